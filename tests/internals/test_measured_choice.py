"""implementation=None on a GPU, chosen by measurement (`_heuristics.measured_choice`,
`_registry.choice`, `jax_flash/measured_choices.json`, `python -m jax_flash.bench
--write-choices`).

The rule is a pure function of the call's class, the architecture and the table, so it is
asked here with tables made for the test; the registry's order is checked with the platform
and the architecture stubbed; the bench's writer runs on a recorded GPU run (docs/gpu-runs).
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _heuristics, _registry
from jax_flash._spec import AttentionSpec
from jax_flash.bench import choices

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "gpu-runs" / "2026-12-04-h200-2" / "bench.json"


def _spec(h=128, t=8192, s=8192, causal=False, dtype="bfloat16", **kw):
    base = dict(
        batch=2,
        q_len=t,
        kv_len=s,
        num_heads=16,
        num_kv_heads=16,
        head_dim=h,
        dtype=dtype,
        scale=h**-0.5,
        window_left=None,
        window_right=0 if causal else None,
    )
    base.update(kw)
    return AttentionSpec(**base)


def _entry(times, pass_="fwd", arch="sm_90", **cls):
    c = dict(head_dim=128, causal=False, seq="<=8k", decode=False)
    c.update(cls)
    return {
        "arch": arch,
        "device": "NVIDIA H200",
        "date": "2026-12-04",
        "jax": "0.11.2",
        "source": "test",
        "class": c,
        "pass": pass_,
        "times_ms": times,
    }


def test_shape_class():
    assert _heuristics.shape_class(_spec()) == dict(head_dim=128, causal=False, seq="<=8k", decode=False)
    assert _heuristics.shape_class(_spec(64, t=1, s=40000, causal=True)) == dict(
        head_dim=64, causal=True, seq=">32k", decode=True
    )
    assert _heuristics.shape_class(_spec(s=2048))["seq"] == "<=2k"
    assert _heuristics.shape_class(_spec(s=2049))["seq"] == "<=8k"
    assert _heuristics.shape_class(_spec(t=16))["decode"] and not _heuristics.shape_class(_spec(t=17))["decode"]
    for other in (
        _spec(dtype="float32"),
        _spec(window_left=100, window_right=0),
        _spec(value_head_dim=64),
    ):
        assert _heuristics.shape_class(other) is None


def test_measured_choice_orders_by_time_and_says_why():
    entries = [
        _entry({"cuda": 3.0, "pallas": 2.0, "xla": 6.0}),
        _entry({"cuda": 9.0, "pallas": 12.0}, pass_="fwdbwd"),
        _entry({"cuda": 1.0, "pallas": 5.0}, arch="sm_80"),
    ]
    order, why = _heuristics.measured_choice(_spec(), "sm_90", entries)
    assert order == ("cuda", "pallas")  # the forward+backward cell decides
    assert "NVIDIA H200 (sm_90), 2026-12-04, fwdbwd" in why and "cuda 1.33x faster than pallas" in why
    order, why = _heuristics.measured_choice(_spec(), "sm_90", entries[:1])
    assert order == ("pallas", "cuda", "xla") and "pallas 1.50x faster than cuda" in why
    order, why = _heuristics.measured_choice(_spec(causal=True), "sm_90", entries)
    assert order == () and why.startswith("no measurement for sm_90 at head_dim=128, causal=True")
    assert _heuristics.measured_choice(_spec(), "sm_86", entries)[0] == ()
    assert _heuristics.measured_choice(_spec(), None, entries) == ((), "not on a GPU: the platform's default order")
    order, why = _heuristics.measured_choice(_spec(dtype="float32"), "sm_90", entries)
    assert order == () and "no measured class" in why
    # The bench's peers are not implementations: only cuda, pallas and xla count.
    order, _ = _heuristics.measured_choice(_spec(), "sm_90", [_entry({"jax.nn": 0.1, "cuda": 3.0, "xla": 2.0})])
    assert order == ("xla", "cuda")


def test_registry_tries_the_measured_order_first(monkeypatch):
    """On a GPU the measured order goes before the default one; without a measurement the
    default stands. (The platform and architecture are stubbed: cuda cannot run here, so the
    default order's first choice that can is pallas.)"""
    monkeypatch.setattr(_registry, "platform", lambda: "gpu")
    monkeypatch.setattr(_registry, "device_arch", lambda: "sm_90")
    spec = _spec(h=64, t=256, s=256)
    monkeypatch.setattr(_registry, "_measured_entries", lambda: ())
    assert _registry.choice(spec)[0] == ("cuda", "pallas", "xla")
    assert _registry.select(spec, None) == "pallas"
    fast_xla = (_entry({"xla": 1.0, "pallas": 2.0, "cuda": 3.0}, head_dim=64, seq="<=2k"),)
    monkeypatch.setattr(_registry, "_measured_entries", lambda: fast_xla)
    assert _registry.choice(spec)[0] == ("xla", "pallas", "cuda")
    assert _registry.select(spec, None) == "xla"
    assert _registry.select(spec, "pallas") == "pallas"  # asked by name: no rule


def test_explain_names_the_measurement(monkeypatch):
    q = jnp.ones((1, 32, 2, 64), jnp.bfloat16)
    """The selected implementation's details (verbose) say what the order rests on."""
    e = jax_flash.explain(q, q, q, verbose=True)
    assert "chosen by: not on a GPU: the platform's default order" in e.notes[e.selected], e.notes
    assert "chosen by" not in str(jax_flash.explain(q, q, q))
    assert "chosen by" not in str(jax_flash.explain(q, q, q, verbose=True, implementation="xla"))
    monkeypatch.setattr(_registry, "device_arch", lambda: "sm_90")
    entry = (_entry({"xla": 1.0, "cpu": 0.5}, head_dim=64, seq="<=2k"),)
    monkeypatch.setattr(_registry, "_measured_entries", lambda: entry)
    e = jax_flash.explain(q, q, q, verbose=True)
    want = "chosen by: measured on NVIDIA H200 (sm_90), 2026-12-04, fwd H=64 full S <=2k: xla alone measured"
    assert e.selected == "xla" and want in e.notes["xla"], e.notes


def test_the_shipped_table_loads():
    entries = _heuristics.load_measured_choices()
    for e in entries:
        assert set(e) == {"arch", "device", "date", "jax", "source", "class", "pass", "times_ms"}, e


@pytest.mark.skipif(not RUN.exists(), reason="the recorded GPU run is not in this tree")
def test_bench_writes_the_measured_table(tmp_path):
    data = json.loads(RUN.read_text())
    assert choices.entries_from_bench(data) == []  # that run did not record its architecture
    data["environment"]["arch"] = "sm_90"
    entries = choices.entries_from_bench(data)
    classes = {(e["class"]["head_dim"], e["class"]["causal"], e["pass"]) for e in entries if not e["class"]["decode"]}
    assert classes == {(h, c, p) for h in (64, 128) for c in (False, True) for p in ("fwd", "fwdbwd")}
    for e in entries:
        assert set(e["times_ms"]) <= set(_heuristics.MEASURED_IMPLEMENTATIONS) and len(e["times_ms"]) > 1
    cell = next(e for e in entries if e["class"]["head_dim"] == 128 and not e["class"]["causal"] and e["pass"] == "fwd")
    assert cell["class"]["seq"] == "<=8k" and cell["date"] == "2026-12-04"
    # Written, read back by the rule's loader, and merged: a new run replaces its cells only.
    out = tmp_path / "measured.json"
    out.write_text(choices.dumps(choices.merge([], entries)))
    assert _heuristics.load_measured_choices(out) == choices.merge([], entries)
    faster = dict(cell, times_ms={"cuda": 0.1, "pallas": 9.0})
    merged = choices.merge(_heuristics.load_measured_choices(out), [faster])
    assert len(merged) == len(entries) and faster in merged and cell not in merged
    order, _ = _heuristics.measured_choice(_spec(), "sm_90", merged)
    assert order[0] in ("cuda", "pallas")

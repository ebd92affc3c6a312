"""`python -m jax_flash.bench --write-choices BENCH_JSON [BENCH_JSON ...] [--out PATH]`: a GPU
run's results into the measured table that `implementation=None` reads on a GPU
(`jax_flash/measured_choices.json`, `_heuristics.measured_choice`).

Each cell of a bench.json (the attention table: one implementation, pass, causal or not, head
dim, T = S; its `decode` section: one decode step over a long cache) becomes part of an entry
for its architecture, shape class (`_heuristics.shape_class`) and pass, holding every measured
implementation's time; an entry of the same architecture, class and pass already in the table
is replaced, the others are kept. Runs without an architecture (not an NVIDIA GPU) and cells
that did not run are left out. Run it on the bench.json a `build/device_check.sh` run brings back.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from jax_flash import _heuristics

TABLE = pathlib.Path(_heuristics.__file__).with_name(_heuristics.MEASURED_CHOICES_FILE)
DECODE_HEAD_DIM = 128  # the decode section's head dim where a run did not record it (2026-12-04)


def entries_from_bench(data: dict) -> list[dict]:
    """The measured-table entries of one bench.json (its environment says the device)."""
    env = data["environment"]
    arch = env.get("arch")
    if not arch:
        return []
    cells: dict[tuple, dict[str, Any]] = {}

    def add(cls: dict, pass_: str, impl: str, time_s: float | None):
        ours = (*_heuristics.MEASURED_IMPLEMENTATIONS, _heuristics.MEASURED_PALLAS_MOSAIC)
        if impl not in ours or not time_s:
            return
        key = (json.dumps(cls, sort_keys=True), pass_)
        entry = cells.setdefault(
            key,
            dict(
                arch=arch,
                device=env["device"],
                date=env["date"][:10],
                jax=env["jax"],
                source=f"jax_flash {env['jax_flash']} bench",
                **{"class": cls},
                **{"pass": pass_},
                times_ms={},
            ),
        )
        entry["times_ms"][impl] = round(time_s * 1e3, 4)

    for r in data.get("results", []):
        if r.get("status") != "ok" or r.get("dtype") not in ("bfloat16", "float16") or r.get("bias", "none") != "none":
            continue
        cls = dict(
            head_dim=r["head_dim"],
            causal=bool(r["causal"]),
            seq=_heuristics.seq_bucket(r["seq_len"]),
            decode=False,
        )
        add(cls, r["pass"], r["impl"], r.get("time_s"))
    decode = data.get("decode") or {}
    for r in decode.get("results", []) if isinstance(decode, dict) else []:
        if r.get("status") != "ok":
            continue
        head_dim = (decode.get("shape") or {}).get("head_dim", DECODE_HEAD_DIM)
        cls = dict(head_dim=head_dim, causal=False, seq=_heuristics.seq_bucket(r["seq_len"]), decode=True)
        add(cls, "fwd", r["impl"], r.get("time_s"))
    return [e for e in cells.values() if len(e["times_ms"]) > 1]


def merge(table: list[dict], new: list[dict]) -> list[dict]:
    """`table` with the entries of the same (arch, class, pass) as one in `new` replaced."""
    key = lambda e: (e["arch"], json.dumps(e["class"], sort_keys=True), e["pass"])
    fresh = {key(e) for e in new}
    kept = [e for e in table if key(e) not in fresh]
    return sorted(kept + new, key=key)


def dumps(entries: list[dict]) -> str:
    lines = ["    " + json.dumps(e, sort_keys=True) for e in entries]
    return '{\n  "entries": [\n' + ",\n".join(lines) + ("\n" if lines else "") + "  ]\n}\n"


def main(argv) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m jax_flash.bench --write-choices", description=__doc__.splitlines()[0])
    p.add_argument("--write-choices", nargs="+", required=True, metavar="BENCH_JSON")
    p.add_argument("--out", default=str(TABLE), help="the table to update (default: the package's)")
    args = p.parse_args(argv)
    new: list[dict] = []
    for path in args.write_choices:
        new += entries_from_bench(json.loads(pathlib.Path(path).read_text()))
    out = pathlib.Path(args.out)
    table = json.loads(out.read_text())["entries"] if out.exists() else []
    entries = merge(table, new)
    out.write_text(dumps(entries))
    print(f"wrote {out}: {len(new)} entries from {len(args.write_choices)} run(s), {len(entries)} in all")
    return entries

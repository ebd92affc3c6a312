"""Smoke test of `python -m jax_flash.bench` on a tiny configuration."""

import json
import subprocess
import sys

import pytest

from jax_flash import bench


def test_bench_tiny_run_writes_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    json_path = tmp_path / "bench.json"
    png_path = tmp_path / "bench.png"
    results = bench.main(
        [
            "--seq-lens",
            "128",
            "--head-dims",
            "32",
            "--heads",
            "2",
            "--reps",
            "1",
            "--json",
            str(json_path),
            "--plot",
            str(png_path),
        ]
    )
    out = capsys.readouterr().out
    assert "GFLOP/s" in out or "TFLOP/s" in out
    assert "x jax.nn" in out and "temp MiB" in out
    impls = {r.impl for r in results}
    assert {"xla", "jax.nn"} <= impls
    # 2 passes x 2 causal settings per implementation.
    assert len(results) == 4 * len(impls)
    for r in results:
        assert r.status == "ok", (r.impl, r.status)
        # torch (a peer measured outside XLA, when it imports) has no compiled temp memory.
        assert r.flops_per_s > 0 and (r.temp_bytes is not None or r.impl == "torch")
        assert r.vs_jax_nn is not None
    causal_fwd = next(r for r in results if r.causal and r.pass_ == "fwd")
    full_fwd = next(r for r in results if not r.causal and r.pass_ == "fwd")
    assert causal_fwd.flops == full_fwd.flops / 2
    full_fwdbwd = next(r for r in results if not r.causal and r.pass_ == "fwdbwd")
    # forward 4·B·N·T·S·H; forward+backward counts the backward's five products too: 3.5x.
    b, n, t, h = full_fwd.batch, full_fwd.heads, full_fwd.seq_len, full_fwd.head_dim
    assert full_fwd.flops == 4 * b * n * t * t * h
    assert full_fwdbwd.flops == 3.5 * full_fwd.flops
    data = json.loads(json_path.read_text())
    assert len(data["results"]) == len(results)
    assert {"pass", "causal", "temp_bytes", "flops_per_s", "vs_jax_nn"} <= set(data["results"][0])
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_reports_failing_peer_without_crashing(capsys):
    # cuDNN attention cannot run on a CPU: the row says so and the run completes.
    results = bench.main(
        [
            "--impls",
            "jax.nn-cudnn,xla",
            "--seq-lens",
            "64",
            "--head-dims",
            "16",
            "--heads",
            "1",
            "--passes",
            "fwd",
            "--causal",
            "no",
            "--reps",
            "1",
        ]
    )
    by_impl = {r.impl: r for r in results}
    assert by_impl["xla"].status == "ok"
    import jax

    if jax.default_backend() == "cpu":
        assert by_impl["jax.nn-cudnn"].status.startswith("failed")
    assert "jax.nn-cudnn" in capsys.readouterr().out


def test_bench_temp_memory_limit_skips():
    results = bench.main(
        [
            "--impls",
            "xla",
            "--seq-lens",
            "64",
            "--head-dims",
            "16",
            "--heads",
            "1",
            "--passes",
            "fwd",
            "--causal",
            "no",
            "--max-temp-gib",
            "0",
        ]
    )
    assert results[0].status.startswith("skipped")


def test_bench_module_entry_point_help():
    out = subprocess.run(
        [sys.executable, "-m", "jax_flash.bench", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--tune-pallas" in out and "--json" in out


def test_bench_time_budget_cuts_cases_and_json_says_so(tmp_path, capsys):
    # A budget already spent: no case starts, every cell is reported as cut, and the JSON
    # (rewritten after every case) is complete and counts them.
    json_path = tmp_path / "bench.json"
    results = bench.main(
        [
            "--impls",
            "xla,jax.nn",
            "--seq-lens",
            "64",
            "--head-dims",
            "16",
            "--heads",
            "1",
            "--passes",
            "both",
            "--causal",
            "no",
            "--time-budget",
            "0",
            "--json",
            str(json_path),
        ]
    )
    assert len(results) == 4 and all(r.status == bench.CUT and r.time_s is None for r in results)
    assert all(r.flops > 0 for r in results)
    data = json.loads(json_path.read_text())
    assert data["complete"] is True and data["counts"]["cut"] == 4 and data["counts"]["ok"] == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("bench: 0 of 4 cells measured, 4 cut")


def test_bench_time_budget_not_reached_measures_everything(tmp_path):
    json_path = tmp_path / "bench.json"
    results = bench.main(
        [
            "--impls",
            "xla",
            "--seq-lens",
            "64",
            "--head-dims",
            "16",
            "--heads",
            "1",
            "--passes",
            "fwd",
            "--causal",
            "both",
            "--reps",
            "1",
            "--time-budget",
            "600",
            "--json",
            str(json_path),
        ]
    )
    assert [r.status for r in results] == ["ok", "ok"] and all(r.compile_s > 0 for r in results)
    assert json.loads(json_path.read_text())["counts"] == {"ok": 2, "failed": 0, "OOM": 0, "skipped": 0, "cut": 0}


def test_bench_plot_without_matplotlib_fails_before_measuring(monkeypatch, capsys):
    # --plot is checked before any case runs: a missing matplotlib must not cost the run.
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    measured = []
    monkeypatch.setattr(bench.attention, "measure_case", lambda *a, **k: measured.append(a) or [])
    with pytest.raises(SystemExit) as e:
        bench.main(["--impls", "xla", "--seq-lens", "16", "--plot", "x.png"])
    assert ".[bench]" in str(e.value.code) and "matplotlib" in str(e.value.code)
    assert not measured


def test_bench_torch_peer_and_cpu_peak(capsys):
    """torch's CPU SDPA in the same table (when it imports), with the ratios to it, the
    fraction of the CPU's peak and the core probe; without torch the run says why it is not
    measured."""
    results = bench.main(
        [
            "--impls",
            "cpu,jax.nn,torch",
            "--seq-lens",
            "128",
            "--head-dims",
            "32",
            "--heads",
            "2",
            "--reps",
            "1",
            "--causal",
            "yes",
            "--dtype",
            "bfloat16",
        ]
    )
    out = capsys.readouterr().out
    assert "x torch" in out and "% peak" in out
    by_impl = {(r.impl, r.pass_): r for r in results}
    torch_ok = bench.torch_unavailable(on_gpu=False) is None
    for pass_ in ("fwd", "fwdbwd"):
        cpu, torch_row = by_impl[("cpu", pass_)], by_impl[("torch", pass_)]
        assert cpu.status == "ok"
        if torch_ok:
            assert torch_row.status == "ok" and torch_row.vs_torch == 1.0
            assert cpu.vs_torch is not None and cpu.vs_torch > 0
        else:
            assert torch_row.status.startswith("failed")
    peaks = bench.cpu_peaks()
    if peaks:  # Linux x86-64
        # A clock no x86-64 core reaches (above 7 GHz) is a probe the core folded away.
        assert "CPU peak" in out and 0.5 < peaks["clock_ghz"] < 7.0
        assert peaks["bfloat16"][1] >= peaks["float32"][1] > 0
        assert 0 < by_impl[("cpu", "fwd")].peak_fraction < 1
        # Whether the threads had a core each: one probe per case, the same for every peer.
        assert "cores" in out
        shares = {r.core_share for r in results if r.pass_ == "fwd"}
        assert len(shares) == 1 and 0.2 < shares.pop() < 1.5


def test_bench_decode_tiny_run(tmp_path, capsys):
    json_path = tmp_path / "decode.json"
    results = bench.main(
        [
            "--decode",
            "--batch",
            "1,2",
            "--seq-lens",
            "300",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "32",
            "--page-size",
            "16",
            "--reps",
            "1",
            "--json",
            str(json_path),
        ]
    )
    out = capsys.readouterr().out
    assert "GB/s" in out and "x jax.nn" in out and "memory bandwidth" in out
    impls = {r["impl"] for r in results}
    assert {"jax.nn", "xla", "xla-split", "xla-unsplit", "paged-xla"} <= impls
    assert len(results) == 2 * len(impls)
    for r in results:
        assert r["status"] == "ok", r
        assert r["kv_bytes"] == 2 * r["batch"] * 300 * 2 * 32 * 4
        assert r["kv_bytes_per_s"] > 0 and r["peak_fraction"] > 0
        assert (r["vs_jax_nn"] is None) == (r["impl"] == "copy")
    import jax

    if jax.default_backend() == "cpu":  # the copy bandwidth of the same cell is the peak
        for r in results:
            copy = next(c for c in results if c["impl"] == "copy" and c["batch"] == r["batch"])
            assert r["peak_bytes_per_s"] == copy["kv_bytes_per_s"]
    data = json.loads(json_path.read_text())
    assert len(data["results"]) == len(results)


def test_bench_decode_skips_caches_over_the_memory_cap(capsys):
    results = bench.main(
        [
            "--decode",
            "--batch",
            "1",
            "--seq-lens",
            "4k",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "16",
            "--max-cache-gib",
            "0.0001",
        ]
    )
    assert results and all(r["status"].startswith("skipped: K+V") for r in results)


def test_bench_dense_bias_cases(capsys):
    """--bias: the cases run with a dense bias (differentiated in fwdbwd) against jax.nn with
    the same bias; torch is skipped with the reason."""
    results = bench.main(
        [
            "--impls",
            "cpu,jax.nn",
            "--seq-lens",
            "130",
            "--head-dims",
            "16",
            "--heads",
            "2",
            "--passes",
            "fwdbwd",
            "--causal",
            "yes",
            "--reps",
            "1",
            "--bias",
            "t5,keys",
        ]
    )
    assert {(r.impl, r.bias) for r in results} == {(i, b) for i in ("cpu", "jax.nn") for b in ("t5", "keys")}
    for r in results:
        assert r.status == "ok", (r.impl, r.bias, r.status)
        assert r.vs_jax_nn is not None
    assert "t5" in capsys.readouterr().out
    assert bench.bias_shape("t5", 2, 8, 64) == (1, 8, 64, 64)
    assert bench.bias_shape("alibi", 2, 8, 64) == (1, 8, 1, 64)
    assert bench.bias_shape("keys", 2, 8, 64) == (2, 1, 1, 64)
    with pytest.raises(SystemExit):
        bench.parse_args(["--bias", "rope"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_bench_peak_memory_runs_each_cell_in_its_own_process(capsys):
    """--peak-memory: one process per (implementation, case); the peak during the call is at
    least what was resident before it, and the table row carries both."""
    rows = bench.main(
        [
            "--peak-memory",
            "--impls",
            "cpu",
            "--seq-lens",
            "256",
            "--head-dims",
            "32",
            "--causal",
            "yes",
            "--passes",
            "fwdbwd",
        ]
    )
    assert len(rows) == 1 and rows[0]["impl"] == "cpu", rows
    row = rows[0]
    assert row["peak_mib"] >= row["before_mib"] > 0 and row["call_mib"] >= 0, row
    assert "| cpu | float32 | 32 | 256 | yes | fwdbwd |" in capsys.readouterr().out


def test_bench_flex_tiny_run(tmp_path, capsys):
    import numpy as np

    from jax_flash.bench import flex

    json_path = tmp_path / "flex.json"
    t, block = 512, 32
    results = bench.main(
        [
            "--flex",
            "--seq-len",
            str(t),
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--block-size",
            str(block),
            "--window",
            "64",
            "--prefix",
            "32",
            "--reps",
            "1",
            "--json",
            str(json_path),
        ]
    )
    out = capsys.readouterr().out
    assert "x built-in" in out and "x jax.nn" in out and "temp MiB" in out and "blocks" in out
    assert "no built-in prefix" in out  # the window row says it is not the same mask
    # Every (mask, row, pass) once, all measured.
    cells = {(r["pattern"], r["row"], r["pass"]) for r in results}
    assert cells == {(m, r, p) for m in flex.PATTERNS for r in flex.ROWS for p in flex.PASSES}
    assert len(results) == len(cells)
    for r in results:
        assert r["status"] == "ok", r
        assert r["time_s"] > 0 and r["temp_bytes"] is not None
        assert r["vs_builtin"] is not None and r["vs_jax_nn"] is not None
        assert (r["block_fraction"] is not None) == (r["row"] == "flex")
    by = {(r["pattern"], r["row"], r["pass"]): r for r in results}
    for m in flex.PATTERNS:
        for p in flex.PASSES:
            # The row's own peers are 1.
            assert by[m, "built-in", p]["vs_builtin"] == 1.0 and by[m, "jax.nn", p]["vs_jax_nn"] == 1.0
            # flex holds no [T, S] array: less temp memory than the dense mask's and jax.nn's.
            assert by[m, "flex", p]["temp_bytes"] < by[m, "dense mask", p]["temp_bytes"]
            assert by[m, "flex", p]["temp_bytes"] < by[m, "jax.nn", p]["temp_bytes"]
    # The non-empty fraction is the block mask's: recomputed here from the masks' definitions.
    q, kv = np.arange(t)[:, None], np.arange(t)[None, :]
    lengths = by["documents", "flex", "fwd"]["doc_lengths"]
    assert len(lengths) == 16 and sum(lengths) == t
    doc = np.repeat(np.arange(16), lengths)
    masks = {
        "documents": (doc[:, None] == doc[None, :]) & (kv <= q),
        "prefix+window": (kv <= q) & (q - kv < 64) | (kv < 32),
    }
    for m, dense in masks.items():
        tiles = dense.reshape(t // block, block, t // block, block).any(axis=(1, 3))
        assert by[m, "flex", "fwd"]["block_fraction"] == pytest.approx(tiles.mean())
        assert 0 < tiles.mean() < 0.5  # sparse at this size: the check would catch "all blocks"
    data = json.loads(json_path.read_text())
    assert len(data["results"]) == len(results)


def test_bench_flex_skips_dense_rows_over_the_caps(capsys):
    results = bench.main(
        [
            "--flex",
            "--seq-len",
            "256",
            "--heads",
            "1",
            "--head-dim",
            "8",
            "--block-size",
            "64",
            "--patterns",
            "documents",
            "--passes",
            "fwd",
            "--reps",
            "1",
            "--max-mask-gib",
            "0.00001",
        ]
    )
    by = {r["row"]: r for r in results}
    assert by["flex"]["status"] == "ok" and by["built-in"]["status"] == "ok"
    for row in ("dense mask", "jax.nn"):
        assert by[row]["status"].startswith("skipped: [T, S] mask"), by[row]
    assert by["flex"]["vs_jax_nn"] is None and by["flex"]["vs_builtin"] is not None
    assert "skipped: [T, S] mask" in capsys.readouterr().out

"""The examples run end to end (tiny flags, a few steps) as a user runs them."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = [
    "--steps=4",
    "--batch_size=2",
    "--seq_len=16",
    "--d_model=16",
    "--num_heads=2",
    "--num_layers=1",
    "--log_every=2",
]


def _run(script, *flags):
    # As a user runs them: no JAX_PLATFORMS, so JAX probes every backend it knows.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *TINY, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    # The examples print what they ran, not absl's INFO lines about backends that are absent.
    assert "Unable to initialize backend" not in out, out[:2000]
    return out


def test_train_flax_lm_with_compare():
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    out = _run("train_flax_lm.py", "--compare", "--sample_chars=4")
    m = re.search(r"jax_flash implementation: (\w+)", out)
    assert m and m.group(1) in ("cuda", "pallas", "cpu", "xla"), out
    assert "tokens/s" in out
    diff = re.search(r"max abs diff ([0-9.e+-]+)", out)
    assert diff, out
    assert float(diff.group(1)) < 1e-3
    assert "sample:" in out


def test_train_haiku_lm():
    pytest.importorskip("haiku")
    pytest.importorskip("optax")
    out = _run("train_haiku_lm.py", "--implementation=xla")
    assert "jax_flash implementation: xla" in out
    assert re.search(r"loss [0-9.]+ -> [0-9.]+", out), out


def test_context_parallel_matches_one_device():
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    out = _run("context_parallel.py", "--layout=zigzag")
    assert "8 devices" in out, out
    assert "zigzag    : [17, 17, 17, 17, 17, 17, 17, 17]" in out, out
    diff = re.search(r"vs 1 device: max abs diff ([0-9.e+-]+)", out)
    assert diff, out
    assert float(diff.group(1)) < 1e-4


def test_context_parallel_across_processes_matches_one_device():
    """The documented launch, `--processes=2` (here 2 processes x 2 host devices, to keep
    the compile short): the ring across the processes learns what one device learns."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    out = _run("context_parallel.py", "--processes=2", "--devices=4", "--steps=3", "--log_every=1")
    assert "4 devices in 2 processes" in out, out
    diff = re.search(r"4 devices in 2 process\(es\) .* vs 1 device: max abs diff ([0-9.e+-]+)", out)
    assert diff, out
    assert float(diff.group(1)) < 1e-4


def test_generate_flax_lm_paged_cache_matches_full_recomputation():
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    out = _run("generate_flax_lm.py", "--gen_tokens=6", "--page_size=4")
    assert "jax_flash.paged_attention would run: cpu" in out, out  # the host kernels read the pages
    assert re.search(r"paged KV cache: [0-9,]+ tokens/s .*one compiled step \((1|\?) compilation\)", out), out
    assert re.search(r"full recomputation: [0-9,]+ tokens/s", out), out
    assert "tokens equal to greedy generation by full recomputation: True" in out, out

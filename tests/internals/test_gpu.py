"""The GPU correctness pass (`pytest -m gpu`, run by build/device_check.sh): a subset of the
shared suite (tests/contract/test_attention.py, same checks and tolerances) for `implementation="cuda"`
at full size, forward and backward, and the backward in deterministic mode
(JAX_FLASH_DETERMINISTIC=1) with bitwise-equal gradients run to run; and the kernels' second
warp layout (JAX_FLASH_CUDA_LAYOUT=warp32) with the combined mask at every head dim it has its
own kernels for (32, 64, 96), forward and backward; and decoding: decode steps with split-KV and
GQA packing over a contiguous and a paged cache.

Every mask kind the kernels take, every head dim with kernels (32, 64, 96, 128, 192, 256) and
both dtypes appear, each (head dim, dtype) pair with the combined mask, and so do the value head
dims Hv != H with kernels ((192, 128), (128, 64)), also in deterministic mode; T and S are ≡ −1 or +1
modulo every tile size of the kernels (16, 32, 64, 128), so partial tiles, the ring wrap and
the interior test meet their edges.

Where the tests run:
- on a GPU: full size, against the compiled kernels;
- JAX_FLASH_GPU_SUITE=emulated on the CPU backend (`build/device_check.sh --dry-run`): small
  shapes with the same residues, against the emulated kernels;
- elsewhere they skip. `-m gpu` fails when no gpu test passed (tests/conftest.py), so a GPU
  run in which nothing ran cannot count as a pass.

Without pytest: `python tests/internals/test_gpu.py [-k SUBSTRING]` runs the same checks (exit status
0 when all that ran passed, 1 on a failure, 5 when none passed).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # run as a script: the package of this tree and tests/, as under pytest
    sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]
# The shared suite this runs a subset of (tests/contract/test_attention.py), also when this file is
# collected alone.
if os.path.join(_TESTS, "contract") not in sys.path:
    sys.path.append(os.path.join(_TESTS, "contract"))

# jax and what it imports first: they look for pytest, and must not find the stand-in below.
import jax  # noqa: E402, F401

import cases  # noqa: E402

try:
    import pytest
except ImportError:  # the runner at the bottom works without pytest
    pytest = None

if pytest is None:
    # A stand-in with what conftest and test_attention use, seen by those two imports only
    # (other libraries look for pytest too, and must not find this).
    import types

    class _Skipped(Exception):
        pass

    def _skip(reason=""):
        raise _Skipped(reason)

    def _decorator(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    class _Decorators(types.ModuleType):
        """Any other attribute (pytest.fixture, .hookimpl, .mark.*) is a no-op decorator."""

        def __getattr__(self, name):
            return _decorator

    pytest = _Decorators("pytest")
    pytest.skip = _skip
    pytest.skip.Exception = _Skipped
    pytest.param = lambda *values, **kwargs: values
    pytest.UsageError = RuntimeError
    pytest.mark = _Decorators("pytest.mark")
    sys.modules["pytest"] = pytest
    try:
        import conftest
        import test_attention as suite
    finally:
        del sys.modules["pytest"]
else:
    import conftest
    import test_attention as suite

EMULATED = os.environ.get("JAX_FLASH_GPU_SUITE", "") == "emulated"
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# (H, Hv) with a narrower value head dim (jax_flash.cuda.NARROW_VALUE_PAIRS).
NARROW_VALUE_PAIRS = ((192, 128), (128, 64))
DTYPES = ("bfloat16", "float16")
# The mask kinds of the suite that the cuda kernels take (no dense bias or mask): window and
# length edges at +1/-1 of the tile boundaries, scales that are not positive, query offsets.
KINDS = ("none", "causal", "window", "window_causal", "lengths", "segments", "softcap", "combo",
         "all_masked", "tile_window", "tile_window_wide", "tile_lengths", "zero_scale",
         "negative_scale") + cases.OFFSET_KINDS


def _shapes(h: int, hv=None) -> dict:
    if EMULATED:  # the emulation is slow: still several tiles, same residues mod 16 and 64
        return {"ragged": cases.Shape(1, 63, 129, 2, 1, h, hv), "tall": cases.Shape(1, 65, 31, 2, 2, h, hv)}
    return {
        # T ≡ −1 and S ≡ +1 modulo 16, 32, 64 and 128; GQA.
        "ragged": cases.Shape(2, 255, 1025, 4, 2, h, hv),
        # T > S, T ≡ +1 and S ≡ −1; MQA.
        "tall": cases.Shape(1, 513, 127, 4, 1, h, hv),
    }


@dataclasses.dataclass(frozen=True)
class GpuCase(cases.Case):
    """A case of the shared suite with its own shape."""

    gpu_shape: cases.Shape = None

    @property
    def shape(self) -> cases.Shape:
        return self.gpu_shape

    def __str__(self):
        hv = "" if self.gpu_shape.hv is None else f"Hv{self.gpu_shape.hv}"
        return f"{self.shape_name}-{self.mask_kind}-{self.dtype}-H{self.gpu_shape.h}{hv}"


def _case(shape_name: str, kind: str, dtype: str, h: int, hv=None) -> GpuCase:
    return GpuCase(shape_name, kind, dtype, EMULATED, gpu_shape=_shapes(h, hv)[shape_name])


def _cases() -> list[GpuCase]:
    out = []
    # Each mask kind once, cycling through head dims and dtypes so that every pair appears.
    for i, kind in enumerate(KINDS):
        h, dtype = HEAD_DIMS[i % len(HEAD_DIMS)], DTYPES[(i + i // len(HEAD_DIMS)) % 2]
        out.append(_case("tall" if i % 3 == 1 else "ragged", kind, dtype, h))
    # The combined mask (causal, soft cap, lengths, segments) for every instantiation.
    for h in HEAD_DIMS:
        for dtype in DTYPES:
            out.append(_case("ragged", "combo", dtype, h))
    # Hv != H: the combined mask in both dtypes, and a window on the MQA shape.
    for h, hv in NARROW_VALUE_PAIRS:
        for dtype in DTYPES:
            out.append(_case("ragged", "combo", dtype, h, hv))
        out.append(_case("tall", "window", "bfloat16", h, hv))
    return list(dict.fromkeys(out))


CASES = _cases()
# Deterministic mode: the dQ kernel of every head dim, both dtypes, causal and lengths.
DETERMINISTIC = [_case("ragged", ("causal", "lengths")[i % 2], DTYPES[i % 2], h) for i, h in enumerate(HEAD_DIMS)] + [
    _case("ragged", "lengths", DTYPES[i % 2], h, hv) for i, (h, hv) in enumerate(NARROW_VALUE_PAIRS)]
# JAX_FLASH_CUDA_LAYOUT=warp32: the head dims whose forward or backward has a kernel of that
# layout (build/generate_kernels.py), the combined mask, both dtypes.
WARP32 = [_case("ragged", "combo", DTYPES[i % 2], h) for i, h in enumerate((32, 64, 96))]


def _impl() -> str:
    """'cuda' where this pass runs, else skip."""
    if not conftest.on_gpu() and not EMULATED:
        pytest.skip("needs a GPU (or JAX_FLASH_GPU_SUITE=emulated on the CPU)")
    why = conftest.availability("cuda")
    if why is not None:
        pytest.skip(f"cuda unavailable here: {why}")
    return "cuda"


class _Env:
    """monkeypatch.setenv and its undo, with or without pytest."""

    def __init__(self):
        self.saved = {}

    def setenv(self, name, value):
        self.saved.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    def undo(self):
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_forward_backward(case):
    suite.check_attention(_impl(), case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", DETERMINISTIC, ids=str)
def test_gpu_backward_deterministic(case):
    # The suite's check: the mode reaches the call, gradients against the reference, and
    # bitwise equal over two more runs.
    impl, env = _impl(), _Env()
    try:
        suite.test_backward_deterministic(impl, case, env)
    finally:
        env.undo()


def _with_layout(fn, case):
    impl, env = _impl(), _Env()
    env.setenv("JAX_FLASH_CUDA_LAYOUT", "warp32")
    try:
        fn(impl, case)
    finally:
        env.undo()


@pytest.mark.gpu
@pytest.mark.parametrize("case", WARP32, ids=str)
def test_gpu_forward_backward_warp32(case):
    _with_layout(suite.check_attention, case)


# Decoding (cuda/README.md, "Split-KV and GQA packing"): a decode step over a contiguous cache
# with the rule's split-KV (B·K = 16 CTAs, fewer than any GPU's SMs) and GQA packing (T = 1,
# G = 4), sinks, ragged lengths with a 0; T = 4 (unpacked, split); against the reference as in
# the shared suite. Emulated: S = 300.
DECODE = [(2, 1, 8, 2, 64), (2, 1, 32, 8, 128), (1, 4, 16, 4, 128)]  # (B, T, N, K, H)


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE, ids=str)
def test_gpu_decode(case):
    import jax.numpy as jnp
    import numpy as np

    import jax_flash

    impl = _impl()
    b, t, n, kh, h = case
    s = 300 if EMULATED else 5000
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)) + 0.1, jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(b, s, kh, h)) - 0.1, jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(b, s, kh, h)) + 0.2, jnp.bfloat16)
    lengths = jnp.asarray([s, 0, 1234 % s][:b], jnp.int32)
    kw = dict(is_causal=True, key_value_seq_lengths=lengths, query_offset=lengths - t,
              sinks=jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32))
    note = jax_flash.explain(q, k, v, implementation=impl, **kw).notes[impl]
    assert "split-KV into" in note and ("GQA packing" in note) == (t == 1), note
    out, lse = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation=impl, return_residual=True,
                                                           **kw))(q, k, v)
    ref = {dt: jax.jit(lambda q, k, v, dt=dt: jax_flash.reference(q, k, v, return_residual=True,
                                                                  compute_dtype=dt, **kw))(q, k, v)
           for dt in (jnp.float64, None)}
    err = lambda a, r: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(r, np.float64))))
    tol = cases.FACTOR * err(ref[None][0], ref[jnp.float64][0]) + cases.EPS["bfloat16"]
    assert err(out, ref[jnp.float64][0]) <= tol
    assert err(lse, ref[jnp.float64][1]) <= 1e-3
    if b > 1:
        assert np.all(np.asarray(out, np.float32)[1] == 0)  # length 0: out exactly 0


# The paged forward: the same decode step over a paged cache (pages shuffled, NaN in the
# unused ones), page sizes 16 (four pages per key tile) and 48 (no power of two).
PAGED = [(2, 1, 8, 2, 64, 16), (2, 3, 32, 8, 128, 48)]  # (B, T, N, K, H, page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PAGED, ids=str)
def test_gpu_paged(case):
    import jax.numpy as jnp
    import numpy as np

    import jax_flash

    impl = _impl()
    b, t, n, kh, h, ps = case
    pages = -(-(300 if EMULATED else 5000) // ps)
    rng = np.random.default_rng(12)
    num_pages = b * pages + 2
    kp = rng.normal(size=(num_pages, ps, kh, h)) - 0.1
    vp = rng.normal(size=(num_pages, ps, kh, h)) + 0.2
    table = rng.permutation(num_pages)[: b * pages].reshape(b, pages)
    unused = np.setdiff1d(np.arange(num_pages), table)
    kp[unused], vp[unused] = np.nan, np.nan
    kp, vp = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16)
    table = jnp.asarray(table, jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)) + 0.1, jnp.bfloat16)
    lengths = jnp.asarray([pages * ps, 77][:b], jnp.int32)
    kw = dict(sinks=jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32))
    note = jax_flash.explain_paged(q, kp, vp, table, lengths, implementation=impl, **kw).notes[impl]
    assert "read through the table" in note, note
    out, lse = jax.jit(lambda *a: jax_flash.paged_attention(*a, implementation=impl, return_residual=True, **kw))(
        q, kp, vp, table, lengths)
    ref = {dt: jax.jit(lambda *a, dt=dt: jax_flash.paged_reference(*a, return_residual=True, compute_dtype=dt,
                                                                   **kw))(q, kp, vp, table, lengths)
           for dt in (jnp.float64, None)}
    err = lambda a, r: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(r, np.float64))))
    tol = cases.FACTOR * err(ref[None][0], ref[jnp.float64][0]) + cases.EPS["bfloat16"]
    assert err(out, ref[jnp.float64][0]) <= tol
    assert err(lse, ref[jnp.float64][1]) <= 1e-3


# ----------------------------------------------------------------------------- without pytest


def _all_tests():
    for fn, params in ((test_gpu_forward_backward, CASES), (test_gpu_backward_deterministic, DETERMINISTIC),
                       (test_gpu_forward_backward_warp32, WARP32), (test_gpu_decode, DECODE),
                       (test_gpu_paged, PAGED)):
        for case in params:
            yield f"{fn.__name__}[{case}]", fn, case


def main(argv: list[str]) -> int:
    pattern = argv[argv.index("-k") + 1] if "-k" in argv else ""
    required = [n for n in os.environ.get("JAX_FLASH_REQUIRE", "").split(",") if n]
    for name in required:
        why = conftest.availability(name)
        if why is not None:
            print(f"JAX_FLASH_REQUIRE lists {name!r}, which cannot run: {why}")
            return 4
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    start = time.monotonic()
    for name, fn, case in _all_tests():
        if pattern not in name:
            continue
        t0 = time.monotonic()
        try:
            fn(case)
            outcome, detail = "passed", ""
        except pytest.skip.Exception as e:
            outcome, detail = "skipped", f" ({e})"
        except Exception:  # noqa: BLE001 - reported, and the run goes on
            outcome, detail = "failed", "\n" + traceback.format_exc()
        counts[outcome] += 1
        print(f"{name} {outcome.upper()} {time.monotonic() - t0:.1f}s{detail}", flush=True)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    print(f"== {summary or 'no tests ran'} in {time.monotonic() - start:.1f}s ==")
    if counts["failed"]:
        return 1
    return 0 if counts["passed"] else 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

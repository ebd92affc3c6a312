"""Shared fixtures: which implementations run here, and how big their test shapes may be.

Every implementation runs through the same tests (tests/contract/test_attention.py). On a CPU
machine that means: `xla`, `cpu` (the C++ kernels), `pallas` in interpret mode and `cuda`
emulated on the host (JAX_FLASH_EMULATE_CUDA=1); on a GPU: `xla`, `cuda`, `pallas`.

JAX_FLASH_REQUIRE=xla,cpu,... makes the run fail (instead of skip) when one of the listed
implementations is unavailable, so a broken build cannot pass as "skipped" in CI.

Emulated CUDA kernels run under one thread schedule per test (cuda/emu/README.md): forward,
reverse or shuffle:<seed>, chosen from a hash of the test's id (and JAX_FLASH_EMU_SEED, 0 by
default), so that a run of the suite covers every schedule and a failure reproduces; a failing
test's report names its schedule. An explicit JAX_FLASH_EMU_SCHEDULE applies to every test.
"""

from __future__ import annotations

import os
import tempfile
import zlib

import jax

# One persistent compilation cache for the run's workers: the same reference programs are
# compiled for every implementation's copy of a case, and each worker meets the others'
# programs. The cache keys on the program (HLO), so a changed program is compiled afresh, and
# the kernels behind a custom call are the loaded extension's. Set here, not in the
# environment: the subprocesses of the multi-device tests, which check what partitioning does
# at compile time, compile everything themselves. JAX_FLASH_TEST_COMPILATION_CACHE=0 turns
# it off; =<dir> puts it elsewhere.
_cache = os.environ.get("JAX_FLASH_TEST_COMPILATION_CACHE",
                        os.path.join(tempfile.gettempdir(), f"jax_flash_test_cache_{os.getuid()}"))
if _cache != "0":
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

jax.config.update("jax_enable_x64", True)  # float64 references and check_grads

if jax.default_backend() == "cpu":
    # implementation="cuda" runs the CUDA kernels' source against the host emulation.
    os.environ.setdefault("JAX_FLASH_EMULATE_CUDA", "1")
# Handlers fill their outputs with NaN before computing, so unwritten elements show up.
os.environ.setdefault("JAX_FLASH_POISON_OUTPUTS", "1")

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

import jax_flash  # noqa: E402
from jax_flash import _registry  # noqa: E402

ALL = ("xla", "cpu", "pallas", "cuda")


def pytest_addoption(parser):
    group = parser.getgroup("jax_flash property suite (tests/contract/test_property.py)")
    group.addoption("--property-examples", default=None,
                    help="examples per implementation: N, or xla:N,cpu:N,cuda:N,pallas:N (env "
                         "JAX_FLASH_PROPERTY_EXAMPLES; default: the CI budget)")
    group.addoption("--property-example", default=None,
                    help="run only this example, e.g. cuda-17 (what a failure's message names)")
    group.addoption("--property-seed", default=None,
                    help="the seed of the drawn examples (env JAX_FLASH_PROPERTY_SEED, default 0)")


def on_gpu() -> bool:
    return _registry.platform() == "gpu"


def slow_impl(name: str) -> bool:
    """Interpreted / emulated runs: small shapes only."""
    return not on_gpu() and name in ("pallas", "cuda")


def availability(name: str):
    """None if `name` loads and runs on this platform, else the reason."""
    probe = jnp.zeros((1, 8, 2, 64), jnp.bfloat16 if name == "cuda" else jnp.float32)
    return jax_flash.explain(probe, probe, probe, implementation=name).reasons[name]


_REQUIRED = [n for n in os.environ.get("JAX_FLASH_REQUIRE", "").split(",") if n]
_USER_SCHEDULE = os.environ.get("JAX_FLASH_EMU_SCHEDULE")
_RUN_SEED = os.environ.get("JAX_FLASH_EMU_SEED", "0")


def emu_schedule(nodeid: str) -> str:
    """The emulation's schedule for one test: forward, reverse or a seeded shuffle."""
    h = zlib.crc32(f"{_RUN_SEED}:{nodeid}".encode())
    kind = h % 4
    return "forward" if kind == 0 else "reverse" if kind == 1 else f"shuffle:{h >> 2}"


@pytest.fixture(autouse=True)
def _emulated_schedule(request):
    schedule = _USER_SCHEDULE or emu_schedule(request.node.nodeid)
    os.environ["JAX_FLASH_EMU_SCHEDULE"] = schedule
    request.node.user_properties.append(("emu_schedule", schedule))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        schedule = dict(item.user_properties).get("emu_schedule")
        if schedule is not None:
            report.sections.append(
                ("emulated CUDA schedule", f"JAX_FLASH_EMU_SCHEDULE={schedule} (reproduce with this variable set)"))


# The longest tests (minutes each: scratch builds, ptxas over every kernel, multi-device
# subprocesses) run first, so that no worker is left with one of them at the end of a run.
_LONG_FIRST = ("test_mutation_check.py::test_fast_mutation_check", "test_cuda_static.py::",
               "test_ring.py::test_ring_", "test_sharding.py::test_sharded_under_jit", "test_examples.py::",
               "test_grid.py::test_emulated_grid_decoding")


def pytest_collection_modifyitems(config, items):
    for name in _REQUIRED:
        why = availability(name)
        if why is not None:
            raise pytest.UsageError(f"JAX_FLASH_REQUIRE lists {name!r}, which cannot run: {why}")
    items.sort(key=lambda item: not any(long in item.nodeid for long in _LONG_FIRST))  # stable


@pytest.fixture(params=ALL)
def impl(request):
    name = request.param
    why = availability(name)
    if why is not None:
        pytest.skip(f"{name} unavailable here: {why}")
    return name


# ---- `-m gpu`: the GPU correctness pass (tests/internals/test_gpu.py) must run something -------------
# An expression that selects the gpu marker (not `not gpu`) fails the session when no gpu test
# passed: a GPU run that selected nothing, or skipped everything, is not a pass.
_gpu_passed = 0


def _selects_gpu(config) -> bool:
    import re

    expr = config.getoption("markexpr", "") or ""
    return re.search(r"(?<!not )\bgpu\b", expr) is not None


def pytest_runtest_logreport(report):
    global _gpu_passed
    if report.when == "call" and report.passed and "gpu" in report.keywords:
        _gpu_passed += 1


def pytest_sessionfinish(session, exitstatus):
    if _selects_gpu(session.config) and _gpu_passed == 0:
        print(f"\n-m {session.config.getoption('markexpr')!r}: no gpu test passed "
              f"({session.testscollected} collected); that is a failure")
        if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

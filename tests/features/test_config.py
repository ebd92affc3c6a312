"""Call settings fixed when a call is traced (`jax_flash.Config`, docs/configuration.md).

Precedence (the call's config= > `with jax_flash.config(...)` > JAX_FLASH_* variables >
defaults), validation (a value given in Python at once, naming the field; a bad variable
when a call that uses it is traced, naming the variable), the jit caches' behaviour, and the
point of it all: a program lowered (compiled, or `jax.export`-ed) under one setting runs the
same kernels and gives bitwise the same result after the environment changes, in this
process and in another one, while a call traced afresh under the new environment does not.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _registry
from jax_flash._normalize import canonicalize

ROOT = Path(__file__).resolve().parents[2]

# Every call-setting variable: cleared for each test, so the process's environment (the
# suite's conftest sets JAX_FLASH_POISON_OUTPUTS and JAX_FLASH_EMULATE_CUDA) cannot decide.
VARIABLES = [jax_flash.Config.variable(name) for name in jax_flash.Config.names()]


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _qkv(b=1, t=1, s=4096, n=4, kh=4, h=64, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, kh, h)), dtype)
    v = jnp.asarray(rng.normal(size=(b, s, kh, h)), dtype)
    return q, k, v


def _needs(name: str):
    why = _registry.reason(name, canonicalize(*_qkv(s=16, dtype=jnp.bfloat16)).spec)
    if why is not None:
        pytest.skip(f"{name} cannot run here: {why}")


def _attribute(text: str, name: str) -> list[str]:
    """The values of FFI attribute `name` in a lowered module's text (one per custom call)."""
    return re.findall(rf"\b{name} = ([^,}}\s]+)", text)


# ---- precedence -------------------------------------------------------------------------


def test_defaults(clean_env):
    cfg = jax_flash.current_config()
    assert cfg == jax_flash.Config(
        cpu_isa="",
        cpu_split_kv=0,
        cpu_gradient_chunks=0,
        cuda_layout="warp16",
        cuda_backward_grid="auto",
        cuda_split_kv=0,
        pallas_split_kv=0,
        pallas_backend="auto",
        deterministic=False,
        poison_outputs=False,
        emulate_cuda=False,
        sequence_parallel="auto",
    )
    assert cfg.is_resolved and cfg.env_errors == ()
    assert not jax_flash.Config().is_resolved and jax_flash.Config().set_fields() == {}


def test_precedence_explicit_over_context_over_environment(clean_env):
    clean_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "4")
    clean_env.setenv("JAX_FLASH_CUDA_LAYOUT", "warp32")
    clean_env.setenv("JAX_FLASH_DETERMINISTIC", "1")
    assert jax_flash.current_config().cpu_split_kv == 4  # the variable
    with jax_flash.config(cpu_split_kv=3, cpu_isa="generic"):
        cfg = jax_flash.current_config()
        assert (cfg.cpu_split_kv, cfg.cpu_isa, cfg.cuda_layout, cfg.deterministic) == (3, "generic", "warp32", True)
        with jax_flash.config(jax_flash.Config(cpu_isa="avx2"), cuda_layout="warp16"):  # nested: field by field
            cfg = jax_flash.current_config()
            assert (cfg.cpu_split_kv, cfg.cpu_isa, cfg.cuda_layout) == (3, "avx2", "warp16")
        # The call's own config wins over both, for the fields it sets.
        cfg = jax_flash.current_config(jax_flash.Config(cpu_split_kv=2, deterministic=False))
        assert (cfg.cpu_split_kv, cfg.cpu_isa, cfg.deterministic) == (2, "generic", False)
        # 0 is "the rule", explicitly: it overrides the variable and the context.
        assert jax_flash.current_config(jax_flash.Config(cpu_split_kv=0)).cpu_split_kv == 0
    assert jax_flash.current_config().cpu_split_kv == 4  # the block is over
    # The variable is read when resolving (at trace time), not once.
    clean_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "")
    assert jax_flash.current_config().cpu_split_kv == 0


def test_context_is_per_thread(clean_env):
    seen = {}

    def other():
        seen["other"] = jax_flash.current_config().cpu_isa

    with jax_flash.config(cpu_isa="generic"):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        seen["here"] = jax_flash.current_config().cpu_isa
    assert seen == {"other": "", "here": "generic"}


def test_config_reaches_the_spec(clean_env):
    """canonicalize (every public entry point) resolves the settings into AttentionSpec.config,
    which `explain` reads too."""
    q, k, v = _qkv(s=64)
    clean_env.setenv("JAX_FLASH_CUDA_BWD_GRID", "q_heads")
    with jax_flash.config(pallas_split_kv=5):
        spec = canonicalize(q, k, v, config=jax_flash.Config(cpu_split_kv=2)).spec
    assert spec.config.is_resolved
    assert (spec.config.cpu_split_kv, spec.config.pallas_split_kv, spec.config.cuda_backward_grid) == (2, 5, "q_heads")
    assert spec.settings is spec.config
    # A spec built by hand (config None) takes the settings in force when it is used.
    bare = dataclasses.replace(spec, config=None)
    with jax_flash.config(cpu_split_kv=7):
        assert bare.settings.cpu_split_kv == 7


# ---- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, error, words",
    [
        (dict(cuda_layout="wide"), ValueError, "Config.cuda_layout must be one of"),
        (dict(cuda_backward_grid="heads"), ValueError, "Config.cuda_backward_grid"),
        (dict(pallas_backend="mosaic"), ValueError, "Config.pallas_backend must be one of"),
        (dict(cpu_isa="sse9"), ValueError, "Config.cpu_isa"),
        (dict(cpu_split_kv=-1), ValueError, "Config.cpu_split_kv must be 0"),
        (dict(cuda_split_kv=1025), ValueError, "Config.cuda_split_kv"),
        (dict(pallas_split_kv="2"), TypeError, "Config.pallas_split_kv must be an int"),
        (dict(cpu_gradient_chunks=True), TypeError, "Config.cpu_gradient_chunks"),
        (
            dict(cpu_gradient_chunks=5),
            ValueError,
            "Config.cpu_gradient_chunks must be 0 .the rule. or a chunk count from 1 to 4",
        ),
        (dict(deterministic=1), TypeError, "Config.deterministic must be a bool"),
        (dict(warp_layout="warp32"), TypeError, "warp_layout"),
    ],
)
def test_bad_values_are_errors_at_once(fields, error, words):
    with pytest.raises(error, match=words):
        jax_flash.Config(**fields)
    with pytest.raises(error, match=words), jax_flash.config(**fields):
        pass


def test_bad_config_argument():
    q, k, v = _qkv(s=16)
    with pytest.raises(TypeError, match=r"config must be a jax_flash\.Config"):
        jax_flash.attention(q, k, v, config={"cpu_isa": "generic"})
    with pytest.raises(TypeError, match=r"jax_flash\.config takes a jax_flash\.Config"), jax_flash.config("generic"):
        pass


def test_bad_variable_is_an_error_of_the_calls_that_use_it(clean_env):
    """JAX_FLASH_CPU_SPLIT_KV=abc: a ValueError naming the variable when a cpu call is traced;
    xla calls and `explain` are unaffected, and an explicit setting overrides the variable."""
    _needs("cpu")
    q, k, v = _qkv(s=256)
    clean_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "abc")
    clean_env.setenv("JAX_FLASH_CUDA_LAYOUT", "wide")
    cfg = jax_flash.current_config()
    assert {name for name, _ in cfg.env_errors} == {"cpu_split_kv", "cuda_layout"}
    with pytest.raises(ValueError, match="JAX_FLASH_CPU_SPLIT_KV='abc' is not a chunk count"):
        cfg.get("cpu_split_kv")
    jax.block_until_ready(jax_flash.attention(q, k, v, implementation="xla"))
    with pytest.raises(ValueError, match="JAX_FLASH_CPU_SPLIT_KV='abc'"):
        jax_flash.attention(q, k, v, implementation="cpu")
    assert "JAX_FLASH_CPU_SPLIT_KV='abc'" in str(jax_flash.explain(q, k, v, implementation="cpu"))
    jax.block_until_ready(jax_flash.attention(q, k, v, implementation="cpu", config=jax_flash.Config(cpu_split_kv=2)))
    with jax_flash.config(cpu_split_kv=0):
        jax.block_until_ready(jax_flash.attention(q, k, v, implementation="cpu"))
    clean_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "")
    clean_env.setenv("JAX_FLASH_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="JAX_FLASH_CPU_ISA=sse9 is not one of"):
        jax.jit(lambda q: jax_flash.attention(q, k, v, implementation="cpu")).lower(q)


# ---- caches -----------------------------------------------------------------------------


def test_hashable_and_part_of_the_spec(clean_env):
    a, b = jax_flash.Config(cpu_isa="avx2", cpu_split_kv=2), jax_flash.Config(cpu_split_kv=2, cpu_isa="avx2")
    assert a == b and hash(a) == hash(b) and a != jax_flash.Config(cpu_isa="avx2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.cpu_isa = "generic"  # type: ignore[misc]
    q, k, v = _qkv(s=64)
    one = canonicalize(q, k, v, config=jax_flash.Config(cuda_layout="warp32")).spec
    two = canonicalize(q, k, v, config=jax_flash.Config(cuda_layout="warp32")).spec
    other = canonicalize(q, k, v, config=jax_flash.Config(cuda_layout="warp16")).spec
    assert one == two and hash(one) == hash(two) and one != other


def test_jit_keeps_the_settings_of_its_trace(clean_env):
    """A jitted function is traced once: a later change of a variable neither retraces it nor
    changes what it runs (nor does a new jax.jit of the same function: jax keys its trace cache
    on the function). Passed as a static argument, a Config keys the jit cache."""
    _needs("cpu")
    q, k, v = _qkv()
    traces = []

    def f(q, k, v, config=None):
        traces.append(config)
        return jax_flash.attention(q, k, v, implementation="cpu", config=config)

    clean_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "1")
    fixed = jax.jit(f)
    first = np.asarray(fixed(q, k, v))
    clean_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "4")
    second = np.asarray(fixed(q, k, v))
    third = np.asarray(jax.jit(f)(q, k, v))
    assert len(traces) == 1 and first.tobytes() == second.tobytes() == third.tobytes()
    jax.clear_caches()  # now the new value decides
    fourth = np.asarray(jax.jit(f)(q, k, v))
    assert len(traces) == 2 and fourth.tobytes() != first.tobytes()
    clean_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "1")

    traces.clear()
    static = jax.jit(f, static_argnames="config")
    unsplit, split = jax_flash.Config(cpu_split_kv=1), jax_flash.Config(cpu_split_kv=4)
    a = np.asarray(static(q, k, v, config=unsplit))
    b = np.asarray(static(q, k, v, config=split))
    c = np.asarray(static(q, k, v, config=jax_flash.Config(cpu_split_kv=1)))  # equal: a cache hit
    assert traces == [unsplit, split]
    assert a.tobytes() == first.tobytes() == c.tobytes()
    assert a.tobytes() != b.tobytes(), "4 key chunks and 1 gave the same bits: the split did not run"


# ---- lowered under one setting, run under another -----------------------------------------


def _export(f, *args):
    return jax.export.export(jax.jit(f), disabled_checks=jax_flash.export_disabled_checks())(*args)


def test_cpu_program_keeps_its_settings(clean_env):
    """Lowered with JAX_FLASH_CPU_SPLIT_KV=1 (unsplit) and JAX_FLASH_CPU_ISA=generic: the
    compiled program and its jax.export-ed copy run those kernels after the variables change
    (to 4 chunks and to an ISA that does not exist, which a program reading the environment at
    run time would fail on), bitwise the same; traced afresh, the call splits (other bits) or
    refuses the ISA."""
    _needs("cpu")
    q, k, v = _qkv()  # B·N = 4 work items < 16: the rule would split (4 chunks of 8 key blocks)
    # A new function for each trace: jax caches the trace of a function (whatever jax.jit wraps it).
    new = lambda: lambda q, k, v: jax_flash.attention(q, k, v, implementation="cpu")
    f = new()
    clean_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "1")
    clean_env.setenv("JAX_FLASH_CPU_ISA", "generic")
    clean_env.setenv("JAX_FLASH_POISON_OUTPUTS", "1")
    lowered = jax.jit(f).lower(q, k, v)
    text = lowered.as_text()
    assert set(_attribute(text, "forward_chunks")) == {"1"} and set(_attribute(text, "isa")) == {'"generic"'}, text
    assert set(_attribute(text, "poison_outputs")) == {"true"}
    compiled = lowered.compile()
    exported = _export(f, q, k, v)
    blob = exported.serialize()
    want = np.asarray(compiled(q, k, v))

    clean_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "4")
    clean_env.setenv("JAX_FLASH_CPU_ISA", "sse9")
    clean_env.setenv("JAX_FLASH_POISON_OUTPUTS", "0")
    assert np.asarray(compiled(q, k, v)).tobytes() == want.tobytes()
    restored = jax.export.deserialize(blob)
    assert set(_attribute(restored.mlir_module(), "forward_chunks")) == {"1"}
    assert np.asarray(restored.call(q, k, v)).tobytes() == want.tobytes()
    assert np.asarray(jax.jit(restored.call)(q, k, v)).tobytes() == want.tobytes()

    # The same function keeps its trace; traced afresh, the new environment decides.
    assert np.asarray(jax.jit(f)(q, k, v)).tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="JAX_FLASH_CPU_ISA=sse9"):
        jax.jit(new()).lower(q, k, v)
    clean_env.setenv("JAX_FLASH_CPU_ISA", "generic")
    fresh = jax.jit(new()).lower(q, k, v)
    assert set(_attribute(fresh.as_text(), "forward_chunks")) == {"4"}
    assert np.asarray(fresh.compile()(q, k, v)).tobytes() != want.tobytes(), "the split did not run"


def test_exported_program_in_another_process(clean_env, tmp_path):
    """The serialized program, deserialized and run by a process whose variables say otherwise
    (4 chunks, a bad ISA, no poisoning), gives the bits it gave here."""
    _needs("cpu")
    q, k, v = _qkv()
    f = lambda q, k, v: jax_flash.attention(q, k, v, implementation="cpu")
    with jax_flash.config(cpu_split_kv=1, cpu_isa="generic"):
        exported = _export(f, q, k, v)
    want = np.asarray(exported.call(q, k, v))
    (tmp_path / "program.bin").write_bytes(exported.serialize())
    np.savez(tmp_path / "inputs.npz", q=np.asarray(q), k=np.asarray(k), v=np.asarray(v))
    script = textwrap.dedent(f"""
        import numpy as np, jax, jax_flash  # importing jax_flash registers its FFI targets
        x = np.load({str(tmp_path / "inputs.npz")!r})
        program = jax.export.deserialize(open({str(tmp_path / "program.bin")!r}, "rb").read())
        out = np.asarray(program.call(x["q"], x["k"], x["v"]))
        open({str(tmp_path / "out.bin")!r}, "wb").write(out.tobytes())
    """)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "JAX_PLATFORMS": "cpu",
        "JAX_FLASH_CPU_SPLIT_KV": "4",
        "JAX_FLASH_CPU_ISA": "sse9",
        "JAX_FLASH_POISON_OUTPUTS": "0",
    }
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "out.bin").read_bytes() == want.tobytes()


def test_cuda_layout_fixed_at_lowering(clean_env):
    """The cuda kernels' warp layout (emulated on a CPU): a program lowered under warp32 runs
    warp32 after JAX_FLASH_CUDA_LAYOUT changes (even to a value that is no layout), bitwise the
    same; traced afresh, the new value decides (warp16, or a ValueError naming it)."""
    if jax.default_backend() == "cpu":
        clean_env.setenv("JAX_FLASH_EMULATE_CUDA", "1")
    _needs("cuda")
    q, k, v = _qkv(b=1, t=16, s=48, n=2, kh=1, h=64, dtype=jnp.bfloat16)
    new = lambda: lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", is_causal=True)
    f = new()
    clean_env.setenv("JAX_FLASH_CUDA_LAYOUT", "warp32")
    lowered = jax.jit(f).lower(q, k, v)
    assert set(_attribute(lowered.as_text(), "layout")) == {'"warp32"'}
    compiled = lowered.compile()
    exported = _export(f, q, k, v)
    want = np.asarray(compiled(q, k, v))
    clean_env.setenv("JAX_FLASH_CUDA_LAYOUT", "warp64")
    assert np.asarray(compiled(q, k, v)).tobytes() == want.tobytes()
    restored = jax.export.deserialize(exported.serialize())
    assert np.asarray(restored.call(q, k, v)).tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="JAX_FLASH_CUDA_LAYOUT='warp64'"):
        jax.jit(new()).lower(q, k, v)
    clean_env.setenv("JAX_FLASH_CUDA_LAYOUT", "warp16")
    assert set(_attribute(jax.jit(new()).lower(q, k, v).as_text(), "layout")) == {'"warp16"'}

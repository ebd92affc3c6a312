"""Call settings, fixed when a call is traced: `Config` and the `config` context manager.

A setting that changes how a call runs (which compiled instruction set, how many split-KV
chunks, which warp layout, ...) is decided once, when `jax_flash.attention` (or
`paged_attention`, `explain`, ...) is traced, and travels in the call's `AttentionSpec`
(`spec.config`) to the implementation, which hands it to the compiled kernels as FFI
attributes. A compiled or `jax.export`-ed program therefore does what it was lowered to do,
whatever the environment of the process that runs it.

Each setting is resolved, field by field, from the first of:

1. the `config=` argument of the call (`jax_flash.Config(...)`; a field left None is not set
   there),
2. the innermost enclosing `with jax_flash.config(...)` that sets it (a context variable:
   per thread and per asyncio task),
3. its `JAX_FLASH_*` environment variable, read when the call is traced,
4. the default.

A value given as an argument or to `config(...)` is checked at once (ValueError or TypeError
naming the field). A variable that holds no valid value is not an error until a call uses
that setting: then the ValueError names the variable (so `JAX_FLASH_CUDA_LAYOUT=wide` breaks
`cuda` calls, not `cpu` ones, and `explain` still answers).

Setting                                Variable                             Default
cpu_isa             str                JAX_FLASH_CPU_ISA                    "" (the CPU's default)
cpu_split_kv        int                JAX_FLASH_CPU_SPLIT_KV               0 (the rule)
cpu_gradient_chunks int                JAX_FLASH_CPU_GRADIENT_CHUNKS        0 (the rule)
cuda_layout         str                JAX_FLASH_CUDA_LAYOUT                "warp16"
cuda_backward_grid  str                JAX_FLASH_CUDA_BWD_GRID              "auto"
cuda_split_kv       int                JAX_FLASH_CUDA_SPLIT_KV              0 (the rule)
pallas_split_kv     int                JAX_FLASH_PALLAS_SPLIT_KV            0 (the rule)
pallas_backend      str                JAX_FLASH_PALLAS_BACKEND             "auto" (the rule)
deterministic       bool               JAX_FLASH_DETERMINISTIC (=1)         False
poison_outputs      bool               JAX_FLASH_POISON_OUTPUTS (set, not 0) False
emulate_cuda        bool               JAX_FLASH_EMULATE_CUDA (=1)          False
sequence_parallel   str                JAX_FLASH_SEQUENCE_PARALLEL          "auto" (the rule)

docs/configuration.md lists every JAX_FLASH_* variable, these and the others (the process
setting JAX_FLASH_CPU_THREADS, build-time and test-only variables).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import numbers
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

CPU_ISAS = ("amx", "avx512bf16", "avx512", "avx2", "generic", "amx_emulated")
CUDA_LAYOUTS = ("warp16", "warp32")
CUDA_BACKWARD_GRIDS = ("auto", "kv_heads", "q_heads")
# The compiler the `pallas` forward's plain calls go through: "auto" is the rule (Mosaic GPU
# where a device run measured it faster on the architecture, Triton elsewhere).
PALLAS_BACKENDS = ("auto", "triton", "mosaic_gpu")
# How a call whose queries and keys/values are sharded over the sequence runs under jax.jit
# (jax_flash.parallel.partitioning): "auto" is the rule (the fewest bytes moved per device).
SEQUENCE_PARALLEL = ("auto", "ring", "all_to_all", "hybrid")
# A forced split-KV chunk count: 1 to MAX_CHUNKS; 0 is the rule. The kernels use at most one
# chunk per key block.
MAX_CHUNKS = 1024
# The cpu backward's forced key-block chunks: 1 to MAX_GRADIENT_CHUNKS (the range its
# gradient_chunks attribute accepts, cuda/README.md); 0 is the rule.
MAX_GRADIENT_CHUNKS = 4


@dataclasses.dataclass(frozen=True)
class _Field:
    variable: str  # the JAX_FLASH_* variable
    default: Any
    kind: type  # str, int or bool
    choices: tuple = ()  # str settings: the values accepted ("" included where it means the default)
    what: str = ""  # what the setting chooses, for messages
    # The variable's text -> the value; None when it is not one (ValueError with `invalid`).
    parse: Callable[[str], Any] | None = None
    invalid: str = ""  # the message for a bad variable: "{variable}={value!r} ..." formatted


def _chunks(text: str, most: int = MAX_CHUNKS) -> int | None:
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 1 <= value <= most else None


def _choice(choices: tuple, empty: str) -> Callable[[str], str | None]:
    return lambda text: empty if text == "" else (text if text in choices else None)


def _chunk_field(variable: str, what: str) -> _Field:
    return _Field(
        variable,
        0,
        int,
        what=what,
        parse=_chunks,
        invalid="{variable}={value!r} is not a chunk count of " + what + " (an integer from 1, never split, to 1024)",
    )


_FIELDS: dict[str, _Field] = {
    "cpu_isa": _Field(
        "JAX_FLASH_CPU_ISA",
        "",
        str,
        ("", *CPU_ISAS),
        "the cpu kernels' instruction set",
        _choice(CPU_ISAS, ""),
        # The words of the kernels' own message (cuda/cpu/kernel_dispatch.cc).
        "{variable}={value} is not one of: amx, avx512bf16, avx512, avx2, generic, amx_emulated "
        "(or unset for the best this CPU runs)",
    ),
    "cpu_split_kv": _chunk_field("JAX_FLASH_CPU_SPLIT_KV", "the cpu forward's split-KV"),
    "cpu_gradient_chunks": _Field(
        "JAX_FLASH_CPU_GRADIENT_CHUNKS",
        0,
        int,
        what="the cpu backward's key-block chunks",
        parse=lambda text: _chunks(text, MAX_GRADIENT_CHUNKS),
        invalid="{variable}={value!r} is not a chunk count of the cpu backward (an integer from 1, the "
        "items own their query heads, to 4)",
    ),
    "cuda_layout": _Field(
        "JAX_FLASH_CUDA_LAYOUT",
        "warp16",
        str,
        CUDA_LAYOUTS,
        "the CUDA kernels' warp layout",
        _choice(CUDA_LAYOUTS, "warp16"),
        "{variable}={value!r} is not a layout of the CUDA kernels (warp16 or warp32)",
    ),
    "cuda_backward_grid": _Field(
        "JAX_FLASH_CUDA_BWD_GRID",
        "auto",
        str,
        CUDA_BACKWARD_GRIDS,
        "the CUDA backward's grid",
        _choice(CUDA_BACKWARD_GRIDS, "auto"),
        "{variable}={value!r} is not a grid of the CUDA backward (auto, kv_heads or q_heads)",
    ),
    "cuda_split_kv": _chunk_field("JAX_FLASH_CUDA_SPLIT_KV", "the CUDA forward's split-KV"),
    "pallas_split_kv": _chunk_field("JAX_FLASH_PALLAS_SPLIT_KV", "the pallas forward's split-KV"),
    "pallas_backend": _Field(
        "JAX_FLASH_PALLAS_BACKEND",
        "auto",
        str,
        PALLAS_BACKENDS,
        "the pallas forward's compiler",
        _choice(PALLAS_BACKENDS, "auto"),
        "{variable}={value!r} is not a pallas backend (auto, triton or mosaic_gpu)",
    ),
    "deterministic": _Field("JAX_FLASH_DETERMINISTIC", False, bool, parse=lambda text: text == "1"),
    # As the kernels read it before: set, not empty and not starting with 0.
    "poison_outputs": _Field(
        "JAX_FLASH_POISON_OUTPUTS", False, bool, parse=lambda text: text != "" and not text.startswith("0")
    ),
    "emulate_cuda": _Field("JAX_FLASH_EMULATE_CUDA", False, bool, parse=lambda text: text == "1"),
    "sequence_parallel": _Field(
        "JAX_FLASH_SEQUENCE_PARALLEL",
        "auto",
        str,
        SEQUENCE_PARALLEL,
        "the scheme of a sequence-sharded call under jax.jit",
        _choice(SEQUENCE_PARALLEL, "auto"),
        "{variable}={value!r} is not a sequence-parallel scheme (auto, ring, all_to_all or hybrid)",
    ),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings of `jax_flash` calls, fixed when a call is traced (frozen, hashable).

    Pass one as `attention(..., config=jax_flash.Config(cuda_layout="warp32"))`, or set
    fields for a block of code with `with jax_flash.config(cuda_layout="warp32"):`. A field
    left None is not set here: it comes from an enclosing `jax_flash.config`, then from its
    `JAX_FLASH_*` variable, then from the default (module `jax_flash._config`).

    Attributes:
      cpu_isa: the `cpu` kernels' instruction set: "" (this CPU's default: the widest, but
        avx512 over avx512bf16 where bf16 dot products are the slower), "amx", "avx512bf16",
        "avx512", "avx2", "generic" or "amx_emulated" (AMX code with emulated tile
        instructions, for tests). An ISA the CPU lacks is an error of the call.
      cpu_split_kv: the `cpu` forward's split-KV chunks: 0 the rule, C >= 1 forces C (1:
        never split; at most one chunk per key block is used).
      cpu_gradient_chunks: the `cpu` backward's key-block chunks: 0 the rule (from XLA's
        thread pool), C from 1 to 4 forces C (1: each work item owns its query heads; at most
        one chunk per key block is used).
      cuda_layout: the `cuda` kernels' warp layout, "warp16" or "warp32".
      cuda_backward_grid: the `cuda` backward's grid, "auto", "kv_heads" or "q_heads".
      cuda_split_kv: the `cuda` forward's split-KV chunks: 0 the rule, C >= 1 forces C.
      pallas_split_kv: the `pallas` forward's split-KV chunks: 0 the rule, C >= 1 forces C.
      pallas_backend: the compiler of the `pallas` forward's plain calls: "auto" (the rule:
        Mosaic GPU where a device run measured it faster on this GPU's architecture, Triton
        elsewhere), "triton", or "mosaic_gpu" (the Mosaic GPU kernel on sm_90; a call it
        cannot serve is an error naming why); its backward on Mosaic GPU too at H = 64 or 128.
        Calls with features run the Triton kernels.
      deterministic: the `cuda` backward accumulates dQ (and a broadcast dbias) without
        racing atomics: bitwise reproducible gradients.
      poison_outputs: the compiled kernels (`cpu`, `cuda`, emulated `cuda`) fill their
        results with NaN before computing, so an element left unwritten shows up (tests).
      emulate_cuda: on the CPU backend, `implementation="cuda"` runs the CUDA kernel source
        against the host emulation of the SIMT model (slow; tests without a GPU).
      sequence_parallel: how a call with queries and keys/values sharded over the sequence
        runs under `jax.jit`: "auto" (the rule: the scheme that moves the fewest bytes per
        device, `jax_flash.parallel.partitioning.sequence_decision`), or "ring",
        "all_to_all" or "hybrid" forced (a forced scheme that cannot run is an error).
      env_errors: in a resolved config, (field, message) for each variable that held no valid
        value (the field then has its default, and a call that uses it raises the message);
        () in a config made by hand.

    Example:

    >>> import jax_flash
    >>> jax_flash.Config(cpu_split_kv=1).cpu_split_kv
    1
    """

    cpu_isa: str | None = None
    cpu_split_kv: int | None = None
    cpu_gradient_chunks: int | None = None
    cuda_layout: str | None = None
    cuda_backward_grid: str | None = None
    cuda_split_kv: int | None = None
    pallas_split_kv: int | None = None
    pallas_backend: str | None = None
    deterministic: bool | None = None
    poison_outputs: bool | None = None
    emulate_cuda: bool | None = None
    sequence_parallel: str | None = None
    env_errors: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)

    def __post_init__(self):
        for name, spec in _FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                _check(name, spec, value)
        errors: object = self.env_errors  # checked as given, whatever its annotation says
        if not isinstance(errors, tuple) or any(
            not (isinstance(e, tuple) and len(e) == 2 and e[0] in _FIELDS and isinstance(e[1], str)) for e in errors
        ):
            raise TypeError(f"Config.env_errors must be a tuple of (field, message) pairs, got {self.env_errors!r}")

    @property
    def is_resolved(self) -> bool:
        """Every setting has a value (a config that `resolve` made)."""
        return all(getattr(self, name) is not None for name in _FIELDS)

    def get(self, name: str) -> Any:
        """The value of setting `name` in a resolved config; ValueError naming the variable
        when it held no valid value."""
        for field, message in self.env_errors:
            if field == name:
                raise ValueError(message)
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"Config.{name} is not resolved (use jax_flash.current_config())")
        return value

    def set_fields(self) -> dict[str, Any]:
        """{name: value} of the settings this config sets (not None)."""
        return {name: getattr(self, name) for name in _FIELDS if getattr(self, name) is not None}

    def over(self, base: Config) -> Config:
        """This config's settings, and `base`'s where this one leaves a field None."""
        return dataclasses.replace(base, **self.set_fields())

    @staticmethod
    def variable(name: str) -> str:
        """The JAX_FLASH_* variable of setting `name`."""
        return _FIELDS[name].variable

    @staticmethod
    def names() -> tuple[str, ...]:
        """The settings' names, in order."""
        return tuple(_FIELDS)


def _check(name: str, spec: _Field, value: Any) -> None:
    where = f"Config.{name}"
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be a bool or None, got {value!r}")
    elif spec.kind is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{where} must be an int or None, got {value!r}")
        most = MAX_GRADIENT_CHUNKS if name == "cpu_gradient_chunks" else MAX_CHUNKS
        if not 0 <= int(value) <= most:
            raise ValueError(f"{where} must be 0 (the rule) or a chunk count from 1 to {most}, got {value!r}")
    else:
        if not isinstance(value, str):
            raise TypeError(f"{where} must be a str or None, got {value!r}")
        if value not in spec.choices:
            raise ValueError(f"{where} must be one of {spec.choices} ({spec.what}), got {value!r}")


_UNSET = Config()  # frozen: every field None
_context: contextvars.ContextVar[Config] = contextvars.ContextVar("jax_flash_config", default=_UNSET)


@contextlib.contextmanager
def config(settings: Config | None = None, /, **overrides: Any) -> Iterator[Config]:
    """Set call settings for the calls traced inside the block::

        with jax_flash.config(cpu_isa="avx2", cpu_split_kv=1):
            out = jax.jit(f)(q, k, v)   # traced here: these settings are compiled in

    `settings` (a `Config`) and keyword fields (those of `Config`) are combined, the keywords
    winning; nested blocks override the fields they set. The values are checked on entry.
    A jitted function traced before, or outside, the block keeps the settings it was traced
    with (jax caches the trace of a function, also across `jax.jit` wrappers of it). Yields
    the settings now in force from contexts (unset fields None).

    Example:

    >>> import jax_flash
    >>> with jax_flash.config(cuda_layout="warp32"):
    ...     jax_flash.current_config().cuda_layout
    'warp32'
    """
    if settings is not None and not isinstance(settings, Config):
        raise TypeError(f"jax_flash.config takes a jax_flash.Config, got {type(settings).__name__}")
    here = Config(**overrides)
    if settings is not None:
        here = here.over(settings)
    token = _context.set(here.over(_context.get()))
    try:
        yield _context.get()
    finally:
        _context.reset(token)


def from_environment(environ: Mapping[str, str] | None = None) -> Config:
    """The settings the JAX_FLASH_* variables give now (every field set; an invalid variable
    leaves its default and an entry in env_errors)."""
    variables: Mapping[str, str] = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    errors: list[tuple[str, str]] = []
    for name, spec in _FIELDS.items():
        text = variables.get(spec.variable, "")
        value = spec.parse(text) if spec.parse is not None else text
        if value is None:
            errors.append((name, spec.invalid.format(variable=spec.variable, value=text)))
            value = spec.default
        values[name] = value
    return Config(**values, env_errors=tuple(errors))


def resolve(explicit: Config | None = None) -> Config:
    """The settings of a call traced now: `explicit` (the call's `config=`), then the
    enclosing `jax_flash.config` blocks, then the JAX_FLASH_* variables, then the defaults.
    Every field is set; env_errors keeps only the variables that were used."""
    if explicit is not None and not isinstance(explicit, Config):
        raise TypeError(f"config must be a jax_flash.Config or None, got {type(explicit).__name__}")
    chosen = _context.get() if explicit is None else explicit.over(_context.get())
    env = from_environment()
    errors = tuple((name, message) for name, message in env.env_errors if getattr(chosen, name) is None)
    return dataclasses.replace(chosen.over(env), env_errors=errors)


def current_config(config: Config | None = None) -> Config:
    """The resolved settings a call traced now would use (with `config=config`).

    Example:

    >>> import jax_flash
    >>> jax_flash.current_config(jax_flash.Config(deterministic=True)).deterministic
    True
    """
    return resolve(config)

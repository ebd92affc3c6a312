"""Tile sizes, warps and pipeline stages of the Pallas (Triton) kernels, and their tuning.

One table, keyed by (padded head dim, dtype, pass), where the passes are
  "fwd"   the forward kernel: block_q query rows resident, loop over block_k keys;
  "dkdv"  the backward dK/dV kernel: block_k keys resident, loop over block_q query rows;
  "dq"    the backward dQ kernel: block_q query rows resident, loop over block_k keys.

`tune()` times every candidate of `candidates()` on the GPU at hand and prints a table to
paste over `TABLE` (`python -m jax_flash.bench --tune-pallas`).

The defaults are FlashAttention-2 choices for sm_80/sm_90 class GPUs (228 KB of shared
memory per SM): 128-row query tiles and 64-key tiles for the forward, 8 warps once the
head dim reaches 128, 2-3 pipeline stages, smaller tiles for float32 and for head dim 256
so that the tiles fit shared memory and the f32 accumulators fit registers.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Optional, Sequence

PASSES = ("fwd", "dkdv", "dq")
HEAD_DIMS = (16, 32, 64, 128, 256)  # head dims are padded up to one of these
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Config:
    """One kernel launch configuration (powers of two, at least 16 rows per tile)."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self):
        return f"Config({self.block_q}, {self.block_k}, {self.num_warps}, {self.num_stages})"


# Defaults per (pass, head dims up to, 2- or 4-byte inputs). Every entry was compiled for
# sm_90a with Triton 3.9 and ptxas: none spills registers (the tempting dK/dV tiles with
# 128 resident keys all spilled), all fit 200 KB of shared memory.
_DEFAULTS = {
    # pass: [(max head dim, 16-bit config, float32 config), ...]
    "fwd": [
        (64, Config(128, 64, 4, 3), Config(64, 32, 4, 2)),
        (128, Config(128, 64, 8, 3), Config(64, 32, 8, 2)),
        (256, Config(64, 64, 8, 2), Config(32, 32, 8, 2)),
    ],
    "dkdv": [
        (128, Config(64, 64, 8, 2), Config(32, 32, 8, 2)),
        (256, Config(32, 32, 8, 2), Config(16, 32, 8, 1)),
    ],
    "dq": [
        (128, Config(128, 64, 8, 2), Config(64, 32, 8, 2)),
        (256, Config(64, 32, 8, 2), Config(16, 32, 8, 1)),
    ],
}


def _defaults(head_dim: int, dtype: str, pass_: str) -> Config:
    for max_head_dim, half, single in _DEFAULTS[pass_]:
        if head_dim <= max_head_dim:
            return single if dtype == "float32" else half
    raise ValueError(f"no default tiles for head dim {head_dim}")


# (padded head dim, dtype, pass) -> Config.  Regenerate with `tune()` on the target GPU.
TABLE: dict[tuple[int, str, str], Config] = {
    (h, d, p): _defaults(h, d, p) for h in HEAD_DIMS for d in DTYPES for p in PASSES
}

# Interpret mode (CPU, tests): small tiles so that ragged test shapes span several blocks
# and the interpreter stays fast.
INTERPRET_CONFIG = {
    "fwd": Config(32, 16, 4, 2),
    "dkdv": Config(16, 32, 4, 2),
    "dq": Config(32, 16, 4, 2),
}


def padded_head_dim(head_dim: int) -> int:
    """Triton tiles are powers of two, at least 16 wide for tensor-core dots."""
    return max(16, 1 << (head_dim - 1).bit_length())


def lookup(head_dim_padded: int, dtype: str, pass_: str, interpret: bool) -> Config:
    if interpret:
        return INTERPRET_CONFIG[pass_]
    return TABLE[(head_dim_padded, dtype, pass_)]


def smem_budget(compute_capability: Optional[tuple[int, int]]) -> Optional[int]:
    """Bytes of shared memory one block may use (CUDA C Programming Guide, compute
    capabilities table), or None when unknown (no GPU here: use the table as it is)."""
    if compute_capability is None:
        return None
    if compute_capability in ((8, 0), (8, 7)):
        return 163 * 1024
    if compute_capability[0] in (9, 10):
        return 227 * 1024
    return 99 * 1024  # sm_86, sm_89, sm_120 and anything not known to have more


def smem_estimate(cfg: Config, head_dim: int, dtype: str, pass_: str, dense_bytes: int = 0) -> int:
    """Shared memory of one launch: resident tiles plus `num_stages` copies of the streamed
    ones (q·kᵀ operands, and dense bias/mask tiles of `dense_bytes` per element). Matches
    what Triton allocates for the defaults within a few percent, erring high."""
    item = 4 if dtype == "float32" else 2
    bq, bk, st = cfg.block_q, cfg.block_k, cfg.num_stages
    dense = min(st, 2) * bq * bk * dense_bytes  # dense tiles are double-buffered at most
    if pass_ == "fwd":  # q resident; k, v streamed
        return item * head_dim * (bq + 2 * bk * st) + dense
    if pass_ == "dkdv":  # k, v resident; q, dO streamed, and each feeds two dots
        return item * head_dim * (2 * bk + 2 * bq * (st + 1)) + dense
    return item * head_dim * (2 * bq + 2 * bk * st) + dense  # dq: q, dO resident


def fit(cfg: Config, head_dim: int, dtype: str, pass_: str, budget: Optional[int],
        dense_bytes: int = 0) -> Config:
    """Shrink `cfg` until it fits `budget` bytes of shared memory: first the pipeline depth
    to 2, then the streamed tile, then the resident tile (to 32 rows), then one stage."""
    if budget is None:
        return cfg
    stream = "block_q" if pass_ == "dkdv" else "block_k"
    resident = "block_k" if pass_ == "dkdv" else "block_q"
    steps = [
        lambda c: dataclasses.replace(c, num_stages=2) if c.num_stages > 2 else None,
        lambda c: dataclasses.replace(c, **{stream: getattr(c, stream) // 2})
        if getattr(c, stream) > 32 else None,
        lambda c: dataclasses.replace(c, **{resident: getattr(c, resident) // 2})
        if getattr(c, resident) > 32 else None,
        lambda c: dataclasses.replace(c, num_stages=1) if c.num_stages > 1 else None,
        lambda c: dataclasses.replace(c, **{stream: getattr(c, stream) // 2})
        if getattr(c, stream) > 16 else None,
        lambda c: dataclasses.replace(c, **{resident: getattr(c, resident) // 2})
        if getattr(c, resident) > 16 else None,
    ]
    for step in steps:
        while smem_estimate(cfg, head_dim, dtype, pass_, dense_bytes) > budget:
            smaller = step(cfg)
            if smaller is None:
                break
            cfg = smaller
    return cfg


def candidates(head_dim: int, dtype: str, pass_: str, budget: int = 227 * 1024) -> list[Config]:
    """The search space of `tune()`, pruned by the shared-memory estimate."""
    small = head_dim >= 256 or dtype == "float32"
    rows = (16, 32, 64, 128) if small else (64, 128)
    stages_ = (1, 2, 3) if small else (2, 3)
    out = []
    for bq, bk, warps, stages in itertools.product(rows, (32, 64, 128), (4, 8), stages_):
        cfg = Config(bq, bk, warps, stages)
        if bq * bk <= 128 * 128 and smem_estimate(cfg, head_dim, dtype, pass_) <= budget:
            out.append(cfg)
    return out


def format_table(table: dict) -> str:
    lines = ["TABLE = {"]
    for key in sorted(table):
        lines.append(f"    {key!r}: {table[key]},")
    lines.append("}")
    return "\n".join(lines)


def _time(fn, args, iters: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def tune(
    head_dims: Sequence[int] = (64, 128),
    dtypes: Sequence[str] = ("bfloat16", "float16"),
    passes: Sequence[str] = PASSES,
    *,
    dtype: Optional[str] = None,
    seq_lens: Optional[Sequence[int]] = None,
    seq_len: int = 4096,
    batch: int = 4,
    num_heads: int = 16,
    causal: bool = False,
    iters: int = 10,
    verbose: bool = True,
) -> dict:
    """Time each candidate configuration on the default (GPU) device; print the best table.

    dtype: tune this one dtype (overrides `dtypes`); seq_lens: tune at the longest of these
    (overrides `seq_len`), T = S, `batch` × `num_heads` heads of full (or causal) attention.
    Returns the full table with the measured entries replaced by the fastest candidate
    (its repr is the table to paste). Candidates that fail to compile (shared memory,
    registers) are skipped.
    """
    import jax
    import jax.numpy as jnp

    if dtype is not None:
        dtypes = (jnp.dtype(dtype).name,)
    if seq_lens:
        seq_len = max(seq_lens)

    from jax_flash import pallas
    from jax_flash._spec import AttentionSpec, MaskInputs

    if jax.default_backend() != "gpu":
        backend = jax.default_backend()
        print(f"tune() times the Triton kernels on a GPU; the default backend is {backend}")
        return None
    best_table = dict(TABLE)
    for h, dtype, pass_ in itertools.product(head_dims, dtypes, passes):
        hp = padded_head_dim(h)
        spec = AttentionSpec(
            batch=batch, q_len=seq_len, kv_len=seq_len, num_heads=num_heads,
            num_kv_heads=num_heads, head_dim=h, dtype=dtype, scale=h**-0.5,
            window_left=None, window_right=0 if causal else None,
        )
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        shape = (batch, seq_len, num_heads, h)
        q, k, v, do = (jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in keys)
        masks = MaskInputs()
        out, lse = jax.jit(lambda q, k, v: pallas.forward(spec, q, k, v, masks))(q, k, v)
        dlse = jnp.zeros_like(lse)
        results = []
        budget = smem_budget(pallas._compute_capability()) or 227 * 1024
        for cfg in candidates(hp, dtype, pass_, budget):
            over = {pass_: cfg}
            if pass_ == "fwd":
                fn = jax.jit(
                    lambda q, k, v, o=over: pallas.forward(spec, q, k, v, masks, configs=o)
                )
                args = (q, k, v)
            else:
                fn = jax.jit(
                    lambda q, k, v, out, lse, do, o=over: pallas.backward(
                        spec, q, k, v, masks, out, lse, do, dlse, configs=o
                    )[:3]
                )
                args = (q, k, v, out, lse, do)
            try:
                t = _time(fn, args, iters)
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile
                if verbose:
                    print(f"  {h} {dtype} {pass_} {cfg}: skipped ({type(e).__name__})")
                continue
            results.append((t, cfg))
            if verbose:
                print(f"  {h} {dtype} {pass_} {cfg}: {t * 1e3:.3f} ms")
        if results:
            t, cfg = min(results, key=lambda r: r[0])
            best_table[(hp, dtype, pass_)] = cfg
            if verbose:
                default = TABLE[(hp, dtype, pass_)]
                print(f"best {h} {dtype} {pass_}: {cfg} {t * 1e3:.3f} ms (default {default})")
    best_table = _Table(best_table)
    print(best_table)
    return best_table


class _Table(dict):
    """A tuned table; printing it gives the source to paste over `TABLE`."""

    def __repr__(self):
        return format_table(self)

    __str__ = __repr__

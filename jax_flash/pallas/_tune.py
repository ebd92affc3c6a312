"""The tuner of the Pallas kernels' tile table (`pallas._table`): times every candidate
configuration of `candidates()` on the GPU at hand and writes the fastest as the table's
JSON file (`python -m jax_flash.bench --tune-pallas` runs it).

Tooling: it runs the `pallas` implementation, so it stands above it; the kernels read only
the table's data.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path

from jax_flash._spec import AttentionSpec, MaskInputs
from jax_flash.pallas import _triton as pallas
from jax_flash.pallas._table import PASSES, TABLE, Config, dumps, padded_head_dim, smem_budget, smem_estimate


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
    dtype: str | None = None,
    seq_lens: Sequence[int] | None = None,
    seq_len: int = 4096,
    batch: int = 4,
    num_heads: int = 16,
    causal: bool = False,
    iters: int = 10,
    verbose: bool = True,
    path=None,
) -> dict | None:
    """Time each candidate configuration on the default (GPU) device; print the best table.

    dtype: tune this one dtype (overrides `dtypes`); seq_lens: tune at the longest of these
    (overrides `seq_len`), T = S, `batch` × `num_heads` heads of full (or causal) attention.
    Returns the full table with the measured entries replaced by the fastest candidate
    (its repr is the JSON text of the table file); `path`: also write it there (e.g.
    `jax_flash.pallas._table.TABLE_FILE`, the file the package reads). Candidates that fail
    to compile (shared memory, registers) are skipped. Off a GPU it prints why and returns None.
    """
    import jax
    import jax.numpy as jnp

    if dtype is not None:
        dtypes = (jnp.dtype(dtype).name,)
    if seq_lens:
        seq_len = max(seq_lens)

    if jax.default_backend() != "gpu":
        backend = jax.default_backend()
        print(f"tune() times the Triton kernels on a GPU; the default backend is {backend}")
        return None
    best_table = dict(TABLE)
    for h, dtype, pass_ in itertools.product(head_dims, dtypes, passes):
        hp = padded_head_dim(h)
        spec = AttentionSpec(
            batch=batch,
            q_len=seq_len,
            kv_len=seq_len,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=h,
            dtype=dtype,
            scale=h**-0.5,
            window_left=None,
            window_right=0 if causal else None,
        )
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        shape = (batch, seq_len, num_heads, h)
        q, k, v, do = (jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in keys)
        masks = MaskInputs()
        out, lse = jax.jit(lambda q, k, v, spec=spec, masks=masks: pallas.forward(spec, q, k, v, masks))(q, k, v)
        dlse = jnp.zeros_like(lse)
        results = []
        budget = smem_budget(pallas.compute_capability()) or 227 * 1024
        for cfg in candidates(hp, dtype, pass_, budget):
            over = {pass_: cfg}
            args: tuple[jax.Array, ...]
            if pass_ == "fwd":
                fn = jax.jit(
                    lambda q, k, v, o=over, spec=spec, masks=masks: pallas.forward(spec, q, k, v, masks, configs=o)
                )
                args = (q, k, v)
            else:
                fn = jax.jit(
                    lambda q, k, v, out, lse, do, o=over, spec=spec, masks=masks, dlse=dlse: pallas.backward(
                        spec, q, k, v, masks, out, lse, do, dlse, configs=o
                    )[:3]
                )
                args = (q, k, v, out, lse, do)
            try:
                t = _time(fn, args, iters)
            except Exception as e:  # a candidate that does not compile is reported, not fatal
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
    best_table = TunedTable(best_table)
    print(best_table)
    if path is not None:
        Path(path).write_text(dumps(best_table))
        print(f"written to {path}")
    return best_table


class TunedTable(dict):
    """A tuned table; printing it gives the JSON text of `pallas/table.json` (`dumps`)."""

    def __repr__(self):
        return dumps(self)

    __str__ = __repr__

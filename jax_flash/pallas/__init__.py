"""The `pallas` implementation: FlashAttention-2 as Pallas kernels on the Triton backend, and
FlashAttention-3's forward on Mosaic GPU for Hopper.

One room, its parts:

- `_triton`: the wrapper of the Triton kernels: pads what Triton needs powers of two for,
  builds the grids and BlockSpecs, chooses plain or general kernels per call, launches the
  forward, the dK/dV and the dQ kernels and merges split-KV partials; `IMPLEMENTATION`, the
  registry's entry (`implementation="pallas"`);
- `_triton_kernels`: their bodies, plain and general (the numerical contract off the plain
  kernels' key loops: its docstring);
- `_flex_tiles`: flex_attention's `score_mod` and `mask_mod` evaluated on a kernel's tile;
- `_mosaic` and `_mosaic_backward`: the plain kernels on Mosaic GPU (sm_90a: FlashAttention-3's
  schedule), the forward and the backward's dQ and dK/dV kernels, and `_backend`, which says per
  call whether they run or the Triton kernels (`Config.pallas_backend`);
- `_decode`: the paged decode kernel (`paged_attention(..., implementation="pallas")`);
- `_table` and `table.json`: the tile table (tiles, warps, stages per head dim, dtype and
  pass), with its shared-memory fit, read by `jax_flash._heuristics`;
- `_tune`: the tuner that times the table's candidates on a GPU and writes `table.json`
  (`python -m jax_flash.bench --tune-pallas`).

What the rest of the package and the tests call is re-exported here.
"""

from __future__ import annotations

from jax_flash.pallas._triton import (
    IMPLEMENTATION,
    PallasImplementation,
    backward,
    compute_capability,
    flex_config,
    flex_limit,
    forward,
    launch_limit,
    plain_inputs,
)

__all__ = [
    "IMPLEMENTATION",
    "PallasImplementation",
    "backward",
    "compute_capability",
    "flex_config",
    "flex_limit",
    "forward",
    "launch_limit",
    "plain_inputs",
]

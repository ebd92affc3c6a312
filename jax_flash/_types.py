"""Type aliases of the public API's arguments and results.

Array inputs are `jax.typing.ArrayLike` (a jax or numpy array, or a Python scalar); results are
`jax.Array`. A function with `return_residual` has two overloads, as `jax.nn.dot_product_attention`
has: out alone, or (out, lse) when return_residual=True is passed literally.
"""

from __future__ import annotations

from typing import TypeAlias

import jax
from jax.typing import ArrayLike

# local_window_size: an int w (both sides) or a pair (left, right) of ints >= 0.
Window: TypeAlias = int | tuple[int, int]
# segment_ids: ids [*B, T] (self-attention) or a pair (q_ids [*B, T], kv_ids [*B, S]).
SegmentIds: TypeAlias = ArrayLike | tuple[ArrayLike, ArrayLike]
# (out, lse): the output and the natural-log log-sum-exp of each row.
OutAndLse: TypeAlias = tuple[jax.Array, jax.Array]

__all__ = ["ArrayLike", "OutAndLse", "SegmentIds", "Window"]

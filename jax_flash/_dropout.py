"""Attention dropout: the one counter-based generator every implementation reproduces.

Semantics (FlashAttention-2): the softmax statistics (row max, row sum, lse) are those of
the full probabilities P; dropout then keeps P[b, n, t, s] with probability 1 - rate and
scales the kept ones by 1 / (1 - rate):

    out = (keep ⊙ P / (1 - rate)) @ V,   lse unchanged.

The backward regenerates `keep` from the same counters; nothing of size T×S is stored.

The generator, exactly (every implementation computes these bits; tests compare them):

* Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11;
  Random123's philox4x32_10): key (k0, k1) = `seed`, the two uint32 words of the
  `dropout_rng` key's data (`jax.random.key_data`); multipliers M0 = 0xD2511F53,
  M1 = 0xCD9E8D57; Weyl increments W0 = 0x9E3779B9, W1 = 0xBB67AE85; ten rounds

      hi0:lo0 = M0 · c0,  hi1:lo1 = M1 · c2        (32×32 -> 64-bit products)
      (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
      (k0, k1) = (k0 + W0, k1 + W1)                 (mod 2**32)

* the counter of element (b, n, t, s): (c0, c1, c2, c3) = (s >> 2, t, n, b) as uint32,
  where b is the canonical (folded) batch index, n the query head, t the query row and s
  the key column, all global (0-based over the whole call). One Philox call yields the
  four words w0..w3 of the four adjacent columns 4·(s >> 2) + i, i = 0..3: column s takes
  word s & 3.
* the threshold: rate is rounded to float32 once (the spec holds the float32 value) and
  `threshold = floor(rate · 2**32)` (exact in float32 or float64 arithmetic: a power-of-two
  scaling of a float32 below 1); element (b, n, t, s) is kept iff its word >= threshold.
  rate = 0 gives threshold 0: everything kept (and every implementation then skips
  dropout entirely, so rate 0 is bitwise the call without dropout).
* the scaling of kept probabilities: float32 `1 / (1 - rate)` (in the accumulator dtype
  for float64 inputs).

This module holds the generator in jnp (uint32 arithmetic only: the 32×32 -> 64-bit
products are built from 16-bit halves, so it runs without x64 and inside Pallas kernels),
the argument checks, and the seed's extraction from a key.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
COLUMNS_PER_CALL = 4  # one Philox call: the words of 4 adjacent key columns


def _u32(x):
    return jnp.asarray(x, jnp.uint32)


def _mulhilo(a: int, b):
    """(hi, lo) of the 64-bit product of the constant `a` and uint32 array `b`, from 16-bit
    halves (no 64-bit integers needed)."""
    a_lo, a_hi = _u32(a & 0xFFFF), _u32(a >> 16)
    b_lo, b_hi = b & _u32(0xFFFF), b >> _u32(16)
    ll = a_lo * b_lo
    hl = a_hi * b_lo
    lh = a_lo * b_hi
    hh = a_hi * b_hi
    cross = (ll >> _u32(16)) + (hl & _u32(0xFFFF)) + lh  # < 2**32: no wrap-around
    hi = hh + (hl >> _u32(16)) + (cross >> _u32(16))
    lo = b * _u32(a)  # uint32 multiplication wraps: the low word
    return hi, lo


def philox4x32(counter, key):
    """Philox-4x32-10: counter (c0, c1, c2, c3) and key (k0, k1), uint32 arrays that
    broadcast together -> the four uint32 words (w0, w1, w2, w3)."""
    c0, c1, c2, c3 = (_u32(c) for c in counter)
    k0, k1 = (_u32(k) for k in key)
    for r in range(PHILOX_ROUNDS):
        if r:
            k0 = k0 + _u32(PHILOX_W0)
            k1 = k1 + _u32(PHILOX_W1)
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def threshold(rate: float) -> int:
    """floor(rate · 2**32) for the float32 rate: words below it drop their element."""
    return int(np.floor(np.float64(np.float32(rate)) * 2.0**32))


def keep_scale(rate: float, dtype=jnp.float32):
    """1 / (1 - rate) in `dtype` (float32, or float64 for float64 inputs)."""
    r = np.asarray(np.float32(rate), dtype)
    return np.asarray(1, dtype) / (np.asarray(1, dtype) - r)


def keep_mask(seed, rate: float, batch, head, row, col):
    """Bool: element (batch, head, row, col) is kept. The four index arrays are integer
    and broadcast together (any shape); seed: uint32 [2]. Each element runs its own Philox
    call (the simple form; `keep_mask_groups` shares one call per 4 columns)."""
    col = _u32(col)
    words = philox4x32((col >> _u32(2), row, head, batch), (seed[0], seed[1]))
    sub = col & _u32(3)
    w = jnp.where(sub == 0, words[0], jnp.where(sub == 1, words[1], jnp.where(sub == 2, words[2], words[3])))
    return w >= _u32(threshold(rate))


def keep_mask_groups(seed, rate: float, batch, head, row, col0, width: int):
    """Bool [..., width]: the keep bits of columns col0 .. col0 + width - 1 of every
    (batch, head, row) (integer arrays broadcasting to [...]); col0 (int or traced scalar)
    a multiple of 4 and width a multiple of 4: one Philox call per 4 columns."""
    if width % COLUMNS_PER_CALL:
        raise ValueError(f"width must be a multiple of {COLUMNS_PER_CALL}, got {width}")
    groups = width // COLUMNS_PER_CALL
    g = _u32(col0) // _u32(COLUMNS_PER_CALL) + jnp.arange(groups, dtype=jnp.uint32)
    ex = lambda x: _u32(x)[..., None]
    words = philox4x32((g, ex(row), ex(head), ex(batch)), (seed[0], seed[1]))
    words = jnp.stack(jnp.broadcast_arrays(*words), axis=-1)  # [..., groups, 4]
    words = words.reshape(*words.shape[:-2], width)
    return words >= _u32(threshold(rate))


# ----------------------------------------------------------------------- argument checks


def check_rate(rate) -> float:
    """The float32 value of a valid dropout rate in [0, 1) as a Python float."""
    if isinstance(rate, (bool, np.bool_)) or not isinstance(rate, numbers.Real):
        raise TypeError(f"dropout_rate must be a Python float in [0, 1), got {rate!r}")
    r = float(np.float32(rate))
    if not (0.0 <= float(rate) < 1.0) or not r < 1.0:
        raise ValueError(
            "dropout_rate must be in [0, 1) (the probability of dropping an attention "
            f"weight; 1 would drop every weight), got {rate!r}"
        )
    return r


def seed_from_key(rng) -> jax.Array:
    """uint32 [2]: the bits of a `jax.random` key (a typed key, jax.random.key, or a
    legacy uint32[2] jax.random.PRNGKey) that seed Philox."""
    if rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng, a jax.random key; got None")
    if isinstance(rng, (str, bytes, numbers.Number)):
        raise TypeError(f"dropout_rng must be a jax.random key, got {type(rng).__name__} {rng!r}")
    typed = hasattr(rng, "dtype") and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(rng) if typed else jnp.asarray(rng)
    if data.dtype != jnp.uint32 or data.ndim != 1 or data.shape[0] < 2:
        raise TypeError(
            "dropout_rng must be one jax.random key (jax.random.key(...) or a uint32[2] "
            f"jax.random.PRNGKey(...)), got shape {tuple(data.shape)} and dtype {data.dtype}"
        )
    # Implementations with wider keys (rbg: uint32[4]) seed Philox with their first two words.
    return data[:2]

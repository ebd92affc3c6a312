"""flex_attention's user functions inside the `pallas` kernels: a scalar function evaluated on
a whole tile.

A `score_mod` or `mask_mod` is written on scalars and closes over arrays (`_flex.close`
hoists them). Inside a Triton kernel a function cannot be vmapped, and a `gather` of a
loaded array has no Triton lowering. So the kernels walk the function's jaxpr once per tile
(`evaluate`): each primitive is applied to the tile's operands as they are (rows [bq, 1],
columns [1, bk], scalars for b and h, broadcast to their common shape), and each read of a
closed-over array (`dynamic_slice` of one element, then `squeeze`/`reshape`, which is what
`x[i, j]` on scalars traces to) becomes a load from that array's ref with index tiles. An
index is clamped into the array as `dynamic_slice` clamps it, so a padded row or column
never reads outside the array. `reason` says, before any kernel is built, whether a
function can be evaluated this way.
"""

from __future__ import annotations

from typing import Any

import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jax_flash._flex import ClosedFunction

# Primitives that call a sub-jaxpr (jnp helpers such as clip, where, floor_divide, and
# custom derivative rules): evaluated inline, their derivative rules ignored (the tile's
# derivative is taken through the primal primitives).
_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
}
# Shape-only primitives that are identities on a scalar program's values.
_SHAPE_ONLY = {"squeeze", "reshape", "broadcast_in_dim", "expand_dims"}


class _Const:
    """A closed-over array's ref (the whole array in the kernel); bool_: a bool array, which
    travels as int8 (Triton has no i1 memory type)."""

    def __init__(self, ref, bool_: bool):
        self.ref, self.bool_ = ref, bool_


class _Read:
    """One element of a closed-over array per position, `const[index...]`, not yet loaded."""

    def __init__(self, const: _Const, index: tuple):
        self.const, self.index = const, index


def _inner(eqn) -> Any:
    """The jaxpr (or closed jaxpr) a call primitive calls."""
    return eqn.params[_CALLS[eqn.primitive.name]]


def _walk(jaxpr, const_is_array: list[bool], path: str) -> str | None:
    """Why `jaxpr` (consts flagged by const_is_array) cannot be evaluated on tiles, or None."""
    arrays = {v for v, is_arr in zip(jaxpr.constvars, const_is_array) if is_arr}
    reads = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
        first = ins[0] if ins and ins[0] is eqn.invars[0] else None
        if name in _CALLS:
            inner = _inner(eqn)
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            if any(v in arrays for v in ins):
                return f"{path}: a closed-over array is passed whole into {name}; index it with scalars (x[i, j])"
            if getattr(inner, "consts", None):
                return f"{path}: {name} holds constant arrays; close over them in the outer function"
            why = _walk(inner_jaxpr, [], f"{path} > {name}")
            if why:
                return why
            continue
        if name == "dynamic_slice" and first in arrays:
            if any(size != 1 for size in eqn.params["slice_sizes"]):
                return (
                    f"{path}: reads a slice {tuple(eqn.params['slice_sizes'])} of a closed-over array; "
                    "the pallas kernels read one element per position (x[i, j] with scalar indices)"
                )
            reads.add(eqn.outvars[0])
            continue
        if name == "slice" and first in arrays:  # x[3] with a static index
            sizes = np.subtract(eqn.params["limit_indices"], eqn.params["start_indices"])
            if np.any(sizes != 1) or any(st not in (None, 1) for st in eqn.params["strides"] or ()):
                return (
                    f"{path}: reads a slice of a closed-over array; the pallas kernels read one element per "
                    "position (x[i, j] with scalar indices)"
                )
            reads.add(eqn.outvars[0])
            continue
        if name in ("squeeze", "reshape") and first in arrays and np.prod(eqn.invars[0].aval.shape) == 1:
            reads.add(eqn.outvars[0])  # the one element of a [1, ...] array
            continue
        if name in ("squeeze", "reshape") and first in reads:
            reads.add(eqn.outvars[0])
            continue
        for v in ins:
            if v in arrays:
                return (
                    f"{path}: uses a closed-over array through {name}; the pallas kernels read "
                    "closed-over arrays one element per position (x[i, j] with scalar indices)"
                )
        if any(getattr(v.aval, "shape", ()) != () for v in eqn.outvars) and name not in _SHAPE_ONLY:
            return f"{path}: {name} makes a non-scalar value; write the function on scalars"
    return None


def reason(fn: ClosedFunction | None) -> str | None:
    """Why the pallas kernels cannot evaluate `fn` on tiles, or None."""
    if fn is None:
        return None
    is_array = [v.aval.shape != () for v in fn.jaxpr.constvars]
    return _walk(fn.jaxpr, is_array, fn.name)


def _tile_reads(jaxpr, deps_in: list[frozenset]) -> tuple[int, list[frozenset]]:
    """(reads of closed-over arrays whose index varies along both rows and columns, the
    outputs' dependencies): each variable depends on a subset of {"q", "k"}."""
    deps: dict = {}
    get = lambda v: frozenset() if isinstance(v, jex.Literal) else deps.get(v, frozenset())
    for v, d in zip(jaxpr.invars, deps_in):
        deps[v] = d
    count = 0
    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        union = frozenset().union(*ins)
        if eqn.primitive.name in _CALLS:
            inner = _inner(eqn)
            n, outs = _tile_reads(getattr(inner, "jaxpr", inner), ins)
            count += n
        else:
            operand = eqn.invars[0] if eqn.invars else None
            if eqn.primitive.name in ("dynamic_slice", "slice") and any(operand is c for c in jaxpr.constvars):
                count += union == {"q", "k"}
            outs = [union] * len(eqn.outvars)
        for v, d in zip(eqn.outvars, outs):
            deps[v] = d
    return count, [get(v) for v in jaxpr.outvars]


def tile_reads(fn: ClosedFunction | None, score: bool) -> int:
    """How many reads of closed-over arrays in `fn` (a score_mod when `score`) load a whole
    [bq, bk] tile (their index varies along rows and columns). Triton stages such a load's
    index or pointer tile through shared memory to meet the scores' layout (a [128, 128] tile
    of 64-bit pointers is 128 KiB), which the launch configuration must leave room for."""
    if fn is None:
        return 0
    q, k, none = frozenset({"q"}), frozenset({"k"}), frozenset[str]()
    deps = [q | k, none, none, q, k] if score else [none, none, q, k]
    return _tile_reads(fn.jaxpr, deps)[0]


def _common_shape(values) -> tuple[int, ...]:
    return tuple(np.broadcast_shapes(*(jnp.shape(x) for x in values)))


def _load(read: _Read):
    """The element of `read` at every position: one load with index tiles (a scalar load when
    every index is a scalar), each index clamped into the array as dynamic_slice clamps."""
    ref = read.const.ref
    shape = _common_shape(read.index)
    index = tuple(tile(jnp.clip(i, 0, d - 1), shape) for i, d in zip(read.index, ref.shape))
    value = ref[index]
    return value != 0 if read.const.bool_ else value


def evaluate(fn: ClosedFunction, const_refs, args):
    """fn's output at every position of the broadcast of `args` (index tiles, scalars and, for a
    score_mod, the score tile); closed-over arrays are read from `const_refs` (bool arrays
    travel as int8)."""
    (out,) = _evaluate(fn.jaxpr, [_Const(r, bool_) for r, bool_ in const_refs], list(args))
    return _value(out)


def _value(x):
    """A loaded value of x (a pending read loads here)."""
    if isinstance(x, _Read):
        return _load(x)
    if isinstance(x, _Const):
        v = x.ref[0]  # a 0-d array, passed as [1]
        return v != 0 if x.bool_ else v
    return x


def _evaluate(jaxpr, consts: list, args: list) -> list:
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [read(v) for v in eqn.invars]
        if name in _CALLS:
            inner = _inner(eqn)
            outs = _evaluate(getattr(inner, "jaxpr", inner), [], ins)
        elif name == "dynamic_slice" and isinstance(ins[0], _Const):
            outs = [_Read(ins[0], tuple(ins[1:]))]
        elif name == "slice" and isinstance(ins[0], _Const):
            outs = [_Read(ins[0], tuple(eqn.params["start_indices"]))]
        elif name in ("squeeze", "reshape") and isinstance(ins[0], _Const):  # a [1, ...] array
            outs = [_Read(ins[0], (0,) * ins[0].ref.ndim)]
        elif name in _SHAPE_ONLY:
            outs = [ins[0]]  # scalar program: a tile stays a tile
        else:
            vals = [_value(x) for x in ins]
            shape = _common_shape(vals)
            vals = [jnp.broadcast_to(x, shape) if jnp.shape(x) != shape else x for x in vals]
            out = eqn.primitive.bind(*vals, **eqn.params)
            outs = list(out) if eqn.primitive.multiple_results else [out]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def kernel_consts(consts) -> list:
    """The closed-over arrays as the kernels take them: bool as int8, 0-d as [1]."""
    out = []
    for c in consts:
        c = jnp.asarray(c)
        if c.dtype == jnp.bool_:
            c = c.astype(jnp.int8)
        if c.ndim == 0:
            c = c.reshape(1)
        out.append(c)
    return out


def tile(x, shape):
    """x broadcast to the tile `shape`."""
    return jnp.broadcast_to(x, shape) if jnp.shape(x) != tuple(shape) else x

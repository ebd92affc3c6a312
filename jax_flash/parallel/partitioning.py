"""Sharding rules for the compiled calls, so that they partition under plain `jax.jit`.

XLA cannot partition a custom call (an FFI target, a Triton `pallas_call`) unless told how:
left alone, it all-gathers every operand and each device computes the whole call. Here each
compiled forward and backward is wrapped in `jax.experimental.custom_partitioning` with

* a Shardy `sharding_rule` (einsum-like factors, one factory `sharding_rule` for every call):
  q, out, dout `b t n h`; k, v `b s k h` (with a value head dim Hv != H, v `b s k hv` and
  out, dout `b t n hv`: a factor of its own); lse, dlse `b n t`; lengths and the query offset
  `b`; segment ids `b t` / `b s`; a dense bias / mask `b n t s` (broadcast dims of size 1
  get factors of their own);
* the `partition` / `infer_sharding_from_operands` callbacks (GSPMD, when Shardy is off;
  `partition` is also what Shardy calls to lower the call on each device's shard).

What runs on local shards, with no collective in the forward:

* batch `b` and heads `n`/`k` (GQA: K/V heads sharded with the query heads, N and K both
  divisible by the axis size). If only the query heads are sharded and K/V are replicated
  over that axis, each device slices the kv heads its query heads use (no communication);
  the backward then all-reduces dK/dV over the head axis (each device holds a part of
  the sum). When the local query heads do not map onto whole kv heads, the query heads
  are gathered instead (reported, see below).
* queries over `t` with K/V not sharded over `s`: each shard runs with its own query
  offset (`q_offset + shard_index * T_local`, from `lax.axis_index`) and shard-local query
  lengths; segment ids shard with their sequence. The backward all-reduces dK/dV over the
  sequence axis (a sum over query shards). Causal and window masks need the offset (an
  implementation that does not take `query_offset` gets its queries gathered, reported).
* queries over `t` and K/V over `s` on one mesh axis (a sequence-sharded self-attention):
  ring attention (`jax_flash.parallel.ring`) inside the partitioned call, the K/V chunks
  rotating by collective-permute, forward and backward; lengths stay global, segment ids
  travel with their chunk. The layout is contiguous (the order of a sharded global array).

Everything else falls back to an all-gather that XLA inserts before the call, reported by
a one-time `ShardingFallbackWarning` per cause naming the mesh axis and the dimension:
K/V over `s` where the ring cannot run (queries not sharded over the same single axis, a
dense bias or mask, a block the implementation cannot serve), the head dim `h`, kv heads
sharded over other axes than the query heads, one mesh axis on two dimensions, a dim that
is not a multiple of its mesh axes' size.

A dense bias broadcast along a sharded dim (e.g. `[1, N, T, S]` with the batch sharded)
gets its gradient summed over those shards (an all-reduce in the backward).

The `xla` implementation is plain JAX and partitions without these rules.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import threading
import warnings
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_flash import _heuristics, _registry
from jax_flash._spec import AttentionSpec, MaskInputs
from jax_flash.parallel import ring


class ShardingFallbackWarning(UserWarning):
    """A sharded dimension that a compiled call cannot partition: XLA all-gathers it."""


# Factors of each array (None: a broadcast dim of size 1).
_Q = ("b", "t", "n", "h")
_KV = ("b", "s", "k", "h")
_OUT_HV = ("b", "t", "n", "hv")  # out, dout when Hv != H
_V_HV = ("b", "s", "k", "hv")  # v when Hv != H
_STAT = ("b", "n", "t")
_MASK_DIMS = {
    "bias": ("b", "n", "t", "s"),
    "mask": ("b", "n", "t", "s"),
    "q_lengths": ("b",),
    "kv_lengths": ("b",),
    "q_segment_ids": ("b", "t"),
    "kv_segment_ids": ("b", "s"),
    "q_offset": ("b",),
    "sinks": ("n",),  # one logit per query head: sharded with the query heads
    "dropout_seed": (None,),  # uint32 [2]: replicated, no batch axis
}

_DIM_NAMES = {
    "b": "the batch axis B",
    "t": "the query sequence axis T",
    "s": "the key/value sequence axis S",
    "n": "the query heads axis N",
    "k": "the key/value heads axis K",
    "h": "the head dim H",
    "hv": "the value head dim Hv",
}


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
    """One compiled call: the per-shard function and the factors of its arrays."""

    name: str  # implementation, for messages
    backward: bool
    fn: Callable  # fn(spec, q, k, v, masks[, out, lse, dout, dlse]) on local shards
    spec: AttentionSpec  # the global call
    fields: tuple  # the MaskInputs fields passed, in order
    operand_dims: tuple  # per operand: tuple of factor names (None = broadcast dim)
    result_dims: tuple


# ----------------------------------------------------------------------------- public


def forward(name: str, fn: Callable, spec: AttentionSpec, q, k, v, masks: MaskInputs):
    """fn(spec, q, k, v, masks) -> (out, lse), partitioned over the inputs' shardings; a
    flex_attention call unpartitioned (`_unpartitioned`)."""
    if _unpartitioned(spec):
        return fn(spec, q, k, v, masks)
    return _wrapped(name, False, fn, spec, q, k, v, masks, ())


def backward(
    name: str,
    fn: Callable,
    spec: AttentionSpec,
    q,
    k,
    v,
    masks: MaskInputs,
    out,
    lse,
    dout,
    dlse,
):
    """fn(spec, q, k, v, masks, out, lse, dout, dlse) -> (dq, dk, dv, dbias or None), as `forward`."""
    if _unpartitioned(spec):
        return fn(spec, q, k, v, masks, out, lse, dout, dlse)
    return _wrapped(name, True, fn, spec, q, k, v, masks, (out, lse, dout, dlse))


def _unpartitioned(spec: AttentionSpec) -> bool:
    """A flex_attention call has no sharding rule yet: it runs once on whole arrays (XLA
    gathers sharded inputs first), since its mask_mod and score_mod see global batch rows and
    heads, and the kernels' block operands and closed-over arrays have no rule of their own."""
    return spec.flex is not None


def sharding_rule(call: _Call, *_) -> str:
    """The Shardy rule of `call`, e.g. "b t n h, b s k h, b s k h -> b t n h, b n t"."""
    fresh = (f"one{i}" for i in itertools.count())

    def spell(dims):
        return " ".join(d if d is not None else next(fresh) for d in dims)

    return ", ".join(spell(d) for d in call.operand_dims) + " -> " + ", ".join(spell(d) for d in call.result_dims)


# ------------------------------------------------------------------------ the wrapping


def _wrapped(name, is_backward, fn, spec, q, k, v, masks, rest):
    fields = tuple(f for f in MaskInputs._fields if getattr(masks, f) is not None)
    mask_arrays = tuple(getattr(masks, f) for f in fields)
    operands = (q, k, v, *mask_arrays, *rest)
    out_dims, v_dims = (_Q, _KV) if spec.v_head_dim == spec.head_dim else (_OUT_HV, _V_HV)
    operand_dims: tuple[tuple[str | None, ...], ...] = (
        _Q,
        _KV,
        v_dims,
        *(_dims(_MASK_DIMS[f], getattr(masks, f)) for f in fields),
    )
    result_dims: tuple[tuple[str | None, ...], ...] = (out_dims, _STAT)
    if is_backward:
        operand_dims += (out_dims, _STAT, out_dims, _STAT)
        result_dims = (_Q, _KV, v_dims)
        if masks.bias is not None:
            result_dims += (_dims(_MASK_DIMS["bias"], masks.bias),)
    call = _Call(name, is_backward, fn, spec, fields, operand_dims, result_dims)
    # The dbias result has the batch extent of the bias operand (maybe a broadcast 1).
    like = {3: 3 + fields.index("bias")} if is_backward and masks.bias is not None else {}
    # Operands without a batch axis (sinks [N], the dropout seed [2]): passed as they
    # are under vmap, never mapped.
    unbatched = {}
    if "sinks" in fields:
        unbatched[3 + fields.index("sinks")] = "sinks"
    if "dropout_seed" in fields:
        unbatched[3 + fields.index("dropout_seed")] = "dropout_rng"
    outs = _fold_vmap(functools.partial(_PARTITIONED, call), like, unbatched)(*operands)
    if is_backward:
        dq, dk, dv, *dbias = outs
        return dq, dk, dv, (dbias[0] if dbias else None)
    return tuple(outs)


def _dims(dims, x):
    """Factor names of an operand: a dense [B|1, N|1, T|1, S|1] input has None (a factor
    of size 1 of its own) where it broadcasts."""
    if len(dims) != 4:
        return dims
    return tuple(None if n == 1 else d for n, d in zip(x.shape, dims))


def _run(call: _Call, *arrays):
    """The call on whole (unsharded, or already local) arrays."""
    return _local(call, None, _Plan())(*arrays)


_PARTITIONED = custom_partitioning(_run, static_argnums=(0,))


# ------------------------------------------------------------------------------ plans


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Mesh axes per factor that the call runs sharded over (missing = replicated)."""

    axes: tuple = ()  # ((factor, (axis, ...)), ...)
    slice_kv_heads: bool = False  # n sharded, k replicated: take the local kv heads
    # T and S sharded over the same mesh axes: how the call runs over them.
    sequence: SequenceDecision | None = None

    def of(self, factor) -> tuple:
        return dict(self.axes).get(factor, ())


_warned: set = set()
_warn_lock = threading.Lock()


def _warn_once(call: _Call, factor: str, axes: tuple, why: str):
    key = (factor, axes, why)
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    names = ", ".join(repr(a) for a in axes)
    warnings.warn(
        f"jax_flash.attention (implementation={call.name!r}): {_DIM_NAMES[factor]} is "
        f"sharded over mesh axis {names}, which this call cannot partition ({why}); XLA "
        f"all-gathers it over {names} before the call (every device holds the whole axis).",
        ShardingFallbackWarning,
        stacklevel=2,
    )


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _decide(call: _Call, mesh, arg_shapes, warn=None) -> _Plan:
    """Which factors run sharded, from the operands' shardings; warns about the rest
    (`warn(call, factor, axes, why)`, by default a one-time ShardingFallbackWarning)."""
    report = warn or _warn_once
    found: dict = {}
    sizes: dict = {}
    for dims, arg in zip(call.operand_dims, arg_shapes):
        sizes.update((d, n) for d, n in zip(dims, arg.shape) if d is not None)
        pspec = getattr(arg.sharding, "spec", None)
        if pspec is None:
            continue
        entries = tuple(pspec) + (None,) * (len(dims) - len(pspec))
        for d, entry in zip(dims, entries):
            a = _axes(entry)
            if d is not None and a and d not in found:
                found[d] = a
    spec = call.spec
    if spec.has_dropout:
        # The keep-mask counts global (batch, head, query, key) positions; a shard's call
        # would count its local ones and draw another mask. Every sharded dimension is
        # gathered, so each device draws the unsharded call's mask.
        for d, axes in found.items():
            report(
                call,
                d,
                axes,
                "attention dropout's keep-mask is counted by global (batch, head, query, key) "
                "positions, which a shard does not know",
            )
        return _Plan()
    used: set = set()
    plan: dict = {}
    for d, axes in list(found.items()):
        if sizes[d] % _size(mesh, axes):
            report(call, d, axes, f"{sizes[d]} is not a multiple of {_size(mesh, axes)} devices")
            del found[d]

    def take(factor, axes):
        if any(a in used for a in axes):
            report(call, factor, axes, "the mesh axis already shards another dimension")
            return
        used.update(axes)
        plan[factor] = axes

    if found.get("b"):
        take("b", found["b"])
    n_axes, k_axes = found.get("n", ()), found.get("k", ())
    slice_kv = False
    if k_axes and k_axes != n_axes:
        report(
            call,
            "k",
            k_axes,
            "the key/value heads must be sharded over the same mesh axes as the query heads",
        )
        k_axes = ()
    if n_axes:
        group = spec.num_heads // spec.num_kv_heads
        local = spec.num_heads // _size(mesh, n_axes)
        if k_axes:
            take("n", n_axes)
            if "n" in plan:
                plan["k"] = n_axes
        elif local % group == 0 or group % local == 0:
            # Only the query heads are sharded: each device slices the kv heads it uses.
            take("n", n_axes)
            slice_kv = "n" in plan
        else:
            report(
                call,
                "n",
                n_axes,
                f"{local} local query heads do not cover whole groups of {group} query heads per kv head",
            )
    t_axes, s_axes = found.get("t", ()), found.get("s", ())
    sequence = None
    if s_axes:
        why = _sequence_unavailable(call, t_axes, s_axes, plan)
        if why is None:
            sequence = sequence_decision(call.name, _shard_spec(call.spec, mesh, plan, slice_kv), mesh, s_axes)
            why = sequence.why
            if sequence.scheme is None:
                sequence = None
        if sequence is not None:  # T and S over the same axes: ring, all-to-all or hybrid
            take("t", t_axes)
            plan["s"] = s_axes
        else:
            report(call, "s", s_axes, why)
    if t_axes and sequence is None and "t" not in plan:
        why = _query_shard_unsupported(call)
        if why is None:
            take("t", t_axes)
        else:
            report(call, "t", t_axes, why)
    if found.get("h"):
        report(call, "h", found["h"], "the head dim is contracted inside the kernel")
    if found.get("hv"):
        report(call, "hv", found["hv"], "the value head dim is contracted inside the kernel")
    return _Plan(tuple(sorted(plan.items())), slice_kv, sequence)


def _sequence_unavailable(call: _Call, t_axes, s_axes, plan) -> str | None:
    """None if K/V sharded over `s_axes` may run sequence-parallel (ring, all-to-all or
    hybrid) inside the partitioned call, else why not."""
    spec = call.spec
    if tuple(t_axes) != tuple(s_axes):
        return (
            f"sequence parallelism (ring, all-to-all, hybrid) needs the queries sharded over T on "
            f"the same mesh axes {tuple(s_axes)}; they are sharded over {t_axes or 'no axis'}"
        )
    if any(a in {x for v in plan.values() for x in v} for a in s_axes):
        return "the mesh axis already shards another dimension"
    if spec.bias_shape is not None or spec.mask_shape is not None:
        return "sequence parallelism here takes no dense bias or mask"
    if spec.has_sinks:
        return "sequence parallelism here takes no sinks"
    return None


def _shard_spec(spec: AttentionSpec, mesh, plan: dict, slice_kv: bool) -> AttentionSpec:
    """`spec` with this device's batch rows and heads (global T and S)."""
    n = spec.num_heads // _size(mesh, plan.get("n", ()))
    k = max(1, n // spec.group_size) if slice_kv else spec.num_kv_heads // _size(mesh, plan.get("k", ()))
    return dataclasses.replace(spec, batch=spec.batch // _size(mesh, plan.get("b", ())), num_heads=n, num_kv_heads=k)


# ------------------------------------------------------------------ sequence parallelism


@dataclasses.dataclass(frozen=True)
class SequenceDecision:
    """How a call with q, k, v sharded over the sequence (mesh axes `axes`) runs under jit.

    scheme: "ring" (over every axis of `axes`), "all_to_all" (over every axis), "hybrid"
    (the ring over all but the last axis, the all-to-all over the last, minor one), or None
    (none can run: XLA gathers K/V, `why` says why). moved: ((scheme, (forward, backward)
    bytes one device sends), ...) of the schemes that can run; unavailable: ((scheme, why),
    ...) of the others; forced: the scheme came from `Config.sequence_parallel`."""

    axes: tuple
    scheme: str | None
    ring_axes: tuple = ()
    a2a_axes: tuple = ()
    moved: tuple = ()
    unavailable: tuple = ()
    forced: bool = False
    why: str = ""

    def words(self) -> str:
        """One line for `explain`."""
        sizes = ", ".join(f"{s}: {f + b} B" for s, (f, b) in self.moved)
        over = f"sequence over mesh axes {self.axes}"
        if self.scheme is None:
            return f"{over}: K/V all-gathered ({self.why})"
        how = {
            "ring": f"ring over {self.ring_axes}",
            "all_to_all": f"all-to-all over {self.a2a_axes}",
            "hybrid": f"hybrid: all-to-all over {self.a2a_axes}, ring over {self.ring_axes}",
        }[self.scheme]
        rule = (
            "forced by Config.sequence_parallel / JAX_FLASH_SEQUENCE_PARALLEL"
            if self.forced
            else "the fewest bytes sent per device, forward + backward"
        )
        text = f"{over}: {how} ({rule}; {sizes})"
        if self.unavailable:
            text += "; not " + "; not ".join(f"{s}: {w}" for s, w in self.unavailable)
        return text


def _ring_why(name: str, spec: AttentionSpec, axes: tuple, size: int) -> str | None:
    cfg = ring.RingConfig(name, axes, size)
    for block in ring.block_specs(spec, cfg, dynamic_offset=spec.has_q_offset):
        why = _registry.reason(name, block)
        if why is not None:
            return f"a block of the ring cannot run: {name} {why}"
    return None


def _a2a_spec(spec: AttentionSpec, size: int) -> AttentionSpec:
    """The local call of an all-to-all over `size` devices: N/size heads, the kv heads
    repeated to lcm(K, size) and split the same way."""
    kx = math.lcm(spec.num_kv_heads, size)
    return dataclasses.replace(spec, num_heads=spec.num_heads // size, num_kv_heads=kx // size)


def _a2a_why(name: str, spec: AttentionSpec, axes: tuple, size: int) -> str | None:
    if spec.num_heads % size:
        return f"the N={spec.num_heads} query heads are not divisible by the {size} devices of {axes}"
    local = _a2a_spec(spec, size)
    if local.num_heads % local.num_kv_heads:
        return f"{local.num_heads} local query heads do not cover whole kv heads"
    why = _registry.reason(name, local)
    return None if why is None else f"{name} {why}"


def sequence_decision(name: str, spec: AttentionSpec, mesh, axes: tuple) -> SequenceDecision:
    """Which sequence-parallel scheme runs `spec` (this device's batch rows and heads, the
    global T and S) with T and S sharded over mesh axes `axes`, by implementation `name`.

    The candidates: the ring over all of `axes` (any head count; every block must be served),
    the all-to-all over all of `axes` (the heads divisible by their size), and with two or
    more axes the hybrid (all-to-all over the last axis, whose size must divide the heads;
    the ring over the others). The rule (`_heuristics.sequence_parallel_choice`): the one
    that sends the fewest bytes per device, forward plus backward
    (`_heuristics.sequence_parallel_bytes`); `Config.sequence_parallel` may force one, and a
    forced scheme that cannot run is a ValueError."""
    axes = tuple(axes)
    p = _size(mesh, axes)
    acc = 8 if spec.dtype == "float64" else 4
    candidates: dict = {}  # scheme -> (ring_axes, a2a_axes, why)
    candidates["all_to_all"] = ((), axes, _a2a_why(name, spec, axes, p))
    if len(axes) >= 2:
        ra, aa = axes[:-1], axes[-1:]
        pa = _size(mesh, aa)
        why = _a2a_why(name, spec, aa, pa)
        if why is None:
            why = _ring_why(name, _a2a_spec(spec, pa), ra, _size(mesh, ra))
        candidates["hybrid"] = (ra, aa, why)
    candidates["ring"] = (axes, (), _ring_why(name, spec, axes, p))
    moved = {}
    for scheme, (ra, aa, why) in candidates.items():
        if why is None:
            moved[scheme] = _heuristics.sequence_parallel_bytes(scheme, spec, _size(mesh, ra), _size(mesh, aa), acc)
    unavailable = tuple((s, c[2]) for s, c in candidates.items() if c[2] is not None)
    if len(axes) < 2:
        unavailable += (("hybrid", "it needs the sequence sharded over two mesh axes (ring major, all-to-all minor)"),)
    setting = spec.settings.get("sequence_parallel")
    forced = setting != "auto"
    if forced:
        if setting not in moved:
            why = dict(unavailable)[setting]
            raise ValueError(
                f"Config.sequence_parallel={setting!r} (JAX_FLASH_SEQUENCE_PARALLEL) cannot run this "
                f"sequence-sharded call of {name} over mesh axes {axes}: {why}"
            )
        scheme = setting
    elif moved:
        scheme = _heuristics.sequence_parallel_choice({s: f + b for s, (f, b) in moved.items()})
    else:
        scheme = None
    ra, aa = candidates[scheme][:2] if scheme is not None else ((), ())
    why = "; ".join(f"{s}: {w}" for s, w in unavailable) if scheme is None else ""
    return SequenceDecision(axes, scheme, ra, aa, tuple(moved.items()), unavailable, forced, why)


def _query_shard_unsupported(call: _Call) -> str | None:
    """None if a shard of the queries can run on its own (with its query offset when the
    masks need positions), else why not."""
    spec = call.spec
    if not spec.is_windowed or spec.has_q_offset:
        return None
    why = _registry.reason(call.name, dataclasses.replace(spec, has_q_offset=True))
    if why is not None:
        return f"causal and window masks of a query shard need its offset in the sequence, and {call.name} {why}"
    return None


def _sharding(mesh, plan: _Plan, dims) -> NamedSharding:
    entries = []
    for d in dims:
        a = plan.of(d) if d is not None else ()
        entries.append(None if not a else (a[0] if len(a) == 1 else a))
    return NamedSharding(mesh, PartitionSpec(*entries))


def _infer(call: _Call, mesh, arg_shapes, result_shape):
    plan = _decide(call, mesh, arg_shapes)
    return tuple(_sharding(mesh, plan, d) for d in call.result_dims)


def _partition(call: _Call, mesh, arg_shapes, result_shape):
    plan = _decide(call, mesh, arg_shapes)
    args = tuple(_sharding(mesh, plan, d) for d in call.operand_dims)
    results = tuple(_sharding(mesh, plan, d) for d in call.result_dims)
    return mesh, _local(call, mesh, plan), results, args


_PARTITIONED.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer,
    sharding_rule=sharding_rule,
)


def explain_sequence(name: str, spec: AttentionSpec, shardings) -> str | None:
    """What `explain` says of a call whose q, k, v (canonical [B, T, N, H] shapes in `spec`)
    carry `shardings` (NamedShardings, or None where unknown): how the sequence-sharded call
    runs under jax.jit, or None when K/V are not sharded over the sequence."""
    if any(getattr(s, "spec", None) is None or getattr(s, "mesh", None) is None for s in shardings):
        return None
    mesh = shardings[0].mesh
    k_spec = tuple(shardings[1].spec)
    if len(k_spec) < 2 or not _axes(k_spec[1]):
        return None
    if name == "xla":
        return f"sequence over mesh axes {_axes(k_spec[1])}: xla is plain JAX, partitioned by XLA itself"
    v_dims = _KV if spec.v_head_dim == spec.head_dim else _V_HV
    call = _Call(name, False, _run, spec, (), (_Q, _KV, v_dims), ((), ()))  # fn unused: decided only
    shapes = (
        (spec.batch, spec.q_len, spec.num_heads, spec.head_dim),
        (spec.batch, spec.kv_len, spec.num_kv_heads, spec.head_dim),
        (spec.batch, spec.kv_len, spec.num_kv_heads, spec.v_head_dim),
    )
    args = [_Shape(shape, s) for shape, s in zip(shapes, shardings)]
    found: dict = {}
    plan = _decide(call, mesh, args, warn=lambda c, factor, axes, why: found.setdefault(factor, why))
    if plan.sequence is not None:
        return plan.sequence.words()
    return f"sequence over mesh axes {_axes(k_spec[1])}: K/V all-gathered ({found.get('s', 'not partitioned')})"


@dataclasses.dataclass(frozen=True)
class _Shape:
    shape: tuple
    sharding: object


# ---------------------------------------------------------------- the per-shard call


def _shard_index(mesh, axes):
    """Linear index of this device along `axes` (major to minor, as PartitionSpec)."""
    idx = jnp.int32(0)
    for a in axes:
        idx = idx * mesh.shape[a] + lax.axis_index(a).astype(jnp.int32)
    return idx


def _local_spec(spec: AttentionSpec, q, k, masks: MaskInputs) -> AttentionSpec:
    return dataclasses.replace(
        spec,
        batch=q.shape[0],
        q_len=q.shape[1],
        kv_len=k.shape[1],
        num_heads=q.shape[2],
        num_kv_heads=k.shape[2],
        bias_shape=None if masks.bias is None else tuple(masks.bias.shape),
        mask_shape=None if masks.mask is None else tuple(masks.mask.shape),
        has_q_offset=masks.q_offset is not None,
    )


def _local(call: _Call, mesh, plan: _Plan):
    """The function each device runs on its shards (collectives only where they are sums
    over shards: dK/dV over query shards and over query-head shards)."""
    spec = call.spec
    nf = len(call.fields)

    def run(*arrays):
        q, k, v = arrays[:3]
        masks = MaskInputs(**dict(zip(call.fields, arrays[3 : 3 + nf])))
        rest = arrays[3 + nf :]
        kv_start = None
        if plan.slice_kv_heads:
            # Local query heads [i·Nl, (i+1)·Nl) use kv heads [i·Nl // G, ...) of the
            # replicated K/V: Nl / G of them, or one when G is a multiple of Nl.
            n_local, group = q.shape[2], spec.group_size
            k_local = max(1, n_local // group)
            kv_start = (_shard_index(mesh, plan.of("n")) * n_local) // group
            k = lax.dynamic_slice_in_dim(k, kv_start, k_local, axis=2)
            v = lax.dynamic_slice_in_dim(v, kv_start, k_local, axis=2)
        if plan.of("t") and plan.sequence is None:
            t_local = q.shape[1]
            start = _shard_index(mesh, plan.of("t")) * t_local
            if masks.q_lengths is not None:
                masks = masks._replace(q_lengths=jnp.clip(masks.q_lengths - start, 0, t_local))
            if spec.is_windowed:
                off = masks.q_offset if masks.q_offset is not None else 0
                masks = masks._replace(q_offset=(off + start + jnp.zeros((q.shape[0],), jnp.int32)).astype(jnp.int32))
        local_spec = _local_spec(spec, q, k, masks)
        if plan.sequence is not None:
            results = _sequence_call(call, mesh, plan.sequence, local_spec, q, k, v, masks, rest)
        else:
            results = call.fn(local_spec, q, k, v, masks, *rest)
        if not call.backward:
            return tuple(results)
        dq, dk, dv, dbias = results
        if kv_start is not None:
            full = arrays[1].shape
            dk = lax.dynamic_update_slice_in_dim(jnp.zeros(full, dk.dtype), dk, kv_start, 2)
            dv = lax.dynamic_update_slice_in_dim(jnp.zeros(full, dv.dtype), dv, kv_start, 2)
        results = [dq, dk, dv] + ([dbias] if masks.bias is not None else [])
        return tuple(_sum_partials(plan, r, d) for r, d in zip(results, call.result_dims))

    return run


def _sequence_call(call: _Call, mesh, seq: SequenceDecision, local_spec, q, k, v, masks, rest):
    """The call on this device's sequence chunks, by the scheme `seq` chose: all-to-all to
    head-sharded full sequences (all_to_all, hybrid) and back; the ring over the ring axes
    (ring, hybrid), with global lengths, offsets and positions."""
    pa, pr = _size(mesh, seq.a2a_axes), _size(mesh, seq.ring_axes)
    kh = k.shape[2]
    r = math.lcm(kh, pa) // kh  # kv head repeats: every device gets the kv heads it uses
    a2a = _AllToAll(seq.a2a_axes, pa)
    if pa > 1:
        q = a2a.to_heads(q, 1, 2)
        k, v = (a2a.to_heads(jnp.repeat(x, r, axis=2) if r > 1 else x, 1, 2) for x in (k, v))
        masks = masks._replace(
            q_segment_ids=a2a.gather(masks.q_segment_ids, 1),
            kv_segment_ids=a2a.gather(masks.kv_segment_ids, 1),
        )
        if call.backward:
            out, lse, dout, dlse = rest
            rest = (
                a2a.to_heads(out, 1, 2),
                a2a.to_heads(lse, 2, 1),
                a2a.to_heads(dout, 1, 2),
                a2a.to_heads(dlse, 2, 1),
            )
    spec = dataclasses.replace(
        local_spec,
        q_len=q.shape[1] * pr,
        kv_len=k.shape[1] * pr,
        num_heads=q.shape[2],
        num_kv_heads=k.shape[2],
    )
    if pr > 1:
        # This runs as the primal forward or backward inside the one custom_vjp (_vjp.py),
        # so it takes the ring's forward and backward, not the ring's own custom_vjp.
        cfg = ring.RingConfig(call.name, seq.ring_axes if len(seq.ring_axes) > 1 else seq.ring_axes[0], pr)
        if not call.backward:
            results = ring.ring_forward(cfg, spec, q, k, v, masks)
        else:
            results = (*ring.ring_backward(cfg, spec, q, k, v, masks, *rest), None)
    else:
        results = call.fn(spec, q, k, v, masks, *rest)
    if pa == 1:
        return results
    if not call.backward:
        out, lse = results
        return a2a.to_sequence(out, 1, 2), a2a.to_sequence(lse, 2, 1)
    dq, dk, dv, dbias = results
    dq = a2a.to_sequence(dq, 1, 2)
    dk, dv = (a2a.to_sequence(x, 1, 2) for x in (dk, dv))
    if r > 1:  # the repeat's transpose: the replicas' gradients summed
        dk, dv = (
            x.reshape(*x.shape[:2], kh, r, x.shape[3]).sum(axis=3, dtype=jnp.float32).astype(x.dtype) for x in (dk, dv)
        )
    return dq, dk, dv, dbias


class _AllToAll:
    """The sequence <-> heads re-sharding over mesh axes `axes` (p devices, in order)."""

    def __init__(self, axes: tuple, p: int):
        self.axes, self.p = (axes[0] if len(axes) == 1 else axes), p

    def to_heads(self, x, seq_axis: int, head_axis: int):
        """[.., T/p (seq_axis), .., N (head_axis), ..] -> [.., T, .., N/p, ..]."""
        return lax.all_to_all(x, self.axes, split_axis=head_axis, concat_axis=seq_axis, tiled=True)

    def to_sequence(self, y, seq_axis: int, head_axis: int):
        """The inverse of `to_heads`."""
        return lax.all_to_all(y, self.axes, split_axis=seq_axis, concat_axis=head_axis, tiled=True)

    def gather(self, x, seq_axis: int):
        """Segment ids: the whole sequence (None stays None)."""
        return None if x is None else lax.all_gather(x, self.axes, axis=seq_axis, tiled=True)


def _sum_partials(plan: _Plan, x, dims):
    """A cotangent whose factors do not cover every sharded mesh axis holds this device's
    part of a sum over those axes (dK/dV over query shards, dbias over broadcast dims)."""
    present = {a for d in dims if d is not None for a in plan.of(d)}
    missing = tuple(a for _, axes in plan.axes for a in axes if a not in present)
    if not missing:
        return x
    return lax.psum(x.astype(jnp.float32), missing).astype(x.dtype)


# ------------------------------------------------------------------------------- vmap


def _fold_vmap(fn, like: dict, unbatched: dict | None = None):
    """Make `fn(*arrays)` (every operand and result has a leading batch axis of size B, or
    1 where a dense bias/mask broadcasts) fold a vmapped axis into that batch axis:
    [V, B, ...] -> [V·B, ...] -> fn -> [V, B, ...]: one call, never a loop over V.

    like: {result index: operand index} for a result with the batch extent of an operand
    (dbias of a bias): the operand is expanded to B rows and the result summed back.
    unbatched: {operand index: name} of operands without a batch axis (sinks [N], the
    dropout seed [2]): passed as they are; vmapping over one is an error naming it.
    """
    unbatched = unbatched or {}

    @custom_vmap
    def folded(*args):
        return tuple(fn(*args))

    @folded.def_vmap
    def rule(axis_size, in_batched, *args):
        b = args[0].shape[1] if in_batched[0] else args[0].shape[0]
        expanded = set(like.values())
        flat, broadcast = [], {}
        for i, (a, batched) in enumerate(zip(args, in_batched)):
            if i in unbatched:
                if batched:
                    raise ValueError(
                        f"{unbatched[i]} cannot be mapped by jax.vmap in the compiled "
                        "implementations (one value for the whole call: sinks per query head, "
                        "one dropout key); map only query, key and value, or use "
                        "implementation='xla'"
                    )
                flat.append(a)
                broadcast[i] = False
                continue
            lead = a.shape[1] if batched else a.shape[0]
            broadcast[i] = lead != b
            if not batched and lead != b and i not in expanded:
                flat.append(a)  # a batch-broadcast dense input stays broadcast
                continue
            if not batched:
                a = jnp.broadcast_to(a, (axis_size, *a.shape))
            if lead != b:
                a = jnp.broadcast_to(a, (axis_size, b, *a.shape[2:]))
            flat.append(a.reshape(axis_size * b, *a.shape[2:]))
        outs = folded(*flat)
        unfolded = []
        for j, o in enumerate(outs):
            o = o.reshape(axis_size, b, *o.shape[1:])
            if j in like and broadcast[like[j]]:
                o = jnp.sum(o, axis=1, keepdims=True)
            unfolded.append(o)
        return tuple(unfolded), (True,) * len(unfolded)

    return folded

"""A fuzz test of the native boundary: every registered FFI target, called directly with
`jax.ffi.ffi_call` (none of jax_flash's Python checks in between), with wrong operand and
result counts, shapes and dtypes, broadcast operands (bias, mask) of wrong sizes, attribute
values out of range, attributes missing, extra or of the wrong type, a block mask's operands
(block_states, block_slots, block_bits) of wrong shapes or dtypes, must raise an XLA error
whose message names what is wrong: never crash, hang or touch memory outside its buffers (the
emulated CUDA targets check every global access). Valid calls, also with hostile values in
valid shapes (lengths, offsets, page ids, segment ids out of every range; NaN and ±inf in the
inputs), run as the control: they must succeed.

The cases run in subprocesses, many per process, so that a crash fails this test instead of
killing pytest; each process reports every case before running it, so a crash or a hang names
its case. Seeded: JAX_FLASH_FUZZ_SEED (default 0) and JAX_FLASH_FUZZ_CASES (mutated cases per
target, default 40) reproduce or deepen a run.

TARGETS below is the one place that states each target's signature: a change of operands,
results or attributes on the C++ side is a change there.

`PYTHONPATH=. python tests/internals/test_ffi_fuzz.py <target> <seed> <cases>` runs one target's
cases in this process and prints each case and its error as JSON lines.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

# The checkout, or a copy of it without jax_flash/ (testing an installed wheel).
ROOT = pathlib.Path(__file__).resolve().parents[2]

# ---- the signatures: the one table ---------------------------------------------------------
#
# A shape is a tuple of dim symbols (or ints); "x" as a dtype is the call's element dtype.
# Symbols: B batch, T queries, S keys (the paged targets: MP · PS), N query heads, K kv heads,
# H the query/key head dim, V the value head dim; P, PS, MP the paged cache's num_pages,
# page_size, max_pages. "bias" / "mask" are the dense operands' shapes of the call ((0,): none);
# "block_states", "block_slots", "block_bits" the block mask's ((0,): none).

X = "x"
DIMS = dict(B=2, T=3, S=6, N=4, K=2, H=32, V=32, P=3, PS=2, MP=3)
assert DIMS["S"] == DIMS["MP"] * DIMS["PS"]
# A block mask of 2 x 40 blocks (two u32 words per bit row) over T = 3, S = 6: nq = 2, nk = 1,
# with bits for 3 partly visible blocks.
BLOCK_Q, BLOCK_K, BLOCK_CAPACITY = 2, 40, 3


def block_variant(batch=None, heads=None) -> dict:
    """The variant of a call with a valid block mask ([B|1, N|1] rows)."""
    b = DIMS["B"] if batch is None else batch
    n = DIMS["N"] if heads is None else heads
    nq, nk = -(-DIMS["T"] // BLOCK_Q), -(-DIMS["S"] // BLOCK_K)
    return {
        "block_states": (b, n, nq, nk),
        "block_slots": (b, n, nq, nk),
        "block_bits": (BLOCK_CAPACITY, BLOCK_Q, -(-BLOCK_K // 32)),
        "attributes": dict(block_q=np.int64(BLOCK_Q), block_k=np.int64(BLOCK_K)),
    }


@dataclass(frozen=True)
class Buffer:
    name: str  # as the handlers' messages name it
    shape: tuple
    dtype: str


def _mask_operands():
    return (
        Buffer("q_lengths", ("B",), "int32"),
        Buffer("kv_lengths", ("B",), "int32"),
        Buffer("q_segment_ids", ("B", "T"), "int32"),
        Buffer("kv_segment_ids", ("B", "S"), "int32"),
        Buffer("q_offset", ("B",), "int32"),
        Buffer("bias", "bias", "bias"),
        Buffer("mask", "mask", "bool"),
        Buffer("block_states", "block_states", "int8"),
        Buffer("block_slots", "block_slots", "int32"),
        Buffer("block_bits", "block_bits", "uint32"),
    )


BLOCK_OPERANDS = ("block_states", "block_slots", "block_bits")


Q = Buffer("q", ("B", "T", "N", "H"), X)
K = Buffer("k", ("B", "S", "K", "H"), X)
V = Buffer("v", ("B", "S", "K", "V"), X)
K_PAGES = Buffer("k", ("P", "PS", "K", "H"), X)
V_PAGES = Buffer("v", ("P", "PS", "K", "V"), X)
PAGE_TABLE = Buffer("page_table", ("B", "MP"), "int32")
SINKS = Buffer("sinks", ("N",), "float32")
SEED = Buffer("dropout_seed", (2,), "uint32")
ROUTE = Buffer("route", (0,), "int32")  # the CUDA targets' own operand: [0], not routed
OUT = Buffer("out", ("B", "T", "N", "V"), X)
LSE = Buffer("lse", ("B", "N", "T"), "float32")
BACKWARD_INPUTS = (
    Q,
    K,
    V,
    OUT,
    Buffer("dout", ("B", "T", "N", "V"), X),
    LSE,
    Buffer("dlse", ("B", "N", "T"), "float32"),
)
GRADIENTS = (
    Buffer("dq", ("B", "T", "N", "H"), X),
    Buffer("dk", ("B", "S", "K", "H"), X),
    Buffer("dv", ("B", "S", "K", "V"), X),
)
EMPTY_F32 = (0,)

# The attributes every target takes, at their valid (and neutral) values. Floats as np.float32
# (a Python float is an f64 attribute).
COMMON_ATTRIBUTES = dict(
    scale=np.float32(0.125),
    window_left=np.int64(-1),
    window_right=np.int64(-1),
    softcap=np.float32(0.0),
    use_segment_ids=False,
    dropout_rate=np.float32(0.0),
    block_q=np.int64(0),  # no block mask
    block_k=np.int64(0),
)


# The attributes that take the place of the handlers' environment reads (cuda/README.md): on
# every target poison_outputs; the cpu forward targets isa, forward_chunks, pack_gqa; the cpu
# backward isa, gradient_chunks; the CUDA and emulated targets layout. False for an extension
# built before them (the handlers then read JAX_FLASH_POISON_OUTPUTS and the other variables).
SCHEDULE_ATTRIBUTES = True
POISON_ATTRIBUTES = dict(poison_outputs=True) if SCHEDULE_ATTRIBUTES else {}
CPU_FORWARD_ATTRIBUTES = dict(isa="", forward_chunks=np.int64(1), pack_gqa=False) if SCHEDULE_ATTRIBUTES else {}
CPU_BACKWARD_ATTRIBUTES = dict(isa="", gradient_chunks=np.int64(0)) if SCHEDULE_ATTRIBUTES else {}
CUDA_ATTRIBUTES = dict(layout="warp16") if SCHEDULE_ATTRIBUTES else {}


@dataclass(frozen=True)
class Target:
    name: str
    operands: tuple
    results: tuple
    attributes: dict
    dtypes: tuple  # element dtypes of q it serves
    emulated: bool = False  # the CUDA kernels on the host emulation: slow, so fewer valid calls
    platform: str = "cpu"  # where it is registered (and called)
    registered_as: str = ""  # the registered name, where the key differs (the CUDA platform's)

    @property
    def target(self) -> str:
        return self.registered_as or self.name


TARGETS = {
    t.name: t
    for t in (
        Target(
            "jax_flash_fwd",
            operands=(Q, K, V, *_mask_operands(), SINKS, SEED),
            results=(OUT, LSE),
            attributes=dict(COMMON_ATTRIBUTES, **POISON_ATTRIBUTES, **CPU_FORWARD_ATTRIBUTES),
            dtypes=("float32", "bfloat16", "float16"),
        ),
        Target(
            "jax_flash_paged_fwd",
            operands=(PAGE_TABLE, Q, K_PAGES, V_PAGES, *_mask_operands(), SINKS, SEED),
            results=(OUT, LSE),
            attributes=dict(COMMON_ATTRIBUTES, **POISON_ATTRIBUTES, **CPU_FORWARD_ATTRIBUTES),
            dtypes=("float32", "bfloat16", "float16"),
        ),
        Target(
            "jax_flash_bwd",
            operands=(*BACKWARD_INPUTS, *_mask_operands(), SEED),
            results=(
                *GRADIENTS,
                Buffer("dq_accum", EMPTY_F32, "float32"),  # [0]: none, or [B, T, N, H] f32
                Buffer("delta", ("B", "N", "T"), "float32"),
                Buffer("dbias", "bias", "float32"),
            ),
            attributes=dict(COMMON_ATTRIBUTES, deterministic=False, **POISON_ATTRIBUTES, **CPU_BACKWARD_ATTRIBUTES),
            dtypes=("float32", "bfloat16", "float16"),
        ),
        Target(
            "jax_flash_emu_fwd",
            operands=(Q, K, V, *_mask_operands(), SINKS, SEED, ROUTE),
            results=(
                OUT,
                LSE,
                Buffer("partial_out", EMPTY_F32, "float32"),  # [0]: no split-KV
                Buffer("partial_lse", EMPTY_F32, "float32"),
            ),
            attributes=dict(
                COMMON_ATTRIBUTES,
                pack_gqa=False,
                plain_kernel=False,
                decode_tile=False,
                **POISON_ATTRIBUTES,
                **CUDA_ATTRIBUTES,
            ),
            dtypes=("float16", "bfloat16"),
            emulated=True,
        ),
        Target(
            "jax_flash_emu_paged_fwd",
            operands=(PAGE_TABLE, Q, K_PAGES, V_PAGES, *_mask_operands(), SINKS, SEED, ROUTE),
            results=(
                OUT,
                LSE,
                Buffer("partial_out", EMPTY_F32, "float32"),
                Buffer("partial_lse", EMPTY_F32, "float32"),
            ),
            attributes=dict(
                COMMON_ATTRIBUTES,
                pack_gqa=False,
                plain_kernel=False,
                decode_tile=False,
                **POISON_ATTRIBUTES,
                **CUDA_ATTRIBUTES,
            ),
            dtypes=("float16", "bfloat16"),
            emulated=True,
        ),
        Target(
            "jax_flash_emu_bwd",
            operands=(*BACKWARD_INPUTS, *_mask_operands(), SEED, ROUTE),
            results=(
                *GRADIENTS,
                Buffer("dq_accum", ("B", "T", "N", "H"), "float32"),
                Buffer("delta", ("B", "N", "T"), "float32"),
                Buffer("dk_accum", EMPTY_F32, "float32"),  # [0]: the kv_heads grid
                Buffer("dv_accum", EMPTY_F32, "float32"),
                Buffer("dbias_accum", EMPTY_F32, "float32"),
                Buffer("dbias", "bias", "float32"),
            ),
            attributes=dict(
                COMMON_ATTRIBUTES, deterministic=False, plain_kernel=False, **POISON_ATTRIBUTES, **CUDA_ATTRIBUTES
            ),
            dtypes=("float16", "bfloat16"),
            emulated=True,
        ),
    )
}
# The CUDA platform's targets: the emulated ones' signatures (kernels/ffi_attention.h serves
# both), called on a GPU where there is one.
for _name in ("jax_flash_fwd", "jax_flash_paged_fwd", "jax_flash_bwd"):
    _emulated = TARGETS[_name.replace("jax_flash_", "jax_flash_emu_")]
    TARGETS[_name + "@CUDA"] = Target(
        _name + "@CUDA",
        _emulated.operands,
        _emulated.results,
        dict(_emulated.attributes),
        _emulated.dtypes,
        emulated=False,
        platform="CUDA",
        registered_as=_name,
    )

# Out-of-range values of each attribute (applied to the targets that take it). The base call
# has T = 3, so GQA packing (T = 1 only) cannot be asked for.
INVALID_ATTRIBUTE_VALUES = {
    "scale": [np.float32(np.nan), np.float32(np.inf), np.float32(-np.inf)],
    "window_left": [np.int64(-2), np.int64(-3), np.int64(-(2**40)), np.int64(np.iinfo(np.int64).min)],
    "window_right": [np.int64(-2), np.int64(-7), np.int64(-(2**33)), np.int64(np.iinfo(np.int64).min)],
    "softcap": [np.float32(-1.0), np.float32(np.nan), np.float32(np.inf), np.float32(1e-40), np.float32(-0.5)],
    "dropout_rate": [np.float32(-0.1), np.float32(1.0), np.float32(1.5), np.float32(np.nan), np.float32(-np.inf)],
    "pack_gqa": [True],
    "forward_chunks": [np.int64(0), np.int64(-1), np.int64(-(2**40))],
    "gradient_chunks": [np.int64(-1), np.int64(5), np.int64(-(2**40))],  # 0: the rule; 1..4 forced
    "isa": ["bogus", "AVX2 ", "avx512bf17", "amx;generic"],
    "layout": ["warp64", "Warp16", "warp16 ", "w"],
    # Without block mask operands: any nonzero block size is refused.
    "block_q": [np.int64(-1), np.int64(2), np.int64(-(2**40))],
    "block_k": [np.int64(-1), np.int64(32), np.int64(2**40)],
}
# A value of another type for each attribute's type; none equal to a valid value (JAX's cache
# of compiled calls keys on attribute values, and True == 1 == 1.0 would reuse another's).
WRONG_TYPE = {
    np.float32: [np.float64(0.3), np.int64(3), "0.3"],
    np.int64: [np.float32(0.5), "1", np.int32(2**20 + 1)],
    bool: [np.int64(2), np.float32(0.5)],
    str: [np.int64(7), np.float32(0.5)],
}

# Words a message may use instead of an operand's name for a dim.
DIM_WORDS = {
    "B": ["batch"],
    "N": ["heads"],
    "K": ["heads"],
    "H": ["head dim"],
    "V": ["head dim"],
    "P": ["num_pages", "paged cache"],
    "PS": ["page_size", "paged cache"],
    "MP": ["max_pages", "paged cache"],
}
STRUCTURE_WORDS = ["Wrong number of arguments", "Wrong number of results"]
ATTRIBUTE_STRUCTURE_WORDS = [
    "Wrong number of attributes",
    "Wrong scalar data type",
    "Wrong attribute type",
    "Wrong data type",
]
# A case that may run or be rejected (as an invalid argument, naming anything): what matters is
# that it neither crashes nor touches memory outside its buffers.
ANY_OUTCOME = ["<run or reject>"]
DTYPES = ["float32", "bfloat16", "float16", "float64", "int32", "int64", "uint32", "int8", "bool"]


# ---- the cases -----------------------------------------------------------------------------


@dataclass
class Case:
    description: str
    operands: list  # [(name, shape, dtype, fill)]
    results: list  # [(name, shape, dtype)]
    attributes: dict
    expect: list | None  # None: must succeed; else words the error message must contain one of


def _resolve(shape, dims, variant):
    if isinstance(shape, str):  # "bias" / "mask"
        return tuple(variant.get(shape, EMPTY_F32))
    return tuple(dims[d] if isinstance(d, str) else d for d in shape)


def _dtype_of(buffer, dtype, variant):
    if buffer.dtype == X:
        return dtype
    if buffer.dtype == "bias":
        return variant.get("bias_dtype", "float32")
    return variant.get(buffer.name + "_dtype", buffer.dtype)


def valid_call(target: Target, dtype: str, variant: dict | None = None, fill: str = "valid") -> Case:
    """The valid call of `target` with element dtype `dtype`; `variant` sets the dense
    operands' shapes (bias, mask), the bias dtype, attribute values and dims."""
    variant = dict(variant or {})
    dims = dict(DIMS, **variant.get("dims", {}))
    dims["S"] = dims["MP"] * dims["PS"] if "paged" in target.name else dims["S"]
    operands = [(b.name, _resolve(b.shape, dims, variant), _dtype_of(b, dtype, variant), fill) for b in target.operands]
    results = [(b.name, _resolve(b.shape, dims, variant), _dtype_of(b, dtype, variant)) for b in target.results]
    attributes = dict(target.attributes)
    attributes.update(variant.get("attributes", {}))
    text = f"valid {dtype}" + (f" {variant}" if variant else "") + ("" if fill == "valid" else f" ({fill} values)")
    return Case(text, operands, results, attributes, None)


def _related(target: Target, buffer: Buffer, symbols) -> list:
    """Names of the buffers that share a dim symbol (or the element dtype) with `buffer`,
    and words for those dims: any of them may be what a handler's message names."""
    words = {buffer.name}
    symbols = set(symbols)
    if symbols & {"PS", "MP"}:
        symbols.add("S")
    for other in (*target.operands, *target.results):
        other_symbols = set(other.shape) if isinstance(other.shape, tuple) else set()
        if other_symbols & symbols or other.shape == buffer.shape:
            words.add(other.name)
    if buffer.name in ("bias", "dbias"):
        words |= {"bias", "dbias", "dbias_accum"}
    for s in symbols:
        words.update(DIM_WORDS.get(s, []))
    return sorted(words)


def _mutate_shape(rng: random.Random, shape: tuple) -> tuple:
    shape = list(shape)
    kind = rng.choice(["dim", "dim", "dim", "add", "drop"]) if shape else "add"
    if kind == "dim":
        i = rng.randrange(len(shape))
        choices = [d for d in {shape[i] + 1, shape[i] + 2, shape[i] - 1, 0, 7, 1} if d >= 0 and d != shape[i]]
        shape[i] = rng.choice(sorted(choices))
    elif kind == "add":
        shape.insert(rng.randrange(len(shape) + 1), rng.choice([1, 2, 3]))
    else:
        del shape[rng.randrange(len(shape))]
    return tuple(shape)


def mutated_cases(target: Target, rng: random.Random, count: int) -> list:
    """`count` calls of `target`, each with one thing wrong."""
    cases = []
    kinds = [
        "operand_shape",
        "operand_shape",
        "operand_dtype",
        "result_shape",
        "result_dtype",
        "dense_shape",
        "dense_shape",
        "attribute_value",
        "attribute_value",
        "attribute_value",
        "attribute_structure",
        "operand_count",
        "result_count",
        "pages",
        "dims",
        "block_mask",
    ]
    for i in range(count):
        dtype = rng.choice(target.dtypes)
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        variant = {}
        if kind == "dense_shape":
            # A dense operand present (valid: a broadcast shape), then one dim of it wrong.
            name = rng.choice(["bias", "mask"])
            full = (DIMS["B"], DIMS["N"], DIMS["T"], DIMS["S"])
            valid = tuple(d if rng.random() < 0.5 else 1 for d in full)
            variant[name] = valid
        if kind == "block_mask":
            # A valid block mask, then one of its operands of a wrong shape or dtype.
            variant.update(block_variant(batch=rng.choice([1, None]), heads=rng.choice([1, None])))
        if kind == "dims":
            # Every buffer consistent with one dim of an edge value (empty, one, past a tile,
            # a head dim without kernels, kv heads that do not divide the query heads): the call
            # either runs or is rejected as an invalid argument, never reaches memory it lacks.
            symbol = rng.choice(["B", "T", "S", "N", "K", "H", "V", "P", "PS", "MP"])
            values = [0, 1, 3] if target.emulated else [0, 1, 3, 129, 300]
            if symbol in ("H", "V"):
                values = [0, 1, 7, 64] if not target.emulated else [0, 16, 64]
            variant["dims"] = {symbol: rng.choice(values)}
        case = valid_call(target, dtype, variant)
        if kind == "dims":
            what = f"dims {variant['dims']}"
            case.expect = ANY_OUTCOME
        elif kind in ("operand_shape", "operand_dtype", "result_shape", "result_dtype"):
            buffers, rows = (
                (target.operands, case.operands) if kind.startswith("operand") else (target.results, case.results)
            )
            j = rng.randrange(len(buffers))
            buffer, row = buffers[j], list(rows[j])
            if kind.endswith("shape"):
                new = _mutate_shape(rng, row[1])
                while buffer is ROUTE and new == (1,):  # [1] s32: a routed call, valid
                    new = _mutate_shape(rng, row[1])
                symbols = buffer.shape if isinstance(buffer.shape, tuple) else ()
                row[1] = new
                what = f"{buffer.name} shape {tuple(rows[j][1])} -> {new}"
            else:
                allowed = {row[2]}
                if buffer.dtype == "bias" and row[1] != EMPTY_F32:
                    allowed |= {"float32", "bfloat16", "float16"}
                row[2] = rng.choice([d for d in DTYPES if d not in allowed])
                symbols = buffer.shape if isinstance(buffer.shape, tuple) else ()
                what = f"{buffer.name} dtype {rows[j][2]} -> {row[2]}"
            rows[j] = tuple(row)
            related = _related(target, buffer, symbols)
            if kind.endswith("dtype") and buffer.dtype == X:  # compared with q's dtype
                related += [b.name for b in (*target.operands, *target.results) if b.dtype == X]
            case.expect = sorted(set(related))
        elif kind == "dense_shape":
            j = next(i for i, b in enumerate(target.operands) if b.name == name)
            row = list(case.operands[j])
            full = (DIMS["B"], DIMS["N"], DIMS["T"], DIMS["S"])
            shape = list(row[1])
            how = rng.choice(["size", "size", "size", "rank"])
            if how == "size":
                d = rng.randrange(4)
                shape[d] = rng.choice(
                    [v for v in (0, 2, 3, 5, full[d] + 1, full[d] - 1) if v not in (1, full[d]) and v >= 0]
                )
            else:
                shape = shape[:3] if rng.random() < 0.5 else [*shape, 1]
            row[1] = tuple(shape)
            if name == "bias" and rng.random() < 0.3:
                row[2] = rng.choice(["int32", "float64", "bool"])
            case.operands[j] = tuple(row)
            what = f"{name} {variant[name]} -> {row[1]} {row[2]}"
            case.expect = ["bias", "dbias"] if name == "bias" else ["mask"]
        elif kind == "block_mask":
            name = rng.choice(BLOCK_OPERANDS)
            j = next(i for i, b in enumerate(target.operands) if b.name == name)
            row = list(case.operands[j])
            if rng.random() < 0.3:
                row[2] = rng.choice([d for d in DTYPES if d != row[2]])
            else:
                shape = row[1]
                # block_bits' first dim (the capacity P) is free: another one is no mistake.
                while shape == row[1] or (name == "block_bits" and len(shape) == 3 and shape[1:] == row[1][1:]):
                    shape = _mutate_shape(rng, row[1])
                row[1] = shape
            case.operands[j] = tuple(row)
            what = f"{name} {variant[name]} -> {row[1]} {row[2]}"
            case.expect = list(BLOCK_OPERANDS)
        elif kind == "attribute_value":
            names = [n for n in case.attributes if n in INVALID_ATTRIBUTE_VALUES]
            name = rng.choice(names)
            value = rng.choice(INVALID_ATTRIBUTE_VALUES[name])
            case.attributes[name] = value
            what = f"attribute {name} = {value!r}"
            case.expect = [name] + ([value.strip() or value] if isinstance(value, str) else [])
        elif kind == "attribute_structure":
            name = rng.choice(sorted(case.attributes))
            how = rng.choice(["missing", "extra", "type", "type"])
            if how == "missing":
                del case.attributes[name]
                what = f"attribute {name} missing"
            elif how == "extra":
                case.attributes["window_middle"] = np.int64(0)
                what = "an extra attribute window_middle"
            else:
                value = rng.choice(WRONG_TYPE[type(case.attributes[name])])
                case.attributes[name] = value
                what = f"attribute {name} of type {type(value).__name__}: {value!r}"
            case.expect = [*ATTRIBUTE_STRUCTURE_WORDS, name]
        elif kind == "operand_count":
            if rng.random() < 0.5:
                j = rng.randrange(len(case.operands))
                what = f"operand {case.operands[j][0]} left out"
                del case.operands[j]
            else:
                case.operands.insert(rng.randrange(len(case.operands) + 1), ("extra", (2,), "int32", "valid"))
                what = "an extra operand"
            case.expect = STRUCTURE_WORDS
        elif kind == "result_count":
            if rng.random() < 0.5:
                j = rng.randrange(len(case.results))
                what = f"result {case.results[j][0]} left out"
                del case.results[j]
            else:
                case.results.append(("extra", (2,), "float32"))
                what = "an extra result"
            case.expect = STRUCTURE_WORDS
        elif kind == "pages":
            # The paged targets: a page table of the wrong batch or dtype, or an empty cache;
            # elsewhere a split-KV / accumulator workspace of the wrong size, or k and v of
            # different lengths.
            names = [r[0] for r in case.results]
            if "page_table" in [o[0] for o in case.operands]:
                row = list(case.operands[0])
                how = rng.choice(["batch", "dtype", "empty", "pages"])
                if how == "batch":
                    row[1] = (DIMS["B"] + 1, DIMS["MP"])
                elif how == "dtype":
                    row[2] = rng.choice(["int64", "uint32", "float32"])
                elif how == "empty":
                    row[1] = (DIMS["B"], 0)
                case.operands[0] = tuple(row)
                if how == "pages":  # no pages at all
                    for j, o in enumerate(case.operands):
                        if o[0] in ("k", "v"):
                            case.operands[j] = (o[0], (0, *tuple(o[1][1:])), o[2], o[3])
                what = f"page_table / pages: {how}"
                case.expect = ["page_table", "paged cache", "num_pages", "k", "v"]
            elif "partial_out" in names:
                j = names.index("partial_out")
                chunks = rng.choice([1, 0, 1025, 3])
                b, t, n, v = DIMS["B"], DIMS["T"], DIMS["N"], DIMS["V"]
                case.results[j] = ("partial_out", (chunks, b, t, n, v), "float32")
                if chunks == 3:  # a valid count, partial_lse left [0]
                    pass
                what = f"partial_out with {chunks} chunks"
                case.expect = ["partial_out", "partial_lse"]
            elif "dk_accum" in names:
                j = names.index("dk_accum")
                b, s, n, h = DIMS["B"], DIMS["S"], DIMS["N"], DIMS["H"]
                case.results[j] = ("dk_accum", (b, s, n, h), "float32")  # dv_accum left [0]
                what = "dk_accum of the q_heads grid, dv_accum of the kv_heads grid"
                case.expect = ["dk_accum", "dv_accum"]
            else:
                j = next(i for i, o in enumerate(case.operands) if o[0] == "v")
                o = case.operands[j]
                case.operands[j] = (o[0], (o[1][0], o[1][1] + 1, *tuple(o[1][2:])), o[2], o[3])
                what = "v one key longer than k"
                case.expect = ["v"]
        case.description = f"{kind}: {what} ({dtype})"
        cases.append(case)
    return cases


def control_cases(target: Target, rng: random.Random) -> list:
    """Valid calls that must succeed: each dtype, broadcast dense operands, the attributes at
    valid non-default values, and hostile values in valid shapes."""
    b, n, t, s = DIMS["B"], DIMS["N"], DIMS["T"], DIMS["S"]
    cases = [valid_call(target, d) for d in target.dtypes]
    dtype = target.dtypes[-1]
    variants = [
        {"bias": (1, n, 1, s), "bias_dtype": dtype},
        {"bias": (b, 1, t, 1), "mask": (1, 1, t, s)},
        {
            "mask": (b, n, t, s),
            "attributes": dict(
                window_left=np.int64(1), window_right=np.int64(0), softcap=np.float32(30.0), use_segment_ids=True
            ),
        },
        {"attributes": dict(dropout_rate=np.float32(0.5), window_left=np.int64(2**62), window_right=np.int64(0))},
    ]
    # The schedule attributes at other valid values (where the target takes them).
    other = dict(
        forward_chunks=np.int64(3), gradient_chunks=np.int64(2), layout="warp32", isa="generic", poison_outputs=False
    )
    variants[1]["attributes"] = {k: v for k, v in other.items() if k in target.attributes}
    if target.emulated:  # each emulated call runs the kernels on the SIMT emulation: fewer
        variants = [variants[0], variants[1], variants[3]]
    # A block mask per (b, n), and one shared by every row and head.
    variants += [block_variant(), block_variant(batch=1, heads=1)]
    cases += [valid_call(target, dtype, v) for v in variants]
    for i in range(2 if target.emulated else 4):
        hostile = {"attributes": dict(use_segment_ids=True)}
        if i % 2:  # any state and slot values, in range or not
            hostile = block_variant()
            hostile["attributes"]["use_segment_ids"] = True
        cases.append(valid_call(target, rng.choice(target.dtypes), hostile, fill=f"hostile:{rng.randrange(2**31)}"))
    return cases


# ---- the worker: runs cases, reports each ----------------------------------------------------


def _array(jnp, name, shape, dtype, fill, rng_np):
    """The values of one operand: valid ones, or (fill "hostile:<seed>") every index and length
    out of its range, NaN and ±inf among the inputs."""
    dt = jnp.dtype(dtype)
    size = int(np.prod(shape)) if shape else 1
    hostile = fill.startswith("hostile")
    if dt == jnp.bool_:
        return jnp.asarray(rng_np.random(shape) < 0.7)
    if jnp.issubdtype(dt, jnp.integer):
        if name == "dropout_seed":
            return jnp.asarray(rng_np.integers(0, 2**32, shape, dtype=np.uint64)).astype(dt)
        if not hostile:
            full = {"q_lengths": DIMS["T"], "kv_lengths": DIMS["S"]}.get(name)
            if full is not None:
                return jnp.full(shape, full, dt)
            if name == "page_table":
                return jnp.asarray(np.arange(size).reshape(shape) % DIMS["P"]).astype(dt)
            if name == "block_states":  # empty, partly and fully visible blocks
                return jnp.asarray(rng_np.integers(0, 3, shape)).astype(dt)
            if name == "block_slots":  # every block its slot, some past the capacity
                return jnp.asarray(np.arange(size).reshape(shape) % (BLOCK_CAPACITY + 1)).astype(dt)
            if name == "block_bits":
                return jnp.asarray(rng_np.integers(0, 2**32, shape, dtype=np.uint64)).astype(dt)
            return jnp.zeros(shape, dt)
        info = np.iinfo(np.dtype(dtype))
        extremes = np.array(
            [info.min, info.max, -1, 0, 1, -5, DIMS["T"] + 1, DIMS["S"] + 2, DIMS["P"], 2**20], dtype=np.int64
        ).clip(info.min, info.max)
        return jnp.asarray(rng_np.choice(extremes, size=shape).astype(np.dtype(dtype)))
    values = np.asarray(rng_np.standard_normal(shape), np.float32)
    if name == "sinks" and not hostile:
        values[...] = -np.inf
    if hostile and size:
        flat = values.reshape(-1)
        picks = rng_np.integers(0, size, max(1, size // 8))
        flat[picks] = rng_np.choice(np.array([np.nan, np.inf, -np.inf, 1e30, -1e30], np.float32), len(picks))
    return jnp.asarray(values).astype(dt)


def run_worker(target_name: str, seed: int, count: int) -> None:
    """Runs the cases of one target in this process, one JSON line before and after each."""
    selftest = os.environ.get("JAX_FLASH_FUZZ_SELFTEST")  # "abort:<case>" / "hang:<case>"
    if selftest:  # the runner's own test: a worker that dies or hangs at one case, without JAX
        how, at = selftest.split(":")
        rng = random.Random(f"{seed}:{target_name}")
        cases = control_cases(TARGETS[target_name], rng) + mutated_cases(TARGETS[target_name], rng, count)
        for i, case in enumerate(cases):
            print(json.dumps({"start": i, "case": case.description}), flush=True)
            if i == int(at):
                os.abort() if how == "abort" else time.sleep(3600)
            print(
                json.dumps({"done": i, "case": case.description, "expect": None, "error": None, "seconds": 0}),
                flush=True,
            )
        return
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 / int64 operands stay what they are
    import jax.numpy as jnp

    from jax_flash import _ffi

    target = TARGETS[target_name]
    registered = _ffi.targets().get(target.platform, set())
    if target.target not in registered:
        print(json.dumps({"skip": f"{target.target} is not registered for platform {target.platform}"}), flush=True)
        return
    devices = (
        [d for d in jax.devices() if d.platform.upper() == target.platform.upper()]
        if target.platform != "cpu"
        else jax.devices("cpu")
    )
    if not devices:
        print(json.dumps({"skip": f"no {target.platform} device for {target.target}"}), flush=True)
        return
    rng = random.Random(f"{seed}:{target_name}")
    cases = control_cases(target, rng) + mutated_cases(target, rng, count)
    # Every registered target sees a valid call first: a signature out of step with the table
    # fails here, before any mutant could pass for the wrong reason.
    for i, case in enumerate(cases):
        print(json.dumps({"start": i, "case": case.description}), flush=True)
        rng_np = np.random.default_rng([seed, i])
        operands = [
            jax.device_put(_array(jnp, name, shape, dtype, fill, rng_np), devices[0])
            for name, shape, dtype, fill in case.operands
        ]
        for array, (name, shape, dtype, _) in zip(operands, case.operands):  # the harness' own check
            assert array.shape == tuple(shape) and array.dtype == jnp.dtype(dtype), (name, array.shape, array.dtype)
        results = tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for _, shape, dtype in case.results)
        started = time.perf_counter()
        try:
            outputs = jax.ffi.ffi_call(target.target, results)(*operands, **case.attributes)
            jax.block_until_ready(outputs)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        print(
            json.dumps(
                {
                    "done": i,
                    "case": case.description,
                    "expect": case.expect,
                    "error": error,
                    "seconds": round(time.perf_counter() - started, 3),
                }
            ),
            flush=True,
        )
    print(json.dumps({"finished": len(cases)}), flush=True)


# ---- the verdicts ----------------------------------------------------------------------------


def _names(message: str, word: str) -> bool:
    if len(word) <= 2:  # q, k, v: as a word, as written
        return re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", message) is not None
    return word.lower() in message.lower()


def verdict(record: dict) -> str | None:
    """None when the case behaved, else what went wrong."""
    error, expect = record["error"], record["expect"]
    if expect == ANY_OUTCOME:
        if error is None or "INVALID_ARGUMENT" in error:
            return None
        return f"neither ran nor was rejected as an invalid argument: {error}"
    if expect is None:
        return None if error is None else f"a valid call failed: {error}"
    if error is None:
        return "an invalid call succeeded (no error)"
    if not any(_names(error, w) for w in expect):
        return f"the error does not name what is wrong (any of {expect}): {error}"
    return None


def run_target(target_name: str, seed: int, count: int, timeout: float):
    """Runs the worker of one target in a subprocess; returns (records, failure or None)."""
    env = dict(os.environ)
    if TARGETS[target_name].platform == "cpu":
        env.setdefault("JAX_PLATFORMS", "cpu")
    env["JAX_FLASH_POISON_OUTPUTS"] = "1"  # the handlers' poisoning path runs too
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), target_name, str(seed), str(count)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = None
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    started = [r for r in records if "start" in r]
    done = {r["done"]: r for r in records if "done" in r}
    if any("skip" in r for r in records):
        return records, "skip: " + next(r["skip"] for r in records if "skip" in r)
    for r in records:
        if "done" in r and (why := verdict(r)):
            return records, f"{target_name} case {r['done']} ({r['case']}): {why}"
    if rc is None or rc != 0 or not any("finished" in r for r in records):
        last = started[-1] if started else None
        where = f"case {last['start']} ({last['case']})" if last and last["start"] not in done else "after the cases"
        how = f"hung (no exit within {timeout:.0f} s)" if rc is None else f"exited with status {rc}"
        return records, f"{target_name} {how} at {where}\n{stderr[-3000:]}"
    return records, None


if __name__ == "__main__":
    run_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    sys.exit(0)


# ---- the tests -------------------------------------------------------------------------------

import pytest  # noqa: E402

SEED = int(os.environ.get("JAX_FLASH_FUZZ_SEED", "0"))
CASES = int(os.environ.get("JAX_FLASH_FUZZ_CASES", "40"))


def test_ffi_targets_reject_bad_calls():
    """Every target of TARGETS, each in its own subprocess, two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    import jax

    # The CUDA platform's targets where JAX has a GPU (the others skip without a subprocess).
    names = sorted(n for n in TARGETS if TARGETS[n].platform == "cpu" or jax.default_backend() == "gpu")
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(names, pool.map(lambda name: run_target(name, SEED, CASES, timeout=150), names)))
    failures, ran = [], []
    for name, (records, failure) in runs.items():
        if failure and failure.startswith("skip: "):
            print(f"{name}: {failure}")
            if _required(TARGETS[name]):
                failures.append(f"{name}: {failure[6:]}, and JAX_FLASH_REQUIRE lists its implementation")
            continue
        if failure:
            failures.append(failure)
            continue
        done = [r for r in records if "done" in r]
        controls = [r for r in done if r["expect"] is None]
        if not controls or len(done) - len(controls) != CASES:
            failures.append(f"{name}: the cases did not all run ({len(done)} reported)")
        ran.append(name)
        print(
            f"{name}: {len(controls)} valid calls, {len(done) - len(controls)} invalid ones, "
            f"{sum(r['seconds'] for r in done):.1f} s in the calls"
        )
    assert not failures, "\n".join(failures)
    if not ran:
        pytest.skip("no FFI target is registered (the extension is not built)")


def _required(target: Target) -> bool:
    """Whether JAX_FLASH_REQUIRE (tests/conftest.py) lists the target's implementation: cpu
    for the host targets, cuda for the emulated ones (and the CUDA platform's)."""
    required = [n for n in os.environ.get("JAX_FLASH_REQUIRE", "").split(",") if n]
    if target.platform == "CUDA":
        return False  # a GPU-less machine has no CUDA device to call them on
    return ("cuda" if target.emulated else "cpu") in required


def test_every_registered_target_is_fuzzed():
    """A target registered for the host (or CUDA) and absent from TARGETS would go unfuzzed."""
    from jax_flash import _ffi

    registered = _ffi.targets()
    if not registered:
        pytest.skip("the extension is not built")
    known = {(t.platform, t.target) for t in TARGETS.values()}
    missing = sorted((plat, name) for plat, names in registered.items() for name in names if (plat, name) not in known)
    assert not missing, f"registered FFI targets without a row in TARGETS: {missing}"


@pytest.mark.parametrize("how", ["abort", "hang"])
def test_fuzz_runner_reports_a_crash_or_hang_with_its_case(monkeypatch, how):
    monkeypatch.setenv("JAX_FLASH_FUZZ_SELFTEST", f"{how}:3")
    _, failure = run_target("jax_flash_fwd", SEED, 5, timeout=20 if how == "abort" else 5)
    assert failure is not None and "at case 3 (" in failure, failure
    assert ("hung" if how == "hang" else "exited with status") in failure, failure


def test_fuzz_verdicts_can_fail():
    """The checks above fail on a crash, a silent acceptance and an unnamed error."""
    ok = {"done": 0, "case": "c", "expect": ["window_left"], "error": "INVALID_ARGUMENT: window_left must be >= 0"}
    assert verdict(ok) is None
    assert "succeeded" in verdict(dict(ok, error=None))
    assert "does not name" in verdict(dict(ok, error="INVALID_ARGUMENT: something"))
    assert "valid call failed" in verdict(dict(ok, expect=None))
    assert _names("q has shape", "q") and not _names("qq has shape", "q")

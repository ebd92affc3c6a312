#!/usr/bin/env python3
"""The key loop of a Pallas Triton kernel, read from its Triton IR, and what it costs per score.

Lowering a jitted function for the `cuda` platform works on any machine: each `pallas_call`
becomes a `__gpu$xla.gpu.triton` custom call whose backend config holds the kernel's Triton IR
(MLIR bytecode), its name, num_warps and num_stages. This reads it with jaxlib's MLIR and its
Triton dialect, canonicalizes it (canonicalize, cse) and walks the **key loop**: the `scf.for`
holding the most `tt.dot` (ties: the fewest operations, so the interior loop rather than a
masked one). Counted there, each operation weighted by the elements of its result (a
reduction by those of its operand), per score of the tile (divided by block_q · block_k):

- `float`: floating-point arithmetic, exponentials, float compares and selects; what a
  kernel does per score and per accumulator element. The budget is on this figure;
- `select`: `arith.select` (a per-score select is 1.0, a per-row one 1 / block_k);
- `integer`: integer arithmetic and compares (addresses, masks), reported only: Triton hoists
  and strength-reduces most address arithmetic, so it says little about the SASS;
- `loads`, `dots`, `reductions`: operations per key tile;
- `select_before_dot`: selects between a load and a dot operand (the value loaded passes a
  select on its way into the matmul: it then leaves the copy pipeline for registers and a
  second shared buffer). None in a plain call.

Where the `triton` package is installed, `sass()` compiles the same IR for a GPU target and
`build/sass_loops.py` walks the SASS: instructions per key tile, barriers, shuffles.

    python build/pallas_loops.py [--head-dim 128] [--causal] [--sass]

prints the forward's and the backward kernels' figures beside JAX's `mha` at the same shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import re
import sys
from collections import Counter

import jax
import jax.numpy as jnp
from jaxlib.mlir import ir, passmanager
from jaxlib.triton import dialect as triton_dialect

TRITON_CALL = "__gpu$xla.gpu.triton"
# Operations that only move or reshape values between layouts (free in the IR's terms).
_LAYOUT = {
    "tt.splat",
    "tt.broadcast",
    "tt.expand_dims",
    "tt.make_range",
    "tt.trans",
    "tt.reshape",
    "arith.constant",
    "tt.addptr",
}
_FLOAT_TYPES = ("f16", "bf16", "f32", "f64")


@dataclasses.dataclass
class TritonKernel:
    name: str
    num_warps: int
    num_stages: int
    module: ir.Module
    context: ir.Context

    @property
    def text(self) -> str:
        return str(self.module)


def triton_kernels(lowered) -> list[TritonKernel]:
    """Each Triton custom call of a `jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`
    result, its IR canonicalized."""
    found: list[TritonKernel] = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if (
                        o.name == "stablehlo.custom_call"
                        and ir.StringAttr(o.attributes["call_target_name"]).value == TRITON_CALL
                    ):
                        found.append(_kernel(o.attributes["mhlo.backend_config"]))
                    walk(o)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def _kernel(config) -> TritonKernel:
    raw = bytes(ir.StringAttr(config["ir"]).value_bytes)
    ctx = ir.Context()
    triton_dialect.register_dialect(ctx)
    with ctx:
        module = ir.Module.parse(raw)
        passmanager.PassManager.parse("builtin.module(canonicalize,cse,canonicalize)").run(module.operation)
    return TritonKernel(
        name=ir.StringAttr(config["name"]).value,
        num_warps=ir.IntegerAttr(config["num_warps"]).value,
        num_stages=ir.IntegerAttr(config["num_stages"]).value,
        module=module,
        context=ctx,
    )


def _elements(type_) -> int:
    shape = re.match(r"tensor<([0-9x]+)x", str(type_))
    if shape is None:
        return 1
    n = 1
    for d in shape.group(1).split("x"):
        n *= int(d)
    return n


def _element_type(type_) -> str:
    s = str(type_)
    m = re.match(r"tensor<[0-9x]+x(\w+)>", s)
    return m.group(1) if m else s


def _ops(block):
    """The operations of a block and of the regions inside them, except a reduction's
    combiner (the reduction is counted once) and nested loops (their own key loops)."""
    for op in block.operations:
        yield op
        if op.name in ("tt.reduce", "scf.for"):
            continue
        for region in op.regions:
            for b in region.blocks:
                yield from _ops(b)


def _loops(op):
    for region in op.regions:
        for block in region.blocks:
            for o in block.operations:
                if o.name == "scf.for":
                    yield o
                yield from _loops(o)


@dataclasses.dataclass
class KeyLoop:
    block_q: int  # the scores tile: the first dot's result shape
    block_k: int
    counts: Counter  # weighted elements per category
    ops: Counter  # operations (unweighted) per category
    select_before_dot: list[str]

    def per_score(self, category: str) -> float:
        return self.counts[category] / (self.block_q * self.block_k)

    def summary(self) -> dict:
        return {
            "tile": f"{self.block_q}x{self.block_k}",
            "float_per_score": round(self.per_score("float"), 3),
            "select_per_score": round(self.per_score("select"), 3),
            "integer_per_score": round(self.per_score("integer"), 3),
            "loads": self.ops["load"],
            "dots": self.ops["dot"],
            "reductions": self.ops["reduce"],
            "select_before_dot": len(self.select_before_dot),
        }


def _category(op) -> str | None:
    name = op.name
    if name in _LAYOUT or name.startswith(("scf.", "tt.return")):
        return None
    if name == "tt.load":
        return "load"
    if name == "tt.dot":
        return "dot"
    if name == "tt.reduce":
        return "reduce"
    if name == "arith.select":
        return "select"
    if not op.results:
        return None
    if name == "arith.cmpf" or name.startswith("math.") or name == "tt.extern_elementwise":
        return "float"
    if _element_type(op.results[0].type) in _FLOAT_TYPES or name in ("arith.truncf", "arith.extf"):
        return "float"
    return "integer"


def _reaches(value, target_names, stop_names, seen) -> bool:
    """Whether `value`'s definition chain (not through `stop_names`) reaches an op named in
    `target_names`."""
    op = _op_of(value)
    if op is None or id(op) in seen:
        return False
    seen.add(id(op))
    if op.name in target_names:
        return True
    if op.name in stop_names:
        return False
    return any(_reaches(v, target_names, stop_names, seen) for v in op.operands)


def _op_of(value):
    owner = value.owner
    # A block argument's owner is a Block (no `.name`); an op result's is its OpView/Operation.
    return owner if hasattr(owner, "operands") and hasattr(owner, "name") else None


def _selects_before_dot(dot) -> list[str]:
    """The selects on a dot operand's definition chain whose own chain reaches a load (not
    through another dot): a loaded tile that passes a select on its way into the matmul."""
    found = []

    def visit(value, seen):
        op = _op_of(value)
        if op is None or id(op) in seen or op.name in ("tt.dot", "tt.load"):
            return
        seen.add(id(op))
        if op.name == "arith.select" and _reaches(op.operands[1], {"tt.load"}, {"tt.dot"}, set()):
            found.append(str(op.operation if hasattr(op, "operation") else op).split("\n")[0][:160])
        for v in op.operands:
            visit(v, seen)

    for operand in list(dot.operands)[:2]:
        visit(operand, set())
    return found


def dot_loops(kernel: TritonKernel) -> int:
    """How many `scf.for` of the kernel hold a dot (the key or query loops it emits)."""
    with kernel.context:
        return sum(
            1
            for loop in _loops(kernel.module.operation)
            if any(op.name == "tt.dot" for op in _ops(loop.regions[0].blocks[0]))
        )


def key_loop(kernel: TritonKernel) -> KeyLoop | None:
    """The kernel's key loop (most dots; ties: fewest operations), or None without a loop
    holding a dot."""
    best = None
    with kernel.context:
        for loop in _loops(kernel.module.operation):
            body = list(_ops(loop.regions[0].blocks[0]))
            dots = [op for op in body if op.name == "tt.dot"]
            if not dots:
                continue
            counts: Counter = Counter()
            ops: Counter = Counter()
            for op in body:
                cat = _category(op)
                if cat is None:
                    continue
                ops[cat] += 1
                weight = (
                    _elements(op.operands[0].type)
                    if cat == "reduce"
                    else _elements(op.results[0].type)
                    if op.results
                    else 1
                )
                counts[cat] += weight
                if cat in ("select",):
                    counts["float"] += weight
                if cat == "reduce":
                    counts["float"] += weight
            rows, cols = _shape(dots[0].results[0].type)
            selects = [s for d in dots for s in _selects_before_dot(d)]
            found = KeyLoop(rows, cols, counts, ops, selects)
            key = (-len(dots), sum(counts.values()))
            if best is None or key < best[0]:
                best = (key, found)
    return None if best is None else best[1]


def _shape(type_) -> tuple[int, int]:
    m = re.match(r"tensor<(\d+)x(\d+)x", str(type_))
    assert m, type_
    return int(m.group(1)), int(m.group(2))


# --- where the triton package is installed: the SASS of the same IR -------------------------


def sass(kernel: TritonKernel, capability: int = 90) -> str | None:
    """The SASS of the kernel compiled by the `triton` package for sm_<capability>, or None
    where it is not installed."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        return None
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = pathlib.Path(d) / f"{kernel.name}.ttir"
        src.write_text(kernel.text)
        compiled = triton.compile(
            str(src),
            target=GPUTarget("cuda", capability, 32),
            options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages),
        )
        cubin = pathlib.Path(d) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


# --- the command line: ours beside JAX's mha ------------------------------------------------


def lower_ours(
    head_dim: int, causal: bool, seq: int = 8192, dtype=jnp.bfloat16, backward: bool = True, window_left=None
):
    """Our forward (and backward) at B = 2, N = 16, T = S = seq, lowered for `cuda`."""
    from jax_flash import pallas
    from jax_flash._spec import AttentionSpec, MaskInputs

    spec = AttentionSpec(
        batch=2,
        q_len=seq,
        kv_len=seq,
        num_heads=16,
        num_kv_heads=16,
        head_dim=head_dim,
        dtype=jnp.dtype(dtype).name,
        scale=head_dim**-0.5,
        window_left=window_left,
        window_right=0 if causal else None,
    )
    x = jax.ShapeDtypeStruct((2, seq, 16, head_dim), dtype)

    def f(q, k, v):
        out, lse = pallas.forward(spec, q, k, v, MaskInputs(), interpret=False)
        if not backward:
            return out, lse
        return out, lse, pallas.backward(spec, q, k, v, MaskInputs(), out, lse, out, lse, interpret=False)

    return jax.jit(f).trace(x, x, x).lower(lowering_platforms=("cuda",))


def lower_jax_mha(head_dim: int, causal: bool, seq: int = 8192, dtype=jnp.bfloat16, backward: bool = True):
    """JAX's reference Pallas kernel (`jax.experimental.pallas.ops.gpu.attention.mha`) with its
    default blocks and warps, layout [B, T, N, H]; traced without 64-bit types (its causal
    mask mixes int32 and Python ints)."""
    from jax.experimental.pallas.ops.gpu import attention

    x = jax.ShapeDtypeStruct((2, seq, 16, head_dim), dtype)

    mha = functools.partial(attention.mha, segment_ids=None, sm_scale=head_dim**-0.5, causal=causal)

    def f(q, k, v):
        o = mha(q, k, v)
        if not backward:
            return o
        _, pullback = jax.vjp(mha, q, k, v)
        return pullback(o)

    with jax.enable_x64(False):
        return jax.jit(f).trace(x, x, x).lower(lowering_platforms=("cuda",))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--sass", action="store_true", help="also the SASS (needs the triton package)")
    parser.add_argument("--dump", type=pathlib.Path, help="write each kernel's Triton IR here")
    args = parser.parse_args()
    for who, lower in (("jax_flash", lower_ours), ("jax mha", lower_jax_mha)):
        for kernel in triton_kernels(lower(args.head_dim, args.causal)):
            loop = key_loop(kernel)
            print(f"{who:9s} {kernel.name:28s} warps {kernel.num_warps} stages {kernel.num_stages}")
            if loop is not None:
                print("    " + ", ".join(f"{k} {v}" for k, v in loop.summary().items()))
                for s in loop.select_before_dot:
                    print("    select before dot:", s)
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{who.replace(' ', '_')}_{kernel.name}.ttir").write_text(kernel.text)
            if args.sass:
                text = sass(kernel)
                if text is None:
                    print("    (no triton package: no SASS)")
                    continue
                sys.path.insert(0, str(pathlib.Path(__file__).parent))
                import sass_loops

                for instructions in sass_loops.parse(text).values():
                    sl = sass_loop(instructions)
                    if sl is not None:
                        print("    sm_90 SASS key loop: " + ", ".join(f"{k} {v}" for k, v in sl.items()))
    return 0


def sass_loop(instructions) -> dict | None:
    """The SASS key loop of a Triton kernel (the backward branch holding the most HMMA or
    HGMMA; ties: the fewest instructions) and its instruction classes."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import sass_loops

    best = None
    for start, end in sass_loops.loops(instructions):
        body = [i for i in instructions if start <= i.address <= end]
        mma = sum(1 for i in body if i.word in ("HMMA", "HGMMA"))
        if not mma:
            continue
        key = (-mma, len(body))
        if best is None or key < best[0]:
            words = Counter(i.word for i in body)
            best = (
                key,
                {
                    "instructions": len(body),
                    "mma": mma,
                    "barriers": words["BAR"],
                    "shuffles": words["SHFL"],
                    "sts": words["STS"],
                    "selects": words["FSEL"] + words["SEL"],
                    "mufu": words["MUFU"],
                    "local": sum(1 for i in instructions if i.word in ("STL", "LDL")),
                },
            )
    return None if best is None else best[1]


if __name__ == "__main__":
    sys.exit(main())

"""A test-only shim over private JAX: the Mosaic GPU interpreter's missing pieces, and a reader of
the lowered Mosaic GPU module.

JAX's GPU interpret mode (`InterpretGPUParams`, private: `jax._src.pallas.mosaic_gpu.interpret`)
runs a Pallas Mosaic GPU kernel on the CPU, warpgroups as threads, with shared memory, TMA
copies and barriers simulated and races detected. In jax 0.10.2 it stops on five things the
FlashAttention-3 schedule needs, all of them plain data movement on the host:

- `pl.run_state` over a wgmma accumulator (`plgpu.ACC.init(o)`: accumulate into registers
  that already hold O): here an accumulator allocated with its initial value, the body
  interpreted, the final value read back, as the primitive's semantics say;
- `plgpu.layout_cast` (a register layout, which the host has none of): the identity;
- a wgmma whose A operand is a value in registers (P in P·V): here copied into a temporary
  accumulator-space buffer for the one product;
- `plgpu.load` (a read of a ref into a register layout): the plain read `ref[idx]`;
- a wgmma whose B operand is transposed (`plgpu.transpose_ref`, Kᵀ in Q·Kᵀ): read untransposed
  and transposed on the host.

`module_ops` parses the Mosaic GPU module of a lowered call (MLIR bytecode in the custom
call's backend config) in a context with JAX's dialects registered, and counts its operations.

Private API, pinned: `JAX_VERSION` is the version it was written against, and `available()`
says why it cannot run on another (tests/internals/test_pallas_mosaic.py skips with that
reason). Never imported by the package.
"""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

JAX_VERSION = "0.10.2"


def available() -> str | None:
    """Why the shim cannot run here, or None."""
    if jax.__version__ != JAX_VERSION:
        return f"the Mosaic GPU interpreter shim is written against jax {JAX_VERSION}, this is {jax.__version__}"
    return None


@functools.cache
def install():
    """Patch the interpreter (once per process) and return `InterpretGPUParams`."""
    from jax._src import core as jax_core
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu import core as gpu_core, primitives as gpu_primitives
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from jax._src.state import discharge, primitives as state_primitives, types as state_types

    interpreter = jaxpr_interpret.JaxprInterpreter
    original_interpret = interpreter.interpret
    original_wgmma = interpreter._interpret_wgmma_ref_p

    def at(self):
        """The thread the interpreter is running, as its callbacks take it."""
        return dict(
            device_id=jnp.int32(self.device_info.device_id),
            grid_point_coords=self.grid_point_coords,
            thread_id=self.thread_id,
        )

    def allocate(self, token, value, source_info):
        """A buffer in the accumulators' memory space (registers) holding `value`."""
        token, request = gpu_callbacks.call_make_allocation_request_array(
            token=token,
            device_id=jnp.int32(self.device_info.device_id),
            memory_space_id=gpu_callbacks.get_memory_space_idx(gpu_core.MemorySpace.REGS),
            thread_id=jnp.int32(self.thread_id),
            initial_ref_count=1,
        )
        return gpu_callbacks.call_allocate_buffer(
            token=token,
            **at(self),
            allocation_request_as_array=request,
            value=value,
            source_info=source_info,
        )

    def release(self, token, alloc, source_info):
        return gpu_callbacks.call_deallocate_buffer(
            token=token,
            **at(self),
            allocation_key_as_array=alloc,
            source_info=source_info,
        )

    def read(self, token, alloc, aval, source_info):
        return gpu_callbacks.call_get(
            token=token,
            result_shape_and_dtype=jax.ShapeDtypeStruct(aval.shape, aval.dtype),
            **at(self),
            allocation_key_as_array=alloc,
            transforms=(),
            source_info=source_info,
        )

    def run_state(self, eqn, token, inits):
        """Each operand that is a value and a reference in the body gets a buffer holding it
        (an accumulator: plgpu.ACC.init); references closed over pass through. The results are
        the operands' final values."""
        jaxpr = eqn.params["jaxpr"]
        args, allocs = [], {}
        for i, (outer, inner, init) in enumerate(zip(eqn.invars, jaxpr.invars, inits, strict=True)):
            if isinstance(inner.aval, state_types.AbstractRef) and not isinstance(outer.aval, state_types.AbstractRef):
                token, allocs[i] = allocate(self, token, jnp.asarray(init, inner.aval.dtype), eqn.source_info)
                args.append(allocs[i])
            else:
                args.append(init)
        token, _ = original_interpret(self, jaxpr, token, *args)
        outs = list(inits)
        for i, alloc in allocs.items():
            token, outs[i] = read(self, token, alloc, jaxpr.invars[i].aval, eqn.source_info)
            token = release(self, token, alloc, eqn.source_info)
        return token, outs[len(inits) - len(eqn.outvars) :]

    def interpret(self, jaxpr, token, *args):
        """The interpreter's loop, with run_state and layout_cast handled first."""
        handled = {discharge.run_state_p, gpu_core.layout_cast_p, gpu_primitives.load_p}
        if not any(e.primitive in handled for e in jaxpr.eqns):
            return original_interpret(self, jaxpr, token, *args)
        # Split the jaxpr at each handled equation: the runs in between go to the interpreter.
        env = dict(zip(jaxpr.constvars + jaxpr.invars, args, strict=True))
        read_var = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]
        pending: list = []

        def flush(token):
            if not pending:
                return token
            inputs = sorted(
                {v for e in pending for v in e.invars if not isinstance(v, jax_core.Literal)}
                - {v for e in pending for v in e.outvars},
                key=id,
            )
            outputs = [v for e in pending for v in e.outvars if not isinstance(v, jax_core.DropVar)]
            part = jax_core.Jaxpr(
                [], inputs, outputs, list(pending), jax_core.join_effects(*(e.effects for e in pending))
            )
            token, values = original_interpret(self, part, token, *(env[v] for v in inputs))
            env.update(zip(outputs, values, strict=True))
            pending.clear()
            return token

        for eqn in jaxpr.eqns:
            if eqn.primitive is discharge.run_state_p:
                token = flush(token)
                token, outs = run_state(self, eqn, token, [read_var(v) for v in eqn.invars])
                env.update(zip(eqn.outvars, outs, strict=True))
            elif eqn.primitive is gpu_core.layout_cast_p:
                token = flush(token)
                env[eqn.outvars[0]] = read_var(eqn.invars[0])
            elif eqn.primitive is gpu_primitives.load_p:  # a read of the ref, as `ref[idx]`
                pending.append(eqn.replace(primitive=state_primitives.get_p, params=dict(tree=eqn.params["tree"])))
            else:
                pending.append(eqn)
        token = flush(token)
        return token, [read_var(v) for v in jaxpr.outvars]

    def wgmma(self, eqn, token, get_invals):
        """A register A operand goes through a temporary accumulator-space buffer."""
        a_var = eqn.invars[1]
        if isinstance(a_var.aval, state_types.AbstractRef):
            return original_wgmma(self, eqn, token, get_invals)
        invals = list(get_invals())
        token, alloc = allocate(self, token, invals[1], eqn.source_info)
        invals[1] = alloc
        token, out = original_wgmma(self, eqn, token, lambda: invals)
        token = release(self, token, alloc, eqn.source_info)
        return token, out

    def wgmma_callback(
        *,
        token,
        device_id,
        grid_point_coords,
        thread_id,
        acc_allocation_key_as_array,
        acc_transforms,
        acc_dtype,
        a_allocation_key_as_array,
        a_transforms,
        b_allocation_key_as_array,
        b_transforms,
        source_info=None,
    ):
        """acc += a @ b on the simulated buffers, B read without its trailing transposes
        (`plgpu.transpose_ref`, a TransposeTransform) and transposed here."""
        memory = gpu_callbacks._get_shared_memory()
        thread = memory.get_global_thread_id(int(device_id), int(thread_id))
        info = interpret_utils.GPULoggingInfo(
            device_id=int(device_id),
            grid_point_coords=tuple(int(x) for x in grid_point_coords),
            thread_id=int(thread_id),
            source_info=source_info,
        )

        def operand(key, transforms):
            transforms = list(gpu_callbacks._remove_noop_transforms(transforms))
            permutation = None
            while transforms and isinstance(transforms[-1], state_types.TransposeTransform):
                p = tuple(transforms.pop().permutation)
                permutation = p if permutation is None else tuple(permutation[i] for i in p)
            where = interpret_utils.to_range(jax.tree.map(int, tuple(transforms)))
            key = gpu_callbacks.HostAllocationKey.from_array(key)
            value, _, _ = memory.get_buffer_content(key, where, thread, logging_info=info)
            return key, where, (value if permutation is None else np.transpose(value, permutation))

        _, _, a = operand(a_allocation_key_as_array, a_transforms)
        _, _, b = operand(b_allocation_key_as_array, b_transforms)
        key, where, acc = operand(acc_allocation_key_as_array, acc_transforms)
        memory.store_buffer_content(key, where, acc + np.matmul(a, b, dtype=acc_dtype), thread, logging_info=info)
        return token

    interpreter.interpret = interpret
    interpreter._interpret_wgmma_ref_p = wgmma
    gpu_callbacks.wgmma = wgmma_callback
    return InterpretGPUParams


def _unescape(text: str) -> bytes:
    """An MLIR string attribute's bytes (\\XX hex escapes, \\\\ and \\")."""
    out = bytearray()
    i = 0
    while i < len(text):
        if text[i] == "\\":
            if text[i + 1] in '\\"':
                out += text[i + 1].encode()
                i += 2
            else:
                out.append(int(text[i + 1 : i + 3], 16))
                i += 3
        else:
            out += text[i].encode()
            i += 1
    return bytes(out)


def module_ops(stablehlo_text: str) -> list[collections.Counter]:
    """Per Mosaic GPU custom call of a lowered module (its StableHLO text), the count of each
    operation of its kernel module, by name (stable_mosaic_gpu.nvvm.* and so on), and of each
    inline assembly string's first word under "asm:<word>" (ex2.approx.ftz.f32, ...); wgmma
    instructions, which sit inside braced assembly blocks, under "asm:wgmma.mma_async"."""
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir

    counts = []
    for match in re.finditer(r'custom_call @mosaic_gpu\w*\(.*?module = "((?:[^"\\]|\\.)*)"', stablehlo_text):
        context = jax_mlir.make_ir_context()
        context.allow_unregistered_dialects = True  # the module's own versioned dialect
        with context:
            module = ir.Module.parse(_unescape(match.group(1)))
        count: collections.Counter = collections.Counter()

        def walk(op, count=count):
            count[op.name] += 1
            if op.name.endswith("llvm.inline_asm"):
                asm = ir.StringAttr(op.attributes["asm_string"]).value.split()
                count["asm:" + (asm[0] if asm else "")] += 1
                count["asm:wgmma.mma_async"] += "wgmma.mma_async" in " ".join(asm)
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        walk(inner.operation, count)

        walk(module.operation)
        counts.append(count)
    return counts


def races_found() -> bool:
    """Whether the interpreter's race detection (InterpretGPUParams(detect_races=True)) saw a race
    since the process started."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    races = gpu_callbacks.get_races()
    return bool(races is not None and races.races_found)

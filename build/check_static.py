#!/usr/bin/env python3
"""Static checks of the CUDA kernels, per instantiation and per architecture (every cubin of the
wheels' list, cuda/CMakeLists.txt JAX_FLASH_WHEEL_ARCHS: sm_80, sm_90, sm_120).

For every kernel of every generated instantiation (cuda/kernels/{fwd,bwd}_*.cu):
  - no register spills and no stack frame (ptxas -v / cuobjdump -res-usage: STACK 0, LOCAL 0),
  - static + dynamic shared memory <= 101376 bytes (the sm_120 opt-in limit; the dynamic
    size comes from the kernels' own tile traits, compiled for the host),
and for the main kernels (forward, backward) the SASS of every architecture contains the
mma.sync / ldmatrix / cp.async instructions (HMMA.16816.F32, LDSM.16.M88.4, LDSM.16.MT88.4,
LDGSTS.E.BYPASS.128), the PTX has no wmma.* instruction and every object carries the PTX
image of compute_80 (which GPUs without a cubin, sm_110 and later, JIT-compile). Prints a table of registers,
shared memory and spills, with two estimates from the tile traits: shared-memory bytes read by
ldmatrix per mma.sync in the main loop, and CTAs per SM (registers, shared memory, threads);
exits 1 on any violation. Instantiations of both warp layouts (`*_warp32.cu`) are checked alike.

By default the objects of the last extension build (_skbuild/*/.../jax_flash_cuda.dir) are
reused when they are newer than every kernel source and hold every architecture; otherwise
(or with --compile) each instantiation is compiled with `nvcc -Xptxas -v`, two at a time.
cuobjdump/nvdisasm come from the pip packages nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm
(test extra) when they are not on PATH.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build"))
import sass_loops  # noqa: E402  (build/sass_loops.py: the key loop of a kernel's SASS)

CUDA = ROOT / "cuda"
KERNELS = CUDA / "kernels"


def wheel_architectures() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(cubins, PTX images) of JAX_FLASH_CUDA=ON, the wheels' list in cuda/CMakeLists.txt."""
    text = (CUDA / "CMakeLists.txt").read_text()
    found = re.search(r'set\(JAX_FLASH_WHEEL_ARCHS "([^"]+)"\)', text)
    if found is None:
        sys.exit("check_static: no JAX_FLASH_WHEEL_ARCHS list in cuda/CMakeLists.txt")
    entries = found.group(1).split(";")
    cubins = tuple(int(e.split("-")[0]) for e in entries if not e.endswith("-virtual"))
    ptx = tuple(int(e.split("-")[0]) for e in entries if not e.endswith("-real"))
    return cubins, ptx


# Cubins, and the PTX images that GPUs without a cubin here (sm_110 and later) JIT-compile.
ARCHS, PTX_ARCHS = wheel_architectures()
SMEM_LIMIT = 101376
# sm_90 and newer reserve 1 KB of shared memory per block for the system; cuobjdump counts it in
# SHARED, the opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin = 101376 on sm_120) does not.
RESERVED_SMEM = {80: 0, 90: 1024, 100: 1024, 120: 1024}
# fwd_f16_hdim192.cu (Hv = H), fwd_f16_hdim192_hv128.cu (the value head dim Hv = 128), *_warp32.cu.
INSTANTIATION = re.compile(r"^(fwd|bwd)_(f16|bf16)_hdim(\d+)(?:_hv(\d+))?(?:_(warp32))?\.cu$")
# The mma.sync kernels (dynamic shared memory, SASS checks) and the host-side traits naming
# their shared memory size.
MAIN_KERNELS = {
    "attention_forward_kernel": "ForwardKernel",
    "attention_forward_plain_kernel": "PlainForwardKernel",
    "attention_forward_decode_kernel": "ForwardKernel",  # attention_forward_kernel on the decoding tile
    "attention_backward_kernel": "BackwardKernel",
    "attention_backward_plain_kernel": "BackwardKernel",
    "attention_backward_dq_kernel": "BackwardDqKernel",
}
BACKWARD_MAIN_KERNELS = ("attention_backward_kernel", "attention_backward_plain_kernel")
FORWARD_KERNELS = ("attention_forward_kernel", "attention_forward_plain_kernel", "attention_forward_decode_kernel")
# The decoding tile's CTAs per SM (_heuristics.CUDA_DECODE_CTAS_PER_SM, which its split-KV rule
# counts in) where the rule says they fit: sm_90 and sm_100 (228 KB of shared memory per SM); at
# H = 256 three (kernels/tile.h DecodeForwardShape: 320 bytes over a fourth).
DECODE_CTAS = {90: 4, 100: 4}
DECODE_CTAS_H256 = {90: 3, 100: 3}
REQUIRED_SASS = ("HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS.E.BYPASS.128")
# Per-SM limits for the occupancy column (CUDA C++ Programming Guide, "Technical Specifications
# per Compute Capability"; the same figures as CCCL's cuda::arch_traits): 64K 32-bit registers
# (allocated per warp, 8 per thread at a time), shared memory per SM (164 KB, 228 KB, 228 KB, 100 KB;
# each CTA also takes 1 KB reserved for the system, so one CTA may opt in to 163, 227, 99 KB),
# threads per SM and resident CTAs per SM.
SM_REGISTERS = 65536
SM_SMEM = {80: 164 * 1024, 90: 228 * 1024, 100: 228 * 1024, 120: 100 * 1024}
SM_THREADS = {80: 2048, 90: 2048, 100: 2048, 120: 1536}
SM_MAX_CTAS = {80: 32, 90: 32, 100: 32, 120: 24}
SMEM_RESERVED_PER_CTA = 1024
LDMATRIX_X4_BYTES = 512  # one ldmatrix .x4: four 8x8 matrices of 16-bit elements

# The steady-state key loop of each plain main kernel (build/sass_loops.py: the backward-branch
# loop holding the most HMMA, the fewest instructions among equals, a rolled inner k-step loop
# counted as often as it runs), per (H, Hv) and architecture: instructions per HMMA, LDSM per
# HMMA, branch instructions in the loop's address range (the inner loop's once), and the CTAs
# per SM that registers and shared memory allow. The instruction budgets are the figures
# measured with nvcc 13.0 plus 0.1, a regression guard: a compare and select per score adds
# 0.5 per HMMA or more. The general kernels' figures are printed, not held. The targets are
# lower (cuda/README.md, "The plain forward"): <= 4.0 instructions and <= 0.32 LDSM per HMMA at
# H = 128 with 2 CTAs per SM on sm_80 / sm_90. The first holds (3.92, 3.93: the budget is the
# target there); the 4-warp, 32-row tiles that reach the other two at H <= 64 spill at H = 96
# and 128 (O 128 and S 64 registers with the fragments in flight): 8 warps of 16 rows run there.
_MEASURED_PER_HMMA = {  # (H, Hv): {arch: instructions per HMMA of the plain forward's key loop}
    (32, 32): {80: 8.41, 90: 8.41, 100: 7.86, 120: 8.58},
    (64, 64): {80: 5.18, 90: 5.19, 100: 4.93, 120: 5.59},
    (96, 96): {80: 4.50, 90: 4.50, 100: 4.45, 120: 5.09},
    (128, 128): {80: 3.92, 90: 3.93, 100: 3.78, 120: 4.37},
    (128, 64): {80: 4.33, 90: 4.33, 100: 4.15, 120: 4.74},
    (192, 192): {80: 5.22, 90: 5.30, 100: 5.25, 120: 5.86},
    (192, 128): {80: 5.54, 90: 5.61, 100: 5.50, 120: 6.06},
    (256, 256): {80: 4.88, 90: 4.92, 100: 4.77, 120: 5.34},
}
# Where the target itself is below the regression guard, the target is the budget.
_TARGET_PER_HMMA = {(128, 128): {80: 4.0, 90: 4.0}}
KEY_LOOP_BUDGETS = {
    ("attention_forward_plain_kernel", h, hv): dict(
        per_hmma={
            arch: min(round(x + 0.1, 2), _TARGET_PER_HMMA.get((h, hv), {}).get(arch, 99.0))
            for arch, x in measured.items()
        },
        # 4 warps of 32 rows (H <= 64): each K and V fragment feeds 4 mma.sync; 8 warps of 16: 2.
        ldsm_per_hmma=0.32 if h <= 64 else 0.66,
        branches=2,
        ctas={80: 2, 90: 2, 100: 2, 120: 2} if h <= 64 else {},
    )
    for (h, hv), measured in _MEASURED_PER_HMMA.items()
}
# The plain backward's key loop (kernels/bwd.h attention_backward_plain_kernel: one step is one
# query block of the CTA's 64 keys, or 32 at H = 192): the figures measured with nvcc 13.0
# (2026-12-07, f16 and bf16 alike), the budget 0.1 above them, and at most the target of 4.5
# per HMMA (cuda/README.md, "The plain backward") where that is lower. Its loop holds per-step
# branches only (the next block's copy, the statistics' rows, the dQ atomics' row guards): 11 of
# them, whatever the head dim. LDSM per HMMA follows from the tile (smem B per MMA / 512).
_MEASURED_BWD_PER_HMMA = {  # (H, Hv): ({arch: instructions per HMMA}, LDSM per HMMA)
    (32, 32): ({80: 7.29, 90: 7.33, 100: 7.26, 120: 7.49}, 0.600),
    (64, 64): ({80: 4.66, 90: 4.64, 100: 4.63, 120: 4.92}, 0.575),
    (96, 96): ({80: 4.55, 90: 4.59, 100: 4.53, 120: 4.84}, 0.633),
    (128, 128): ({80: 3.92, 90: 3.92, 100: 3.88, 120: 4.21}, 0.625),
    (128, 64): ({80: 4.62, 90: 4.66, 100: 4.62, 120: 4.96}, 0.625),
    (192, 192): ({80: 5.33, 90: 5.30, 100: 5.30, 120: 5.79}, 0.810),
    (192, 128): ({80: 6.33, 90: 6.38, 100: 6.46, 120: 6.97}, 0.806),
    (256, 256): ({80: 4.21, 90: 4.26, 100: 4.22, 120: 4.56}, 0.821),
}
_BWD_TARGET_PER_HMMA = {(128, 128): {80: 4.5, 90: 4.5, 120: 4.5}}
KEY_LOOP_BUDGETS.update(
    {
        ("attention_backward_plain_kernel", h, hv): dict(
            per_hmma={
                arch: min(round(x + 0.1, 2), _BWD_TARGET_PER_HMMA.get((h, hv), {}).get(arch, 99.0))
                for arch, x in measured.items()
            },
            ldsm_per_hmma=round(ldsm + 0.005, 3),
            branches=11,
            # Two CTAs per SM where the 64-key tiles' registers and shared memory allow it
            # (sm_80 / sm_90 / sm_100 below H = 256).
            ctas={80: 2, 90: 2, 100: 2} if h < 256 else {},
        )
        for (h, hv), (measured, ldsm) in _MEASURED_BWD_PER_HMMA.items()
    }
)


def smem_bytes_per_mma(kind: str, t: dict) -> float:
    """Estimated shared-memory bytes read by ldmatrix per mma.sync (m16n8k16), one warp, one
    tile step of the kernel's main loop (every x4 load is 512 bytes; st.shared, the statistics
    and the epilogue are left out)."""
    h, hv, kv, q, r = t["head_dim"], t["v_head_dim"], t["block_kv"], t["block_q"], t["rows_per_warp"] // 16
    hc, hvc = h // t["col_splits"], hv // t["col_splits"]  # the backward's dK, dV columns per warp
    if kind in FORWARD_KERNELS:  # S = Q·Kᵀ (R A-loads + KV/16 B-loads per k-step), O += P·V
        loads = (h // 16) * (r + kv // 16) + (kv // 16) * (hv // 16)
    elif kind in BACKWARD_MAIN_KERNELS:  # Sᵀ (over H), dPᵀ (over Hv); dV, dK (its columns); the dQ share
        dq_cols = t["dq_cols"]
        loads = ((h + hv) // 16) * (1 + q // 16) + (q // 16) * ((hc + hvc) // 16) + (kv // 16) * (1 + dq_cols // 16)
    else:  # deterministic dQ: S (over H), dP (over Hv), dQ += dS·K
        loads = ((h + hv) // 16) * (1 + kv // 16) + (kv // 16) * (h // 16)
    return LDMATRIX_X4_BYTES * loads / hmma_per_step(kind, t)


def occupancy(arch: int, regs: int, threads: int, smem: int) -> int:
    """CTAs per SM, from registers, shared memory and threads."""
    warps = threads // 32
    by_regs = (SM_REGISTERS // (((regs + 7) // 8) * 8 * 32)) // warps
    by_smem = SM_SMEM[arch] // (smem + SMEM_RESERVED_PER_CTA)
    return min(by_regs, by_smem, SM_THREADS[arch] // threads, SM_MAX_CTAS[arch])


def tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia  # the nvidia-cuda-* wheels install into the nvidia namespace package

        for base in nvidia.__path__:
            cand = pathlib.Path(base) / "cu13" / "bin" / name
            if cand.exists():
                return str(cand)
    except ImportError:
        pass
    sys.exit(
        f"check_static: {name} not found (pip install nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86)"
    )


def instantiations() -> list[pathlib.Path]:
    return sorted(p for p in KERNELS.glob("*.cu") if INSTANTIATION.match(p.name))


def demangle_kind(symbol: str) -> str:
    # The general forward on the decoding tile (ForwardVariant::kDecode, the enum's third value).
    if "attention_forward_kernel" in symbol and "14ForwardVariantE2E" in symbol:
        return "attention_forward_decode_kernel"
    for k in (
        "attention_forward_plain_kernel",
        "attention_forward_kernel",
        "attention_backward_plain_kernel",
        "attention_backward_kernel",
        "attention_backward_dq_kernel",
        "attention_backward_delta_kernel",
        "attention_backward_convert_dq_kernel",
        "attention_backward_reduce_dkv_kernel",
    ):
        if k in symbol:
            return k
    return symbol


def build_objects(sources) -> dict[pathlib.Path, pathlib.Path] | None:
    """The extension build's objects, if they are fresh and hold every architecture."""
    # The kernels' sources and the headers they share with the host (cuda/common/).
    sources_and_headers = [*KERNELS.iterdir(), *(KERNELS.parent / "common").iterdir()]
    newest_source = max(p.stat().st_mtime for p in sources_and_headers if p.suffix in (".h", ".cu"))
    out = {}
    for src in sources:
        objs = sorted(
            ROOT.glob(f"_skbuild/*/CMakeFiles/jax_flash_cuda.dir/kernels/{src.name}.o"), key=lambda p: p.stat().st_mtime
        )
        if not objs or objs[-1].stat().st_mtime < newest_source:
            return None
        out[src] = objs[-1]
    return out


def compile_objects(sources, workdir: pathlib.Path, nvcc: str, defines=()) -> tuple[dict, dict]:
    gencode = []
    for a in ARCHS:
        gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    for a in PTX_ARCHS:
        gencode += ["-gencode", f"arch=compute_{a},code=compute_{a}"]
    gencode += [f"-D{d}" for d in defines]

    def one(src):
        obj = workdir / (src.name + ".o")
        cmd = [nvcc, "-c", "-std=c++17", "-O3", "-I", str(CUDA), *gencode, "-Xptxas", "-v", "-o", str(obj), str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"check_static: compiling {src.name} failed:\n{r.stderr}")
        return src, obj, r.stderr

    objs, logs = {}, {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for src, obj, log in pool.map(one, sources):
            objs[src], logs[src] = obj, log
    return objs, logs


def ptxas_spills(log: str) -> dict:
    """{(arch, kind): (stack, spill_stores, spill_loads)} from ptxas -v output."""
    out, arch, func = {}, None, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for 'sm_(\d+)'", line)
        if m:
            func, arch = demangle_kind(m.group(1)), int(m.group(2))
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and func:
            out[(arch, func)] = tuple(int(x) for x in m.groups())
    return out


def resource_usage(obj: pathlib.Path, cuobjdump: str) -> dict:
    """{(arch, kind): {REG, STACK, SHARED, LOCAL}} from cuobjdump -res-usage."""
    text = subprocess.run([cuobjdump, "-res-usage", str(obj)], capture_output=True, text=True, check=True).stdout
    out, arch, func = {}, None, None
    for line in text.splitlines():
        m = re.match(r"\s*arch = sm_(\d+)", line)
        if m:
            arch = int(m.group(1))
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            func = demangle_kind(m.group(1))
        if func and "REG:" in line:
            out[(arch, func)] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
            func = None
    return out


def sass_dump(obj: pathlib.Path, cuobjdump: str) -> str:
    env = dict(os.environ, PATH=str(pathlib.Path(cuobjdump).parent) + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run(
        [cuobjdump, "--dump-sass", str(obj)], capture_output=True, text=True, check=True, env=env
    ).stdout


def key_loops(functions: dict) -> dict:
    """{(arch, kind): (the key loop, the function's instructions)} of the main kernels, from
    sass_loops.parse's {(arch, function): instructions}."""
    out = {}
    for (arch, func), instructions in functions.items():
        kind = demangle_kind(func)
        if kind in MAIN_KERNELS:
            loop = sass_loops.key_loop(instructions)
            if loop is not None:
                out[(arch, kind)] = (loop, instructions)
    return out


def hmma_per_step(kind: str, t: dict) -> int:
    """The mma.sync one warp issues per step of its main loop (a key tile in the forward)."""
    h, hv, kv, q, r = t["head_dim"], t["v_head_dim"], t["block_kv"], t["block_q"], t["rows_per_warp"] // 16
    if kind in FORWARD_KERNELS:
        return r * (h // 16) * (kv // 8) + r * (kv // 16) * (hv // 8)
    hc, hvc = h // t["col_splits"], hv // t["col_splits"]
    if kind in BACKWARD_MAIN_KERNELS:
        return ((h + hv) // 16) * (q // 8) + (q // 16) * ((hc + hvc) // 8) + (kv // 16) * (t["dq_cols"] // 8)
    return ((h + hv) // 16) * (kv // 8) + (kv // 16) * (h // 8)


def loop_budget(kind: str, head_dim: int, v_head_dim: int) -> dict | None:
    """KEY_LOOP_BUDGETS' row for a kernel and head dims, or None (figures reported only)."""
    return KEY_LOOP_BUDGETS.get((kind, head_dim, v_head_dim))


def sass_opcodes(functions: dict) -> dict:
    """{(arch, kind): set of SASS opcodes with modifiers}, from sass_loops.parse's
    {(arch, function): instructions}."""
    out: dict = {}
    for (arch, func), instructions in functions.items():
        out.setdefault((arch, demangle_kind(func)), set()).update(i.opcode for i in instructions)
    return out


def ptx_images(obj: pathlib.Path, cuobjdump: str) -> set[int]:
    """The compute_XY of every PTX image in the object (cuobjdump -lptx: "... .sm_80.ptx")."""
    text = subprocess.run([cuobjdump, "-lptx", str(obj)], capture_output=True, text=True).stdout
    return {int(a) for a in re.findall(r"\.sm_(\d+)[af]?\.ptx", text)}


def ptx_has_wmma(obj: pathlib.Path, cuobjdump: str) -> bool:
    text = subprocess.run([cuobjdump, "--dump-ptx", str(obj)], capture_output=True, text=True).stdout
    return "wmma." in text


def tile_traits(sources) -> dict:
    """{(instantiation stem, kernel): {smem, threads, head_dim, v_head_dim, block_q, block_kv,
    rows_per_warp, dq_cols, col_splits}} from the kernels' tile traits, compiled for the host."""
    cxx = shutil.which("c++") or shutil.which("g++")
    lines = []
    for src in sources:
        p, d, h, hv, layout = INSTANTIATION.match(src.name).groups()
        elem = {"f16": "F16", "bf16": "Bf16"}[d]
        layout_arg = ", Layout::kWarp32" if layout else ""
        if p == "fwd":
            kernels = ["attention_forward_kernel"] + (
                [] if layout else ["attention_forward_plain_kernel", "attention_forward_decode_kernel"]
            )
        else:
            kernels = ["attention_backward_kernel", "attention_backward_dq_kernel"] + (
                [] if layout else ["attention_backward_plain_kernel"]
            )
        for kernel in kernels:
            traits = MAIN_KERNELS[kernel]
            no_layout = kernel in ("attention_backward_dq_kernel", "attention_forward_plain_kernel")
            args = f"{elem}, {h}, {hv or h}" + ("" if no_layout else layout_arg)
            if kernel == "attention_forward_decode_kernel":
                args += ", Layout::kWarp16, ForwardVariant::kDecode"
            k = f"{traits}<{args}>"
            dq_cols = f"{k}::DQ_COLS" if kernel in BACKWARD_MAIN_KERNELS else "0"
            lines.append(
                f'  std::printf("{src.stem} {kernel} %d %d {h} {hv or h} %d %d %d %d %d\\n", {k}::kSmemBytes, '
                f"{k}::THREADS, {k}::BLOCK_Q, {k}::BLOCK_KV, {k}::kShape.rows_per_warp, {dq_cols}, "
                f"{k}::kShape.col_splits);"
            )
    program = (
        '#include <cstdio>\n#include "kernels/fwd.h"\n#include "kernels/bwd.h"\n'
        "using namespace jax_flash::kernels;\nint main() {\n" + "\n".join(lines) + "\n}\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        cc = pathlib.Path(tmp) / "smem.cc"
        cc.write_text(program)
        exe = pathlib.Path(tmp) / "smem"
        subprocess.run(
            [cxx, "-std=c++17", "-DJAX_FLASH_EMULATE", "-I", str(CUDA), str(cc), "-o", str(exe)],
            check=True,
            capture_output=True,
        )
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    names = (
        "smem",
        "threads",
        "head_dim",
        "v_head_dim",
        "block_q",
        "block_kv",
        "rows_per_warp",
        "dq_cols",
        "col_splits",
    )
    return {(f[0], f[1]): dict(zip(names, map(int, f[2:]))) for f in (l.split() for l in out.splitlines())}


def markdown_table(rows) -> str:
    """The main kernels' rows merged over dtypes and archs: regs and CTAs/SM per arch."""
    groups = {}
    for stem, arch, kind, regs, smem, stack, local, spills, per_mma, ctas, loop_per_hmma, _, _ in rows:
        if "attention_" + kind not in MAIN_KERNELS:
            continue
        _p, _d, h, hv, layout = INSTANTIATION.match(stem + ".cu").groups()
        head = h if hv is None else f"{h}, Hv {hv}"
        g = groups.setdefault(
            (kind, layout or "warp16", head),
            {"regs": {}, "ctas": {}, "smem": set(), "per_mma": set(), "bad": set(), "loop": {}},
        )
        g["loop"].setdefault(arch, set()).add(loop_per_hmma)
        g["regs"].setdefault(arch, set()).add(regs)
        g["ctas"].setdefault(arch, set()).add(ctas)
        g["smem"].add(smem)
        g["per_mma"].add(per_mma)
        g["bad"].add(f"{stack}/{local}" + ("" if spills == "-" else f"/{spills}"))
    fmt = lambda s: "/".join(str(x) for x in sorted(s))  # f16 and bf16 differ: both
    lines = [
        (
            "| kernel | layout | H | regs sm_80 / sm_90 / sm_120 | smem (bytes) | stack / local / spill st / ld "
            "(bytes) | smem B per MMA "
            "| CTAs per SM sm_80 / sm_90 / sm_120 | key loop instructions per HMMA sm_80 / sm_90 / sm_120 |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {
        k: i
        for i, k in enumerate(
            ("forward_plain_kernel", "forward_kernel", "forward_decode_kernel", "backward_kernel", "backward_dq_kernel")
        )
    }

    def head_key(head):  # (H, Hv): Hv = H first, then the narrower values
        h, _, hv = head.partition(", Hv ")
        return int(h), -int(hv or h)

    for (kind, layout, h), g in sorted(
        groups.items(), key=lambda x: (order.get(x[0][0], 9), x[0][1], head_key(x[0][2]))
    ):
        archs = [f"sm_{a}" for a in ARCHS]
        lines.append(
            f"| {kind.replace('_kernel', '')} | {layout} | {h} | "
            + " / ".join(fmt(g["regs"].get(a, {"-"})) for a in archs)
            + f" | {fmt(g['smem'])} | {fmt(g['bad'])} | {fmt(g['per_mma'])} | "
            + " / ".join(fmt(g["ctas"].get(a, {"-"})) for a in archs)
            + " | "
            + " / ".join(fmt(g["loop"].get(a, {"-"})) for a in archs)
            + " |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="always compile, never reuse build objects")
    parser.add_argument(
        "--only", action="append", default=[], metavar="FILE", help="check only this instantiation (repeatable)"
    )
    parser.add_argument(
        "--arch", type=int, default=0, help="compile and check only this sm_XY (no PTX images: their check is skipped)"
    )
    parser.add_argument(
        "--define", action="append", default=[], metavar="MACRO", help="compile with -DMACRO (implies --compile)"
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="also print the main kernels' figures as one markdown row per kernel, layout and head dim",
    )
    args = parser.parse_args()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("check_static: nvcc not found", file=sys.stderr)
        return 2
    cuobjdump = tool("cuobjdump")
    tool("nvdisasm")
    global ARCHS, PTX_ARCHS
    sources = instantiations()
    if args.only:
        sources = [src for src in sources if src.name in args.only]
    if args.arch:
        ARCHS, PTX_ARCHS = (args.arch,), ()
    if args.define or args.arch:
        args.compile = True
    if not sources:
        print("check_static: no generated instantiations in cuda/kernels", file=sys.stderr)
        return 1

    logs = {}
    objs = None if args.compile else build_objects(sources)
    with tempfile.TemporaryDirectory() as tmp:
        if objs is not None:
            probe = next(iter(objs.values()))
            usage_probe = resource_usage(probe, cuobjdump)
            if not all(any(a == arch for a, _ in usage_probe) for arch in ARCHS) or not set(PTX_ARCHS) <= ptx_images(
                probe, cuobjdump
            ):
                objs = None
        if objs is None:
            print(f"compiling {len(sources)} instantiations for sm_{', sm_'.join(map(str, ARCHS))} (2 jobs)...")
            objs, logs = compile_objects(sources, pathlib.Path(tmp), nvcc, args.define)
        else:
            print("reusing the extension build's objects")
        traits = tile_traits(sources)

        problems = []
        rows = []
        for src in sources:
            obj = objs[src]
            usage = resource_usage(obj, cuobjdump)
            functions = sass_loops.parse(sass_dump(obj, cuobjdump))
            sass = sass_opcodes(functions)
            loops = key_loops(functions)
            spills = ptxas_spills(logs.get(src, ""))
            if ptx_has_wmma(obj, cuobjdump):
                problems.append(f"{src.name}: the PTX contains wmma instructions")
            missing_ptx = set(PTX_ARCHS) - ptx_images(obj, cuobjdump)
            if missing_ptx:
                problems.append(
                    f"{src.name}: no PTX image for compute_{', compute_'.join(map(str, sorted(missing_ptx)))}"
                )
            for arch in ARCHS:
                kinds = sorted(k for a, k in usage if a == arch)
                if not kinds:
                    problems.append(f"{src.name}: no sm_{arch} code")
                for kind in kinds:
                    u = usage[(arch, kind)]
                    main_kernel = kind in MAIN_KERNELS
                    static_smem = max(0, u.get("SHARED", 0) - RESERVED_SMEM.get(arch, 0))
                    tt = traits.get((src.stem, kind))
                    total_smem = static_smem + (tt["smem"] if tt else 0)
                    stack, stores, loads = spills.get((arch, kind), (u.get("STACK", 0), None, None))
                    spill_text = "-" if stores is None else f"{stores}/{loads}"
                    per_mma = f"{smem_bytes_per_mma(kind, tt):.0f}" if tt else "-"
                    ctas = f"{occupancy(arch, u['REG'], tt['threads'], total_smem)}" if tt else "-"
                    loop_cols = ("-", "-", "-")
                    if (arch, kind) in loops and tt:
                        loop, instructions = loops[(arch, kind)]
                        branches = loop.count("branch")  # the inner loop's once
                        budget = loop_budget(kind, tt["head_dim"], tt["v_head_dim"])
                        try:
                            loop = sass_loops.weighted(loop, instructions, hmma_per_step(kind, tt))
                            mark = ""
                        except ValueError as e:  # several inner loops (the general kernels' features)
                            if budget is not None:
                                problems.append(f"{src.name} sm_{arch} {kind}: {e}")
                            mark = "*"  # the address range counted once: not per HMMA of a key step
                        loop_cols = (
                            f"{loop.per_hmma():.2f}{mark}",
                            f"{loop.per_hmma('ldsm'):.3f}{mark}",
                            str(branches),
                        )
                        where = f"{src.name} sm_{arch} {kind}"
                        if budget is not None:
                            limit = budget["per_hmma"].get(arch)
                            if limit is None or loop.per_hmma() > limit:
                                problems.append(
                                    f"{where}: key loop {loop.per_hmma():.2f} instructions per HMMA "
                                    f"> {limit} ({len(loop.instructions)} / {loop.hmma})"
                                )
                            if loop.per_hmma("ldsm") > budget["ldsm_per_hmma"]:
                                problems.append(
                                    f"{where}: key loop {loop.per_hmma('ldsm'):.3f} LDSM per HMMA > {budget['ldsm_per_hmma']}"
                                )
                            if branches > budget["branches"]:
                                problems.append(f"{where}: key loop {branches} branches > {budget['branches']}")
                            if int(ctas) < budget["ctas"].get(arch, 1):
                                problems.append(f"{where}: {ctas} CTAs per SM < {budget['ctas'][arch]}")
                    rows.append(
                        (
                            src.stem,
                            f"sm_{arch}",
                            kind.replace("attention_", ""),
                            u["REG"],
                            total_smem,
                            stack,
                            u.get("LOCAL", 0),
                            spill_text,
                            per_mma,
                            ctas,
                            *loop_cols,
                        )
                    )
                    where = f"{src.name} sm_{arch} {kind}"
                    if kind == "attention_forward_decode_kernel" and tt:
                        want = (DECODE_CTAS_H256 if tt["head_dim"] == 256 else DECODE_CTAS).get(arch, 1)
                        if int(ctas) < want:
                            problems.append(f"{where}: {ctas} CTAs per SM < {want}")
                    if u.get("STACK", 0) > 0 or stack > 0:
                        problems.append(f"{where}: stack frame {max(stack, u.get('STACK', 0))} bytes")
                    if u.get("LOCAL", 0) > 0 or (stores or 0) > 0 or (loads or 0) > 0:
                        problems.append(
                            f"{where}: local memory / spills (LOCAL {u.get('LOCAL', 0)}, "
                            f"spill stores {stores}, loads {loads})"
                        )
                    if total_smem > SMEM_LIMIT:
                        problems.append(f"{where}: shared memory {total_smem} > {SMEM_LIMIT}")
                    if main_kernel:
                        ops = sass.get((arch, kind), set())
                        for want in REQUIRED_SASS:
                            if not any(op.startswith(want) for op in ops):
                                problems.append(f"{where}: no {want} in the SASS")
                        if any(op.startswith("HMMA") and not op.startswith("HMMA.16816") for op in ops):
                            problems.append(f"{where}: HMMA of another shape than m16n8k16")

    header = (
        "instantiation",
        "arch",
        "kernel",
        "regs",
        "smem",
        "stack",
        "local",
        "spill st/ld",
        "smem B/mma",
        "CTAs/SM",
        "loop/HMMA",
        "LDSM/HMMA",
        "loop BRA",
    )
    widths = [max(len(str(r[i])) for r in [*rows, header]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    if args.markdown:
        print()
        print(markdown_table(rows))
    if problems:
        print("\nFAILED:", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 1
    print(
        f"\nOK: {len(rows)} kernels, no spills, no stack, shared memory <= {SMEM_LIMIT}, "
        "HMMA/LDSM/LDGSTS in every main kernel on every arch, no wmma, "
        f"PTX for compute_{', compute_'.join(map(str, PTX_ARCHS))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

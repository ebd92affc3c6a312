"""Static checks of the CUDA kernels (build/check_static.py): per instantiation and per arch
(every cubin of the wheels: sm_80, sm_90, sm_120), no register spills, no stack frame, shared memory within the 99 KB
sm_120 limit, and mma.sync/ldmatrix/cp.async (HMMA, LDSM, LDGSTS) in the SASS, no wmma; the
value head dims Hv != H ((192, 128), (128, 64)) among them.

Needs nvcc (skipped without it) and cuobjdump/nvdisasm (the test extra installs them).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: CUDA kernels not compiled here")


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "build" / script), *args], capture_output=True, text=True, timeout=900
    )


def test_instantiations_are_generated():
    r = _run("generate_kernels.py", "--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_spills_smem_fits_and_sass_uses_mma_sync():
    r = _run("check_static.py")
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK:" in r.stdout
    # The value head dims Hv != H are checked like the others: each kernel of their files on
    # every arch (forward; backward, deterministic dQ, delta, group sum).
    rows = [line.split() for line in r.stdout.splitlines()]
    for pair in ("hdim192_hv128", "hdim128_hv64"):
        for dtype in ("f16", "bf16"):
            for pass_name, kernels in (
                ("fwd", {"forward_kernel"}),
                (
                    "bwd",
                    {
                        "backward_kernel",
                        "backward_plain_kernel",
                        "backward_dq_kernel",
                        "backward_delta_kernel",
                        "backward_reduce_dkv_kernel",
                    },
                ),
            ):
                stem = f"{pass_name}_{dtype}_{pair}"
                for arch in ("sm_80", "sm_90", "sm_120"):
                    seen = {row[2] for row in rows if len(row) > 2 and row[0] == stem and row[1] == arch}
                    assert kernels <= seen, (stem, arch, seen)


@pytest.mark.parametrize(
    "source, kernel",
    [
        ("fwd_bf16_hdim128.cu", "attention_forward_plain_kernel"),
        ("bwd_bf16_hdim128.cu", "attention_backward_plain_kernel"),
    ],
)
def test_key_loop_budget_catches_a_per_score_test(source, kernel):
    """The plain kernels' key-loop budgets (build/check_static.py, KEY_LOOP_BUDGETS) can fail: a
    compare and select per score planted in the loop (JAX_FLASH_PLANT_SCORE_TEST, never defined
    in a build) takes H = 128 on sm_90 over its instructions-per-HMMA budget, forward and
    backward."""
    r = _run("check_static.py", "--only", source, "--arch", "90", "--define", "JAX_FLASH_PLANT_SCORE_TEST")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{kernel}: key loop" in r.stderr and "instructions per HMMA >" in r.stderr, r.stderr


def test_sass_loop_walker():
    """build/sass_loops.py on a made-up listing: the key loop is the backward branch's range with
    the most HMMA (the fewest instructions among equals), and a rolled inner loop is counted as
    often as the MMAs of one key step say it runs."""
    sys.path.insert(0, str(ROOT / "build"))
    import sass_loops

    lines = ["        code for sm_90", "        Function : kernel"]
    program = [
        (0x00, "MOV R1, R2"),
        # loop A (0x10-0x40): 2 HMMA, 4 instructions
        (0x10, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        (0x20, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        (0x30, "FMUL R1, R1, R2"),
        (0x40, "@P0 BRA 0x10"),
        # loop B (0x50-0xa0): 2 HMMA, 6 instructions, an inner loop (0x60-0x80) with 1 HMMA
        (0x50, "LDSM.16.M88.4 R4, [R2]"),
        (0x60, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        (0x70, "IADD3 R1, R1, 0x1, RZ"),
        (0x80, "@P1 BRA 0x60"),
        (0x90, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        (0xA0, "@P2 BRA 0x50"),
        (0xB0, "EXIT"),
    ]
    lines += [f"        /*{a:04x}*/                   {text} ;" for a, text in program]
    parsed = sass_loops.parse("\n".join(lines))
    (_arch, name), instructions = next(iter(parsed.items()))
    assert name == "kernel" and len(instructions) == len(program)
    loop = sass_loops.key_loop(instructions)
    assert (loop.start, loop.end, loop.hmma, len(loop.instructions)) == (0x10, 0x40, 2, 4)  # fewer instructions
    b = sass_loops.KeyLoop(0x50, 0xA0, [i for i in instructions if 0x50 <= i.address <= 0xA0], 1)
    # One key step issues 4 HMMA: the inner loop runs 3 times.
    w = sass_loops.weighted(b, instructions, 4)
    assert (w.hmma, len(w.instructions), w.count("ldsm"), w.count("branch")) == (4, 12, 1, 4)
    assert sass_loops.weighted(loop, instructions, 2) is loop  # no inner loop
    whole = sass_loops.KeyLoop(0x10, 0xA0, [i for i in instructions if 0x10 <= i.address <= 0xA0], 3)
    with pytest.raises(ValueError, match="loops inside the key loop"):
        sass_loops.weighted(whole, instructions, 10)  # several inner loops: no single trip count

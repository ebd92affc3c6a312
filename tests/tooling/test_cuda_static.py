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
                    {"backward_kernel", "backward_dq_kernel", "backward_delta_kernel", "backward_reduce_dkv_kernel"},
                ),
            ):
                stem = f"{pass_name}_{dtype}_{pair}"
                for arch in ("sm_80", "sm_90", "sm_120"):
                    seen = {row[2] for row in rows if len(row) > 2 and row[0] == stem and row[1] == arch}
                    assert kernels <= seen, (stem, arch, seen)

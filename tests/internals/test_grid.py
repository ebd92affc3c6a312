"""Launch grids of the CUDA kernels (cuda/kernels/grid.h): every kernel with a CTA per
(block, head, batch) folds the batch into grid.x and spans the heads over grid.y, then grid.z,
so B·N (or B, or N) beyond grid.y/z's 65535 launches; every (block, head, batch) has exactly
one CTA.

The grid arithmetic is compiled for the host from the kernels' own traits and checked at sizes
an emulated launch could not reach in CI (65536 CTAs take minutes there); an emulated run at a
small size with uneven B, N, K, T, S checks the kernels decode their CTA index the same way.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.reference import attention_reference

from cases import GRAD_EPS, EPS, FACTOR, Shape, make_qkv, max_err

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROGRAM = r"""
#include <cstdio>
#include <vector>
#include "kernels/fwd.h"
#include "kernels/bwd.h"
using namespace jax_flash::kernels;

static int failures = 0;
#define CHECK(cond, ...) \
  do {                    \
    if (!(cond)) {        \
      ++failures;         \
      std::printf("FAIL " __VA_ARGS__); \
      std::printf("\n");  \
    }                     \
  } while (0)

// grid.x = (block, batch), heads over grid.y then grid.z, all within the launch limits; every
// (block, head, batch) is one CTA's, block fastest, and the CTAs past the last head are idle.
static void check(const char* name, const FoldedGrid& g) {
  dim3 grid;
  const LaunchError err = g.dims(&grid);
  CHECK(err.empty(), "%s: %s", name, err.c_str());
  if (!err.empty()) return;
  CHECK(grid.x <= 2147483647u && grid.y <= 65535 && grid.z <= 65535, "%s: grid %u %u %u", name, grid.x, grid.y,
        grid.z);
  CHECK(1LL * grid.y * grid.z >= g.heads && 1LL * grid.y * (grid.z - 1) < g.heads, "%s: %u x %u for %d heads", name,
        grid.y, grid.z, g.heads);
  std::vector<unsigned char> seen(static_cast<size_t>(g.blocks) * g.heads * g.batch, 0);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        const GridIndex at = g.of(x, y, z, grid.y);
        if (!g.contains(at)) {
          CHECK(z == grid.z - 1, "%s: CTA (%u, %u, %u) idle outside the last z slice", name, x, y, z);
          continue;
        }
        const bool in_range = at.block >= 0 && at.block < g.blocks && at.head >= 0 && at.batch >= 0 &&
                              at.batch < g.batch;
        CHECK(in_range, "%s: CTA (%u, %u, %u) -> (%d, %d, %d)", name, x, y, z, at.block, at.head, at.batch);
        if (!in_range) return;
        CHECK(x == static_cast<unsigned>(at.batch * g.blocks + at.block), "%s: block is not fastest in x", name);
        unsigned char& s = seen[(static_cast<size_t>(at.batch) * g.heads + at.head) * g.blocks + at.block];
        CHECK(s == 0, "%s: (%d, %d, %d) twice", name, at.block, at.head, at.batch);
        s = 1;
      }
  for (unsigned char s : seen)
    if (!s) {
      CHECK(false, "%s: a (block, head, batch) has no CTA", name);
      return;
    }
}

template <int H>
static void check_all(int B, int T, int S, int N, int KH) {
  AttentionParams p;
  p.batch = B; p.q_len = T; p.kv_len = S; p.q_heads = N; p.kv_heads = KH; p.head_dim = H;
  check("forward", ForwardKernel<Bf16, H>::grid(p));
  check("backward", BackwardKernel<Bf16, H>::grid(p));
  check("backward dq", BackwardDqKernel<Bf16, H>::grid(p));
}

int main() {
  check_all<64>(70000, 1, 1, 1, 1);      // B > 65535
  check_all<128>(1, 1, 1, 70001, 70001); // N > 65535: two z slices, the second mostly idle
  check_all<64>(2, 1, 1, 131070, 2);     // N = 2 x 65535 exactly
  check_all<32>(300, 200, 129, 300, 3);  // B*N > 65535, several blocks
  check_all<96>(3, 130, 70, 5, 1);
  dim3 grid;
  CHECK(!(FoldedGrid{65536, 1, 32768}.dims(&grid)).empty(), "2^31 CTAs in grid.x must be refused");
  CHECK((FoldedGrid{65535, 1, 32768}.dims(&grid)).empty() && grid.x == 2147450880u, "65535 x 32768 CTAs fit");
  CHECK(!LinearGrid(int64_t{1} << 31, &grid).empty(), "2^31 CTAs must be refused");
  CHECK(LinearGrid((int64_t{1} << 31) - 1, &grid).empty() && grid.x == 2147483647u, "2^31 - 1 CTAs fit");
  std::printf(failures ? "FAILED\n" : "OK\n");
  return failures ? 1 : 0;
}
"""


def test_grid_folds_batch_and_heads_into_x(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "grid.cc"
    src.write_text(PROGRAM)
    exe = tmp_path / "grid"
    subprocess.run([cxx, "-std=c++17", "-O1", "-DJAX_FLASH_EMULATE", "-I", str(ROOT / "cuda"), str(src), "-o",
                    str(exe)], check=True, capture_output=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_emulated_grid_decoding(deterministic, monkeypatch):
    """Uneven B=3, N=3 (MQA), 2 forward / 3 dQ query blocks, 2 key blocks; per-batch lengths
    differ, so a CTA that took another batch element's or head's place gives wrong numbers."""
    why = jax_flash.explain(jnp.zeros((1, 8, 2, 64), jnp.bfloat16), jnp.zeros((1, 8, 2, 64), jnp.bfloat16),
                            jnp.zeros((1, 8, 2, 64), jnp.bfloat16), implementation="cuda").reasons["cuda"]
    if why is not None:
        pytest.skip(f"cuda unavailable here: {why}")
    if deterministic:
        monkeypatch.setenv("JAX_FLASH_DETERMINISTIC", "1")
    shape = Shape(3, 130, 70, 3, 1, 32)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=3)
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([70, 41, 9], jnp.int32),
              query_seq_lengths=jnp.asarray([130, 77, 100], jnp.int32))

    def loss(fn, **extra):
        def f(q, k, v):
            return jnp.sum(fn(q, k, v, **kw, **extra).astype(jnp.float32) * jnp.cos(q.astype(jnp.float32)))

        return f

    out = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", **kw))(q, k, v)
    ref64 = attention_reference(q, k, v, compute_dtype=jnp.float64, **kw)
    ref_lo = attention_reference(q, k, v, **kw)
    assert max_err(out, ref64) <= FACTOR * max_err(ref_lo, ref64) + EPS["bfloat16"]
    g = jax.jit(jax.grad(loss(jax_flash.attention, implementation="cuda"), argnums=(0, 1, 2)))(q, k, v)
    g64 = jax.grad(loss(attention_reference, compute_dtype=jnp.float64), argnums=(0, 1, 2))(q, k, v)
    g_lo = jax.grad(loss(attention_reference), argnums=(0, 1, 2))(q, k, v)
    for name, a, r64, rlo in zip(("dq", "dk", "dv"), g, g64, g_lo):
        err, tol = max_err(a, r64), FACTOR * max_err(rlo, r64) + GRAD_EPS["bfloat16"]
        assert err <= tol, f"{name} error {err:.3g} > {tol:.3g}"
        assert np.any(np.asarray(a, np.float32) != 0)

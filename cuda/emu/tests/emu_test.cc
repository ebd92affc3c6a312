// Unit tests of the host emulation (cuda/emu/): every emulated PTX wrapper against the PTX ISA's
// fragment tables, the SIMT runtime, and the strictness checks. Built and run by
// tests/internals/test_emulator.py:
//   g++ -std=c++17 -O1 -Icuda cuda/emu/tests/emu_test.cc cuda/emu/simt.cc cuda/emu/ptx_emu.cc
// Prints one line per test and a summary; exits non-zero when a test fails.
//
// The expected values here are derived from the ISA text in a different form than the
// emulator uses (per register instead of per element, flat row-major order instead of
// row/column formulas, literal constants for rounding), so that a misreading in one place
// does not hide behind the same misreading in the other. Section numbers: PTX ISA 8.x/9.x.
#define JAX_FLASH_EMULATE 1
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "emu/ptx_emu.h"
#include "emu/simt.h"
#include "kernels/ptx.h"  // the kernels' wrappers: their emulated branch must reach the same code

namespace emu = jax_flash::emu;
namespace ptx = jax_flash::ptx;

// Whether the test kernels call the emulation directly (emu::) or through the kernels' PTX
// wrappers (ptx::, cuda/kernels/ptx.h), which must forward each call to the matching emulation.
bool g_via_ptx = false;

// ---- a minimal test harness -------------------------------------------------------------------
namespace {
int g_failed_tests = 0, g_passed_tests = 0;
std::vector<std::string> g_errors;  // of the running test

void check(bool ok, const std::string& what) {
  if (!ok && g_errors.size() < 8) g_errors.push_back(what);
  if (!ok && g_errors.size() == 8) g_errors.push_back("(more failures not shown)");
}
#define CHECK(cond, msg) check((cond), std::string(msg) + "  [" #cond "]  line " + std::to_string(__LINE__))

void run_test(const char* name, const std::function<void()>& body) {
  g_errors.clear();
  auto t0 = std::chrono::steady_clock::now();
  body();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (g_errors.empty()) {
    ++g_passed_tests;
    std::printf("PASS %-54s %8.1f ms\n", name, ms);
  } else {
    ++g_failed_tests;
    std::printf("FAIL %s\n", name);
    for (auto& e : g_errors) std::printf("     %s\n", e.c_str());
  }
  std::fflush(stdout);
}

std::string str(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}
std::string hex(uint64_t v) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}
uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Test-local encoders for values exactly representable in the 16-bit formats (checked), written
// with frexp/ldexp rather than bit tricks, independent of emu/fp16.h.
uint16_t exact_f16(double v) {
  if (v == 0) return std::signbit(v) ? 0x8000 : 0;
  uint16_t sign = v < 0 ? 0x8000 : 0;
  double a = std::fabs(v);
  int e;
  double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int biased = e - 1 + 15;       // a = (2m) * 2^(e-1)
  if (biased >= 1) {
    double frac = (2 * m - 1) * 1024;
    if (frac != std::floor(frac) || biased > 30) std::abort();
    return static_cast<uint16_t>(sign | (biased << 10) | static_cast<int>(frac));
  }
  double sub = std::ldexp(a, 24);  // subnormal: a = s * 2^-24
  if (sub != std::floor(sub)) std::abort();
  return static_cast<uint16_t>(sign | static_cast<int>(sub));
}
uint16_t exact_bf16(double v) {
  uint32_t u = bits(static_cast<float>(v));
  if (static_cast<double>(static_cast<float>(v)) != v || (u & 0xffff) != 0) std::abort();
  return static_cast<uint16_t>(u >> 16);
}
double decode_f16(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}
uint32_t pack2(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16); }

// =================================================================================================
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} — PTX ISA 9.7.14.5.8 "Matrix Fragments for
// mma.m16n8k16 with floating point type" (Figures "MMA .m16n8k16 fragment layout for matrix A /
// B / accumulator C/D"). Per register, as the figures draw them (g = lane/4, t = lane%4):
//   A reg j (j=0..3) holds row g + 8*(j%2), columns 2t + 8*(j/2) and +1 (low half first)
//   B reg j (j=0..1) holds k rows 2t + 8j and 2t + 8j + 1 of column n = g
//   C/D element i (i=0..3): row g + 8*(i/2), column 2t + i%2
// =================================================================================================
struct MmaParams {
  const uint16_t* A;  // [16][16] row-major, encoded
  const uint16_t* B;  // [16][8]  (k, n), encoded
  const float* C;     // [16][8]
  float* D;           // [16][8]
  bool bf16;
  bool alias;  // pass the accumulator array as both c and d
};

__global__ void mma_kernel(MmaParams p) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  uint32_t a[4], b[2];
  float c[4], d[4];
  for (int j = 0; j < 4; ++j) {
    const int row = g + 8 * (j % 2), col = 2 * t + 8 * (j / 2);
    a[j] = pack2(p.A[row * 16 + col], p.A[row * 16 + col + 1]);
  }
  for (int j = 0; j < 2; ++j) {
    const int k = 2 * t + 8 * j;
    b[j] = pack2(p.B[k * 8 + g], p.B[(k + 1) * 8 + g]);
  }
  for (int i = 0; i < 4; ++i) c[i] = p.C[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
  float* dst = p.alias ? c : d;
  if (p.bf16)
    g_via_ptx ? ptx::mma_m16n8k16_bf16(dst, a, b, c) : emu::mma_m16n8k16_bf16(dst, a, b, c);
  else
    g_via_ptx ? ptx::mma_m16n8k16_f16(dst, a, b, c) : emu::mma_m16n8k16_f16(dst, a, b, c);
  for (int i = 0; i < 4; ++i) p.D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = dst[i];
}

// D = A*B + C in double, from decoded values.
void run_mma_case(const std::vector<double>& A, const std::vector<double>& B, const std::vector<double>& C, bool bf16,
                  bool alias, double rel_tol, const std::string& label) {
  std::vector<uint16_t> Ae(256), Be(128);
  for (int i = 0; i < 256; ++i) Ae[i] = bf16 ? exact_bf16(A[i]) : exact_f16(A[i]);
  for (int i = 0; i < 128; ++i) Be[i] = bf16 ? exact_bf16(B[i]) : exact_f16(B[i]);
  std::vector<float> Cf(128), D(128, -12345.0f);
  for (int i = 0; i < 128; ++i) Cf[i] = static_cast<float>(C[i]);
  auto st =
      emu::launch(dim3(1), dim3(32), 0, mma_kernel, MmaParams{Ae.data(), Be.data(), Cf.data(), D.data(), bf16, alias});
  CHECK(st.ok(), label + ": launch failed: " + st.error);
  int bad = 0;
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double ref = Cf[m * 8 + n];
      for (int k = 0; k < 16; ++k) ref += A[m * 16 + k] * B[k * 8 + n];
      double got = D[m * 8 + n];
      bool ok = std::fabs(got - ref) <= rel_tol * std::fabs(ref) + 1e-30;
      if (!ok && bad++ < 3)
        CHECK(false,
              label + ": D[" + std::to_string(m) + "][" + std::to_string(n) + "] = " + str(got) + ", want " + str(ref));
    }
}

void test_mma_structured(bool bf16) {
  // Distinct small integers: every sum is exact, so any misplaced element changes the result.
  std::vector<double> A(256), B(128), C(128);
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k) A[m * 16 + k] = ((m * 7 + k * 3) % 11) - 5 + (m == k ? 16 : 0);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) B[k * 8 + n] = ((k * 5 + n * 3) % 9) - 4 + 0.5 * (k % 2);
  for (int i = 0; i < 128; ++i) C[i] = 1000 + i;
  run_mma_case(A, B, C, bf16, false, 0.0, "distinct integers");
  run_mma_case(A, B, C, bf16, true, 0.0, "distinct integers, d aliases c");
}

void test_mma_one_hot(bool bf16) {
  // A = e_(m,k) (one element 1): D row m must be row k of B (+ C), every other row C.
  // B = e_(k,n): D column n must be column k of A (+ C). Pins every A and B position.
  std::vector<double> A(256), B(128), C(128);
  for (int i = 0; i < 128; ++i) C[i] = -0.25 * i;
  for (int i = 0; i < 128; ++i) B[i] = i + 1;
  for (int pos = 0; pos < 256; ++pos) {
    std::fill(A.begin(), A.end(), 0.0);
    A[pos] = 1;
    run_mma_case(A, B, C, bf16, false, 0.0, "one-hot A at " + std::to_string(pos));
  }
  for (int i = 0; i < 256; ++i) A[i] = i + 1;
  for (int pos = 0; pos < 128; ++pos) {
    std::fill(B.begin(), B.end(), 0.0);
    B[pos] = 1;
    run_mma_case(A, B, C, bf16, false, 0.0, "one-hot B at " + std::to_string(pos));
  }
}

void test_mma_random(bool bf16) {
  std::mt19937 rng(bf16 ? 7 : 3);
  std::uniform_int_distribution<int> mant(0, bf16 ? 127 : 1023), expo(-6, 3), sgn(0, 1);
  auto value = [&] {
    double v = bf16 ? std::ldexp(128 + mant(rng), expo(rng) - 7) : std::ldexp(1024 + mant(rng), expo(rng) - 10);
    return sgn(rng) ? -v : v;
  };
  for (int rep = 0; rep < 20; ++rep) {
    std::vector<double> A(256), B(128), C(128);
    for (auto& v : A) v = value();
    for (auto& v : B) v = value();
    for (auto& v : C) v = static_cast<float>(value());
    run_mma_case(A, B, C, bf16, false, 1e-6, "random " + std::to_string(rep));
  }
}

// =================================================================================================
// ldmatrix.sync.aligned.m8n8.{x2,x4}{.trans}.shared.b16 — PTX ISA 9.7.14.5.15 "ldmatrix": the
// rows of matrix i come from the addresses of threads 8i..8i+7; "each thread in a warp loads
// fragments of a row, with thread 0 receiving the first fragment" — i.e. the 64 elements of
// each (with .trans: transposed) 8x8 matrix, in row-major order, two per thread: thread l gets
// flat elements 2l (low half) and 2l+1 (high half) in register i.
// =================================================================================================
uint16_t ld_code(int m, int r, int c) { return static_cast<uint16_t>(0x1000 * (m + 1) + 16 * r + c); }
int ld_slot(int m, int r) { return ((m * 8 + r) * 13 + 5) % 32; }  // rows scattered over 32 slots

struct LdParams {
  int num;  // 2 or 4
  bool trans;
  uint32_t* out;  // [32 lanes][4]
};

__global__ void ldmatrix_kernel(LdParams p) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  uint16_t* s = reinterpret_cast<uint16_t*>(smem);
  // Each lane writes the row (m, r) = (lane / 8, lane % 8) of the four matrices to its slot.
  for (int c = 0; c < 8; ++c) s[ld_slot(lane / 8, lane % 8) * 8 + c] = ld_code(lane / 8, lane % 8, c);
  __syncwarp();
  const void* row = smem + ld_slot(lane / 8, lane % 8) * 16;
  uint32_t r[4] = {0xdeadbeef, 0xdeadbeef, 0xdeadbeef, 0xdeadbeef};
  if (p.num == 4) {
    if (g_via_ptx)
      p.trans ? ptx::ldmatrix_x4_trans(r, row) : ptx::ldmatrix_x4(r, row);
    else
      p.trans ? emu::ldmatrix_x4_trans(r, row) : emu::ldmatrix_x4(r, row);
  } else {
    if (lane >= 16) row = nullptr;  // not used by .x2 on sm_80+: must not be dereferenced
    if (g_via_ptx)
      p.trans ? ptx::ldmatrix_x2_trans(r, row) : ptx::ldmatrix_x2(r, row);
    else
      p.trans ? emu::ldmatrix_x2_trans(r, row) : emu::ldmatrix_x2(r, row);
  }
  for (int i = 0; i < 4; ++i) p.out[lane * 4 + i] = r[i];
}

void test_ldmatrix(int num, bool trans) {
  std::vector<uint32_t> out(128, 0);
  auto st = emu::launch(dim3(1), dim3(32), 32 * 16, ldmatrix_kernel, LdParams{num, trans, out.data()});
  CHECK(st.ok(), "launch failed: " + st.error);
  int bad = 0;
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      uint32_t want = 0xdeadbeef;
      if (i < num) {
        uint16_t half[2];
        for (int h = 0; h < 2; ++h) {
          const int flat = 2 * lane + h, fr = flat / 8, fc = flat % 8;  // position in the loaded matrix
          half[h] = trans ? ld_code(i, fc, fr) : ld_code(i, fr, fc);
        }
        want = pack2(half[0], half[1]);
      }
      if (out[lane * 4 + i] != want && bad++ < 4)
        CHECK(false, "lane " + std::to_string(lane) + " r[" + std::to_string(i) + "] = " + hex(out[lane * 4 + i]) +
                         ", want " + hex(want));
    }
}

// The kernels' use of ldmatrix feeding mma (A row-major; B as [n][k] without .trans, and as
// [k][n] with .trans, as for V), compared with a dense product.
struct LdMmaParams {
  const uint16_t* A;    // [16][16] (m, k)
  const uint16_t* Bnk;  // [8][16]  (n, k)
  const uint16_t* Bkn;  // [16][8]  (k, n)
  float* D1;            // A * B via Bnk
  float* D2;            // A * B via Bkn
};
__global__ void ldmatrix_mma_kernel(LdMmaParams p) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  uint16_t* sA = reinterpret_cast<uint16_t*>(smem);  // 16 x 16, row stride 24 elements (padded)
  uint16_t* sBnk = sA + 16 * 24;                     // 8 x 16, row stride 24
  uint16_t* sBkn = sBnk + 8 * 24;                    // 16 x 8, row stride 8
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) sA[(i / 16) * 24 + i % 16] = p.A[i];
  for (int i = lane; i < 128; i += 32) sBnk[(i / 16) * 24 + i % 16] = p.Bnk[i];
  for (int i = lane; i < 128; i += 32) sBkn[i] = p.Bkn[i];
  __syncthreads();
  uint32_t a[4], b1[2], b2[2];
  // x4 over A: lanes 0-15 give rows 0-15 at column 0, lanes 16-31 rows 0-15 at column 8.
  emu::ldmatrix_x4(a, sA + (lane % 16) * 24 + (lane / 16) * 8);
  // x2 over B^T = Bnk: lanes 0-7 rows n at k 0..7, lanes 8-15 the same rows at k 8..15.
  emu::ldmatrix_x2(b1, sBnk + (lane % 8) * 24 + ((lane / 8) % 2) * 8);
  // x2.trans over Bkn: lanes 0-15 give k rows 0-15.
  emu::ldmatrix_x2_trans(b2, sBkn + (lane % 16) * 8);
  float zero[4] = {0, 0, 0, 0}, d1[4], d2[4];
  emu::mma_m16n8k16_f16(d1, a, b1, zero);
  emu::mma_m16n8k16_f16(d2, a, b2, zero);
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    p.D1[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = d1[i];
    p.D2[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = d2[i];
  }
}

void test_ldmatrix_feeds_mma() {
  std::vector<uint16_t> A(256), Bnk(128), Bkn(128);
  std::vector<double> Ad(256), Bd(128);
  for (int i = 0; i < 256; ++i) Ad[i] = (i * 37 % 29) - 14;
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) Bd[k * 8 + n] = ((k * 8 + n) * 11 % 17) - 8;
  for (int i = 0; i < 256; ++i) A[i] = exact_f16(Ad[i]);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) Bnk[n * 16 + k] = Bkn[k * 8 + n] = exact_f16(Bd[k * 8 + n]);
  std::vector<float> D1(128), D2(128);
  auto st = emu::launch(dim3(1), dim3(32), (16 * 24 + 8 * 24 + 16 * 8) * 2, ldmatrix_mma_kernel,
                        LdMmaParams{A.data(), Bnk.data(), Bkn.data(), D1.data(), D2.data()});
  CHECK(st.ok(), "launch failed: " + st.error);
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double ref = 0;
      for (int k = 0; k < 16; ++k) ref += Ad[m * 16 + k] * Bd[k * 8 + n];
      CHECK(D1[m * 8 + n] == ref, "B via ldmatrix.x2: D[" + std::to_string(m) + "][" + std::to_string(n) +
                                      "] = " + str(D1[m * 8 + n]) + ", want " + str(ref));
      CHECK(D2[m * 8 + n] == ref, "B via ldmatrix.x2.trans: D[" + std::to_string(m) + "][" + std::to_string(n) +
                                      "] = " + str(D2[m * 8 + n]) + ", want " + str(ref));
    }
}

// =================================================================================================
// cp.async.cg.shared.global + commit_group + wait_group — PTX ISA 9.7.9.25.3 "cp.async",
// "cp.async.commit_group", "cp.async.wait_group": the copies of a thread form groups at each
// commit; wait_group N waits until at most N of the most recent groups are pending. Emulated
// strictly: nothing lands before the covering wait, so an early read sees the old bytes.
// =================================================================================================
struct CpParams {
  const float* src;  // 256 floats
  uint32_t* snap;    // [5 snapshots][64 threads][4 regions][4 floats] as bits
};
__global__ void cp_async_kernel(CpParams p) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  float* s = reinterpret_cast<float*>(smem);  // 4 regions of 256 floats
  const int t = threadIdx.x;
  auto snapshot = [&](int k) {
    for (int r = 0; r < 4; ++r)
      for (int e = 0; e < 4; ++e) std::memcpy(&p.snap[((k * 64 + t) * 4 + r) * 4 + e], &s[r * 256 + 4 * t + e], 4);
  };
  auto copy = [](void* dst, const void* src, int bytes) {
    g_via_ptx ? ptx::cp_async_16(dst, src, bytes) : emu::cp_async_16(dst, src, bytes);
  };
  auto commit = [] { g_via_ptx ? ptx::cp_async_commit_group() : emu::cp_async_commit_group(); };
  copy(s + 0 * 256 + 4 * t, p.src + 4 * t, 16);  // group 0
  commit();
  copy(s + 1 * 256 + 4 * t, p.src + 4 * t, 16);  // group 1
  commit();
  copy(s + 2 * 256 + 4 * t, nullptr, 0);  // group 2: src-size 0 zero-fills, reads nothing
  commit();
  copy(s + 3 * 256 + 4 * t, p.src + 4 * t, 16);  // never committed
  snapshot(0);
  g_via_ptx ? ptx::cp_async_wait_group<2>() : emu::cp_async_wait_group<2>();
  snapshot(1);
  g_via_ptx ? ptx::cp_async_wait_group<1>() : emu::cp_async_wait_group<1>();
  snapshot(2);
  g_via_ptx ? ptx::cp_async_wait_group<0>() : emu::cp_async_wait_group<0>();
  snapshot(3);
  __syncthreads();
  // Another thread's landed copy is visible after the barrier.
  const int u = (t + 1) % 64;
  for (int e = 0; e < 4; ++e) std::memcpy(&p.snap[((4 * 64 + t) * 4 + 0) * 4 + e], &s[0 * 256 + 4 * u + e], 4);
}

void test_cp_async() {
  std::vector<float> src(256);
  for (int i = 0; i < 256; ++i) src[i] = 0.5f + i;
  std::vector<uint32_t> snap(5 * 64 * 16, 0x12345678);
  auto st = emu::launch(dim3(1), dim3(64), 4 * 256 * 4, cp_async_kernel, CpParams{src.data(), snap.data()});
  CHECK(st.ok(), "launch failed: " + st.error);
  const uint32_t poison = 0xffffffffu;
  // landed[k][r]: whether region r has landed at snapshot k; region 2 lands zeros.
  const bool landed[4][4] = {{0, 0, 0, 0}, {1, 0, 0, 0}, {1, 1, 0, 0}, {1, 1, 1, 0}};
  int bad = 0;
  for (int k = 0; k < 4; ++k)
    for (int t = 0; t < 64; ++t)
      for (int r = 0; r < 4; ++r)
        for (int e = 0; e < 4; ++e) {
          uint32_t want = !landed[k][r] ? poison : r == 2 ? 0u : bits(src[4 * t + e]);
          uint32_t got = snap[((k * 64 + t) * 4 + r) * 4 + e];
          if (got != want && bad++ < 4)
            CHECK(false, "snapshot " + std::to_string(k) + " thread " + std::to_string(t) + " region " +
                             std::to_string(r) + ": " + hex(got) + ", want " + hex(want));
        }
  for (int t = 0; t < 64; ++t)
    CHECK(snap[((4 * 64 + t) * 4 + 0) * 4 + 1] == bits(src[4 * ((t + 1) % 64) + 1]),
          "thread " + std::to_string(t) + " does not see its neighbour's copy after __syncthreads");
}

// =================================================================================================
// shfl / vote (CUDA C++ Programming Guide, "Warp Shuffle Functions", "Warp Vote Functions").
// =================================================================================================
struct ShflParams {
  float* f;     // [32][6]
  int* i;       // [32][4]
  unsigned* u;  // [32][2]
};
__global__ void shfl_kernel(ShflParams p) {
  const int lane = threadIdx.x;
  const float v = 100.0f + lane;
  float* f = p.f + lane * 6;
  f[0] = __shfl_xor_sync(0xffffffffu, v, 1);
  f[1] = __shfl_xor_sync(0xffffffffu, v, 2);
  f[2] = __shfl_xor_sync(0xffffffffu, v, 16);
  // The quad reduction the kernels use for row max/sum.
  float m = v;
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  f[3] = m;
  f[4] = __shfl_sync(0xffffffffu, v, 5);
  f[5] = __shfl_xor_sync(0xffffffffu, v, 4, 8);  // width 8: stays inside lanes 8k..8k+7
  int* i = p.i + lane * 4;
  i[0] = __shfl_xor_sync(0xffffffffu, -lane, 3);
  i[1] = __shfl_down_sync(0xffffffffu, lane * 10, 4);
  i[2] = __shfl_up_sync(0xffffffffu, lane * 10, 1, 16);
  i[3] = __shfl_sync(0xffffffffu, lane, lane + 3, 8);
  unsigned* u = p.u + lane * 2;
  u[0] = __shfl_xor_sync(0xffffffffu, 0x80000000u + static_cast<unsigned>(lane), 31);
  u[1] = __ballot_sync(0xffffffffu, lane % 3 == 0);
}

void test_shfl() {
  std::vector<float> f(32 * 6);
  std::vector<int> in(32 * 4);
  std::vector<unsigned> u(32 * 2);
  auto st = emu::launch(dim3(1), dim3(32), 0, shfl_kernel, ShflParams{f.data(), in.data(), u.data()});
  CHECK(st.ok(), "launch failed: " + st.error);
  unsigned ballot = 0;
  for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
  for (int l = 0; l < 32; ++l) {
    const std::string at = "lane " + std::to_string(l) + ": ";
    CHECK(f[l * 6 + 0] == 100.0f + (l ^ 1), at + "xor 1");
    CHECK(f[l * 6 + 1] == 100.0f + (l ^ 2), at + "xor 2");
    CHECK(f[l * 6 + 2] == 100.0f + (l ^ 16), at + "xor 16");
    CHECK(f[l * 6 + 3] == 100.0f + (l | 3), at + "quad max");
    CHECK(f[l * 6 + 4] == 105.0f, at + "shfl from lane 5");
    CHECK(f[l * 6 + 5] == 100.0f + (l ^ 4), at + "xor 4 width 8");
    CHECK(in[l * 4 + 0] == -(l ^ 3), at + "int xor");
    CHECK(in[l * 4 + 1] == (l + 4 < 32 ? (l + 4) * 10 : l * 10), at + "down 4 (the last lanes keep their own)");
    CHECK(in[l * 4 + 2] == (l % 16 >= 1 ? (l - 1) * 10 : l * 10), at + "up 1 width 16");
    CHECK(in[l * 4 + 3] == (l / 8) * 8 + (l + 3) % 8, at + "idx lane+3 width 8 (modulo width)");
    CHECK(u[l * 2 + 0] == 0x80000000u + static_cast<unsigned>(l ^ 31), at + "unsigned xor 31");
    CHECK(u[l * 2 + 1] == ballot, at + "ballot");
  }
}

// =================================================================================================
// cvt.rn.{bf16x2,f16x2}.f32 — PTX ISA 9.7.9.21 "cvt": d = {cvt(a) in the upper half, cvt(b) in
// the lower half} for `cvt d, a, b`; the wrappers take (lo, hi). Round to nearest, ties to even.
// ex2.approx.ftz.f32 — PTX ISA 9.7.3.21 "Floating Point Instructions: ex2": subnormal inputs and
// results flush to +-0. Expected bit patterns are literal constants.
// =================================================================================================
void test_cvt_bf16() {
  struct Case {
    float in;
    uint16_t want;
    const char* what;
  };
  const Case cases[] = {
      {1.0f, 0x3f80, "one"},
      {-2.0f, 0xc000, "minus two"},
      {0.0f, 0x0000, "zero"},
      {-0.0f, 0x8000, "negative zero"},
      {1.0f + 0x1p-8f, 0x3f80, "tie between 1 and 1+2^-7 goes to even (down)"},
      {1.0f + 3 * 0x1p-8f, 0x3f82, "tie between 1+2^-7 and 1+2^-6 goes to even (up)"},
      {1.0f + 0x1p-8f + 0x1p-20f, 0x3f81, "just above a tie rounds up"},
      {1.0f + 0x1p-8f - 0x1p-20f, 0x3f80, "just below a tie rounds down"},
      {3.140625f, 0x4049, "exact"},
      {from_bits(0x7f7fffff), 0x7f80, "max float rounds to infinity"},
      {INFINITY, 0x7f80, "infinity"},
      {-INFINITY, 0xff80, "minus infinity"},
      {from_bits(0x00000001), 0x0000, "smallest subnormal rounds to zero"},
      {from_bits(0x00018000), 0x0002, "subnormal tie goes to even"},
      {from_bits(0x7fc00000), 0x7fff, "NaN is canonical"},
      {from_bits(0xffc12345), 0x7fff, "negative NaN with payload is canonical"},
  };
  for (const Case& c : cases) {
    uint32_t lo = emu::cvt_pack_bf16x2(c.in, 1.0f);
    uint32_t hi = emu::cvt_pack_bf16x2(-2.0f, c.in);
    CHECK((lo & 0xffff) == c.want && (lo >> 16) == 0x3f80, std::string(c.what) + " (lo): " + hex(lo));
    CHECK((hi >> 16) == c.want && (hi & 0xffff) == 0xc000, std::string(c.what) + " (hi): " + hex(hi));
  }
}

void test_cvt_f16() {
  struct Case {
    float in;
    uint16_t want;
    const char* what;
  };
  const Case cases[] = {
      {1.0f, 0x3c00, "one"},
      {-2.0f, 0xc000, "minus two"},
      {-0.0f, 0x8000, "negative zero"},
      {1.0f + 0x1p-11f, 0x3c00, "tie between 1 and 1+2^-10 goes to even (down)"},
      {1.0f + 3 * 0x1p-11f, 0x3c02, "tie between 1+2^-10 and 1+2^-9 goes to even (up)"},
      {1.0f + 0x1p-11f + 0x1p-20f, 0x3c01, "just above a tie rounds up"},
      {65504.0f, 0x7bff, "largest finite"},
      {65519.0f, 0x7bff, "below the overflow threshold"},
      {65520.0f, 0x7c00, "overflow threshold rounds to infinity"},
      {-1e6f, 0xfc00, "large negative to minus infinity"},
      {0x1p-14f, 0x0400, "smallest normal"},
      {0x1p-24f, 0x0001, "smallest subnormal"},
      {0x1p-25f, 0x0000, "half the smallest subnormal: tie to even (zero)"},
      {0x1.8p-25f, 0x0001, "three quarters of the smallest subnormal rounds up"},
      {3 * 0x1p-25f, 0x0002, "1.5 x smallest subnormal: tie to even (2)"},
      {0x1.ffcp-15f, 0x0400, "subnormal rounding carries into the smallest normal"},
      {1e-10f, 0x0000, "far below the range"},
      {-0x1p-24f, 0x8001, "negative subnormal"},
      {from_bits(0x00000001), 0x0000, "f32 subnormal"},
      {INFINITY, 0x7c00, "infinity"},
      {from_bits(0x7fc00000), 0x7fff, "NaN is canonical"},
  };
  for (const Case& c : cases) {
    uint32_t v = emu::cvt_pack_f16x2(c.in, c.in);
    CHECK((v & 0xffff) == c.want && (v >> 16) == c.want, std::string(c.what) + ": " + hex(v) + ", want " + hex(c.want));
  }
  // Exhaustive cross-check over every finite f16 value and the midpoints between neighbours.
  int bad = 0;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double v = decode_f16(static_cast<uint16_t>(h));
    if ((emu::cvt_pack_f16x2(static_cast<float>(v), 0.0f) & 0xffff) != h && bad++ < 3)
      CHECK(false, "exact value " + str(v) + " does not convert to " + hex(h));
    if (h + 1 < 0x7c00) {
      const double mid = 0.5 * (v + decode_f16(static_cast<uint16_t>(h + 1)));
      const uint32_t want = (h % 2 == 0) ? h : h + 1;
      if ((emu::cvt_pack_f16x2(static_cast<float>(mid), 0.0f) & 0xffff) != want && bad++ < 3)
        CHECK(false, "midpoint " + str(mid) + " does not round to even " + hex(want));
    }
  }
}

void test_cvt_f32_f16() {
  // Every f16 bit pattern, against the test's own decoder (exact for all finite values).
  int bad = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float got = emu::cvt_f32_f16(static_cast<uint16_t>(h));
    const int e = (h >> 10) & 31, m = h & 1023;
    bool ok;
    if (e == 31 && m != 0)
      ok = std::isnan(got);
    else if (e == 31)
      ok = got == ((h & 0x8000) ? -INFINITY : INFINITY);
    else
      ok = static_cast<double>(got) == decode_f16(static_cast<uint16_t>(h)) &&
           std::signbit(got) == static_cast<bool>(h & 0x8000);
    if (!ok && bad++ < 4) CHECK(false, "cvt.f32.f16 of " + hex(h) + " = " + str(got));
  }
}

// Distance in ulps between two finite floats of the same sign.
int ulps(float a, float b) {
  const int32_t ia = static_cast<int32_t>(bits(a)), ib = static_cast<int32_t>(bits(b));
  return ia > ib ? ia - ib : ib - ia;
}

// ex2.approx.ftz.f32 (9.7.3.21): within 2 ulp of the correctly rounded 2^x, emulated as exactly
// 2 ulp off (direction from a hash of x), exact at the corner cases of the ISA's table.
void test_ex2() {
  CHECK(emu::ex2_approx(0.0f) == 1.0f, "2^0");
  CHECK(emu::ex2_approx(-0.0f) == 1.0f, "2^-0");
  CHECK(ulps(emu::ex2_approx(1.0f), 2.0f) == 2, "2^1 is 2 ulp off");
  CHECK(ulps(emu::ex2_approx(-10.0f), 0x1p-10f) == 2, "2^-10");
  CHECK(emu::ex2_approx(-130.0f) == 0.0f, "2^-130 is subnormal: flushed to zero");
  CHECK(emu::ex2_approx(from_bits(0x00000010)) == 1.0f, "subnormal input flushed to zero");
  CHECK(emu::ex2_approx(-INFINITY) == 0.0f, "2^-inf");
  CHECK(emu::ex2_approx(INFINITY) == INFINITY, "2^inf");
  CHECK(emu::ex2_approx(200.0f) == INFINITY, "overflow");
  CHECK(std::isnan(emu::ex2_approx(NAN)), "NaN");
  CHECK(std::fabs(emu::ex2_approx(0.5f) - 1.41421356f) < 1e-6f, "2^0.5");
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> x(-100.0f, 100.0f);
  int up = 0;
  for (int i = 0; i < 2000; ++i) {
    const float v = x(rng), got = emu::ex2_approx(v), exact = std::exp2(v);
    CHECK(ulps(got, exact) == 2, "ex2(" + str(v) + ") = " + str(got) + " is not 2 ulp from " + str(exact));
    CHECK(bits(got) == bits(emu::ex2_approx(v)), "ex2 is not reproducible");
    up += got > exact;
  }
  CHECK(up > 800 && up < 1200, "the error's direction is not balanced: " + std::to_string(up) + " of 2000 up");
}

// tanh.approx.f32 (9.7.3.22): relative error 2^-11 at most, emulated as exactly 2^-11 (within
// [-1, 1]); subnormals pass through; the ISA's corner cases.
void test_tanh() {
  CHECK(emu::tanh_approx(0.0f) == 0.0f && !std::signbit(emu::tanh_approx(0.0f)), "tanh(+0)");
  CHECK(emu::tanh_approx(-0.0f) == 0.0f && std::signbit(emu::tanh_approx(-0.0f)), "tanh(-0)");
  CHECK(emu::tanh_approx(INFINITY) == 1.0f && emu::tanh_approx(-INFINITY) == -1.0f, "tanh(+-inf)");
  CHECK(std::isnan(emu::tanh_approx(NAN)), "tanh(NaN)");
  CHECK(emu::tanh_approx(from_bits(0x00000010)) == from_bits(0x00000010), "subnormal passes through");
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> x(-12.0f, 12.0f);
  int off = 0;
  for (int i = 0; i < 2000; ++i) {
    const float v = x(rng);
    const double exact = std::tanh(static_cast<double>(v)), got = emu::tanh_approx(v);
    const double rel = std::fabs(got - exact) / std::fabs(exact);
    CHECK(rel <= 0x1p-11, "tanh(" + str(v) + ") relative error " + str(rel) + " > 2^-11");
    CHECK(std::fabs(got) <= 1.0, "|tanh| > 1");
    off += rel > 0x1p-12;
  }
  CHECK(off > 1000, "the emulated tanh.approx should be off by its bound, not exact");
}

// =================================================================================================
// The SIMT model: built-in variables, several blocks, poisoned shared memory, atomics.
// =================================================================================================
struct IdParams {
  int* out;  // per (block, thread): 6 ints
};
__global__ void ids_kernel(IdParams p) {
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  int* o = p.out + (block * blockDim.x * blockDim.y * blockDim.z + thread) * 6;
  o[0] = threadIdx.x;
  o[1] = threadIdx.y;
  o[2] = threadIdx.z;
  o[3] = blockIdx.x;
  o[4] = blockIdx.y;
  o[5] = blockIdx.z;
}
void test_ids() {
  const dim3 grid(3, 2, 2), block(8, 4, 2);
  std::vector<int> out(12 * 64 * 6, -1);
  auto st = emu::launch(grid, block, 0, ids_kernel, IdParams{out.data()});
  CHECK(st.ok(), "launch failed: " + st.error);
  for (int b = 0; b < 12; ++b)
    for (int t = 0; t < 64; ++t) {
      const int* o = &out[(b * 64 + t) * 6];
      CHECK(o[0] == t % 8 && o[1] == (t / 8) % 4 && o[2] == t / 32, "threadIdx of thread " + std::to_string(t));
      CHECK(o[3] == b % 3 && o[4] == (b / 3) % 2 && o[5] == b / 6, "blockIdx of block " + std::to_string(b));
    }
}

struct PoisonParams {
  int* fresh;  // per block: 1 when every byte of shared memory was 0xFF on entry
  float* sum;
};
__global__ void poison_kernel(PoisonParams p) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  if (threadIdx.x == 0) {
    bool all = true;
    for (size_t i = 0; i < emu::dynamic_smem_size(); ++i) all = all && static_cast<unsigned char>(smem[i]) == 0xFF;
    float f;
    std::memcpy(&f, smem, 4);
    p.fresh[blockIdx.x] = all && std::isnan(f);
  }
  __syncthreads();
  smem[threadIdx.x] = 1;  // the next block must not see this
  atomicAdd(p.sum, 1.0f);
}
void test_poison_and_atomics() {
  std::vector<int> fresh(3, 0);
  float sum = 0;
  auto st = emu::launch(dim3(3), dim3(96), 200, poison_kernel, PoisonParams{fresh.data(), &sum});
  CHECK(st.ok(), "launch failed: " + st.error);
  for (int b = 0; b < 3; ++b) CHECK(fresh[b] == 1, "block " + std::to_string(b) + " did not start with poisoned smem");
  CHECK(sum == 3 * 96, "atomicAdd total " + str(sum));
}

// A missing __syncthreads: warp 1 writes what warp 0 reads. Each schedule is legal; the forward
// one runs warp 0 first, so the read sees poison instead of silently seeing the value.
struct RaceParams {
  float* out;
};
__global__ void race_kernel(RaceParams p) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  float* s = reinterpret_cast<float*>(smem);
  if (threadIdx.x >= 32) s[threadIdx.x - 32] = 1.0f;
  // (missing __syncthreads here)
  if (threadIdx.x < 32) p.out[threadIdx.x] = s[threadIdx.x];
}
void test_schedules_expose_races() {
  std::vector<float> out(32, 0);
  emu::LaunchOptions fwd, rev;
  rev.schedule = emu::Schedule::kReverse;
  auto st = emu::launch_with(fwd, dim3(1), dim3(64), 128, race_kernel, RaceParams{out.data()});
  CHECK(st.ok() && std::isnan(out[0]), "forward schedule: the reader should run first and see poison");
  st = emu::launch_with(rev, dim3(1), dim3(64), 128, race_kernel, RaceParams{out.data()});
  CHECK(st.ok() && out[0] == 1.0f, "reverse schedule: the writer should run first");
  emu::LaunchOptions shuf;
  shuf.schedule = emu::Schedule::kShuffle;
  shuf.seed = 42;
  std::vector<float> sums(2, 0);
  // A correct kernel gives the same result under every schedule.
  for (auto opt : {fwd, rev, shuf}) {
    ShflParams dummy{};
    (void)dummy;
    std::vector<int> ids(12 * 64 * 6, -1);
    auto s2 = emu::launch_with(opt, dim3(3, 2, 2), dim3(8, 4, 2), 0, ids_kernel, IdParams{ids.data()});
    CHECK(s2.ok() && ids[5] == 0 && ids[(11 * 64 + 63) * 6 + 5] == 1, "ids under a non-default schedule");
  }
}

// =================================================================================================
// Strictness: each of these is a bug the GPU would punish; the emulator must report it (and
// never crash), with the block/thread and what happened.
// =================================================================================================
struct StrictParams {
  int mode;
  float* out;
};
__global__ void strict_kernel(StrictParams p) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x % 32;
  float v = static_cast<float>(threadIdx.x);
  switch (p.mode) {
    case 0:  // a lane exits before a warp collective
      if (lane == 5) return;
      v = __shfl_xor_sync(0xffffffffu, v, 1);
      break;
    case 1:  // lanes of a warp at different collectives
      if (lane < 16)
        v = __shfl_xor_sync(0xffffffffu, v, 1);
      else
        v = static_cast<float>(__ballot_sync(0xffffffffu, 1));
      break;
    case 2:  // __syncthreads not reached by a thread that has exited
      if (threadIdx.x == 40) return;
      __syncthreads();
      break;
    case 3:  // one lane at __syncthreads while the rest of its warp is at a shuffle
      if (lane == 0)
        __syncthreads();
      else
        v = __shfl_xor_sync(0xffffffffu, v, 1);
      break;
    case 4: {  // ldmatrix row outside the dynamic shared memory
      uint32_t r[4];
      emu::ldmatrix_x4(r, smem + (lane == 31 ? 256 : lane * 16 % 256));
      break;
    }
    case 5: {  // ldmatrix row not 16-byte aligned
      uint32_t r[4];
      emu::ldmatrix_x4(r, smem + lane * 16 % 256 + (lane == 3 ? 4 : 0));
      break;
    }
    case 6:  // cp.async into memory that is not the dynamic shared memory
      if (threadIdx.x < 16)
        emu::cp_async_16(threadIdx.x == 7 ? static_cast<void*>(p.out) : smem + threadIdx.x * 16, p.out, 16);
      break;
    case 7:  // a plain store past the end of the dynamic shared memory (red zone)
      if (threadIdx.x == 0) smem[256 + 3] = 1;
      break;
    case 8:  // a partial mask that does not contain the calling lane
      v = __shfl_xor_sync(0x0000ffffu, v, 1);
      break;
    case 9:  // shfl reading a lane outside the mask
      if (lane < 16) v = __shfl_xor_sync(0x0000ffffu, v, 16);
      break;
    case 10:  // __trap
      if (threadIdx.x == 33) __trap();
      break;
    case 11:  // a thread exits while the others wait at __syncthreads
      if (threadIdx.x != 0) __syncthreads();
      break;
    case 12: {  // mma with a lane missing (exited)
      if (lane == 31) return;
      uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
      float c[4] = {0, 0, 0, 0}, d[4];
      emu::mma_m16n8k16_f16(d, a, b, c);
      break;
    }
    case 13:  // a store to a cp.async destination while the copy is in flight
      if (threadIdx.x < 16) {
        emu::cp_async_16(smem + threadIdx.x * 16, p.out, 16);
        emu::cp_async_commit_group();
        if (threadIdx.x == 3) smem[3 * 16 + 1] = 7;
        emu::cp_async_wait_group<0>();
      }
      break;
    case 14:  // ldmatrix of rows whose cp.async has not been waited for
      if (threadIdx.x < 32) {
        if (lane < 16) emu::cp_async_16(smem + lane * 16, p.out, 16);
        emu::cp_async_commit_group();
        uint32_t r[4];
        emu::ldmatrix_x4(r, smem + (lane % 16) * 16);
      }
      break;
    case 15:  // cp.async reading outside the declared global buffers
      if (threadIdx.x < 16) emu::cp_async_16(smem + threadIdx.x * 16, p.out + (threadIdx.x == 9 ? 64 : 0), 16);
      break;
    case 16:  // the same, inside the declared buffers, waited for and read after a barrier
      if (threadIdx.x < 16) emu::cp_async_16(smem + threadIdx.x * 16, p.out + 4 * threadIdx.x, 16);
      emu::cp_async_commit_group();
      emu::cp_async_wait_group<0>();
      __syncthreads();
      if (threadIdx.x < 32) {
        uint32_t r[4];
        emu::ldmatrix_x4(r, smem + (lane % 16) * 16);
        v = static_cast<float>(r[0] & 0xffff);
      }
      break;
  }
  p.out[threadIdx.x] = v;
}

void expect_error(int mode, const std::vector<std::string>& needles) {
  std::vector<float> out(64, 0);
  emu::GlobalBufferScope scope({{out.data(), out.size() * sizeof(float)}});
  auto st = emu::launch(dim3(2), dim3(64), 256, strict_kernel, StrictParams{mode, out.data()});
  CHECK(!st.ok(), "mode " + std::to_string(mode) + ": no error reported");
  for (const auto& n : needles)
    CHECK(st.error.find(n) != std::string::npos,
          "mode " + std::to_string(mode) + ": error \"" + st.error + "\" does not mention \"" + n + "\"");
}

void test_strict() {
  expect_error(0, {"block (0,0,0)", "__shfl_xor_sync", "exited"});
  expect_error(1, {"__ballot_sync", "__shfl_xor_sync", "wait at"});
  expect_error(2, {"__syncthreads", "thread (40,0,0)", "exited"});
  expect_error(3, {"__syncthreads", "__shfl_xor_sync"});
  expect_error(4, {"ldmatrix", "lane 31", "outside"});
  expect_error(5, {"ldmatrix", "lane 3", "aligned"});
  expect_error(6, {"cp.async", "thread (7,0,0)", "outside"});
  expect_error(7, {"block (0,0,0)", "past its 256 bytes"});
  expect_error(8, {"not in the mask"});
  expect_error(9, {"reads lane", "not in the mask"});
  expect_error(10, {"thread (33,0,0)", "__trap"});
  expect_error(11, {"thread (0,0,0)", "exited", "__syncthreads"});
  expect_error(12, {"mma.sync", "exited"});
  expect_error(13, {"thread (3,0,0)", "written while a cp.async"});
  expect_error(14, {"ldmatrix", "has not been waited for"});
  expect_error(15, {"thread (9,0,0)", "outside every buffer"});
  {
    std::vector<float> buf(64);
    for (int i = 0; i < 64; ++i) buf[i] = static_cast<float>(i);
    emu::GlobalBufferScope scope({{buf.data(), buf.size() * sizeof(float)}});
    auto st = emu::launch(dim3(2), dim3(64), 256, strict_kernel, StrictParams{16, buf.data()});
    CHECK(st.ok(), "cp.async inside the declared buffers: " + st.error);
  }
  // After all these errors, the emulator still works.
  std::vector<float> out(64, 0);
  auto st = emu::launch(dim3(1), dim3(64), 256, strict_kernel, StrictParams{-1, out.data()});
  CHECK(st.ok() && out[63] == 63.0f, "a clean launch after errors: " + st.error);
  // Invalid launches are reported, not run.
  CHECK(!emu::launch(dim3(1), dim3(2048), 0, strict_kernel, StrictParams{-1, out.data()}).ok(), "2048 threads");
  CHECK(!emu::launch(dim3(1), dim3(32), 1 << 20, strict_kernel, StrictParams{-1, out.data()}).ok(), "1 MiB smem");
  // Intrinsics outside a launch throw instead of crashing.
  bool threw = false;
  try {
    __syncthreads();
  } catch (const std::exception&) {
    threw = true;
  }
  CHECK(threw, "__syncthreads outside a launch");
}

// =================================================================================================
// The race detector (shared memory) and the global-memory checks: each mode is a bug the GPU
// might or might not show; the emulation must report it under every schedule, naming both
// threads, the offset and the source line, and the correct variants must pass.
// =================================================================================================
struct MemParams {
  int mode;
  const float* in;  // 64 floats, read-only
  float* out;       // 64 floats
};
__global__ void memcheck_kernel(MemParams p) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  float* s = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int b = blockIdx.x;
  switch (p.mode) {
    case 0:  // RAW between warps: warp 1 writes what warp 0 reads, no barrier
      if (warp == 1) ptx::st_shared_f32(s + lane, 1.0f);
      if (warp == 0) p.out[b * 32 + lane] = ptx::ld_shared_f32(s + lane);
      break;
    case 1:  // the same with the barrier
      if (warp == 1) ptx::st_shared_f32(s + lane, 1.0f);
      __syncthreads();
      if (warp == 0) p.out[b * 32 + lane] = ptx::ld_shared_f32(s + lane);
      break;
    case 2:  // WAR between warps: everyone reads s[0], then thread 33 overwrites it, no barrier
      if (t == 0) ptx::st_shared_f32(s, 2.0f);
      __syncthreads();
      p.out[b * 32 + lane] = ptx::ld_shared_f32(s);
      if (t == 33) ptx::st_shared_f32(s, 3.0f);
      break;
    case 3:  // RAW inside a warp without __syncwarp
      if (lane == 0) ptx::st_shared_f32(s + warp, 1.0f);
      if (lane == 1) p.out[b * 32 + warp] = ptx::ld_shared_f32(s + warp);
      break;
    case 4:  // the same with __syncwarp
      if (lane == 0) ptx::st_shared_f32(s + warp, 1.0f);
      __syncwarp();
      if (lane == 1) p.out[b * 32 + warp] = ptx::ld_shared_f32(s + warp);
      break;
    case 5:  // WAR inside a warp: lane 0 reads what lane 1 then overwrites, no __syncwarp
      ptx::st_shared_f32(s + t, 0.0f);
      __syncthreads();
      if (lane == 0) p.out[b * 32 + warp] = ptx::ld_shared_f32(s + t + 1);
      if (lane == 1) ptx::st_shared_f32(s + t, 5.0f);
      break;
    case 6:  // a partial __syncwarp orders its lanes (and only them)
      if (lane == 0) ptx::st_shared_f32(s + warp, 1.0f);
      if (lane < 2) __syncwarp(0x3u);
      if (lane == 1) p.out[b * 32 + warp] = ptx::ld_shared_f32(s + warp);
      break;
    case 7: {  // ldmatrix of rows another warp stores, no barrier
      if (warp == 1 && lane < 8)
        for (int i = 0; i < 4; ++i) ptx::st_shared_b32(smem + lane * 16 + 4 * i, 0x3c003c00u);
      if (warp == 0) {
        uint32_t r[4];
        ptx::ldmatrix_x4(r, smem + (lane % 8) * 16);
        p.out[b * 32 + lane] = static_cast<float>(r[0] & 0xff);
      }
      break;
    }
    case 8: {  // a cp.async landed in warp 1 read by warp 0 with no barrier after the wait
      if (warp == 1 && lane < 16) {
        ptx::cp_async_16(smem + lane * 16, p.in + 4 * lane, 16);
        ptx::cp_async_commit_group();
        ptx::cp_async_wait_group<0>();
      }
      if (warp == 0 && lane < 16) {
        uint32_t r[4];
        ptx::ld_shared_v4_b32(r, smem + lane * 16);
        p.out[b * 32 + lane] = static_cast<float>(r[0] & 0xff);
      }
      break;
    }
    case 9: {  // the same, correct: wait, barrier, read
      if (warp == 1 && lane < 16) ptx::cp_async_16(smem + lane * 16, p.in + 4 * lane, 16);
      ptx::cp_async_commit_group();
      ptx::cp_async_wait_group<0>();
      __syncthreads();
      if (warp == 0 && lane < 16) {
        uint32_t r[4];
        ptx::ld_shared_v4_b32(r, smem + lane * 16);
        p.out[b * 32 + lane] = static_cast<float>(r[0] & 0xff);
      }
      break;
    }
    case 10:  // a global read past the end of a buffer
      p.out[b * 32 + lane] = ptx::ld_global_f32(p.in + (t == 63 ? 64 : t));
      break;
    case 11:  // a global write past the end of a buffer
      ptx::st_global_f32(p.out + b * 32 + (t == 40 ? 2 * 32 : lane), 1.0f);
      break;
    case 12:  // a global write into a read-only operand
      if (t == 5) ptx::st_global_f32(const_cast<float*>(p.in) + 5, 1.0f);
      break;
    case 13:  // two CTAs storing to the same address
      if (t < 32) ptx::st_global_f32(p.out + t, static_cast<float>(b));
      break;
    case 14:  // atomics of both CTAs on the same addresses: fine
      ptx::red_global_add_f32(p.out + t % 4, 1.0f);
      atomicAdd(p.out + 4 + t % 4, 2.0f);
      break;
    case 15:  // the same as a plain read-modify-write: a race between the CTAs
      if (t < 4) ptx::st_global_f32(p.out + t, ptx::ld_global_f32(p.out + t) + 1.0f);
      break;
    case 16:  // a plain store of one CTA where the other adds atomically
      if (t == 0) {
        if (b == 0)
          ptx::st_global_f32(p.out + 7, 1.0f);
        else
          ptx::red_global_add_f32(p.out + 7, 1.0f);
      }
      break;
    case 17:  // every access in bounds, each CTA on its own half: fine
      if (t < 32) ptx::st_global_f32(p.out + b * 32 + lane, ptx::ld_global_f32(p.in + t));
      break;
    case 18:  // tagged pointers (emu::tag_global) through the wrappers: fine
      if (t < 16)
        ptx::st_global_f32(emu::tag_global(p.out) + b * 32 + t, ptx::ld_global_f32(emu::tag_global(p.in) + t));
      if (t == 40) ptx::red_global_add_f32(emu::tag_global(p.out) + b * 32 + 20, 1.0f);
      break;
    case 19:  // a plain read-modify-write through a tagged pointer: faults, reported
      if (t == 3) emu::tag_global(p.out)[b * 32 + 3] += 1.0f;
      break;
    case 20:  // vector atomics (red.global.add.v2.f32) of both CTAs on the same pairs: fine
      ptx::red_global_add_v2_f32(p.out + 2 * (t % 2), 1.0f, 2.0f);
      break;
    case 21:  // a vector atomic at a 4-byte, not 8-byte, aligned address
      if (t == 9) ptx::red_global_add_v2_f32(p.out + 1, 1.0f, 2.0f);
      break;
    case 22:  // a plain store of one CTA where the other adds with the vector atomic
      if (t == 0) {
        if (b == 0)
          ptx::st_global_f32(p.out + 11, 1.0f);
        else
          ptx::red_global_add_v2_f32(p.out + 10, 1.0f, 1.0f);
      }
      break;
  }
}

emu::Status run_memcheck(int mode, emu::LaunchOptions opt, std::vector<float>* out_values = nullptr) {
  std::vector<float> in(64), out(64, 0.0f);
  for (int i = 0; i < 64; ++i) in[i] = static_cast<float>(i);
  emu::GlobalBufferScope scope(std::vector<emu::GlobalBuffer>{{in.data(), 64 * sizeof(float), "in", false},
                                                              {out.data(), 64 * sizeof(float), "out", true}});
  opt.kernel = "memcheck_kernel";
  emu::Status st =
      emu::launch_with(opt, dim3(2), dim3(64), 1024, memcheck_kernel, MemParams{mode, in.data(), out.data()});
  if (out_values) *out_values = out;
  return st;
}

std::vector<emu::LaunchOptions> all_schedules() {
  emu::LaunchOptions fwd, rev, shuf1, shuf2;
  rev.schedule = emu::Schedule::kReverse;
  shuf1.schedule = shuf2.schedule = emu::Schedule::kShuffle;
  shuf1.seed = 3;
  shuf2.seed = 1234;
  return {fwd, rev, shuf1, shuf2};
}

void expect_memcheck_error(int mode, const std::vector<std::string>& needles) {
  const char* names[] = {"forward", "reverse", "shuffle:3", "shuffle:1234"};
  int k = 0;
  for (const auto& opt : all_schedules()) {
    const std::string label = "mode " + std::to_string(mode) + " (" + names[k++] + ")";
    auto st = run_memcheck(mode, opt);
    CHECK(!st.ok(), label + ": no error reported");
    for (const auto& n : needles)
      CHECK(st.error.find(n) != std::string::npos,
            label + ": error \"" + st.error + "\" does not mention \"" + n + "\"");
  }
}

void expect_memcheck_ok(int mode) {
  for (const auto& opt : all_schedules()) {
    auto st = run_memcheck(mode, opt);
    CHECK(st.ok(), "mode " + std::to_string(mode) + ": " + st.error);
  }
}

void test_race_detector() {
  // Both accesses named: who, what, where (offset and line).
  expect_memcheck_error(
      0, {"memcheck_kernel", "shared-memory race", "warp 1", "warp 0", "byte ", "emu_test.cc:", "no __syncthreads"});
  expect_memcheck_ok(1);
  expect_memcheck_error(2, {"shared-memory race", "thread (33,0,0)", "read", "byte 0 "});
  expect_memcheck_error(3, {"shared-memory race", "lane 0", "lane 1", "no __syncwarp or __syncthreads"});
  expect_memcheck_ok(4);
  expect_memcheck_error(5, {"shared-memory race", "lane 0", "lane 1"});
  expect_memcheck_ok(6);
  expect_memcheck_error(7, {"shared-memory race", "ldmatrix", "st.shared.b32"});
  expect_memcheck_error(8, {"shared-memory race", "cp.async", "ld.shared.v4.b32"});
  expect_memcheck_ok(9);
}

void test_global_checks() {
  emu::LaunchOptions fwd;
  auto st = run_memcheck(10, fwd);
  CHECK(!st.ok() && st.error.find("ld.global.f32") != std::string::npos &&
            st.error.find("outside every buffer") != std::string::npos &&
            st.error.find("0 bytes past the end of in") != std::string::npos &&
            st.error.find("thread (63,0,0)") != std::string::npos,
        "out-of-bounds read: " + st.error);
  st = run_memcheck(11, fwd);
  CHECK(!st.ok() && st.error.find("st.global.f32") != std::string::npos &&
            st.error.find("past the end of out") != std::string::npos &&
            st.error.find("thread (40,0,0)") != std::string::npos,
        "out-of-bounds write: " + st.error);
  st = run_memcheck(12, fwd);
  CHECK(!st.ok() && st.error.find("which the kernel may only read") != std::string::npos,
        "write into a read-only operand: " + st.error);
  st = run_memcheck(13, fwd);
  CHECK(!st.ok() && st.error.find("block (1,0,0)") != std::string::npos &&
            st.error.find("which block (0,0,0) wrote in the same launch") != std::string::npos,
        "two CTAs storing to one address: " + st.error);
  std::vector<float> out;
  st = run_memcheck(14, fwd, &out);
  CHECK(st.ok(), "atomics of several CTAs: " + st.error);
  CHECK(out[0] == 32.0f && out[3] == 32.0f && out[4] == 64.0f, "atomic sums " + str(out[0]) + ", " + str(out[4]));
  st = run_memcheck(15, fwd);
  CHECK(!st.ok() && st.error.find("ld.global.f32") != std::string::npos &&
            st.error.find("in the same launch") != std::string::npos,
        "a read-modify-write instead of an atomic: " + st.error);
  st = run_memcheck(16, fwd);
  CHECK(!st.ok() && st.error.find("mixing atomic and plain") != std::string::npos,
        "plain store and atomic: " + st.error);
  st = run_memcheck(17, fwd, &out);
  CHECK(st.ok() && out[40] == 8.0f, "accesses in bounds: " + st.error);
  st = run_memcheck(18, fwd, &out);
  CHECK(st.ok() && out[35] == 3.0f && out[52] == 1.0f, "tagged pointers through the wrappers: " + st.error);
  st = run_memcheck(20, fwd, &out);
  CHECK(st.ok(), "vector atomics of several CTAs: " + st.error);
  CHECK(out[0] == 64.0f && out[1] == 128.0f && out[2] == 64.0f && out[3] == 128.0f && out[4] == 0.0f,
        "vector atomic sums " + str(out[0]) + ", " + str(out[1]) + ", " + str(out[2]) + ", " + str(out[3]));
  st = run_memcheck(21, fwd);
  CHECK(!st.ok() && st.error.find("red.global.add.v2.f32") != std::string::npos &&
            st.error.find("not 8-byte aligned") != std::string::npos,
        "a misaligned vector atomic: " + st.error);
  st = run_memcheck(22, fwd);
  CHECK(!st.ok() && st.error.find("mixing atomic and plain") != std::string::npos,
        "plain store and vector atomic: " + st.error);
#if !defined(__SANITIZE_ADDRESS__)
  // (AddressSanitizer keeps SIGSEGV to itself.)
  for (const auto& opt : all_schedules()) {
    st = run_memcheck(19, opt, &out);
    CHECK(!st.ok() && st.error.find("thread (3,0,0)") != std::string::npos &&
              st.error.find("plain C++ load or store of global memory") != std::string::npos,
          "a plain access through a tagged pointer: " + st.error);
  }
  // The emulator still works after a fault.
  st = run_memcheck(17, fwd, &out);
  CHECK(st.ok() && out[40] == 8.0f, "a clean launch after a fault: " + st.error);
#endif
}

// =================================================================================================
// Speed: the collective traffic of a forward tile loop (B=1, T=S=128, N=2, H=64, 128-thread
// blocks of 64 query rows): per warp and key tile of 64, 4x(ldmatrix) + 32 mma for S = QK^T,
// quad shuffles for the row statistics, 16 ldmatrix.trans + 32 mma for PV, and a barrier.
// =================================================================================================
struct SpeedParams {
  float* out;
};
__global__ void speed_kernel(SpeedParams p) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) reinterpret_cast<uint16_t*>(smem)[i] = 0x3c00;
  __syncthreads();
  float acc[8][4] = {};
  float s[8][4] = {};
  for (int tile = 0; tile < 2; ++tile) {
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t a[4];
      emu::ldmatrix_x4(a, smem + (lane % 16) * 128 + (kk * 2 + lane / 16) * 16);
      for (int n = 0; n < 8; ++n) {
        uint32_t b[2];
        emu::ldmatrix_x2(b, smem + (n * 8 + lane % 8) * 128 + (kk * 2 + (lane / 8) % 2) * 16);
        emu::mma_m16n8k16_f16(s[n], a, b, s[n]);
      }
    }
    for (int r = 0; r < 2; ++r) {
      float m = s[0][2 * r];
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      float l = m;
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      acc[0][r] += l;
    }
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t a[4] = {0x3c003c00, 0x3c003c00, 0x3c003c00, 0x3c003c00};
      for (int n = 0; n < 8; ++n) {
        uint32_t b[2];
        if (n % 2 == 0) {
          uint32_t b4[4];
          emu::ldmatrix_x4_trans(b4, smem + (kk * 16 + lane % 16) * 128 + (n / 2 * 2 + lane / 16) * 16);
        }
        emu::ldmatrix_x2_trans(b, smem + (kk * 16 + lane % 16) * 128 + n * 16);
        emu::mma_m16n8k16_f16(acc[n], a, b, acc[n]);
      }
    }
    __syncthreads();
  }
  p.out[blockIdx.x * blockDim.x + threadIdx.x] = acc[3][1] + s[2][2];
}
void test_speed() {
  std::vector<float> out(4 * 128);
  auto t0 = std::chrono::steady_clock::now();
  auto st = emu::launch(dim3(4), dim3(128), 64 * 64 * 2, speed_kernel, SpeedParams{out.data()});
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(st.ok(), "launch failed: " + st.error);
  std::printf("     forward-shaped collective load (4 blocks x 128 threads, ~190 collectives/warp): %.1f ms\n",
              s * 1e3);
  CHECK(s < 1.0, "too slow: " + str(s) + " s");
}

}  // namespace

// The scalar wrappers of kernels/ptx.h give the emulation's results bit for bit.
void test_ptx_scalar_wrappers() {
  const float xs[] = {0.0f,     -0.0f,     1.0f, 1.0f + 0x1p-8f,        1.0f + 0x1p-11f, 0x1p-25f, 65520.0f, -3.75f,
                      INFINITY, -INFINITY, NAN,  from_bits(0x00000010), -130.0f,         7.5f};
  for (float lo : xs)
    for (float hi : xs) {
      CHECK(ptx::cvt_pack_bf16x2(lo, hi) == emu::cvt_pack_bf16x2(lo, hi),
            "cvt_pack_bf16x2(" + str(lo) + ", " + str(hi) + ")");
      CHECK(ptx::cvt_pack_f16x2(lo, hi) == emu::cvt_pack_f16x2(lo, hi),
            "cvt_pack_f16x2(" + str(lo) + ", " + str(hi) + ")");
    }
  for (float x : xs) {
    const float a = ptx::ex2_approx(x), b = emu::ex2_approx(x);
    CHECK(bits(a) == bits(b) || (std::isnan(a) && std::isnan(b)), "ex2_approx(" + str(x) + ")");
  }
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    const float a = ptx::cvt_f32_f16(static_cast<uint16_t>(h)), b = emu::cvt_f32_f16(static_cast<uint16_t>(h));
    CHECK(bits(a) == bits(b), "cvt_f32_f16(" + hex(h) + ")");
  }
}

int main() {
  run_test("mma f16: distinct integers (9.7.14.5.8)", [] { test_mma_structured(false); });
  run_test("mma bf16: distinct integers (9.7.14.5.8)", [] { test_mma_structured(true); });
  run_test("mma f16: one-hot A and B positions", [] { test_mma_one_hot(false); });
  run_test("mma bf16: one-hot A and B positions", [] { test_mma_one_hot(true); });
  run_test("mma f16: random values", [] { test_mma_random(false); });
  run_test("mma bf16: random values", [] { test_mma_random(true); });
  run_test("ldmatrix.x4 (9.7.14.5.15)", [] { test_ldmatrix(4, false); });
  run_test("ldmatrix.x4.trans", [] { test_ldmatrix(4, true); });
  run_test("ldmatrix.x2", [] { test_ldmatrix(2, false); });
  run_test("ldmatrix.x2.trans", [] { test_ldmatrix(2, true); });
  run_test("ldmatrix feeds mma (A, B^T, B.trans)", test_ldmatrix_feeds_mma);
  run_test("cp.async groups land only at wait_group", test_cp_async);
  run_test("shfl xor/idx/up/down, widths, ballot", test_shfl);
  run_test("cvt.rn.bf16x2.f32", test_cvt_bf16);
  run_test("cvt.rn.f16x2.f32 (+ exhaustive)", test_cvt_f16);
  run_test("cvt.f32.f16 (exhaustive)", test_cvt_f32_f16);
  run_test("ex2.approx.ftz.f32 (2 ulp)", test_ex2);
  run_test("tanh.approx.f32 (2^-11)", test_tanh);
  run_test("threadIdx/blockIdx over 3-d grid and block", test_ids);
  run_test("shared memory poisoned per block; atomicAdd", test_poison_and_atomics);
  run_test("schedules expose a missing __syncthreads", test_schedules_expose_races);
  run_test("strictness errors", test_strict);
  run_test("race detector: shared memory RAW/WAR, __syncwarp, ldmatrix, cp.async", test_race_detector);
  run_test("global memory: bounds, read-only operands, CTA conflicts, atomics", test_global_checks);
  run_test("speed", test_speed);
  g_via_ptx = true;
  run_test("kernels/ptx.h: mma f16 and bf16", [] {
    test_mma_structured(false);
    test_mma_structured(true);
  });
  run_test("kernels/ptx.h: ldmatrix x4, x4.trans, x2, x2.trans", [] {
    test_ldmatrix(4, false);
    test_ldmatrix(4, true);
    test_ldmatrix(2, false);
    test_ldmatrix(2, true);
  });
  run_test("kernels/ptx.h: cp.async, commit_group, wait_group", test_cp_async);
  run_test("kernels/ptx.h: cvt, ex2", test_ptx_scalar_wrappers);
  g_via_ptx = false;
  std::printf("%d passed, %d failed\n", g_passed_tests, g_failed_tests);
  return g_failed_tests == 0 ? 0 : 1;
}

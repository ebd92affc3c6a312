// The emulated PTX instructions of ptx_emu.h. Fragment layouts follow the PTX ISA text
// ("Parallel Thread Execution ISA", 8.x/9.x); the tests in tests/emu/ check them against
// tables written independently, and build/ptx_selftest.cu against the hardware.
#include "emu/ptx_emu.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace jax_flash {
namespace emu {
namespace detail {
// simt.cc
bool smem_range_ok(const void* p, size_t bytes, size_t* offset);
bool smem_in_flight(size_t offset);  // a cp.async into these 16 bytes has not landed yet
void cp_async_issue(size_t smem_offset, const void* src, int src_bytes, const char* file, int line);
void cp_async_commit();
void cp_async_wait(int n);
}  // namespace detail

namespace {

constexpr int kWarp = 32;

std::string hex_ptr(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

// ---- mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 -----------------------
// PTX ISA 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type", with
//   groupID = %laneid >> 2, threadID_in_group = %laneid % 4 (tig below):
// A (16x16, .row), four .f16x2/.bf16x2 registers holding a0..a7, low half first:
//   row = groupID for a0,a1,a4,a5; groupID + 8 for a2,a3,a6,a7
//   col = tig*2 + (i & 1) for a0..a3; tig*2 + (i & 1) + 8 for a4..a7
// B (16x8, .col), two registers holding b0..b3:
//   row (k) = tig*2 + (i & 1) for b0,b1; tig*2 + (i & 1) + 8 for b2,b3;  col (n) = groupID
// C, D (16x8 f32), four registers c0..c3:
//   row = groupID for c0,c1; groupID + 8 for c2,c3;  col = tig*2 + (i & 1)
// Products of two f16 or two bf16 values are exact in f32; the sum over k is accumulated in
// double and rounded once, so results can differ from the tensor core's in the last bits.
struct MmaIn {
  const uint32_t* a;
  const uint32_t* b;
  const float* c;
};

template <bool kBf16>
float half_at(const uint32_t* regs, int element) {
  uint32_t r = regs[element >> 1];
  uint16_t h = static_cast<uint16_t>((element & 1) ? (r >> 16) : (r & 0xffffu));
  return kBf16 ? bf16_to_float(h) : f16_to_float(h);
}

template <bool kBf16>
std::string compute_mma(uint32_t, const void* const* in, void* const* out, void*) {
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < kWarp; ++lane) {
    const MmaIn& x = *static_cast<const MmaIn*>(in[lane]);
    const int group = lane >> 2, tig = lane & 3;
    for (int i = 0; i < 8; ++i) {
      const int row = group + (((i >> 1) & 1) ? 8 : 0);  // a2,a3,a6,a7 -> +8
      const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = half_at<kBf16>(x.a, i);
    }
    for (int i = 0; i < 4; ++i) {
      const int k = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[k][group] = half_at<kBf16>(x.b, i);
    }
    for (int i = 0; i < 4; ++i) C[group + (i >= 2 ? 8 : 0)][tig * 2 + (i & 1)] = x.c[i];
  }
  float D[16][8];
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double acc = C[m][n];
      for (int k = 0; k < 16; ++k) acc += static_cast<double>(A[m][k] * B[k][n]);
      D[m][n] = static_cast<float>(acc);
    }
  // Every lane's inputs are read above before any output is written: d may alias c.
  for (int lane = 0; lane < kWarp; ++lane) {
    float* d = static_cast<float*>(out[lane]);
    const int group = lane >> 2, tig = lane & 3;
    for (int i = 0; i < 4; ++i) d[i] = D[group + (i >= 2 ? 8 : 0)][tig * 2 + (i & 1)];
  }
  return {};
}

const detail::CollectiveKind kMmaF16{"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", &compute_mma<false>};
const detail::CollectiveKind kMmaBf16{"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", &compute_mma<true>};

// ---- ldmatrix.sync.aligned.m8n8.{x2,x4}{.trans}.shared.b16 ----------------------------------
// PTX ISA 9.7.14.5.15 "ldmatrix": matrix i (of .num = 1, 2 or 4) has its eight rows at the
// addresses of lanes 8i..8i+7; each row is 8 contiguous b16 elements (16 bytes, 16-byte
// aligned). Lane l receives, in register i, row l/4, columns 2*(l%4) and 2*(l%4)+1 of matrix
// i (the lower column in the low half). With .trans the matrix is read column-major: lane l
// receives the elements at stored rows 2*(l%4), 2*(l%4)+1 of stored column l/4. For .x1/.x2
// the addresses of lanes 8*num..31 are not used (sm_80+).
struct LdmatrixIn {
  const void* row;
  const char* file;
  int line;
};

template <int kNum, bool kTrans>
std::string compute_ldmatrix(uint32_t, const void* const* in, void* const* out, void*) {
  uint16_t M[4][8][8];
  for (int m = 0; m < kNum; ++m)
    for (int row = 0; row < 8; ++row) {
      const int lane = m * 8 + row;
      const LdmatrixIn& x = *static_cast<const LdmatrixIn*>(in[lane]);
      const void* p = x.row;
      size_t offset;
      if (!detail::smem_range_ok(p, 16, &offset))
        return std::string("ldmatrix: lane ") + std::to_string(lane) + " row address " + hex_ptr(p) +
               " is outside the block's dynamic shared memory [" + hex_ptr(dynamic_smem()) + ", +" +
               std::to_string(dynamic_smem_size()) + " bytes)";
      if (offset % 16 != 0)
        return std::string("ldmatrix: lane ") + std::to_string(lane) + " row address " + hex_ptr(p) +
               " is not 16-byte aligned";
      if (detail::smem_in_flight(offset))
        return std::string("ldmatrix: lane ") + std::to_string(lane) + " reads shared memory offset " +
               std::to_string(offset) +
               " while a cp.async into it has not been waited for (missing "
               "cp.async.wait_group or __syncthreads)";
      // The lanes of one ldmatrix read together; each row is read by the lane that addresses it.
      std::string race = detail::smem_access(lane, p, 16, detail::MemOp::kRead, "ldmatrix", x.file, x.line);
      if (!race.empty()) return race;
      std::memcpy(M[m][row], p, 16);
    }
  for (int lane = 0; lane < kWarp; ++lane) {
    uint32_t* r = static_cast<uint32_t*>(out[lane]);
    const int q = lane >> 2, c = (lane & 3) * 2;
    for (int m = 0; m < kNum; ++m) {
      uint16_t lo = kTrans ? M[m][c][q] : M[m][q][c];
      uint16_t hi = kTrans ? M[m][c + 1][q] : M[m][q][c + 1];
      r[m] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
  return {};
}

const detail::CollectiveKind kLdmatrixX4{"ldmatrix.sync.aligned.m8n8.x4.shared.b16", &compute_ldmatrix<4, false>};
const detail::CollectiveKind kLdmatrixX4T{"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", &compute_ldmatrix<4, true>};
const detail::CollectiveKind kLdmatrixX2{"ldmatrix.sync.aligned.m8n8.x2.shared.b16", &compute_ldmatrix<2, false>};
const detail::CollectiveKind kLdmatrixX2T{"ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16", &compute_ldmatrix<2, true>};

}  // namespace

void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  MmaIn in{a, b, c};
  detail::warp_collective(kMmaF16, 0xffffffffu, &in, d);
}
void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  MmaIn in{a, b, c};
  detail::warp_collective(kMmaBf16, 0xffffffffu, &in, d);
}

void ldmatrix_x4(uint32_t r[4], const void* smem_row_ptr, const char* file, int line) {
  LdmatrixIn in{smem_row_ptr, file, line};
  detail::warp_collective(kLdmatrixX4, 0xffffffffu, &in, r);
}
void ldmatrix_x4_trans(uint32_t r[4], const void* smem_row_ptr, const char* file, int line) {
  LdmatrixIn in{smem_row_ptr, file, line};
  detail::warp_collective(kLdmatrixX4T, 0xffffffffu, &in, r);
}
void ldmatrix_x2(uint32_t r[2], const void* smem_row_ptr, const char* file, int line) {
  LdmatrixIn in{smem_row_ptr, file, line};
  detail::warp_collective(kLdmatrixX2, 0xffffffffu, &in, r);
}
void ldmatrix_x2_trans(uint32_t r[2], const void* smem_row_ptr, const char* file, int line) {
  LdmatrixIn in{smem_row_ptr, file, line};
  detail::warp_collective(kLdmatrixX2T, 0xffffffffu, &in, r);
}

void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes, const char* file, int line) {
  size_t offset;
  if (!detail::smem_range_ok(smem_dst, 16, &offset))
    detail::fail("cp.async: destination " + hex_ptr(smem_dst) +
                 " (16 bytes) is outside the block's dynamic shared memory [" + hex_ptr(dynamic_smem()) + ", +" +
                 std::to_string(dynamic_smem_size()) + " bytes)");
  if (offset % 16 != 0) detail::fail("cp.async: destination " + hex_ptr(smem_dst) + " is not 16-byte aligned");
  if (src_bytes < 0 || src_bytes > 16)
    detail::fail("cp.async: src-size " + std::to_string(src_bytes) + " is outside [0, 16]");
  gmem_src = untag_global(gmem_src);
  if (src_bytes > 0 && reinterpret_cast<uintptr_t>(gmem_src) % 16 != 0)
    detail::fail("cp.async: source " + hex_ptr(gmem_src) + " is not 16-byte aligned");
  detail::cp_async_issue(offset, gmem_src, src_bytes, file, line);
}
void cp_async_commit_group() { detail::cp_async_commit(); }
void cp_async_wait_group_n(int n) {
  if (n < 0) detail::fail("cp.async.wait_group: negative count");
  detail::cp_async_wait(n);
}

// ---- ld/st.shared, ld/st.global, red.global ----
namespace {

void check_shared(const char* what, const void* p, size_t bytes, detail::MemOp op, const char* file, int line) {
  size_t offset;
  if (!detail::smem_range_ok(p, bytes, &offset))
    detail::fail(std::string(what) + ": address " + hex_ptr(p) + " (" + std::to_string(bytes) +
                 " bytes) is outside the block's dynamic shared memory [" + hex_ptr(dynamic_smem()) + ", +" +
                 std::to_string(dynamic_smem_size()) + " bytes)");
  if (offset % bytes != 0)
    detail::fail(std::string(what) + ": shared memory offset " + std::to_string(offset) + " is not " +
                 std::to_string(bytes) + "-byte aligned");
  std::string race = detail::smem_access(-1, p, bytes, op, what, file, line);
  if (!race.empty()) detail::fail(race);
}

// Returns p without its tag (tag_global), checked.
template <class T>
T* check_global(const char* what, T* p, size_t bytes, detail::MemOp op, const char* file, int line) {
  p = untag_global(p);
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
    detail::fail(std::string(what) + ": address " + hex_ptr(p) + " is not " + std::to_string(bytes) + "-byte aligned");
  detail::check_global(p, bytes, op, what, file, line);
  return p;
}

}  // namespace

float ld_shared_f32(const float* p, const char* file, int line) {
  check_shared("ld.shared.f32", p, 4, detail::MemOp::kRead, file, line);
  float v;
  std::memcpy(&v, p, 4);
  return v;
}
void ld_shared_v4_b32(uint32_t r[4], const void* p, const char* file, int line) {
  check_shared("ld.shared.v4.b32", p, 16, detail::MemOp::kRead, file, line);
  std::memcpy(r, p, 16);
}
void st_shared_b32(void* p, uint32_t v, const char* file, int line) {
  check_shared("st.shared.b32", p, 4, detail::MemOp::kWrite, file, line);
  std::memcpy(p, &v, 4);
}
void st_shared_f32(float* p, float v, const char* file, int line) {
  check_shared("st.shared.f32", p, 4, detail::MemOp::kWrite, file, line);
  std::memcpy(p, &v, 4);
}

float ld_global_f32(const float* p, const char* file, int line) {
  p = check_global("ld.global.f32", p, 4, detail::MemOp::kRead, file, line);
  float v;
  std::memcpy(&v, p, 4);
  return v;
}
uint16_t ld_global_b16(const uint16_t* p, const char* file, int line) {
  p = check_global("ld.global.b16", p, 2, detail::MemOp::kRead, file, line);
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
uint8_t ld_global_u8(const uint8_t* p, const char* file, int line) {
  p = check_global("ld.global.u8", p, 1, detail::MemOp::kRead, file, line);
  uint8_t v;
  std::memcpy(&v, p, 1);
  return v;
}
uint32_t ld_global_b32(const uint32_t* p, const char* file, int line) {
  p = check_global("ld.global.b32", p, 4, detail::MemOp::kRead, file, line);
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
void ld_global_v4_b32(uint32_t r[4], const void* p, const char* file, int line) {
  p = check_global("ld.global.v4.b32", p, 16, detail::MemOp::kRead, file, line);
  std::memcpy(r, p, 16);
}
void st_global_f32(float* p, float v, const char* file, int line) {
  p = check_global("st.global.f32", p, 4, detail::MemOp::kWrite, file, line);
  std::memcpy(p, &v, 4);
}
void st_global_b32(void* p, uint32_t v, const char* file, int line) {
  p = check_global("st.global.b32", p, 4, detail::MemOp::kWrite, file, line);
  std::memcpy(p, &v, 4);
}
void st_global_v4_b32(void* p, const uint32_t v[4], const char* file, int line) {
  p = check_global("st.global.v4.b32", p, 16, detail::MemOp::kWrite, file, line);
  std::memcpy(p, v, 16);
}
void red_global_add_f32(float* p, float v, const char* file, int line) {
  p = check_global("red.global.add.f32", p, 4, detail::MemOp::kAtomic, file, line);
  float old;
  std::memcpy(&old, p, 4);
  old += v;
  std::memcpy(p, &old, 4);
}
void red_global_add_v2_f32(float* p, float lo, float hi, const char* file, int line) {
  p = check_global("red.global.add.v2.f32", p, 8, detail::MemOp::kAtomic, file, line);
  float old[2];
  std::memcpy(old, p, 8);
  old[0] += lo;
  old[1] += hi;
  std::memcpy(p, old, 8);
}

namespace detail {
uint32_t approx_seed() {
  static const uint32_t seed = [] {
    const char* s = std::getenv("JAX_FLASH_EMU_APPROX_SEED");
    return s != nullptr ? static_cast<uint32_t>(std::strtoul(s, nullptr, 10)) : 0u;
  }();
  return seed;
}
}  // namespace detail

}  // namespace emu
}  // namespace jax_flash

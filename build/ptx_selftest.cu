// PTX wrapper self-test: runs every wrapper of cuda/kernels/ptx.h on the real instruction and the
// same inputs through the host emulation (cuda/emu/), and compares the results lane by lane.
// Prints PASS/FAIL per wrapper; exits 0 when all pass, 1 on a mismatch, 2 without a usable GPU.
//
// The same file is compiled twice: by nvcc for the GPU side (with main), and by the host
// compiler with JAX_FLASH_EMULATE for the emulated side; the test kernels below are shared.
// With JAX_FLASH_SELFTEST_HOST_DRIVER as well, the host compiler builds the driver too, with
// both sides emulated: no GPU needed, every comparison must pass, and the approximate
// instructions' emulation is checked against the documented bounds
// (build/device_check.sh --dry-run). JAX_FLASH_SELFTEST_PERTURB=1 then changes one element of
// every output of one side, and every comparison must fail: the self-test can fail.
// Build and run from the repository root (sm_80 or newer; pick -arch for the GPU at hand):
//
//   T=$(mktemp -d)
//   g++ -std=c++17 -O1 -DJAX_FLASH_EMULATE -Icuda -x c++ -c build/ptx_selftest.cu -o $T/emu_side.o
//   g++ -std=c++17 -O1 -Icuda -c cuda/emu/simt.cc -o $T/simt.o
//   g++ -std=c++17 -O1 -Icuda -c cuda/emu/ptx_emu.cc -o $T/ptx_emu.o
//   OBJS="$T/emu_side.o $T/simt.o $T/ptx_emu.o"
//   nvcc -std=c++17 -O2 -arch=sm_90 -Icuda build/ptx_selftest.cu $OBJS -o $T/ptx_selftest
//   $T/ptx_selftest
//
// Comparisons: bit-exact for ldmatrix, cp.async, cvt, shfl, ld/st (shared and global) and
// red.global.add on integer-valued sums, and for mma on integer-valued inputs (every partial
// sum exact); mma on random inputs within 16 f32 ulps of the case's largest output (the tensor
// core's accumulation order and rounding are not specified). The approximate instructions are
// checked on each side against the exact result (double precision) and the PTX ISA's bound:
// ex2.approx.ftz within 2 ulp of the correctly rounded result (results below 2^-126 may be
// flushed to zero), tanh.approx within a relative error of 2^-11; the GPU's largest error is
// printed. NaNs compare as NaN.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/ptx.h"

namespace selftest {

constexpr int kMmaCases = 16;  // per dtype; cases 0..3 integer-valued, 4 with inf/NaN, rest random
constexpr int kLdRows = 32;    // 16-byte rows of the ldmatrix source
constexpr int kCpThreads = 64;
constexpr int kPerLane = 64;          // values per lane for ex2, tanh, cvt_pack
constexpr int kMemBlocks = 4, kMemThreads = 64;  // ld/st/red: several CTAs add to the same words
constexpr int kMemTotal = kMemBlocks * kMemThreads;
constexpr int kAccumulators = 10;  // 0-4: red.global.add.f32, 6-9: the .v2 pairs (8-byte aligned)
constexpr int kCvtF16PerLane = 2048;  // 32 x 2048 = every f16 bit pattern

struct Inputs {
  std::vector<uint32_t> mma_a[2], mma_b[2];  // [dtype][case][lane][4 or 2]
  std::vector<float> mma_c[2];               // [dtype][case][lane][4]
  std::vector<uint16_t> ld_src;              // [kLdRows * 8]
  std::vector<int> ld_row_of_lane;           // [32]
  std::vector<uint8_t> cp_src;               // [2][kCpThreads][16]
  std::vector<float> ex2_in, tanh_in;        // [32][kPerLane]
  std::vector<float> cvt_lo, cvt_hi;         // [32][kPerLane]
  std::vector<float> shfl_in;                // [32]
  std::vector<float> mem_src;                // [kMemTotal * 4]
};

struct Outputs {
  std::vector<float> mma_d[2];              // [dtype][case][lane][4]
  std::vector<uint32_t> ld[4];              // [variant][lane][4]: x4, x4.trans, x2, x2.trans
  std::vector<uint8_t> cp;                  // [3][kCpThreads][16]
  std::vector<float> ex2, tanh;             // [32][kPerLane]
  std::vector<uint32_t> cvt_bf16, cvt_f16;  // [32][kPerLane]
  std::vector<float> cvt_f32_f16;           // [65536]
  std::vector<float> shfl;                  // [32][6]
  std::vector<float> mem_f32;               // [kMemTotal]: ld.global -> st/ld.shared -> st.global
  std::vector<uint32_t> mem_b32;            // [kMemTotal][8]: v4 global and shared round trips
  std::vector<float> mem_acc;               // [kAccumulators]: red.global.add, .v2
};

}  // namespace selftest

#if defined(JAX_FLASH_EMULATE) && !defined(JAX_FLASH_SELFTEST_HOST_DRIVER)
#define SELFTEST_SIDE emu_side
#else
#define SELFTEST_SIDE gpu_side  // compiled by nvcc, or emulated as well with the host driver
#define SELFTEST_DRIVER 1
#endif

namespace SELFTEST_SIDE {
using namespace selftest;
namespace ptx = jax_flash::ptx;

// ---- the test kernels (compiled for the GPU and for the emulation) -----------------------------

__global__ void mma_kernel(const uint32_t* a, const uint32_t* b, const float* c, float* d, int bf16) {
  const int lane = threadIdx.x, cs = blockIdx.x, at = cs * 32 + lane;
  uint32_t ra[4], rb[2];
  float rc[4], rd[4];
  for (int i = 0; i < 4; ++i) ra[i] = a[at * 4 + i];
  for (int i = 0; i < 2; ++i) rb[i] = b[at * 2 + i];
  for (int i = 0; i < 4; ++i) rc[i] = c[at * 4 + i];
  if (bf16)
    ptx::mma_m16n8k16_bf16(rd, ra, rb, rc);
  else
    ptx::mma_m16n8k16_f16(rd, ra, rb, rc);
  for (int i = 0; i < 4; ++i) d[at * 4 + i] = rd[i];
}

__global__ void ldmatrix_kernel(const uint16_t* src, const int* row_of_lane, uint32_t* out) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  uint16_t* s = reinterpret_cast<uint16_t*>(smem);
  for (int i = lane; i < kLdRows * 8; i += 32) s[i] = src[i];
  __syncthreads();
  const char* row = smem + row_of_lane[lane] * 16;
  // .x2 uses the addresses of lanes 0..15 only; the others repeat valid ones.
  const char* row2 = smem + row_of_lane[lane % 16] * 16;
  uint32_t r[4];
  ptx::ldmatrix_x4(r, row);
  for (int i = 0; i < 4; ++i) out[(0 * 32 + lane) * 4 + i] = r[i];
  ptx::ldmatrix_x4_trans(r, row);
  for (int i = 0; i < 4; ++i) out[(1 * 32 + lane) * 4 + i] = r[i];
  r[2] = r[3] = 0;
  ptx::ldmatrix_x2(r, row2);
  for (int i = 0; i < 4; ++i) out[(2 * 32 + lane) * 4 + i] = i < 2 ? r[i] : 0;
  ptx::ldmatrix_x2_trans(r, row2);
  for (int i = 0; i < 4; ++i) out[(3 * 32 + lane) * 4 + i] = i < 2 ? r[i] : 0;
}

__global__ void cp_async_kernel(const uint8_t* src, uint8_t* out) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const int t = threadIdx.x;
  ptx::cp_async_16(smem + t * 16, src + t * 16, 16);
  ptx::cp_async_commit_group();
  // Odd threads copy, even threads zero-fill (src-size 0 reads nothing).
  ptx::cp_async_16(smem + 1024 + t * 16, src + (kCpThreads + t) * 16, (t % 2) ? 16 : 0);
  ptx::cp_async_commit_group();
  ptx::cp_async_wait_group<1>();
  for (int i = 0; i < 16; ++i) out[(0 * kCpThreads + t) * 16 + i] = static_cast<uint8_t>(smem[t * 16 + i]);
  ptx::cp_async_wait_group<0>();
  for (int i = 0; i < 16; ++i) out[(1 * kCpThreads + t) * 16 + i] = static_cast<uint8_t>(smem[1024 + t * 16 + i]);
  __syncthreads();
  const int u = (t + 1) % kCpThreads;
  for (int i = 0; i < 16; ++i) out[(2 * kCpThreads + t) * 16 + i] = static_cast<uint8_t>(smem[u * 16 + i]);
}

__global__ void scalar_kernel(const float* ex2_in, const float* tanh_in, const float* lo, const float* hi,
                              float* ex2_out, float* tanh_out, uint32_t* bf16_out, uint32_t* f16_out, float* f32_out) {
  const int lane = threadIdx.x;
  for (int i = 0; i < kPerLane; ++i) {
    const int at = lane * kPerLane + i;
    ex2_out[at] = ptx::ex2_approx(ex2_in[at]);
    tanh_out[at] = ptx::tanh_approx(tanh_in[at]);
    bf16_out[at] = ptx::cvt_pack_bf16x2(lo[at], hi[at]);
    f16_out[at] = ptx::cvt_pack_f16x2(lo[at], hi[at]);
  }
  for (int i = 0; i < kCvtF16PerLane; ++i) {
    const int h = lane * kCvtF16PerLane + i;
    f32_out[h] = ptx::cvt_f32_f16(static_cast<uint16_t>(h));
  }
}

__global__ void shfl_kernel(const float* in, float* out) {
  const int lane = threadIdx.x;
  const float v = in[lane];
  float* o = out + lane * 6;
  o[0] = __shfl_xor_sync(0xffffffffu, v, 1);
  o[1] = __shfl_xor_sync(0xffffffffu, v, 2);
  o[2] = __shfl_xor_sync(0xffffffffu, v, 16);
  float m = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  o[3] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  o[4] = __shfl_sync(0xffffffffu, v, 7);
  o[5] = __shfl_xor_sync(0xffffffffu, v, 4, 8);
}

// Every ld/st wrapper, shared and global, and red.global.add: values make a round trip
// global -> registers -> shared (another thread's words) -> global; the red adds are small
// integers (every sum exact in any order) from every thread of every CTA.
__global__ void memory_kernel(const float* src, float* out_f32, uint32_t* out_b32, float* acc) {
  JAX_FLASH_DYNAMIC_SMEM(smem);
  float* sf = reinterpret_cast<float*>(smem);  // [kMemThreads] floats, then [kMemThreads] words
  const int t = threadIdx.x, g = blockIdx.x * kMemThreads + t;
  const float x = ptx::ld_global_f32(src + g);
  uint32_t v[4];
  ptx::ld_global_v4_b32(v, src + kMemTotal + 4 * (g % (kMemTotal - kMemTotal / 4)));
  ptx::st_shared_f32(sf + t, x);
  ptx::st_shared_b32(sf + kMemThreads + t, v[t % 4] ^ 0x5a5a5a5au);
  __syncthreads();
  const float y = ptx::ld_shared_f32(sf + (t * 7 + 3) % kMemThreads);
  uint32_t w[4];
  ptx::ld_shared_v4_b32(w, sf + kMemThreads + 4 * ((t + 5) % (kMemThreads / 4)));
  ptx::st_global_f32(out_f32 + g, y);
  ptx::st_global_v4_b32(out_b32 + 8 * g, v);
  // The narrow loads (a 16-bit half and a byte of src's words), a 32-bit word load and the
  // volatile mov, folded into the shared words' round trip.
  w[0] ^= ptx::ld_global_b16(reinterpret_cast<const uint16_t*>(src) + 2 * g + (g & 1));
  w[1] ^= ptx::ld_global_u8(reinterpret_cast<const uint8_t*>(src) + 4 * g + (g & 3));
  w[2] ^= static_cast<uint32_t>(ptx::mov_b32_volatile(g * 2654435 + 17));
  w[3] ^= ptx::ld_global_b32(reinterpret_cast<const uint32_t*>(src) + (g * 7 + 1) % kMemTotal);
  for (int i = 0; i < 4; ++i) ptx::st_global_b32(out_b32 + 8 * g + 4 + i, w[i]);
  ptx::red_global_add_f32(acc + g % 4, static_cast<float>(g % 13) - 6.0f);
  ptx::red_global_add_f32(acc + 4, 1.0f);
  // Two pairs: each element of a pair gets its own values (a swapped or dropped half shows).
  ptx::red_global_add_v2_f32(acc + 6 + 2 * (g % 2), static_cast<float>(g % 7) - 3.0f, static_cast<float>(g % 5) + 1.0f);
}

// ---- memory and launches on each side ---------------------------------------------------------

#ifdef JAX_FLASH_EMULATE
template <class T>
T* upload(const std::vector<T>& v) {
  T* p = new T[v.size() > 0 ? v.size() : 1];
  std::memcpy(p, v.data(), v.size() * sizeof(T));
  return p;
}
template <class T>
T* alloc(size_t n) {
  return new T[n]();
}
template <class T>
void download(std::vector<T>& v, const T* p, size_t n) {
  v.assign(p, p + n);
}
template <class T>
void release(T* p) {
  delete[] p;
}
template <class... Params, class... Args>
std::string run(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args... args) {
  return jax_flash::emu::launch(grid, block, smem, kernel, static_cast<Params>(args)...).error;
}
#else
template <class T>
T* upload(const std::vector<T>& v) {
  T* p = nullptr;
  cudaMalloc(&p, (v.size() > 0 ? v.size() : 1) * sizeof(T));
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}
template <class T>
T* alloc(size_t n) {
  T* p = nullptr;
  cudaMalloc(&p, n * sizeof(T));
  cudaMemset(p, 0, n * sizeof(T));
  return p;
}
template <class T>
void download(std::vector<T>& v, const T* p, size_t n) {
  v.resize(n);
  cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
}
template <class T>
void release(T* p) {
  cudaFree(p);
}
template <class... Params, class... Args>
std::string run(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args... args) {
  // clang-format would split the launch's >>> into > > >.
  // clang-format off
  kernel<<<grid, block, smem>>>(static_cast<Params>(args)...);
  // clang-format on
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}
#endif

// Runs every test kernel on this side; returns the first error (empty on success).
std::string run_all(const Inputs& in, Outputs* out) {
  std::string err;
  auto note = [&](const std::string& what, const std::string& e) {
    if (!e.empty() && err.empty()) err = what + ": " + e;
  };
  for (int dt = 0; dt < 2; ++dt) {
    uint32_t* a = upload(in.mma_a[dt]);
    uint32_t* b = upload(in.mma_b[dt]);
    float* c = upload(in.mma_c[dt]);
    float* d = alloc<float>(kMmaCases * 32 * 4);
    note("mma", run(mma_kernel, dim3(kMmaCases), dim3(32), 0, a, b, c, d, dt));
    download(out->mma_d[dt], d, kMmaCases * 32 * 4);
    release(a), release(b), release(c), release(d);
  }
  {
    uint16_t* src = upload(in.ld_src);
    int* rows = upload(in.ld_row_of_lane);
    uint32_t* o = alloc<uint32_t>(4 * 32 * 4);
    note("ldmatrix", run(ldmatrix_kernel, dim3(1), dim3(32), kLdRows * 16, src, rows, o));
    std::vector<uint32_t> all;
    download(all, o, 4 * 32 * 4);
    for (int v = 0; v < 4; ++v) out->ld[v].assign(all.begin() + v * 128, all.begin() + (v + 1) * 128);
    release(src), release(rows), release(o);
  }
  {
    uint8_t* src = upload(in.cp_src);
    uint8_t* o = alloc<uint8_t>(3 * kCpThreads * 16);
    note("cp.async", run(cp_async_kernel, dim3(1), dim3(kCpThreads), 2048, src, o));
    download(out->cp, o, 3 * kCpThreads * 16);
    release(src), release(o);
  }
  {
    float* ex2_in = upload(in.ex2_in);
    float* tanh_in = upload(in.tanh_in);
    float* lo = upload(in.cvt_lo);
    float* hi = upload(in.cvt_hi);
    float* ex2_out = alloc<float>(32 * kPerLane);
    float* tanh_out = alloc<float>(32 * kPerLane);
    uint32_t* bf = alloc<uint32_t>(32 * kPerLane);
    uint32_t* f16 = alloc<uint32_t>(32 * kPerLane);
    float* f32 = alloc<float>(65536);
    note("scalar", run(scalar_kernel, dim3(1), dim3(32), 0, ex2_in, tanh_in, lo, hi, ex2_out, tanh_out, bf, f16, f32));
    download(out->ex2, ex2_out, 32 * kPerLane);
    download(out->tanh, tanh_out, 32 * kPerLane);
    download(out->cvt_bf16, bf, 32 * kPerLane);
    download(out->cvt_f16, f16, 32 * kPerLane);
    download(out->cvt_f32_f16, f32, 65536);
    release(ex2_in), release(tanh_in), release(lo), release(hi), release(ex2_out), release(tanh_out);
    release(bf), release(f16), release(f32);
  }
  {
    float* src = upload(in.mem_src);
    float* f32 = alloc<float>(kMemTotal);
    uint32_t* b32 = alloc<uint32_t>(kMemTotal * 8);
    float* acc = alloc<float>(kAccumulators);
    note("memory", run(memory_kernel, dim3(kMemBlocks), dim3(kMemThreads), 2 * kMemThreads * 4, src, f32, b32, acc));
    download(out->mem_f32, f32, kMemTotal);
    download(out->mem_b32, b32, kMemTotal * 8);
    download(out->mem_acc, acc, kAccumulators);
    release(src), release(f32), release(b32), release(acc);
  }
  {
    float* i = upload(in.shfl_in);
    float* o = alloc<float>(32 * 6);
    note("shfl", run(shfl_kernel, dim3(1), dim3(32), 0, i, o));
    download(out->shfl, o, 32 * 6);
    release(i), release(o);
  }
  return err;
}

}  // namespace SELFTEST_SIDE

#ifdef SELFTEST_DRIVER
// ---- the GPU side also has the driver: inputs, both runs, comparison -----------------------------
namespace emu_side {
std::string run_all(const selftest::Inputs& in, selftest::Outputs* out);
}

namespace selftest {
namespace {

uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bitsf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Rng {  // xorshift64*, deterministic
  uint64_t s = 0x2545f4914f6cdd1dull;
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545f4914f6cdd1dull;
  }
  uint32_t u32() { return static_cast<uint32_t>(next() >> 32); }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
};

// Exact small integers as f16 / bf16 bits.
uint16_t int_f16(int v) {
  if (v == 0) return 0;
  uint16_t sign = v < 0 ? 0x8000 : 0;
  int a = v < 0 ? -v : v, e = 0;
  while ((a >> e) > 1) ++e;            // a in [2^e, 2^(e+1))
  int mant = (a << (10 - e)) & 0x3ff;  // exact for |v| < 2048
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | mant);
}
uint16_t int_bf16(int v) { return static_cast<uint16_t>(fbits(static_cast<float>(v)) >> 16); }  // exact for |v| < 256
uint16_t random_f16(Rng& r) {  // finite, |x| in [2^-6, 2^6)
  return static_cast<uint16_t>((r.u32() & 0x8000) | ((9 + r.u32() % 12) << 10) | (r.u32() & 0x3ff));
}
uint16_t random_bf16(Rng& r) {
  return static_cast<uint16_t>((r.u32() & 0x8000) | ((121 + r.u32() % 12) << 7) | (r.u32() & 0x7f));
}

Inputs make_inputs() {
  Inputs in;
  Rng r;
  for (int dt = 0; dt < 2; ++dt) {
    in.mma_a[dt].resize(kMmaCases * 32 * 4);
    in.mma_b[dt].resize(kMmaCases * 32 * 2);
    in.mma_c[dt].resize(kMmaCases * 32 * 4);
    for (int cs = 0; cs < kMmaCases; ++cs)
      for (int lane = 0; lane < 32; ++lane) {
        const int at = cs * 32 + lane;
        auto half = [&](int reg, int h) -> uint16_t {
          if (cs < 4) {  // integers in [-8, 8]: every partial sum is exact in f32
            int v = static_cast<int>((lane * 7 + reg * 5 + h * 3 + cs * 11) % 17) - 8;
            if (cs == 1 && (lane + reg + h) % 3 != 0) v = 0;  // sparse
            return dt ? int_bf16(v) : int_f16(v);
          }
          return dt ? random_bf16(r) : random_f16(r);
        };
        for (int i = 0; i < 4; ++i) in.mma_a[dt][at * 4 + i] = half(i, 0) | (static_cast<uint32_t>(half(i, 1)) << 16);
        for (int i = 0; i < 2; ++i)
          in.mma_b[dt][at * 2 + i] = half(4 + i, 0) | (static_cast<uint32_t>(half(4 + i, 1)) << 16);
        for (int i = 0; i < 4; ++i)
          in.mma_c[dt][at * 4 + i] =
              cs < 4 ? static_cast<float>(lane * 4 + i - 64) : static_cast<float>(r.uniform() * 8 - 4);
        if (cs == 4 && lane == 9) {  // inf and NaN propagate to the rows/columns they touch
          in.mma_a[dt][at * 4 + 0] = dt ? 0x7f80u : 0x7c00u;  // +inf
          in.mma_b[dt][at * 2 + 1] = dt ? 0x7fc00000u : 0x7e000000u;  // NaN in the high half
        }
      }
  }
  // ldmatrix: distinct 16-bit codes, rows scattered by a permutation of lanes.
  in.ld_src.resize(kLdRows * 8);
  for (int i = 0; i < kLdRows * 8; ++i) in.ld_src[i] = static_cast<uint16_t>(0x100 * (i / 8) + (i % 8) + 0x1000);
  in.ld_row_of_lane.resize(32);
  for (int l = 0; l < 32; ++l) in.ld_row_of_lane[l] = (l * 13 + 7) % 32;
  in.cp_src.resize(2 * kCpThreads * 16);
  for (size_t i = 0; i < in.cp_src.size(); ++i) in.cp_src[i] = static_cast<uint8_t>(i * 31 + 1);
  // ex2 and cvt: special values first, then random ones.
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -1.0f,
                            0.5f,
                            -126.0f,
                            -127.5f,
                            -149.0f,
                            -150.0f,
                            127.0f,
                            128.0f,
                            INFINITY,
                            -INFINITY,
                            NAN,
                            bitsf(0x00000010),
                            bitsf(0x80000010),
                            bitsf(0x007fffff),
                            1.0f + 0x1p-8f,
                            1.0f + 3 * 0x1p-8f,
                            1.0f + 0x1p-11f,
                            1.0f + 3 * 0x1p-11f,
                            65504.0f,
                            65519.0f,
                            65520.0f,
                            0x1p-24f,
                            0x1p-25f,
                            0x1.8p-25f,
                            0x1p-14f,
                            0x1.ffcp-15f,
                            bitsf(0x7f7fffff),
                            bitsf(0xffc12345),
                            3.14159265f,
                            -2.71828183f,
                            1e-10f,
                            1e10f};
  const int ns = sizeof(specials) / sizeof(specials[0]);
  in.ex2_in.resize(32 * kPerLane);
  in.cvt_lo.resize(32 * kPerLane);
  in.cvt_hi.resize(32 * kPerLane);
  for (int i = 0; i < 32 * kPerLane; ++i) {
    in.ex2_in[i] = i < ns ? specials[i] : static_cast<float>(r.uniform() * 300 - 160);
    in.cvt_lo[i] = i < ns ? specials[i] : bitsf(r.u32());
    in.cvt_hi[i] = i < ns ? specials[ns - 1 - i] : static_cast<float>((r.uniform() - 0.5) * 1e5);
    if (i >= ns && i % 5 == 0) in.cvt_lo[i] = static_cast<float>((r.uniform() - 0.5) * 100);
  }
  // tanh: its own specials (saturation, tiny and subnormal inputs), then |x| spread over 2^-30..2^5.
  const float tanh_specials[] = {0.5f,
                                 -0.5f,
                                 0.0f,
                                 -0.0f,
                                 1.0f,
                                 -1.0f,
                                 4.0f,
                                 9.0f,
                                 -9.5f,
                                 20.0f,
                                 1e-3f,
                                 -1e-6f,
                                 0x1p-20f,
                                 bitsf(0x00000010),
                                 bitsf(0x80400000),
                                 0x1p-126f,
                                 INFINITY,
                                 -INFINITY,
                                 NAN,
                                 bitsf(0x7f7fffff)};
  const int nt = sizeof(tanh_specials) / sizeof(tanh_specials[0]);
  in.tanh_in.resize(32 * kPerLane);
  for (int i = 0; i < 32 * kPerLane; ++i) {
    const float mag = std::exp2(static_cast<float>(r.uniform() * 35 - 30));
    in.tanh_in[i] = i < nt ? tanh_specials[i] : (r.u32() & 1 ? mag : -mag);
    if (i >= nt && i % 3 == 0) in.tanh_in[i] = static_cast<float>(r.uniform() * 12 - 6);
  }
  in.shfl_in.resize(32);
  for (int l = 0; l < 32; ++l) in.shfl_in[l] = 0.25f * ((l * 11) % 32) - 3.0f;
  // ld/st/red: any bit patterns (NaN payloads, -0, subnormals) must move unchanged.
  in.mem_src.resize(kMemTotal * 4);
  for (size_t i = 0; i < in.mem_src.size(); ++i) in.mem_src[i] = i < ns ? specials[i] : bitsf(r.u32());
  return in;
}

int g_failed = 0, g_verdicts = 0;
void verdict(const char* name, int mismatches, const std::string& first, const std::string& figure = "") {
  ++g_verdicts;
  if (mismatches == 0) {
    std::printf("PASS %s%s\n", name, figure.c_str());
  } else {
    ++g_failed;
    std::printf("FAIL %s: %d mismatches; first: %s\n", name, mismatches, first.c_str());
  }
}
std::string fmt(const char* f, double a, double b) {
  char buf[160];
  std::snprintf(buf, sizeof buf, f, a, b);
  return buf;
}
std::string hex2(const char* label_a, uint32_t a, const char* label_b, uint32_t b) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s 0x%08x %s 0x%08x", label_a, a, label_b, b);
  return buf;
}

void compare_mma(const Outputs& g, const Outputs& e, int dt) {
  int bad = 0;
  std::string first;
  for (int cs = 0; cs < kMmaCases; ++cs) {
    double scale = 0;
    for (int i = 0; i < 128; ++i) {
      double v = std::fabs(e.mma_d[dt][cs * 128 + i]);
      if (std::isfinite(v) && v > scale) scale = v;
    }
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        const float gv = g.mma_d[dt][(cs * 32 + lane) * 4 + i], ev = e.mma_d[dt][(cs * 32 + lane) * 4 + i];
        bool ok;
        if (std::isnan(gv) || std::isnan(ev))
          ok = std::isnan(gv) && std::isnan(ev);
        else if (cs < 4 || std::isinf(gv) || std::isinf(ev))
          ok = gv == ev;
        else
          ok = std::fabs(static_cast<double>(gv) - ev) <= 0x1p-19 * scale;  // 16 ulps of the largest output
        if (!ok && bad++ == 0)
          first = "case " + std::to_string(cs) + " lane " + std::to_string(lane) + " d[" + std::to_string(i) +
                  "]: " + fmt("gpu %.9g emu %.9g", gv, ev);
      }
  }
  verdict(dt ? "mma_m16n8k16_bf16" : "mma_m16n8k16_f16", bad, first);
}

void compare_ldmatrix(const Outputs& g, const Outputs& e) {
  const char* names[4] = {"ldmatrix_x4", "ldmatrix_x4_trans", "ldmatrix_x2", "ldmatrix_x2_trans"};
  for (int v = 0; v < 4; ++v) {
    int bad = 0;
    std::string first;
    for (int i = 0; i < 128; ++i)
      if (g.ld[v][i] != e.ld[v][i] && bad++ == 0)
        first = "lane " + std::to_string(i / 4) + " r[" + std::to_string(i % 4) +
                "]: " + hex2("gpu", g.ld[v][i], "emu", e.ld[v][i]);
    verdict(names[v], bad, first);
  }
}

void compare_bytes(const char* name, const std::vector<uint8_t>& g, const std::vector<uint8_t>& e) {
  int bad = 0;
  std::string first;
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i] != e[i] && bad++ == 0) first = "byte " + std::to_string(i) + fmt(": gpu %.0f emu %.0f", g[i], e[i]);
  verdict(name, bad, first);
}

int ulp_distance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if (ia < 0) ia = static_cast<int32_t>(0x80000000u - static_cast<uint32_t>(ia));
  if (ib < 0) ib = static_cast<int32_t>(0x80000000u - static_cast<uint32_t>(ib));
  int64_t d = static_cast<int64_t>(ia) - ib;
  return static_cast<int>(d < 0 ? (-d > 1000000 ? 1000000 : -d) : (d > 1000000 ? 1000000 : d));
}

// ex2.approx.ftz.f32: the error of y = 2^x in ulps of the correctly rounded result (0 when
// exact), or a large number when y is off; results below 2^-126 may be flushed to zero.
double ex2_error_ulps(float x, float y) {
  if (std::isnan(x)) return std::isnan(y) ? 0 : 1e9;
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;  // ftz input
  const double exact = std::exp2(static_cast<double>(x));
  const float rounded = static_cast<float>(exact);
  // Flushed: a result within 2 ulp of the correctly rounded one may lie below 2^-126.
  if (y == 0.0f && exact < 0x1p-126 * (1 + 0x1p-22)) return 0;
  if (exact < 0x1p-126) return (y >= 0.0f && y <= 0x1p-126f) ? 0 : 1e9;
  if (std::isinf(rounded) || std::isinf(y)) return (y == rounded || exact >= 0x1.fffffcp127) ? 0 : 1e9;
  return std::isnan(y) ? 1e9 : ulp_distance(y, rounded);
}

// tanh.approx.f32: |y - tanh(x)| / (2^-11 |tanh(x)|), the error in units of the documented bound,
// less the float rounding of the result (2^-24 relative) and a subnormal floor (2^-126).
double tanh_error_bounds(float x, float y) {
  if (std::isnan(x)) return std::isnan(y) ? 0 : 1e9;
  if (std::isnan(y)) return 1e9;
  const double exact = std::tanh(static_cast<double>(x));
  const double err = std::fabs(static_cast<double>(y) - exact) - 0x1p-24 * std::fabs(exact) - 0x1p-126;
  return err <= 0 ? 0 : err / (0x1p-11 * std::fabs(exact));
}

// Each side against the exact result and the bound; the emulation (libm's result moved by the
// bound) may add libm's own error, and so may the first side when the host driver emulates it.
void compare_approx(const char* name, const char* unit, const std::vector<float>& x, const std::vector<float>& g,
                    const std::vector<float>& e, double (*error)(float, float), double gpu_bound, double emu_bound) {
#ifdef JAX_FLASH_EMULATE
  const double bound = emu_bound;
  (void)gpu_bound;
#else
  const double bound = gpu_bound;
#endif
  int bad = 0;
  std::string first;
  double worst_gpu = 0, worst_emu = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double eg = error(x[i], g[i]), ee = error(x[i], e[i]);
    worst_gpu = std::fmax(worst_gpu, eg), worst_emu = std::fmax(worst_emu, ee);
    if ((eg > bound || ee > emu_bound) && bad++ == 0)
      first = fmt("x = %.9g: ", x[i], 0) + fmt("gpu %.9g emu %.9g", g[i], e[i]) +
              fmt(" (errors %.3g and %.3g ", eg, ee) + unit + fmt("; bounds %g and %g)", bound, emu_bound);
  }
  verdict(name, bad, first,
          fmt(" (largest error: gpu %.3g, emulation %.3g ", worst_gpu, worst_emu) + unit +
              fmt("; bounds %g and %g)", bound, emu_bound));
}

void compare_scalars(const Inputs& in, const Outputs& g, const Outputs& e) {
  compare_approx("ex2_approx", "ulp", in.ex2_in, g.ex2, e.ex2, ex2_error_ulps, 2, 3);
  compare_approx("tanh_approx", "x 2^-11 relative", in.tanh_in, g.tanh, e.tanh, tanh_error_bounds, 1, 1);
  for (int which = 0; which < 2; ++which) {
    const auto& gv = which ? g.cvt_f16 : g.cvt_bf16;
    const auto& ev = which ? e.cvt_f16 : e.cvt_bf16;
    int bad = 0;
    std::string first;
    for (int i = 0; i < 32 * kPerLane; ++i)
      if (gv[i] != ev[i] && bad++ == 0)
        first = fmt("lo %.9g hi %.9g: ", in.cvt_lo[i], in.cvt_hi[i]) + hex2("gpu", gv[i], "emu", ev[i]);
    verdict(which ? "cvt_pack_f16x2" : "cvt_pack_bf16x2", bad, first);
  }
  {
    int bad = 0;
    std::string first;
    for (int h = 0; h < 65536; ++h) {
      const float gv = g.cvt_f32_f16[h], ev = e.cvt_f32_f16[h];
      bool ok = (std::isnan(gv) && std::isnan(ev)) || fbits(gv) == fbits(ev);
      if (!ok && bad++ == 0)
        first = hex2("f16", static_cast<uint32_t>(h), "->", 0) + hex2(": gpu", fbits(gv), "emu", fbits(ev));
    }
    verdict("cvt_f32_f16", bad, first);
  }
  {
    int bad = 0;
    std::string first;
    for (int i = 0; i < 32 * 6; ++i)
      if (fbits(g.shfl[i]) != fbits(e.shfl[i]) && bad++ == 0)
        first = "lane " + std::to_string(i / 6) + " value " + std::to_string(i % 6) +
                fmt(": gpu %.9g emu %.9g", g.shfl[i], e.shfl[i]);
    verdict("__shfl_xor_sync/__shfl_sync", bad, first);
  }
}

void compare_memory(const Outputs& g, const Outputs& e) {
  auto words = [](const std::vector<float>& v) {
    std::vector<uint32_t> w(v.size());
    for (size_t i = 0; i < v.size(); ++i) w[i] = fbits(v[i]);
    return w;
  };
  auto exact = [](const char* name, const std::vector<uint32_t>& gv, const std::vector<uint32_t>& ev) {
    int bad = 0;
    std::string first;
    for (size_t i = 0; i < gv.size(); ++i)
      if (gv[i] != ev[i] && bad++ == 0) first = "word " + std::to_string(i) + ": " + hex2("gpu", gv[i], "emu", ev[i]);
    verdict(name, bad, first);
  };
  exact("ld_global_f32, st_shared_f32, ld_shared_f32, st_global_f32", words(g.mem_f32), words(e.mem_f32));
  exact(
      "ld_global_v4_b32, st_shared_b32, ld_shared_v4_b32, st_global_v4_b32, st_global_b32, ld_global_b16, "
      "ld_global_u8, ld_global_b32, mov_b32_volatile",
      g.mem_b32, e.mem_b32);
  exact("red_global_add_f32, red_global_add_v2_f32", words(g.mem_acc), words(e.mem_acc));
}

// JAX_FLASH_SELFTEST_PERTURB=1 (host driver): one element of every output of the first side
// changed, so that every comparison must fail.
void perturb(Outputs* o) {
  auto flip = [](float& f, int bit) { f = bitsf(fbits(f) ^ (1u << bit)); };
  flip(o->mma_d[0][0], 22), flip(o->mma_d[1][0], 22);  // case 0 is integer-valued: compared exactly
  for (auto& v : o->ld) v[0] ^= 1;
  o->cp[0] ^= 1;
  flip(o->ex2[0], 20), flip(o->tanh[0], 20);  // 2^0 = 1 and tanh(0.5): far outside the bounds
  o->cvt_bf16[0] ^= 1, o->cvt_f16[0] ^= 1;
  flip(o->cvt_f32_f16[0], 20), flip(o->shfl[0], 0);
  flip(o->mem_f32[0], 0), o->mem_b32[0] ^= 1, flip(o->mem_acc[0], 0);
}

}  // namespace
}  // namespace selftest

int main() {
  using namespace selftest;
#ifdef JAX_FLASH_EMULATE
  const char* p = std::getenv("JAX_FLASH_SELFTEST_PERTURB");
  const bool perturbed = p != nullptr && std::string(p) == "1";
  std::printf("host driver: both sides emulated%s\n", perturbed ? ", one side perturbed: every check must fail" : "");
#else
  const bool perturbed = false;
  int count = 0;
  cudaDeviceProp prop;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("NO DEVICE: no usable CUDA device\n");
    return 2;
  }
  if (prop.major < 8) {
    std::printf("NO DEVICE: %s is sm_%d%d; the wrappers need sm_80 or newer\n", prop.name, prop.major, prop.minor);
    return 2;
  }
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
#endif
  const Inputs in = make_inputs();
  Outputs gpu, emu;
  std::string err = gpu_side::run_all(in, &gpu);
  if (!err.empty()) {
    std::printf("FAIL gpu run: %s\n", err.c_str());
    return 1;
  }
  if (perturbed) perturb(&gpu);
  err = emu_side::run_all(in, &emu);
  if (!err.empty()) {
    std::printf("FAIL emulated run: %s\n", err.c_str());
    return 1;
  }
  compare_mma(gpu, emu, 0);
  compare_mma(gpu, emu, 1);
  compare_ldmatrix(gpu, emu);
  compare_bytes("cp_async_16 + commit_group + wait_group", gpu.cp, emu.cp);
  compare_scalars(in, gpu, emu);
  compare_memory(gpu, emu);
  if (perturbed) {
    const bool all = g_failed == g_verdicts;
    std::printf("%s: %d of %d checks failed on the perturbed outputs\n", all ? "PASS" : "FAIL", g_failed, g_verdicts);
    return all ? 0 : 1;
  }
  std::printf("%s: %d of %d checks differ between the GPU and the emulation\n", g_failed ? "FAIL" : "PASS", g_failed,
              g_verdicts);
  return g_failed ? 1 : 0;
}
#endif

// Host emulation of the CUDA SIMT model, for compiling the kernels in cuda/kernels/ with a
// host compiler (JAX_FLASH_EMULATE defined) and running them exactly as the hardware would
// schedule them: one fiber per CUDA thread, warps that meet at every collective, a block
// barrier, and dynamic shared memory per block.
//
// The emulation is strict on purpose: it reports what a GPU would punish
// with garbage or a hang instead of tolerating it.
//   - Dynamic shared memory starts poisoned (every byte 0xFF: NaN as f16, bf16 and f32) for
//     every block, and is surrounded by red zones checked after the block finishes.
//   - A warp collective (shfl, vote, mma, ldmatrix, __syncwarp) where a lane of its mask has
//     exited, or waits at another collective or at __syncthreads, is an error.
//   - A __syncthreads that not every thread of the block reaches (some exited) is an error.
//   - cp.async lands only when a wait_group covering its group runs in the issuing thread
//     (see ptx_emu.h); reading bytes with a copy still in flight, and a store to a copy's
//     destination while it is in flight, are errors; shared-memory accesses outside the
//     dynamic allocation are errors.
//   - Races in shared memory: every access through the PTX wrappers is checked, per byte,
//     against the other threads' accesses since the last __syncthreads (or __syncwarp, within
//     a warp); an unordered read-after-write, write-after-read or write-after-write is an error
//     naming both threads, the offset and both source lines (simt.cc, smem_access).
//   - Global memory: accesses through the wrappers must stay inside the buffers the host code
//     declared (GlobalBufferScope), and CTAs of a launch must not store to (or read) bytes
//     another CTA stores to, except with atomics.
// Errors never abort the process: the first one (with block, thread and what) stops the
// launch and is returned by emu::launch.
//
// Usage (host side):
//   jax_flash::emu::Status st = jax_flash::emu::launch(grid, block, smem_bytes, my_kernel<...>, params);
//   if (!st.ok()) return ffi::Error::Internal(st.error);
// Kernels take dynamic shared memory with JAX_FLASH_DYNAMIC_SMEM(name) inside the kernel body.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu/fp16.h"

// ---- CUDA declaration specifiers: nothing on the host --------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Static __shared__ variables are not emulated: the kernels use only dynamic shared memory.
#define __shared__ JAX_FLASH_EMU_static_shared_is_not_emulated_use_JAX_FLASH_DYNAMIC_SMEM
// (__restrict__ is already a GNU C++ keyword.)

// The block's dynamic shared memory as `char* name` (128-byte aligned). Use inside the kernel
// body; under nvcc the kernels define it as `extern __shared__ __align__(128) char name[]`.
#define JAX_FLASH_DYNAMIC_SMEM(name) [[maybe_unused]] char* const name = ::jax_flash::emu::dynamic_smem()

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

namespace jax_flash {
namespace emu {

// Result of a launch: ok() or the first error (block, thread, what happened).
struct Status {
  std::string error;
  bool ok() const { return error.empty(); }
};

// The order in which runnable threads are resumed. Every order is a legal schedule; running a
// kernel under several exposes missing __syncthreads (a reader running before its writer).
enum class Schedule {
  kForward,  // thread 0, 1, 2, ... (default; JAX_FLASH_EMU_SCHEDULE=forward)
  kReverse,  // the last thread first (JAX_FLASH_EMU_SCHEDULE=reverse)
  kShuffle,  // a seeded random choice of the next thread, also at cp.async commit/wait
             // (JAX_FLASH_EMU_SCHEDULE=shuffle[:seed])
};

struct LaunchOptions {
  Schedule schedule = Schedule::kForward;
  uint64_t seed = 1;                     // for kShuffle
  const char* kernel = nullptr;          // the kernel's name, for error messages
  size_t stack_bytes = 256 * 1024;       // per thread (fiber)
  size_t max_dynamic_smem = 227 * 1024;  // the largest opt-in of any supported arch
  // Read JAX_FLASH_EMU_SCHEDULE / JAX_FLASH_EMU_STACK_KB from the environment.
  static LaunchOptions FromEnvironment();
};

// A global-memory buffer a launch may touch: [ptr, ptr + bytes), named for error messages;
// a store or atomic into a buffer that is not writable is an error.
struct GlobalBuffer {
  const void* ptr;
  size_t bytes;
  std::string name;
  bool writable;
};

// While alive, the kernels launched from this host thread may access global memory only
// inside these buffers: every access through the PTX wrappers (ld/st.global, red.global,
// cp.async sources) outside all of them is an error instead of a silent read or write of
// neighbouring host memory. Scopes nest; with none, global accesses are not checked.
//   emu::GlobalBufferScope scope({{q, q_bytes}, {k, k_bytes}, {v, v_bytes}});  // writable, unnamed
//   emu::GlobalBufferScope scope(std::vector<emu::GlobalBuffer>{{q, q_bytes, "q", false}, ...});
// Within one launch, the checked accesses are also checked between CTAs (which the GPU does not
// order): two CTAs storing to the same byte, a CTA reading a byte another CTA stored or added
// to, or a plain store mixed with atomics of another CTA, are errors. Atomics (red/atom) of
// several CTAs on the same bytes are fine.
class GlobalBufferScope {
 public:
  GlobalBufferScope(std::initializer_list<std::pair<const void*, size_t>> buffers);
  explicit GlobalBufferScope(std::vector<GlobalBuffer> buffers);
  ~GlobalBufferScope();
  GlobalBufferScope(const GlobalBufferScope&) = delete;
  GlobalBufferScope& operator=(const GlobalBufferScope&) = delete;

 private:
  std::vector<GlobalBuffer> saved_;
};

// Tagged global pointers: a pointer with tag_global() applied still supports pointer arithmetic
// and is accepted by every global-memory wrapper of ptx_emu.h (which strips the tag), but a plain
// C++ load or store through it faults (the tag makes the address non-canonical). The emulation
// turns that fault, inside a kernel, into the launch's error ("a plain access of global
// memory"), so kernels cannot bypass the wrappers unseen. Host code must not dereference a
// tagged pointer; untag_global() gives the plain one back.
constexpr uintptr_t kGlobalTag = uintptr_t{0x5a} << 48;  // bits 48..55: not ignored by arm64's TBI
constexpr uintptr_t kGlobalTagMask = uintptr_t{0xff} << 48;
template <class T>
inline T* tag_global(T* p) {
  return p == nullptr ? p : reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) | kGlobalTag);
}
template <class T>
inline T* untag_global(T* p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  return (u & kGlobalTagMask) == kGlobalTag ? reinterpret_cast<T*>(u & ~kGlobalTagMask) : p;
}

// The block's dynamic shared memory (what JAX_FLASH_DYNAMIC_SMEM gives the kernel).
char* dynamic_smem();
size_t dynamic_smem_size();

namespace detail {

// The per-thread view a kernel reads through threadIdx/blockIdx/blockDim/gridDim.
struct ThreadView {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
// The running CUDA thread, or nullptr outside a launch.
inline thread_local const ThreadView* tls_view = nullptr;
[[noreturn]] void outside_launch(const char* what);  // throws std::logic_error
inline const ThreadView& current_view() {
  if (tls_view == nullptr) outside_launch("threadIdx/blockIdx/blockDim/gridDim");
  return *tls_view;
}

// A launch handed to the runtime: run(ctx) is called once per CUDA thread, in its fiber.
struct LaunchSpec {
  dim3 grid, block;
  size_t smem_bytes;
  void (*run)(void* ctx);
  void* ctx;
};
Status run_launch(const LaunchSpec& spec, const LaunchOptions& options);

// ---- warp collectives ----
// A kind of collective: every lane of the mask must reach the same kind with the same mask.
// compute() runs once, when the last lane of the mask arrives, with every lane's input
// (in[lane], in_size bytes, valid for lanes in mask) and writes every lane's output
// (out[lane], out_size bytes). It returns an empty string or an error message.
struct CollectiveKind {
  const char* name;
  std::string (*compute)(uint32_t mask, const void* const* in, void* const* out, void* arg);
};
// Called by one lane: deposits `in`, waits for the other lanes of `mask`, receives `out`.
// `arg` is passed to compute from the lane that completes the collective (must agree).
// A full-warp .aligned instruction (mma, ldmatrix) passes mask 0xffffffff.
void warp_collective(const CollectiveKind& kind, uint32_t mask, const void* in, void* out, void* arg = nullptr);

enum class ShflMode : int { kIdx = 0, kUp = 1, kDown = 2, kXor = 3 };
uint64_t shfl(ShflMode mode, uint32_t mask, uint64_t value, int lane_arg, int width);
uint32_t vote(int op, uint32_t mask, bool predicate);  // 0: ballot, 1: any, 2: all

// ---- memory checks (used by the emulated PTX instructions, ptx_emu.cc) ----
enum class MemOp { kRead, kWrite, kAtomic };
// A global-memory access of the running thread: inside a declared buffer (GlobalBufferScope),
// writable for kWrite/kAtomic, and no conflict with another CTA of the launch. Fails the
// launch (does not return) otherwise. `what` names the instruction; file:line the call site.
void check_global(const void* p, size_t bytes, MemOp op, const char* what, const char* file, int line);
// A shared-memory access by lane `lane` of the running thread's warp (-1: the running thread
// itself), for the race detector (simt.cc): returns an error message, empty when the access is
// ordered after every conflicting access of another thread. `p` must be inside the block's
// dynamic shared memory (smem_range_ok).
std::string smem_access(int lane, const void* p, size_t bytes, MemOp op, const char* what, const char* file, int line);

// ---- block barrier, errors ----
void syncthreads();
void syncwarp(uint32_t mask);
// Records `message` (prefixed with block/thread) as the launch's error and stops the launch
// (by unwinding the calling kernel thread); outside a launch it throws std::runtime_error.
[[noreturn]] void fail(const std::string& message);
// "block (x,y,z) thread (x,y,z)" of the running thread.
std::string where();

template <class T>
inline uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shfl of a type wider than 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

template <class Kernel, class Tuple>
struct LaunchContext {
  Kernel kernel;
  Tuple args;
  static void run(void* ctx) {
    auto* self = static_cast<LaunchContext*>(ctx);
    Tuple copy = self->args;  // each CUDA thread gets its own copy of the parameters
    std::apply(self->kernel, copy);
  }
};

}  // namespace detail

// Runs every block of the grid (one after another), each with one fiber per CUDA thread.
// Returns the first error instead of aborting; the kernel's global-memory effects up to the
// error remain.
template <class Kernel, class... Args>
Status launch_with(const LaunchOptions& options, dim3 grid, dim3 block, size_t smem_bytes, Kernel kernel,
                   Args... args) {
  using Tuple = std::tuple<Args...>;
  detail::LaunchContext<Kernel, Tuple> ctx{kernel, Tuple(args...)};
  detail::LaunchSpec spec{grid, block, smem_bytes, &detail::LaunchContext<Kernel, Tuple>::run, &ctx};
  return detail::run_launch(spec, options);
}
template <class Kernel, class... Args>
Status launch(dim3 grid, dim3 block, size_t smem_bytes, Kernel kernel, Args... args) {
  return launch_with(LaunchOptions::FromEnvironment(), grid, block, smem_bytes, kernel, args...);
}

// A debug count of the tiles the kernels compute (kernels/block_mask.h count_tile), per pass
// (0 forward, 1 backward, 2 the backward's dQ kernel), kept while counting is on
// (jax_flash.cuda.count_tiles): tests that the work follows a block mask.
constexpr int kTilePasses = 7;
void count_tile(int pass);
void set_tile_counting(bool on);
int64_t tile_count(int pass);

}  // namespace emu
}  // namespace jax_flash

// ---- built-in variables ---------------------------------------------------------------------
#define threadIdx (::jax_flash::emu::detail::current_view().thread_idx)
#define blockIdx (::jax_flash::emu::detail::current_view().block_idx)
#define blockDim (::jax_flash::emu::detail::current_view().block_dim)
#define gridDim (::jax_flash::emu::detail::current_view().grid_dim)
constexpr int warpSize = 32;

// ---- synchronisation and warp intrinsics ------------------------------------------------------
inline void __syncthreads() { ::jax_flash::emu::detail::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::jax_flash::emu::detail::syncwarp(mask); }
inline void __threadfence_block() {}
inline void __threadfence() {}
[[noreturn]] inline void __trap() { ::jax_flash::emu::detail::fail("__trap()"); }

template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  using namespace ::jax_flash::emu::detail;
  return from_bits<T>(shfl(ShflMode::kIdx, mask, to_bits(var), src_lane, width));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = 32) {
  using namespace ::jax_flash::emu::detail;
  return from_bits<T>(shfl(ShflMode::kUp, mask, to_bits(var), static_cast<int>(delta), width));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = 32) {
  using namespace ::jax_flash::emu::detail;
  return from_bits<T>(shfl(ShflMode::kDown, mask, to_bits(var), static_cast<int>(delta), width));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  using namespace ::jax_flash::emu::detail;
  return from_bits<T>(shfl(ShflMode::kXor, mask, to_bits(var), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return ::jax_flash::emu::detail::vote(0, mask, predicate != 0);
}
inline int __any_sync(unsigned mask, int predicate) {
  return static_cast<int>(::jax_flash::emu::detail::vote(1, mask, predicate != 0));
}
inline int __all_sync(unsigned mask, int predicate) {
  return static_cast<int>(::jax_flash::emu::detail::vote(2, mask, predicate != 0));
}

// ---- atomics: the blocks and threads of a launch run on one host thread, one at a time; ------
// global ones are recorded as atomic accesses (GlobalBufferScope's conflict check between CTAs).
namespace jax_flash {
namespace emu {
namespace detail {
template <class T>
inline T* atomic_access(T* address) {
  address = untag_global(address);
  check_global(address, sizeof(T), MemOp::kAtomic, "atomic", __FILE__, __LINE__);
  return address;
}
}  // namespace detail
}  // namespace emu
}  // namespace jax_flash
inline float atomicAdd(float* address, float val) {
  address = ::jax_flash::emu::detail::atomic_access(address);
  float old = *address;
  *address = old + val;
  return old;
}
inline double atomicAdd(double* address, double val) {
  address = ::jax_flash::emu::detail::atomic_access(address);
  double old = *address;
  *address = old + val;
  return old;
}
inline int atomicAdd(int* address, int val) {
  address = ::jax_flash::emu::detail::atomic_access(address);
  int old = *address;
  *address = old + val;
  return old;
}
inline unsigned int atomicAdd(unsigned int* address, unsigned int val) {
  address = ::jax_flash::emu::detail::atomic_access(address);
  unsigned int old = *address;
  *address = old + val;
  return old;
}
inline int atomicMax(int* address, int val) {
  address = ::jax_flash::emu::detail::atomic_access(address);
  int old = *address;
  *address = old > val ? old : val;
  return old;
}
inline int atomicMin(int* address, int val) {
  address = ::jax_flash::emu::detail::atomic_access(address);
  int old = *address;
  *address = old < val ? old : val;
  return old;
}
inline int atomicCAS(int* address, int compare, int val) {
  address = ::jax_flash::emu::detail::atomic_access(address);
  int old = *address;
  if (old == compare) *address = val;
  return old;
}
inline int atomicExch(int* address, int val) {
  address = ::jax_flash::emu::detail::atomic_access(address);
  int old = *address;
  *address = val;
  return old;
}

// ---- math intrinsics: the host's correctly rounded functions --------------------------------
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return std::fma(x, y, z); }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, 4);
  return i;
}
inline float __uint_as_float(unsigned int x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline unsigned int __float_as_uint(float x) {
  unsigned int i;
  std::memcpy(&i, &x, 4);
  return i;
}
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
// CUDA's device overloads of min/max.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
// exp2f, fmaxf, fminf, fmaf, tanhf, log2f, ... are the C library's.

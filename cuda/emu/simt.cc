// The runtime behind simt.h: fibers (one per CUDA thread), the scheduler, warp collectives,
// the block barrier and dynamic shared memory with poison and red zones.
//
// Scheduling: the threads of a block run one at a time on the calling host thread. A thread
// runs until it blocks (at a warp collective whose other lanes have not arrived yet, or at
// __syncthreads) or exits; it then hands the host thread directly to the next runnable thread.
// The lane that completes a collective computes its result for every lane and keeps running.
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS declares the ucontext functions only for XSI
#endif
#include "emu/simt.h"

#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) && !defined(JAX_FLASH_EMU_UCONTEXT)
#define JAX_FLASH_EMU_ASM_SWITCH 1
#include <xmmintrin.h>
#else
#include <ucontext.h>
#endif

// AddressSanitizer must be told about every switch between stacks (it then also checks the
// kernels' global-memory accesses under emulation: build with -fsanitize=address).
#if defined(__SANITIZE_ADDRESS__)
#define JAX_FLASH_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define JAX_FLASH_EMU_ASAN 1
#endif
#endif
#if JAX_FLASH_EMU_ASAN
#include <pthread.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace jax_flash {
namespace emu {
namespace detail {

#if JAX_FLASH_EMU_ASM_SWITCH
// Host context switch (x86-64 System V): saves the callee-saved registers and the SSE/x87
// control words on the current stack, stores the stack pointer to *save_sp, and resumes the
// context whose stack pointer is load_sp. glibc's swapcontext would also do a sigprocmask
// system call per switch, which dominates the emulation's run time. A new fiber is entered by
// `ret` into fiber_main; where that is unwelcome (a host enforcing shadow stacks), define
// JAX_FLASH_EMU_UCONTEXT to use the portable switch (also used on every other architecture).
extern "C" void jax_flash_emu_switch(void** save_sp, void* load_sp);
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl jax_flash_emu_switch\n"
    ".hidden jax_flash_emu_switch\n"
    ".type jax_flash_emu_switch,@function\n"
    "jax_flash_emu_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size jax_flash_emu_switch, .-jax_flash_emu_switch\n");
#endif

namespace {

constexpr int kWarpSize = 32;
constexpr size_t kRedZone = 256;         // bytes on each side of the dynamic shared memory
constexpr unsigned char kPoison = 0xFF;  // NaN as f16, bf16 and f32
constexpr unsigned char kRedZoneByte = 0xA5;

enum class State { kRunnable, kCollective, kBarrier, kExited };

struct Context {
#if JAX_FLASH_EMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

struct PendingCopy {
  size_t smem_offset;
  unsigned char bytes[16];   // what lands
  unsigned char before[16];  // the destination when the copy was issued
  uint64_t group;
  uint16_t site;  // where it was issued
};

// The race detector's record of one byte of shared memory. Accesses are ordered by program
// order within a thread, by __syncthreads (the block's barrier epoch changes) and, between lanes
// of one warp, by __syncwarp (the warp's clocks below); nothing else orders them (not shuffles,
// ldmatrix or mma: PTX ISA memory consistency model, only barriers synchronize).
struct SmemByte {
  uint32_t w_epoch = 0, w_gen = 0;  // the last write: barrier epoch and writer warp's generation
  uint32_t r_epoch = 0, r_gen = 0;  // reads since that write, in epoch r_epoch: the latest generation
  uint32_t r_lanes = 0;             // ... the lanes of r_thread's warp that read
  uint16_t w_thread = 0;            // writer thread + 1 (0: never written)
  uint16_t r_thread = 0;            // a reader + 1
  uint16_t r_other = 0;             // a reader in another warp than r_thread's + 1 (0: none)
  uint16_t w_site = 0, r_site = 0, r_other_site = 0;
};

struct Fiber {
  ThreadView view;
  int index = 0, warp = 0, lane = 0;
  State state = State::kRunnable;
  Context ctx;
  char* stack = nullptr;  // lowest usable address
  size_t stack_bytes = 0;
  std::vector<PendingCopy> copies;  // cp.async copies not yet landed, in issue order
  uint64_t committed_groups = 0;    // cp.async groups committed so far; the open group's index
  sigjmp_buf fault;                 // where a memory fault in the kernel code lands (fiber_main)
};

struct Warp {
  // Vector clocks of the lanes for __syncwarp: gen counts the warp's completed __syncwarps;
  // vc[l][m] > g when an access of lane m at generation g is ordered before lane l's present.
  uint32_t gen = 0;
  uint32_t vc[kWarpSize][kWarpSize] = {};
  uint32_t exists = 0;                   // lanes that exist (a block may end in a partial warp)
  uint32_t exited = 0;                   // lanes that have returned from the kernel
  uint32_t at_barrier = 0;               // lanes waiting at __syncthreads
  const CollectiveKind* kind = nullptr;  // the collective some lanes wait at, or nullptr
  uint32_t mask = 0, arrived = 0;
  void* arg = nullptr;
  const void* in[kWarpSize] = {};
  void* out[kWarpSize] = {};
};

// Fiber stacks are reused across launches on the same host thread.
struct StackPool {
  struct Stack {
    char* base;    // mapping start (guard page)
    size_t total;  // mapping size
  };
  std::vector<Stack> stacks;
  size_t stack_bytes = 0;
  size_t page = 4096;

  bool ensure(size_t count, size_t bytes) {
    page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    bytes = (bytes + page - 1) / page * page;
    if (bytes != stack_bytes) release();
    stack_bytes = bytes;
    while (stacks.size() < count) {
      size_t total = bytes + page;
      void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) return false;
      // A guard page below the stack turns an overflow into a fault instead of corruption.
      mprotect(p, page, PROT_NONE);
      stacks.push_back({static_cast<char*>(p), total});
    }
    return true;
  }
  void release() {
    for (auto& s : stacks) munmap(s.base, s.total);
    stacks.clear();
  }
  ~StackPool() { release(); }
};
thread_local StackPool tls_stacks;
// The race detector's shadow of shared memory, reused by the launches of this host thread;
// barrier epochs only grow, so the records of earlier blocks and launches are never current.
thread_local std::vector<SmemByte> tls_smem_shadow;
thread_local uint32_t tls_epoch = 0;

struct Runtime {
  LaunchSpec spec;
  LaunchOptions options;
  int nthreads = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned char> smem_storage;
  char* smem = nullptr;
  size_t smem_bytes = 0;
  std::vector<uint16_t> in_flight;  // per 16-byte granule of smem: cp.async copies not yet landed
  std::vector<int> queue;           // runnable fibers not currently running (ring buffer)
  size_t queue_head = 0, queue_size = 0;
  int at_barrier = 0;
  int exited = 0;
  Fiber* current = nullptr;
  Context scheduler;
  const void* scheduler_stack = nullptr;  // the host thread's stack (for AddressSanitizer)
  size_t scheduler_stack_bytes = 0;
  std::string error;
  bool aborted = false;
  uint64_t rng = 1;
  uint3 block_idx{0, 0, 0};
  uint32_t block_linear = 0;  // blockIdx as one number, for the global conflict check
  SmemByte* shadow = nullptr;   // per byte of smem (tls_smem_shadow)
  uint32_t epoch = 0;           // the block's barrier epoch (a new one per block and __syncthreads)
  // Source sites (instruction, file, line) of the recorded accesses, by index (0: unknown).
  struct Site {
    const char* what;
    const char* file;
    int line;
  };
  std::vector<Site> sites{{nullptr, nullptr, 0}};
  // Global buffers of the launch (GlobalBufferScope) and, per writable one, who wrote each byte
  // in this launch: (CTA + 1) << 1 | atomic, allocated at the first store.
  std::vector<GlobalBuffer> buffers;
  std::vector<std::vector<uint32_t>> global_writers;

  uint64_t next_random() {  // splitmix64
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  void push(int i) {
    queue[(queue_head + queue_size) % queue.size()] = i;
    ++queue_size;
  }
  int pop() {
    if (queue_size == 0) return -1;
    if (options.schedule == Schedule::kShuffle && queue_size > 1) {
      size_t k = next_random() % queue_size;
      std::swap(queue[queue_head], queue[(queue_head + k) % queue.size()]);
    }
    int i = queue[queue_head];
    queue_head = (queue_head + 1) % queue.size();
    --queue_size;
    return i;
  }
};
thread_local Runtime* tls_runtime = nullptr;
// Declared by GlobalBufferScope: where cp.async may read from (empty: anywhere).
thread_local std::vector<GlobalBuffer> tls_global_buffers;

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}
std::string lanes_of(uint32_t mask) {
  std::string s;
  for (int l = 0; l < kWarpSize; ++l)
    if (mask & (1u << l)) s += (s.empty() ? "" : ",") + std::to_string(l);
  return "{" + s + "}";
}
std::string dim_str(uint3 v) {
  return "(" + std::to_string(v.x) + "," + std::to_string(v.y) + "," + std::to_string(v.z) + ")";
}
std::string thread_str(const Runtime& rt, const Fiber& f) {
  return "block " + dim_str(rt.block_idx) + " thread " + dim_str(f.view.thread_idx) + " (warp " +
         std::to_string(f.warp) + " lane " + std::to_string(f.lane) + ")";
}

Runtime& runtime(const char* what) {
  if (tls_runtime == nullptr || tls_runtime->current == nullptr) outside_launch(what);
  return *tls_runtime;
}

// AddressSanitizer bookkeeping around a stack switch (no-ops otherwise).
inline void before_switch(void** fake_stack, const void* stack, size_t bytes) {
#if JAX_FLASH_EMU_ASAN
  __sanitizer_start_switch_fiber(fake_stack, stack, bytes);
#else
  (void)fake_stack, (void)stack, (void)bytes;
#endif
}
inline void after_switch(void* fake_stack) {
#if JAX_FLASH_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  (void)fake_stack;
#endif
}

// Hands the host thread from `self` (which is blocked or exited) to the next runnable thread,
// or back to the scheduler when there is none. Returns when `self` is resumed.
void switch_away(Runtime& rt, Fiber* self) {
  int next = rt.aborted ? -1 : rt.pop();
  Fiber* to = next >= 0 ? &rt.fibers[next] : nullptr;
  if (to == self) return;  // a yield that picked the yielding thread again
  rt.current = to;
  tls_view = to ? &to->view : nullptr;
  void* fake_stack = nullptr;
  before_switch(self->state == State::kExited ? nullptr : &fake_stack, to ? to->stack : rt.scheduler_stack,
                to ? to->stack_bytes : rt.scheduler_stack_bytes);
#if JAX_FLASH_EMU_ASM_SWITCH
  jax_flash_emu_switch(&self->ctx.sp, to ? to->ctx.sp : rt.scheduler.sp);
#else
  swapcontext(&self->ctx.uc, to ? &to->ctx.uc : &rt.scheduler.uc);
#endif
  after_switch(fake_stack);
}

// Under Schedule::kShuffle the asynchronous-copy instructions are also points where another
// thread may run, so that more interleavings between barriers get exercised.
void maybe_yield(Runtime& rt) {
  if (rt.options.schedule != Schedule::kShuffle) return;
  Fiber* f = rt.current;
  rt.push(f->index);
  switch_away(rt, f);
}

void wake(Runtime& rt, Fiber& f) {
  f.state = State::kRunnable;
  rt.push(f.index);
}

void on_exit(Runtime& rt, Fiber& f) {
  Warp& w = rt.warps[f.warp];
  uint32_t bit = 1u << f.lane;
  if (w.kind != nullptr && (w.mask & bit))
    fail(std::string("exited while lanes ") + lanes_of(w.arrived) + " of its warp wait for it at " + w.kind->name +
         " (mask " + hex(w.mask) + ")");
  if (rt.at_barrier > 0)
    fail("exited while " + std::to_string(rt.at_barrier) +
         " threads of the block wait at __syncthreads (a barrier not every thread reaches)");
  w.exited |= bit;
  ++rt.exited;
  f.state = State::kExited;
  // Copies never waited for: nothing can observe them any more (they no longer count as in
  // flight for ldmatrix's check either).
  for (const PendingCopy& c : f.copies) --rt.in_flight[c.smem_offset / 16];
  f.copies.clear();
}

// Thrown by fail() in a kernel thread, so that its frames unwind; caught in fiber_main.
struct KernelAbort {};

std::string kernel_prefix(const Runtime& rt) {
  return rt.options.kernel != nullptr ? std::string(rt.options.kernel) + ": " : std::string();
}

void record_error(Runtime& rt, const std::string& message) {
  if (rt.error.empty()) rt.error = kernel_prefix(rt) + thread_str(rt, *rt.current) + ": " + message;
  rt.aborted = true;
}

[[noreturn]] void fiber_main() {
  after_switch(nullptr);
  Runtime& rt = *tls_runtime;
  Fiber* self = rt.current;
  if (sigsetjmp(self->fault, 0) != 0) {
    // on_fault jumped here: the kernel's frames are abandoned (kernels hold no resources).
    record_error(rt,
                 "memory fault in the kernel: a plain C++ load or store of global memory (the kernels "
                 "access it only through the PTX wrappers of kernels/ptx.h: ld/st.global, red.global, "
                 "cp.async), or a wild pointer");
    self->state = State::kExited;
    switch_away(rt, self);
    std::abort();
  }
  try {
    rt.spec.run(rt.spec.ctx);
    on_exit(rt, *self);
  } catch (const KernelAbort&) {
    // the error is recorded; the launch stops
  } catch (const std::exception& e) {
    record_error(rt, std::string("exception in kernel: ") + e.what());
  } catch (...) {
    record_error(rt, "exception in kernel");
  }
  self->state = State::kExited;
  switch_away(rt, self);
  std::abort();  // an exited fiber is never resumed
}

#if !JAX_FLASH_EMU_ASM_SWITCH
void fiber_main_uc() { fiber_main(); }
#endif

// SIGSEGV/SIGBUS in a kernel thread (a plain access through a tagged global pointer, see
// tag_global): back to that thread's fiber_main, which records the error. Elsewhere the signal
// goes to the handler that was installed before (or the default action).
struct sigaction g_previous[2];
std::mutex g_signal_mutex;

void on_fault(int sig, siginfo_t* info, void* context) {
  Runtime* rt = tls_runtime;
  if (rt != nullptr && rt->current != nullptr) siglongjmp(rt->current->fault, 1);
  const struct sigaction& prev = g_previous[sig == SIGSEGV ? 0 : 1];
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction != nullptr) prev.sa_sigaction(sig, info, context);
    return;
  }
  if (prev.sa_handler == SIG_IGN) return;
  if (prev.sa_handler == SIG_DFL || prev.sa_handler == nullptr) {
    sigaction(sig, &prev, nullptr);  // the faulting instruction runs again, with the default action
    return;
  }
  prev.sa_handler(sig);
}

// Installs on_fault for SIGSEGV and SIGBUS unless it is already the handler (called at each
// launch: a library may have installed its own since).
void install_fault_handler() {
  std::lock_guard<std::mutex> lock(g_signal_mutex);
  const int sigs[2] = {SIGSEGV, SIGBUS};
  for (int i = 0; i < 2; ++i) {
    struct sigaction cur;
    if (sigaction(sigs[i], nullptr, &cur) != 0) continue;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == &on_fault) continue;
    struct sigaction mine;
    std::memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = &on_fault;
    sigemptyset(&mine.sa_mask);
    // SA_NODEFER: the handler leaves by siglongjmp without restoring the signal mask.
    mine.sa_flags = SA_SIGINFO | SA_NODEFER;
    g_previous[i] = cur;
    sigaction(sigs[i], &mine, nullptr);
  }
}

void init_fiber_context(Runtime& rt, Fiber& f) {
#if JAX_FLASH_EMU_ASAN
  // The previous user of this stack may have been abandoned mid-frame (a finished block's
  // threads never unwind): forget its poisoned redzones.
  __asan_unpoison_memory_region(f.stack, f.stack_bytes);
#endif
#if JAX_FLASH_EMU_ASM_SWITCH
  // Initial frame consumed by jax_flash_emu_switch: control words, six callee-saved registers,
  // then the "return address" fiber_main, entered with rsp % 16 == 8 like any called function.
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + f.stack_bytes) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top - 72);
  uint32_t csr = _mm_getcsr();
  uint16_t fpcw = 0x037f;  // the x87 default
  std::memset(slot, 0, 72);
  std::memcpy(&slot[0], &csr, 4);
  std::memcpy(reinterpret_cast<char*>(&slot[0]) + 4, &fpcw, 2);
  slot[7] = reinterpret_cast<uint64_t>(&fiber_main);
  slot[8] = 0;
  f.ctx.sp = slot;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = f.stack;
  f.ctx.uc.uc_stack.ss_size = f.stack_bytes;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, fiber_main_uc, 0);
#endif
  (void)rt;
}

std::string describe_deadlock(const Runtime& rt) {
  std::string s = "deadlock in block " + dim_str(rt.block_idx) + ":";
  for (size_t wi = 0; wi < rt.warps.size(); ++wi) {
    const Warp& w = rt.warps[wi];
    if (w.kind != nullptr)
      s += " warp " + std::to_string(wi) + " lanes " + lanes_of(w.arrived) + " wait at " + w.kind->name +
           " for lanes " + lanes_of(w.mask & ~w.arrived) + ";";
    if (w.at_barrier)
      s += " warp " + std::to_string(wi) + " lanes " + lanes_of(w.at_barrier) + " wait at __syncthreads;";
  }
  return s;
}

bool run_block(Runtime& rt, uint3 block_idx) {
  rt.block_idx = block_idx;
  rt.block_linear = block_idx.x + rt.spec.grid.x * (block_idx.y + rt.spec.grid.y * block_idx.z);
  rt.epoch = ++tls_epoch;
  std::memset(rt.smem_storage.data(), kRedZoneByte, rt.smem_storage.size());
  std::memset(rt.smem, kPoison, rt.smem_bytes);
  std::fill(rt.in_flight.begin(), rt.in_flight.end(), 0);
  for (auto& w : rt.warps) {
    uint32_t exists = w.exists;
    w = Warp();
    w.exists = exists;
  }
  rt.at_barrier = 0;
  rt.exited = 0;
  rt.queue_head = rt.queue_size = 0;
  for (int i = 0; i < rt.nthreads; ++i) {
    Fiber& f = rt.fibers[i];
    f.view.block_idx = block_idx;
    f.state = State::kRunnable;
    f.copies.clear();
    f.committed_groups = 0;
    init_fiber_context(rt, f);
  }
  for (int i = 0; i < rt.nthreads; ++i) rt.push(rt.options.schedule == Schedule::kReverse ? rt.nthreads - 1 - i : i);

  while (!rt.aborted && rt.exited < rt.nthreads) {
    int next = rt.pop();
    if (next < 0) {
      rt.error = kernel_prefix(rt) + describe_deadlock(rt);
      rt.aborted = true;
      break;
    }
    Fiber& f = rt.fibers[next];
    rt.current = &f;
    tls_view = &f.view;
    void* fake_stack = nullptr;
    before_switch(&fake_stack, f.stack, f.stack_bytes);
#if JAX_FLASH_EMU_ASM_SWITCH
    jax_flash_emu_switch(&rt.scheduler.sp, f.ctx.sp);
#else
    swapcontext(&rt.scheduler.uc, &f.ctx.uc);
#endif
    after_switch(fake_stack);
    rt.current = nullptr;
    tls_view = nullptr;
  }
  if (rt.aborted) return false;

  // Red zones: a plain store outside the dynamic shared memory leaves a trace here.
  const unsigned char* lo = rt.smem_storage.data();
  const unsigned char* hi = reinterpret_cast<unsigned char*>(rt.smem) + rt.smem_bytes;
  const unsigned char* end = lo + rt.smem_storage.size();
  for (const unsigned char* p = lo; p < reinterpret_cast<unsigned char*>(rt.smem); ++p)
    if (*p != kRedZoneByte) {
      rt.error = kernel_prefix(rt) + "block " + dim_str(block_idx) + ": a store landed " +
                 std::to_string(reinterpret_cast<unsigned char*>(rt.smem) - p) +
                 " bytes before the start of dynamic shared memory";
      return false;
    }
  for (const unsigned char* p = hi; p < end; ++p)
    if (*p != kRedZoneByte) {
      rt.error = kernel_prefix(rt) + "block " + dim_str(block_idx) + ": a store landed at byte " +
                 std::to_string(p - reinterpret_cast<unsigned char*>(rt.smem)) +
                 " of dynamic shared memory, past its " + std::to_string(rt.smem_bytes) + " bytes";
      return false;
    }
  return true;
}

}  // namespace

void outside_launch(const char* what) {
  throw std::logic_error(std::string("jax_flash emulation: ") + what + " used outside a kernel launch");
}

std::string where() {
  Runtime* rt = tls_runtime;
  if (rt == nullptr || rt->current == nullptr) return "host";
  return thread_str(*rt, *rt->current);
}

void fail(const std::string& message) {
  Runtime* rt = tls_runtime;
  if (rt == nullptr || rt->current == nullptr) throw std::runtime_error("jax_flash emulation: " + message);
  record_error(*rt, message);
  throw KernelAbort{};  // unwinds this thread's frames to fiber_main, which ends the launch
}

void warp_collective(const CollectiveKind& kind, uint32_t mask, const void* in, void* out, void* arg) {
  Runtime& rt = runtime(kind.name);
  Fiber* f = rt.current;
  Warp& w = rt.warps[f->warp];
  const uint32_t bit = 1u << f->lane;
  if (!(mask & bit)) fail(std::string(kind.name) + ": the calling lane is not in the mask " + hex(mask));
  if (mask & ~w.exists)
    fail(std::string(kind.name) + ": mask " + hex(mask) + " names lanes " + lanes_of(mask & ~w.exists) +
         " that do not exist (the block ends in a partial warp)");
  if (mask & w.exited)
    fail(std::string(kind.name) + ": lanes " + lanes_of(mask & w.exited) + " of mask " + hex(mask) + " have exited");
  if (mask & w.at_barrier)
    fail(std::string(kind.name) + ": lanes " + lanes_of(mask & w.at_barrier) + " of mask " + hex(mask) +
         " wait at __syncthreads instead");
  if (w.kind != nullptr) {
    if (w.kind != &kind || w.mask != mask)
      fail(std::string("reached ") + kind.name + " (mask " + hex(mask) + ") while lanes " + lanes_of(w.arrived) +
           " of its warp wait at " + w.kind->name + " (mask " + hex(w.mask) + ")");
  } else {
    w.kind = &kind;
    w.mask = mask;
    w.arrived = 0;
    w.arg = arg;
  }
  w.in[f->lane] = in;
  w.out[f->lane] = out;
  w.arrived |= bit;
  if (w.arrived != mask) {
    f->state = State::kCollective;
    switch_away(rt, f);
    return;  // the last lane computed our result
  }
  std::string err = kind.compute(mask, w.in, w.out, w.arg);
  w.kind = nullptr;
  const uint32_t others = mask & ~bit;
  for (int l = 0; l < kWarpSize; ++l)
    if (others & (1u << l)) wake(rt, rt.fibers[f->warp * kWarpSize + l]);
  w.arrived = 0;
  if (!err.empty()) fail(err);
}

void syncthreads() {
  Runtime& rt = runtime("__syncthreads");
  Fiber* f = rt.current;
  Warp& w = rt.warps[f->warp];
  const uint32_t bit = 1u << f->lane;
  if (rt.exited > 0) {
    for (const Fiber& g : rt.fibers)
      if (g.state == State::kExited)
        fail("__syncthreads not reached by every thread: thread " + dim_str(g.view.thread_idx) + " has exited");
  }
  if (w.kind != nullptr && (w.mask & bit))
    fail(std::string("reached __syncthreads while lanes ") + lanes_of(w.arrived) + " of its warp wait at " +
         w.kind->name + " (mask " + hex(w.mask) + ")");
  ++rt.at_barrier;
  if (rt.at_barrier == rt.nthreads) {
    rt.at_barrier = 0;
    rt.epoch = ++tls_epoch;  // every access before the barrier is ordered before every one after
    for (auto& ww : rt.warps) ww.at_barrier = 0;
    if (rt.options.schedule == Schedule::kReverse) {
      for (int i = rt.nthreads - 1; i >= 0; --i)
        if (rt.fibers[i].state == State::kBarrier) wake(rt, rt.fibers[i]);
    } else {
      for (int i = 0; i < rt.nthreads; ++i)
        if (rt.fibers[i].state == State::kBarrier) wake(rt, rt.fibers[i]);
    }
    return;
  }
  w.at_barrier |= bit;
  f->state = State::kBarrier;
  switch_away(rt, f);
}

namespace {
// __syncwarp(mask) orders the accesses of the lanes in mask before it before their accesses
// after it (CUDA: "guarantees memory ordering among threads participating in the barrier").
std::string compute_syncwarp(uint32_t mask, const void* const*, void* const*, void* arg) {
  Warp& w = *static_cast<Warp*>(arg);
  uint32_t joined[kWarpSize] = {};
  for (int l = 0; l < kWarpSize; ++l)
    if (mask & (1u << l))
      for (int m = 0; m < kWarpSize; ++m) joined[m] = std::max(joined[m], w.vc[l][m]);
  ++w.gen;
  for (int m = 0; m < kWarpSize; ++m)
    if (mask & (1u << m)) joined[m] = w.gen;
  for (int l = 0; l < kWarpSize; ++l)
    if (mask & (1u << l)) std::memcpy(w.vc[l], joined, sizeof joined);
  return {};
}
const CollectiveKind kSyncwarp{"__syncwarp", &compute_syncwarp};

struct ShflIn {
  uint64_t value;
  int lane_arg;
  int width;
};
template <ShflMode kMode>
std::string compute_shfl(uint32_t mask, const void* const* in, void* const* out, void*) {
  uint64_t result[kWarpSize];
  for (int l = 0; l < kWarpSize; ++l) {
    if (!(mask & (1u << l))) continue;
    const ShflIn& x = *static_cast<const ShflIn*>(in[l]);
    const int width = x.width;
    if (width < 1 || width > kWarpSize || (width & (width - 1)))
      return "shfl: width " + std::to_string(width) + " of lane " + std::to_string(l) + " is not a power of two <= 32";
    const int seg_lo = l & ~(width - 1), seg_hi = seg_lo + width;
    int src = l;
    switch (kMode) {
      case ShflMode::kIdx: src = seg_lo + (x.lane_arg & (width - 1)); break;
      case ShflMode::kUp:
        src = l - x.lane_arg;
        if (src < seg_lo) src = l;
        break;
      case ShflMode::kDown:
        src = l + x.lane_arg;
        if (src >= seg_hi) src = l;
        break;
      case ShflMode::kXor:
        src = l ^ x.lane_arg;
        if (src >= seg_hi || src < 0) src = l;
        break;
    }
    if (src < 0 || src >= kWarpSize || !(mask & (1u << src)))
      return "shfl: lane " + std::to_string(l) + " reads lane " + std::to_string(src) + ", which is not in the mask " +
             hex(mask) + " (undefined on the GPU)";
    result[l] = static_cast<const ShflIn*>(in[src])->value;
  }
  for (int l = 0; l < kWarpSize; ++l)
    if (mask & (1u << l)) *static_cast<uint64_t*>(out[l]) = result[l];
  return {};
}
const CollectiveKind kShflKinds[4] = {
    {"__shfl_sync", &compute_shfl<ShflMode::kIdx>},
    {"__shfl_up_sync", &compute_shfl<ShflMode::kUp>},
    {"__shfl_down_sync", &compute_shfl<ShflMode::kDown>},
    {"__shfl_xor_sync", &compute_shfl<ShflMode::kXor>},
};

template <int kOp>
std::string compute_vote(uint32_t mask, const void* const* in, void* const* out, void*) {
  uint32_t ballot = 0;
  for (int l = 0; l < kWarpSize; ++l)
    if ((mask & (1u << l)) && *static_cast<const bool*>(in[l])) ballot |= 1u << l;
  uint32_t r = kOp == 0 ? ballot : kOp == 1 ? (ballot != 0) : (ballot == mask);
  for (int l = 0; l < kWarpSize; ++l)
    if (mask & (1u << l)) *static_cast<uint32_t*>(out[l]) = r;
  return {};
}
const CollectiveKind kVoteKinds[3] = {
    {"__ballot_sync", &compute_vote<0>},
    {"__any_sync", &compute_vote<1>},
    {"__all_sync", &compute_vote<2>},
};
}  // namespace

void syncwarp(uint32_t mask) {
  Runtime& rt = runtime("__syncwarp");
  warp_collective(kSyncwarp, mask, nullptr, nullptr, &rt.warps[rt.current->warp]);
}

uint64_t shfl(ShflMode mode, uint32_t mask, uint64_t value, int lane_arg, int width) {
  ShflIn in{value, lane_arg, width};
  uint64_t out = 0;
  warp_collective(kShflKinds[static_cast<int>(mode)], mask, &in, &out);
  return out;
}

uint32_t vote(int op, uint32_t mask, bool predicate) {
  uint32_t out = 0;
  warp_collective(kVoteKinds[op], mask, &predicate, &out);
  return out;
}

// ---- the race detector (shared memory) ----
namespace {

uint16_t intern_site(Runtime& rt, const char* what, const char* file, int line) {
  // A launch has a few dozen sites: a linear search from the most recent is enough.
  for (size_t i = rt.sites.size(); i-- > 1;) {
    const Runtime::Site& e = rt.sites[i];
    if (e.line == line && e.file == file && e.what == what) return static_cast<uint16_t>(i);
  }
  if (rt.sites.size() >= 0xffff) return 0;
  rt.sites.push_back({what, file, line});
  return static_cast<uint16_t>(rt.sites.size() - 1);
}

// "ldmatrix at kernels/bwd.h:162" (the path from cuda/ on, or the file name).
std::string site_str(const Runtime& rt, uint16_t site) {
  if (site == 0 || site >= rt.sites.size()) return "?";
  const Runtime::Site& e = rt.sites[site];
  std::string s = e.what != nullptr ? e.what : "?";
  if (e.file == nullptr) return s;
  std::string f = e.file;
  size_t cut = f.rfind("/cuda/");
  if (cut != std::string::npos)
    f = f.substr(cut + 6);
  else if ((cut = f.rfind('/')) != std::string::npos)
    f = f.substr(cut + 1);
  return s + " at " + f + ":" + std::to_string(e.line);
}

std::string thread_of(const Runtime& rt, int index) {
  const Fiber& f = rt.fibers[index];
  return "thread " + dim_str(f.view.thread_idx) + " (warp " + std::to_string(f.warp) + " lane " +
         std::to_string(f.lane) + ")";
}

// Whether an access of thread `other` (index + 1; 0: none) at (epoch, gen) is ordered before
// the present of thread `me`.
inline bool ordered(const Runtime& rt, const Fiber& me, uint16_t other, uint32_t epoch, uint32_t gen) {
  if (other == 0 || epoch != rt.epoch) return true;
  const int o = other - 1;
  if (o == me.index) return true;
  const Fiber& of = rt.fibers[o];
  if (of.warp != me.warp) return false;
  return rt.warps[me.warp].vc[me.lane][of.lane] > gen;
}

std::string race(const Runtime& rt, const Fiber& me, const char* verb, size_t offset, uint16_t site, int other,
                 const char* other_verb, uint16_t other_site) {
  const Fiber& of = rt.fibers[other];
  const char* order = of.warp == me.warp ? "no __syncwarp or __syncthreads" : "no __syncthreads";
  return "shared-memory race: " + site_str(rt, site) + " by " + thread_of(rt, me.index) + " " + verb + " byte " +
         std::to_string(offset) + " of shared memory, which " + thread_of(rt, other) + " " + other_verb + " (" +
         site_str(rt, other_site) + ") with " + order + " in between";
}

}  // namespace

std::string smem_access(int lane, const void* p, size_t bytes, MemOp op, const char* what, const char* file, int line) {
  Runtime& rt = runtime(what);
  const Fiber& me = lane < 0 ? *rt.current : rt.fibers[rt.current->warp * kWarpSize + lane];
  const Warp& w = rt.warps[me.warp];
  const uint16_t self = static_cast<uint16_t>(me.index + 1);
  const uint32_t bit = 1u << me.lane;
  const uint16_t site = intern_site(rt, what, file, line);
  const size_t offset = static_cast<size_t>(static_cast<const char*>(p) - rt.smem);
  for (size_t i = offset; i < offset + bytes; ++i) {
    SmemByte& b = rt.shadow[i];
    if (!ordered(rt, me, b.w_thread, b.w_epoch, b.w_gen))
      return race(rt, me, op == MemOp::kRead ? "reads" : "overwrites", i, site, b.w_thread - 1, "wrote", b.w_site);
    if (rt.in_flight[i / 16] != 0)
      return site_str(rt, site) + " by " + thread_of(rt, me.index) + " " + (op == MemOp::kRead ? "reads" : "writes") +
             " shared memory offset " + std::to_string(i) +
             " while a cp.async into it has not been waited for (missing cp.async.wait_group or __syncthreads)";
    if (op == MemOp::kRead) {
      if (b.r_epoch != rt.epoch) {
        b.r_epoch = rt.epoch;
        b.r_thread = self;
        b.r_lanes = bit;
        b.r_gen = w.gen;
        b.r_other = 0;
        b.r_site = site;
      } else if (b.r_other == 0) {
        const Fiber& rf = rt.fibers[b.r_thread - 1];
        if (rf.warp != me.warp) {
          b.r_other = self;
          b.r_other_site = site;
        } else if (b.r_lanes == bit) {
          b.r_gen = w.gen;
          b.r_site = site;
        } else {
          // Readers all ordered before this one are covered by it (clocks are transitive).
          bool all_before = true;
          for (uint32_t m = b.r_lanes & ~bit; m != 0; m &= m - 1)
            all_before = all_before && w.vc[me.lane][__builtin_ctz(m)] > b.r_gen;
          if (all_before) {
            b.r_lanes = bit;
            b.r_thread = self;
            b.r_gen = w.gen;
            b.r_site = site;
          } else {
            b.r_lanes |= bit;
            b.r_gen = std::max(b.r_gen, w.gen);
          }
        }
      }
    } else {
      if (b.r_epoch == rt.epoch) {
        int reader = -1;
        uint16_t reader_site = b.r_site;
        const Fiber& rf = rt.fibers[b.r_thread - 1];
        if (b.r_other != 0) {
          // Readers in two warps: one of them is in another warp than this writer.
          if (rf.warp != me.warp) {
            reader = rf.index;
          } else {
            reader = b.r_other - 1;
            reader_site = b.r_other_site;
          }
        } else if (rf.warp != me.warp) {
          reader = rf.index;
        } else {
          for (uint32_t m = b.r_lanes & ~bit; m != 0 && reader < 0; m &= m - 1) {
            const int l = __builtin_ctz(m);
            if (w.vc[me.lane][l] <= b.r_gen) reader = me.warp * kWarpSize + l;
          }
        }
        if (reader >= 0) return race(rt, me, "overwrites", i, site, reader, "read", reader_site);
      }
      b.w_thread = self;
      b.w_epoch = rt.epoch;
      b.w_gen = w.gen;
      b.w_site = site;
      b.r_epoch = 0;
    }
  }
  return {};
}

// ---- global memory: declared buffers and conflicts between CTAs ----
void check_global(const void* p, size_t bytes, MemOp op, const char* what, const char* file, int line) {
  Runtime& rt = runtime(what);
  if (rt.buffers.empty()) return;
  const char* c = static_cast<const char*>(p);
  if (c >= rt.smem && c < rt.smem + rt.smem_bytes) return;  // shared memory (atomics on it)
  const char* verb = op == MemOp::kRead ? "reads" : op == MemOp::kWrite ? "writes" : "atomically updates";
  const std::string at = site_str(rt, intern_site(rt, what, file, line)) + " " + verb + " " + std::to_string(bytes) +
                         " bytes at " + hex(reinterpret_cast<uintptr_t>(p));
  size_t index = rt.buffers.size();
  for (size_t i = 0; i < rt.buffers.size(); ++i) {
    const char* lo = static_cast<const char*>(rt.buffers[i].ptr);
    if (c >= lo && c + bytes <= lo + rt.buffers[i].bytes && c + bytes >= c) {
      index = i;
      break;
    }
  }
  if (index == rt.buffers.size()) {
    // Name the nearest buffer: most out-of-bounds accesses are just past one.
    std::string near;
    uint64_t best = UINT64_MAX;
    for (const auto& b : rt.buffers) {
      const uintptr_t lo = reinterpret_cast<uintptr_t>(b.ptr), hi = lo + b.bytes, a = reinterpret_cast<uintptr_t>(c);
      const uint64_t d = a >= hi ? a - hi : a < lo ? lo - a : 0;
      if (d < best) {
        best = d;
        near = a >= hi ? std::to_string(a - hi) + " bytes past the end of " + b.name + " (" + std::to_string(b.bytes) +
                             " bytes)"
               : a >= lo ? "the end of " + b.name + " (" + std::to_string(b.bytes) + " bytes)"
                         : std::to_string(lo - a) + " bytes before " + b.name;
      }
    }
    fail(at + ", outside every buffer the launch declared (emu::GlobalBufferScope)" +
         (near.empty() ? std::string() : ": " + near));
  }
  const GlobalBuffer& buf = rt.buffers[index];
  if (op != MemOp::kRead && !buf.writable) fail(at + " in " + buf.name + ", which the kernel may only read");
  std::vector<uint32_t>& writers = rt.global_writers[index];
  if (writers.empty()) {
    if (op == MemOp::kRead || !buf.writable) return;  // nothing written to it yet in this launch
    writers.assign(buf.bytes, 0);
  }
  const size_t offset = static_cast<size_t>(c - static_cast<const char*>(buf.ptr));
  const uint32_t me = rt.block_linear + 1;
  for (size_t i = offset; i < offset + bytes; ++i) {
    const uint32_t wr = writers[i];
    const uint32_t cta = wr >> 1;
    const bool atomic = wr & 1;
    if (wr != 0 && cta != me && !(op == MemOp::kAtomic && atomic)) {
      const uint32_t other = cta - 1, gx = rt.spec.grid.x, gy = rt.spec.grid.y;
      const std::string other_block = dim_str({other % gx, (other / gx) % gy, other / (gx * gy)});
      fail(at + " (byte " + std::to_string(i) + " of " + buf.name + "), which block " + other_block +
           (atomic ? " updated atomically" : " wrote") + " in the same launch: the CTAs of a launch are not ordered" +
           (op == MemOp::kAtomic || atomic ? " (mixing atomic and plain accesses)" : " (use an atomic)"));
    }
    if (op != MemOp::kRead) writers[i] = me << 1 | (op == MemOp::kAtomic || (atomic && cta == me) ? 1u : 0u);
  }
}

// ---- used by ptx_emu.cc ----
bool smem_range_ok(const void* p, size_t bytes, size_t* offset) {
  Runtime& rt = runtime("shared memory");
  const char* c = static_cast<const char*>(p);
  if (c < rt.smem || c + bytes > rt.smem + rt.smem_bytes || c + bytes < c) return false;
  *offset = static_cast<size_t>(c - rt.smem);
  return true;
}

bool smem_in_flight(size_t smem_offset) {
  Runtime& rt = runtime("shared memory");
  return rt.in_flight[smem_offset / 16] != 0;
}

void cp_async_issue(size_t smem_offset, const void* src, int src_bytes, const char* file, int line) {
  Runtime& rt = runtime("cp.async");
  Fiber& f = *rt.current;
  if (src_bytes > 0) check_global(src, static_cast<size_t>(src_bytes), MemOp::kRead, "cp.async", file, line);
  // The copy may land at any time until its wait: it must be ordered after every access of
  // another thread to its destination, and no other copy into it may be in flight.
  if (rt.in_flight[smem_offset / 16] != 0)
    fail(site_str(rt, intern_site(rt, "cp.async", file, line)) + " into shared memory offset " +
         std::to_string(smem_offset) + ", where another cp.async has not landed yet");
  std::string err = smem_access(-1, rt.smem + smem_offset, 16, MemOp::kWrite, "cp.async", file, line);
  if (!err.empty()) fail(err);
  PendingCopy c;
  c.smem_offset = smem_offset;
  std::memset(c.bytes, 0, sizeof c.bytes);
  if (src_bytes > 0) std::memcpy(c.bytes, src, static_cast<size_t>(src_bytes));
  std::memcpy(c.before, rt.smem + smem_offset, 16);
  c.group = f.committed_groups;
  c.site = intern_site(rt, "cp.async", file, line);
  f.copies.push_back(c);
  ++rt.in_flight[smem_offset / 16];
}

void cp_async_commit() {
  Runtime& rt = runtime("cp.async.commit_group");
  ++rt.current->committed_groups;
  maybe_yield(rt);
}

void cp_async_wait(int n) {
  Runtime& rt = runtime("cp.async.wait_group");
  Fiber& f = *rt.current;
  if (f.committed_groups < static_cast<uint64_t>(n)) return;
  const uint64_t limit = f.committed_groups - static_cast<uint64_t>(n);  // groups < limit must be complete
  size_t kept = 0;
  for (size_t i = 0; i < f.copies.size(); ++i) {
    const PendingCopy& c = f.copies[i];
    if (c.group < limit) {
      // A write to the destination while the copy was in flight is a race on the GPU (which
      // of the two lands is unspecified); the emulation reports it instead of picking one.
      if (std::memcmp(rt.smem + c.smem_offset, c.before, 16) != 0)
        fail("cp.async.wait_group: the 16 bytes at shared memory offset " + std::to_string(c.smem_offset) +
             " were written while a cp.async into them (group " + std::to_string(c.group) + ") was in flight");
      std::memcpy(rt.smem + c.smem_offset, c.bytes, 16);
      --rt.in_flight[c.smem_offset / 16];
      // The copy lands here: a write of the issuing thread, which other threads must not read
      // before a barrier orders them after this wait.
      for (size_t b = c.smem_offset; b < c.smem_offset + 16; ++b) {
        SmemByte& s = rt.shadow[b];
        s.w_thread = static_cast<uint16_t>(f.index + 1);
        s.w_epoch = rt.epoch;
        s.w_gen = rt.warps[f.warp].gen;
        s.w_site = c.site;
        s.r_epoch = 0;
      }
    } else {
      f.copies[kept++] = c;
    }
  }
  f.copies.resize(kept);
  maybe_yield(rt);
}

Status run_launch(const LaunchSpec& spec, const LaunchOptions& options) {
  Status st;
  if (tls_runtime != nullptr) {
    st.error = "jax_flash emulation: a kernel launch inside a kernel is not supported";
    return st;
  }
  const dim3 g = spec.grid, b = spec.block;
  const uint64_t nthreads = static_cast<uint64_t>(b.x) * b.y * b.z;
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.y > 65535 || g.z > 65535) {
    st.error = "invalid grid " + dim_str({g.x, g.y, g.z});
    return st;
  }
  if (nthreads == 0 || nthreads > 1024 || b.z > 64) {
    st.error = "invalid block " + dim_str({b.x, b.y, b.z}) + " (at most 1024 threads, z <= 64)";
    return st;
  }
  if (spec.smem_bytes > options.max_dynamic_smem) {
    st.error = "dynamic shared memory of " + std::to_string(spec.smem_bytes) + " bytes exceeds the limit of " +
               std::to_string(options.max_dynamic_smem);
    return st;
  }
  if (!tls_stacks.ensure(nthreads, options.stack_bytes)) {
    st.error = "jax_flash emulation: cannot map fiber stacks";
    return st;
  }

  Runtime rt;
  rt.spec = spec;
  rt.options = options;
  rt.rng = options.seed;
  rt.nthreads = static_cast<int>(nthreads);
  rt.fibers.resize(nthreads);
  rt.warps.resize((nthreads + kWarpSize - 1) / kWarpSize);
  rt.queue.resize(nthreads);
  // 128-byte alignment for the dynamic shared memory, red zones on both sides.
  rt.smem_storage.resize(kRedZone + 128 + spec.smem_bytes + kRedZone);
  uintptr_t base = reinterpret_cast<uintptr_t>(rt.smem_storage.data()) + kRedZone;
  base = (base + 127) & ~uintptr_t{127};
  rt.smem = reinterpret_cast<char*>(base);
  rt.smem_bytes = spec.smem_bytes;
  rt.in_flight.assign(spec.smem_bytes / 16 + 1, 0);
  if (tls_smem_shadow.size() < spec.smem_bytes) tls_smem_shadow.resize(spec.smem_bytes);
  rt.shadow = tls_smem_shadow.data();
  rt.buffers = tls_global_buffers;
  rt.global_writers.resize(rt.buffers.size());
  for (uint64_t i = 0; i < nthreads; ++i) {
    Fiber& f = rt.fibers[i];
    f.index = static_cast<int>(i);
    f.warp = static_cast<int>(i / kWarpSize);
    f.lane = static_cast<int>(i % kWarpSize);
    f.view.thread_idx = {static_cast<unsigned>(i % b.x), static_cast<unsigned>((i / b.x) % b.y),
                         static_cast<unsigned>(i / (static_cast<uint64_t>(b.x) * b.y))};
    f.view.block_dim = b;
    f.view.grid_dim = g;
    f.stack = tls_stacks.stacks[i].base + tls_stacks.page;
    f.stack_bytes = tls_stacks.stack_bytes;
    rt.warps[f.warp].exists |= 1u << f.lane;
  }

#if JAX_FLASH_EMU_ASAN
  {
    pthread_attr_t attr;
    void* addr = nullptr;
    size_t bytes = 0;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      pthread_attr_getstack(&attr, &addr, &bytes);
      pthread_attr_destroy(&attr);
    }
    rt.scheduler_stack = addr;
    rt.scheduler_stack_bytes = bytes;
  }
#endif
  install_fault_handler();
  tls_runtime = &rt;
  for (unsigned z = 0; z < g.z && !rt.aborted; ++z)
    for (unsigned y = 0; y < g.y && !rt.aborted; ++y)
      for (unsigned x = 0; x < g.x && !rt.aborted; ++x)
        if (!run_block(rt, uint3{x, y, z})) rt.aborted = true;
  tls_runtime = nullptr;
  tls_view = nullptr;
  st.error = rt.error;
  if (rt.aborted && st.error.empty()) st.error = "jax_flash emulation: launch aborted";
  return st;
}

}  // namespace detail

GlobalBufferScope::GlobalBufferScope(std::initializer_list<std::pair<const void*, size_t>> buffers)
    : saved_(detail::tls_global_buffers) {
  detail::tls_global_buffers.clear();
  for (const auto& b : buffers)
    detail::tls_global_buffers.push_back(
        {b.first, b.second, "buffer " + std::to_string(detail::tls_global_buffers.size()), true});
}
GlobalBufferScope::GlobalBufferScope(std::vector<GlobalBuffer> buffers) : saved_(detail::tls_global_buffers) {
  detail::tls_global_buffers = std::move(buffers);
}
GlobalBufferScope::~GlobalBufferScope() { detail::tls_global_buffers = saved_; }

char* dynamic_smem() { return detail::runtime("dynamic shared memory").smem; }
size_t dynamic_smem_size() { return detail::runtime("dynamic shared memory").smem_bytes; }

namespace {
std::atomic<bool> tile_counting{false};
std::atomic<int64_t> tile_counts[kTilePasses];
}  // namespace

void count_tile(int pass) {
  if (tile_counting.load(std::memory_order_relaxed) && pass >= 0 && pass < kTilePasses)
    tile_counts[pass].fetch_add(1, std::memory_order_relaxed);
}
void set_tile_counting(bool on) {
  if (on) {
    for (auto& c : tile_counts) c.store(0, std::memory_order_relaxed);
  }
  tile_counting.store(on, std::memory_order_relaxed);
}
int64_t tile_count(int pass) { return pass >= 0 && pass < kTilePasses ? tile_counts[pass].load() : 0; }

LaunchOptions LaunchOptions::FromEnvironment() {
  LaunchOptions o;
  if (const char* s = std::getenv("JAX_FLASH_EMU_SCHEDULE")) {
    std::string v(s);
    if (v == "reverse") {
      o.schedule = Schedule::kReverse;
    } else if (v.rfind("shuffle", 0) == 0) {
      o.schedule = Schedule::kShuffle;
      if (v.size() > 8 && v[7] == ':') o.seed = std::strtoull(v.c_str() + 8, nullptr, 10);
    }
  }
  if (const char* s = std::getenv("JAX_FLASH_EMU_STACK_KB")) {
    unsigned long long kb = std::strtoull(s, nullptr, 10);
    if (kb >= 16) o.stack_bytes = static_cast<size_t>(kb) * 1024;
  }
  return o;
}

}  // namespace emu
}  // namespace jax_flash

// Parallel-for over independent work items on XLA's intra-op thread pool (reached
// through the FFI execution context). Every output element belongs to exactly one
// item and items never communicate, so the result is the same bits whatever the
// number of threads or the order the items run in.
//
// The calling thread works too and waits only for items some thread has already
// claimed, so the call cannot deadlock even when every pool thread is busy (or the
// caller is itself a pool thread): a task the pool starts late finds nothing left
// and returns. A process-wide cap limits the number of threads (1: the caller only): read once
// from JAX_FLASH_CPU_THREADS when the extension is loaded, changed by set_cpu_thread_limit;
// never read from the environment by a call.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>

#include "xla/ffi/api/ffi.h"

namespace jax_flash {
namespace cpu {

// The process-wide thread cap; 0: none (every thread of XLA's pool).
inline std::atomic<int64_t>& ThreadLimit() {
  static std::atomic<int64_t> limit{0};
  return limit;
}
// JAX_FLASH_CPU_THREADS=n, read once, when the extension is loaded (cpu/targets.cc).
inline void SetThreadLimitFromEnvironment() {
  const char* value = std::getenv("JAX_FLASH_CPU_THREADS");
  const long long n = value == nullptr ? 0 : std::atoll(value);
  ThreadLimit().store(n > 0 ? n : 0);
}

// A 64-byte-aligned float buffer: a worker's workspace, or packed operands. Null
// (not an exception) when the allocation fails.
class Workspace {
 public:
  explicit Workspace(int64_t floats)
      : data_(static_cast<float*>(::operator new[](static_cast<size_t>(floats > 0 ? floats : 1) * sizeof(float),
                                                   std::align_val_t{64}, std::nothrow))) {}
  ~Workspace() { ::operator delete[](data_, std::align_val_t{64}); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  float* get() const { return data_; }

 private:
  float* data_;
};

// Runs tile(item, workspace) for every item in [0, items), each worker with its own
// workspace of `workspace_floats` floats. Returns false if a workspace could not be
// allocated (the items that worker claimed are then left undone).
template <typename Tile>
bool ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, int64_t workspace_floats, const Tile& tile) {
  if (items <= 0) return true;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<bool> failed{false};
    int64_t items = 0;
    std::mutex mutex;
    std::condition_variable all_done;
  };
  auto state = std::make_shared<State>();
  state->items = items;

  // `tile` lives on the caller's stack: a worker touches it only while it holds a
  // claimed, unfinished item, i.e. while the caller is still waiting.
  auto worker = [state, workspace_floats, &tile]() {
    std::unique_ptr<Workspace> workspace;
    for (int64_t item; (item = state->next.fetch_add(1)) < state->items;) {
      if (workspace == nullptr) workspace = std::make_unique<Workspace>(workspace_floats);
      if (workspace->get() != nullptr) {
        tile(item, workspace->get());
      } else {
        state->failed.store(true);
      }
      if (state->done.fetch_add(1) + 1 == state->items) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->all_done.notify_all();
      }
    }
  };

  int64_t threads = pool.num_threads();
  if (threads < 1) threads = 1;
  const int64_t limit = ThreadLimit().load();
  if (limit > 0 && limit < threads) threads = limit;
  if (items < threads) threads = items;
  for (int64_t i = 1; i < threads; ++i) pool.Schedule(decltype(worker)(worker));
  worker();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_done.wait(lock, [&] { return state->done.load() == state->items; });
  return !state->failed.load();
}

}  // namespace cpu
}  // namespace jax_flash

// A parallel loop over work items on XLA's intra-op thread pool, for weld's FFI kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace weld {

// Runs prologue() on the calling thread, then body(begin, end) over [0, n) in chunks of `grain`
// items, claimed from a shared counter by the calling thread and by tasks scheduled on the pool.
// The tasks are scheduled before the prologue runs, so their wake-up (~10 us on a busy pool)
// overlaps it: small work the items need, too small to split (quantizing a call's few activation
// rows), costs no extra round trip. Items start once the prologue is done (its writes are visible
// to them). The caller waits only for the items, never for the tasks: a task that starts late
// finds nothing left and touches nothing but the counters it co-owns, and one the pool runs on the
// caller's own thread before the prologue returns at once (so a busy pool cannot deadlock the
// call). `body` is copied into each task and must copy what it captures.
template <typename Prologue, typename Body>
void parallel_for_after(xla::ffi::ThreadPool& pool, int64_t n, int64_t grain, const Prologue& prologue,
                        const Body& body) {
  struct Shared {
    std::thread::id caller = std::this_thread::get_id();
    std::atomic<bool> ready{false};
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto sh = std::make_shared<Shared>();
  const int64_t chunks = (n + grain - 1) / grain;
  auto work = [sh, n, grain, body] {
    while (!sh->ready.load(std::memory_order_acquire)) {
      if (std::this_thread::get_id() == sh->caller) return;  // run inline by Schedule: the caller works
      std::this_thread::yield();
    }
    for (int64_t begin; (begin = sh->next.fetch_add(grain)) < n;) {
      const int64_t end = std::min(n, begin + grain);
      body(begin, end);
      sh->done.fetch_add(end - begin, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));  // a copy per task
  prologue();
  sh->ready.store(true, std::memory_order_release);
  work();
  while (sh->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// parallel_for_after with nothing before the items.
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t grain, const Body& body) {
  parallel_for_after(pool, n, grain, [] {}, body);
}

}  // namespace weld

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

// parallel_for_after for streams: [0, n) is cut into one contiguous segment per thread (the
// caller's first), and each thread claims its own segment's items front to back in chunks of
// `grain`, so its loads run in one ascending stream the hardware prefetchers follow. A thread
// done with its own takes chunks from the back of the others', so a helper that wakes late
// leaves its segment's front to be eaten from behind instead of the caller waiting for it: the
// call ends when the items do, about (work + a helper's wake-up) / threads, where one fixed run
// per thread ended at work / threads + the wake-up (~10 us, a SmolLM2 projection's whole
// stream at one row is 10-40 us).
template <typename Prologue, typename Body>
void parallel_streams_after(xla::ffi::ThreadPool& pool, int64_t n, int64_t grain, const Prologue& prologue,
                            const Body& body) {
  constexpr int64_t kMaxSegments = 64;
  const int64_t segments = std::max<int64_t>(1, std::min<int64_t>({pool.num_threads(), kMaxSegments,
                                                                      (n + grain - 1) / std::max<int64_t>(grain, 1)}));
  struct Shared {
    std::thread::id caller = std::this_thread::get_id();
    std::atomic<bool> ready{false};
    std::atomic<int64_t> done{0};
    // per segment: (front << 32) | back, the items not yet claimed being [front, back)
    std::atomic<uint64_t> span[kMaxSegments];
  };
  auto sh = std::make_shared<Shared>();
  for (int64_t s = 0; s < segments; ++s) {
    const uint64_t begin = static_cast<uint64_t>(n * s / segments), end = static_cast<uint64_t>(n * (s + 1) / segments);
    sh->span[s].store((begin << 32) | end, std::memory_order_relaxed);
  }
  // Claims up to `grain` items of segment s from its front (the owner) or back (a thief).
  auto claim = [sh, grain](int64_t s, bool front, int64_t* begin, int64_t* end) {
    uint64_t cur = sh->span[s].load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(cur >> 32), b = static_cast<int64_t>(cur & 0xFFFFFFFFu);
      if (f >= b) return false;
      const int64_t take = std::min(grain, b - f);
      *begin = front ? f : b - take;
      *end = front ? f + take : b;
      const uint64_t next = front ? (static_cast<uint64_t>(f + take) << 32) | static_cast<uint64_t>(b)
                                  : (static_cast<uint64_t>(f) << 32) | static_cast<uint64_t>(b - take);
      if (sh->span[s].compare_exchange_weak(cur, next, std::memory_order_acq_rel)) return true;
    }
  };
  auto work = [sh, segments, claim, body](int64_t own) {
    int64_t begin, end;
    for (int64_t k = 0; k < segments; ++k) {  // its own segment first, then the others' backs
      const int64_t s = (own + k) % segments;
      while (claim(s, k == 0, &begin, &end)) {
        body(begin, end);
        sh->done.fetch_add(end - begin, std::memory_order_release);
      }
    }
  };
  for (int64_t i = 1; i < segments; ++i) {
    pool.Schedule([sh, work, i] {
      while (!sh->ready.load(std::memory_order_acquire)) {
        if (std::this_thread::get_id() == sh->caller) return;  // run inline by Schedule: the caller works
        std::this_thread::yield();
      }
      work(i);
    });
  }
  prologue();
  sh->ready.store(true, std::memory_order_release);
  work(0);
  while (sh->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// parallel_for_after with nothing before the items.
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t grain, const Body& body) {
  parallel_for_after(pool, n, grain, [] {}, body);
}

}  // namespace weld

// The streaming mailbox: a device loop (programs.hand_over) copies its outputs so far into it, and a
// host thread takes them while the loop runs on. An XLA FFI call, not a Python callback: programs
// holding Python callbacks never enter JAX's persistent compile cache, and the loop does not wait
// for Python here (it copies a few hundred bytes into a queue and signals).
//
// weld_stream_put (the FFI target): args = an s32[] call id, then any buffers; returns the call
// id, which the loop feeds to its next put (that orders the puts: nothing else depends on them).
// The buffers' bytes go to the back of a queue. A reader held up (the GIL, a busy core) takes the
// hand-overs late but in order and none is lost; the loop waits only when 64 are queued (or a
// second has passed), so the device never waits on Python in the common case.
// weld_stream_seq (for ctypes): the number of hand-overs put so far.
// weld_stream_take (for ctypes): waits up to timeout_ms for a hand-over, moves the oldest out and
// returns its sequence number (0 on timeout, -seq when `capacity` is too small: it stays queued).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kMaxQueued = 64;

struct HandOver {
  uint64_t seq;
  int32_t call;
  std::vector<char> data;
};

struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t seq = 0;  // hand-overs put so far
  std::deque<HandOver> queue;
};

Mailbox& mailbox() {
  static Mailbox* box = new Mailbox();  // never destroyed: XLA threads may put during exit
  return *box;
}

ffi::Error StreamPut(ffi::Buffer<ffi::S32> call, ffi::RemainingArgs buffers, ffi::ResultBuffer<ffi::S32> echo) {
  HandOver item{0, call.typed_data()[0], {}};
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto buffer = buffers.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return ffi::Error::InvalidArgument("weld_stream_put: arguments must be buffers");
    const char* bytes = static_cast<const char*>(buffer->untyped_data());
    item.data.insert(item.data.end(), bytes, bytes + buffer->size_bytes());
  }
  Mailbox& box = mailbox();
  {
    std::unique_lock<std::mutex> lock(box.mu);
    box.cv.wait_for(lock, std::chrono::seconds(1), [&] { return box.queue.size() < kMaxQueued; });
    if (box.queue.size() >= kMaxQueued) box.queue.pop_front();  // no reader: keep the newest
    item.seq = ++box.seq;
    box.queue.push_back(std::move(item));
  }
  box.cv.notify_all();
  echo->typed_data()[0] = call.typed_data()[0];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WeldStreamPut, StreamPut,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // the call's id
                                  .RemainingArgs()                // the outputs so far
                                  .Ret<ffi::Buffer<ffi::S32>>());  // the call's id again

extern "C" int64_t weld_stream_seq() {
  Mailbox& box = mailbox();
  std::lock_guard<std::mutex> lock(box.mu);
  return static_cast<int64_t>(box.seq);
}

extern "C" int64_t weld_stream_take(int32_t timeout_ms, int32_t* call, void* dst, int64_t capacity, int64_t* size) {
  Mailbox& box = mailbox();
  std::unique_lock<std::mutex> lock(box.mu);
  if (!box.cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return !box.queue.empty(); })) return 0;
  HandOver& front = box.queue.front();
  *size = static_cast<int64_t>(front.data.size());
  const int64_t seq = static_cast<int64_t>(front.seq);
  if (*size > capacity) return -seq;
  std::memcpy(dst, front.data.data(), front.data.size());
  *call = front.call;
  box.queue.pop_front();
  lock.unlock();
  box.cv.notify_all();  // a put waiting for room
  return seq;
}

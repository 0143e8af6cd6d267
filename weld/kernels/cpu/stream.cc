// The streaming mailbox: a device loop (programs.hand_over) copies its outputs so far into it, and a
// host thread takes them while the loop runs on. An XLA FFI call, not a Python callback: programs
// holding Python callbacks never enter JAX's persistent compile cache, and the loop does not wait
// for Python here (it only copies a few hundred bytes and signals).
//
// weld_stream_put (the FFI target): args = an s32[] call id, then any buffers; returns the call
// id, which the loop feeds to its next put: XLA:CPU may otherwise run the puts of successive
// iterations out of order, since nothing else depends on them. The buffers' bytes are
// concatenated into the mailbox, replacing what was there. Once a reader has taken from the
// mailbox, a put first waits (up to a second) until the reader took the previous hand-over, so
// none is skipped: the reader handles hand-over n while the loop computes step n + 1, and the
// loop waits only for a reader slower than a step. (Each hand-over holds everything the call has
// produced so far, so a skipped one would lose nothing but its timing.)
// weld_stream_seq (for ctypes): the newest hand-over's sequence number.
// weld_stream_take (for ctypes): waits up to timeout_ms for a hand-over newer than `after`, copies
// it out and returns its sequence number (0 on timeout, -seq when `capacity` is too small).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t seq = 0;
  uint64_t taken = 0;   // the newest hand-over a reader took
  bool reader = false;  // a reader has taken from the mailbox
  int32_t call = -1;
  std::vector<char> data;
};

Mailbox& mailbox() {
  static Mailbox* box = new Mailbox();  // never destroyed: XLA threads may put during exit
  return *box;
}

ffi::Error StreamPut(ffi::Buffer<ffi::S32> call, ffi::RemainingArgs buffers, ffi::ResultBuffer<ffi::S32> echo) {
  Mailbox& box = mailbox();
  {
    std::unique_lock<std::mutex> lock(box.mu);
    if (box.reader) box.cv.wait_for(lock, std::chrono::seconds(1), [&] { return box.taken >= box.seq; });
    box.data.clear();
    for (size_t i = 0; i < buffers.size(); ++i) {
      auto buffer = buffers.get<ffi::AnyBuffer>(i);
      if (!buffer.has_value()) return ffi::Error::InvalidArgument("weld_stream_put: arguments must be buffers");
      const char* bytes = static_cast<const char*>(buffer->untyped_data());
      box.data.insert(box.data.end(), bytes, bytes + buffer->size_bytes());
    }
    box.call = call.typed_data()[0];
    ++box.seq;
  }
  echo->typed_data()[0] = call.typed_data()[0];
  box.cv.notify_all();
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

extern "C" int64_t weld_stream_take(uint64_t after, int32_t timeout_ms, int32_t* call, void* dst,
                                    int64_t capacity, int64_t* size) {
  Mailbox& box = mailbox();
  std::unique_lock<std::mutex> lock(box.mu);
  box.reader = true;
  if (!box.cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return box.seq > after; })) return 0;
  *size = static_cast<int64_t>(box.data.size());
  if (*size > capacity) return -static_cast<int64_t>(box.seq);
  std::memcpy(dst, box.data.data(), box.data.size());
  *call = box.call;
  const uint64_t seq = box.taken = box.seq;  // read under the lock: a put may follow at once
  lock.unlock();
  box.cv.notify_all();  // a put waiting for this take
  return static_cast<int64_t>(seq);
}

// RMSNorm over the last axis for XLA:CPU, called through the XLA FFI (built by
// weld/kernels/cpu/__init__.py):
//     y[r, j] = w'[j] * (x[r, j] * inv[r]),   inv[r] = 1 / sqrt(mean_j x[r, j]^2 + eps)
// with w' = w, or 1 + w (`plus_one`: Gemma, Qwen3-Next).
//
// Why a kernel for so little work: XLA:CPU vectorizes the mean's reduction differently for
// different row counts and fusion contexts (SmolLM2's 576 wide rows: one way at 1-7 rows, another
// at 8 or more), so a row's result depended on its batch by an ulp. Under int8 activation
// quantization (the GGUF kernels) such an ulp flips roundings and a greedy request's tokens
// depended on what else the server was running (docs/reliability.md, batch invariance). Here every
// row takes the same instructions in the same order whatever the row count, thread or address:
// eight lanes of fused multiply-adds over the row (unaligned loads: no alignment peeling), folded
// in a fixed order, then the scalar tail.

#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// The sum of squares of one row, in one fixed order.
float sum_squares(const float* x, int64_t d) {
  int64_t j = 0;
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= d; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  _mm256_storeu_ps(lanes, acc);
#else
  for (; j + 8 <= d; j += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = std::fma(x[j + l], x[j + l], lanes[l]);
#endif
  // fixed pairwise fold of the lanes, then the tail one by one
  const float s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  float tail = 0.f;
  for (; j < d; ++j) tail = std::fma(x[j], x[j], tail);
  return s + tail;
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y, float eps, int64_t plus_one) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || w.element_count() != xd[1] || y->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("weld_rms_norm: x [m, d], w [d], y [m, d]");
  }
  const int64_t m = xd[0], d = xd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));  // ~128 KB of rows per task
  weld::parallel_for(pool, m, grain, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * d;
      float* out = yp + r * d;
      const float inv = 1.0f / std::sqrt(sum_squares(row, d) / static_cast<float>(d) + eps);
      for (int64_t j = 0; j < d; ++j) {
        const float scale = plus_one ? 1.0f + wp[j] : wp[j];
        out[j] = scale * (row[j] * inv);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WeldRmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [m, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [d]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [m, d]
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("plus_one"));

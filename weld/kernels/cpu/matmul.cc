// y [m, n] = x [m, k] . w [n, k]^T for the few rows of a decode step (XLA:CPU FFI; built by
// weld/kernels/cpu/__init__.py with -march=native).
//
// At 1 row XLA:CPU's dot streams weights at 8-16 GB/s and at 2..64 rows its best form (a
// multiply + reduction) reaches about half the FMA peak, because each weight is multiplied by
// one row at a time. Here a block of 4 weight rows is multiplied by 3 input rows at a time
// (12 independent sums in registers), so each weight is read from memory once per call and
// from L1 once per 3 rows; threads split the output features.

#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// y[r, c] for rows r0..r0+MR-1 and columns c0..c0+NR-1 (k a multiple of 8).
template <int MR, int NR>
inline void block(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t k,
                  int64_t n, int64_t r0, int64_t c0) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + (c0 + j) * k + kk);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + (r0 + i) * k + kk);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[(r0 + i) * n + c0 + j] = hsum(acc[i][j]);
}

template <int NR>
inline void columns(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n, int64_t c0) {
  int64_t r = 0;
  for (; r + 3 <= m; r += 3) block<3, NR>(x, w, y, k, n, r, c0);
  if (m - r == 2) block<2, NR>(x, w, y, k, n, r, c0);
  if (m - r == 1) block<1, NR>(x, w, y, k, n, r, c0);
}
#endif

void matmul_range(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n, int64_t c_begin,
                  int64_t c_end) {
#if defined(__AVX2__) && defined(__FMA__)
  if (k % 8 == 0) {
    int64_t c = c_begin;
    if (m == 1) {  // a matrix-vector product: 8 weight rows at a time
      for (; c + 8 <= c_end; c += 8) block<1, 8>(x, w, y, k, n, 0, c);
    }
    for (; c + 4 <= c_end; c += 4) columns<4>(x, w, y, m, k, n, c);
    for (; c < c_end; ++c) columns<1>(x, w, y, m, k, n, c);
    return;
  }
#endif
  for (int64_t c = c_begin; c < c_end; ++c) {
    for (int64_t r = 0; r < m; ++r) {
      float s = 0.f;
      for (int64_t i = 0; i < k; ++i) s += x[r * k + i] * w[c * k + i];
      y[r * n + c] = s;
    }
  }
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("weld_matmul: x [m, k], w [n, k]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // ~64 KB of weights per chunk: enough chunks to balance the threads, few enough to be cheap.
  const int64_t grain = std::max<int64_t>(8, (16384 / std::max<int64_t>(k, 1)) / 8 * 8);
  weld::parallel_for(pool, n, grain, [xp, wp, yp, m, k, n](int64_t begin, int64_t end) {
    matmul_range(xp, wp, yp, m, k, n, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WeldMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [m, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [n, k]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [m, n]

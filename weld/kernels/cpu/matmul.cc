// y [m, n] = x [m, k] . w^T for any number of rows (decode steps and prefill chunks), with w
// packed in panels of 16 outputs (weld.models.common.layers.PackedWeight: panels [ceil(n / 16), k, 16]). XLA:CPU FFI;
// built by weld/kernels/cpu/__init__.py with -march=native.
//
// XLA:CPU's dot streams weights at 8-16 GB/s for one row, and at 2..64 rows its best form (a
// multiply + reduction) reaches about half the FMA peak. Here each panel is read front to back
// once per block of up to 6 rows: for every input feature, two 8-wide weight vectors are
// multiplied by 6 broadcast inputs into 12 accumulators in registers (no horizontal sums), and
// one row runs 4 panels at once to hide the FMA latency. Every output is one chain of fused
// multiply-adds over k in order, whatever the row count (batch invariance). Threads split the
// panels.

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;

#if defined(__AVX2__) && defined(__FMA__)
template <int MR>
inline void panel_block(const float* __restrict x, const float* __restrict wp, float* __restrict y, int64_t k,
                        int64_t n, int64_t r0, int64_t c0, int64_t width, const float* next) {
  // Every loop over i is unrolled: otherwise GCC keeps acc in memory and stores all 12
  // accumulators on every step (26 instead of ~55 GFLOPS per thread on the AVX2 box).
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const float* xr[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) xr[i] = x + (r0 + i) * k;
  for (int64_t kk = 0; kk < k; ++kk) {
    if (next) __builtin_prefetch(next + kk * 16);  // one line of the next panel per step
    __m256 w0 = _mm256_loadu_ps(wp + kk * 16), w1 = _mm256_loadu_ps(wp + kk * 16 + 8);
    // in registers: otherwise GCC folds the loads into each FMA and reads w MR times (load-bound)
    asm("" : "+x"(w0), "+x"(w1));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 xb = _mm256_broadcast_ss(xr[i] + kk);
      acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    float* dst = y + (r0 + i) * n + c0;
    if (width == 16) {
      _mm256_storeu_ps(dst, acc[i][0]);
      _mm256_storeu_ps(dst + 8, acc[i][1]);
    } else {
      alignas(32) float tmp[16];
      _mm256_store_ps(tmp, acc[i][0]);
      _mm256_store_ps(tmp + 8, acc[i][1]);
      std::copy(tmp, tmp + width, dst);
    }
  }
}

// One row against NP panels at once: each output's sum is the same single chain of fused
// multiply-adds over k as in panel_block (so a row's result is the same at any row count: batch
// invariance), and the NP independent chain pairs hide the FMA latency instead.
template <int NP>
inline void panel_row(const float* __restrict x, const float* __restrict wp, float* __restrict y, int64_t k,
                      int64_t n, int64_t c0) {
  __m256 acc[NP][2];
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m256 xb = _mm256_broadcast_ss(x + kk);
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      const float* w = wp + (q * k + kk) * kPanel;
      acc[q][0] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w), acc[q][0]);
      acc[q][1] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w + 8), acc[q][1]);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) {
    alignas(32) float tmp[16];
    _mm256_store_ps(tmp, acc[q][0]);
    _mm256_store_ps(tmp + 8, acc[q][1]);
    const int64_t col = c0 + q * kPanel;
    std::copy(tmp, tmp + std::min<int64_t>(kPanel, n - col), y + col);
  }
}

#endif

// Panels p_begin..p_end-1 of y: columns 16 p .. 16 p + 15 (fewer in a last, padded panel).
void packed_range(const float* x, const float* wp, float* y, int64_t m, int64_t k, int64_t n, int64_t p_begin,
                  int64_t p_end) {
#if defined(__AVX2__) && defined(__FMA__)
  if (m == 1) {
    for (int64_t p = p_begin; p < p_end; p += 4) {
      const float* panel = wp + p * k * kPanel;
      switch (std::min<int64_t>(4, p_end - p)) {
        case 1: panel_row<1>(x, panel, y, k, n, p * kPanel); break;
        case 2: panel_row<2>(x, panel, y, k, n, p * kPanel); break;
        case 3: panel_row<3>(x, panel, y, k, n, p * kPanel); break;
        default: panel_row<4>(x, panel, y, k, n, p * kPanel); break;
      }
    }
    return;
  }
#endif
  for (int64_t p = p_begin; p < p_end; ++p) {
    const float* panel = wp + p * k * kPanel;
    const float* next = p + 1 < p_end ? panel + k * kPanel : nullptr;  // fetched during the first block
    const int64_t c0 = p * kPanel, width = std::min<int64_t>(kPanel, n - c0);
#if defined(__AVX2__) && defined(__FMA__)
    int64_t r = 0;
    for (; r + 6 <= m; r += 6) panel_block<6>(x, panel, y, k, n, r, c0, width, r == 0 ? next : nullptr);
    switch (m - r) {
      case 5: panel_block<5>(x, panel, y, k, n, r, c0, width, r == 0 ? next : nullptr); break;
      case 4: panel_block<4>(x, panel, y, k, n, r, c0, width, r == 0 ? next : nullptr); break;
      case 3: panel_block<3>(x, panel, y, k, n, r, c0, width, r == 0 ? next : nullptr); break;
      case 2: panel_block<2>(x, panel, y, k, n, r, c0, width, r == 0 ? next : nullptr); break;
      case 1: panel_block<1>(x, panel, y, k, n, r, c0, width, r == 0 ? next : nullptr); break;
      default: break;
    }
#else
    for (int64_t r = 0; r < m; ++r) {
      float acc[kPanel] = {};
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t j = 0; j < kPanel; ++j) acc[j] += x[r * k + kk] * panel[kk * kPanel + j];
      std::copy(acc, acc + width, y + r * n + c0);
    }
#endif
  }
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                            ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[1] != xd[1] || pd[2] != kPanel ||
      yd[0] != xd[0] || yd[1] > pd[0] * kPanel || yd[1] <= (pd[0] - 1) * kPanel) {
    return ffi::Error::InvalidArgument("weld_packed_matmul: x [m, k], panels [ceil(n / 16), k, 16], y [m, n]");
  }
  const int64_t m = xd[0], k = xd[1], n = yd[1], num_panels = pd[0];
  const float* xp = x.typed_data();
  const float* wp = panels.typed_data();
  float* yp = y->typed_data();
  // Chunks of one panel, or of ~64 KB of small panels: many chunks to balance the threads.
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(k, 1));
  weld::parallel_for(pool, num_panels, grain, [xp, wp, yp, m, k, n](int64_t begin, int64_t end) {
    packed_range(xp, wp, yp, m, k, n, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WeldPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [m, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels [ceil(n / 16), k, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [m, n]

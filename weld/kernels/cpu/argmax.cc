// The greedy choice over each row of logits for XLA:CPU, called through the XLA FFI (built by
// weld/kernels/cpu/__init__.py): for x [m, v] f32,
//     index[r]  = the first j of the row's maximum (jnp.argmax: a NaN counts as the maximum, so
//                 the first NaN's index where there is one; a row of -inf gives 0),
//     finite[r] = 1 if every value of the row is finite, else 0.
//
// Why a kernel: XLA:CPU reduces a variadic (value, index) pair one element at a time on one
// thread: 1.8 ms for SmolLM2's 8 x 49,152 logits of a verification, 9.3 ms for Gemma 3's
// 16 x 262,144 of a batch-16 decode step, longer than the LM head that made them. Here one pass
// takes the maximum and whether anything is not finite (8 lanes), a second finds the first index
// that holds the maximum (or the first NaN), rows in parallel. Exact: the result does not depend
// on the row count, the thread or the lanes.

#include <cmath>
#include <cstdint>
#include <limits>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

void row_argmax(const float* x, int64_t v, int32_t* index, int8_t* finite) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float best = -kInf;
  bool bad = false;  // an inf or a NaN somewhere
  int64_t j = 0;
#if defined(__AVX2__)
  __m256 vbest = _mm256_set1_ps(-kInf), vbad = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(kInf);
  for (; j + 8 <= v; j += 8) {
    const __m256 x8 = _mm256_loadu_ps(x + j);
    vbest = _mm256_max_ps(x8, vbest);  // a NaN lane keeps vbest: NaNs are found below
    vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(_mm256_and_ps(x8, magnitude), inf, _CMP_NLT_UQ));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vbest);
  for (float lane : lanes) best = lane > best ? lane : best;
  bad = _mm256_movemask_ps(vbad) != 0;
#endif
  for (; j < v; ++j) {
    best = x[j] > best ? x[j] : best;
    bad |= !(std::fabs(x[j]) < kInf);
  }
  int64_t at = 0;
  bool nan = false;
  if (bad) {  // rare: the first NaN, if any, is the answer
    while (at < v && x[at] == x[at]) ++at;
    nan = at < v;
  }
  if (!nan) {
    at = 0;
#if defined(__AVX2__)
    const __m256 target = _mm256_set1_ps(best);
    for (; at + 8 <= v; at += 8) {
      const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + at), target, _CMP_EQ_OQ));
      if (hits) {
        at += __builtin_ctz(hits);
        break;
      }
    }
#endif
    while (at < v - 1 && x[at] != best) ++at;
  }
  *index = static_cast<int32_t>(at);
  *finite = static_cast<int8_t>(!bad);
}

ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> index,
                      ffi::ResultBuffer<ffi::S8> finite) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] < 1 || xd[1] > std::numeric_limits<int32_t>::max() ||
      index->element_count() != xd[0] || finite->element_count() != xd[0]) {
    return ffi::Error::InvalidArgument("weld_argmax: x [m, v] with 1 <= v < 2^31, index [m], finite [m]");
  }
  const int64_t m = xd[0], v = xd[1];
  const float* xp = x.typed_data();
  int32_t* ip = index->typed_data();
  int8_t* fp = finite->typed_data();
  const int64_t grain = std::max<int64_t>(1, 32768 / v);  // rows of ~128 KB per task
  weld::parallel_for(pool, m, grain, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_argmax(xp + r * v, v, ip + r, fp + r);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WeldArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [m, v]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // index [m]
                                  .Ret<ffi::Buffer<ffi::S8>>());  // finite [m]

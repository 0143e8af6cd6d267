// Paged attention for XLA:CPU (decode steps, verification and prefill chunks), called through the
// XLA FFI (weld/kernels/cpu/__init__.py builds this file on the machine that runs it, with
// -march=native).
//
// XLA:CPU runs the jnp form of paged attention (weld/models/common/attention.py) as a gather of
// whole K/V tiles into new buffers, a transposed copy and batched dots of a few rows each; at
// batch 16 that is a third of a decode step, and a 1024-token prefill spends most of its time
// there. This kernel reads each row's pages where they lie, once per block of 16 queries, for all
// the query heads that share a kv head, under an online softmax; a query skips the pages it does
// not see (causal and sliding-window masks cost nothing).
//
// Semantics are those of `paged_attention` for queries that read the pools (the new K/V were
// written before the call): query (b, t, head) at position p >= 0 attends to positions
// max(0, p - window + 1) .. p (window 0: no window) of row b, position j lying in page
// block_tables[b, j / page_size] at row j % page_size. A query with p < 0 is padding: its output
// is 0 and its log-sum-exp is -1e30.
//
// The pools hold f32, f16 or bf16 (the engine's KV dtype); each element is widened to f32 as it is
// read, and every sum is in f32.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "half.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define WELD_PA_AVX2 1
#include <immintrin.h>
#endif
// AVX-512 (16 lanes) for head sizes that are a multiple of 16, where -march has it; the AVX2
// path stays for other sizes and CPUs (tests/kernels/test_cpu_baseline_build.py builds it here).
#if WELD_PA_AVX2 && defined(__AVX512F__)
#define WELD_PA_AVX512 1
#endif

namespace ffi = xla::ffi;
using weld::BF16;
using weld::F16;
using weld::to_float;

namespace {

constexpr float kMasked = -1e30f;  // the jnp path's mask value: lse of padding rows
constexpr int64_t kQueryBlock = 16;  // queries of one row that share each page's visit
// Key rows folded into a query's online softmax at once (whole pages, at least one): its max,
// rescale and sums are paid once per span instead of once per page.
constexpr int64_t kSpanRows = 64;

template <typename T>
struct Problem {
  const float* q;        // [b, t, h, e]
  const T* k_pool;       // [P, page, kv * e]
  const T* v_pool;
  const int32_t* tables;  // [b, nb]
  const int32_t* qpos;    // [b, t]
  float* out;             // [b, t, h, e]
  float* lse;             // [b, t, h]
  int64_t b, t, h, e, kv, g, pages, page_size, nb, window;
  float scale;
};

template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_float(b[i]);
  return s;
}

// Online-softmax state of one query head: running max, denominator and numerator [e].
struct HeadState {
  float m, l;
  float* acc;
};

#if WELD_PA_AVX2
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// The lane sums of 8 vectors at once: lane i of the result is the sum of a[i]'s lanes, each as
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) (9 instructions for 8 sums).
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 pool elements widened to f32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const BF16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// exp's constants, for every vector width: x = n ln2 + r with ln2 in two parts (hi exact in
// f32), |r| <= ln2 / 2, exp(r) ~ 1 + r + r^2 p(r) with p of degree 4 (relative error ~2e-7);
// inputs below kExpLow (masked scores) give 0.
constexpr float kExpLow = -87.0f, kExpHigh = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[5] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                               5.0000001201e-1f};

// exp of 8 lanes (kExp*'s rule).
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpLow);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 5; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// One vector width's operations for `scores`.
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load_q(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T>
  static V load(const T* p) { return load8(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_sums(float* p, const V* a) { _mm256_storeu_ps(p, hsum8(a)); }
};

// Scores of rows lo..hi-1 against one query head qg [e = W::kLanes * NV] into s[lo..hi-1],
// W::kLanes rows at a time: as many independent sums (they hide the FMA latency), reduced
// together in one fixed tree, so a row's score has the same bits wherever it falls. Past hi the
// last row is read again and its lanes never used (s holds kLanes of slack past the span).
template <typename W, int64_t NV, typename T>
inline void scores(const float* __restrict qg, const T* const* krow, int64_t lo, int64_t hi, float* __restrict s) {
  constexpr int64_t L = W::kLanes;
  for (int64_t r = lo; r < hi; r += L) {
    typename W::V a[L];
    const T* kr[L];
    for (int i = 0; i < L; ++i) {
      a[i] = W::zero();
      kr[i] = krow[std::min<int64_t>(r + i, hi - 1)];
    }
    for (int64_t c = 0; c < NV; ++c) {
      const typename W::V qv = W::load_q(qg + L * c);
      for (int i = 0; i < L; ++i) a[i] = W::fma(qv, W::template load<T>(kr[i] + L * c), a[i]);
    }
    W::store_sums(s + r, a);
  }
}
#endif

#if WELD_PA_AVX2
// fold_rows for e = 8 * N8 (a compile-time constant, so the loops over e unroll).
template <int64_t N8, typename T>
void fold_rows_avx2(const float* __restrict qs, const T* const* krow, const T* const* vrow, int64_t lo, int64_t hi,
                    int64_t g, HeadState* st, float* __restrict s) {
    constexpr int64_t n8 = N8, e = 8 * N8;
    for (int64_t gi = 0; gi < g; ++gi) {
      HeadState& h = st[gi];
      const float* qg = qs + gi * e;
      scores<Lanes8, N8>(qg, krow, lo, hi, s);
      int64_t r;
      float mx = h.m;
      for (r = lo; r < hi; ++r) mx = std::max(mx, s[r]);
      const float correction = std::exp(h.m - mx);
      // Weights, 8 at a time; lanes past hi are zeroed.
      float sum = 0.f;
      const __m256 mv = _mm256_set1_ps(mx);
      for (r = lo; r < hi; r += 8) {
        const int64_t valid = std::min<int64_t>(8, hi - r);
        __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + r), mv));
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        w = _mm256_and_ps(w, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane)));
        _mm256_storeu_ps(s + r, w);
        sum += hsum(w);
      }
      // Numerator: acc = acc * correction + sum_r w_r v_r, kept in registers over the rows.
      __m256 acc[N8];
      const __m256 cv = _mm256_set1_ps(correction);
      for (int64_t c = 0; c < n8; ++c) acc[c] = _mm256_mul_ps(_mm256_loadu_ps(h.acc + 8 * c), cv);
      for (r = lo; r < hi; ++r) {
        const __m256 w = _mm256_set1_ps(s[r]);
        const T* vr = vrow[r];
        for (int64_t c = 0; c < n8; ++c) acc[c] = _mm256_fmadd_ps(w, load8(vr + 8 * c), acc[c]);
      }
      for (int64_t c = 0; c < n8; ++c) _mm256_storeu_ps(h.acc + 8 * c, acc[c]);
      h.m = mx;
      h.l = h.l * correction + sum;
    }
}
#endif

#if WELD_PA_AVX512
// The lane sums of 16 vectors at once: lane i of the result is the sum of a[i]'s lanes, in one
// tree for every vector wherever it sits (lanes j + 8, then + 4, + 2, + 1), so that a key's score
// has the same bits in any group of 16.
inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // quarters 0, 1 of a[2i] and of a[2i + 1]: lanes j + (j + 8)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quarter k: a[4i + k]'s four partial sums
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // quarter k: two partial sums of a[8i + k], then two of a[8i + 4 + k]
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter k, element j: the sum of a[k + 4 j]; put it in lane k + 4 j
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// exp of 16 lanes (kExp*'s rule, as exp8).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpLow);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));
}

struct Lanes16 {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load_q(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T>
  static V load(const T* p) { return load16(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_sums(float* p, const V* a) { _mm512_storeu_ps(p, hsum16(a)); }
};

// The weighted sum of value rows lo..hi-1 for G query heads at once: acc[gi] = acc[gi] *
// correction[gi] + sum_r w[gi][r] v_r, each head's sum one chain of fused multiply-adds over the
// rows in order (the same bits as a head alone); the value row's loads are shared by the G heads,
// and the G x N16 independent chains keep both FMA units busy.
template <int64_t N16, int G, typename T>
inline void weigh_values_avx512(const T* const* vrow, int64_t lo, int64_t hi, const float* const* w,
                                const float* correction, HeadState* st) {
  __m512 acc[G][N16];
  for (int gi = 0; gi < G; ++gi) {
    const __m512 cv = _mm512_set1_ps(correction[gi]);
    for (int64_t c = 0; c < N16; ++c) acc[gi][c] = _mm512_mul_ps(_mm512_loadu_ps(st[gi].acc + 16 * c), cv);
  }
  for (int64_t r = lo; r < hi; ++r) {
    const T* vr = vrow[r];
    __m512 v[N16];
    for (int64_t c = 0; c < N16; ++c) v[c] = load16(vr + 16 * c);
    for (int gi = 0; gi < G; ++gi) {
      const __m512 wv = _mm512_set1_ps(w[gi][r]);
      for (int64_t c = 0; c < N16; ++c) acc[gi][c] = _mm512_fmadd_ps(wv, v[c], acc[gi][c]);
    }
  }
  for (int gi = 0; gi < G; ++gi)
    for (int64_t c = 0; c < N16; ++c) _mm512_storeu_ps(st[gi].acc + 16 * c, acc[gi][c]);
}

// fold_rows for e = 16 * N16: fold_rows_avx2's steps on 16 lanes (scores of 16 rows at a time),
// the g heads' weighted sums of values taken together (weigh_values_avx512). s: [g, span + 16].
template <int64_t N16, typename T>
void fold_rows_avx512(const float* __restrict qs, const T* const* krow, const T* const* vrow, int64_t lo, int64_t hi,
                      int64_t g, HeadState* st, float* __restrict s, int64_t stride) {
  constexpr int64_t e = 16 * N16;
  constexpr int kMostHeads = N16 <= 4 ? 4 : N16 <= 8 ? 2 : 1;  // G x N16 accumulators in 32 registers
  float correction[kMostHeads];
  const float* w[kMostHeads];
  for (int64_t g0 = 0; g0 < g; g0 += kMostHeads) {
    const int heads = static_cast<int>(std::min<int64_t>(kMostHeads, g - g0));
    for (int gi = 0; gi < heads; ++gi) {
      HeadState& h = st[g0 + gi];
      const float* qg = qs + (g0 + gi) * e;
      float* sg = s + gi * stride;
      scores<Lanes16, N16>(qg, krow, lo, hi, sg);
      __m512 top = _mm512_set1_ps(h.m);
      for (int64_t r = lo; r < hi; r += 16) {
        const __mmask16 keep = static_cast<__mmask16>((1u << std::min<int64_t>(16, hi - r)) - 1u);
        top = _mm512_mask_max_ps(top, keep, top, _mm512_loadu_ps(sg + r));
      }
      const float mx = _mm512_reduce_max_ps(top);
      correction[gi] = std::exp(h.m - mx);
      __m512 sums = _mm512_setzero_ps();  // lane j: the weights of rows lo + j, lo + 16 + j, ...
      const __m512 mv = _mm512_set1_ps(mx);
      for (int64_t r = lo; r < hi; r += 16) {
        const __mmask16 keep = static_cast<__mmask16>((1u << std::min<int64_t>(16, hi - r)) - 1u);
        const __m512 wv = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + r), mv)));
        _mm512_storeu_ps(sg + r, wv);
        sums = _mm512_add_ps(sums, wv);
      }
      h.m = mx;
      h.l = h.l * correction[gi] + _mm512_reduce_add_ps(sums);
      w[gi] = sg;
    }
    switch (heads) {
      case 4: if constexpr (kMostHeads >= 4) weigh_values_avx512<N16, 4, T>(vrow, lo, hi, w, correction, st + g0); break;
      case 3: if constexpr (kMostHeads >= 3) weigh_values_avx512<N16, 3, T>(vrow, lo, hi, w, correction, st + g0); break;
      case 2: if constexpr (kMostHeads >= 2) weigh_values_avx512<N16, 2, T>(vrow, lo, hi, w, correction, st + g0); break;
      default: weigh_values_avx512<N16, 1, T>(vrow, lo, hi, w, correction, st + g0); break;
    }
  }
}
#endif

// Folds the key rows lo..hi-1 of a span (krow[r], vrow[r]: one kv head's key and value of row r)
// into the g query heads qs [g, e] that share that kv head. s: scratch [4, stride] for scores,
// stride = the longest span + 16.
template <typename T>
inline void fold_rows(const float* __restrict qs, const T* const* krow, const T* const* vrow, int64_t lo, int64_t hi,
                      int64_t e, int64_t g, HeadState* st, float* __restrict s, int64_t stride) {
#if WELD_PA_AVX512
  switch (e) {
    case 64: return fold_rows_avx512<4, T>(qs, krow, vrow, lo, hi, g, st, s, stride);
    case 128: return fold_rows_avx512<8, T>(qs, krow, vrow, lo, hi, g, st, s, stride);
    case 96: return fold_rows_avx512<6, T>(qs, krow, vrow, lo, hi, g, st, s, stride);
    case 32: return fold_rows_avx512<2, T>(qs, krow, vrow, lo, hi, g, st, s, stride);
    case 256: return fold_rows_avx512<16, T>(qs, krow, vrow, lo, hi, g, st, s, stride);
    default: break;
  }
#endif
#if WELD_PA_AVX2
  switch (e) {
    case 64: return fold_rows_avx2<8, T>(qs, krow, vrow, lo, hi, g, st, s);
    case 128: return fold_rows_avx2<16, T>(qs, krow, vrow, lo, hi, g, st, s);
    case 96: return fold_rows_avx2<12, T>(qs, krow, vrow, lo, hi, g, st, s);
    case 32: return fold_rows_avx2<4, T>(qs, krow, vrow, lo, hi, g, st, s);
    case 256: return fold_rows_avx2<32, T>(qs, krow, vrow, lo, hi, g, st, s);
    default: break;
  }
#endif
  for (int64_t gi = 0; gi < g; ++gi) {
    HeadState& h = st[gi];
    float mx = h.m;
    for (int64_t r = lo; r < hi; ++r) {
      s[r] = dot(qs + gi * e, krow[r], e);
      mx = std::max(mx, s[r]);
    }
    const float correction = std::exp(h.m - mx);
    float* __restrict a = h.acc;
    float sum = h.l * correction;
    for (int64_t i = 0; i < e; ++i) a[i] *= correction;
    for (int64_t r = lo; r < hi; ++r) {
      const float w = std::exp(s[r] - mx);
      sum += w;
      const T* __restrict vr = vrow[r];
      for (int64_t i = 0; i < e; ++i) a[i] += w * to_float(vr[i]);
    }
    h.m = mx;
    h.l = sum;
  }
}

template <typename T>
inline void prefetch_page(const T* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elements * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

// Pages of one span: kSpanRows rows of whole pages, at least one page.
inline int64_t span_pages(int64_t page_size) { return std::max<int64_t>(1, kSpanRows / page_size); }

// One work item: queries t0..t1-1 of row `row` (consecutive tokens of one sequence, e.g. a prefill
// chunk), kv heads kh0..kh1-1 with their g query heads each. Pages are visited once for the whole
// block, front to back, a span of consecutive pages at a time (the next span prefetched): each
// span is folded into every query of the block that sees part of it while it is in cache. A query
// with position < 0 is padding. rows: scratch for 2 x the span's rows of pointers.
template <typename T>
void attend(const Problem<T>& P, int64_t row, int64_t t0, int64_t t1, int64_t kh0, int64_t kh1, float* scratch,
            HeadState* st, const T** rows) {
  const int64_t e = P.e, g = P.g, nh = (kh1 - kh0) * g, nq = t1 - t0;
  float* acc = scratch;               // [nq, nh, e]
  float* qs = acc + nq * nh * e;      // [nq, nh, e] scaled queries
  float* s = qs + nq * nh * e;        // [4, stride] scores
  const int64_t stride = span_pages(P.page_size) * P.page_size + 16;
  int64_t lowest = INT64_MAX, highest = -1;  // the block's visible positions
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t qbase = (row * P.t + t0 + j) * P.h + kh0 * g;  // the query's first head of this item
    const int32_t p = P.qpos[row * P.t + t0 + j];
    for (int64_t i = 0; i < nh; ++i) {
      const float* src = P.q + (qbase + i) * e;
      for (int64_t c = 0; c < e; ++c) qs[(j * nh + i) * e + c] = src[c] * P.scale;
      st[j * nh + i] = HeadState{kMasked, 0.f, acc + (j * nh + i) * e};
    }
    if (p >= 0) {
      lowest = std::min<int64_t>(lowest, P.window > 0 ? std::max<int64_t>(0, p - P.window + 1) : 0);
      highest = std::max<int64_t>(highest, p);
    }
  }
  std::fill(acc, acc + nq * nh * e, 0.f);
  const int64_t row_stride = P.kv * e;  // between consecutive tokens of a page
  const int64_t page_elements = P.page_size * row_stride;
  auto page_of = [&](int64_t block) -> int64_t {
    const int32_t page = P.tables[row * P.nb + block];
    return page < 0 || page >= P.pages ? -1 : page;  // never out of range for positions a query sees
  };
  if (highest >= 0) {
    const int64_t last_block = std::min<int64_t>(highest / P.page_size, P.nb - 1);
    const int64_t most = span_pages(P.page_size);
    const T** krow = rows;
    const T** vrow = rows + most * P.page_size;
    for (int64_t block = lowest / P.page_size; block <= last_block;) {
      if (page_of(block) < 0) {
        ++block;
        continue;
      }
      // The span: blocks [block, end), every page present, inside one aligned run of `most` blocks,
      // so a query's rows fold in the same groups whatever the block's other queries see (a decode
      // step's query and the same query in a verification give the same bits).
      const int64_t limit = std::min(last_block + 1, (block / most + 1) * most);
      int64_t end = block + 1;
      while (end < limit && page_of(end) >= 0) ++end;
      for (int64_t next = end; next <= std::min(last_block, end + most - 1); ++next) {
        const int64_t page = page_of(next);
        if (page >= 0) {
          prefetch_page(P.k_pool + page * page_elements, page_elements);
          prefetch_page(P.v_pool + page * page_elements, page_elements);
        }
      }
      const int64_t start = block * P.page_size, span = (end - block) * P.page_size;
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        for (int64_t r = 0, b = block; b < end; ++b) {  // the kv head's rows, page by page
          const T* kp = P.k_pool + page_of(b) * page_elements + kh * e;
          const T* vp = P.v_pool + page_of(b) * page_elements + kh * e;
          for (int64_t i = 0; i < P.page_size; ++i, ++r) krow[r] = kp + i * row_stride, vrow[r] = vp + i * row_stride;
        }
        for (int64_t j = 0; j < nq; ++j) {
          const int32_t p = P.qpos[row * P.t + t0 + j];
          const int64_t first = P.window > 0 ? std::max<int64_t>(0, p - P.window + 1) : 0;
          const int64_t lo = std::max(start, first) - start;
          const int64_t hi = std::min<int64_t>(span, p - start + 1);
          if (p < 0 || lo >= hi) continue;
          const int64_t at = j * nh + (kh - kh0) * g;
          fold_rows(qs + at * e, krow, vrow, lo, hi, e, g, st + at, s, stride);
        }
      }
      block = end;
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t qbase = (row * P.t + t0 + j) * P.h + kh0 * g;
    const bool padding = P.qpos[row * P.t + t0 + j] < 0;
    for (int64_t i = 0; i < nh; ++i) {
      const HeadState& h = st[j * nh + i];
      const float denom = std::max(h.l, 1e-30f);
      float* dst = P.out + (qbase + i) * e;
      for (int64_t c = 0; c < e; ++c) dst[c] = padding ? 0.f : acc[(j * nh + i) * e + c] / denom;
      P.lse[qbase + i] = padding ? kMasked : h.m + std::log(denom);
    }
  }
}

template <typename T>
ffi::Error Run(ffi::ThreadPool& pool, Problem<T> P) {
  P.g = P.h / P.kv;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Item i covers a block of up to `qblock` queries of one row and kv heads [chunk * per,
  // (chunk + 1) * per): every kv head (each page is read once per block, front to back) when there
  // are enough items to keep every thread busy; otherwise one item per kv head, and the queries in
  // blocks small enough for at least two items per thread (a verification's k + 1 queries on
  // 3 kv heads made 3 items for 2 threads: one thread did two, the other one).
  const int64_t full_blocks = (P.t + kQueryBlock - 1) / kQueryBlock;
  const int64_t chunks = P.b * full_blocks >= 2 * threads ? 1 : P.kv;
  const int64_t wanted = 2 * threads, per_query = P.b * chunks;  // items per query block's worth of queries
  const int64_t qblock = chunks == 1 ? kQueryBlock
                                     : std::clamp<int64_t>(P.t * per_query / wanted, 1, kQueryBlock);
  const int64_t blocks = (P.t + qblock - 1) / qblock;
  weld::parallel_for(pool, P.b * blocks * chunks, 1, [P, chunks, blocks, qblock](int64_t begin, int64_t end) {
    const int64_t per = P.kv / chunks, nh = per * P.g, nq = std::min<int64_t>(qblock, P.t);
    const int64_t span = span_pages(P.page_size) * P.page_size;
    std::vector<float> scratch(2 * nq * nh * P.e + 4 * (span + 16));  // + 16: whole-vector reads of s
    std::vector<HeadState> st(nq * nh);
    std::vector<const T*> rows(2 * span);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i % chunks, qb = (i / chunks) % blocks, row = i / (chunks * blocks);
      const int64_t t0 = qb * qblock, t1 = std::min(P.t, t0 + qblock);
      attend(P, row, t0, t1, chunk * per, (chunk + 1) * per, scratch.data(), st.data(), rows.data());
    }
  });
  return ffi::Error::Success();
}

template <typename T>
Problem<T> problem(const ffi::Buffer<ffi::F32>& q, const ffi::AnyBuffer& k_pool, const ffi::AnyBuffer& v_pool,
                   const ffi::Buffer<ffi::S32>& tables, const ffi::Buffer<ffi::S32>& qpos, float* out, float* lse,
                   int64_t window, float scale) {
  auto qd = q.dimensions(), kd = k_pool.dimensions(), td = tables.dimensions();
  return Problem<T>{q.typed_data(), static_cast<const T*>(k_pool.untyped_data()),
                    static_cast<const T*>(v_pool.untyped_data()), tables.typed_data(), qpos.typed_data(), out, lse,
                    qd[0], qd[1], qd[2], qd[3], kd[2] / qd[3], 0, kd[0], kd[1], td[1], window, scale};
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool,
                              ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> qpos, ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<ffi::F32> lse, int64_t window, float scale) {
  auto qd = q.dimensions(), kd = k_pool.dimensions(), td = tables.dimensions();
  auto vd = v_pool.dimensions(), pd = qpos.dimensions();
  if (qd.size() != 4 || kd.size() != 3 || td.size() != 2 || vd.size() != 3 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || k_pool.element_type() != v_pool.element_type()) {
    return ffi::Error::InvalidArgument("weld_paged_attention: q [b,t,h,e], pools [P,page,kv*e] of one dtype, tables [b,n]");
  }
  if (qd[3] == 0 || kd[2] % qd[3] != 0 || kd[2] == 0 || qd[2] % (kd[2] / qd[3]) != 0 || td[0] != qd[0] ||
      pd.size() != 2 || pd[0] != qd[0] || pd[1] != qd[1]) {
    return ffi::Error::InvalidArgument("weld_paged_attention: mismatched shapes");
  }
  float *o = out->typed_data(), *l = lse->typed_data();
  switch (k_pool.element_type()) {
    case ffi::DataType::F32: return Run(pool, problem<float>(q, k_pool, v_pool, tables, qpos, o, l, window, scale));
    case ffi::DataType::F16: return Run(pool, problem<F16>(q, k_pool, v_pool, tables, qpos, o, l, window, scale));
    case ffi::DataType::BF16: return Run(pool, problem<BF16>(q, k_pool, v_pool, tables, qpos, o, l, window, scale));
    default: return ffi::Error::InvalidArgument("weld_paged_attention: pools must be f32, f16 or bf16");
  }
}

}  // namespace

// Whether this library's compile-time vector paths are the AVX2 ones (here and in matmul.cc,
// norm.cc and argmax.cc, which test the same macros), or the portable scalar ones.
#if WELD_PA_AVX2
extern "C" int weld_cpu_built_with_avx2() { return 1; }
#else
extern "C" int weld_cpu_built_with_avx2() { return 0; }
#endif
// Whether attention's 16-lane path is compiled in (-march with AVX-512F).
#if WELD_PA_AVX512
extern "C" int weld_cpu_built_with_avx512() { return 1; }
#else
extern "C" int weld_cpu_built_with_avx512() { return 0; }
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(WeldPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pool: f32, f16 or bf16
                                  .Arg<ffi::AnyBuffer>()         // v_pool: the same dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query positions
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));

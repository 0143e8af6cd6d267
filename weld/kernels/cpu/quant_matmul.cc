// y [m, n] = x [m, k] . W^T for weights quantized in blocks of 32 inputs per output
// (weld.models.common.layers.QuantWeight), for any number of rows. XLA:CPU FFI; built by
// weld/kernels/cpu/__init__.py.
//
// Weights: per output o and block b of 32 inputs, unsigned codes c (8, 6, 5 or 4 bits), a scale d[o, b]
// and, in formats with one, a min mn[o, b] (f16):
//     w = d * (c - offset)      offset 128: int8 / Q8_0;  32: Q6_K;  16: Q5_0;  8: int4 / Q4_0
//     w = d * c + mn            Q4_1, Q5_1, Q4_K, Q5_K (offset 0, mins)
// With sub = 2 (Q6_K) each half block (16 inputs) has its own scale (and min): d[o, b, s]. With
// group = 2^gshift > 1 (int4_g128: 4) that many blocks share one: block b takes d[o, b >> gshift].
// With a table (MXFP4's e2m1 grid), 4-bit codes are indices: c = 128 + table[code] (int8), offset 128.
// Activations: each row's block of 32 is quantized to int8 on entry, xq = round(x / sx) with
// sx = max|x| / 127, and xsum = sum of xq (llama.cpp's Q8 activations). Then
//     y[r, o] = sum_b sx[r, b] * sum_s (d[o, b, s] * dot(c[o, b, s], xq[r, b, s]) + mv[o, b, s] * xsum[r, b, s]),
//     mv = mn, or -offset * d, over the sub-blocks s (one, or the two halves),
// With digits = 2 the rounding residual x - sx * xq is quantized again, with the scale
// sx2 = max|x| / 32258 (half a step of sx over 127), and its product added: activations then
// carry ~15 bits instead of 8, for twice the integer work (the "int8" mode's accuracy).
// where dot is an exact integer dot product in registers: AVX-512 VNNI (vpdpbusd: u8 x s8, 4 at a
// time into 16 lanes) where the CPU has it, AVX2 (vpmaddubsw + vpmaddwd) otherwise, else scalar.
// The path is an attribute chosen by the caller (weld.kernels.cpu.quant_isa: from the CPU flags),
// so every path runs on a machine that has it.
//
// Layout (panels of 16 outputs, as the f32 packed kernel): codes [P, nb, bytes]; in a block, group
// g of 4 inputs (32 b + 4 g .. + 3) for the 16 outputs is 64 bytes [o][j]. 8 bits: groups 0..7 one
// after another (512 bytes); 4 bits: 256 bytes, byte [g][o][j] holding group g in its low nibble
// and group g + 4 in its high nibble; 5 and 6 bits: the 4-bit layout of the low nibbles, then one
// (two) 64-byte planes of the fifth (and sixth) bits, byte [o][j] of a plane holding in bit g that
// bit of input 4 g + j (320 or 384 bytes). Scales and mins [P, ng, 16] (ng = nb / group, rounded
// up). Rows pad k to whole blocks
// with zeros; padded outputs have code `offset` (weight 0). With sub = 2, scales and mins are
// [P, nb, 2 * 16]: the first half's 16 outputs, then the second's; in the 4-bit layout the first
// half is the low nibbles, the second the high ones.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "half.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;
// Up to this many rows a call streams its weights in one contiguous run of panels per thread (see
// QuantMatmulImpl): 8 before 2026-12-07; at 16 rows the chunked path took 10.1 ms against 8.7
// (benchmarks/quant_matmul.py, SmolLM2's projections in int4, 2-core EPYC), at 32 17.8 against
// 16.3, at 64 33.2 against 31.7.
constexpr int64_t kStreamRows = 64;
// Bytes of one block of one panel: 8-bit codes, or the 4-bit layout plus a plane per bit above 4.
constexpr int64_t block_bytes(int64_t bits) { return bits == 8 ? 512 : 256 + 64 * (bits - 4); }
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kVnni = 2 };

using weld::half_to_float;

// One digit of each row's activations quantized per block of 32: codes [m, nb * 32] (zero-padded),
// the block's scale and scale * (the sum of its codes), the factor of the weights' mins (or
// offset). The first digit's products are stored in y, a second digit's (`accumulate`) added.
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> scaled_sum;  // [m, nb]: scale * the sum of the block's codes
  std::vector<float> half_sum;    // [m, nb, 2]: the same of each half block (sub-blocks of 16)
  int64_t nb;
  bool accumulate;

  Activations(int64_t m, int64_t nb_, bool accumulate_ = false)
      : q(m * nb_ * kBlock, 0), scale(m * nb_), scaled_sum(m * nb_), half_sum(2 * m * nb_), nb(nb_),
        accumulate(accumulate_) {}

  // first: null for the first digit (x itself), else the first digit, whose residual is quantized.
  // A whole block takes the isa's vector form (the same operations lane by lane: the same codes);
  // a block cut short by k, and the scalar isa, the loop below.
  void quantize_rows(const float* x, int64_t k, int64_t begin, int64_t end, int64_t isa,
                     const Activations* first = nullptr) {
    const float levels = first ? 32258.0f : 127.0f;  // the residual is within half a first step
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t lo = b * kBlock, hi = std::min(k, lo + kBlock);
        const float* xb = x + r * k + lo;
        const int8_t* q1 = first ? first->row(r) + lo : nullptr;
        const float s1 = first ? first->scale[r * nb + b] : 0.0f;
        int8_t* out = q.data() + r * nb * kBlock + lo;
        float s;
        int32_t halves[2];
        if (hi - lo == kBlock && isa == kVnni) {
          s = quantize_block_avx512(xb, q1, s1, levels, out, halves);
        } else if (hi - lo == kBlock && isa == kAvx2) {
          s = quantize_block_avx2(xb, q1, s1, levels, out, halves);
        } else {
          s = quantize_block_scalar(xb, hi - lo, q1, s1, levels, out, halves);
        }
        scale[r * nb + b] = s;
        scaled_sum[r * nb + b] = s * static_cast<float>(halves[0] + halves[1]);
        half_sum[2 * (r * nb + b)] = s * static_cast<float>(halves[0]);
        half_sum[2 * (r * nb + b) + 1] = s * static_cast<float>(halves[1]);
      }
    }
  }
  // One block of `len` <= 32 inputs (q1: the first digit's codes, for a residual): its codes, the
  // sums of its halves' codes; returns its scale max|x| / levels (NaNs ignored, as std::max does).
  static float quantize_block_scalar(const float* x, int64_t len, const int8_t* q1, float s1, float levels, int8_t* out,
                                     int32_t halves[2]) {
    float amax = 0.0f;
    for (int64_t j = 0; j < len; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float inv = amax > 0.0f ? levels / amax : 0.0f;
    int32_t sum = 0;
    for (int64_t j = 0; j < len; ++j) {
      const float v = q1 ? std::fma(-static_cast<float>(q1[j]), s1, x[j]) : x[j];
      const int32_t c = std::clamp(static_cast<int32_t>(std::nearbyint(v * inv)), -127, 127);
      out[j] = static_cast<int8_t>(c);
      sum += c;
    }
    // the first half's sum in a pass of its own: one running sum keeps the loop above vectorized
    // where the compiler can (an indexed pair of sums made it ~7x slower)
    halves[0] = 0;
    for (int64_t j = 0; j < std::min<int64_t>(len, kBlock / 2); ++j) halves[0] += out[j];
    halves[1] = sum - halves[0];
    return amax / levels;
  }
#if defined(__x86_64__)
  // Lane by lane the scalar form's operations: max_ps returns its second operand where either is a
  // NaN (as std::max(amax, NaN) keeps amax), cvtps rounds half to even (nearbyint's default mode),
  // and a NaN or an overflow converts to INT32_MIN, clamped to -127 (the scalar cast gives the same).
  __attribute__((target("avx512f,avx512bw"))) static float quantize_block_avx512(
      const float* x, const int8_t* q1, float s1, float levels, int8_t* out, int32_t halves[2]) {
    __m512 v[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
    const __m512 m = _mm512_max_ps(_mm512_abs_ps(v[1]), _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps()));
    const float amax = _mm512_reduce_max_ps(m);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
    for (int h = 0; h < 2; ++h) {
      if (q1) {
        const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + 16 * h))));
        v[h] = _mm512_fnmadd_ps(c1, _mm512_set1_ps(s1), v[h]);
      }
      __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], inv));
      c = _mm512_min_epi32(_mm512_max_epi32(c, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h), _mm512_cvtepi32_epi8(c));
      halves[h] = _mm512_reduce_add_epi32(c);
    }
    return amax / levels;
  }
  __attribute__((target("avx2,fma"))) static float quantize_block_avx2(const float* x, const int8_t* q1, float s1,
                                                                       float levels, int8_t* out, int32_t halves[2]) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      m = _mm256_max_ps(_mm256_and_ps(v[i], abs_mask), m);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) {
      if (q1) {
        const __m256 c1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q1 + 8 * i))));
        v[i] = _mm256_fnmadd_ps(c1, _mm256_set1_ps(s1), v[i]);
      }
      c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      c[i] = _mm256_min_epi32(_mm256_max_epi32(c[i], _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
    }
    // int32 -> int8 (in range, so saturation is exact); packs interleave 128-bit lanes, the
    // permutation puts the 4-byte groups back in order
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
    for (int h = 0; h < 2; ++h) {
      const __m256i t = _mm256_add_epi32(c[2 * h], c[2 * h + 1]);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      halves[h] = _mm_cvtsi128_si32(s4);
    }
    return amax / levels;
  }
#else
  static float quantize_block_avx512(const float* x, const int8_t* q1, float s1, float levels, int8_t* out,
                                     int32_t halves[2]) {
    return quantize_block_scalar(x, kBlock, q1, s1, levels, out, halves);
  }
  static float quantize_block_avx2(const float* x, const int8_t* q1, float s1, float levels, int8_t* out,
                                   int32_t halves[2]) {
    return quantize_block_scalar(x, kBlock, q1, s1, levels, out, halves);
  }
#endif
  const int8_t* row(int64_t r) const { return q.data() + r * nb * kBlock; }

  // The VNNI path's copy, tiles of kTileRows rows (the last padded with zeros): per tile and block,
  // the 8 groups of 4 codes of each row as words [g][row], then the scales [row], the scaled sums
  // [row] and the half sums [2][row]. A tile's broadcasts and scales are then fixed offsets from
  // one pointer, not a pointer per row (which spilled the general registers at 8 rows).
  static constexpr int64_t kTileRows = 8;
  static constexpr int64_t kTileWords = 8 * kTileRows + 4 * kTileRows;  // one block of one tile
  std::vector<int32_t> tiles;
  void tile_rows(int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r % kTileRows;
      int32_t* t = tiles.data() + (r / kTileRows) * nb * kTileWords;
      for (int64_t b = 0; b < nb; ++b, t += kTileWords) {
        for (int64_t g = 0; g < 8; ++g) std::memcpy(t + g * kTileRows + i, row(r) + b * kBlock + 4 * g, 4);
        const float f[4] = {scale[r * nb + b], scaled_sum[r * nb + b], half_sum[2 * (r * nb + b)],
                            half_sum[2 * (r * nb + b) + 1]};
        for (int j = 0; j < 4; ++j) std::memcpy(t + 8 * kTileRows + j * kTileRows + i, f + j, 4);
      }
    }
  }
  // tile r0 / kTileRows's words of block b
  const int32_t* tile(int64_t r0, int64_t b) const { return tiles.data() + ((r0 / kTileRows) * nb + b) * kTileWords; }
  // scale * the code sum of sub-block s of block b (the whole block when sub == 1)
  float sum(int64_t r, int64_t b, int sub, int s) const {
    return sub == 1 ? scaled_sum[r * nb + b] : half_sum[2 * (r * nb + b) + s];
  }
  void store(const float* acc, float* y, int64_t width) const {
    for (int64_t j = 0; j < width; ++j) y[j] = accumulate ? y[j] + acc[j] : acc[j];
  }
};

struct Panel {
  const uint8_t* codes;  // [nb, bytes]
  const uint16_t* d;     // [ng, sub, 16]
  const uint16_t* mn;    // [ng, sub, 16] or null
  const int8_t* lut;     // [16]: 4-bit codes are indices into it (c = 128 + lut[code]), or null
  int gshift;            // block b's scales are group b >> gshift's
};

// ----- scalar: the reference the vector paths are tested against -----

void panel_scalar(const Activations& a, const Panel& p, int bits, int sub, float offset, int64_t r, float* y,
                  int64_t width) {
  const int64_t bytes = block_bytes(bits);
  float acc[kPanel] = {};
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* cb = p.codes + b * bytes;
    const int8_t* xq = a.row(r) + b * kBlock;
    for (int64_t o = 0; o < kPanel; ++o) {
      int32_t dot[2] = {0, 0};  // per sub-block: groups 0..3 and 4..7 (inputs 0..15, 16..31)
      for (int64_t g = 0; g < 8; ++g) {
        for (int64_t j = 0; j < 4; ++j) {
          int32_t c;
          if (bits == 8) {
            c = cb[g * 64 + o * 4 + j];
          } else {
            const uint8_t byte = cb[(g % 4) * 64 + o * 4 + j];
            c = g < 4 ? (byte & 0x0f) : (byte >> 4);
            if (p.lut) c = 128 + p.lut[c];
            for (int plane = 0; plane < bits - 4; ++plane) c |= ((cb[256 + 64 * plane + o * 4 + j] >> g) & 1) << (4 + plane);
          }
          dot[sub == 2 && g >= 4] += c * xq[4 * g + j];
        }
      }
      for (int s = 0; s < sub; ++s) {
        const int64_t at = ((b >> p.gshift) * sub + s) * kPanel + o;
        const float d = half_to_float(p.d[at]);
        const float mv = p.mn ? half_to_float(p.mn[at]) : -offset * d;
        acc[o] += d * (static_cast<float>(dot[s]) * a.scale[r * a.nb + b]) + mv * a.sum(r, b, sub, s);
      }
    }
  }
  a.store(acc, y, width);
}

#if defined(__x86_64__)

// ----- AVX2: two 8-lane halves of the 16 outputs -----

__attribute__((target("avx2,fma,f16c"))) inline __m256i dot4_avx2(__m256i codes_u8, __m256i x) {
  // u8 x s8 products summed in pairs (no overflow: 4-bit codes, or 8-bit ones made signed first)
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes_u8, x), _mm256_set1_epi16(1));
}

// A nibble vector of group g with its fifth (and sixth) bits set from the planes: bit g of each
// plane byte moved to bit 4 (5) by a 16-bit shift; the mask drops what crossed a byte.
template <int BITS>
__attribute__((target("avx2"))) inline __m256i high_bits_avx2(__m256i nib, const __m256i* planes, int g) {
  for (int b = 0; b < BITS - 4; ++b) {
    const int pos = 4 + b;
    const __m256i moved = g <= pos ? _mm256_sll_epi16(planes[b], _mm_cvtsi32_si128(pos - g))
                                   : _mm256_srl_epi16(planes[b], _mm_cvtsi32_si128(g - pos));
    nib = _mm256_or_si256(nib, _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(1 << pos))));
  }
  return nib;
}

template <int MR, int BITS, int SUB, bool LUT>
__attribute__((target("avx2,fma,f16c"))) void panel_avx2(const Activations& a, const Panel& p, float offset, int64_t r0,
                                                          float* y, int64_t n, int64_t width) {
  constexpr int64_t kBytes = block_bytes(BITS);
  // a table's int8 values (the codes' c - 128), in both 128-bit lanes for vpshufb
  const __m256i table = LUT ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.lut)))
                            : _mm256_setzero_si256();
  __m256 accf[MR][2];
  for (int i = 0; i < MR; ++i) accf[i][0] = accf[i][1] = _mm256_setzero_ps();
  const __m256i sign_flip = _mm256_set1_epi8(static_cast<char>(0x80)), low = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* cb = p.codes + b * kBytes;
    int32_t x4[MR][8];
    for (int i = 0; i < MR; ++i) std::memcpy(x4[i], a.row(r0 + i) + b * kBlock, kBlock);
    for (int s = 0; s < SUB; ++s) {  // sub-blocks: the whole block, or its halves (groups 0..3, 4..7)
      __m256i acc[MR][2];
      for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
      if constexpr (BITS == 8) {
        for (int g = s * (8 / SUB); g < (s + 1) * (8 / SUB); ++g) {
          for (int h = 0; h < 2; ++h) {
            // c - 128 as s8: |q| x sign(x, q) keeps vpmaddubsw's pair sums within 16 bits
            const __m256i q = _mm256_xor_si256(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + g * 64 + h * 32)), sign_flip);
            const __m256i aq = _mm256_abs_epi8(q);
            for (int i = 0; i < MR; ++i) {
              const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(x4[i][g]), q);
              acc[i][h] = _mm256_add_epi32(acc[i][h], dot4_avx2(aq, xs));
            }
          }
        }
      } else {
        // 4-bit codes (0..15) times int8 codes (|x| <= 127): a pair sum is within 3,810 and the
        // 8 a sub-block adds per lane within 30,480, exact in 16 bits (5 and 6 bits overflow)
        __m256i acc16[MR][2];
        for (int i = 0; i < MR; ++i) acc16[i][0] = acc16[i][1] = _mm256_setzero_si256();
        for (int g = 0; g < 4; ++g) {
          for (int h = 0; h < 2; ++h) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + g * 64 + h * 32));
            __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            if constexpr (BITS > 4) {
              __m256i planes[2];
              for (int b = 0; b < BITS - 4; ++b)
                planes[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 256 + 64 * b + h * 32));
              lo = high_bits_avx2<BITS>(lo, planes, g);
              hi = high_bits_avx2<BITS>(hi, planes, g + 4);
            }
            if constexpr (LUT) {  // signed values: |q| x sign(x, q), as the 8-bit path
              const __m256i ql = _mm256_shuffle_epi8(table, lo), qh = _mm256_shuffle_epi8(table, hi);
              const __m256i al = _mm256_abs_epi8(ql), ah = _mm256_abs_epi8(qh);
              for (int i = 0; i < MR; ++i) {
                if (SUB == 1 || s == 0)
                  acc[i][h] = _mm256_add_epi32(acc[i][h], dot4_avx2(al, _mm256_sign_epi8(_mm256_set1_epi32(x4[i][g]), ql)));
                if (SUB == 1 || s == 1)
                  acc[i][h] = _mm256_add_epi32(acc[i][h],
                                               dot4_avx2(ah, _mm256_sign_epi8(_mm256_set1_epi32(x4[i][g + 4]), qh)));
              }
              continue;
            }
            if constexpr (BITS == 4 && !LUT) {  // pair sums added in 16 bits, widened once after the groups
              for (int i = 0; i < MR; ++i) {
                if (SUB == 1 || s == 0) acc16[i][h] = _mm256_add_epi16(acc16[i][h], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4[i][g])));
                if (SUB == 1 || s == 1) acc16[i][h] = _mm256_add_epi16(acc16[i][h], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4[i][g + 4])));
              }
              continue;
            }
            for (int i = 0; i < MR; ++i) {
              if (SUB == 1 || s == 0) acc[i][h] = _mm256_add_epi32(acc[i][h], dot4_avx2(lo, _mm256_set1_epi32(x4[i][g])));
              if (SUB == 1 || s == 1) acc[i][h] = _mm256_add_epi32(acc[i][h], dot4_avx2(hi, _mm256_set1_epi32(x4[i][g + 4])));
            }
          }
        }
        if constexpr (BITS == 4 && !LUT) {
          for (int i = 0; i < MR; ++i)
            for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_madd_epi16(acc16[i][h], _mm256_set1_epi16(1));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const int64_t at = ((b >> p.gshift) * SUB + s) * kPanel + h * 8;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.d + at)));
        __m256 mv = p.mn ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.mn + at)))
                         : _mm256_mul_ps(d, _mm256_set1_ps(-offset));
        if constexpr (BITS == 8 || LUT) mv = _mm256_fmadd_ps(d, _mm256_set1_ps(128.0f), mv);  // the dot was of c - 128
        for (int i = 0; i < MR; ++i) {
          const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][h]), _mm256_set1_ps(a.scale[(r0 + i) * a.nb + b]));
          accf[i][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.sum(r0 + i, b, SUB, s)), _mm256_fmadd_ps(d, t, accf[i][h]));
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(32) float tmp[kPanel];
    _mm256_store_ps(tmp, accf[i][0]);
    _mm256_store_ps(tmp + 8, accf[i][1]);
    a.store(tmp, y + (r0 + i) * n, width);
  }
}

// ----- AVX-512 VNNI: the 16 outputs in one register, 4 inputs per lane per vpdpbusd -----

template <int BITS>
__attribute__((target("avx512f,avx512bw"))) inline __m512i high_bits_vnni(__m512i nib, const __m512i* planes, int g) {
  for (int b = 0; b < BITS - 4; ++b) {
    const int pos = 4 + b;
    const __m512i moved = g <= pos ? _mm512_sll_epi16(planes[b], _mm_cvtsi32_si128(pos - g))
                                   : _mm512_srl_epi16(planes[b], _mm_cvtsi32_si128(g - pos));
    nib = _mm512_or_si512(nib, _mm512_and_si512(moved, _mm512_set1_epi8(static_cast<char>(1 << pos))));
  }
  return nib;
}

template <int MR, int BITS, int SUB, bool LUT>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma"))) void panel_vnni(const Activations& a, const Panel& p,
                                                                                 float offset, int64_t r0, float* y,
                                                                                 int64_t n, int64_t width) {
  constexpr int64_t kBytes = block_bytes(BITS);
  // a table's codes c = 128 + value (value xor 0x80), in every 128-bit lane for vpshufb
  const __m512i table = LUT ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.lut))),
                                               _mm512_set1_epi8(static_cast<char>(0x80)))
                            : _mm512_setzero_si512();
  __m512 accf[MR];
  for (int i = 0; i < MR; ++i) accf[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* cb = p.codes + b * kBytes;
    if constexpr (MR >= 4) {  // many rows: the loads wait on compute, so fetch 8 blocks ahead
      for (int64_t off = 0; off < kBytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(cb + 8 * kBytes + off), _MM_HINT_T0);
      }
    }
    constexpr int64_t R = Activations::kTileRows;
    const int32_t* x4 = a.tile(r0, b);  // [8 groups][R rows], then scales, sums, half sums [R] each
    const float* xf = reinterpret_cast<const float*>(x4 + 8 * R);
    for (int s = 0; s < SUB; ++s) {  // sub-blocks: the whole block, or its halves (groups 0..3, 4..7)
      __m512i acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
      if constexpr (BITS == 8) {
        for (int g = s * (8 / SUB); g < (s + 1) * (8 / SUB); ++g) {
          const __m512i w = _mm512_loadu_si512(cb + g * 64);
          for (int i = 0; i < MR; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, _mm512_set1_epi32(x4[g * R + i]));
        }
      } else {
        __m512i planes[2];
        for (int b = 0; b < BITS - 4; ++b) planes[b] = _mm512_loadu_si512(cb + 256 + 64 * b);
        for (int g = 0; g < 4; ++g) {
          const __m512i raw = _mm512_loadu_si512(cb + g * 64);
          __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
          if constexpr (BITS > 4) {
            lo = high_bits_vnni<BITS>(lo, planes, g);
            hi = high_bits_vnni<BITS>(hi, planes, g + 4);
          }
          if constexpr (LUT) {
            lo = _mm512_shuffle_epi8(table, lo);
            hi = _mm512_shuffle_epi8(table, hi);
          }
          for (int i = 0; i < MR; ++i) {
            if (SUB == 1 || s == 0) acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(x4[g * R + i]));
            if (SUB == 1 || s == 1) acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(x4[(g + 4) * R + i]));
          }
        }
      }
      const int64_t at = ((b >> p.gshift) * SUB + s) * kPanel;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.d + at)));
      const __m512 mv = p.mn ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.mn + at)))
                             : _mm512_mul_ps(d, _mm512_set1_ps(-offset));
      const float* sums = xf + (SUB == 1 ? R : (2 + s) * R);  // the block's sums, or this half's
      for (int i = 0; i < MR; ++i) {
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_set1_ps(xf[i]));
        accf[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[i]), _mm512_fmadd_ps(d, t, accf[i]));
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(64) float tmp[kPanel];
    _mm512_store_ps(tmp, accf[i]);
    a.store(tmp, y + (r0 + i) * n, width);
  }
}

#endif

// Rows in tiles against one panel, by the chosen instruction set: up to 8 rows per tile with
// AVX-512 (32 registers: 8 integer and 8 float accumulators), up to 4 with AVX2.
template <int MR, int BITS, int SUB, bool LUT = false>
void tile_of(const Activations& a, const Panel& p, float offset, int64_t isa, int64_t r, float* y, int64_t n,
             int64_t width) {
#if defined(__x86_64__)
  if (isa == kVnni) {
    panel_vnni<MR, BITS, SUB, LUT>(a, p, offset, r, y, n, width);
  } else if constexpr (MR <= 4) {
    panel_avx2<MR, BITS, SUB, LUT>(a, p, offset, r, y, n, width);
  }
#endif
}

template <int MR, int BITS>
void tile_bits(const Activations& a, const Panel& p, int sub, float offset, int64_t isa, int64_t r, float* y, int64_t n,
               int64_t width) {
  sub == 1 ? tile_of<MR, BITS, 1>(a, p, offset, isa, r, y, n, width)
           : tile_of<MR, BITS, 2>(a, p, offset, isa, r, y, n, width);
}

template <int MR>
void tile(const Activations& a, const Panel& p, int bits, int sub, float offset, int64_t isa, int64_t r, float* y,
          int64_t n, int64_t width) {
  switch (bits) {
    case 8: tile_bits<MR, 8>(a, p, sub, offset, isa, r, y, n, width); break;
    case 6: tile_bits<MR, 6>(a, p, sub, offset, isa, r, y, n, width); break;
    case 5: tile_bits<MR, 5>(a, p, sub, offset, isa, r, y, n, width); break;
    default:
      if (p.lut) {
        sub == 1 ? tile_of<MR, 4, 1, true>(a, p, offset, isa, r, y, n, width)
                 : tile_of<MR, 4, 2, true>(a, p, offset, isa, r, y, n, width);
      } else {
        tile_bits<MR, 4>(a, p, sub, offset, isa, r, y, n, width);
      }
      break;
  }
}

void panel_rows(const Activations& a, const Panel& p, int bits, int sub, float offset, int64_t isa, int64_t m, float* y,
                int64_t n, int64_t c0, int64_t width) {
  if (isa == kScalar) {
    for (int64_t r = 0; r < m; ++r) panel_scalar(a, p, bits, sub, offset, r, y + r * n + c0, width);
    return;
  }
  const int64_t most = isa == kVnni ? Activations::kTileRows : 4;  // VNNI tiles start on a tile of the copy
  for (int64_t r = 0; r < m;) {
    const int64_t rows = std::min(most, m - r);
    switch (rows) {
      case 1: tile<1>(a, p, bits, sub, offset, isa, r, y + c0, n, width); break;
      case 2: tile<2>(a, p, bits, sub, offset, isa, r, y + c0, n, width); break;
      case 3: tile<3>(a, p, bits, sub, offset, isa, r, y + c0, n, width); break;
      case 4: tile<4>(a, p, bits, sub, offset, isa, r, y + c0, n, width); break;
      case 5: tile<5>(a, p, bits, sub, offset, isa, r, y + c0, n, width); break;
      case 6: tile<6>(a, p, bits, sub, offset, isa, r, y + c0, n, width); break;
      case 7: tile<7>(a, p, bits, sub, offset, isa, r, y + c0, n, width); break;
      default: tile<8>(a, p, bits, sub, offset, isa, r, y + c0, n, width); break;
    }
    r += rows;
  }
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                           ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::F16> mins, ffi::Buffer<ffi::S8> lut,
                           ffi::ResultBuffer<ffi::F32> y,
                           int64_t bits, float offset, int64_t isa, int64_t digits, int64_t sub, int64_t group,
                           int64_t chunks) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions(), md = mins.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || cd.size() != 3 || sd.size() != 3 || yd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "weld_quant_matmul: x [m, k], codes [P, nb, bytes], scales [P, ng, 16 sub], y [m, n]");
  }
  const int64_t m = xd[0], k = xd[1], num_panels = cd[0], nb = cd[1], n = yd[1];
  const int64_t bytes = block_bytes(bits);
  int gshift = 0;
  while (gshift < 4 && (int64_t{1} << gshift) < group) ++gshift;
  const int64_t ng = (nb + group - 1) / std::max<int64_t>(group, 1);
  const bool has_mins = md.size() == 3 && md[0] == num_panels;
  const bool has_lut = lut.element_count() == 16;
  if (has_lut && (bits != 4 || has_mins)) {
    return ffi::Error::InvalidArgument("weld_quant_matmul: a table takes 4-bit codes without mins");
  }
  if (bits < 4 || bits > 8 || bits == 7 || (sub != 1 && sub != 2) || (int64_t{1} << gshift) != group ||
      (group > 1 && sub != 1) || cd[2] != bytes || sd[0] != num_panels || sd[1] != ng || sd[2] != kPanel * sub ||
      nb * kBlock < k || (nb - 1) * kBlock >= k || yd[0] != m || n > num_panels * kPanel ||
      n <= (num_panels - 1) * kPanel || (has_mins && (md[1] != ng || md[2] != kPanel * sub)) || isa < 0 || isa > kVnni ||
      (digits != 1 && digits != 2) || chunks < 1) {
    return ffi::Error::InvalidArgument("weld_quant_matmul: inconsistent shapes or attributes");
  }
  Activations acts(m, nb), second(digits == 2 ? m : 0, nb, true);
  const float* xp = x.typed_data();
  Activations *qp = &acts, *q2 = digits == 2 ? &second : nullptr;
  const bool tiled = isa == kVnni;
  const int64_t tile_words = (m + Activations::kTileRows - 1) / Activations::kTileRows * nb * Activations::kTileWords;
  if (tiled) {
    acts.tiles.assign(tile_words, 0);
    if (q2) second.tiles.assign(tile_words, 0);
  }
  auto quantize = [=](int64_t begin, int64_t end) {
    qp->quantize_rows(xp, k, begin, end, isa);
    if (q2) q2->quantize_rows(xp, k, begin, end, isa, qp);
    if (tiled) {
      qp->tile_rows(begin, end);
      if (q2) q2->tile_rows(begin, end);
    }
  };
  // A few rows (decode, verification, batches up to kStreamRows: the calls that stream the
  // weights) are quantized by the caller while the pool's helpers wake for the panels
  // (parallel_streams_after); many (prefill) in parallel first.
  const bool few = m <= kStreamRows;
  if (!few) weld::parallel_for(pool, m, std::max<int64_t>(1, 4096 / std::max<int64_t>(k, 1)), quantize);
  const uint8_t* cp = codes.typed_data();
  const uint16_t* dp = scales.typed_data();
  const uint16_t* mp = has_mins ? mins.typed_data() : nullptr;
  const int8_t* lp = has_lut ? lut.typed_data() : nullptr;
  float* yp = y->typed_data();
  const Activations *ap = &acts, *ap2 = q2;
  // Few rows: each thread streams its own contiguous run of panels, which the hardware prefetchers
  // follow (chunks handed out in turn would break every thread's streams at each chunk), and
  // takes the back of another's run when done with its own (weld::parallel_streams_after); bound
  // by memory at one row, by the products at 16, both gain. Each run is claimed in `chunks`
  // pieces (1: a thread's whole run at once, as before 2026-12-07). More rows: chunks of ~64
  // blocks, for balance.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t grain = m <= kStreamRows ? std::max<int64_t>(1, (num_panels + chunks * threads - 1) / (chunks * threads))
                                         : std::max<int64_t>(1, 64 / std::max<int64_t>(nb, 1));
  auto panels = [=](int64_t begin, int64_t end) {
    for (int64_t pi = begin; pi < end; ++pi) {
      const Panel panel{cp + pi * nb * bytes, dp + pi * ng * kPanel * sub, mp ? mp + pi * ng * kPanel * sub : nullptr,
                        lp, gshift};
      const int64_t c0 = pi * kPanel;
      const int64_t width = std::min<int64_t>(kPanel, n - c0);
      panel_rows(*ap, panel, static_cast<int>(bits), static_cast<int>(sub), offset, isa, m, yp, n, c0, width);
      if (ap2) panel_rows(*ap2, panel, static_cast<int>(bits), static_cast<int>(sub), offset, isa, m, yp, n, c0, width);
    }
  };
  if (few) {
    weld::parallel_streams_after(pool, num_panels, grain, [&] { quantize(0, m); }, panels);
  } else {
    weld::parallel_for(pool, num_panels, grain, panels);
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" int weld_cpu_has_vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512f");
#else
  return 0;
#endif
}

extern "C" int weld_cpu_has_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(WeldQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [m, k]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes [P, nb, 512 | 256]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales [P, ng, 16 sub]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // mins [P, ng, 16 sub], or [0] for none
                                  .Arg<ffi::Buffer<ffi::S8>>()   // lut [16] (4-bit codes index it), or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [m, n]
                                  .Attr<int64_t>("bits")
                                  .Attr<float>("offset")
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("digits")
                                  .Attr<int64_t>("sub")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("chunks"));

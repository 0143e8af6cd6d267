// 16-bit floats as weld's native kernels read them: IEEE half (f16) and bfloat16, to f32.
#pragma once

#include <cstdint>
#include <cstring>

namespace weld {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mantissa;
      do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element types of a KV pool: f32 as is, or 16-bit codes of either kind.
struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };
inline float to_float(float x) { return x; }
inline float to_float(F16 x) { return half_to_float(x.bits); }
inline float to_float(BF16 x) { return bf16_to_float(x.bits); }

}  // namespace weld

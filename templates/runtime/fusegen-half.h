// fusegen-half.h: the 16-bit storage types, fp16 and bf16, and their host conversions.
// The CPU loop converts with these; the CUDA kernels store the same types and convert on
// the device (fusegen-cuda-common.cuh).
#ifndef FUSEGEN_HALF_H_
#define FUSEGEN_HALF_H_

#ifdef __CUDACC_RTC__
#include "fusegen-rtc.h"
#else
#include <cmath>
#include <cstdint>
#include <cstring>
#endif

namespace fusegen {

// Host fp16 and bf16: storage types for the CPU kernels, converted exactly as c10::Half
// and c10::BFloat16 convert (round to nearest even, NaN kept), and computed in float as
// at::opmath does.

struct Half {
  uint16_t x;
};
struct BFloat16 {
  uint16_t x;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// c10::detail::fp16_ieee_to_fp32_value (portable path).
inline float to_float(Half h) {
  const uint32_t w = static_cast<uint32_t>(h.x) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const float normalized =
      bits_float((two_w >> 4) + (UINT32_C(0xE0) << 23)) * bits_float(UINT32_C(15) << 23);
  const float denormalized = bits_float((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
  // A mask, not a branch: both sides are computed anyway, and a loop of these vectorizes
  // (GCC does not if-convert a select between float results under -ftrapping-math).
  const uint32_t subnormal = UINT32_C(0) - static_cast<uint32_t>(two_w < (UINT32_C(1) << 27));
  return bits_float(sign | (subnormal & float_bits(denormalized)) |
                    (~subnormal & float_bits(normalized)));
}

// c10::detail::fp16_ieee_from_fp32_value (portable path).
inline Half to_half(float f) {
  float base = (std::fabs(f) * bits_float(UINT32_C(239) << 23)) * bits_float(UINT32_C(17) << 23);
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  bias = bias < UINT32_C(0x71000000) ? UINT32_C(0x71000000) : bias;
  base = bits_float((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t nonsign = ((bits >> 13) & UINT32_C(0x00007C00)) + (bits & UINT32_C(0x00000FFF));
  const uint32_t nan = UINT32_C(0) - static_cast<uint32_t>(shl1_w > UINT32_C(0xFF000000));
  return Half{static_cast<uint16_t>((sign >> 16) | (nan & UINT32_C(0x7E00)) | (~nan & nonsign))};
}

inline float to_float(BFloat16 b) { return bits_float(static_cast<uint32_t>(b.x) << 16); }

// c10::detail::round_to_nearest_even.
inline BFloat16 to_bfloat16(float f) {
  if (std::isnan(f)) return BFloat16{UINT16_C(0x7FC0)};
  const uint32_t u = float_bits(f);
  return BFloat16{static_cast<uint16_t>((u + ((u >> 16) & 1) + UINT32_C(0x7FFF)) >> 16)};
}

// The same conversions over a contiguous run of n values, bit for bit: the CPU loop
// (fusegen-cpu.h) converts its fp16/bf16 operands a block at a time through these. Defined
// in the runtime library (fusegen-layout.cpp, compiled once), which picks F16C (fp16) or
// AVX2 (bf16) instructions when the CPU it runs on has them and a portable loop otherwise.
void convert(const Half* x, float* y, int64_t n);
void convert(const float* x, Half* y, int64_t n);
void convert(const BFloat16* x, float* y, int64_t n);
void convert(const float* x, BFloat16* y, int64_t n);

}  // namespace fusegen

#endif  // FUSEGEN_HALF_H_

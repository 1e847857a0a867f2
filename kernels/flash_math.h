// Per-group math of Flash Communication's quantizer (CodecId::kFlash; Li et al., arXiv 2412.04964),
// shared by the CPU codec and any future CUDA kernel (both must produce identical bytes).
//
// The authors' two-step all-reduce quantizes with group-wise asymmetric INT-b (b = 8 or 4; here
// any b in 2..8) and round-to-nearest: a group of 128 consecutive values keeps its minimum (the
// zero point) and a scale (max - min) / (2^b - 1); a value encodes as round((v - min) / scale) and
// decodes to min + code * scale. Layout of a group (the last group of a chunk may hold fewer
// values; its unused code slots are written as 0 and ignored on decode):
//   [ bf16 min ][ bf16 scale ][ 128 codes, b bits each, packed LSB-first ]   (little-endian)
// so a group takes 4 + 16*b bytes: b + 0.25 bits per coordinate. Where we differ from the source,
// and why: the minimum and the scale are bf16, not fp16 (our values are fp32 gradients, and bf16
// has fp32's range, so a value beyond fp16's range can never turn into Inf); the minimum is rounded
// down and the scale up so that the group's range is always covered (never clamped). Every code
// 0..2^b-1 is legal. Round-to-nearest is the source's choice and is biased (ties go up); on
// gradients the stochastic `uniform` codec is the unbiased relative.
//
// Decoding is one multiply and one add in float (min + float(code) * scale), in that order and
// never contracted to a fused multiply-add (a CUDA kernel must use __fmul_rn/__fadd_rn). A group
// holding Inf/NaN, or whose range would overflow float, is sent with min and scale both the NaN
// marker 0x7fc0 and all codes 0; it decodes to NaN everywhere, the same policy as DynamiQ.
#ifndef DQ_KERNELS_FLASH_MATH_H_
#define DQ_KERNELS_FLASH_MATH_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/bf16_math.h"
#include "kernels/host_device.h"
#include "kernels/uniform_math.h"

namespace dynamiq::kernels {

inline constexpr int kFlashGroupSize = 128;
inline constexpr int kFlashMinBits = 2;
inline constexpr int kFlashMaxBits = 8;
inline constexpr uint16_t kFlashNanMarker = 0x7fc0;  // bf16 quiet NaN: the group held Inf/NaN
inline constexpr size_t kFlashGroupHeaderBytes = 4;

DQ_HOST_DEVICE int FlashMaxCode(int bits) { return (1 << bits) - 1; }

// Bytes of one group (full or partial) at `bits` bits per code.
DQ_HOST_DEVICE size_t FlashGroupBytes(int bits) {
  return kFlashGroupHeaderBytes + static_cast<size_t>(kFlashGroupSize / 8) * static_cast<size_t>(bits);
}

DQ_HOST_DEVICE size_t FlashNumGroups(size_t count) { return (count + kFlashGroupSize - 1) / kFlashGroupSize; }

DQ_HOST_DEVICE uint16_t FlashLoadHalf(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

DQ_HOST_DEVICE void FlashStoreHalf(uint8_t* p, uint16_t h) {
  p[0] = static_cast<uint8_t>(h);
  p[1] = static_cast<uint8_t>(h >> 8);
}

// Largest bf16 <= f for finite f (the minimum must not rise above the group's smallest value).
DQ_HOST_DEVICE uint16_t FlashBf16Down(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) == 0u) return static_cast<uint16_t>(u >> 16);  // +-0
  // Truncation rounds the magnitude down: towards -inf for positive f; negative f rounds its
  // magnitude up instead.
  uint32_t hi = u >> 16;
  if ((u & 0x80000000u) != 0u && (u & 0xffffu) != 0u) hi += 1u;
  return static_cast<uint16_t>(hi);
}

// The decoded value of `code`: min + code * scale, one rounding per operation.
DQ_HOST_DEVICE float FlashDecodeValue(float min, float scale, uint32_t code) {
  const float step = static_cast<float>(code) * scale;
  return min + step;
}

// Whether a received group header is one a correct encoder writes: the NaN pair, or a finite
// minimum and a finite non-negative scale whose top code decodes to a finite value.
DQ_HOST_DEVICE bool FlashHeaderIsValid(uint16_t min_bits, uint16_t scale_bits, int bits) {
  if (scale_bits == kFlashNanMarker || min_bits == kFlashNanMarker) {
    return scale_bits == kFlashNanMarker && min_bits == kFlashNanMarker;
  }
  if ((scale_bits & 0x8000u) != 0u) return false;
  const float min = Bf16ToFloat(min_bits);
  const float scale = Bf16ToFloat(scale_bits);
  if (!UniformIsFinite(min) || !UniformIsFinite(scale)) return false;
  return UniformIsFinite(FlashDecodeValue(min, scale, static_cast<uint32_t>(FlashMaxCode(bits))));
}

// Encodes v[0, count) into `group` (FlashGroupBytes(bits) bytes).
DQ_HOST_DEVICE void FlashEncodeGroup(const float* v, int count, int bits, uint8_t* group) {
  const int max_code = FlashMaxCode(bits);
  const float levels = static_cast<float>(max_code);
  float lo = 3.40282347e38f;
  float hi = -3.40282347e38f;
  bool finite = count > 0;
  for (int k = 0; k < count; ++k) {
    const float x = v[k];
    finite = finite && fabsf(x) <= 3.40282347e38f;  // false for Inf and NaN
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  uint16_t min_bits = kFlashNanMarker;
  uint16_t scale_bits = kFlashNanMarker;
  if (finite) {
    min_bits = FlashBf16Down(lo);
    const float min = Bf16ToFloat(min_bits);
    const float range = hi - min;  // >= 0; Inf when the group spans most of float's range
    scale_bits = UniformIsFinite(range) ? FloatToBf16Up(range / levels) : kFlashNanMarker;
    // The division and the decode's rounding may fall short of hi: widen by bf16 steps until the
    // top code covers it (one or two steps at most; bounded all the same).
    for (int step = 0; step < 4 && scale_bits != kFlashNanMarker &&
                       FlashDecodeValue(min, Bf16ToFloat(scale_bits), static_cast<uint32_t>(max_code)) < hi;
         ++step) {
      scale_bits = static_cast<uint16_t>(scale_bits + 1u);
    }
    if (scale_bits == kFlashNanMarker || !FlashHeaderIsValid(min_bits, scale_bits, bits) ||
        FlashDecodeValue(min, Bf16ToFloat(scale_bits), static_cast<uint32_t>(max_code)) < hi) {
      min_bits = scale_bits = kFlashNanMarker;
    }
  }
  if (min_bits == kFlashNanMarker) scale_bits = kFlashNanMarker;
  FlashStoreHalf(group, min_bits);
  FlashStoreHalf(group + 2, scale_bits);
  uint8_t* codes = group + kFlashGroupHeaderBytes;
  for (int b = 0; b < kFlashGroupSize / 8 * bits; ++b) codes[b] = 0;
  if (scale_bits == kFlashNanMarker) return;
  const float min = Bf16ToFloat(min_bits);
  const float scale = Bf16ToFloat(scale_bits);
  if (!(scale > 0.0f)) return;  // every value equals min: all codes 0
  for (int k = 0; k < count; ++k) {
    float t = (v[k] - min) / scale;  // a division: 1 / (subnormal scale) overflows
    t = fminf(fmaxf(t, 0.0f), levels);
    UniformPackCode(codes, k, bits, static_cast<uint32_t>(floorf(t + 0.5f)));
  }
}

// Decodes a group whose header passed FlashHeaderIsValid into out[0, count).
DQ_HOST_DEVICE void FlashDecodeGroup(const uint8_t* group, int bits, int count, float* out) {
  const uint16_t min_bits = FlashLoadHalf(group);
  const float min = Bf16ToFloat(min_bits);
  const float scale = Bf16ToFloat(FlashLoadHalf(group + 2));
  const uint8_t* codes = group + kFlashGroupHeaderBytes;
  for (int k = 0; k < count; ++k) out[k] = FlashDecodeValue(min, scale, UniformUnpackCode(codes, k, bits));
}

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_FLASH_MATH_H_

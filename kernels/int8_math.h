// Per-element math of the INTELLECT-1-style int8 codec (CodecId::kInt8), shared by the CPU codec
// and any future CUDA kernel (both must produce identical bytes).
//
// A chunk (one message of the all-reduce: a rank's share of a pipelining block) has ONE scale,
// from the chunk's own values: sigma = sqrt(sum(v^2) / count) (accumulated in double, in index
// order), clip = kInt8ClipSigmas * sigma, scale = float(clip / 127). Every element is clipped to
// [-clip, clip] and stochastically rounded to a multiple of the scale (up with probability equal
// to the fractional position: unbiased for |v| <= clip, biased towards 0 beyond the clip).
// Payload: [ f32 scale, little-endian ][ count codes, one byte each ]: 8 bits per coordinate plus
// 32 bits per chunk. Byte c decodes to (c - 127) * scale; 0..254 are legal, 255 is not.
// A chunk holding Inf/NaN (or whose scale would overflow) is sent with the NaN scale 0x7fc00000
// and all codes 127; it decodes to NaN everywhere, the same policy as DynamiQ.
#ifndef DQ_KERNELS_INT8_MATH_H_
#define DQ_KERNELS_INT8_MATH_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/bf16_math.h"
#include "kernels/host_device.h"

namespace dynamiq::kernels {

inline constexpr float kInt8ClipSigmas = 6.0f;          // clip at +-6 sigma of the chunk
inline constexpr int kInt8MaxLevel = 127;               // codes 0..254 = levels -127..127
inline constexpr uint32_t kInt8IllegalCode = 255;       // never produced; decoders reject it
inline constexpr uint32_t kInt8NanScale = 0x7fc00000u;  // f32 quiet NaN: the chunk held Inf/NaN
inline constexpr size_t kInt8ScaleBytes = 4;

DQ_HOST_DEVICE bool Int8IsFinite(float x) { return (FloatBits(x) & 0x7f800000u) != 0x7f800000u; }

// A scale a correct encoder can produce: the NaN marker, or finite, non-negative, and small
// enough that scale * 127 does not overflow (so every decoded value is finite).
DQ_HOST_DEVICE bool Int8ScaleIsValid(uint32_t bits) {
  if (bits == kInt8NanScale) return true;
  if (bits & 0x80000000u) return false;
  float s = BitsToFloat(bits);
  return Int8IsFinite(s) && Int8IsFinite(s * static_cast<float>(kInt8MaxLevel));
}

// The scale bits of a chunk of `count` > 0 values with sum of squares `sum_sq` (`finite` false if
// any value was Inf/NaN).
DQ_HOST_DEVICE uint32_t Int8ScaleFor(double sum_sq, size_t count, bool finite) {
  if (!finite || !(sum_sq <= 1.0e300)) return kInt8NanScale;
  const double clip = static_cast<double>(kInt8ClipSigmas) * sqrt(sum_sq / static_cast<double>(count));
  const float scale = static_cast<float>(clip / kInt8MaxLevel);
  const uint32_t bits = FloatBits(scale);
  return Int8ScaleIsValid(bits) ? bits : kInt8NanScale;
}

// Clips v to +-127 scales and stochastically rounds it to a code in [0, 254]; `scale` > 0 and
// finite. Rounds up iff u < frac(v / scale).
DQ_HOST_DEVICE uint32_t Int8Quantize(float v, float scale, float u) {
  const float levels = static_cast<float>(kInt8MaxLevel);
  float t = v / scale;
  t = fminf(fmaxf(t, -levels), levels);
  float lo = floorf(t);
  int q = static_cast<int>(lo) + (u < t - lo ? 1 : 0);
  return static_cast<uint32_t>(q + kInt8MaxLevel);
}

DQ_HOST_DEVICE float Int8Decode(uint32_t code, float scale) {
  return static_cast<float>(static_cast<int>(code) - kInt8MaxLevel) * scale;
}

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_INT8_MATH_H_

// Per-block math of the uniform stochastic b-bit quantizer (CodecId::kUniform), shared by the CPU
// codec and any future CUDA kernel (both must produce identical bytes).
//
// A block covers 32 consecutive bucket elements (the last block of a chunk may hold fewer; its
// unused code slots are written as code L and ignored on decode). Layout, b in 2..8:
//   [ bf16 scale, little-endian ][ 32 codes, b bits each, packed LSB-first: code k starts at bit
//                                   k*b of the 4*b code bytes (codes may straddle a byte) ]
// so a block takes 2 + 4*b bytes: b + 0.5 bits per coordinate.
// An element decodes to (code - L) * scale with L = 2^(b-1) - 1: codes 0..2L are legal, code
// 2^b - 1 is not and decoders reject it.
//
// Encoding: scale = the smallest bf16 with scale * L >= max|v| (rounded up, never clamps), then
// every element is stochastically rounded between its two neighbouring multiples of scale: up
// with probability equal to the fractional position, which is unbiased in the value domain.
// A block holding Inf/NaN (or whose scale would overflow) is sent with the NaN scale 0x7fc0 and
// all codes L; it decodes to NaN everywhere, the same policy as DynamiQ.
#ifndef DQ_KERNELS_UNIFORM_MATH_H_
#define DQ_KERNELS_UNIFORM_MATH_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/bf16_math.h"
#include "kernels/host_device.h"
#include "kernels/random_math.h"

namespace dynamiq::kernels {

inline constexpr int kUniformBlockSize = 32;
inline constexpr int kUniformStratumElements = 256;   // siblings share one stratum permutation per 256
inline constexpr uint16_t kUniformNanScale = 0x7fc0;  // bf16 quiet NaN: the block held Inf/NaN

DQ_HOST_DEVICE int UniformMaxLevel(int bits) { return (1 << (bits - 1)) - 1; }

// Bytes of one block (full or partial) at `bits` bits per code.
DQ_HOST_DEVICE size_t UniformBlockBytes(int bits) { return 2 + 4 * static_cast<size_t>(bits); }

DQ_HOST_DEVICE size_t UniformNumBlocks(size_t count) { return (count + kUniformBlockSize - 1) / kUniformBlockSize; }

// Code k of a block's code bytes. Reads only the bytes the code occupies.
DQ_HOST_DEVICE uint32_t UniformUnpackCode(const uint8_t* codes, int k, int bits) {
  int bit = k * bits;
  uint32_t word = codes[bit >> 3];
  if ((bit & 7) + bits > 8) word |= static_cast<uint32_t>(codes[(bit >> 3) + 1]) << 8;
  return (word >> (bit & 7)) & ((1u << bits) - 1u);
}

// ORs `code` into zero-initialised code bytes.
DQ_HOST_DEVICE void UniformPackCode(uint8_t* codes, int k, int bits, uint32_t code) {
  int bit = k * bits;
  uint32_t shifted = code << (bit & 7);
  codes[bit >> 3] = static_cast<uint8_t>(codes[bit >> 3] | shifted);
  if ((bit & 7) + bits > 8) codes[(bit >> 3) + 1] = static_cast<uint8_t>(codes[(bit >> 3) + 1] | (shifted >> 8));
}

DQ_HOST_DEVICE bool UniformIsFinite(float x) { return (FloatBits(x) & 0x7f800000u) != 0x7f800000u; }

// The rounding threshold u in [0, 1) for bucket element `index`; `key` is the rank's stream key.
DQ_HOST_DEVICE float UniformRoundingUnit(uint32_t key, uint32_t index, bool correlated, uint32_t stratum, uint32_t n) {
  float uniform = BitsToUnit(RandomBits(key, index));
  return correlated ? CorrelatedUnit(stratum, n, uniform) : uniform;
}

DQ_HOST_DEVICE uint16_t UniformLoadScale(const uint8_t* block) {
  return static_cast<uint16_t>(block[0] | (block[1] << 8));
}

// A scale a correct encoder can produce: the NaN marker, or finite, non-negative, and small
// enough that scale * L does not overflow (so every decoded value is finite).
DQ_HOST_DEVICE bool UniformScaleIsValid(uint16_t scale, int max_level) {
  if (scale == kUniformNanScale) return true;
  if (scale & 0x8000u) return false;
  float s = Bf16ToFloat(scale);
  return UniformIsFinite(s) && UniformIsFinite(s * static_cast<float>(max_level));
}

// The block's scale from its largest magnitude (`finite` false if any value was Inf/NaN).
DQ_HOST_DEVICE uint16_t UniformScaleFor(float block_max, bool finite, int max_level) {
  if (!finite) return kUniformNanScale;
  const float levels = static_cast<float>(max_level);
  uint16_t scale = FloatToBf16Up(block_max / levels);
  // The division may round down; scale * L is exact (<= 15 significant bits), so this check is too.
  if (Bf16ToFloat(scale) * levels < block_max) scale += 1;
  if (!UniformScaleIsValid(scale, max_level)) return kUniformNanScale;  // max|v| near FLT_MAX
  return scale;
}

// Stochastically rounds v (|v| <= scale * L) to a code in [0, 2L]; `scale` > 0 and finite.
// Rounds up iff u < frac(v / scale), so E[(code - L) * scale] = v.
DQ_HOST_DEVICE uint32_t UniformQuantize(float v, float scale, int max_level, float u) {
  const float levels = static_cast<float>(max_level);
  float t = v / scale;  // a division, not a reciprocal: 1 / (subnormal scale) overflows
  t = fminf(fmaxf(t, -levels), levels);
  float lo = floorf(t);
  int q = static_cast<int>(lo) + (u < t - lo ? 1 : 0);
  return static_cast<uint32_t>(q + max_level);
}

// Checks one received block: a valid scale and no illegal code (2^b - 1) in any of the 32 slots.
DQ_HOST_DEVICE bool UniformValidateBlock(const uint8_t* block, int bits) {
  const int max_level = UniformMaxLevel(bits);
  if (!UniformScaleIsValid(UniformLoadScale(block), max_level)) return false;
  const uint32_t illegal = (1u << bits) - 1u;
  for (int k = 0; k < kUniformBlockSize; ++k) {
    if (UniformUnpackCode(block + 2, k, bits) == illegal) return false;
  }
  return true;
}

// Decodes a validated block into out[0, count).
DQ_HOST_DEVICE void UniformDecodeBlock(const uint8_t* block, int bits, int count, float* out) {
  const int max_level = UniformMaxLevel(bits);
  const float scale = Bf16ToFloat(UniformLoadScale(block));
  for (int k = 0; k < count; ++k) {
    int q = static_cast<int>(UniformUnpackCode(block + 2, k, bits)) - max_level;
    out[k] = static_cast<float>(q) * scale;
  }
}

// Encodes v[0, count) (the partial sum to send) into `block` (UniformBlockBytes(bits) bytes).
// `first_index` is the bucket index of v[0]; `key` the rank's stream key; `stratum`/`n` the
// correlated-rounding stratum of the block's 256-element group (ignored unless `correlated`).
DQ_HOST_DEVICE void UniformEncodeBlock(const float* v, int count, int bits, uint32_t key, uint32_t first_index,
                                       bool correlated, uint32_t stratum, uint32_t n, uint8_t* block) {
  const int max_level = UniformMaxLevel(bits);
  float block_max = 0.0f;
  bool finite = true;
  for (int k = 0; k < count; ++k) {
    float a = fabsf(v[k]);
    finite = finite && a <= 3.40282347e38f;  // false for Inf and NaN
    block_max = a > block_max ? a : block_max;
  }
  const uint16_t scale_bits = UniformScaleFor(block_max, finite, max_level);
  const float scale = Bf16ToFloat(scale_bits);
  block[0] = static_cast<uint8_t>(scale_bits);
  block[1] = static_cast<uint8_t>(scale_bits >> 8);
  uint8_t* codes = block + 2;
  for (int b = 0; b < 4 * bits; ++b) codes[b] = 0;
  const bool quantize = scale_bits != kUniformNanScale && scale > 0.0f;  // else every code is zero
  for (int k = 0; k < kUniformBlockSize; ++k) {
    uint32_t code = static_cast<uint32_t>(max_level);
    if (k < count && quantize) {
      float u = UniformRoundingUnit(key, first_index + static_cast<uint32_t>(k), correlated, stratum, n);
      code = UniformQuantize(v[k], scale, max_level, u);
    }
    UniformPackCode(codes, k, bits, code);
  }
}

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_UNIFORM_MATH_H_

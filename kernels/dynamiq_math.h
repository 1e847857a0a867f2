// Per-element and per-super-group math of the DynamiQ quantizer, shared by the scalar reference,
// the Highway CPU kernels and the CUDA kernels (all three must produce identical bytes).
//
// Layout of one super-group (SG) of up to 256 elements with code width b in 2..8 bits:
//   repeat for each of its G groups of 16 elements (G = 16 except in a chunk's last SG):
//     [ 16 codes, b bits each, packed LSB-first: code k at bit (k*b) % 8 of byte (k*b) / 8 (codes may
//       straddle bytes; 16 codes always fill exactly 2b bytes) ]
//     [ u8 r_g: group scale in units of the SG's super unit, 1..255 ]
//   [ bf16 super unit ]
// An element decodes to decode[code] * r_g * super_unit, with decode[code] = sign * level[|code - L|],
// L = 2^(b-1) - 1, so codes 0..2L are legal and code 2^b - 1 is not. Width 0 means "every element of
// this SG is exactly zero on every rank" and takes no bytes. (The paper uses widths 2, 4, 8 only;
// any width packs into whole bytes per group here, which lets the allocator use 3, 5, 6 and 7.)
//
// Encoding: super_unit = bf16 rounded up from max|v| / 255; r_g = ceil(max_g|v| / super_unit), so
// the reconstructed group scale covers the group and |v| / scale <= 1 (no clamping). Each element is
// stochastically rounded between the two neighbouring levels in the value domain, which is unbiased.
// A SG holding Inf or NaN is sent with a NaN super unit and decodes to NaN everywhere, so loss
// scalers still see the overflow after the all-reduce.
#ifndef DQ_KERNELS_DYNAMIQ_MATH_H_
#define DQ_KERNELS_DYNAMIQ_MATH_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/bf16_math.h"
#include "kernels/host_device.h"
#include "kernels/random_math.h"

namespace dynamiq::kernels {

inline constexpr int kGroupSize = 16;
inline constexpr int kSuperGroupSize = 256;
inline constexpr int kGroupsPerSuperGroup = kSuperGroupSize / kGroupSize;
inline constexpr int kMaxLevels = 128;             // L + 1 for 8-bit codes
inline constexpr int kSearchBuckets = 1024;        // interval-search table resolution over [0, 1]
inline constexpr uint16_t kNanSuperUnit = 0x7fc0;  // bf16 quiet NaN: the SG held Inf/NaN
inline constexpr uint16_t kMinSuperUnit = 0x0080;  // bf16 2^-126, the smallest normal

// Levels and lookup tables of one code width. Plain data: copied as-is to GPU memory.
struct LevelTable {
  int32_t bits;                    // 2..8
  int32_t max_level;               // L = 2^(bits-1) - 1
  int32_t uniform;                 // 1: level[r] = r * (1/L), located arithmetically (no table search)
  float level[kMaxLevels];         // level[0] = 0 < ... < level[L] = 1
  float inv_gap[kMaxLevels];       // 1 / (level[r+1] - level[r]) for r < L
  float decode[256];               // signed level of each code; entries >= 2L+1 are 0 (illegal codes)
  int32_t search[kSearchBuckets];  // largest r <= L-1 with level[r] <= i / kSearchBuckets
};

inline constexpr int kMinWidth = 2;
inline constexpr int kMaxWidth = 8;

DQ_HOST_DEVICE int NumGroups(int count) { return (count + kGroupSize - 1) / kGroupSize; }

// Bytes of one SG of `count` elements at width `bits`.
DQ_HOST_DEVICE size_t SuperGroupBytes(int bits, int count) {
  return bits == 0 ? 0 : static_cast<size_t>(NumGroups(count)) * (2 * bits + 1) + 2;
}

DQ_HOST_DEVICE bool IsFiniteFloat(float x) { return (FloatBits(x) & 0x7f800000u) != 0x7f800000u; }

// Bucket statistics of a super-group, in one summation order that every implementation (scalar,
// SIMD of any width, CUDA) follows exactly, so all devices compute bit-identical statistics: eight
// partial sums, lane l over the elements k = l, l + 8, ... in order, then a fixed pairwise tree.
// Squares are exact in double (24-bit mantissas), so fused multiply-adds change nothing either.
inline constexpr int kMomentLanes = 8;

DQ_HOST_DEVICE double SumMomentLanes(const double* lane) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

DQ_HOST_DEVICE void SuperGroupMoments(const float* v, int count, double* sum, double* sum_sq) {
  double s[kMomentLanes] = {0, 0, 0, 0, 0, 0, 0, 0}, q[kMomentLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < count; ++k) {
    const double x = v[k];
    s[k % kMomentLanes] += x;
    q[k % kMomentLanes] += x * x;
  }
  *sum = SumMomentLanes(s);
  *sum_sq = SumMomentLanes(q);
}

// The two statistics that travel (as bf16) for a super-group of `count` elements: its mean (0 when
// not finite) and its norm, rounded up so a non-zero super-group never looks zero.
DQ_HOST_DEVICE void SuperGroupStats(double sum, double sum_sq, int count, float* stats) {
  const float mean = static_cast<float>(sum / static_cast<double>(count));
  stats[0] = IsFiniteFloat(mean) ? Bf16ToFloat(FloatToBf16(mean)) : 0.0f;
  stats[1] = Bf16ToFloat(FloatToBf16Up(static_cast<float>(sqrt(sum_sq))));
}

// The SG's super unit from its largest magnitude (`finite` false if any value was Inf/NaN).
DQ_HOST_DEVICE uint16_t SuperUnitFor(float sg_max, bool finite) {
  if (!finite) return kNanSuperUnit;
  uint16_t unit = FloatToBf16Up(sg_max / 255.0f);
  if (Bf16ToFloat(unit) * 255.0f < sg_max) unit += 1;  // the division rounded down: one more ulp
  // Keep group scales normal (>= 2^-126) so 1 / scale stays finite; super-groups of values below
  // ~3e-36 are quantized a little more coarsely, still unbiased.
  if (sg_max > 0.0f && unit < kMinSuperUnit) unit = kMinSuperUnit;
  return unit;
}

// Group scale code for a group with largest magnitude `group_max` (1..255; 1 for zero groups).
DQ_HOST_DEVICE uint32_t GroupScaleCode(float group_max, float super_unit) {
  if (!(super_unit > 0.0f)) return 1;
  float ratio = ceilf(group_max / super_unit);
  uint32_t r = ratio < 1.0f ? 1u : (ratio > 255.0f ? 255u : static_cast<uint32_t>(ratio));
  if (static_cast<float>(r) * super_unit < group_max && r < 255u) ++r;
  return r;
}

// Reciprocal of a group scale; 0 for an all-zero group so every code becomes zero.
DQ_HOST_DEVICE float InverseScale(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// The rounding threshold for element `index` of a bucket. `key` is the rank's stream key.
DQ_HOST_DEVICE float RoundingUnit(uint32_t key, uint32_t index, bool correlated, uint32_t stratum, uint32_t n) {
  float uniform = BitsToUnit(RandomBits(key, index));
  return correlated ? CorrelatedUnit(stratum, n, uniform) : uniform;
}

// QuantizeElement with the level kind fixed at compile time and the table's per-width constants
// passed in (L = t.max_level, top = t.level[L], step = t.level[1]), so a kernel reads them once per
// super-group and its per-element code has no branch on the kind. Any v gives an in-range table
// index (|v| * inv is clamped to [0, 1]; NaN becomes 1), so callers may quantize padding and
// discard the code. No branch on the data either: the search's one-step correction reads
// level[r + 1] whatever r (r <= L - 1, so it exists) and adds the comparison.
template <bool kUniform>
DQ_HOST_DEVICE uint32_t QuantizeElementOf(const LevelTable& t, int L, float top, float step, float v, float inv_scale,
                                          float u) {
  float x = fminf(fabsf(v) * inv_scale, 1.0f);
  int r;
  float p;
  if (kUniform) {
    // level[r] = r * (1/L); the estimate from x * L may be one off after rounding, so check it
    // against the levels themselves (on-grid inputs then round to themselves exactly).
    const float inv_L = step;
    r = static_cast<int>(x * static_cast<float>(L));
    r = r < L - 1 ? r : L - 1;
    if (x < static_cast<float>(r) * inv_L) {
      --r;
    } else if (r < L - 1 && x >= static_cast<float>(r + 1) * inv_L) {
      ++r;
    }
    p = (x - static_cast<float>(r) * inv_L) * static_cast<float>(L);
  } else {
    int idx = static_cast<int>(x * static_cast<float>(kSearchBuckets));
    idx = idx < kSearchBuckets - 1 ? idx : kSearchBuckets - 1;
    r = t.search[idx];
    r += static_cast<int>((r < L - 1) & (x >= t.level[r + 1]));
    p = (x - t.level[r]) * t.inv_gap[r];
  }
  // x at the top level must round to it for every u (p may come out a rounding error below 1).
  // Both comparisons are evaluated (no short circuit): the result is the same, without a branch.
  const int q = r + static_cast<int>((u < p) | (x >= top));
  return static_cast<uint32_t>(v < 0.0f ? L - q : L + q);
}

// Stochastically rounds v (|v| * inv_scale <= 1 up to rounding) to a code of `t`.
DQ_HOST_DEVICE uint32_t QuantizeElement(const LevelTable& t, float v, float inv_scale, float u) {
  const int L = t.max_level;
  return t.uniform ? QuantizeElementOf<true>(t, L, t.level[L], t.level[1], v, inv_scale, u)
                   : QuantizeElementOf<false>(t, L, t.level[L], t.level[1], v, inv_scale, u);
}

DQ_HOST_DEVICE uint32_t UnpackCode(const uint8_t* codes, int k, int bits) {
  const int bit = k * bits;
  const int shift = bit & 7;
  uint32_t w = codes[bit >> 3];
  if (shift + bits > 8) w |= static_cast<uint32_t>(codes[(bit >> 3) + 1]) << 8;
  return (w >> shift) & ((1u << bits) - 1u);
}

// ORs `code` into a zero-initialised packed group.
DQ_HOST_DEVICE void PackCode(uint8_t* codes, int k, int bits, uint32_t code) {
  const int bit = k * bits;
  const int shift = bit & 7;
  codes[bit >> 3] = static_cast<uint8_t>(codes[bit >> 3] | (code << shift));
  if (shift + bits > 8) codes[(bit >> 3) + 1] = static_cast<uint8_t>(codes[(bit >> 3) + 1] | (code >> (8 - shift)));
}

// Reads the super unit stored at the end of an SG.
DQ_HOST_DEVICE uint16_t LoadSuperUnit(const uint8_t* sg, int bits, int count) {
  const uint8_t* p = sg + SuperGroupBytes(bits, count) - 2;
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

// True if a group's packed codes contain the illegal code 2^b - 1 (all bits of a code set).
// Word-at-a-time so validation costs little next to decoding. Precondition: 2 * bits + 3 bytes are
// readable at `codes` (true for any group inside a super-group: codes, scale, super unit).
DQ_HOST_DEVICE bool HasIllegalCode(const uint8_t* codes, int bits) {
  if (bits == 2) {
    uint32_t w;
    memcpy(&w, codes, 4);
    return (w & (w >> 1) & 0x55555555u) != 0;
  }
  if (bits == 4) {
    uint64_t w;
    memcpy(&w, codes, 8);
    return (w & (w >> 1) & (w >> 2) & (w >> 3) & 0x1111111111111111ull) != 0;
  }
  if (bits == 8) {
    for (int half = 0; half < 2; ++half) {  // any byte == 0xff: find a zero byte in ~w
      uint64_t w;
      memcpy(&w, codes + 8 * half, 8);
      w = ~w;
      if (((w - 0x0101010101010101ull) & ~w & 0x8080808080808080ull) != 0) return true;
    }
    return false;
  }
  // Codes 0..7 and 8..15 each fill `bits` bytes: AND each code's bits down onto its lowest bit.
  uint64_t field_low_bits = 0;
  for (int k = 0; k < 8; ++k) field_low_bits |= uint64_t{1} << (k * bits);
  const int available = 2 * bits + 3;                     // see the precondition above
  const uint64_t mask = (uint64_t{1} << (8 * bits)) - 1;  // bits < 8 here
  for (int half = 0; half < 2; ++half) {
    const int offset = half * bits + 8 <= available ? half * bits : available - 8;
    uint64_t w;
    memcpy(&w, codes + offset, 8);
    w = (w >> (8 * (half * bits - offset))) & mask;
    uint64_t all_ones = w;
    for (int b = 1; b < bits; ++b) all_ones &= w >> b;
    if ((all_ones & field_low_bits) != 0) return true;
  }
  return false;
}

// Checks one received SG: legal codes, group scales 1..255, a finite non-negative (or NaN-marker)
// super unit. Peers may send anything; nothing is decoded before this passes.
DQ_HOST_DEVICE bool ValidateSuperGroup(const LevelTable& t, const uint8_t* sg, int count) {
  const int bits = t.bits;
  const int group_bytes = 2 * bits + 1;
  uint16_t unit = LoadSuperUnit(sg, bits, count);
  if (unit != kNanSuperUnit && (!IsFiniteFloat(Bf16ToFloat(unit)) || (unit & 0x8000u))) return false;
  for (int g = 0; g < NumGroups(count); ++g) {
    const uint8_t* group = sg + g * group_bytes;
    if (group[2 * bits] == 0 || HasIllegalCode(group, bits)) return false;
  }
  return true;
}

// Decodes a validated SG into out[0, count).
DQ_HOST_DEVICE void DecodeSuperGroup(const LevelTable& t, const uint8_t* sg, int count, float* out) {
  const int bits = t.bits;
  const int group_bytes = 2 * bits + 1;
  float unit = Bf16ToFloat(LoadSuperUnit(sg, bits, count));
  for (int g = 0; g < NumGroups(count); ++g) {
    const uint8_t* group = sg + g * group_bytes;
    float scale = static_cast<float>(group[2 * bits]) * unit;
    int n = count - g * kGroupSize < kGroupSize ? count - g * kGroupSize : kGroupSize;
    for (int k = 0; k < n; ++k) out[g * kGroupSize + k] = t.decode[UnpackCode(group, k, bits)] * scale;
  }
}

// Encodes v[0, count) (already the partial sum to send) into `sg`, which must hold
// SuperGroupBytes(t.bits, count) bytes. `first_index` is the bucket index of v[0].
DQ_HOST_DEVICE void EncodeSuperGroup(const LevelTable& t, const float* v, int count, uint32_t key, uint32_t first_index,
                                     bool correlated, uint32_t stratum, uint32_t n, uint8_t* sg) {
  const int bits = t.bits;
  const int group_bytes = 2 * bits + 1;
  const int groups = NumGroups(count);
  float group_max[kGroupsPerSuperGroup];
  float sg_max = 0.0f;
  bool finite = true;
  for (int g = 0; g < groups; ++g) {
    float m = 0.0f;
    int n_in_group = count - g * kGroupSize < kGroupSize ? count - g * kGroupSize : kGroupSize;
    for (int k = 0; k < n_in_group; ++k) {
      float a = fabsf(v[g * kGroupSize + k]);
      finite = finite && a <= 3.40282347e38f;
      m = a > m ? a : m;
    }
    group_max[g] = m;
    sg_max = m > sg_max ? m : sg_max;
  }
  uint16_t unit_bits = SuperUnitFor(sg_max, finite);
  float unit = finite ? Bf16ToFloat(unit_bits) : 0.0f;
  for (int g = 0; g < groups; ++g) {
    uint8_t* group = sg + g * group_bytes;
    for (int b = 0; b < 2 * bits; ++b) group[b] = 0;
    uint32_t r = GroupScaleCode(group_max[g], unit);
    group[2 * bits] = static_cast<uint8_t>(r);
    float inv = InverseScale(static_cast<float>(r) * unit);
    int n_in_group = count - g * kGroupSize < kGroupSize ? count - g * kGroupSize : kGroupSize;
    for (int k = 0; k < kGroupSize; ++k) {
      uint32_t code = static_cast<uint32_t>(t.max_level);  // zero (padding, or non-finite SG)
      if (k < n_in_group && finite) {
        uint32_t index = first_index + static_cast<uint32_t>(g * kGroupSize + k);
        code = QuantizeElement(t, v[g * kGroupSize + k], inv, RoundingUnit(key, index, correlated, stratum, n));
      }
      PackCode(group, k, bits, code);
    }
  }
  uint8_t* tail = sg + groups * group_bytes;
  tail[0] = static_cast<uint8_t>(unit_bits);
  tail[1] = static_cast<uint8_t>(unit_bits >> 8);
}

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_DYNAMIQ_MATH_H_

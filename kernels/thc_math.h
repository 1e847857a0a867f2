// Per-element math of THC (CodecId::kThc, algorithm.md 2.1), shared by the CPU codec and any future
// CUDA kernel (both must produce identical bytes).
//
// Rotation (Li et al., NSDI'24, as their code does it): the whole bucket of d elements is
// zero-padded to P = max(256, 2^ceil(log2 d)) elements and rotated with one randomized Hadamard
// transform
//   y = H D x / sqrt(P)   (D: shared random +-1 diagonal re-drawn every round, H: P x P Hadamard)
// before it is cut into chunks, and the all-reduced sum is rotated back (x = D H y / sqrt(P)) after
// the all-gather (Codec::ForwardTransform / InverseTransform, run by the engine around the
// schedule). Every rotated coordinate is then close to N(0, |x|^2 / P) whatever the layout of x.
// The chunk-level codec works on y: it cuts it into aligned blocks of 256 coefficients, normalizes
// by the bucket's global norm N (max over ranks of the local L2 norms; the rotation keeps norms) to
//   z = y * sqrt(P) / N   (coordinates roughly N(0, 1)),
// clamps to [-T, T] (T = 3.2972: |z| > T about once per 1024 coordinates) and stochastically
// rounds onto the 16-point table v_k = R[k] * 2T/g - T, g = 42. The rounding is between the two
// neighbouring table points, unbiased in the value domain (it works on pos = (z + T) * g / 2T,
// an affine image of z, so unbiased in pos is unbiased in z).
//
// Integer homomorphism: a sum of s contributions is S = sum_i R[X_i] <= s * g, and decodes to
//   y = (S * 2T/g - s * T) * N / sqrt(P).
//
// Codes on the wire are packed LSB-first: coefficient j at bit j * w, w = 4 (leaf table indices)
// or w in {8, 12, 16} (integer sums).
#ifndef DQ_KERNELS_THC_MATH_H_
#define DQ_KERNELS_THC_MATH_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/host_device.h"
#include "kernels/random_math.h"

namespace dynamiq::kernels {

inline constexpr int kThcBlockSize = 256;
inline constexpr int kThcTableSize = 16;                             // 4-bit indices
inline constexpr int kThcGranularity = 42;                           // g: R[15]
inline constexpr float kThcClamp = 3.2972f;                          // T: 2 * (1 - Phi(T)) = 1 / 1024
inline constexpr uint32_t kThcSignStream = kSharedStream ^ 0x7468u;  // RHT signs, shared by all ranks

// The table and the lookups derived from it. Plain data: copy it as-is to GPU memory.
struct ThcTable {
  int32_t value[kThcTableSize];      // R[k], 0 = R[0] < ... < R[15] = g
  float inv_gap[kThcTableSize - 1];  // 1 / (R[k+1] - R[k])
  int32_t cell[kThcGranularity];     // largest k <= 14 with R[k] <= c, for c in 0..g-1
};

DQ_HOST_DEVICE void InitThcTable(ThcTable* t) {
  const int32_t r[kThcTableSize] = {0, 6, 9, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 33, 36, 42};
  for (int k = 0; k < kThcTableSize; ++k) t->value[k] = r[k];
  for (int k = 0; k + 1 < kThcTableSize; ++k) t->inv_gap[k] = 1.0f / static_cast<float>(r[k + 1] - r[k]);
  int k = 0;
  for (int c = 0; c < kThcGranularity; ++c) {
    while (k + 2 < kThcTableSize && r[k + 1] <= c) ++k;
    t->cell[c] = k;
  }
}

// Table point k in the normalized domain.
DQ_HOST_DEVICE float ThcTableValue(const ThcTable& t, int k) {
  return static_cast<float>(t.value[k]) * (2.0f * kThcClamp / kThcGranularity) - kThcClamp;
}

// The RHT sign of bucket element `index` (+1 or -1).
DQ_HOST_DEVICE float ThcSign(uint32_t sign_key, uint32_t index) {
  return (RandomBits(sign_key, index) >> 31) != 0u ? -1.0f : 1.0f;
}

// Rotated length of a bucket of d elements: 0 for d = 0, else the smallest power of two >= d and
// >= 256 (so that chunks of whole 256-blocks tile it).
DQ_HOST_DEVICE uint64_t ThcRotatedLength(uint64_t d) {
  if (d == 0) return 0;
  uint64_t p = kThcBlockSize;
  while (p < d) p <<= 1;
  return p;
}

// One butterfly of the Walsh-Hadamard transform: (a, b) -> (a + b, a - b).
DQ_HOST_DEVICE void ThcButterfly(float* a, float* b) {
  const float x = *a, y = *b;
  *a = x + y;
  *b = x - y;
}

// The butterflies of Walsh-Hadamard levels h = h_begin, 2 h_begin, ... < h_end (powers of two)
// over v[0, n), n a multiple of 2 h of every level. Levels commute, so any split of the levels
// into calls (and any order of independent butterflies within a level) gives identical results.
DQ_HOST_DEVICE void ThcHadamardLevels(float* v, uint64_t n, uint64_t h_begin, uint64_t h_end) {
  for (uint64_t h = h_begin; h < h_end; h <<= 1) {
    for (uint64_t i = 0; i < n; i += 2 * h) {
      for (uint64_t j = i; j < i + h; ++j) ThcButterfly(v + j, v + j + h);
    }
  }
}

// Two consecutive levels h and 2h at once on the four elements j, j + h, j + 2h, j + 3h (j in the
// first quarter of a 4h-block): the same operations, in the same order, as the two levels one after
// the other, in one pass over memory.
DQ_HOST_DEVICE void ThcButterfly4(float* v, uint64_t j, uint64_t h) {
  ThcButterfly(v + j, v + j + h);
  ThcButterfly(v + j + 2 * h, v + j + 3 * h);
  ThcButterfly(v + j, v + j + 2 * h);
  ThcButterfly(v + j + h, v + j + 3 * h);
}

// Levels 1, 2 and 4 on each of the 8 groups of 8 consecutive elements of v[0, 64): the same
// operations as ThcHadamardLevels(v, 64, 1, 8), laid out so that a compiler runs the 8 groups in
// SIMD lanes (5x faster than group by group on this machine's x86-64 baseline).
DQ_HOST_DEVICE void ThcHadamard8x8(float* v) {
  float a[8][8];  // a[k][g] = element k of group g
  for (int k = 0; k < 8; ++k) {
    for (int g = 0; g < 8; ++g) a[k][g] = v[8 * g + k];
  }
  for (int h = 1; h < 8; h <<= 1) {
    for (int i = 0; i < 8; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        for (int g = 0; g < 8; ++g) ThcButterfly(&a[j][g], &a[j + h][g]);
      }
    }
  }
  for (int k = 0; k < 8; ++k) {
    for (int g = 0; g < 8; ++g) v[8 * g + k] = a[k][g];
  }
}

// v[i] *= sign(first + i) * scale for i in [0, count): the diagonal D and the 1/sqrt(P) of the
// rotation.
DQ_HOST_DEVICE void ThcSignScale(float* v, uint64_t count, uint32_t sign_key, uint32_t first, float scale) {
  for (uint64_t i = 0; i < count; ++i) v[i] *= ThcSign(sign_key, first + static_cast<uint32_t>(i)) * scale;
}

// The rounding threshold u in [0, 1) for coefficient `index`; `key` is the rank's stream key.
DQ_HOST_DEVICE float ThcRoundingUnit(uint32_t key, uint32_t index, bool correlated, uint32_t stratum, uint32_t n) {
  float uniform = BitsToUnit(RandomBits(key, index));
  return correlated ? CorrelatedUnit(stratum, n, uniform) : uniform;
}

// Stochastically rounds z onto the table (after clamping to [-T, T]); returns the index 0..15.
// Rounds up iff u < the fractional position between the neighbouring points. NaN z maps to 0.
DQ_HOST_DEVICE uint32_t ThcQuantize(const ThcTable& t, float z, float u) {
  float pos = (z + kThcClamp) * (kThcGranularity / (2.0f * kThcClamp));
  pos = fminf(fmaxf(pos, 0.0f), static_cast<float>(kThcGranularity));
  int c = static_cast<int>(pos);
  c = c < kThcGranularity - 1 ? c : kThcGranularity - 1;
  int k = t.cell[c];  // R[k] <= c <= pos < c + 1 <= R[k+1]  (pos = g lands in the last cell)
  float p = (pos - static_cast<float>(t.value[k])) * t.inv_gap[k];
  return static_cast<uint32_t>(k + (u < p ? 1 : 0));
}

// Integer sum S of s contributions -> the rotated value y (see the header comment).
DQ_HOST_DEVICE float ThcDequantize(uint32_t sum, uint32_t summands, float from_z) {
  float z = static_cast<float>(sum) * (2.0f * kThcClamp / kThcGranularity) - static_cast<float>(summands) * kThcClamp;
  return z * from_z;
}

// Code j of a packed block, w in {4, 8, 12, 16}. Reads only the bytes the code occupies.
DQ_HOST_DEVICE uint32_t ThcUnpack(const uint8_t* codes, int j, int w) {
  int bit = j * w;
  const uint8_t* p = codes + (bit >> 3);
  int shift = bit & 7;
  uint32_t word = p[0];
  if (shift + w > 8) word |= static_cast<uint32_t>(p[1]) << 8;
  if (shift + w > 16) word |= static_cast<uint32_t>(p[2]) << 16;
  return (word >> shift) & ((1u << w) - 1u);
}

// ORs `code` into zero-initialised packed codes.
DQ_HOST_DEVICE void ThcPack(uint8_t* codes, int j, int w, uint32_t code) {
  int bit = j * w;
  uint8_t* p = codes + (bit >> 3);
  int shift = bit & 7;
  uint32_t word = code << shift;
  p[0] = static_cast<uint8_t>(p[0] | word);
  if (shift + w > 8) p[1] = static_cast<uint8_t>(p[1] | (word >> 8));
  if (shift + w > 16) p[2] = static_cast<uint8_t>(p[2] | (word >> 16));
}

// Bytes of one packed 256-coefficient block at w bits per code.
DQ_HOST_DEVICE size_t ThcBlockBytes(int w) { return static_cast<size_t>(kThcBlockSize) * w / 8; }

// Width of the integer sums: the smallest of 8, 12, 16 bits with 2^w > world_size * g; 0 if none.
DQ_HOST_DEVICE int ThcSumBits(uint32_t world_size) {
  const uint64_t max_sum = static_cast<uint64_t>(world_size) * kThcGranularity;
  if (max_sum < (1u << 8)) return 8;
  if (max_sum < (1u << 12)) return 12;
  if (max_sum < (1u << 16)) return 16;
  return 0;
}

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_THC_MATH_H_

// Per-element math of Global-QSGD (CodecId::kGlobalQsgd; Xin, Canini, Richtarik, Horvath,
// "Quantize Once, Train Fast: Allreduce-Compatible Compression with Provable Guarantees", arXiv
// 2305.18627), shared by the CPU codec and any future CUDA kernel (both must produce identical
// bytes).
//
// Standard dithering with a GLOBAL scale: every rank normalizes by the same M, the largest |x| of
// any rank's bucket (an L-infinity norm, as the authors' standard_dithering hook; the paper's
// analysis also admits the largest L2 norm, which only makes the levels coarser), so
//   t = x * s / M in [-s, s],  q = floor(t) + (u < t - floor(t))   (unbiased: E[q] = t)
// with s = 2^(b-1) - 1 levels per sign at b bits (b = 2: ternary, b = 8: s = 127, the authors'
// int8). Codes of different ranks share one unit M / s, so the sum of k ranks' codes is an
// integer Q in [-k s, k s] that decodes to Q * M / s: hops add integers and never re-quantize.
//
// Integer range along the hops: a chunk holding k contributions carries each Q offset by k s, so
// the stored value lies in [0, 2 k s], at the smallest width that holds 2 k s:
//   w(k) = bit_width(2 k s)       (leaf k = 1: exactly b bits; 2^b - 1 is an illegal leaf code)
// It grows by one bit each time k doubles: at b = 8 (s = 127), 8 bits at the leaf, 9 at k = 2,
// 10 at k = 3..4, 11 at k = 5..8, ..., 24 bits at most (k <= 65535). The authors instead scale
// every rank's value by 1/n so that sums stay in int8: that spends log2(n) bits of every rank's
// resolution at every hop; growing the width spends them only on the later hops and keeps each
// rank's quantization at the full b bits.
//
// Codes are packed LSB-first: element j of the chunk at bit j * w; (count * w + 7) / 8 bytes.
#ifndef DQ_KERNELS_GLOBAL_QSGD_MATH_H_
#define DQ_KERNELS_GLOBAL_QSGD_MATH_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/host_device.h"

namespace dynamiq::kernels {

inline constexpr int kGlobalQsgdMinBits = 2;
inline constexpr int kGlobalQsgdMaxBits = 8;
inline constexpr int kGlobalQsgdMaxSumBits = 24;  // 2 * 65535 * 127 < 2^24

// s: levels per sign at b bits.
DQ_HOST_DEVICE uint32_t GlobalQsgdLevels(int bits) { return (1u << (bits - 1)) - 1u; }

// w(k): bits per stored sum of k contributions at s levels (bit width of 2 k s).
DQ_HOST_DEVICE int GlobalQsgdSumBits(uint32_t summands, uint32_t levels) {
  uint64_t max_stored = 2ull * summands * levels;
  int w = 0;
  while (max_stored != 0) {
    ++w;
    max_stored >>= 1;
  }
  return w;
}

// Packed bytes of `count` codes at w bits.
DQ_HOST_DEVICE size_t GlobalQsgdPackedBytes(size_t count, int w) { return (count * static_cast<size_t>(w) + 7) / 8; }

// Stochastically rounds t = x * to_unit (clamped to [-s, s]) to an integer level; u in [0, 1).
// Rounds up iff u < frac(t). x must be finite.
DQ_HOST_DEVICE int32_t GlobalQsgdQuantize(float x, float to_unit, uint32_t levels, float u) {
  const float s = static_cast<float>(levels);
  float t = x * to_unit;
  t = fminf(fmaxf(t, -s), s);
  const float lo = floorf(t);
  return static_cast<int32_t>(lo) + (u < t - lo ? 1 : 0);
}

// Integer sum Q -> value. |Q| < 2^24, so float(Q) is exact.
DQ_HOST_DEVICE float GlobalQsgdDecode(int32_t sum, float unit) { return static_cast<float>(sum) * unit; }

// Code j (w <= 24 bits) of LSB-first packed codes. Reads only the bytes the code occupies.
DQ_HOST_DEVICE uint32_t GlobalQsgdUnpack(const uint8_t* codes, size_t j, int w) {
  const size_t bit = j * static_cast<size_t>(w);
  const uint8_t* p = codes + (bit >> 3);
  const int shift = static_cast<int>(bit & 7);
  uint64_t word = 0;
  const int nbytes = (shift + w + 7) / 8;
  for (int b = 0; b < nbytes; ++b) word |= static_cast<uint64_t>(p[b]) << (8 * b);
  return static_cast<uint32_t>((word >> shift) & ((1ull << w) - 1ull));
}

// ORs `code` (< 2^w) into zero-initialised packed codes.
DQ_HOST_DEVICE void GlobalQsgdPack(uint8_t* codes, size_t j, int w, uint32_t code) {
  const size_t bit = j * static_cast<size_t>(w);
  uint8_t* p = codes + (bit >> 3);
  const int shift = static_cast<int>(bit & 7);
  const uint64_t word = static_cast<uint64_t>(code) << shift;
  const int nbytes = (shift + w + 7) / 8;
  for (int b = 0; b < nbytes; ++b) p[b] = static_cast<uint8_t>(p[b] | (word >> (8 * b)));
}

// Sequential forms of the same packing, for whole chunks: reads and writes exactly the packed
// bytes, in order.
struct GlobalQsgdBitReader {
  const uint8_t* p;
  uint64_t buffer = 0;
  int available = 0;
  DQ_HOST_DEVICE explicit GlobalQsgdBitReader(const uint8_t* codes) : p(codes) {}
  DQ_HOST_DEVICE uint32_t Next(int w) {
    while (available < w) {
      buffer |= static_cast<uint64_t>(*p++) << available;
      available += 8;
    }
    const uint32_t v = static_cast<uint32_t>(buffer & ((1ull << w) - 1ull));
    buffer >>= w;
    available -= w;
    return v;
  }
};

struct GlobalQsgdBitWriter {
  uint8_t* p;
  uint64_t buffer = 0;
  int pending = 0;
  DQ_HOST_DEVICE explicit GlobalQsgdBitWriter(uint8_t* codes) : p(codes) {}
  // `code` < 2^w.
  DQ_HOST_DEVICE void Put(uint32_t code, int w) {
    buffer |= static_cast<uint64_t>(code) << pending;
    pending += w;
    while (pending >= 8) {
      *p++ = static_cast<uint8_t>(buffer);
      buffer >>= 8;
      pending -= 8;
    }
  }
  // Writes the last partial byte (zero-padded).
  DQ_HOST_DEVICE void Flush() {
    if (pending > 0) *p++ = static_cast<uint8_t>(buffer);
    buffer = 0;
    pending = 0;
  }
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_GLOBAL_QSGD_MATH_H_

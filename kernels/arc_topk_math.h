// Per-element math of ARC-Top-K (CodecId::kArcTopK; Chen, Ma, Li, He, Dong, Yuan, "An All-Reduce
// Compatible Top-K Compressor for Communication-Efficient Distributed Learning", arXiv 2510.26709),
// shared by the CPU codec and any future CUDA kernel.
//
// The bucket is seen as rows of kArcTopKRow = 256 elements (DynamiQ's super-groups, so chunk and
// pipelining-block boundaries never cut a row; the last row may be partial). Every rank sketches
// its rows with the same random projection V (256 x kArcTopKSketch = 4, entries +-1):
//   S[g][p] = sum over j in 0..255 of x[256 g + j] * V[j][p]
// (the authors project every row of a weight matrix with one shared Gaussian matrix; Rademacher
// signs keep it exactly reproducible). The sketch is linear, so the SUM of the ranks' sketches is
// the sketch of the summed gradient; the row score |S[g]|^2 / 4 estimates the squared norm of row
// g of that sum (unbiased over V: E[V[i][p] V[j][p]] = [i == j]). All ranks rank rows by that
// score and keep the same top ceil(density * rows) rows, so the values travel without indices.
#ifndef DQ_KERNELS_ARC_TOPK_MATH_H_
#define DQ_KERNELS_ARC_TOPK_MATH_H_

#include <stddef.h>
#include <stdint.h>

#include "kernels/host_device.h"
#include "kernels/random_math.h"

namespace dynamiq::kernels {

inline constexpr int kArcTopKRow = 256;
inline constexpr int kArcTopKSketch = 4;
inline constexpr uint32_t kArcTopKSignStream = kSharedStream ^ 0x6172u;  // projection signs, shared
inline constexpr double kArcTopKMinDensity = 0.001;

// The key of projection direction p (0..3): fixed per job seed, shared by all ranks. (Codec
// statistics are computed without the round, so the projection does not change between steps.)
DQ_HOST_DEVICE uint32_t ArcTopKSignKey(uint64_t seed, int p) {
  return StreamKey(seed, static_cast<uint64_t>(p), kArcTopKSignStream);
}

// V[j][p] as +-1.0f, for key = ArcTopKSignKey(seed, p).
DQ_HOST_DEVICE float ArcTopKSign(uint32_t key, uint32_t j) { return (RandomBits(key, j) >> 31) != 0u ? -1.0f : 1.0f; }

// Rows kept out of `rows` at `density` in (0, 1]: ceil(density * rows), at least 1 of a non-empty
// bucket. Computed in double from the configured density, identical on every rank.
DQ_HOST_DEVICE size_t ArcTopKKeptRows(size_t rows, double density) {
  if (rows == 0) return 0;
  double k = density * static_cast<double>(rows);
  size_t kept = static_cast<size_t>(k);
  if (static_cast<double>(kept) < k) ++kept;
  if (kept < 1) kept = 1;
  return kept > rows ? rows : kept;
}

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_ARC_TOPK_MATH_H_

// Counter-based random numbers for stochastic rounding, shared by CPU and CUDA code.
//
// Every random value is a pure function of (key, index): no state, no ordering, so any thread,
// SIMD lane or GPU block can compute the value for any coordinate, and CPU and GPU agree bit for
// bit. Keys are derived from the job seed, the collective round and a stream id (the rank for
// per-rank noise; a fixed id for the permutation that all ranks share).
#ifndef DQ_KERNELS_RANDOM_MATH_H_
#define DQ_KERNELS_RANDOM_MATH_H_

#include <stdint.h>

#include "kernels/host_device.h"

namespace dynamiq::kernels {

// Stream id for values every rank must draw identically (the correlated-rounding permutation).
inline constexpr uint32_t kSharedStream = 0xfffffff0u;

// lowbias32 integer finalizer (a bijection on 32 bits with good avalanche).
DQ_HOST_DEVICE uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

DQ_HOST_DEVICE uint32_t StreamKey(uint64_t seed, uint64_t round, uint32_t stream) {
  uint32_t k = Mix32(static_cast<uint32_t>(seed) ^ 0x9e3779b9u);
  k = Mix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = Mix32(k ^ static_cast<uint32_t>(round));
  k = Mix32(k ^ static_cast<uint32_t>(round >> 32));
  return Mix32(k ^ Mix32(stream + 0x632be5abu));
}

// 32 random bits for coordinate `index` of the stream `key`.
DQ_HOST_DEVICE uint32_t RandomBits(uint32_t key, uint32_t index) { return Mix32(index * 0x9e3779b1u + key); }

// Uniform in [0, 1) with 24 random bits (exactly representable as float).
DQ_HOST_DEVICE float BitsToUnit(uint32_t bits) { return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f); }

// Correlated rounding (stratified sampling across ranks): the stratum rank `rank` uses for
// super-group `group`. Strata are a uniformly random permutation of 0..n-1 shared by all ranks
// (Fisher-Yates driven by the shared key), so every stratum [k/n, (k+1)/n) holds exactly one rank.
// We track where `rank` lands instead of materialising the permutation: O(n) time, O(1) memory.
DQ_HOST_DEVICE uint32_t StratumOf(uint32_t shared_key, uint32_t group, uint32_t rank, uint32_t n) {
  uint32_t pos = rank;
  uint32_t group_key = Mix32(shared_key ^ (group * 0x85ebca77u));
  for (uint32_t i = n - 1; i >= 1; --i) {
    uint32_t j = static_cast<uint32_t>((static_cast<uint64_t>(RandomBits(group_key, i)) * (i + 1)) >> 32);
    if (pos == i) {
      pos = j;
    } else if (pos == j) {
      pos = i;
    }
  }
  return pos;
}

// The rounding threshold u in [0, 1): plain uniform when `n == 1` or correlation is off, else
// (stratum + uniform) / n.
DQ_HOST_DEVICE float CorrelatedUnit(uint32_t stratum, uint32_t n, float uniform) {
  float u = (static_cast<float>(stratum) + uniform) * (1.0f / static_cast<float>(n));
  return u < 0.99999994f ? u : 0.99999994f;  // float rounding may reach 1.0; keep u < 1
}

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_RANDOM_MATH_H_

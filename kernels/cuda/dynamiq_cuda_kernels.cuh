// Bodies of the DynamiQ CUDA kernels as block-level device functions.
//
// They are written against a small `Block` interface instead of CUDA built-ins:
//   int thread() const;          threadIdx.x
//   uint32_t block() const;      blockIdx.x
//   void Sync();                 __syncthreads()
//   float ShflXor(float, int);   __shfl_xor_sync(0xffffffff, v, lane_mask), likewise for int
// so the same source is compiled by nvcc into the kernels (kernels/cuda/dynamiq_cuda.cu, CudaBlock)
// and by g++ into a CPU emulation of a thread block (tests/kernels/cuda_block_emulator.h) that
// checks indexing, barriers and bit-exact parity with the CPU codec on machines without a GPU.
// Headers included here must stay free of CUDA headers.
//
// Mapping: one block of kDynamiqBlockThreads = 256 threads per super-group (SG); thread t owns
// element t of the SG, i.e. position t % 16 of group t / 16. The two halves of a warp are two
// groups, so a group's max is a 4-step __shfl_xor_sync butterfly inside a 16-lane half warp.
// Shared memory: one DynamiqBlockShared (~132 bytes) per block. One barrier per SG.
//
// Encoding one SG (EncodeSgInBlock; also the second half of the fused DAR), per block:
//   1. every thread: |v| and finiteness, butterfly max / AND over its group; lane 0 of each group
//      stores them; thread 0 computes the SG's stratum (StratumOf).                     Sync
//   2. every half warp: butterfly max / AND over the groups' values -> super unit
//      (SuperUnitFor), computed by every thread (no barrier).
//   3. every thread: its group's scale code (GroupScaleCode) and its element's code
//      (QuantizeElement); each group's half warp packs its 16 codes with an OR butterfly of
//      shuffles (PackCode's layout) and writes the group's bytes and scale byte to global
//      memory; thread 0 writes the super unit. No staging copy: one barrier per SG.
// Every float operation is the one EncodeSuperGroup performs, through the same functions of
// kernels/dynamiq_math.h. The max of non-negative, non-NaN floats is exact and independent of
// order, so the butterfly and the sequential loop agree bit for bit (NaN counts as 0 in both; a
// SG holding NaN or Inf is sent as the NaN marker whatever its maxima).
#ifndef DQ_KERNELS_CUDA_DYNAMIQ_CUDA_KERNELS_CUH_
#define DQ_KERNELS_CUDA_DYNAMIQ_CUDA_KERNELS_CUH_

#include <math.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"
#include "kernels/dynamiq_math.h"
#include "kernels/random_math.h"

#if defined(__CUDACC__)
#define DQ_DEVICE __device__ __forceinline__
#else
#define DQ_DEVICE inline
#endif

namespace dynamiq::kernels::internal {

inline constexpr int kDynamiqBlockThreads = kSuperGroupSize;  // one thread per element of a SG
inline constexpr int kValidateBlockThreads = 256;             // one thread per SG

// Largest finite float: |v| <= this is false for Inf and NaN (as in EncodeSuperGroup).
inline constexpr float kMaxFiniteFloat = 3.40282347e38f;

struct DynamiqBlockShared {
  float group_max[kGroupsPerSuperGroup];
  int group_finite[kGroupsPerSuperGroup];
  uint32_t stratum;
};

// Elements in SG j of a run of `count` elements (1..256).
DQ_DEVICE int SgElementCount(uint64_t count, uint64_t j) {
  const uint64_t rest = count - j * kSuperGroupSize;
  return rest < static_cast<uint64_t>(kSuperGroupSize) ? static_cast<int>(rest) : kSuperGroupSize;
}

DQ_DEVICE bool IsCodeWidth(int w) { return w >= kMinWidth && w <= kMaxWidth; }

// Element k < count of a validated SG, computed exactly as DecodeSuperGroup does.
DQ_DEVICE float DecodeSgElement(const LevelTable& t, const uint8_t* sg, int count, int k) {
  const int bits = t.bits;
  const float unit = Bf16ToFloat(LoadSuperUnit(sg, bits, count));
  const uint8_t* group = sg + (k / kGroupSize) * (2 * bits + 1);
  const float scale = static_cast<float>(group[2 * bits]) * unit;
  return t.decode[UnpackCode(group, k % kGroupSize, bits)] * scale;
}

// Encodes the block's SG into `out` (SuperGroupBytes(t.bits, count) bytes of global memory).
// Every thread of the block must call it; `v` is the thread's element (ignored for padding
// threads, thread() >= count, which must pass 0).
template <typename Block>
DQ_DEVICE void EncodeSgInBlock(Block& b, const DynamiqDeviceArgs& a, uint64_t global_sg, const LevelTable& t, int count,
                               float v, uint8_t* out, DynamiqBlockShared& s) {
  const int tid = b.thread();
  const int g = tid / kGroupSize;
  const int bits = t.bits;
  const int group_bytes = 2 * bits + 1;
  const int groups = NumGroups(count);

  // 1. Group max and finiteness (padding threads hold 0: finite, no effect on the max).
  const float mag = fabsf(v);
  float m = mag > 0.0f ? mag : 0.0f;  // the sequential loop's first step from 0: NaN -> 0
  int finite = mag <= kMaxFiniteFloat ? 1 : 0;
  for (int lanes = kGroupSize / 2; lanes >= 1; lanes /= 2) {
    const float other = b.ShflXor(m, lanes);
    m = other > m ? other : m;
    finite &= b.ShflXor(finite, lanes);
  }
  if (tid % kGroupSize == 0) {
    s.group_max[g] = m;
    s.group_finite[g] = finite;
  }
  if (tid == 0) {
    s.stratum = a.correlated
                    ? StratumOf(a.shared_key, static_cast<uint32_t>(global_sg), a.rounding_index, a.rounding_size)
                    : 0u;
  }
  b.Sync();

  // 2. Super unit from the SG's max: every half warp reduces the groups' maxima with a butterfly
  // (the same result in each: the max is exact and order-free), so every thread derives the unit
  // itself and no second barrier is needed.
  const int k = tid % kGroupSize;
  float sg_max = k < groups ? s.group_max[k] : 0.0f;
  int all_finite = k < groups ? s.group_finite[k] : 1;
  for (int lanes = kGroupSize / 2; lanes >= 1; lanes /= 2) {
    const float other = b.ShflXor(sg_max, lanes);
    sg_max = other > sg_max ? other : sg_max;
    all_finite &= b.ShflXor(all_finite, lanes);
  }
  const bool sg_finite = all_finite != 0;
  const uint16_t unit_bits = static_cast<uint16_t>(SuperUnitFor(sg_max, sg_finite));

  // 3. Codes (padding and non-finite SGs: code L, the zero level), packed by each group's half warp:
  // lane k's code takes bits [k b, (k + 1) b) of the group's 16 b-bit field (PackCode's LSB-first
  // layout; at most 128 bits, words w0..w3); an OR butterfly over the 16 lanes gives every lane the
  // whole field, and lane k < 2 b writes byte k straight to global memory (no staging, no barrier).
  const float unit = sg_finite ? Bf16ToFloat(unit_bits) : 0.0f;
  uint32_t code = static_cast<uint32_t>(t.max_level);
  uint32_t scale_code = 0;
  if (g < groups) scale_code = GroupScaleCode(s.group_max[g], unit);
  if (tid < count && sg_finite) {
    const float inv = InverseScale(static_cast<float>(scale_code) * unit);
    const uint32_t index = static_cast<uint32_t>(global_sg * kSuperGroupSize) + static_cast<uint32_t>(tid);
    code = QuantizeElement(t, v, inv, RoundingUnit(a.key, index, a.correlated, s.stratum, a.rounding_size));
  }
  const int bit = k * bits;
  const int word = bit >> 5;
  const int shift = bit & 31;
  const uint32_t low = code << shift;                                   // into `word`
  const uint32_t high = shift + bits > 32 ? code >> (32 - shift) : 0u;  // into word + 1
  uint32_t w0 = word == 0 ? low : 0u;
  uint32_t w1 = word == 1 ? low : word == 0 ? high : 0u;
  uint32_t w2 = word == 2 ? low : word == 1 ? high : 0u;
  uint32_t w3 = word == 3 ? low : word == 2 ? high : 0u;
  for (int lanes = kGroupSize / 2; lanes >= 1; lanes /= 2) {
    w0 |= static_cast<uint32_t>(b.ShflXor(static_cast<int>(w0), lanes));
    w1 |= static_cast<uint32_t>(b.ShflXor(static_cast<int>(w1), lanes));
    w2 |= static_cast<uint32_t>(b.ShflXor(static_cast<int>(w2), lanes));
    w3 |= static_cast<uint32_t>(b.ShflXor(static_cast<int>(w3), lanes));
  }
  if (g < groups) {
    uint8_t* group = out + g * group_bytes;
    if (k < 2 * bits) {
      const int q = k >> 2;
      const uint32_t field = q == 0 ? w0 : q == 1 ? w1 : q == 2 ? w2 : w3;
      group[k] = static_cast<uint8_t>(field >> ((k & 3) * 8));
    }
    if (k == 0) group[2 * bits] = static_cast<uint8_t>(scale_code);
  }
  if (tid == 0) {
    uint8_t* tail = out + groups * group_bytes;
    tail[0] = static_cast<uint8_t>(unit_bits);
    tail[1] = static_cast<uint8_t>(unit_bits >> 8);
  }
}

// Compress: block b.block() encodes SG j = b.block() of the run.
template <typename Block>
DQ_DEVICE void EncodeBlock(Block& b, const DynamiqDeviceArgs& a, const float* values, uint8_t* payload_sgs,
                           DynamiqBlockShared& s) {
  const uint64_t j = b.block();
  const int w = a.widths[j];
  if (!IsCodeWidth(w)) return;  // width 0 takes no bytes (the host rejects other widths); block-uniform
  const int count = SgElementCount(a.count, j);
  const int tid = b.thread();
  const float v = tid < count ? values[j * kSuperGroupSize + tid] : 0.0f;
  EncodeSgInBlock(b, a, a.first_sg + j, a.tables[w], count, v, payload_sgs + a.offsets[j], s);
}

// Fused DAR: decode + local, re-encoded at the same width. All reads of in_sgs happen before the
// (only) Sync and all writes after it, so in place (in_sgs == out_sgs) is safe.
template <typename Block>
DQ_DEVICE void DarBlock(Block& b, const DynamiqDeviceArgs& a, const uint8_t* in_sgs, const float* local,
                        uint8_t* out_sgs, DynamiqBlockShared& s) {
  const uint64_t j = b.block();
  const int w = a.widths[j];
  if (!IsCodeWidth(w)) return;
  const LevelTable& t = a.tables[w];
  const int count = SgElementCount(a.count, j);
  const int tid = b.thread();
  float v = 0.0f;
  if (tid < count) {
    // DecompressAccumulateRecompress: tile = local, then tile += decoded.
    v = local[j * kSuperGroupSize + tid] + DecodeSgElement(t, in_sgs + a.offsets[j], count, tid);
  }
  EncodeSgInBlock(b, a, a.first_sg + j, t, count, v, out_sgs + a.offsets[j], s);
}

// Decompress (one element per thread, no barriers): SG j, element tid.
DQ_DEVICE void DecodeThread(const DynamiqDeviceArgs& a, uint64_t j, int tid, const uint8_t* payload_sgs, float* out,
                            bool accumulate) {
  const int count = SgElementCount(a.count, j);
  if (tid >= count) return;
  const int w = a.widths[j];
  float* dst = out + j * kSuperGroupSize + tid;
  if (!IsCodeWidth(w)) {  // width 0: every element is exactly zero
    if (!accumulate) *dst = 0.0f;
    return;
  }
  const float d = DecodeSgElement(a.tables[w], payload_sgs + a.offsets[j], count, tid);
  *dst = accumulate ? *dst + d : d;
}

// True if SG j may be decoded: width 0, or a legal width whose SG passes ValidateSuperGroup.
DQ_DEVICE bool SgIsValid(const DynamiqDeviceArgs& a, const uint8_t* payload_sgs, uint64_t j) {
  const int w = a.widths[j];
  if (w == 0) return true;
  if (!IsCodeWidth(w)) return false;
  return ValidateSuperGroup(a.tables[w], payload_sgs + a.offsets[j], SgElementCount(a.count, j));
}

}  // namespace dynamiq::kernels::internal

#undef DQ_DEVICE

#endif  // DQ_KERNELS_CUDA_DYNAMIQ_CUDA_KERNELS_CUH_

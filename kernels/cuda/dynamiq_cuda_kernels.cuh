// Bodies of the DynamiQ CUDA kernels as warp-level device functions.
//
// They are written against a small `Warp` interface instead of CUDA built-ins:
//   int lane() const;                   threadIdx.x % 32
//   uint32_t ShflXor(uint32_t, int);    __shfl_xor_sync(0xffffffff, v, lane_mask)
//   uint32_t Shfl(uint32_t, int);       __shfl_sync(0xffffffff, v, src_lane)
// so the same source is compiled by nvcc into the kernels (kernels/cuda/dynamiq_cuda.cu, CudaWarp)
// and by g++ into a CPU emulation of a warp (tests/kernels/cuda_block_emulator.h) that checks
// indexing, lane exchanges and bit-exact parity with the CPU codec on machines without a GPU.
// Headers included here must stay free of CUDA headers.
//
// Mapping: one warp per super-group (SG) at a time, in a grid-stride loop over the run's SGs (warp
// w of W takes SGs w, w + W, ...). Lane l owns the 8 consecutive elements [8 l, 8 l + 8) of the SG,
// i.e. half l % 2 of group l / 2: it loads them with two 16-byte loads, and its 8 codes fill exactly
// b bytes (8 b bits), the group's bytes [b (l % 2), b (l % 2) + b). So no shared memory and no
// barrier: per-group values (maximum, scale code, reciprocal) are computed once per lane instead of
// once per element, a group's maximum is one shuffle, the SG's maximum a 5-step butterfly, and the
// codes are packed in a register. Why: the one-block-per-SG form (one element per thread, every
// thread recomputing its group's scale with IEEE divisions, a 4-word OR butterfly to pack) was
// issue-bound at ~350 instructions per element (Nsight Compute on an H200, docs/results.md).
//
// The per-element work has no branch (every element is quantized, padding replaced afterwards)
// and reads the level kind's constants once per SG. Tried and measured slower on an H200
// (docs/results.md): instantiating the body per code width (seven copies: 10-40 % slower, likely
// the instruction cache) and copying the level tables into shared memory per block (the copy and
// byte-wide search entries cost more instructions than the 64-bit addresses they save: 4-7 %).
//
// Per-SG metadata: each SG's width, byte offset and stratum of correlated rounding (StratumOf, a
// loop over the rounding group's size) are loaded by one lane for the warp's next 32 SGs at once
// and fetched with shuffles, so the warp pays for one strata loop per 32 SGs instead of one per
// SG, and its data loads do not wait for two dependent metadata loads.
//
// Every float operation is the one EncodeSuperGroup / DecodeSuperGroup performs, through the same
// functions of kernels/dynamiq_math.h. Maxima are taken over the magnitudes' bit patterns: for
// finite non-negative floats the integer order is the float order, so the result is the float
// maximum exactly; any Inf or NaN makes the SG's maximum pattern exceed the largest finite float's,
// which marks the SG non-finite (sent as the NaN marker whatever its maxima, as on the CPU).
#ifndef DQ_KERNELS_CUDA_DYNAMIQ_CUDA_KERNELS_CUH_
#define DQ_KERNELS_CUDA_DYNAMIQ_CUDA_KERNELS_CUH_

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "kernels/cuda/launch.h"
#include "kernels/dynamiq_math.h"
#include "kernels/random_math.h"

#if defined(__CUDACC__)
#define DQ_DEVICE __device__ __forceinline__
#else
#define DQ_DEVICE inline
#endif

namespace dynamiq::kernels::internal {

inline constexpr int kWarpLanes = 32;
inline constexpr int kLaneElements = kSuperGroupSize / kWarpLanes;  // 8: half a group
inline constexpr int kDynamiqBlockThreads = 256;                    // 8 warps per block
inline constexpr int kValidateBlockThreads = 256;                   // one thread per SG
inline constexpr int kSgBatch = kWarpLanes;  // SGs whose widths, offsets, strata a warp loads at once
static_assert(2 * kLaneElements == kGroupSize, "two lanes per group");

inline constexpr uint32_t kMaxFiniteBits = 0x7f7fffffu;  // the largest finite float's bit pattern

// Elements in SG j of a run of `count` elements (1..256).
DQ_DEVICE int SgElementCount(uint64_t count, uint64_t j) {
  const uint64_t rest = count - j * kSuperGroupSize;
  return rest < static_cast<uint64_t>(kSuperGroupSize) ? static_cast<int>(rest) : kSuperGroupSize;
}

DQ_DEVICE bool IsCodeWidth(int w) { return w >= kMinWidth && w <= kMaxWidth; }

// Elements lane `lane` owns in an SG of `count` elements (0..8).
DQ_DEVICE int LaneCount(int count, int lane) {
  const int n = count - lane * kLaneElements;
  return n < 0 ? 0 : (n > kLaneElements ? kLaneElements : n);
}

DQ_DEVICE bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// v[k] = p[k] for k < n, 0 beyond. `full`: the SG is whole and the run's base 16-byte aligned, so
// every lane holds 8 elements at a multiple of 32 bytes; the lane then uses two 16-byte loads. The
// choice is made per SG (warp-uniform), not per lane: with a per-lane test (n == 8) ptxas issued
// the 16-byte loads for partial lanes too (compute-sanitizer saw reads past the end of a buffer in
// the last SG; the results were right, the padding being discarded). A partial lane reads
// p[min(k, n - 1)], so every address it reads is in bounds.
DQ_DEVICE void LoadLane(const float* p, int n, bool full, float* v) {
#if defined(__CUDA_ARCH__)
  if (full) {
    const float4 lo = reinterpret_cast<const float4*>(p)[0];
    const float4 hi = reinterpret_cast<const float4*>(p)[1];
    v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    return;
  }
#endif
  (void)full;
  for (int k = 0; k < kLaneElements; ++k) v[k] = 0.0f;
  if (n <= 0) return;
  for (int k = 0; k < kLaneElements; ++k) {
    const float x = p[k < n ? k : n - 1];
    v[k] = k < n ? x : 0.0f;
  }
}

// p[k] = v[k] for k < n (`full` as for LoadLane).
DQ_DEVICE void StoreLane(float* p, int n, bool full, const float* v) {
#if defined(__CUDA_ARCH__)
  if (full) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    return;
  }
#endif
  (void)full;
  for (int k = 0; k < kLaneElements; ++k) {
    if (k < n) p[k] = v[k];
  }
}

// A code width known at compile time (an int where one is expected).
template <int W>
struct Width {
  DQ_DEVICE constexpr operator int() const { return W; }
};

// Calls f(Width<W>{}) for the code width W == bits (2..8; warp-uniform).
template <typename F>
DQ_DEVICE void WithWidth(int bits, F&& f) {
  switch (bits) {
    case 2:
      f(Width<2>{});
      break;
    case 3:
      f(Width<3>{});
      break;
    case 4:
      f(Width<4>{});
      break;
    case 5:
      f(Width<5>{});
      break;
    case 6:
      f(Width<6>{});
      break;
    case 7:
      f(Width<7>{});
      break;
    case 8:
      f(Width<8>{});
      break;
    default:
      break;
  }
}

// A code width: `int` (known at run time) or Width<W> (at compile time: constant shifts and masks,
// and a lane's codes in 32 bits up to W = 4). Only the decompress kernel instantiates the widths
// (WithWidth; its body is small). Encode and DAR run one body for every width: seven copies of
// theirs measured 10-40 % slower on an H200 (fewer instructions, but issue slots idle; the code
// size, ~7x, is the likely cause).
template <typename Bits>
struct LaneFieldOf {
  using type = uint64_t;
};
template <int kBits>
struct LaneFieldOf<Width<kBits>> {
  using type = std::conditional_t<(kLaneElements * kBits <= 32), uint32_t, uint64_t>;
};

// The lane's 8 decoded elements of a validated SG of `count` elements at width `bits` (`decode`:
// its decode values), exactly as DecodeSuperGroup computes them (elements k >= LaneCount decode
// the group's padding codes: read but meaningless). Returns false, leaving d alone, for a lane
// with no elements.
template <typename Bits>
DQ_DEVICE bool DecodeLaneOf(Bits bits, const float* decode, const uint8_t* sg, int count, int lane, float* d) {
  using Field = typename LaneFieldOf<Bits>::type;
  if (LaneCount(count, lane) == 0) return false;
  const uint8_t* group = sg + (lane / 2) * (2 * bits + 1);
  const uint8_t* codes = group + (lane % 2) * bits;
  Field field = 0;
  for (int i = 0; i < bits; ++i) field |= static_cast<Field>(codes[i]) << (8 * i);
  const float scale = static_cast<float>(group[2 * bits]) * Bf16ToFloat(LoadSuperUnit(sg, bits, count));
  const uint32_t mask = (1u << bits) - 1u;
  for (int k = 0; k < kLaneElements; ++k) d[k] = decode[static_cast<uint32_t>(field >> (k * bits)) & mask] * scale;
  return true;
}

// Encodes the warp's SG (global index global_sg, `count` elements, lane values v[0, 8), zero where
// k >= LaneCount) into `out` (SuperGroupBytes(bits, count) bytes of global memory). Every lane
// must call it; `t` is the table of width `bits` and kUniform its level kind (warp-uniform).
template <bool kUniform, typename Warp>
DQ_DEVICE void EncodeSgInWarp(Warp& w, const DynamiqDeviceArgs& a, uint64_t global_sg, int bits, const LevelTable& t,
                              int count, uint32_t stratum, const float* v, uint8_t* out) {
  const int L = (1 << (bits - 1)) - 1;  // the table's max_level
  const int lane = w.lane();
  const int n = LaneCount(count, lane);

  // 1. Maxima over magnitude bit patterns: the lane's (padding is zero), its group's (the
  //    neighbouring lane), the SG's.
  uint32_t m = 0;
  for (int k = 0; k < kLaneElements; ++k) {
    const uint32_t mag = FloatBits(v[k]) & 0x7fffffffu;
    m = mag > m ? mag : m;
  }
  const uint32_t other = w.ShflXor(m, 1);
  const uint32_t group_m = other > m ? other : m;
  uint32_t sg_m = group_m;
  for (int lanes = 2; lanes < kWarpLanes; lanes *= 2) {
    const uint32_t o = w.ShflXor(sg_m, lanes);
    sg_m = o > sg_m ? o : sg_m;
  }
  const bool finite = sg_m <= kMaxFiniteBits;

  // 2. Super unit, the group's scale code and its reciprocal (once per lane), and the table's
  //    constants (once per SG).
  const uint16_t unit_bits = SuperUnitFor(BitsToFloat(sg_m), finite);
  const float unit = finite ? Bf16ToFloat(unit_bits) : 0.0f;
  const uint32_t scale_code = GroupScaleCode(BitsToFloat(group_m), unit);
  const float inv = InverseScale(static_cast<float>(scale_code) * unit);
  const float top = t.level[L];
  const float step = t.level[1];

  // 3. Codes, packed LSB-first in a register. Every element is quantized (padding and non-finite
  //    SGs give in-range garbage) and then replaced by code L, the zero level, where it must be:
  //    no branch per element.
  const uint32_t first_index = static_cast<uint32_t>(global_sg * kSuperGroupSize) + lane * kLaneElements;
  uint64_t field = 0;
  for (int k = 0; k < kLaneElements; ++k) {
    const uint32_t q = QuantizeElementOf<kUniform>(
        t, L, top, step, v[k], inv, RoundingUnit(a.key, first_index + k, a.correlated, stratum, a.rounding_size));
    const uint32_t code = (k < n && finite) ? q : static_cast<uint32_t>(L);
    field |= static_cast<uint64_t>(code) << (k * bits);
  }

  // 4. The lane's b code bytes, its group's scale byte (even lane) and the super unit (lane 0).
  if (lane / 2 < NumGroups(count)) {
    uint8_t* group = out + (lane / 2) * (2 * bits + 1);
    uint8_t* codes = group + (lane % 2) * bits;
    for (int i = 0; i < bits; ++i) codes[i] = static_cast<uint8_t>(field >> (8 * i));
    if (lane % 2 == 0) group[2 * bits] = static_cast<uint8_t>(scale_code);
  }
  if (lane == 0) {
    uint8_t* tail = out + SuperGroupBytes(bits, count) - 2;
    tail[0] = static_cast<uint8_t>(unit_bits);
    tail[1] = static_cast<uint8_t>(unit_bits >> 8);
  }
}

// EncodeSgInWarp for the level kind of width `bits` (warp-uniform).
template <typename Warp>
DQ_DEVICE void EncodeSg(Warp& w, const DynamiqDeviceArgs& a, uint64_t global_sg, int bits, int count, uint32_t stratum,
                        const float* v, uint8_t* out) {
  const LevelTable& t = a.tables[bits];
  if (t.uniform) {
    EncodeSgInWarp<true>(w, a, global_sg, bits, t, count, stratum, v, out);
  } else {
    EncodeSgInWarp<false>(w, a, global_sg, bits, t, count, stratum, v, out);
  }
}

// What a warp reads of each SG it takes besides the data: its width, its byte offset and its
// stratum of correlated rounding (0 when rounding is independent). Loaded kSgBatch SGs at a time,
// lane l those of the SG the warp takes at iteration `iteration + l` of its grid-stride loop
// (zeros past the run's end), and handed out by shuffles (SgAt): two dependent global loads per SG
// leave the chain before its data loads, and the strata's loop runs once per 32 SGs. Called by
// every lane at iterations 0, 32, 64, ...
struct SgMeta {
  uint32_t width = 0;
  uint32_t stratum = 0;
  uint64_t offset = 0;
};

DQ_DEVICE SgMeta LaneSgMeta(const DynamiqDeviceArgs& a, uint64_t first_task, uint64_t stride, uint64_t iteration,
                            int lane) {
  SgMeta m;
  const uint64_t j = first_task + (iteration + static_cast<uint64_t>(lane)) * stride;
  if (j >= DynamiqNumSuperGroups(a.count)) return m;
  m.width = a.widths[j];
  m.offset = a.offsets[j];
  if (a.correlated) {
    m.stratum = StratumOf(a.shared_key, static_cast<uint32_t>(a.first_sg + j), a.rounding_index, a.rounding_size);
  }
  return m;
}

// The SG at `iteration`, from the lanes' batch (every lane must call it).
template <typename Warp>
DQ_DEVICE SgMeta SgAt(Warp& w, const DynamiqDeviceArgs& a, const SgMeta& batch, uint64_t iteration) {
  const int src = static_cast<int>(iteration % kSgBatch);
  SgMeta m;
  m.width = w.Shfl(batch.width, src);
  m.stratum = a.correlated ? w.Shfl(batch.stratum, src) : 0u;
  const uint32_t lo = w.Shfl(static_cast<uint32_t>(batch.offset), src);
  const uint32_t hi = w.Shfl(static_cast<uint32_t>(batch.offset >> 32), src);
  m.offset = (static_cast<uint64_t>(hi) << 32) | lo;
  return m;
}

// Compress: the warp encodes SGs first_task, first_task + stride, ... of the run.
template <typename Warp>
DQ_DEVICE void EncodeWarp(Warp& w, const DynamiqDeviceArgs& a, const float* values, uint8_t* payload_sgs,
                          uint64_t first_task, uint64_t stride) {
  const int lane = w.lane();
  const uint64_t num_sg = DynamiqNumSuperGroups(a.count);
  const bool vector = Aligned16(values);
  SgMeta batch;
  uint64_t i = 0;
  for (uint64_t j = first_task; j < num_sg; j += stride, ++i) {
    if (i % kSgBatch == 0) batch = LaneSgMeta(a, first_task, stride, i, lane);
    const SgMeta sg = SgAt(w, a, batch, i);
    const int width = static_cast<int>(sg.width);
    if (!IsCodeWidth(width)) continue;  // width 0 takes no bytes (the host rejects other widths); warp-uniform
    const int count = SgElementCount(a.count, j);
    float v[kLaneElements];
    LoadLane(values + j * kSuperGroupSize + lane * kLaneElements, LaneCount(count, lane),
             vector && count == kSuperGroupSize, v);
    EncodeSg(w, a, a.first_sg + j, width, count, sg.stratum, v, payload_sgs + sg.offset);
  }
}

// Fused DAR: decode + local, re-encoded at the same width. Each lane reads all it needs of its SG
// (its code bytes, its group's scale, the super unit) before the first shuffle of the encoding,
// and every byte is written after the last, so in place (in_sgs == out_sgs) is safe.
template <typename Warp>
DQ_DEVICE void DarWarp(Warp& w, const DynamiqDeviceArgs& a, const uint8_t* in_sgs, const float* local, uint8_t* out_sgs,
                       uint64_t first_task, uint64_t stride) {
  const int lane = w.lane();
  const uint64_t num_sg = DynamiqNumSuperGroups(a.count);
  const bool vector = Aligned16(local);
  SgMeta batch;
  uint64_t i = 0;
  for (uint64_t j = first_task; j < num_sg; j += stride, ++i) {
    if (i % kSgBatch == 0) batch = LaneSgMeta(a, first_task, stride, i, lane);
    const SgMeta sg = SgAt(w, a, batch, i);
    const int width = static_cast<int>(sg.width);
    if (!IsCodeWidth(width)) continue;
    const int count = SgElementCount(a.count, j);
    const int n = LaneCount(count, lane);
    float v[kLaneElements];
    LoadLane(local + j * kSuperGroupSize + lane * kLaneElements, n, vector && count == kSuperGroupSize, v);
    float d[kLaneElements] = {0, 0, 0, 0, 0, 0, 0, 0};
    DecodeLaneOf(width, a.tables[width].decode, in_sgs + sg.offset, count, lane, d);
    // DecompressAccumulateRecompress: tile = local, then tile += decoded.
    for (int k = 0; k < kLaneElements; ++k) v[k] = k < n ? v[k] + d[k] : 0.0f;
    EncodeSg(w, a, a.first_sg + j, width, count, sg.stratum, v, out_sgs + sg.offset);
  }
}

// Decompress: out[i] = decoded element i, or out[i] += it (accumulate); width-0 SGs are zeros.
// No lane exchanges: any lane may run alone.
DQ_DEVICE void DecodeLaneTask(const DynamiqDeviceArgs& a, uint64_t j, int lane, const uint8_t* payload_sgs, float* out,
                              bool accumulate) {
  const int count = SgElementCount(a.count, j);
  const int n = LaneCount(count, lane);
  if (n == 0) return;
  float* dst = out + j * kSuperGroupSize + lane * kLaneElements;
  const bool full = Aligned16(out) && count == kSuperGroupSize;
  const int width = a.widths[j];
  float d[kLaneElements] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (IsCodeWidth(width)) {
    WithWidth(width, [&](auto bits) {
      (void)DecodeLaneOf(bits, a.tables[width].decode, payload_sgs + a.offsets[j], count, lane, d);
    });
  } else if (accumulate) {
    return;  // width 0 adds nothing
  }
  if (accumulate) {
    float v[kLaneElements];
    LoadLane(dst, n, full, v);
    for (int k = 0; k < kLaneElements; ++k) d[k] = v[k] + d[k];
  }
  StoreLane(dst, n, full, d);
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

// Highway (runtime-dispatched SIMD) versions of the per-super-group DynamiQ kernels for full
// super-groups of 256 elements. Each produces exactly the bytes / floats of its scalar
// counterpart in kernels/dynamiq_math.h (tests/kernels/dynamiq_codec_test.cc checks this).
#ifndef DQ_KERNELS_CPU_DYNAMIQ_SIMD_H_
#define DQ_KERNELS_CPU_DYNAMIQ_SIMD_H_

#include <stdint.h>

#include "kernels/dynamiq_math.h"

namespace dynamiq::kernels {

// A LevelTable plus the small tables the SIMD kernels hold in registers, derived once per codec
// so no kernel call rebuilds them.
struct SimdLevelTable {
  LevelTable base;
  // Interval search for non-uniform levels of widths 3..6, exact like QuantizeElement's: split
  // [0, 1] into 2^bits equal buckets; bucket[i] is the interval (largest r <= L - 1 with
  // level[r] <= i / 2^bits), and `corrections` steps of "r += x >= above[r]" reach the interval of
  // any x in the bucket (above[r] = level[r + 1], +inf for r = L - 1).
  int32_t corrections;
  int32_t bucket[64];
  float above[64];
};

SimdLevelTable PrepareSimdTable(const LevelTable& t);

// Where a super-group's 256 values come from: data[k] (fp32, or bf16 if `bf16`) minus `subtract`,
// as LoadSource computes them.
struct SgInput {
  const void* data;
  bool bf16;
  float subtract;
};

// The rounding thresholds of a super-group's elements (see RoundingUnit in dynamiq_math.h).
struct SgRounding {
  uint32_t key;
  uint32_t first_index;
  bool correlated;
  uint32_t stratum;
  uint32_t n;
};

// EncodeSuperGroup of the values `in` describes (Compress).
void CompressSuperGroupSimd(const SimdLevelTable& t, const SgInput& in, const SgRounding& rounding, uint8_t* sg);

// EncodeSuperGroup of in + DecodeSuperGroup(received), element by element in that order (the fused
// DecompressAccumulateRecompress). `received` is a validated super-group of the same width.
void DecodeAddEncodeSuperGroupSimd(const SimdLevelTable& t, const uint8_t* received, const SgInput& in,
                                   const SgRounding& rounding, uint8_t* sg);

// ValidateSuperGroup for count == kSuperGroupSize.
bool ValidateSuperGroupSimd(const SimdLevelTable& t, const uint8_t* sg);

// out[k] = decoded value k (DecodeSuperGroup for a full, validated super-group).
void DecodeSuperGroupSimd(const SimdLevelTable& t, const uint8_t* sg, float* out);

// inout[k] += decoded value k.
void DecodeAddSuperGroupSimd(const SimdLevelTable& t, const uint8_t* sg, float* inout);

// out[k] = decoded value k + offset (StoreDest of a decoded super-group with an offset).
void DecodeOffsetSuperGroupSimd(const SimdLevelTable& t, const uint8_t* sg, float offset, float* out);

// Conveniences for tests: prepare the table on every call.
void EncodeSuperGroupSimd(const LevelTable& t, const float* v, uint32_t key, uint32_t first_index, bool correlated,
                          uint32_t stratum, uint32_t n, uint8_t* sg);
void DecodeSuperGroupSimd(const LevelTable& t, const uint8_t* sg, float* out);
void DecodeAddSuperGroupSimd(const LevelTable& t, const uint8_t* sg, float* inout);

// SuperGroupStats of `num_sgs` full super-groups of fp32 `values` into stats[2j], stats[2j + 1]
// (ComputeStats), summed exactly as SuperGroupMoments does.
void ComputeStatsSimd(const float* values, size_t num_sgs, float* stats);

// Name of the SIMD target the dispatcher picked on this CPU (e.g. "AVX3").
const char* DynamiqSimdTarget();

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_DYNAMIQ_SIMD_H_

// Highway (runtime-dispatched SIMD) versions of the per-super-group DynamiQ kernels for full
// super-groups of 256 elements. Each produces exactly the bytes / floats of its scalar
// counterpart in kernels/dynamiq_math.h (tests/kernels/dynamiq_codec_test.cc checks this).
#ifndef DQ_KERNELS_CPU_DYNAMIQ_SIMD_H_
#define DQ_KERNELS_CPU_DYNAMIQ_SIMD_H_

#include <stdint.h>

#include "kernels/dynamiq_math.h"

namespace dynamiq::kernels {

// EncodeSuperGroup for count == kSuperGroupSize.
void EncodeSuperGroupSimd(const LevelTable& t, const float* v, uint32_t key, uint32_t first_index, bool correlated,
                          uint32_t stratum, uint32_t n, uint8_t* sg);

// out[k] = decoded value k (DecodeSuperGroup for a full, validated super-group).
void DecodeSuperGroupSimd(const LevelTable& t, const uint8_t* sg, float* out);

// inout[k] += decoded value k.
void DecodeAddSuperGroupSimd(const LevelTable& t, const uint8_t* sg, float* inout);

// Name of the SIMD target the dispatcher picked on this CPU (e.g. "AVX3").
const char* DynamiqSimdTarget();

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_DYNAMIQ_SIMD_H_

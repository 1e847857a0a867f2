// bfloat16 <-> float conversions shared by CPU and CUDA code.
//
// bf16 is the upper half of an IEEE float. Conversions work on bit patterns so host and device
// produce identical results without relying on compiler intrinsics.
#ifndef DQ_KERNELS_BF16_MATH_H_
#define DQ_KERNELS_BF16_MATH_H_

#include <stdint.h>
#include <string.h>

#include "kernels/host_device.h"

namespace dynamiq::kernels {

DQ_HOST_DEVICE uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

DQ_HOST_DEVICE float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

DQ_HOST_DEVICE float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even. NaN stays NaN (quiet); overflow goes to Inf as in IEEE. A select,
// not a branch, so that loops of it vectorize.
DQ_HOST_DEVICE uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// Smallest bf16 >= f for finite f >= 0 (rounds the magnitude up). Used for scales, which must
// never shrink below the value they cover.
DQ_HOST_DEVICE uint16_t FloatToBf16Up(float f) {
  uint32_t u = FloatBits(f);
  uint32_t hi = u >> 16;
  if ((u & 0xffffu) != 0u) hi += 1u;
  return static_cast<uint16_t>(hi);
}

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_BF16_MATH_H_

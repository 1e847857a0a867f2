#include "kernels/cpu/buffer_io.h"

#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "kernels/bf16_math.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::kernels {

void LoadSource(const Source& src, size_t begin, size_t count, float* out) {
  // An empty chunk's buffers may be null (an empty std::vector's data()): memcpy on null is
  // undefined even for 0 bytes.
  if (count == 0) return;
  const size_t offset = begin - src.first;
  if (src.dtype == DType::kFloat32) {
    memcpy(out, static_cast<const float*>(src.data) + offset, count * sizeof(float));
  } else {
    const uint16_t* in = static_cast<const uint16_t*>(src.data) + offset;
    for (size_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(in[i]);
  }
  if (src.subtract_per_group == nullptr) return;
  for (size_t i = 0; i < count;) {
    size_t k = begin + i;
    size_t end = std::min(count, i + (kSuperGroupSize - k % kSuperGroupSize));
    const float m = src.subtract_per_group[k / kSuperGroupSize];
    for (; i < end; ++i) out[i] -= m;
  }
}

void StoreDest(const Dest& dst, size_t begin, size_t count, const float* in) {
  if (count == 0) return;
  const size_t offset = begin - dst.first;
  for (size_t i = 0; i < count;) {
    size_t k = begin + i;
    size_t end = std::min(count, i + (kSuperGroupSize - k % kSuperGroupSize));
    const float m = dst.add_per_group == nullptr ? 0.0f : dst.add_per_group[k / kSuperGroupSize];
    if (dst.dtype == DType::kFloat32) {
      float* out = static_cast<float*>(dst.data) + offset;
      if (dst.add_per_group == nullptr) {
        memcpy(out + i, in + i, (end - i) * sizeof(float));
        i = end;
      } else {
        for (; i < end; ++i) out[i] = in[i] + m;
      }
    } else {
      uint16_t* out = static_cast<uint16_t*>(dst.data) + offset;
      for (; i < end; ++i) out[i] = FloatToBf16(in[i] + m);
    }
  }
}

const float* PlainFloats(const Source& s, size_t begin) {
  if (s.dtype != DType::kFloat32 || s.subtract_per_group != nullptr || s.data == nullptr) return nullptr;
  return static_cast<const float*>(s.data) + (begin - s.first);
}

float* PlainFloats(const Dest& d, size_t begin) {
  if (d.dtype != DType::kFloat32 || d.add_per_group != nullptr || d.data == nullptr) return nullptr;
  return static_cast<float*>(d.data) + (begin - d.first);
}

}  // namespace dynamiq::kernels

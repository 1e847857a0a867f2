// Element types of user buffers. Compressed payloads have their own formats (see wire_format.h);
// accumulation is always fp32.
#ifndef DQ_KERNELS_DTYPE_H_
#define DQ_KERNELS_DTYPE_H_

#include <stddef.h>
#include <stdint.h>

#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace dynamiq::kernels {

enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1 };

inline size_t DTypeSize(DType t) { return t == DType::kFloat32 ? 4 : 2; }
inline absl::string_view DTypeName(DType t) { return t == DType::kFloat32 ? "float32" : "bfloat16"; }
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_DTYPE_H_

#include "kernels/dtype.h"

#include "absl/strings/str_cat.h"

namespace dynamiq::kernels {

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "float32" || name == "fp32" || name == "f32") return DType::kFloat32;
  if (name == "bfloat16" || name == "bf16") return DType::kBFloat16;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "' (expected float32 or bfloat16)"));
}

}  // namespace dynamiq::kernels

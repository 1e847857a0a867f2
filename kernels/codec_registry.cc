#include "kernels/codec_registry.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/cpu/mx_codec.h"
#include "kernels/cpu/simple_codecs.h"
#include "kernels/cpu/thc_codec.h"
#include "kernels/cpu/uniform_codec.h"

namespace dynamiq::kernels {

absl::Status ValidateCodecConfig(const CodecConfig& config) {
  const double b = config.bits;
  switch (config.id) {
    case CodecId::kDynamiq:
      if (!(b >= 3.0 && b <= 8.0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("dynamiq bits must be between 3 and 8 (average incl. metadata), got ", b));
      }
      return absl::OkStatus();
    case CodecId::kUniform:
      if (!(b >= 2.0 && b <= 8.0) || b != std::floor(b)) {
        return absl::InvalidArgumentError(absl::StrCat("uniform bits must be an integer 2..8, got ", b));
      }
      return absl::OkStatus();
    case CodecId::kThc:
      if (b != 4.0) return absl::InvalidArgumentError(absl::StrCat("thc uses 4-bit codes, got bits ", b));
      return absl::OkStatus();
    case CodecId::kNone:
    case CodecId::kBf16:
    case CodecId::kMxfp8:
    case CodecId::kMxfp6:
    case CodecId::kMxfp4:
      // No bit setting: the value is carried unused, but a non-finite or absurd one is refused all
      // the same, so that it never reaches a status or a metric label.
      if (!(b >= 0 && b <= 32)) {
        return absl::InvalidArgumentError(absl::StrCat("bits must be a number between 0 and 32, got ", b, " (codec ",
                                                       CodecName(config.id), " does not use it)"));
      }
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown codec id ", static_cast<int>(config.id)));
}

absl::StatusOr<std::unique_ptr<Codec>> CreateCodec(const CodecConfig& config) {
  DQ_RETURN_IF_ERROR(ValidateCodecConfig(config));
  switch (config.id) {
    case CodecId::kNone:
    case CodecId::kBf16:
      return NewSimpleCodec(config);
    case CodecId::kDynamiq:
      return NewDynamiqCodec(config);
    case CodecId::kMxfp8:
    case CodecId::kMxfp6:
    case CodecId::kMxfp4:
      return NewMxCodec(config);
    case CodecId::kThc:
      return NewThcCodec(config);
    case CodecId::kUniform:
      return NewUniformCodec(config);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown codec id ", static_cast<int>(config.id)));
}

}  // namespace dynamiq::kernels

#include "kernels/codec_registry.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/arc_topk_codec.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/cpu/flash_codec.h"
#include "kernels/cpu/global_qsgd_codec.h"
#include "kernels/cpu/int8_codec.h"
#include "kernels/cpu/mx_codec.h"
#include "kernels/cpu/simple_codecs.h"
#include "kernels/cpu/thc_codec.h"
#include "kernels/cpu/uniform_codec.h"

namespace dynamiq::kernels {

absl::Status ValidateCodecConfig(const CodecConfig& config) {
  if (static_cast<int>(config.id) >= kNumCodecs) {
    return absl::InvalidArgumentError(absl::StrCat("unknown codec id ", static_cast<int>(config.id)));
  }
  return CheckCodecBits(config.id, config.bits);
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
    case CodecId::kInt8:
      return NewInt8Codec(config);
    case CodecId::kGlobalQsgd:
      return NewGlobalQsgdCodec(config);
    case CodecId::kArcTopK:
      return NewArcTopKCodec(config);
    case CodecId::kFlash:
      return NewFlashCodec(config);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown codec id ", static_cast<int>(config.id)));
}

}  // namespace dynamiq::kernels

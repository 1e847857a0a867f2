// CreateCodec: validates a CodecConfig and builds the CPU codec for it. The one place that knows
// every codec; callers (engine, daemon, benchmarks) only see the Codec interface.
#ifndef DQ_KERNELS_CODEC_REGISTRY_H_
#define DQ_KERNELS_CODEC_REGISTRY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/codec.h"

namespace dynamiq::kernels {

// INVALID_ARGUMENT with a message for out-of-range settings (e.g. dynamiq bits outside 3..8).
absl::Status ValidateCodecConfig(const CodecConfig& config);

absl::StatusOr<std::unique_ptr<Codec>> CreateCodec(const CodecConfig& config);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CODEC_REGISTRY_H_

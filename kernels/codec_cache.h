// CodecCache: the codecs one user (a job's reducer) switches between, each built once. Building a
// codec (DynamiQ's level and error tables) costs milliseconds, far more than coding a small tensor,
// and a job alternates between a couple (its configured codec, and `none` below
// min_compress_elements). Keeps the most recent `capacity` codecs. Not thread-safe.
#ifndef DQ_KERNELS_CODEC_CACHE_H_
#define DQ_KERNELS_CODEC_CACHE_H_

#include <stddef.h>

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/codec.h"

namespace dynamiq::kernels {

class CodecCache {
 public:
  explicit CodecCache(size_t capacity = 8) : capacity_(capacity) {}

  // The codec for `config`, built on first use (CreateCodec's errors for an invalid one). Valid
  // until `capacity` other configurations have been asked for since.
  absl::StatusOr<Codec*> Get(const CodecConfig& config);

 private:
  const size_t capacity_;
  std::vector<std::pair<CodecConfig, std::unique_ptr<Codec>>> codecs_;  // oldest first
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CODEC_CACHE_H_

// FlashCodec: Flash Communication's group-wise asymmetric INT-b quantizer (CodecId::kFlash, Li et
// al., arXiv 2412.04964) on the CPU, the codec of their two-step all-reduce (topology two_shot).
//
// Groups of 128 elements keep a bf16 minimum (rounded down) and a bf16 scale (rounded up) so that
// min + (2^b - 1) * scale covers the group; elements round to the nearest code (deterministic, as
// the authors do). Payload: one group after another, 4 + 16*b bytes each (kernels/flash_math.h),
// b + 0.25 bits per coordinate; header element_bits = b, param = 0, flags = 0. Every hop of a
// multi-hop reduction decodes, adds its local values, recomputes the group's minimum and scale
// from the new partial sum and re-quantizes; on the two-shot schedule that happens once.
//
// Decoders validate the header (exact payload size, element_bits, flags, summand count) and every
// group's minimum and scale before writing any output. `in` and `out` of DAR must not overlap.
//
// Thread safety: immutable after construction; all methods may be called concurrently.
#ifndef DQ_KERNELS_CPU_FLASH_CODEC_H_
#define DQ_KERNELS_CPU_FLASH_CODEC_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "kernels/codec.h"

namespace dynamiq::kernels {

// config.bits must be an integer in 2..8; returns nullptr otherwise. config.id is set to kFlash.
std::unique_ptr<Codec> NewFlashCodec(const CodecConfig& config);

class FlashCodec final : public Codec {
 public:
  // Use NewFlashCodec, which validates the config; this aborts on bits outside 2..8.
  explicit FlashCodec(const CodecConfig& config);

  std::string Describe() const override;

  size_t MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const override;
  absl::StatusOr<size_t> Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                  absl::Span<uint8_t> out) const override;
  absl::Status Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                          const Dest& out) const override;
  absl::Status DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                    float* acc) const override;
  absl::StatusOr<size_t> DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                        absl::Span<const uint8_t> in, const Source& local,
                                                        absl::Span<uint8_t> out) const override;

 private:
  int bits_;
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_FLASH_CODEC_H_

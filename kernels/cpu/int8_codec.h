// Int8Codec: the INTELLECT-1-style int8 baseline (CodecId::kInt8) on the CPU: one f32 scale per
// chunk from the chunk's RMS, values clipped at +-6 sigma, 8-bit codes, stochastic rounding
// (kernels/int8_math.h has the format). Header element_bits = 8, param = 6 (the clip in sigmas),
// flags = 0. 8 bits per coordinate plus 4 bytes per chunk.
//
// Every hop of a multi-hop reduction decodes, adds its local values and re-quantizes the new
// partial sum with a scale recomputed from it (DAR makes two passes over the chunk: the sum of
// squares, then the codes; no decoded copy). Rounding is independent per rank and hop: u for
// bucket element i is BitsToUnit(RandomBits(StreamKey(seed, round, rank), i)), so all ranks, which
// decode the same all-gathered bytes, end bit-identical.
//
// Decoders validate the header (exact payload size, element_bits, flags, param, summand count),
// the scale and every code before writing any output. `in` and `out` of DAR must not overlap.
//
// Thread safety: immutable after construction; all methods may be called concurrently.
#ifndef DQ_KERNELS_CPU_INT8_CODEC_H_
#define DQ_KERNELS_CPU_INT8_CODEC_H_

#include <stddef.h>

#include <memory>
#include <string>

#include "kernels/codec.h"

namespace dynamiq::kernels {

// config.bits is ignored (always 8); config.id is set to kInt8.
std::unique_ptr<Codec> NewInt8Codec(const CodecConfig& config);

class Int8Codec final : public Codec {
 public:
  explicit Int8Codec(const CodecConfig& config);

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
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_INT8_CODEC_H_

// UniformCodec: the uniform stochastic b-bit quantizer baseline (CodecId::kUniform) on the CPU.
//
// Blocks of 32 elements share a bf16 scale rounded up so that scale * (2^(b-1) - 1) covers the
// block; elements are stochastically rounded (value domain, unbiased) to multiples of the scale.
// Payload: one block after another, 2 + 4*b bytes each (kernels/uniform_math.h), b + 0.5 bits per
// coordinate; header element_bits = b, param = 0, flags = kFlagCorrelated iff configured.
// Every hop of a multi-hop reduction decodes, adds its local values, recomputes the block scales
// from the new partial sum and re-quantizes (DAR works block by block on a stack tile).
//
// Randomness (kernels/random_math.h): u for bucket element i is BitsToUnit(RandomBits(
// StreamKey(seed, round, rank), i)). With config.correlated_rounding and chunk.rounding_size > 1
// (the caller names this compression as sibling rounding_index of rounding_size, see ChunkRef) it
// becomes CorrelatedUnit(StratumOf(StreamKey(seed, round, kSharedStream ^ Mix32(rounding_group)),
// i / 256, rounding_index, rounding_size), rounding_size, u), exactly as DynamiQ. Stratifying the
// hops of a ring instead (stratum by rank) would be biased: each hop re-quantizes a partial sum
// whose rounding probability depends on the previous hop's outcome, and stratified thresholds are
// not independent of that outcome (the tests measure this). kFlagCorrelated mirrors
// config.correlated_rounding.
//
// Decoders validate the header (exact payload size, element_bits, flags, summand count) and every
// scale and code before writing any output. `in` and `out` of DAR must not overlap.
//
// Thread safety: immutable after construction; all methods may be called concurrently.
#ifndef DQ_KERNELS_CPU_UNIFORM_CODEC_H_
#define DQ_KERNELS_CPU_UNIFORM_CODEC_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "kernels/codec.h"

namespace dynamiq::kernels {

// config.bits must be an integer in 2..8; returns nullptr otherwise. config.id is set to kUniform.
std::unique_ptr<Codec> NewUniformCodec(const CodecConfig& config);

class UniformCodec final : public Codec {
 public:
  // Use NewUniformCodec, which validates the config; this aborts on bits outside 2..8.
  explicit UniformCodec(const CodecConfig& config);

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

#endif  // DQ_KERNELS_CPU_UNIFORM_CODEC_H_

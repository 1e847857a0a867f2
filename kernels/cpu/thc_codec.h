// ThcCodec: the THC baseline (CodecId::kThc, algorithm.md 2.1) on the CPU.
//
// The bucket is rotated as a whole before it is cut into chunks (NeedsBucketTransform: a
// randomized Hadamard transform over the bucket zero-padded to a power of two, signs shared by all
// ranks and re-drawn every round; the engine runs ForwardTransform before the schedule and
// InverseTransform after the all-gather, kernels/cpu/bucket_transform.h), as in Li et al.
// (NSDI'24). The chunk-level calls below work on the rotated bucket: per aligned 256-coefficient
// block, normalization by the global norm N, clamp to [-T, T] and unbiased stochastic rounding
// onto a 16-point table (kernels/thc_math.h). Aggregation is a plain integer sum of table values,
// so a DAR hop never re-quantizes what it received: it adds the integer table values of its own
// local contribution. Called on an unrotated bucket the chunk calls still work (they quantize the
// values as they are), but every coordinate that exceeds T sqrt(N^2/d) is clamped: only the
// rotation makes the coordinates N(0, N^2/P)-like, which the global norm and T assume.
//
// Bucket statistics: StatsLength = 1, reduced with kMax. ComputeStats writes the local L2 norm
// (accumulated in double); MakePlan sets plan.global_scale = N, the reduced (largest) norm, and
// fails if N is not finite (Inf/NaN in some rank's bucket) or the world is too large for 16-bit
// sums (world_size * 42 must be < 65536).
//
// Wire format (header element_bits / flags / num_summands / param = N):
//   leaf (Compress):   element_bits = 4, no kFlagAggregated, num_summands = 1; one 4-bit table
//                      index per rotated coefficient: 4 bits/coord.
//   DAR output:        element_bits = w, kFlagAggregated, num_summands = contributions; one w-bit
//                      sum per coefficient, w = smallest of 8/12/16 with 2^w > world_size * 42.
//   Codes are packed LSB-first, coefficient j of the chunk at bit j * w. A chunk of c elements
//   carries 256 * ceil(c / 256) coefficients (a partial last block is sent padded); only the real
//   elements are ever written back on decode. kFlagCorrelated is set when rounding is correlated.
//
// No error feedback: the codec layer is stateless (a Codec is immutable and shared by threads),
// so THC's EF (e = x - irht(own decoded)) belongs to the caller, which can compute it from
// Decompress of its own leaf chunk. Without EF the compressor is still unbiased except for the
// rare clamped coordinates.
//
// Not butterfly-capable (SupportsButterfly() == false): the integer homomorphism only holds along
// a path where each hop adds exactly one new contribution's table values to received integers.
// A butterfly internal node merges several children into an fp32 accumulator and would have to
// re-quantize that sum, which THC's integer scheme has no operation for.
//
// Randomness (kernels/random_math.h): signs from RandomBits(StreamKey(seed, round,
// kSharedStream ^ 0x7468), index in the padded bucket); rounding u for coefficient i from
// RandomBits(StreamKey(seed, round, rank), i). With config.correlated_rounding and world_size > 1,
// u = CorrelatedUnit(StratumOf(StreamKey(seed, round, kSharedStream), i / 256, rank, world_size),
// world_size, u): stratified by rank, ignoring ChunkRef's rounding fields. That is unbiased for
// THC (unlike re-quantizing codecs) because every rank rounds only its own local values, which
// never depend on another rank's rounding outcome; the ring's n contributions to a chunk come from
// n distinct ranks, so they occupy distinct strata. kFlagCorrelated is set when this applies.
//
// THC cannot carry Inf/NaN: MakePlan fails on a non-finite norm, and Compress/DAR fail with
// INVALID_ARGUMENT if local values are non-finite anyway (their output is then unspecified).
//
// Decoders validate the header (exact payload size, element_bits, flags, summands <= world_size,
// param == plan.global_scale) and every sum (<= num_summands * 42) before writing any output.
// `in` and `out` of DAR must not overlap.
//
// Thread safety: immutable after construction; all methods may be called concurrently.
#ifndef DQ_KERNELS_CPU_THC_CODEC_H_
#define DQ_KERNELS_CPU_THC_CODEC_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "kernels/codec.h"
#include "kernels/thc_math.h"

namespace dynamiq::kernels {

// config.bits must be 4; returns nullptr otherwise. config.id is set to kThc.
std::unique_ptr<Codec> NewThcCodec(const CodecConfig& config);

class ThcCodec final : public Codec {
 public:
  // Use NewThcCodec, which validates the config; this aborts on bits != 4.
  explicit ThcCodec(const CodecConfig& config);

  std::string Describe() const override;
  bool SupportsButterfly() const override { return false; }

  // The rotation: max(256, 2^ceil(log2 d)) elements; INVALID_ARGUMENT above 2^31.
  bool NeedsBucketTransform() const override { return true; }
  absl::StatusOr<size_t> TransformedLength(size_t num_elements) const override;
  // y = H D x / sqrt(P) and x = D H y / sqrt(P) in place; `values` must be TransformedLength long.
  absl::Status ForwardTransform(const RoundInfo& round, absl::Span<float> values) const override;
  absl::Status InverseTransform(const RoundInfo& round, absl::Span<float> values) const override;

  size_t StatsLength(size_t num_elements) const override { return 1; }
  StatsReduction stats_reduction() const override { return StatsReduction::kMax; }
  void ComputeStats(const Source& local, size_t num_elements, float* stats) const override;
  absl::StatusOr<BucketPlan> MakePlan(const RoundInfo& round, size_t num_elements, absl::Span<const float> local_stats,
                                      absl::Span<const float> reduced_stats) const override;

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
  // Table indices X of this rank's local contribution to the 256-block starting at bucket index
  // `block_start` (`count` real elements). False if a normalized value is Inf/NaN.
  bool QuantizeLocalBlock(const BucketPlan& plan, const Source& local, size_t block_start, int count,
                          uint32_t* indices) const;

  ThcTable table_;
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_THC_CODEC_H_

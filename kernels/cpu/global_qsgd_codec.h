// GlobalQsgdCodec: Global-QSGD (CodecId::kGlobalQsgd, arXiv 2305.18627) on the CPU: unbiased
// stochastic quantization onto s = 2^(b-1) - 1 levels per sign against one GLOBAL scale M that all
// ranks agree on, so integer codes add up along the ring without ever being decoded
// (kernels/global_qsgd_math.h has the per-element math and the growth of the integer range).
//
// Bucket statistics: StatsLength = 1, reduced with kMax. ComputeStats writes the local largest
// |x|; MakePlan sets plan.global_scale = M, the largest over ranks, and fails if M is not finite
// (Inf/NaN in some rank's bucket). One M per bucket: pipelining blocks share it.
//
// Wire format (header element_bits = w(num_summands), flags = kFlagCorrelated or 0, param = M):
//   Compress (leaf):  num_summands = 1, w = b; stored code = q + s in [0, 2s].
//   DAR:              num_summands = k + 1; every stored value = received sum + this rank's
//                     code, re-offset: stored = Q + (k + 1) s in [0, 2 (k + 1) s], at
//                     w(k + 1) bits. Exact integer arithmetic: no re-quantization at any hop.
//   Payload: the count stored values packed LSB-first at w bits, (count * w + 7) / 8 bytes.
// Per coordinate a ring of n ranks sends w(1..n-1) in reduce-scatter and w(n) in all-gather: at
// b = 8 and n = 8, 10.5 bits on average (docs/wire_format.md).
//
// Not butterfly-capable (SupportsButterfly() == false), for THC's reason: the integer sum only
// exists along a path where every hop adds one rank's codes; a butterfly node merging several
// children into an fp32 accumulator would have to re-quantize, which Global-QSGD has no
// operation for.
//
// Randomness (kernels/random_math.h): u for element i from RandomBits(StreamKey(seed, round,
// rank), i). With config.correlated_rounding and world_size > 1 the ranks' thresholds are
// stratified per super-group: u = CorrelatedUnit(StratumOf(StreamKey(seed, round, kSharedStream),
// i / 256, rank, world_size), world_size, u), unbiased because every rank rounds only its own
// local values (as THC); kFlagCorrelated is then set.
//
// Global-QSGD cannot carry Inf/NaN: MakePlan fails on a non-finite M, and Compress/DAR fail with
// INVALID_ARGUMENT on non-finite local values.
//
// Decoders validate the header (exact payload size, element_bits, flags, 1 <= num_summands <=
// world_size, param == plan.global_scale) and every stored value (<= 2 k s) before writing any
// output. `in` and `out` of DAR must not overlap.
//
// Thread safety: immutable after construction; all methods may be called concurrently.
#ifndef DQ_KERNELS_CPU_GLOBAL_QSGD_CODEC_H_
#define DQ_KERNELS_CPU_GLOBAL_QSGD_CODEC_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "kernels/codec.h"

namespace dynamiq::kernels {

// config.bits must be an integer in 2..8; returns nullptr otherwise. config.id is set to
// kGlobalQsgd.
std::unique_ptr<Codec> NewGlobalQsgdCodec(const CodecConfig& config);

class GlobalQsgdCodec final : public Codec {
 public:
  // Use NewGlobalQsgdCodec, which validates the config; this aborts on bad bits.
  explicit GlobalQsgdCodec(const CodecConfig& config);

  std::string Describe() const override;
  bool SupportsButterfly() const override { return false; }

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

  // s, the levels per sign.
  uint32_t levels() const { return levels_; }

 private:
  // This rank's integer levels q in [-s, s] for local[begin, begin + count). False if a local
  // value is Inf/NaN.
  bool QuantizeLocal(const BucketPlan& plan, const Source& local, size_t begin, size_t count, int32_t* q) const;

  int bits_;
  uint32_t levels_;
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_GLOBAL_QSGD_CODEC_H_

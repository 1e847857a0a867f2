// ArcTopKCodec: ARC-Top-K (CodecId::kArcTopK, arXiv 2510.26709) on the CPU: all ranks agree on one
// sparsity pattern from a small linear sketch of the summed gradient, then all-reduce only the
// selected values, without indices (kernels/arc_topk_math.h has the sketch).
//
// config.bits carries the DENSITY, the fraction of 256-element rows kept, in [0.001, 1] (the
// codec table's "bits" of this codec; dynamiqctl --bits=0.05 keeps 5%).
//
// Bucket statistics: StatsLength(n) = 4 per row of 256, reduced with kSum, so the engine plans
// every pipelining block from its own slice (engine/block_plan.h): the density holds per block,
// hence per bucket. ComputeStats writes each row's 4 projections (accumulated in double);
// MakePlan scores every row by the squared norm of its summed sketch and keeps the
// ceil(density * rows) highest (ties: lower row first), recorded in plan.widths (1 = kept, one
// byte per row). MakePlan fails on a non-finite sketch (Inf/NaN gradients). Every rank gets the
// same reduced statistics, hence the same rows.
//
// Wire format (header element_bits = 32, flags = 0, param = the density as float):
//   the chunk's kept elements (rows of the plan, clipped to the chunk) as little-endian fp32, in
//   index order; nothing for the other rows. Compress: num_summands = 1; DAR: decode + local
//   values of the kept rows, num_summands + 1. The sums are plain fp32 additions along the
//   aggregation tree, so the result is exactly sum_i C(x_i) up to fp32 rounding, and the
//   compressor is contractive (it keeps the selected rows exactly). Per coordinate: 32 * density
//   bits plus the sketch (4 bf16 per 256 elements, 0.25 bits, twice: reduce-scatter and
//   all-gather of the statistics).
// Butterfly-capable: re-encoding an fp32 accumulator loses nothing.
//
// Decompress writes 0 for the elements of rows not kept. Values are not validated (as codec
// none: the sum of honest finite values may overflow to Inf). Decoders validate the header
// (exact payload size for the plan's rows, element_bits, flags, param, summands <= world_size)
// before writing any output. `in` and `out` of DAR must not overlap.
//
// Error feedback is not the codec's (a Codec is immutable and shared): with
// --arc_topk_error_feedback the daemon keeps EF21(M) state per job and tensor
// (server/error_feedback.h).
//
// Thread safety: immutable after construction; all methods may be called concurrently.
#ifndef DQ_KERNELS_CPU_ARC_TOPK_CODEC_H_
#define DQ_KERNELS_CPU_ARC_TOPK_CODEC_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "kernels/codec.h"

namespace dynamiq::kernels {

// config.bits (the density) must be in [0.001, 1]; returns nullptr otherwise. config.id is set
// to kArcTopK.
std::unique_ptr<Codec> NewArcTopKCodec(const CodecConfig& config);

class ArcTopKCodec final : public Codec {
 public:
  // Use NewArcTopKCodec, which validates the config; this aborts on a bad density.
  explicit ArcTopKCodec(const CodecConfig& config);

  std::string Describe() const override;

  size_t StatsLength(size_t num_elements) const override;
  StatsReduction stats_reduction() const override { return StatsReduction::kSum; }
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

  double density() const { return config().bits; }
};

// True where element i of a bucket planned as `plan` is kept (plan.widths of an ARC-Top-K plan).
inline bool ArcTopKKept(const BucketPlan& plan, size_t i) { return plan.widths[i / 256] != 0; }

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_ARC_TOPK_CODEC_H_

// DynamiqCodec: the DynamiQ quantizer for multi-hop all-reduce on the CPU.
//
// Bucket level: every rank computes per-super-group (mean, norm) statistics (bf16, 0.125
// bits/coord), the caller sums them across ranks, and MakePlan derives the same code width for
// every super-group on every rank (kernels/dynamiq_allocator.h). Values are centred on the global
// mean before quantization: every rank subtracts the same m = bf16(sum of means / n)
// (Source::subtract_per_group = plan.local_means) and n * m, exact in fp32, is added back after
// decoding (Dest::add_per_group = plan.mean_sums), so centring never biases the result.
//
// Chunk payload (after the 32-byte ChunkHeader, whose element_bits holds a bitmask of the widths
// using uniform levels, bit w - 2 for width w, so ranks with different level settings are caught):
//   [ width map: one nibble per super-group (the width, 0 or 2..8), low nibble first ]
//   [ super-groups in order, each as documented in kernels/dynamiq_math.h ]
// DAR re-encodes each super-group at its received width from the new partial sum (scales are
// recomputed at every hop, so partial sums never overflow), working on one 1 KiB tile at a time.
//
// The *On calls split a chunk (or the statistics) into contiguous ranges of at least
// kMinSuperGroupsPerThread super-groups that the pool's threads share out (common/thread_pool.h).
// Nothing couples super-groups: their byte offsets follow from the plan's widths, and every random
// draw is keyed by the element's bucket index (the stratum by the super-group's), so any split
// writes the same bytes; validation reports the first bad super-group in order, as one thread does.
//
// Thread-safe: immutable after construction.
#ifndef DQ_KERNELS_CPU_DYNAMIQ_CODEC_H_
#define DQ_KERNELS_CPU_DYNAMIQ_CODEC_H_

#include <memory>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/cpu/dynamiq_simd.h"
#include "kernels/dynamiq_allocator.h"
#include "kernels/dynamiq_math.h"

namespace dynamiq::kernels {

class DynamiqCodec final : public Codec {
 public:
  // kScalar runs the shared reference math only; kSimd uses Highway for full super-groups.
  enum class Kernel { kSimd, kScalar };

  // Chunks (and statistics) shorter than twice this many super-groups run on one thread: below
  // ~16K elements per thread the hand-off costs more than it saves.
  static constexpr size_t kMinSuperGroupsPerThread = 64;

  DynamiqCodec(const CodecConfig& config, Kernel kernel);

  std::string Describe() const override;

  size_t StatsLength(size_t num_elements) const override;
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

  void ComputeStatsOn(common::ThreadPool* pool, const Source& local, size_t num_elements, float* stats) const override;
  absl::StatusOr<size_t> CompressOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                    const Source& local, absl::Span<uint8_t> out) const override;
  absl::Status DecompressOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                            absl::Span<const uint8_t> in, const Dest& out) const override;
  absl::Status DecompressAccumulateOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                      absl::Span<const uint8_t> in, float* acc) const override;
  absl::StatusOr<size_t> DecompressAccumulateRecompressOn(common::ThreadPool* pool, const BucketPlan& plan,
                                                          const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                                          const Source& local, absl::Span<uint8_t> out) const override;

  // Measured relative squared error of one quantization per width 2..8 (Gaussian groups).
  const WidthErrors& width_errors() const { return errors_; }
  const WidthErrors* MeasuredWidthErrors() const override { return &errors_; }
  const LevelTable& table(int bits) const { return tables_[bits]; }

 private:
  struct Layout;
  absl::StatusOr<Layout> ChunkLayout(const BucketPlan& plan, const ChunkRef& chunk) const;
  // Parses and fully validates a received chunk; returns its payload.
  absl::StatusOr<const uint8_t*> CheckInput(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                            const Layout& layout, absl::Span<const uint8_t> in,
                                            uint16_t* summands) const;
  // Compress (received == nullptr) or DAR (received: the validated payload's first super-group).
  absl::StatusOr<size_t> Encode(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                const Layout& layout, uint16_t summands, const Source& local, const uint8_t* received,
                                absl::Span<uint8_t> out) const;
  // Compress/DAR of the chunk's super-groups [first, last): `sg` and `received` point at super-group `first`.
  void EncodeRange(const BucketPlan& plan, const ChunkRef& chunk, const Layout& layout, size_t first, size_t last,
                   const Source& local, const uint8_t* received, uint8_t* sg) const;
  // Statistics of the bucket's super-groups [first, last) (ComputeStats' work).
  void StatsRange(const Source& raw, size_t num_elements, size_t first, size_t last, float* stats) const;
  void DecodeSg(int width, const uint8_t* sg, int count, float* out, bool add) const;
  uint8_t Flags() const;
  uint8_t UniformMask() const;

  Kernel kernel_;
  LevelTable tables_[kMaxWidth + 1];         // indexed by width
  std::vector<SimdLevelTable> simd_tables_;  // indexed by width (kSimd only)
  WidthErrors errors_;
};

std::unique_ptr<Codec> NewDynamiqCodec(const CodecConfig& config,
                                       DynamiqCodec::Kernel kernel = DynamiqCodec::Kernel::kSimd);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_DYNAMIQ_CODEC_H_

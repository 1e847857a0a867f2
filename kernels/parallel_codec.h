// ParallelCodec: a codec whose every call splits its work across a thread pool: it forwards the
// plain calls of the codec it wraps to that codec's *On variants with the pool (kernels/codec.h).
// What the CPU data path hands the engine, so that one collective's codec work (statistics,
// compress, DAR, decompress) uses the node's cores while the engine itself stays single-threaded.
// Results are bit-identical to the wrapped codec's for any pool size; codecs that do not split
// run on the calling thread. Cheap to make (two pointers): one per collective is fine.
//
// Thread safety: as Codec (immutable; concurrent calls share the pool, see common/thread_pool.h).
// The wrapped codec and the pool must outlive it.
#ifndef DQ_KERNELS_PARALLEL_CODEC_H_
#define DQ_KERNELS_PARALLEL_CODEC_H_

#include <string>

#include "common/thread_pool.h"
#include "kernels/codec.h"

namespace dynamiq::kernels {

class ParallelCodec final : public Codec {
 public:
  // `pool` may be null (every call on the calling thread).
  ParallelCodec(const Codec& codec, common::ThreadPool* pool) : Codec(codec.config()), codec_(codec), pool_(pool) {}

  const Codec& wrapped() const { return codec_; }

  std::string Describe() const override { return codec_.Describe(); }
  bool SupportsButterfly() const override { return codec_.SupportsButterfly(); }

  bool NeedsBucketTransform() const override { return codec_.NeedsBucketTransform(); }
  const std::array<double, 9>* MeasuredWidthErrors() const override { return codec_.MeasuredWidthErrors(); }
  absl::StatusOr<size_t> TransformedLength(size_t num_elements) const override {
    return codec_.TransformedLength(num_elements);
  }
  absl::Status ForwardTransform(const RoundInfo& round, absl::Span<float> values) const override {
    return codec_.ForwardTransform(round, values);
  }
  absl::Status InverseTransform(const RoundInfo& round, absl::Span<float> values) const override {
    return codec_.InverseTransform(round, values);
  }
  size_t StatsLength(size_t num_elements) const override { return codec_.StatsLength(num_elements); }
  StatsReduction stats_reduction() const override { return codec_.stats_reduction(); }
  void ComputeStats(const Source& local, size_t num_elements, float* stats) const override {
    codec_.ComputeStatsOn(pool_, local, num_elements, stats);
  }
  absl::StatusOr<BucketPlan> MakePlan(const RoundInfo& round, size_t num_elements, absl::Span<const float> local_stats,
                                      absl::Span<const float> reduced_stats) const override {
    return codec_.MakePlan(round, num_elements, local_stats, reduced_stats);
  }

  size_t MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const override {
    return codec_.MaxEncodedBytes(plan, chunk);
  }
  absl::StatusOr<size_t> Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                  absl::Span<uint8_t> out) const override {
    return codec_.CompressOn(pool_, plan, chunk, local, out);
  }
  absl::Status Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                          const Dest& out) const override {
    return codec_.DecompressOn(pool_, plan, chunk, in, out);
  }
  absl::Status DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                    float* acc) const override {
    return codec_.DecompressAccumulateOn(pool_, plan, chunk, in, acc);
  }
  absl::StatusOr<size_t> DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                        absl::Span<const uint8_t> in, const Source& local,
                                                        absl::Span<uint8_t> out) const override {
    return codec_.DecompressAccumulateRecompressOn(pool_, plan, chunk, in, local, out);
  }

  // A codec that checksums while it encodes and verifies while it decodes does not split (none,
  // bf16): its own calls. The others split (the plain calls above) and are checksummed and
  // verified before or after (Codec's defaults).
  bool ChecksumsWhileEncoding() const override { return codec_.ChecksumsWhileEncoding(); }
  absl::StatusOr<size_t> CompressChecksummed(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                             absl::Span<uint8_t> out, uint64_t& checksum) const override {
    return codec_.ChecksumsWhileEncoding() ? codec_.CompressChecksummed(plan, chunk, local, out, checksum)
                                           : Codec::CompressChecksummed(plan, chunk, local, out, checksum);
  }
  absl::StatusOr<size_t> DecompressAccumulateRecompressChecksummed(const BucketPlan& plan, const ChunkRef& chunk,
                                                                   absl::Span<const uint8_t> in, const Source& local,
                                                                   absl::Span<uint8_t> out,
                                                                   uint64_t& checksum) const override {
    return codec_.ChecksumsWhileEncoding()
               ? codec_.DecompressAccumulateRecompressChecksummed(plan, chunk, in, local, out, checksum)
               : Codec::DecompressAccumulateRecompressChecksummed(plan, chunk, in, local, out, checksum);
  }

  absl::Status DecompressVerified(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                  const Dest& out, uint64_t expected) const override {
    return codec_.ChecksumsWhileEncoding() ? codec_.DecompressVerified(plan, chunk, in, out, expected)
                                           : Codec::DecompressVerified(plan, chunk, in, out, expected);
  }
  absl::StatusOr<size_t> DecompressAccumulateRecompressVerified(const BucketPlan& plan, const ChunkRef& chunk,
                                                                absl::Span<const uint8_t> in, uint64_t expected,
                                                                const Source& local, absl::Span<uint8_t> out,
                                                                uint64_t& checksum) const override {
    return codec_.ChecksumsWhileEncoding()
               ? codec_.DecompressAccumulateRecompressVerified(plan, chunk, in, expected, local, out, checksum)
               : Codec::DecompressAccumulateRecompressVerified(plan, chunk, in, expected, local, out, checksum);
  }

  // Split messages (none): one pass over memory, not split either.
  bool BodyIsFloat32() const override { return codec_.BodyIsFloat32(); }
  absl::Status WriteFloat32Head(const BucketPlan& plan, const ChunkRef& chunk,
                                absl::Span<uint8_t> head) const override {
    return codec_.WriteFloat32Head(plan, chunk, head);
  }
  absl::Status CheckFloat32Head(const BucketPlan& plan, const ChunkRef& chunk,
                                absl::Span<const uint8_t> head) const override {
    return codec_.CheckFloat32Head(plan, chunk, head);
  }
  absl::Status DecompressAccumulateRecompressSplit(const BucketPlan& plan, const ChunkRef& chunk,
                                                   absl::Span<const uint8_t> in, std::optional<uint64_t> expected,
                                                   const Source& local, absl::Span<uint8_t> head, float* body,
                                                   uint64_t& checksum) const override {
    return codec_.DecompressAccumulateRecompressSplit(plan, chunk, in, expected, local, head, body, checksum);
  }

  // A pool given explicitly (a ParallelCodec of a ParallelCodec) wins over this one's.
  void ComputeStatsOn(common::ThreadPool* pool, const Source& local, size_t num_elements, float* stats) const override {
    codec_.ComputeStatsOn(pool, local, num_elements, stats);
  }
  absl::StatusOr<size_t> CompressOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                    const Source& local, absl::Span<uint8_t> out) const override {
    return codec_.CompressOn(pool, plan, chunk, local, out);
  }
  absl::Status DecompressOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                            absl::Span<const uint8_t> in, const Dest& out) const override {
    return codec_.DecompressOn(pool, plan, chunk, in, out);
  }
  absl::Status DecompressAccumulateOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                      absl::Span<const uint8_t> in, float* acc) const override {
    return codec_.DecompressAccumulateOn(pool, plan, chunk, in, acc);
  }
  absl::StatusOr<size_t> DecompressAccumulateRecompressOn(common::ThreadPool* pool, const BucketPlan& plan,
                                                          const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                                          const Source& local, absl::Span<uint8_t> out) const override {
    return codec_.DecompressAccumulateRecompressOn(pool, plan, chunk, in, local, out);
  }

 private:
  const Codec& codec_;
  common::ThreadPool* const pool_;
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_PARALLEL_CODEC_H_

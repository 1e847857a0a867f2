#include "kernels/codec.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/payload_checksum.h"

namespace dynamiq::kernels {

absl::Status Codec::ForwardTransform(const RoundInfo&, absl::Span<float>) const {
  return absl::UnimplementedError(absl::StrCat(CodecName(id()), " has no bucket transform"));
}

absl::Status Codec::InverseTransform(const RoundInfo&, absl::Span<float>) const {
  return absl::UnimplementedError(absl::StrCat(CodecName(id()), " has no bucket transform"));
}

size_t Codec::StatsLength(size_t) const { return 0; }

void Codec::ComputeStats(const Source&, size_t, float*) const {}

absl::StatusOr<BucketPlan> Codec::MakePlan(const RoundInfo& round, size_t num_elements, absl::Span<const float>,
                                           absl::Span<const float>) const {
  BucketPlan plan;
  plan.round = round;
  plan.num_elements = num_elements;
  return plan;
}

absl::StatusOr<size_t> Codec::CompressChecksummed(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                                  absl::Span<uint8_t> out, uint64_t& checksum) const {
  DQ_ASSIGN_OR_RETURN(const size_t bytes, Compress(plan, chunk, local, out));
  checksum = PayloadChecksum(out.first(bytes));
  return bytes;
}

absl::StatusOr<size_t> Codec::DecompressAccumulateRecompressChecksummed(const BucketPlan& plan, const ChunkRef& chunk,
                                                                        absl::Span<const uint8_t> in,
                                                                        const Source& local, absl::Span<uint8_t> out,
                                                                        uint64_t& checksum) const {
  DQ_ASSIGN_OR_RETURN(const size_t bytes, DecompressAccumulateRecompress(plan, chunk, in, local, out));
  checksum = PayloadChecksum(out.first(bytes));
  return bytes;
}

absl::Status PayloadChecksumError() {
  return absl::DataLossError("payload failed its checksum (corrupted in transit)");
}

absl::Status Codec::WriteFloat32Head(const BucketPlan&, const ChunkRef&, absl::Span<uint8_t>) const {
  return absl::UnimplementedError(absl::StrCat(CodecName(id()), " messages have no fp32 body"));
}

absl::Status Codec::CheckFloat32Head(const BucketPlan&, const ChunkRef&, absl::Span<const uint8_t>) const {
  return absl::UnimplementedError(absl::StrCat(CodecName(id()), " messages have no fp32 body"));
}

absl::Status Codec::DecompressAccumulateRecompressSplit(const BucketPlan&, const ChunkRef&, absl::Span<const uint8_t>,
                                                        std::optional<uint64_t>, const Source&, absl::Span<uint8_t>,
                                                        float*, uint64_t&) const {
  return absl::UnimplementedError(absl::StrCat(CodecName(id()), " messages have no fp32 body"));
}

absl::Status Codec::DecompressVerified(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                       const Dest& out, uint64_t expected) const {
  if (PayloadChecksum(in) != expected) return PayloadChecksumError();
  return Decompress(plan, chunk, in, out);
}

absl::StatusOr<size_t> Codec::DecompressAccumulateRecompressVerified(const BucketPlan& plan, const ChunkRef& chunk,
                                                                     absl::Span<const uint8_t> in, uint64_t expected,
                                                                     const Source& local, absl::Span<uint8_t> out,
                                                                     uint64_t& checksum) const {
  if (PayloadChecksum(in) != expected) return PayloadChecksumError();
  return DecompressAccumulateRecompressChecksummed(plan, chunk, in, local, out, checksum);
}

void Codec::ComputeStatsOn(common::ThreadPool*, const Source& local, size_t num_elements, float* stats) const {
  ComputeStats(local, num_elements, stats);
}

absl::StatusOr<size_t> Codec::CompressOn(common::ThreadPool*, const BucketPlan& plan, const ChunkRef& chunk,
                                         const Source& local, absl::Span<uint8_t> out) const {
  return Compress(plan, chunk, local, out);
}

absl::Status Codec::DecompressOn(common::ThreadPool*, const BucketPlan& plan, const ChunkRef& chunk,
                                 absl::Span<const uint8_t> in, const Dest& out) const {
  return Decompress(plan, chunk, in, out);
}

absl::Status Codec::DecompressAccumulateOn(common::ThreadPool*, const BucketPlan& plan, const ChunkRef& chunk,
                                           absl::Span<const uint8_t> in, float* acc) const {
  return DecompressAccumulate(plan, chunk, in, acc);
}

absl::StatusOr<size_t> Codec::DecompressAccumulateRecompressOn(common::ThreadPool*, const BucketPlan& plan,
                                                               const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                                               const Source& local, absl::Span<uint8_t> out) const {
  return DecompressAccumulateRecompress(plan, chunk, in, local, out);
}

}  // namespace dynamiq::kernels

// MxCodec: the OCP Microscaling baselines MXFP8 (E4M3), MXFP6 (E3M2) and MXFP4 (E2M1) on the CPU.
//
// Chunk payload (after the 32-byte ChunkHeader): one block per 32 elements of the chunk, the last
// one padded with zero codes,
//   [ u8 E8M0 scale ][ 32 codes of w = 8/6/4 bits, packed LSB-first (32/24/16 bytes) ]
// i.e. 8.25 / 6.25 / 4.25 bits per coordinate. kernels/mx_math.h defines the block math (scale
// choice, round to nearest even with saturation, the 0xFF NaN block for non-finite input).
// Header fields: codec id, element_bits = w, flags 0, param 0, num_summands (1 at a leaf; DAR
// writes the received count + 1), round = low 32 bits of plan.round.round, chunk_id,
// num_elements = chunk.count, payload_bytes exact.
//
// No bucket statistics (the Codec defaults). Every decoder validates the header and every block
// before it writes any output, and reports malformed input as INVALID_ARGUMENT (header does not
// match the expected chunk) or DATA_LOSS (truncated chunk, corrupt codes). `in` may be longer than
// the chunk; the extra bytes are ignored. DAR re-quantizes block by block from the new partial
// sum with a 32-float stack tile; its `out` may be the very buffer `in` points to. The hot loops
// use Highway with runtime dispatch and write the same bytes as mx_math.h on every target.
//
// Thread safety: immutable after construction; all methods may be called concurrently.
#ifndef DQ_KERNELS_CPU_MX_CODEC_H_
#define DQ_KERNELS_CPU_MX_CODEC_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/codec.h"
#include "kernels/mx_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {

class MxCodec final : public Codec {
 public:
  // config.id must be kMxfp8, kMxfp6 or kMxfp4 (NewMxCodec checks).
  explicit MxCodec(const CodecConfig& config);

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
  // Checks that `chunk` can be encoded and `out` holds its encoding; returns the payload size.
  absl::StatusOr<size_t> CheckOutput(const BucketPlan& plan, const ChunkRef& chunk, size_t out_bytes) const;
  // Parses `in`, checks it is `chunk` of plan's round in this format and validates every block.
  absl::StatusOr<ChunkHeader> ParseAndValidate(const BucketPlan& plan, const ChunkRef& chunk,
                                               absl::Span<const uint8_t> in) const;
  ChunkHeader MakeHeader(const BucketPlan& plan, const ChunkRef& chunk, uint16_t num_summands) const;

  MxElementFormat format_;
  float decode_[256];  // element value of every code (validation rejects illegal codes first)
};

// The MX codec for config.id kMxfp8, kMxfp6 or kMxfp4; nullptr for any other id.
std::unique_ptr<Codec> NewMxCodec(const CodecConfig& config);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_MX_CODEC_H_

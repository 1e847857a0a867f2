#include "kernels/wire_format.h"

#include <string.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/little_endian.h"

namespace dynamiq::kernels {

void WriteChunkHeader(const ChunkHeader& h, absl::Span<uint8_t> out) {
  uint8_t* p = out.data();
  common::PutLe<uint32_t>(p + 0, kChunkMagic);
  p[4] = kWireVersion;
  p[5] = static_cast<uint8_t>(h.codec);
  p[6] = h.element_bits;
  p[7] = h.flags;
  common::PutLe<uint32_t>(p + 8, h.num_elements);
  common::PutLe<uint32_t>(p + 12, h.chunk_id);
  common::PutLe<uint32_t>(p + 16, h.round);
  common::PutLe<uint16_t>(p + 20, h.num_summands);
  common::PutLe<uint16_t>(p + 22, 0);
  common::PutLe<uint32_t>(p + 24, h.payload_bytes);
  uint32_t param_bits;
  memcpy(&param_bits, &h.param, 4);
  common::PutLe<uint32_t>(p + 28, param_bits);
}

absl::StatusOr<ChunkHeader> ParseChunkHeader(absl::Span<const uint8_t> bytes) {
  return ParseDetachedChunkHeader(bytes, bytes.size() < kChunkHeaderBytes ? 0 : bytes.size() - kChunkHeaderBytes);
}

absl::StatusOr<ChunkHeader> ParseDetachedChunkHeader(absl::Span<const uint8_t> bytes, size_t payload_bytes) {
  if (bytes.size() < kChunkHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat("compressed chunk truncated: ", bytes.size(), " bytes, header alone needs ", kChunkHeaderBytes));
  }
  const uint8_t* p = bytes.data();
  uint32_t magic = common::GetLe<uint32_t>(p);
  if (magic != kChunkMagic) {
    return absl::InvalidArgumentError(absl::StrCat("not a dynamiq chunk: magic 0x", absl::Hex(magic, absl::kZeroPad8),
                                                   ", expected 0x", absl::Hex(kChunkMagic, absl::kZeroPad8)));
  }
  if (p[4] != kWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported chunk wire version ", p[4], " (this build speaks ", kWireVersion, ")"));
  }
  if (p[5] >= kNumCodecs) return absl::InvalidArgumentError(absl::StrCat("unknown codec id ", p[5], " in chunk"));
  if (common::GetLe<uint16_t>(p + 22) != 0)
    return absl::InvalidArgumentError("chunk header reserved field is not zero");
  ChunkHeader h;
  h.codec = static_cast<CodecId>(p[5]);
  h.element_bits = p[6];
  h.flags = p[7];
  h.num_elements = common::GetLe<uint32_t>(p + 8);
  h.chunk_id = common::GetLe<uint32_t>(p + 12);
  h.round = common::GetLe<uint32_t>(p + 16);
  h.num_summands = common::GetLe<uint16_t>(p + 20);
  h.payload_bytes = common::GetLe<uint32_t>(p + 24);
  uint32_t param_bits = common::GetLe<uint32_t>(p + 28);
  memcpy(&h.param, &param_bits, 4);
  if (h.num_elements > kMaxChunkElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk claims ", h.num_elements, " elements; the limit is ", kMaxChunkElements));
  }
  if (h.num_summands == 0) return absl::InvalidArgumentError("chunk claims 0 summands");
  if (!std::isfinite(h.param)) return absl::InvalidArgumentError("chunk parameter is not finite");
  if (payload_bytes < h.payload_bytes) {
    return absl::DataLossError(absl::StrCat("compressed chunk truncated: header announces ", h.payload_bytes,
                                            " payload bytes, only ", payload_bytes, " present"));
  }
  return h;
}

absl::Status ValidateChunkHeader(const ChunkHeader& h, CodecId codec, const BucketPlan& plan, const ChunkRef& chunk,
                                 size_t expected_payload_bytes) {
  if (h.codec != codec) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk was compressed with codec ", CodecName(h.codec), ", expected ", CodecName(codec)));
  }
  if (h.num_elements != chunk.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", chunk.chunk_id, " holds ", h.num_elements, " elements, expected ", chunk.count));
  }
  if (h.chunk_id != chunk.chunk_id) {
    return absl::InvalidArgumentError(absl::StrCat("received chunk id ", h.chunk_id, ", expected ", chunk.chunk_id));
  }
  if (h.round != static_cast<uint32_t>(plan.round.round)) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk belongs to round ", h.round, ", expected round ", static_cast<uint32_t>(plan.round.round)));
  }
  if (h.payload_bytes != expected_payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", chunk.chunk_id, " payload is ", h.payload_bytes,
                                                   " bytes, expected ", expected_payload_bytes));
  }
  return absl::OkStatus();
}

}  // namespace dynamiq::kernels

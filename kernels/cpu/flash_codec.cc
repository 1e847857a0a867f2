#include "kernels/cpu/flash_codec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/flash_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {
namespace {

CodecConfig WithFlashId(CodecConfig config) {
  config.id = CodecId::kFlash;
  return config;
}

// What the caller hands us: a plan for a real rank and a chunk inside the bucket, aligned to the
// bucket's groups.
absl::Status ValidateChunkRef(const BucketPlan& plan, const ChunkRef& chunk) {
  if (plan.round.world_size == 0 || plan.round.rank >= plan.round.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash: rank ", plan.round.rank, " is not in a world of ", plan.round.world_size));
  }
  if ((chunk.count > 0 && chunk.begin % kFlashGroupSize != 0) || chunk.count > kMaxChunkElements ||
      chunk.begin + chunk.count > plan.num_elements) {
    return absl::InvalidArgumentError(absl::StrCat("flash: chunk ", chunk.chunk_id, " [", chunk.begin, ", +",
                                                   chunk.count, ") is not a ", kFlashGroupSize,
                                                   "-aligned range of the ", plan.num_elements, "-element bucket"));
  }
  return absl::OkStatus();
}

absl::Status CheckOutputSize(absl::Span<uint8_t> out, size_t needed) {
  if (out.size() < needed) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash: output buffer holds ", out.size(), " bytes, the chunk needs ", needed));
  }
  return absl::OkStatus();
}

size_t PayloadBytes(int bits, size_t count) { return FlashNumGroups(count) * FlashGroupBytes(bits); }

// Values of group `g` of the chunk: its offset in the chunk and its element count.
size_t GroupOffset(size_t g) { return g * kFlashGroupSize; }
int GroupCount(const ChunkRef& chunk, size_t g) {
  return static_cast<int>(std::min<size_t>(kFlashGroupSize, chunk.count - GroupOffset(g)));
}

// Parses and validates a received chunk: header fields and every group's minimum and scale
// (every code is legal). Nothing is decoded before this passes.
absl::StatusOr<ChunkHeader> ParseAndValidate(int bits, const BucketPlan& plan, const ChunkRef& chunk,
                                             absl::Span<const uint8_t> in) {
  DQ_RETURN_IF_ERROR(ValidateChunkRef(plan, chunk));
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
  DQ_RETURN_IF_ERROR(ValidateChunkHeader(h, CodecId::kFlash, plan, chunk, PayloadBytes(bits, chunk.count)));
  if (h.element_bits != bits) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash: chunk ", chunk.chunk_id, " has ", h.element_bits, "-bit codes, expected ", bits));
  }
  if (h.flags != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash: chunk ", chunk.chunk_id, " has flags 0x", absl::Hex(h.flags), ", expected 0"));
  }
  if (h.num_summands > plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("flash: chunk ", chunk.chunk_id, " claims ", h.num_summands,
                                                   " summands in a world of ", plan.round.world_size));
  }
  if (h.param != 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash: chunk ", chunk.chunk_id, " has parameter ", h.param, ", expected 0"));
  }
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  const size_t group_bytes = FlashGroupBytes(bits);
  for (size_t g = 0; g < FlashNumGroups(chunk.count); ++g) {
    const uint8_t* group = payload + g * group_bytes;
    const uint16_t min_bits = FlashLoadHalf(group);
    const uint16_t scale_bits = FlashLoadHalf(group + 2);
    if (!FlashHeaderIsValid(min_bits, scale_bits, bits)) {
      return absl::DataLossError(
          absl::StrCat("flash: chunk ", chunk.chunk_id, " group ", g, " has an invalid minimum/scale (bf16 0x",
                       absl::Hex(min_bits, absl::kZeroPad4), "/0x", absl::Hex(scale_bits, absl::kZeroPad4),
                       "): Inf, NaN other than the 0x7fc0 pair, a negative scale, or a range that overflows"));
    }
  }
  return h;
}

}  // namespace

std::unique_ptr<Codec> NewFlashCodec(const CodecConfig& config) {
  if (!(config.bits >= kFlashMinBits && config.bits <= kFlashMaxBits) || config.bits != std::floor(config.bits)) {
    return nullptr;
  }
  return std::make_unique<FlashCodec>(config);
}

FlashCodec::FlashCodec(const CodecConfig& config) : Codec(WithFlashId(config)), bits_(static_cast<int>(config.bits)) {
  DQ_CHECK(bits_ >= kFlashMinBits && bits_ <= kFlashMaxBits && config.bits == bits_);
}

std::string FlashCodec::Describe() const {
  return absl::StrCat("flash: ", bits_, "-bit asymmetric round-to-nearest, bf16 min and scale per ", kFlashGroupSize,
                      ", ", bits_ + 0.25, " bits/coord");
}

size_t FlashCodec::MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const {
  return kChunkHeaderBytes + PayloadBytes(bits_, chunk.count);
}

absl::StatusOr<size_t> FlashCodec::Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                            absl::Span<uint8_t> out) const {
  DQ_RETURN_IF_ERROR(ValidateChunkRef(plan, chunk));
  const size_t payload_bytes = PayloadBytes(bits_, chunk.count);
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  uint8_t* payload = out.data() + kChunkHeaderBytes;
  const size_t group_bytes = FlashGroupBytes(bits_);
  float tile[kFlashGroupSize];
  for (size_t g = 0; g < FlashNumGroups(chunk.count); ++g) {
    const int count = GroupCount(chunk, g);
    LoadSource(local, chunk.begin + GroupOffset(g), count, tile);
    FlashEncodeGroup(tile, count, bits_, payload + g * group_bytes);
  }
  ChunkHeader h;
  h.codec = CodecId::kFlash;
  h.element_bits = static_cast<uint8_t>(bits_);
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = 1;
  h.payload_bytes = static_cast<uint32_t>(payload_bytes);
  WriteChunkHeader(h, out);
  return kChunkHeaderBytes + payload_bytes;
}

absl::Status FlashCodec::Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                    const Dest& out) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(bits_, plan, chunk, in).status());
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  const size_t group_bytes = FlashGroupBytes(bits_);
  float tile[kFlashGroupSize];
  for (size_t g = 0; g < FlashNumGroups(chunk.count); ++g) {
    const int count = GroupCount(chunk, g);
    FlashDecodeGroup(payload + g * group_bytes, bits_, count, tile);
    StoreDest(out, chunk.begin + GroupOffset(g), count, tile);
  }
  return absl::OkStatus();
}

absl::Status FlashCodec::DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk,
                                              absl::Span<const uint8_t> in, float* acc) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(bits_, plan, chunk, in).status());
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  const size_t group_bytes = FlashGroupBytes(bits_);
  float tile[kFlashGroupSize];
  for (size_t g = 0; g < FlashNumGroups(chunk.count); ++g) {
    const int count = GroupCount(chunk, g);
    FlashDecodeGroup(payload + g * group_bytes, bits_, count, tile);
    float* a = acc + GroupOffset(g);
    for (int k = 0; k < count; ++k) a[k] += tile[k];
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> FlashCodec::DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                                  absl::Span<const uint8_t> in, const Source& local,
                                                                  absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseAndValidate(bits_, plan, chunk, in));
  if (h.num_summands >= plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("flash: chunk ", chunk.chunk_id, " already holds all ",
                                                   h.num_summands, " contributions; nothing left to add"));
  }
  const size_t payload_bytes = h.payload_bytes;
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  const uint8_t* src = in.data() + kChunkHeaderBytes;
  uint8_t* dst = out.data() + kChunkHeaderBytes;
  const size_t group_bytes = FlashGroupBytes(bits_);
  float sum[kFlashGroupSize];
  float mine[kFlashGroupSize];
  for (size_t g = 0; g < FlashNumGroups(chunk.count); ++g) {
    const int count = GroupCount(chunk, g);
    FlashDecodeGroup(src + g * group_bytes, bits_, count, sum);
    LoadSource(local, chunk.begin + GroupOffset(g), count, mine);
    for (int k = 0; k < count; ++k) sum[k] += mine[k];
    // The minimum and scale are recomputed from the new partial sum: the range follows the data.
    FlashEncodeGroup(sum, count, bits_, dst + g * group_bytes);
  }
  h.num_summands = static_cast<uint16_t>(h.num_summands + 1);
  WriteChunkHeader(h, out);
  return kChunkHeaderBytes + payload_bytes;
}

}  // namespace dynamiq::kernels

#include "kernels/cpu/int8_codec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/int8_math.h"
#include "kernels/random_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {
namespace {

// Bucket element indices key the random streams as uint32.
constexpr size_t kMaxBucketElements = 0xffffff00u;
constexpr size_t kTile = 256;

CodecConfig WithInt8Id(CodecConfig config) {
  config.id = CodecId::kInt8;
  config.bits = 8;
  return config;
}

absl::Status ValidateChunkRef(const BucketPlan& plan, const ChunkRef& chunk) {
  if (plan.round.world_size == 0 || plan.round.rank >= plan.round.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("int8: rank ", plan.round.rank, " is not in a world of ", plan.round.world_size));
  }
  if (plan.num_elements > kMaxBucketElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("int8: bucket of ", plan.num_elements, " elements exceeds the limit ", kMaxBucketElements));
  }
  if (chunk.count > kMaxChunkElements || chunk.begin + chunk.count > plan.num_elements) {
    return absl::InvalidArgumentError(absl::StrCat("int8: chunk ", chunk.chunk_id, " [", chunk.begin, ", +",
                                                   chunk.count, ") is not inside the ", plan.num_elements,
                                                   "-element bucket"));
  }
  return absl::OkStatus();
}

absl::Status CheckOutputSize(absl::Span<uint8_t> out, size_t needed) {
  if (out.size() < needed) {
    return absl::InvalidArgumentError(
        absl::StrCat("int8: output buffer holds ", out.size(), " bytes, the chunk needs ", needed));
  }
  return absl::OkStatus();
}

size_t PayloadBytes(size_t count) { return kInt8ScaleBytes + count; }

uint32_t LoadScale(const uint8_t* payload) {
  return static_cast<uint32_t>(payload[0]) | (static_cast<uint32_t>(payload[1]) << 8) |
         (static_cast<uint32_t>(payload[2]) << 16) | (static_cast<uint32_t>(payload[3]) << 24);
}

void StoreScale(uint32_t bits, uint8_t* payload) {
  for (int b = 0; b < 4; ++b) payload[b] = static_cast<uint8_t>(bits >> (8 * b));
}

// Values of the chunk, tile by tile: fn(offset, values, count) for offsets 0, kTile, ...
// `values` = decode(in) + local (either may be absent).
template <typename Fn>
void ForEachTile(const ChunkRef& chunk, const uint8_t* in_payload, const Source* local, Fn fn) {
  float tile[kTile];
  float mine[kTile];
  const float in_scale = in_payload == nullptr ? 0.0f : BitsToFloat(LoadScale(in_payload));
  for (size_t offset = 0; offset < chunk.count; offset += kTile) {
    const size_t count = std::min(kTile, chunk.count - offset);
    if (in_payload != nullptr) {
      const uint8_t* codes = in_payload + kInt8ScaleBytes + offset;
      for (size_t k = 0; k < count; ++k) tile[k] = Int8Decode(codes[k], in_scale);
    } else {
      std::fill(tile, tile + count, 0.0f);
    }
    if (local != nullptr) {
      LoadSource(*local, chunk.begin + offset, count, mine);
      for (size_t k = 0; k < count; ++k) tile[k] += mine[k];
    }
    fn(offset, tile, count);
  }
}

// Encodes decode(in) + local over the chunk into `payload` (two passes: scale, then codes).
void Encode(const CodecConfig& config, const BucketPlan& plan, const ChunkRef& chunk, const uint8_t* in_payload,
            const Source* local, uint8_t* payload) {
  double sum_sq = 0.0;
  bool finite = true;
  ForEachTile(chunk, in_payload, local, [&](size_t, const float* v, size_t count) {
    for (size_t k = 0; k < count; ++k) {
      finite = finite && Int8IsFinite(v[k]);
      sum_sq += static_cast<double>(v[k]) * static_cast<double>(v[k]);
    }
  });
  const uint32_t scale_bits = chunk.count == 0 ? 0u : Int8ScaleFor(sum_sq, chunk.count, finite);
  StoreScale(scale_bits, payload);
  uint8_t* codes = payload + kInt8ScaleBytes;
  const float scale = BitsToFloat(scale_bits);
  if (scale_bits == kInt8NanScale || !(scale > 0.0f)) {
    std::fill(codes, codes + chunk.count, static_cast<uint8_t>(kInt8MaxLevel));  // all zero, or NaN
    return;
  }
  const uint32_t key = StreamKey(config.seed, plan.round.round, plan.round.rank);
  ForEachTile(chunk, in_payload, local, [&](size_t offset, const float* v, size_t count) {
    for (size_t k = 0; k < count; ++k) {
      const uint32_t index = static_cast<uint32_t>(chunk.begin + offset + k);
      codes[offset + k] = static_cast<uint8_t>(Int8Quantize(v[k], scale, BitsToUnit(RandomBits(key, index))));
    }
  });
}

absl::StatusOr<ChunkHeader> ParseAndValidate(const BucketPlan& plan, const ChunkRef& chunk,
                                             absl::Span<const uint8_t> in) {
  DQ_RETURN_IF_ERROR(ValidateChunkRef(plan, chunk));
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
  DQ_RETURN_IF_ERROR(ValidateChunkHeader(h, CodecId::kInt8, plan, chunk, PayloadBytes(chunk.count)));
  if (h.element_bits != 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("int8: chunk ", chunk.chunk_id, " has ", h.element_bits, "-bit codes, expected 8"));
  }
  if (h.flags != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("int8: chunk ", chunk.chunk_id, " has flags 0x", absl::Hex(h.flags), ", expected 0"));
  }
  if (h.num_summands > plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("int8: chunk ", chunk.chunk_id, " claims ", h.num_summands,
                                                   " summands in a world of ", plan.round.world_size));
  }
  if (h.param != kInt8ClipSigmas) {
    return absl::InvalidArgumentError(absl::StrCat("int8: chunk ", chunk.chunk_id, " has parameter ", h.param,
                                                   ", expected the clip ", kInt8ClipSigmas));
  }
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  const uint32_t scale = LoadScale(payload);
  if (!Int8ScaleIsValid(scale)) {
    return absl::DataLossError(absl::StrCat("int8: chunk ", chunk.chunk_id, " has an invalid scale (f32 0x",
                                            absl::Hex(scale, absl::kZeroPad8),
                                            "): negative, Inf, NaN other than 0x7fc00000, or overflowing"));
  }
  const uint8_t* codes = payload + kInt8ScaleBytes;
  const uint8_t* bad = std::find(codes, codes + chunk.count, static_cast<uint8_t>(kInt8IllegalCode));
  if (bad != codes + chunk.count) {
    return absl::DataLossError(absl::StrCat("int8: chunk ", chunk.chunk_id, " element ", bad - codes,
                                            " holds the illegal code ", kInt8IllegalCode));
  }
  return h;
}

ChunkHeader HeaderFor(const BucketPlan& plan, const ChunkRef& chunk) {
  ChunkHeader h;
  h.codec = CodecId::kInt8;
  h.element_bits = 8;
  h.flags = 0;
  h.param = kInt8ClipSigmas;
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = 1;
  h.payload_bytes = static_cast<uint32_t>(PayloadBytes(chunk.count));
  return h;
}

}  // namespace

std::unique_ptr<Codec> NewInt8Codec(const CodecConfig& config) { return std::make_unique<Int8Codec>(config); }

Int8Codec::Int8Codec(const CodecConfig& config) : Codec(WithInt8Id(config)) {}

std::string Int8Codec::Describe() const {
  return absl::StrCat("int8: 8-bit stochastic, f32 scale per chunk, clip at +-", kInt8ClipSigmas,
                      " sigma, 8 bits/coord + 32 per chunk");
}

size_t Int8Codec::MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const {
  return kChunkHeaderBytes + PayloadBytes(chunk.count);
}

absl::StatusOr<size_t> Int8Codec::Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                           absl::Span<uint8_t> out) const {
  DQ_RETURN_IF_ERROR(ValidateChunkRef(plan, chunk));
  const size_t bytes = kChunkHeaderBytes + PayloadBytes(chunk.count);
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, bytes));
  Encode(config(), plan, chunk, nullptr, &local, out.data() + kChunkHeaderBytes);
  WriteChunkHeader(HeaderFor(plan, chunk), out);
  return bytes;
}

absl::Status Int8Codec::Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                   const Dest& out) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(plan, chunk, in).status());
  ForEachTile(chunk, in.data() + kChunkHeaderBytes, nullptr,
              [&](size_t offset, const float* v, size_t count) { StoreDest(out, chunk.begin + offset, count, v); });
  return absl::OkStatus();
}

absl::Status Int8Codec::DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk,
                                             absl::Span<const uint8_t> in, float* acc) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(plan, chunk, in).status());
  ForEachTile(chunk, in.data() + kChunkHeaderBytes, nullptr, [&](size_t offset, const float* v, size_t count) {
    for (size_t k = 0; k < count; ++k) acc[offset + k] += v[k];
  });
  return absl::OkStatus();
}

absl::StatusOr<size_t> Int8Codec::DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                                 absl::Span<const uint8_t> in, const Source& local,
                                                                 absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseAndValidate(plan, chunk, in));
  if (h.num_summands >= plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("int8: chunk ", chunk.chunk_id, " already holds all ",
                                                   h.num_summands, " contributions; nothing left to add"));
  }
  const size_t bytes = kChunkHeaderBytes + PayloadBytes(chunk.count);
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, bytes));
  // The scale is recomputed from the new partial sum, so the range follows the data.
  Encode(config(), plan, chunk, in.data() + kChunkHeaderBytes, &local, out.data() + kChunkHeaderBytes);
  h.num_summands = static_cast<uint16_t>(h.num_summands + 1);
  WriteChunkHeader(h, out);
  return bytes;
}

}  // namespace dynamiq::kernels

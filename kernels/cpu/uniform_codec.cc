#include "kernels/cpu/uniform_codec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/random_math.h"
#include "kernels/uniform_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {
namespace {

// Bucket element indices key the random streams as uint32.
constexpr size_t kMaxBucketElements = 0xffffff00u;

CodecConfig WithUniformId(CodecConfig config) {
  config.id = CodecId::kUniform;
  return config;
}

// What the caller hands us: a plan for a real rank and a chunk inside the bucket whose blocks (and
// correlated-rounding groups) are aligned to the bucket.
absl::Status ValidateChunkRef(const BucketPlan& plan, const ChunkRef& chunk) {
  if (plan.round.world_size == 0 || plan.round.rank >= plan.round.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("uniform: rank ", plan.round.rank, " is not in a world of ", plan.round.world_size));
  }
  if (plan.num_elements > kMaxBucketElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("uniform: bucket of ", plan.num_elements, " elements exceeds the limit ", kMaxBucketElements));
  }
  if ((chunk.count > 0 && chunk.begin % kUniformStratumElements != 0) || chunk.count > kMaxChunkElements ||
      chunk.begin + chunk.count > plan.num_elements) {
    return absl::InvalidArgumentError(absl::StrCat("uniform: chunk ", chunk.chunk_id, " [", chunk.begin, ", +",
                                                   chunk.count, ") is not a 256-aligned range of the ",
                                                   plan.num_elements, "-element bucket"));
  }
  if (chunk.rounding_size > 1 && chunk.rounding_index >= chunk.rounding_size) {
    return absl::InvalidArgumentError(absl::StrCat("uniform: chunk ", chunk.chunk_id, " rounding index ",
                                                   chunk.rounding_index, " is not below its ", chunk.rounding_size,
                                                   " siblings"));
  }
  return absl::OkStatus();
}

// Stratified rounding only among the siblings the caller names (see ChunkRef): never across the
// hops of a ring, where a hop's rounding probability depends on the previous hop's outcome.
bool Correlated(const CodecConfig& config, const ChunkRef& chunk) {
  return config.correlated_rounding && chunk.rounding_size > 1;
}

absl::Status CheckOutputSize(absl::Span<uint8_t> out, size_t needed) {
  if (out.size() < needed) {
    return absl::InvalidArgumentError(
        absl::StrCat("uniform: output buffer holds ", out.size(), " bytes, the chunk needs ", needed));
  }
  return absl::OkStatus();
}

size_t PayloadBytes(int bits, size_t count) { return UniformNumBlocks(count) * UniformBlockBytes(bits); }

// Config-level, like DynamiQ's: a receiver cannot know the sender's sibling set.
uint8_t FlagsFor(const CodecConfig& config) { return config.correlated_rounding ? kFlagCorrelated : 0; }

// Encodes v[0, count), the values of chunk block `block`, into `dst`.
void EncodeChunkBlock(const CodecConfig& config, int bits, const BucketPlan& plan, const ChunkRef& chunk, size_t block,
                      const float* v, int count, uint8_t* dst) {
  const uint32_t first = static_cast<uint32_t>(chunk.begin + block * kUniformBlockSize);
  const bool correlated = Correlated(config, chunk);
  const uint32_t n = chunk.rounding_size;
  uint32_t stratum = 0;
  if (correlated) {
    // Siblings share one permutation of strata per 256 elements. StratumOf is O(n) per block;
    // negligible next to the 32 elements' work for the sibling counts trees have.
    const uint32_t shared_key = StreamKey(config.seed, plan.round.round, kSharedStream ^ Mix32(chunk.rounding_group));
    stratum = StratumOf(shared_key, first / kUniformStratumElements, chunk.rounding_index, n);
  }
  const uint32_t key = StreamKey(config.seed, plan.round.round, plan.round.rank);
  UniformEncodeBlock(v, count, bits, key, first, correlated, stratum, n, dst);
}

// Parses and validates a received chunk: header fields and every block. Nothing is decoded before
// this passes.
absl::StatusOr<ChunkHeader> ParseAndValidate(const CodecConfig& config, int bits, const BucketPlan& plan,
                                             const ChunkRef& chunk, absl::Span<const uint8_t> in) {
  DQ_RETURN_IF_ERROR(ValidateChunkRef(plan, chunk));
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
  DQ_RETURN_IF_ERROR(ValidateChunkHeader(h, CodecId::kUniform, plan, chunk, PayloadBytes(bits, chunk.count)));
  if (h.element_bits != bits) {
    return absl::InvalidArgumentError(
        absl::StrCat("uniform: chunk ", chunk.chunk_id, " has ", h.element_bits, "-bit codes, expected ", bits));
  }
  const uint8_t flags = FlagsFor(config);
  if (h.flags != flags) {
    return absl::InvalidArgumentError(absl::StrCat("uniform: chunk ", chunk.chunk_id, " has flags 0x",
                                                   absl::Hex(h.flags), ", expected 0x", absl::Hex(flags)));
  }
  if (h.num_summands > plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("uniform: chunk ", chunk.chunk_id, " claims ", h.num_summands,
                                                   " summands in a world of ", plan.round.world_size));
  }
  if (h.param != 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("uniform: chunk ", chunk.chunk_id, " has parameter ", h.param, ", expected 0"));
  }
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  const size_t block_bytes = UniformBlockBytes(bits);
  const int max_level = UniformMaxLevel(bits);
  for (size_t b = 0; b < UniformNumBlocks(chunk.count); ++b) {
    const uint8_t* block = payload + b * block_bytes;
    if (UniformValidateBlock(block, bits)) continue;
    const uint16_t scale = UniformLoadScale(block);
    if (!UniformScaleIsValid(scale, max_level)) {
      return absl::DataLossError(absl::StrCat("uniform: chunk ", chunk.chunk_id, " block ", b,
                                              " has an invalid scale (bf16 0x", absl::Hex(scale, absl::kZeroPad4),
                                              "): negative, Inf, NaN other than 0x7fc0, or overflowing"));
    }
    return absl::DataLossError(
        absl::StrCat("uniform: chunk ", chunk.chunk_id, " block ", b, " holds the illegal code ", (1u << bits) - 1u));
  }
  return h;
}

}  // namespace

std::unique_ptr<Codec> NewUniformCodec(const CodecConfig& config) {
  if (!(config.bits >= 2.0 && config.bits <= 8.0) || config.bits != std::floor(config.bits)) return nullptr;
  return std::make_unique<UniformCodec>(config);
}

UniformCodec::UniformCodec(const CodecConfig& config)
    : Codec(WithUniformId(config)), bits_(static_cast<int>(config.bits)) {
  DQ_CHECK(bits_ >= 2 && bits_ <= 8 && config.bits == bits_);
}

std::string UniformCodec::Describe() const {
  return absl::StrCat("uniform: ", bits_, "-bit stochastic, bf16 scale per ", kUniformBlockSize, ", ", bits_ + 0.5,
                      " bits/coord", config().correlated_rounding ? ", correlated rounding" : "");
}

size_t UniformCodec::MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const {
  return kChunkHeaderBytes + PayloadBytes(bits_, chunk.count);
}

absl::StatusOr<size_t> UniformCodec::Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                              absl::Span<uint8_t> out) const {
  DQ_RETURN_IF_ERROR(ValidateChunkRef(plan, chunk));
  const size_t payload_bytes = PayloadBytes(bits_, chunk.count);
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  uint8_t* payload = out.data() + kChunkHeaderBytes;
  const size_t block_bytes = UniformBlockBytes(bits_);
  float tile[kUniformBlockSize];
  for (size_t b = 0; b < UniformNumBlocks(chunk.count); ++b) {
    const size_t offset = b * kUniformBlockSize;
    const int count = static_cast<int>(std::min<size_t>(kUniformBlockSize, chunk.count - offset));
    LoadSource(local, chunk.begin + offset, count, tile);
    EncodeChunkBlock(config(), bits_, plan, chunk, b, tile, count, payload + b * block_bytes);
  }
  ChunkHeader h;
  h.codec = CodecId::kUniform;
  h.element_bits = static_cast<uint8_t>(bits_);
  h.flags = FlagsFor(config());
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = 1;
  h.payload_bytes = static_cast<uint32_t>(payload_bytes);
  WriteChunkHeader(h, out);
  return kChunkHeaderBytes + payload_bytes;
}

absl::Status UniformCodec::Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                      const Dest& out) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(config(), bits_, plan, chunk, in).status());
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  const size_t block_bytes = UniformBlockBytes(bits_);
  float tile[kUniformBlockSize];
  for (size_t b = 0; b < UniformNumBlocks(chunk.count); ++b) {
    const size_t offset = b * kUniformBlockSize;
    const int count = static_cast<int>(std::min<size_t>(kUniformBlockSize, chunk.count - offset));
    UniformDecodeBlock(payload + b * block_bytes, bits_, count, tile);
    StoreDest(out, chunk.begin + offset, count, tile);
  }
  return absl::OkStatus();
}

absl::Status UniformCodec::DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk,
                                                absl::Span<const uint8_t> in, float* acc) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(config(), bits_, plan, chunk, in).status());
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  const size_t block_bytes = UniformBlockBytes(bits_);
  float tile[kUniformBlockSize];
  for (size_t b = 0; b < UniformNumBlocks(chunk.count); ++b) {
    const size_t offset = b * kUniformBlockSize;
    const int count = static_cast<int>(std::min<size_t>(kUniformBlockSize, chunk.count - offset));
    UniformDecodeBlock(payload + b * block_bytes, bits_, count, tile);
    for (int k = 0; k < count; ++k) acc[offset + k] += tile[k];
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> UniformCodec::DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                                    absl::Span<const uint8_t> in, const Source& local,
                                                                    absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseAndValidate(config(), bits_, plan, chunk, in));
  if (h.num_summands >= plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("uniform: chunk ", chunk.chunk_id, " already holds all ",
                                                   h.num_summands, " contributions; nothing left to add"));
  }
  const size_t payload_bytes = h.payload_bytes;
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  const uint8_t* src = in.data() + kChunkHeaderBytes;
  uint8_t* dst = out.data() + kChunkHeaderBytes;
  const size_t block_bytes = UniformBlockBytes(bits_);
  float sum[kUniformBlockSize];
  float mine[kUniformBlockSize];
  for (size_t b = 0; b < UniformNumBlocks(chunk.count); ++b) {
    const size_t offset = b * kUniformBlockSize;
    const int count = static_cast<int>(std::min<size_t>(kUniformBlockSize, chunk.count - offset));
    UniformDecodeBlock(src + b * block_bytes, bits_, count, sum);
    LoadSource(local, chunk.begin + offset, count, mine);
    for (int k = 0; k < count; ++k) sum[k] += mine[k];
    // The scale is recomputed from the new partial sum, so the range follows the data.
    EncodeChunkBlock(config(), bits_, plan, chunk, b, sum, count, dst + b * block_bytes);
  }
  h.num_summands = static_cast<uint16_t>(h.num_summands + 1);
  WriteChunkHeader(h, out);
  return kChunkHeaderBytes + payload_bytes;
}

}  // namespace dynamiq::kernels

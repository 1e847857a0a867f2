#include "kernels/cpu/thc_codec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/random_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {
namespace {

constexpr int kLeafBits = 4;
// Bucket indices (padding included) key the random streams as uint32.
constexpr size_t kMaxBucketElements = 0xffffff00u;

CodecConfig WithThcId(CodecConfig config) {
  config.id = CodecId::kThc;
  return config;
}

size_t NumBlocks(size_t count) { return (count + kThcBlockSize - 1) / kThcBlockSize; }

size_t PayloadBytes(int w, size_t count) { return NumBlocks(count) * ThcBlockBytes(w); }

bool Correlated(const CodecConfig& config, const BucketPlan& plan) {
  return config.correlated_rounding && plan.round.world_size > 1;
}

uint8_t FlagsFor(const CodecConfig& config, const BucketPlan& plan, bool aggregated) {
  return static_cast<uint8_t>((Correlated(config, plan) ? kFlagCorrelated : 0) | (aggregated ? kFlagAggregated : 0));
}

absl::Status ValidateRound(const RoundInfo& round) {
  if (round.world_size == 0 || round.rank >= round.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("thc: rank ", round.rank, " is not in a world of ", round.world_size));
  }
  if (ThcSumBits(round.world_size) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("thc: world of ", round.world_size, " ranks is too large: sums of ",
                                                   round.world_size, " x ", kThcGranularity,
                                                   " must fit in 16 bits (at most 1560 ranks)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateGlobalScale(float n) {
  if (!std::isfinite(n) || n < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("thc: global norm ", n, " is not a finite non-negative number (Inf/NaN gradients?)"));
  }
  return absl::OkStatus();
}

// What the caller hands us: a consistent plan and a 256-aligned chunk inside the bucket.
absl::Status ValidatePlanAndChunk(const BucketPlan& plan, const ChunkRef& chunk) {
  DQ_RETURN_IF_ERROR(ValidateRound(plan.round));
  DQ_RETURN_IF_ERROR(ValidateGlobalScale(plan.global_scale));
  if (plan.num_elements > kMaxBucketElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("thc: bucket of ", plan.num_elements, " elements exceeds the limit ", kMaxBucketElements));
  }
  if ((chunk.count > 0 && chunk.begin % kThcBlockSize != 0) || chunk.count > kMaxChunkElements ||
      chunk.begin + chunk.count > plan.num_elements) {
    return absl::InvalidArgumentError(absl::StrCat("thc: chunk ", chunk.chunk_id, " [", chunk.begin, ", +", chunk.count,
                                                   ") is not a 256-aligned range of the ", plan.num_elements,
                                                   "-element bucket"));
  }
  return absl::OkStatus();
}

absl::Status CheckOutputSize(absl::Span<uint8_t> out, size_t needed) {
  if (out.size() < needed) {
    return absl::InvalidArgumentError(
        absl::StrCat("thc: output buffer holds ", out.size(), " bytes, the chunk needs ", needed));
  }
  return absl::OkStatus();
}

// The element count the global norm spreads over: the whole bucket's, also in a block's slice.
size_t ScaleElements(const BucketPlan& plan) {
  return plan.scale_elements != 0 ? plan.scale_elements : plan.num_elements;
}

// sqrt(d) / N, the factor into the normalized domain. Capped so that a tiny N cannot turn
// 0 * Inf into NaN; 0 when N = 0 (every rank's bucket is zero and decodes to exactly zero).
float ToZ(const BucketPlan& plan) {
  if (!(plan.global_scale > 0.0f)) return 0.0f;
  double f = std::sqrt(static_cast<double>(ScaleElements(plan))) / plan.global_scale;
  return static_cast<float>(std::min(f, static_cast<double>(FLT_MAX)));
}

// N / sqrt(d), the factor back out of it.
float FromZ(const BucketPlan& plan) {
  if (ScaleElements(plan) == 0) return 0.0f;
  return static_cast<float>(plan.global_scale / std::sqrt(static_cast<double>(ScaleElements(plan))));
}

// Walsh-Hadamard levels h_begin <= h < h_end over v[0, n): two levels per pass over memory.
void HadamardLevels(float* v, size_t n, size_t h_begin, size_t h_end) {
  size_t h = h_begin;
  for (; 4 * h <= h_end; h *= 4) {
    for (size_t i = 0; i < n; i += 4 * h) {
      for (size_t j = i; j < i + h; ++j) ThcButterfly4(v, j, h);
    }
  }
  if (h < h_end) ThcHadamardLevels(v, n, h, h_end);
}

// The levels below kTile within one tile (in cache; n a multiple of 64): 1, 2 and 4 per 8
// elements, then the rest.
constexpr size_t kTile = 4096;  // 16 KiB
void HadamardTile(float* v, size_t n) {
  for (size_t i = 0; i < n; i += 64) ThcHadamard8x8(v + i);
  HadamardLevels(v, n, 8, n);
}

// The rotation of v[0, p), p a power of two >= 256, forward (y = H D x / sqrt(p)) or inverse
// (x = D H y / sqrt(p)). The Hadamard levels commute: the forward transform runs the sign and the
// low levels tile by tile, then the levels above a tile; the inverse the other way round, so the
// signs are applied while a tile is in cache. Deterministic: the same bits on every rank.
void Rotate(float* v, size_t p, uint32_t sign_key, bool inverse) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p)));
  const size_t tile = std::min(p, kTile);
  if (inverse) HadamardLevels(v, p, tile, p);
  for (size_t t = 0; t < p; t += tile) {
    if (!inverse) ThcSignScale(v + t, tile, sign_key, static_cast<uint32_t>(t), scale);
    HadamardTile(v + t, tile);
    if (inverse) ThcSignScale(v + t, tile, sign_key, static_cast<uint32_t>(t), scale);
  }
  if (!inverse) HadamardLevels(v, p, tile, p);
}

absl::Status ValidateRotated(absl::Span<float> values) {
  if (values.size() != ThcRotatedLength(values.size()) || values.size() > kMaxBucketElements) {
    return absl::InvalidArgumentError(absl::StrCat("thc: a rotated bucket has a power-of-two length >= ", kThcBlockSize,
                                                   " (TransformedLength), not ", values.size()));
  }
  return absl::OkStatus();
}

absl::Status NonFiniteLocal(const ChunkRef& chunk, size_t offset) {
  return absl::InvalidArgumentError(absl::StrCat("thc: local values of elements [", chunk.begin + offset, ", +256) are",
                                                 " Inf/NaN; THC cannot carry them"));
}

// A received chunk after header validation: how to read its codes.
struct Received {
  ChunkHeader header;
  int bits = 0;  // 4 (leaf table indices) or the sum width
  bool aggregated = false;
  const uint8_t* payload = nullptr;
};

// Parses and validates a received chunk: header fields and every code. Nothing is decoded before
// this passes.
absl::StatusOr<Received> ParseAndValidate(const CodecConfig& config, const BucketPlan& plan, const ChunkRef& chunk,
                                          absl::Span<const uint8_t> in) {
  DQ_RETURN_IF_ERROR(ValidatePlanAndChunk(plan, chunk));
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
  Received r;
  r.header = h;
  r.aggregated = (h.flags & kFlagAggregated) != 0;
  r.bits = r.aggregated ? ThcSumBits(plan.round.world_size) : kLeafBits;
  r.payload = in.data() + kChunkHeaderBytes;
  DQ_RETURN_IF_ERROR(ValidateChunkHeader(h, CodecId::kThc, plan, chunk, PayloadBytes(r.bits, chunk.count)));
  const uint8_t flags = FlagsFor(config, plan, r.aggregated);
  if (h.flags != flags) {
    return absl::InvalidArgumentError(absl::StrCat("thc: chunk ", chunk.chunk_id, " has flags 0x", absl::Hex(h.flags),
                                                   ", expected 0x", absl::Hex(flags)));
  }
  if (h.element_bits != r.bits) {
    return absl::InvalidArgumentError(absl::StrCat("thc: chunk ", chunk.chunk_id, " has ", h.element_bits,
                                                   "-bit codes, expected ", r.bits,
                                                   r.aggregated ? " for integer sums" : " for table indices"));
  }
  if (h.num_summands > plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("thc: chunk ", chunk.chunk_id, " claims ", h.num_summands,
                                                   " summands in a world of ", plan.round.world_size));
  }
  if (!r.aggregated && h.num_summands != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("thc: chunk ", chunk.chunk_id, " holds table indices but claims ", h.num_summands, " summands"));
  }
  if (h.param != plan.global_scale) {
    return absl::InvalidArgumentError(absl::StrCat("thc: chunk ", chunk.chunk_id, " was normalized by global norm ",
                                                   h.param, ", this round's plan has ", plan.global_scale));
  }
  if (r.aggregated) {
    // Every 4-bit index is a legal table index; sums must be reachable by num_summands indices.
    const uint32_t max_sum = static_cast<uint32_t>(h.num_summands) * kThcGranularity;
    const size_t coefficients = NumBlocks(chunk.count) * kThcBlockSize;
    for (size_t j = 0; j < coefficients; ++j) {
      const uint8_t* block = r.payload + (j / kThcBlockSize) * ThcBlockBytes(r.bits);
      uint32_t s = ThcUnpack(block, static_cast<int>(j % kThcBlockSize), r.bits);
      if (s > max_sum) {
        return absl::DataLossError(absl::StrCat("thc: chunk ", chunk.chunk_id, " coefficient ", j, " holds the sum ", s,
                                                ", more than ", h.num_summands, " x ", kThcGranularity));
      }
    }
  }
  return r;
}

// The integer sum carried by coefficient j of a received block.
uint32_t ReceivedSum(const ThcTable& table, const Received& r, const uint8_t* block, int j) {
  uint32_t code = ThcUnpack(block, j, r.bits);
  return r.aggregated ? code : static_cast<uint32_t>(table.value[code]);
}

// Decodes a validated chunk block by block, handing each block's real values to
// sink(offset in chunk, count, values).
template <typename Sink>
void DecodeChunk(const ThcTable& table, const CodecConfig& config, const BucketPlan& plan, const ChunkRef& chunk,
                 const Received& r, Sink sink) {
  const float from_z = FromZ(plan);
  float v[kThcBlockSize];
  for (size_t b = 0; b < NumBlocks(chunk.count); ++b) {
    const size_t offset = b * kThcBlockSize;
    const uint8_t* block = r.payload + b * ThcBlockBytes(r.bits);
    for (int j = 0; j < kThcBlockSize; ++j) {
      v[j] = ThcDequantize(ReceivedSum(table, r, block, j), r.header.num_summands, from_z);
    }
    sink(offset, std::min<size_t>(kThcBlockSize, chunk.count - offset), v);
  }
}

}  // namespace

std::unique_ptr<Codec> NewThcCodec(const CodecConfig& config) {
  if (config.bits != kLeafBits) return nullptr;
  return std::make_unique<ThcCodec>(config);
}

ThcCodec::ThcCodec(const CodecConfig& config) : Codec(WithThcId(config)) {
  DQ_CHECK(config.bits == kLeafBits);
  InitThcTable(&table_);
}

absl::StatusOr<size_t> ThcCodec::TransformedLength(size_t num_elements) const {
  if (num_elements > kMaxBucketElements / 2 + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("thc: bucket of ", num_elements, " elements is too large to rotate (at most 2^31)"));
  }
  return static_cast<size_t>(ThcRotatedLength(num_elements));
}

absl::Status ThcCodec::ForwardTransform(const RoundInfo& round, absl::Span<float> values) const {
  DQ_RETURN_IF_ERROR(ValidateRotated(values));
  if (values.empty()) return absl::OkStatus();
  Rotate(values.data(), values.size(), StreamKey(config().seed, round.round, kThcSignStream), /*inverse=*/false);
  return absl::OkStatus();
}

absl::Status ThcCodec::InverseTransform(const RoundInfo& round, absl::Span<float> values) const {
  DQ_RETURN_IF_ERROR(ValidateRotated(values));
  if (values.empty()) return absl::OkStatus();
  Rotate(values.data(), values.size(), StreamKey(config().seed, round.round, kThcSignStream), /*inverse=*/true);
  return absl::OkStatus();
}

std::string ThcCodec::Describe() const {
  return absl::StrCat("thc: RHT of the whole bucket (padded to 2^k) + 4-bit table g=", kThcGranularity,
                      " T=", kThcClamp,
                      ", integer sums at w = 8/12/16 bits (smallest with 2^w > 42 x world_size); 4 bits/coord first "
                      "hop, w after; no error feedback",
                      config().correlated_rounding ? ", correlated rounding" : "");
}

void ThcCodec::ComputeStats(const Source& local, size_t num_elements, float* stats) const {
  float tile[kThcBlockSize];
  double sum_sq = 0.0;  // double: a float sum of squares overflows for norms above ~1.8e19
  for (size_t i = 0; i < num_elements; i += kThcBlockSize) {
    const size_t count = std::min<size_t>(kThcBlockSize, num_elements - i);
    LoadSource(local, i, count, tile);
    for (size_t k = 0; k < count; ++k) sum_sq += static_cast<double>(tile[k]) * tile[k];
  }
  stats[0] = static_cast<float>(std::sqrt(sum_sq));
}

absl::StatusOr<BucketPlan> ThcCodec::MakePlan(const RoundInfo& round, size_t num_elements,
                                              absl::Span<const float> local_stats,
                                              absl::Span<const float> reduced_stats) const {
  DQ_RETURN_IF_ERROR(ValidateRound(round));
  if (reduced_stats.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("thc: expected 1 reduced statistic (the global norm), got ", reduced_stats.size()));
  }
  DQ_RETURN_IF_ERROR(ValidateGlobalScale(reduced_stats[0]));
  if (num_elements > kMaxBucketElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("thc: bucket of ", num_elements, " elements exceeds the limit ", kMaxBucketElements));
  }
  BucketPlan plan;
  plan.round = round;
  plan.num_elements = num_elements;
  plan.global_scale = reduced_stats[0];
  plan.scale_elements = num_elements;
  return plan;
}

size_t ThcCodec::MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const {
  const int sum_bits = ThcSumBits(plan.round.world_size);
  return kChunkHeaderBytes + PayloadBytes(std::max(kLeafBits, sum_bits == 0 ? 16 : sum_bits), chunk.count);
}

bool ThcCodec::QuantizeLocalBlock(const BucketPlan& plan, const Source& local, size_t block_start, int count,
                                  uint32_t* indices) const {
  float v[kThcBlockSize];
  LoadSource(local, block_start, count, v);
  for (int i = count; i < kThcBlockSize; ++i) v[i] = 0.0f;  // padding of a partial last block
  const CodecConfig& c = config();
  const uint32_t first = static_cast<uint32_t>(block_start);
  const float to_z = ToZ(plan);
  for (int i = 0; i < count; ++i) v[i] *= to_z;
  const bool correlated = Correlated(c, plan);
  const uint32_t n = plan.round.world_size;
  const uint32_t stratum = correlated ? StratumOf(StreamKey(c.seed, plan.round.round, kSharedStream),
                                                  first / kThcBlockSize, plan.round.rank, n)
                                      : 0;
  const uint32_t key = StreamKey(c.seed, plan.round.round, plan.round.rank);
  bool finite = true;
  for (int i = 0; i < kThcBlockSize; ++i) {
    float u = ThcRoundingUnit(key, first + static_cast<uint32_t>(i), correlated, stratum, n);
    finite = finite && std::isfinite(v[i]);
    indices[i] = ThcQuantize(table_, v[i], u);
  }
  return finite;
}

absl::StatusOr<size_t> ThcCodec::Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                          absl::Span<uint8_t> out) const {
  DQ_RETURN_IF_ERROR(ValidatePlanAndChunk(plan, chunk));
  const size_t payload_bytes = PayloadBytes(kLeafBits, chunk.count);
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  uint8_t* payload = out.data() + kChunkHeaderBytes;
  std::fill(payload, payload + payload_bytes, 0);
  uint32_t index[kThcBlockSize];
  for (size_t b = 0; b < NumBlocks(chunk.count); ++b) {
    const size_t offset = b * kThcBlockSize;
    const int count = static_cast<int>(std::min<size_t>(kThcBlockSize, chunk.count - offset));
    if (!QuantizeLocalBlock(plan, local, chunk.begin + offset, count, index)) return NonFiniteLocal(chunk, offset);
    uint8_t* block = payload + b * ThcBlockBytes(kLeafBits);
    for (int j = 0; j < kThcBlockSize; ++j) ThcPack(block, j, kLeafBits, index[j]);
  }
  ChunkHeader h;
  h.codec = CodecId::kThc;
  h.element_bits = kLeafBits;
  h.flags = FlagsFor(config(), plan, /*aggregated=*/false);
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = 1;
  h.payload_bytes = static_cast<uint32_t>(payload_bytes);
  h.param = plan.global_scale;
  WriteChunkHeader(h, out);
  return kChunkHeaderBytes + payload_bytes;
}

absl::Status ThcCodec::Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                  const Dest& out) const {
  DQ_ASSIGN_OR_RETURN(Received r, ParseAndValidate(config(), plan, chunk, in));
  DecodeChunk(table_, config(), plan, chunk, r,
              [&](size_t offset, size_t count, const float* v) { StoreDest(out, chunk.begin + offset, count, v); });
  return absl::OkStatus();
}

absl::Status ThcCodec::DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                            float* acc) const {
  DQ_ASSIGN_OR_RETURN(Received r, ParseAndValidate(config(), plan, chunk, in));
  DecodeChunk(table_, config(), plan, chunk, r, [&](size_t offset, size_t count, const float* v) {
    for (size_t k = 0; k < count; ++k) acc[offset + k] += v[k];
  });
  return absl::OkStatus();
}

absl::StatusOr<size_t> ThcCodec::DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                                absl::Span<const uint8_t> in, const Source& local,
                                                                absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(Received r, ParseAndValidate(config(), plan, chunk, in));
  if (r.header.num_summands >= plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("thc: chunk ", chunk.chunk_id, " already holds all ",
                                                   r.header.num_summands, " contributions; nothing left to add"));
  }
  const int w = ThcSumBits(plan.round.world_size);
  const size_t payload_bytes = PayloadBytes(w, chunk.count);
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  uint8_t* payload = out.data() + kChunkHeaderBytes;
  std::fill(payload, payload + payload_bytes, 0);
  uint32_t mine[kThcBlockSize];
  for (size_t b = 0; b < NumBlocks(chunk.count); ++b) {
    const size_t offset = b * kThcBlockSize;
    const int count = static_cast<int>(std::min<size_t>(kThcBlockSize, chunk.count - offset));
    if (!QuantizeLocalBlock(plan, local, chunk.begin + offset, count, mine)) return NonFiniteLocal(chunk, offset);
    const uint8_t* src = r.payload + b * ThcBlockBytes(r.bits);
    uint8_t* dst = payload + b * ThcBlockBytes(w);
    for (int j = 0; j < kThcBlockSize; ++j) {
      // Exact integer homomorphism: received sum + this rank's table value. Fits in w bits because
      // (num_summands + 1) * g <= world_size * g < 2^w.
      ThcPack(dst, j, w, ReceivedSum(table_, r, src, j) + static_cast<uint32_t>(table_.value[mine[j]]));
    }
  }
  ChunkHeader h = r.header;
  h.element_bits = static_cast<uint8_t>(w);
  h.flags = FlagsFor(config(), plan, /*aggregated=*/true);
  h.num_summands = static_cast<uint16_t>(r.header.num_summands + 1);
  h.payload_bytes = static_cast<uint32_t>(payload_bytes);
  WriteChunkHeader(h, out);
  return kChunkHeaderBytes + payload_bytes;
}

}  // namespace dynamiq::kernels

#include "kernels/cpu/arc_topk_codec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/arc_topk_math.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {
namespace {

static_assert(std::endian::native == std::endian::little, "fp32 values are copied as little-endian bytes");

constexpr size_t kRow = kArcTopKRow;
constexpr size_t kSketch = kArcTopKSketch;
// Bucket element indices key the projection signs as uint32.
constexpr size_t kMaxBucketElements = 0xffffff00u;

CodecConfig WithArcTopKId(CodecConfig config) {
  config.id = CodecId::kArcTopK;
  return config;
}

bool ValidDensity(double density) { return density >= kArcTopKMinDensity && density <= 1.0; }

size_t Rows(size_t n) { return (n + kRow - 1) / kRow; }

absl::Status ValidatePlanAndChunk(const BucketPlan& plan, const ChunkRef& chunk) {
  if (plan.round.world_size == 0 || plan.round.rank >= plan.round.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("arc_topk: rank ", plan.round.rank, " is not in a world of ", plan.round.world_size));
  }
  if (plan.num_elements > kMaxBucketElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("arc_topk: bucket of ", plan.num_elements, " elements exceeds the limit ", kMaxBucketElements));
  }
  if (plan.widths.size() != Rows(plan.num_elements)) {
    return absl::InvalidArgumentError(absl::StrCat("arc_topk: plan selects ", plan.widths.size(), " rows of a ",
                                                   Rows(plan.num_elements), "-row bucket"));
  }
  if ((chunk.count > 0 && chunk.begin % kRow != 0) || chunk.count > kMaxChunkElements ||
      chunk.begin + chunk.count > plan.num_elements) {
    return absl::InvalidArgumentError(absl::StrCat("arc_topk: chunk ", chunk.chunk_id, " [", chunk.begin, ", +",
                                                   chunk.count, ") is not a 256-aligned range of the ",
                                                   plan.num_elements, "-element bucket"));
  }
  return absl::OkStatus();
}

// fn(begin, count, kept) for the chunk's rows (clipped to the chunk), in index order.
template <typename Fn>
void ForEachRow(const BucketPlan& plan, const ChunkRef& chunk, Fn fn) {
  const size_t end = chunk.begin + chunk.count;
  for (size_t begin = chunk.begin; begin < end; begin += kRow) {
    fn(begin, std::min(kRow, end - begin), plan.widths[begin / kRow] != 0);
  }
}

size_t KeptElements(const BucketPlan& plan, const ChunkRef& chunk) {
  size_t kept = 0;
  ForEachRow(plan, chunk, [&](size_t, size_t count, bool k) { kept += k ? count : 0; });
  return kept;
}

absl::Status CheckOutputSize(absl::Span<uint8_t> out, size_t needed) {
  if (out.size() < needed) {
    return absl::InvalidArgumentError(
        absl::StrCat("arc_topk: output buffer holds ", out.size(), " bytes, the chunk needs ", needed));
  }
  return absl::OkStatus();
}

ChunkHeader HeaderFor(const BucketPlan& plan, const ChunkRef& chunk, double density, size_t payload_bytes) {
  ChunkHeader h;
  h.codec = CodecId::kArcTopK;
  h.element_bits = 32;
  h.flags = 0;
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = 1;
  h.payload_bytes = static_cast<uint32_t>(payload_bytes);
  h.param = static_cast<float>(density);
  return h;
}

absl::StatusOr<ChunkHeader> ParseAndValidate(const BucketPlan& plan, const ChunkRef& chunk, double density,
                                             absl::Span<const uint8_t> in) {
  DQ_RETURN_IF_ERROR(ValidatePlanAndChunk(plan, chunk));
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
  DQ_RETURN_IF_ERROR(ValidateChunkHeader(h, CodecId::kArcTopK, plan, chunk, 4 * KeptElements(plan, chunk)));
  if (h.element_bits != 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("arc_topk: chunk ", chunk.chunk_id, " has ", h.element_bits, "-bit values, expected 32"));
  }
  if (h.flags != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("arc_topk: chunk ", chunk.chunk_id, " has flags 0x", absl::Hex(h.flags), ", expected 0"));
  }
  if (h.param != static_cast<float>(density)) {
    return absl::InvalidArgumentError(absl::StrCat("arc_topk: chunk ", chunk.chunk_id, " was selected at density ",
                                                   h.param, ", this codec's is ", density));
  }
  if (h.num_summands > plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("arc_topk: chunk ", chunk.chunk_id, " claims ", h.num_summands,
                                                   " summands in a world of ", plan.round.world_size));
  }
  return h;
}

// Kept values of a validated chunk: fn(begin, count, values) per kept row, `values` pointing into
// the payload (unaligned fp32, copied out by the caller).
template <typename Fn>
void ForEachKeptPayload(const BucketPlan& plan, const ChunkRef& chunk, const uint8_t* payload, Fn fn) {
  size_t at = 0;
  ForEachRow(plan, chunk, [&](size_t begin, size_t count, bool kept) {
    if (!kept) return;
    float v[kRow];
    std::memcpy(v, payload + at, 4 * count);
    at += 4 * count;
    fn(begin, count, v);
  });
}

}  // namespace

std::unique_ptr<Codec> NewArcTopKCodec(const CodecConfig& config) {
  if (!ValidDensity(config.bits)) return nullptr;
  return std::make_unique<ArcTopKCodec>(config);
}

ArcTopKCodec::ArcTopKCodec(const CodecConfig& config) : Codec(WithArcTopKId(config)) {
  DQ_CHECK(ValidDensity(config.bits));
}

std::string ArcTopKCodec::Describe() const {
  return absl::StrCat("arc_topk: density ", density(), " of 256-element rows, chosen by all ranks from a ", kSketch,
                      "-direction sketch of the sum, fp32 values without indices; ", 32 * density(),
                      " bits/coord + 0.25 for the sketch");
}

size_t ArcTopKCodec::StatsLength(size_t num_elements) const { return kSketch * Rows(num_elements); }

void ArcTopKCodec::ComputeStats(const Source& local, size_t num_elements, float* stats) const {
  uint32_t keys[kSketch];
  for (size_t p = 0; p < kSketch; ++p) keys[p] = ArcTopKSignKey(config().seed, static_cast<int>(p));
  float v[kRow];
  for (size_t begin = 0; begin < num_elements; begin += kRow) {
    const size_t count = std::min(kRow, num_elements - begin);
    LoadSource(local, begin, count, v);
    double s[kSketch] = {0, 0, 0, 0};
    for (size_t j = 0; j < count; ++j) {
      // V[j][p]: one projection matrix for every row (statistics are computed in parts whose
      // element indices restart at 0, always at a row boundary).
      for (size_t p = 0; p < kSketch; ++p) {
        s[p] += static_cast<double>(v[j]) * ArcTopKSign(keys[p], static_cast<uint32_t>(j));
      }
    }
    for (size_t p = 0; p < kSketch; ++p) stats[kSketch * (begin / kRow) + p] = static_cast<float>(s[p]);
  }
}

absl::StatusOr<BucketPlan> ArcTopKCodec::MakePlan(const RoundInfo& round, size_t num_elements,
                                                  absl::Span<const float> local_stats,
                                                  absl::Span<const float> reduced_stats) const {
  if (round.world_size == 0 || round.rank >= round.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("arc_topk: rank ", round.rank, " is not in a world of ", round.world_size));
  }
  if (num_elements > kMaxBucketElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("arc_topk: bucket of ", num_elements, " elements exceeds the limit ", kMaxBucketElements));
  }
  const size_t rows = Rows(num_elements);
  if (reduced_stats.size() != kSketch * rows) {
    return absl::InvalidArgumentError(absl::StrCat("arc_topk: expected ", kSketch * rows,
                                                   " reduced statistics (the sketch), got ", reduced_stats.size()));
  }
  std::vector<double> score(rows);
  for (size_t g = 0; g < rows; ++g) {
    double s = 0;
    for (size_t p = 0; p < kSketch; ++p) {
      const double v = reduced_stats[kSketch * g + p];
      s += v * v;
    }
    if (!std::isfinite(s)) {
      return absl::InvalidArgumentError(
          absl::StrCat("arc_topk: the sketch of row ", g, " is not finite (Inf/NaN gradients?)"));
    }
    score[g] = s;
  }
  std::vector<uint32_t> order(rows);
  std::iota(order.begin(), order.end(), 0u);
  const size_t kept = ArcTopKKeptRows(rows, density());
  // A strict total order (score descending, then row ascending): the same set on every rank.
  const auto before = [&](uint32_t a, uint32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  if (kept < rows) std::nth_element(order.begin(), order.begin() + kept, order.end(), before);
  BucketPlan plan;
  plan.round = round;
  plan.num_elements = num_elements;
  plan.widths.assign(rows, 0);
  for (size_t i = 0; i < kept; ++i) plan.widths[order[i]] = 1;
  return plan;
}

size_t ArcTopKCodec::MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const {
  if (!ValidatePlanAndChunk(plan, chunk).ok()) return kChunkHeaderBytes + 4 * chunk.count;
  return kChunkHeaderBytes + 4 * KeptElements(plan, chunk);
}

absl::StatusOr<size_t> ArcTopKCodec::Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                              absl::Span<uint8_t> out) const {
  DQ_RETURN_IF_ERROR(ValidatePlanAndChunk(plan, chunk));
  const size_t payload_bytes = 4 * KeptElements(plan, chunk);
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  uint8_t* payload = out.data() + kChunkHeaderBytes;
  size_t at = 0;
  ForEachRow(plan, chunk, [&](size_t begin, size_t count, bool kept) {
    if (!kept) return;
    float v[kRow];
    LoadSource(local, begin, count, v);
    std::memcpy(payload + at, v, 4 * count);
    at += 4 * count;
  });
  WriteChunkHeader(HeaderFor(plan, chunk, density(), payload_bytes), out);
  return kChunkHeaderBytes + payload_bytes;
}

absl::Status ArcTopKCodec::Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                      const Dest& out) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(plan, chunk, density(), in).status());
  static constexpr float kZeros[kRow] = {};
  size_t at = 0;
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  ForEachRow(plan, chunk, [&](size_t begin, size_t count, bool kept) {
    if (!kept) {
      StoreDest(out, begin, count, kZeros);
      return;
    }
    float v[kRow];
    std::memcpy(v, payload + at, 4 * count);
    at += 4 * count;
    StoreDest(out, begin, count, v);
  });
  return absl::OkStatus();
}

absl::Status ArcTopKCodec::DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk,
                                                absl::Span<const uint8_t> in, float* acc) const {
  DQ_RETURN_IF_ERROR(ParseAndValidate(plan, chunk, density(), in).status());
  ForEachKeptPayload(plan, chunk, in.data() + kChunkHeaderBytes, [&](size_t begin, size_t count, const float* v) {
    float* a = acc + (begin - chunk.begin);
    for (size_t k = 0; k < count; ++k) a[k] += v[k];
  });
  return absl::OkStatus();
}

absl::StatusOr<size_t> ArcTopKCodec::DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                                    absl::Span<const uint8_t> in, const Source& local,
                                                                    absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseAndValidate(plan, chunk, density(), in));
  if (h.num_summands >= plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("arc_topk: chunk ", chunk.chunk_id, " already holds all ",
                                                   h.num_summands, " contributions; nothing left to add"));
  }
  const size_t payload_bytes = h.payload_bytes;
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  uint8_t* dst = out.data() + kChunkHeaderBytes;
  size_t at = 0;
  ForEachKeptPayload(plan, chunk, in.data() + kChunkHeaderBytes, [&](size_t begin, size_t count, const float* v) {
    float mine[kRow];
    LoadSource(local, begin, count, mine);
    for (size_t k = 0; k < count; ++k) mine[k] = v[k] + mine[k];
    std::memcpy(dst + at, mine, 4 * count);
    at += 4 * count;
  });
  h.num_summands = static_cast<uint16_t>(h.num_summands + 1);
  WriteChunkHeader(h, out);
  return kChunkHeaderBytes + payload_bytes;
}

}  // namespace dynamiq::kernels

#include "kernels/cpu/global_qsgd_codec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/global_qsgd_math.h"
#include "kernels/random_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {
namespace {

// Bucket element indices key the random streams as uint32.
constexpr size_t kMaxBucketElements = 0xffffff00u;
constexpr size_t kTile = 256;

CodecConfig WithGlobalQsgdId(CodecConfig config) {
  config.id = CodecId::kGlobalQsgd;
  return config;
}

bool ValidBits(double bits) {
  return bits >= kGlobalQsgdMinBits && bits <= kGlobalQsgdMaxBits && bits == std::floor(bits);
}

bool Correlated(const CodecConfig& config, const BucketPlan& plan) {
  return config.correlated_rounding && plan.round.world_size > 1;
}

uint8_t FlagsFor(const CodecConfig& config, const BucketPlan& plan) {
  return Correlated(config, plan) ? kFlagCorrelated : 0;
}

absl::Status ValidateRound(const RoundInfo& round) {
  if (round.world_size == 0 || round.rank >= round.world_size || round.world_size > 0xffffu) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_qsgd: rank ", round.rank, " is not in a world of ", round.world_size,
                     " (at most 65535 ranks: sums carry their summand count in 16 bits)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateGlobalScale(float m) {
  if (!std::isfinite(m) || m < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_qsgd: global scale ", m, " is not a finite non-negative number (Inf/NaN gradients?)"));
  }
  return absl::OkStatus();
}

absl::Status ValidatePlanAndChunk(const BucketPlan& plan, const ChunkRef& chunk) {
  DQ_RETURN_IF_ERROR(ValidateRound(plan.round));
  DQ_RETURN_IF_ERROR(ValidateGlobalScale(plan.global_scale));
  if (plan.num_elements > kMaxBucketElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_qsgd: bucket of ", plan.num_elements, " elements exceeds the limit ", kMaxBucketElements));
  }
  if (chunk.count > kMaxChunkElements || chunk.begin + chunk.count > plan.num_elements) {
    return absl::InvalidArgumentError(absl::StrCat("global_qsgd: chunk ", chunk.chunk_id, " [", chunk.begin, ", +",
                                                   chunk.count, ") is not inside the ", plan.num_elements,
                                                   "-element bucket"));
  }
  return absl::OkStatus();
}

absl::Status CheckOutputSize(absl::Span<uint8_t> out, size_t needed) {
  if (out.size() < needed) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_qsgd: output buffer holds ", out.size(), " bytes, the chunk needs ", needed));
  }
  return absl::OkStatus();
}

// s / M, into level units; capped so that a tiny M cannot make 0 * Inf; 0 when M = 0.
float ToUnit(const BucketPlan& plan, uint32_t levels) {
  if (!(plan.global_scale > 0.0f)) return 0.0f;
  const double f = static_cast<double>(levels) / plan.global_scale;
  return static_cast<float>(std::min(f, static_cast<double>(FLT_MAX)));
}

// M / s, one level's value.
float Unit(const BucketPlan& plan, uint32_t levels) {
  return static_cast<float>(static_cast<double>(plan.global_scale) / levels);
}

struct Received {
  ChunkHeader header;
  int bits = 0;
  const uint8_t* payload = nullptr;
};

absl::StatusOr<Received> ParseAndValidate(const CodecConfig& config, uint32_t levels, const BucketPlan& plan,
                                          const ChunkRef& chunk, absl::Span<const uint8_t> in) {
  DQ_RETURN_IF_ERROR(ValidatePlanAndChunk(plan, chunk));
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
  if (h.num_summands > plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("global_qsgd: chunk ", chunk.chunk_id, " claims ", h.num_summands,
                                                   " summands in a world of ", plan.round.world_size));
  }
  Received r;
  r.header = h;
  r.bits = GlobalQsgdSumBits(h.num_summands, levels);
  r.payload = in.data() + kChunkHeaderBytes;
  DQ_RETURN_IF_ERROR(
      ValidateChunkHeader(h, CodecId::kGlobalQsgd, plan, chunk, GlobalQsgdPackedBytes(chunk.count, r.bits)));
  if (h.element_bits != r.bits) {
    return absl::InvalidArgumentError(absl::StrCat("global_qsgd: chunk ", chunk.chunk_id, " has ", h.element_bits,
                                                   "-bit codes, expected ", r.bits, " for ", h.num_summands,
                                                   " summands of ", levels, " levels"));
  }
  const uint8_t flags = FlagsFor(config, plan);
  if (h.flags != flags) {
    return absl::InvalidArgumentError(absl::StrCat("global_qsgd: chunk ", chunk.chunk_id, " has flags 0x",
                                                   absl::Hex(h.flags), ", expected 0x", absl::Hex(flags)));
  }
  if (!(h.param == plan.global_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("global_qsgd: chunk ", chunk.chunk_id, " was quantized against ",
                                                   h.param, ", this round's global scale is ", plan.global_scale));
  }
  const uint32_t max_stored = 2u * h.num_summands * levels;
  GlobalQsgdBitReader reader(r.payload);
  for (size_t j = 0; j < chunk.count; ++j) {
    const uint32_t v = reader.Next(r.bits);
    if (v > max_stored) {
      return absl::DataLossError(absl::StrCat("global_qsgd: chunk ", chunk.chunk_id, " element ", j, " holds ", v,
                                              ", more than 2 x ", h.num_summands, " x ", levels));
    }
  }
  return r;
}

// Decodes a validated chunk tile by tile: sink(offset, count, values).
template <typename Sink>
void DecodeChunk(uint32_t levels, const BucketPlan& plan, const ChunkRef& chunk, const Received& r, Sink sink) {
  const float unit = Unit(plan, levels);
  const int32_t offset_code = static_cast<int32_t>(r.header.num_summands * levels);
  float v[kTile];
  GlobalQsgdBitReader reader(r.payload);
  for (size_t offset = 0; offset < chunk.count; offset += kTile) {
    const size_t count = std::min(kTile, chunk.count - offset);
    for (size_t k = 0; k < count; ++k) {
      const int32_t q = static_cast<int32_t>(reader.Next(r.bits)) - offset_code;
      v[k] = GlobalQsgdDecode(q, unit);
    }
    sink(offset, count, v);
  }
}

absl::Status NonFiniteLocal(const ChunkRef& chunk) {
  return absl::InvalidArgumentError(absl::StrCat("global_qsgd: local values of chunk ", chunk.chunk_id, " [",
                                                 chunk.begin, ", +", chunk.count,
                                                 ") hold Inf/NaN; Global-QSGD cannot carry them"));
}

}  // namespace

std::unique_ptr<Codec> NewGlobalQsgdCodec(const CodecConfig& config) {
  if (!ValidBits(config.bits)) return nullptr;
  return std::make_unique<GlobalQsgdCodec>(config);
}

GlobalQsgdCodec::GlobalQsgdCodec(const CodecConfig& config)
    : Codec(WithGlobalQsgdId(config)),
      bits_(static_cast<int>(config.bits)),
      levels_(GlobalQsgdLevels(static_cast<int>(config.bits))) {
  DQ_CHECK(ValidBits(config.bits));
}

std::string GlobalQsgdCodec::Describe() const {
  return absl::StrCat("global_qsgd: ", bits_, "-bit stochastic codes, ", levels_,
                      " levels per sign against the global max |x|, integer sums along the ring at bit_width(2 k ",
                      levels_, ") bits for k summands; no error feedback",
                      config().correlated_rounding ? ", correlated rounding" : "");
}

void GlobalQsgdCodec::ComputeStats(const Source& local, size_t num_elements, float* stats) const {
  float tile[kTile];
  float m = 0.0f;
  bool finite = true;
  for (size_t i = 0; i < num_elements; i += kTile) {
    const size_t count = std::min(kTile, num_elements - i);
    LoadSource(local, i, count, tile);
    for (size_t k = 0; k < count; ++k) {
      finite = finite && std::isfinite(tile[k]);
      m = std::max(m, std::fabs(tile[k]));
    }
  }
  // A NaN would vanish in std::max: report it so that MakePlan refuses the round on every rank.
  stats[0] = finite ? m : std::numeric_limits<float>::infinity();
}

absl::StatusOr<BucketPlan> GlobalQsgdCodec::MakePlan(const RoundInfo& round, size_t num_elements,
                                                     absl::Span<const float> local_stats,
                                                     absl::Span<const float> reduced_stats) const {
  DQ_RETURN_IF_ERROR(ValidateRound(round));
  if (reduced_stats.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_qsgd: expected 1 reduced statistic (the global max |x|), got ", reduced_stats.size()));
  }
  DQ_RETURN_IF_ERROR(ValidateGlobalScale(reduced_stats[0]));
  if (num_elements > kMaxBucketElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_qsgd: bucket of ", num_elements, " elements exceeds the limit ", kMaxBucketElements));
  }
  BucketPlan plan;
  plan.round = round;
  plan.num_elements = num_elements;
  plan.global_scale = reduced_stats[0];
  return plan;
}

size_t GlobalQsgdCodec::MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const {
  const uint32_t world = std::clamp<uint32_t>(plan.round.world_size, 1, 0xffffu);
  return kChunkHeaderBytes + GlobalQsgdPackedBytes(chunk.count, GlobalQsgdSumBits(world, levels_));
}

bool GlobalQsgdCodec::QuantizeLocal(const BucketPlan& plan, const Source& local, size_t begin, size_t count,
                                    int32_t* q) const {
  float v[kTile];
  const CodecConfig& c = config();
  const float to_unit = ToUnit(plan, levels_);
  const bool correlated = Correlated(c, plan);
  const uint32_t n = plan.round.world_size;
  const uint32_t key = StreamKey(c.seed, plan.round.round, plan.round.rank);
  const uint32_t shared = StreamKey(c.seed, plan.round.round, kSharedStream);
  bool finite = true;
  uint32_t stratum_group = 0xffffffffu, stratum = 0;  // StratumOf is O(n): once per super-group
  for (size_t offset = 0; offset < count; offset += kTile) {
    const size_t m = std::min(kTile, count - offset);
    LoadSource(local, begin + offset, m, v);
    for (size_t k = 0; k < m; ++k) {
      const uint32_t index = static_cast<uint32_t>(begin + offset + k);
      float u = BitsToUnit(RandomBits(key, index));
      if (correlated) {
        const uint32_t group = index / kTile;
        if (group != stratum_group) {
          stratum_group = group;
          stratum = StratumOf(shared, group, plan.round.rank, n);
        }
        u = CorrelatedUnit(stratum, n, u);
      }
      finite = finite && std::isfinite(v[k]);
      q[offset + k] = finite ? GlobalQsgdQuantize(v[k], to_unit, levels_, u) : 0;
    }
  }
  return finite;
}

absl::StatusOr<size_t> GlobalQsgdCodec::Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                                 absl::Span<uint8_t> out) const {
  DQ_RETURN_IF_ERROR(ValidatePlanAndChunk(plan, chunk));
  const size_t payload_bytes = GlobalQsgdPackedBytes(chunk.count, bits_);
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  GlobalQsgdBitWriter writer(out.data() + kChunkHeaderBytes);
  int32_t q[kTile];
  for (size_t offset = 0; offset < chunk.count; offset += kTile) {
    const size_t count = std::min(kTile, chunk.count - offset);
    if (!QuantizeLocal(plan, local, chunk.begin + offset, count, q)) return NonFiniteLocal(chunk);
    for (size_t k = 0; k < count; ++k) writer.Put(static_cast<uint32_t>(q[k] + static_cast<int32_t>(levels_)), bits_);
  }
  writer.Flush();
  ChunkHeader h;
  h.codec = CodecId::kGlobalQsgd;
  h.element_bits = static_cast<uint8_t>(bits_);
  h.flags = FlagsFor(config(), plan);
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = 1;
  h.payload_bytes = static_cast<uint32_t>(payload_bytes);
  h.param = plan.global_scale;
  WriteChunkHeader(h, out);
  return kChunkHeaderBytes + payload_bytes;
}

absl::Status GlobalQsgdCodec::Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                         const Dest& out) const {
  DQ_ASSIGN_OR_RETURN(Received r, ParseAndValidate(config(), levels_, plan, chunk, in));
  DecodeChunk(levels_, plan, chunk, r,
              [&](size_t offset, size_t count, const float* v) { StoreDest(out, chunk.begin + offset, count, v); });
  return absl::OkStatus();
}

absl::Status GlobalQsgdCodec::DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk,
                                                   absl::Span<const uint8_t> in, float* acc) const {
  DQ_ASSIGN_OR_RETURN(Received r, ParseAndValidate(config(), levels_, plan, chunk, in));
  DecodeChunk(levels_, plan, chunk, r, [&](size_t offset, size_t count, const float* v) {
    for (size_t k = 0; k < count; ++k) acc[offset + k] += v[k];
  });
  return absl::OkStatus();
}

absl::StatusOr<size_t> GlobalQsgdCodec::DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                                       absl::Span<const uint8_t> in,
                                                                       const Source& local,
                                                                       absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(Received r, ParseAndValidate(config(), levels_, plan, chunk, in));
  const uint32_t k = r.header.num_summands;
  if (k >= plan.round.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("global_qsgd: chunk ", chunk.chunk_id, " already holds all ", k,
                                                   " contributions; nothing left to add"));
  }
  const int w = GlobalQsgdSumBits(k + 1, levels_);
  const size_t payload_bytes = GlobalQsgdPackedBytes(chunk.count, w);
  DQ_RETURN_IF_ERROR(CheckOutputSize(out, kChunkHeaderBytes + payload_bytes));
  GlobalQsgdBitReader reader(r.payload);
  GlobalQsgdBitWriter writer(out.data() + kChunkHeaderBytes);
  int32_t q[kTile];
  for (size_t offset = 0; offset < chunk.count; offset += kTile) {
    const size_t count = std::min(kTile, chunk.count - offset);
    if (!QuantizeLocal(plan, local, chunk.begin + offset, count, q)) return NonFiniteLocal(chunk);
    for (size_t j = 0; j < count; ++j) {
      // stored_in = Q + k s; stored_out = Q + q + (k + 1) s, in [0, 2 (k + 1) s] < 2^w.
      const uint32_t stored = reader.Next(r.bits);
      writer.Put(static_cast<uint32_t>(static_cast<int32_t>(stored) + q[j]) + levels_, w);
    }
  }
  writer.Flush();
  ChunkHeader h = r.header;
  h.element_bits = static_cast<uint8_t>(w);
  h.num_summands = static_cast<uint16_t>(k + 1);
  h.payload_bytes = static_cast<uint32_t>(payload_bytes);
  WriteChunkHeader(h, out);
  return kChunkHeaderBytes + payload_bytes;
}

}  // namespace dynamiq::kernels

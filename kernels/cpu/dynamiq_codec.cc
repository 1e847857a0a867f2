#include "kernels/cpu/dynamiq_codec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_info.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/cpu/dynamiq_simd.h"
#include "kernels/dynamiq_levels.h"
#include "kernels/random_math.h"
#include "kernels/wire_format.h"

namespace dynamiq::kernels {
namespace {

size_t NumSuperGroups(size_t n) { return (n + kSuperGroupSize - 1) / kSuperGroupSize; }

int CountInSg(const ChunkRef& chunk, size_t j) {
  return static_cast<int>(std::min<size_t>(kSuperGroupSize, chunk.count - j * kSuperGroupSize));
}

size_t MapBytes(size_t num_sg) { return (num_sg + 1) / 2; }
int MapWidth(const uint8_t* map, size_t j) { return (map[j / 2] >> (4 * (j % 2))) & 15; }

// fn(first, last) over ranges covering super-groups [0, n): split across `pool` (if any) in ranges of at
// least DynamiqCodec::kMinSuperGroupsPerThread.
void ForSuperGroups(common::ThreadPool* pool, size_t n, absl::FunctionRef<void(size_t, size_t)> fn) {
  if (pool != nullptr) {
    pool->ParallelFor(n, DynamiqCodec::kMinSuperGroupsPerThread, fn);
  } else if (n > 0) {
    fn(0, n);
  }
}

// Bytes of the chunk's super-groups [0, j), j < the chunk's super-groups (widths from the plan, starting at
// super-group first_sg). They are all full: only a chunk's last super-group may be shorter.
size_t SuperGroupsBytes(const BucketPlan& plan, size_t first_sg, size_t j) {
  size_t full[kMaxWidth + 1];
  for (int w = 0; w <= kMaxWidth; ++w) full[w] = SuperGroupBytes(w, kSuperGroupSize);
  size_t bytes = 0;
  for (size_t i = 0; i < j; ++i) bytes += full[plan.widths[first_sg + i]];
  return bytes;
}

// Standard normal samples from the counter-based generator (Box-Muller), for error calibration.
float Gaussian(uint32_t key, uint32_t i) {
  double u1 = (RandomBits(key, 2 * i) + 0.5) / 4294967296.0;
  double u2 = (RandomBits(key, 2 * i + 1) + 0.5) / 4294967296.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// Relative squared error of one quantization with `table` on Gaussian super-groups.
double MeasureError(const LevelTable& table) {
  constexpr int kSgs = 64;
  std::vector<float> x(kSuperGroupSize), y(kSuperGroupSize);
  std::vector<uint8_t> sg(SuperGroupBytes(8, kSuperGroupSize));
  double err = 0, norm = 0;
  for (int s = 0; s < kSgs; ++s) {
    for (int k = 0; k < kSuperGroupSize; ++k) x[k] = Gaussian(0x51a7u, s * kSuperGroupSize + k);
    EncodeSuperGroup(table, x.data(), kSuperGroupSize, StreamKey(1, s, 0), 0, false, 0, 1, sg.data());
    DecodeSuperGroup(table, sg.data(), kSuperGroupSize, y.data());
    for (int k = 0; k < kSuperGroupSize; ++k) {
      err += double(y[k] - x[k]) * (y[k] - x[k]);
      norm += double(x[k]) * x[k];
    }
  }
  return err / norm;
}

}  // namespace

struct DynamiqCodec::Layout {
  size_t first_sg = 0;
  size_t num_sg = 0;
  size_t map_bytes = 0;
  size_t payload_bytes = 0;
};

DynamiqCodec::DynamiqCodec(const CodecConfig& config, Kernel kernel) : Codec(config), kernel_(kernel) {
  errors_.fill(0.0);
  for (int w = kMinWidth; w <= kMaxWidth; ++w) {
    const double eps = DefaultMeeEpsilon(w);
    if (config.levels == LevelKind::kAuto) {
      // Measurement decides per width (Gaussian groups): MEE wins at 3-4 bits, uniform above.
      const LevelTable mee = BuildLevelTable(w, LevelKind::kMee, eps);
      const LevelTable uniform = BuildLevelTable(w, LevelKind::kUniform, eps);
      const double e_mee = MeasureError(mee), e_uniform = MeasureError(uniform);
      tables_[w] = e_uniform < e_mee ? uniform : mee;
      errors_[w] = std::min(e_mee, e_uniform);
    } else {
      tables_[w] = BuildLevelTable(w, config.levels, eps);
      errors_[w] = MeasureError(tables_[w]);
    }
  }
  if (kernel_ == Kernel::kSimd) {
    simd_tables_.resize(kMaxWidth + 1);
    for (int w = kMinWidth; w <= kMaxWidth; ++w) simd_tables_[w] = PrepareSimdTable(tables_[w]);
  }
}

std::string DynamiqCodec::Describe() const {
  return absl::StrFormat(
      "dynamiq: %.3g bits/coord on average incl. all metadata (2..8-bit codes per 256-element super-group, "
      "u8 scale per 16, bf16 super unit, 4-bit width map, 32 bits of bf16 stats per super-group), %s levels, "
      "%s allocator, %s rounding",
      config().bits, UniformMask() == 0 ? "MEE" : absl::StrCat("MEE/uniform (mask 0x", absl::Hex(UniformMask()), ")"),
      config().allocator == BitAllocator::kMeasured ? "measured-error" : "paper",
      config().correlated_rounding ? "correlated" : "independent");
}

uint8_t DynamiqCodec::Flags() const { return config().correlated_rounding ? kFlagCorrelated : 0; }

uint8_t DynamiqCodec::UniformMask() const {
  uint8_t mask = 0;
  for (int w = kMinWidth; w <= kMaxWidth; ++w) mask = static_cast<uint8_t>(mask | (tables_[w].uniform << (w - 2)));
  return mask;
}

size_t DynamiqCodec::StatsLength(size_t num_elements) const { return 2 * NumSuperGroups(num_elements); }

void DynamiqCodec::ComputeStats(const Source& local, size_t num_elements, float* stats) const {
  ComputeStatsOn(nullptr, local, num_elements, stats);
}

void DynamiqCodec::ComputeStatsOn(common::ThreadPool* pool, const Source& local, size_t num_elements,
                                  float* stats) const {
  Source raw = local;
  raw.subtract_per_group = nullptr;
  ForSuperGroups(pool, NumSuperGroups(num_elements),
                 [&](size_t first, size_t last) { StatsRange(raw, num_elements, first, last, stats); });
}

void DynamiqCodec::StatsRange(const Source& raw, size_t num_elements, size_t first, size_t last, float* stats) const {
  size_t j = first;
  if (kernel_ == Kernel::kSimd && raw.dtype == DType::kFloat32 && raw.first == 0) {
    // fp32 is read in place; the SIMD kernel sums in SuperGroupMoments' order.
    const size_t full = std::min(last, num_elements / kSuperGroupSize);
    if (full > first) {
      ComputeStatsSimd(static_cast<const float*>(raw.data) + first * kSuperGroupSize, full - first, stats + 2 * first);
      j = full;
    }
  }
  float tile[kSuperGroupSize];
  for (; j < last; ++j) {
    const size_t begin = j * kSuperGroupSize;
    const int count = static_cast<int>(std::min<size_t>(kSuperGroupSize, num_elements - begin));
    LoadSource(raw, begin, count, tile);
    double sum = 0, sum_sq = 0;
    SuperGroupMoments(tile, count, &sum, &sum_sq);
    SuperGroupStats(sum, sum_sq, count, stats + 2 * j);
  }
}

absl::StatusOr<BucketPlan> DynamiqCodec::MakePlan(const RoundInfo& round, size_t num_elements,
                                                  absl::Span<const float> local_stats,
                                                  absl::Span<const float> reduced_stats) const {
  const size_t m = NumSuperGroups(num_elements);
  if (local_stats.size() != 2 * m || reduced_stats.size() != 2 * m) {
    return absl::InvalidArgumentError(absl::StrCat("dynamiq stats for ", num_elements, " elements need ", 2 * m,
                                                   " floats, got ", local_stats.size(), " local and ",
                                                   reduced_stats.size(), " reduced"));
  }
  if (num_elements > (size_t{1} << 40)) return absl::InvalidArgumentError("bucket too large");
  const double bits = round.bits != 0 ? round.bits : config().bits;
  if (round.bits != 0) DQ_RETURN_IF_ERROR(CheckCodecBits(CodecId::kDynamiq, round.bits));
  BucketPlan plan;
  plan.round = round;
  plan.num_elements = num_elements;
  plan.local_means.resize(m);
  plan.mean_sums.resize(m);
  const float n = static_cast<float>(round.world_size);
  for (size_t j = 0; j < m; ++j) {
    // Every rank subtracts the same bf16 value; n times it is exact in fp32 (8 + 16 mantissa
    // bits), so adding it back restores exactly what all ranks together subtracted.
    float mean = Bf16ToFloat(FloatToBf16(reduced_stats[2 * j] / n));
    if (!std::isfinite(mean) || !std::isfinite(mean * n)) mean = 0.0f;
    plan.local_means[j] = mean;
    plan.mean_sums[j] = mean * n;
  }
  plan.widths =
      AllocateWidths(EnergiesFromStats(reduced_stats), num_elements, bits, config().allocator, errors_).widths;
  return plan;
}

absl::StatusOr<DynamiqCodec::Layout> DynamiqCodec::ChunkLayout(const BucketPlan& plan, const ChunkRef& chunk) const {
  // Empty chunks (small buckets on many ranks) may start anywhere, e.g. at the bucket's end.
  if (plan.widths.size() != NumSuperGroups(plan.num_elements) ||
      (chunk.count > 0 && chunk.begin % kSuperGroupSize != 0) || chunk.begin > plan.num_elements ||
      chunk.count > plan.num_elements - chunk.begin || chunk.count > kMaxChunkElements) {
    return absl::InvalidArgumentError(absl::StrCat("chunk [", chunk.begin, ", +", chunk.count,
                                                   ") does not fit the dynamiq plan of ", plan.num_elements,
                                                   " elements / ", plan.widths.size(), " super-groups"));
  }
  Layout l;
  l.first_sg = chunk.begin / kSuperGroupSize;
  l.num_sg = NumSuperGroups(chunk.count);
  l.map_bytes = MapBytes(l.num_sg);
  l.payload_bytes = l.map_bytes;
  for (size_t j = 0; j < l.num_sg; ++j) {
    l.payload_bytes += SuperGroupBytes(plan.widths[l.first_sg + j], CountInSg(chunk, j));
  }
  return l;
}

size_t DynamiqCodec::MaxEncodedBytes(const BucketPlan& plan, const ChunkRef& chunk) const {
  auto layout = ChunkLayout(plan, chunk);
  return kChunkHeaderBytes + (layout.ok() ? layout->payload_bytes : 0);
}

void DynamiqCodec::DecodeSg(int width, const uint8_t* sg, int count, float* out, bool add) const {
  if (kernel_ == Kernel::kSimd && count == kSuperGroupSize) {
    add ? DecodeAddSuperGroupSimd(simd_tables_[width], sg, out) : DecodeSuperGroupSimd(simd_tables_[width], sg, out);
    return;
  }
  float tmp[kSuperGroupSize];
  DecodeSuperGroup(tables_[width], sg, count, add ? tmp : out);
  if (add) {
    for (int k = 0; k < count; ++k) out[k] = out[k] + tmp[k];
  }
}

absl::StatusOr<const uint8_t*> DynamiqCodec::CheckInput(common::ThreadPool* pool, const BucketPlan& plan,
                                                        const ChunkRef& chunk, const Layout& layout,
                                                        absl::Span<const uint8_t> in, uint16_t* summands) const {
  DQ_ASSIGN_OR_RETURN(ChunkHeader h, ParseChunkHeader(in));
  DQ_RETURN_IF_ERROR(ValidateChunkHeader(h, CodecId::kDynamiq, plan, chunk, layout.payload_bytes));
  if (h.element_bits != UniformMask()) {
    return absl::InvalidArgumentError(absl::StrCat("dynamiq chunk uses uniform levels at widths mask 0x",
                                                   absl::Hex(h.element_bits), ", expected 0x", absl::Hex(UniformMask()),
                                                   " (ranks disagree on level settings)"));
  }
  if (h.flags != Flags()) {
    return absl::InvalidArgumentError(absl::StrCat("dynamiq chunk flags 0x", absl::Hex(h.flags), ", expected 0x",
                                                   absl::Hex(Flags()),
                                                   " (ranks disagree on rounding or level settings)"));
  }
  const uint8_t* payload = in.data() + kChunkHeaderBytes;
  // The error is the first super-group's, in order, with a wrong width or malformed codes: the
  // widths first (the codes of super-groups past a wrong width are not where the plan puts them),
  // then the codes before the first wrong width, range by range.
  size_t wrong_width = layout.num_sg;
  for (size_t j = 0; j < layout.num_sg && wrong_width == layout.num_sg; ++j) {
    if (MapWidth(payload, j) != plan.widths[layout.first_sg + j]) wrong_width = j;
  }
  std::atomic<size_t> malformed{wrong_width};
  ForSuperGroups(pool, wrong_width, [&](size_t first, size_t last) {
    const uint8_t* sg = payload + layout.map_bytes + SuperGroupsBytes(plan, layout.first_sg, first);
    for (size_t j = first; j < last; ++j) {
      const int w = plan.widths[layout.first_sg + j];
      const int count = CountInSg(chunk, j);
      const bool simd = kernel_ == Kernel::kSimd && count == kSuperGroupSize;
      if (w != 0 && !(simd ? ValidateSuperGroupSimd(simd_tables_[w], sg) : ValidateSuperGroup(tables_[w], sg, count))) {
        size_t seen = malformed.load();
        while (j < seen && !malformed.compare_exchange_weak(seen, j)) {
        }
        return;
      }
      sg += SuperGroupBytes(w, count);
    }
  });
  if (const size_t j = malformed.load(); j < wrong_width) {
    return absl::InvalidArgumentError(absl::StrCat("super-group ", layout.first_sg + j,
                                                   " is malformed (illegal code, zero group scale or bad super "
                                                   "unit)"));
  }
  if (wrong_width < layout.num_sg) {
    return absl::InvalidArgumentError(absl::StrCat("super-group ", layout.first_sg + wrong_width, " arrived with ",
                                                   MapWidth(payload, wrong_width), "-bit codes, the plan says ",
                                                   static_cast<int>(plan.widths[layout.first_sg + wrong_width]),
                                                   " (ranks disagree on the bit allocation)"));
  }
  *summands = h.num_summands;
  return payload;
}

absl::StatusOr<size_t> DynamiqCodec::Encode(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                            const Layout& layout, uint16_t summands, const Source& local,
                                            const uint8_t* received, absl::Span<uint8_t> out) const {
  const size_t total = kChunkHeaderBytes + layout.payload_bytes;
  if (out.size() < total) {
    return absl::InvalidArgumentError(absl::StrCat("output buffer of ", out.size(), " bytes, need ", total));
  }
  ChunkHeader h;
  h.codec = CodecId::kDynamiq;
  h.element_bits = UniformMask();
  h.flags = Flags();
  h.num_elements = static_cast<uint32_t>(chunk.count);
  h.chunk_id = chunk.chunk_id;
  h.round = static_cast<uint32_t>(plan.round.round);
  h.num_summands = summands;
  h.payload_bytes = static_cast<uint32_t>(layout.payload_bytes);
  WriteChunkHeader(h, out);
  uint8_t* payload = out.data() + kChunkHeaderBytes;
  std::memset(payload, 0, layout.map_bytes);
  for (size_t j = 0; j < layout.num_sg; ++j) {
    payload[j / 2] = static_cast<uint8_t>(payload[j / 2] | (plan.widths[layout.first_sg + j] << (4 * (j % 2))));
  }
  uint8_t* const sgs = payload + layout.map_bytes;
  ForSuperGroups(pool, layout.num_sg, [&](size_t first, size_t last) {
    const size_t offset = SuperGroupsBytes(plan, layout.first_sg, first);
    EncodeRange(plan, chunk, layout, first, last, local, received == nullptr ? nullptr : received + offset,
                sgs + offset);
  });
  return total;
}

void DynamiqCodec::EncodeRange(const BucketPlan& plan, const ChunkRef& chunk, const Layout& layout, size_t first,
                               size_t last, const Source& local, const uint8_t* received, uint8_t* sg) const {
  const RoundInfo& round = plan.round;
  const uint32_t key = StreamKey(config().seed, round.round, round.rank);
  // Siblings of one aggregation-tree node share a permutation of strata (see ChunkRef).
  const bool correlated = config().correlated_rounding && chunk.rounding_size > 1;
  const uint32_t shared_key = StreamKey(config().seed, round.round, kSharedStream ^ Mix32(chunk.rounding_group));
  alignas(64) float tile[kSuperGroupSize];
  for (size_t j = first; j < last; ++j) {
    const size_t global_sg = layout.first_sg + j;
    const int w = plan.widths[global_sg];
    const int count = CountInSg(chunk, j);
    if (w == 0) continue;
    const uint32_t stratum =
        correlated ? StratumOf(shared_key, static_cast<uint32_t>(global_sg), chunk.rounding_index, chunk.rounding_size)
                   : 0;
    const uint32_t first_index = static_cast<uint32_t>(global_sg * kSuperGroupSize);
    const size_t begin = chunk.begin + j * kSuperGroupSize;
    if (kernel_ == Kernel::kSimd && count == kSuperGroupSize) {
      // One fused pass straight from the source (and the received bytes): no tile copies.
      const size_t offset = begin - local.first;
      const SgInput input{
          local.dtype == DType::kFloat32 ? static_cast<const void*>(static_cast<const float*>(local.data) + offset)
                                         : static_cast<const uint16_t*>(local.data) + offset,
          local.dtype != DType::kFloat32,
          local.subtract_per_group == nullptr ? 0.0f : local.subtract_per_group[begin / kSuperGroupSize]};
      const SgRounding rounding{key, first_index, correlated, stratum, chunk.rounding_size};
      if (received == nullptr) {
        CompressSuperGroupSimd(simd_tables_[w], input, rounding, sg);
      } else {
        DecodeAddEncodeSuperGroupSimd(simd_tables_[w], received, input, rounding, sg);
      }
    } else {
      LoadSource(local, begin, count, tile);
      if (received != nullptr) DecodeSg(w, received, count, tile, /*add=*/true);
      EncodeSuperGroup(tables_[w], tile, count, key, first_index, correlated, stratum, chunk.rounding_size, sg);
    }
    sg += SuperGroupBytes(w, count);
    if (received != nullptr) received += SuperGroupBytes(w, count);
  }
}

absl::StatusOr<size_t> DynamiqCodec::Compress(const BucketPlan& plan, const ChunkRef& chunk, const Source& local,
                                              absl::Span<uint8_t> out) const {
  return CompressOn(nullptr, plan, chunk, local, out);
}

absl::StatusOr<size_t> DynamiqCodec::CompressOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                                const Source& local, absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(Layout layout, ChunkLayout(plan, chunk));
  return Encode(pool, plan, chunk, layout, 1, local, nullptr, out);
}

absl::StatusOr<size_t> DynamiqCodec::DecompressAccumulateRecompress(const BucketPlan& plan, const ChunkRef& chunk,
                                                                    absl::Span<const uint8_t> in, const Source& local,
                                                                    absl::Span<uint8_t> out) const {
  return DecompressAccumulateRecompressOn(nullptr, plan, chunk, in, local, out);
}

absl::StatusOr<size_t> DynamiqCodec::DecompressAccumulateRecompressOn(common::ThreadPool* pool, const BucketPlan& plan,
                                                                      const ChunkRef& chunk,
                                                                      absl::Span<const uint8_t> in, const Source& local,
                                                                      absl::Span<uint8_t> out) const {
  DQ_ASSIGN_OR_RETURN(Layout layout, ChunkLayout(plan, chunk));
  uint16_t summands = 0;
  DQ_ASSIGN_OR_RETURN(const uint8_t* payload, CheckInput(pool, plan, chunk, layout, in, &summands));
  const uint16_t out_summands = summands == 0xffff ? summands : static_cast<uint16_t>(summands + 1);
  // Encode walks the received super-groups alongside the ones it writes.
  return Encode(pool, plan, chunk, layout, out_summands, local, payload + layout.map_bytes, out);
}

absl::Status DynamiqCodec::Decompress(const BucketPlan& plan, const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                      const Dest& out) const {
  return DecompressOn(nullptr, plan, chunk, in, out);
}

absl::Status DynamiqCodec::DecompressOn(common::ThreadPool* pool, const BucketPlan& plan, const ChunkRef& chunk,
                                        absl::Span<const uint8_t> in, const Dest& out) const {
  DQ_ASSIGN_OR_RETURN(Layout layout, ChunkLayout(plan, chunk));
  uint16_t summands = 0;
  DQ_ASSIGN_OR_RETURN(const uint8_t* payload, CheckInput(pool, plan, chunk, layout, in, &summands));
  ForSuperGroups(pool, layout.num_sg, [&](size_t first, size_t last) {
    const uint8_t* sg = payload + layout.map_bytes + SuperGroupsBytes(plan, layout.first_sg, first);
    alignas(64) float tile[kSuperGroupSize];
    for (size_t j = first; j < last; ++j) {
      const int w = plan.widths[layout.first_sg + j];
      const int count = CountInSg(chunk, j);
      const size_t begin = chunk.begin + j * kSuperGroupSize;
      if (w != 0 && kernel_ == Kernel::kSimd && count == kSuperGroupSize && out.dtype == DType::kFloat32) {
        // Straight into the destination, as StoreDest would write it.
        float* dest = static_cast<float*>(out.data) + (begin - out.first);
        if (out.add_per_group == nullptr) {
          DecodeSuperGroupSimd(simd_tables_[w], sg, dest);
        } else {
          DecodeOffsetSuperGroupSimd(simd_tables_[w], sg, out.add_per_group[begin / kSuperGroupSize], dest);
        }
        sg += SuperGroupBytes(w, count);
        continue;
      }
      if (w == 0) {
        std::fill(tile, tile + count, 0.0f);
      } else {
        DecodeSg(w, sg, count, tile, /*add=*/false);
      }
      StoreDest(out, begin, count, tile);
      sg += SuperGroupBytes(w, count);
    }
  });
  return absl::OkStatus();
}

absl::Status DynamiqCodec::DecompressAccumulate(const BucketPlan& plan, const ChunkRef& chunk,
                                                absl::Span<const uint8_t> in, float* acc) const {
  return DecompressAccumulateOn(nullptr, plan, chunk, in, acc);
}

absl::Status DynamiqCodec::DecompressAccumulateOn(common::ThreadPool* pool, const BucketPlan& plan,
                                                  const ChunkRef& chunk, absl::Span<const uint8_t> in,
                                                  float* acc) const {
  DQ_ASSIGN_OR_RETURN(Layout layout, ChunkLayout(plan, chunk));
  uint16_t summands = 0;
  DQ_ASSIGN_OR_RETURN(const uint8_t* payload, CheckInput(pool, plan, chunk, layout, in, &summands));
  ForSuperGroups(pool, layout.num_sg, [&](size_t first, size_t last) {
    const uint8_t* sg = payload + layout.map_bytes + SuperGroupsBytes(plan, layout.first_sg, first);
    for (size_t j = first; j < last; ++j) {
      const int w = plan.widths[layout.first_sg + j];
      const int count = CountInSg(chunk, j);
      if (w != 0) DecodeSg(w, sg, count, acc + j * kSuperGroupSize, /*add=*/true);
      sg += SuperGroupBytes(w, count);
    }
  });
  return absl::OkStatus();
}

std::unique_ptr<Codec> NewDynamiqCodec(const CodecConfig& config, DynamiqCodec::Kernel kernel) {
  return std::make_unique<DynamiqCodec>(config, kernel);
}

}  // namespace dynamiq::kernels

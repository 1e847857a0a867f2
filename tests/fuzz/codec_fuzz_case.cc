#include "tests/fuzz/codec_fuzz_case.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <map>
#include <utility>

#include "common/status_macros.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_registry.h"

namespace dynamiq::fuzz {
namespace {

using kernels::CodecConfig;
using kernels::CodecId;

constexpr size_t kSg = 256;

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint32_t U32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

CodecConfig ConfigFor(CodecId id, int variant) {
  CodecConfig c;
  c.id = id;
  switch (id) {
    case CodecId::kDynamiq: {
      static constexpr double kBits[] = {3.0, 3.3, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0};
      c.bits = kBits[variant % 8];
      c.allocator = static_cast<kernels::BitAllocator>(variant / 8 % 2);
      c.levels = static_cast<kernels::LevelKind>(variant / 16 % 3);
      c.correlated_rounding = variant / 48 % 2 == 0;
      break;
    }
    case CodecId::kUniform:
      c.bits = 2 + variant % 7;
      c.correlated_rounding = (variant / 7) % 2 == 0;
      break;
    case CodecId::kFlash:
      c.bits = 2 + variant % 7;
      break;
    case CodecId::kThc:
      c.bits = 4;
      c.correlated_rounding = variant % 2 == 0;
      break;
    case CodecId::kGlobalQsgd:
      c.bits = 2 + variant % 7;
      c.correlated_rounding = (variant / 7) % 2 == 0;
      break;
    case CodecId::kArcTopK: {
      static constexpr double kDensity[] = {0.001, 0.05, 0.25, 0.5, 1.0};
      c.bits = kDensity[variant % 5];
      break;
    }
    default:
      break;
  }
  return c;
}

// Codecs are immutable and DynamiQ's constructor measures quantizer errors, so build each
// configuration once per process.
absl::StatusOr<const kernels::Codec*> CachedCodec(CodecId id, int variant) {
  static auto* cache = new std::map<std::pair<CodecId, int>, std::unique_ptr<kernels::Codec>>();
  auto key = std::make_pair(id, variant);
  auto it = cache->find(key);
  if (it == cache->end()) {
    DQ_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Codec> codec, kernels::CreateCodec(ConfigFor(id, variant)));
    it = cache->emplace(key, std::move(codec)).first;
  }
  return it->second.get();
}

// The rank's local values of the whole bucket: per super-group zero, tiny, huge or ordinary.
std::vector<float> LocalValues(size_t n, uint8_t seed, uint8_t magnitude) {
  std::vector<float> v(n);
  const float scale = std::ldexp(1.0f, static_cast<int>(magnitude) - 140);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t kind = Mix(seed * 1000003ull + i / kSg) % 8;
    const float factor = kind == 0 ? 0.0f : (kind == 1 ? 0x1p-30f : (kind == 2 ? 0x1p30f : 1.0f));
    const double u = static_cast<double>(Mix((uint64_t{seed} << 32) | i) >> 11) * 0x1p-53 * 2.0 - 1.0;
    v[i] = static_cast<float>(u * scale * factor);
  }
  return v;
}

float HostileValue(int kind) {
  switch (kind & 7) {
    case 0:
      return std::numeric_limits<float>::quiet_NaN();
    case 1:
      return std::numeric_limits<float>::infinity();
    case 2:
      return -std::numeric_limits<float>::infinity();
    case 3:
      return 0.0f;
    case 4:
      return -1.0f;
    case 5:
      return FLT_MAX;
    case 6:
      return std::numeric_limits<float>::denorm_min();
    default:
      return -0.0f;
  }
}

}  // namespace

kernels::Source CodecFuzzCase::Source() const {
  kernels::Source s;
  s.data = local->data.get();
  s.dtype = local_dtype;
  s.first = chunk.begin;
  s.subtract_per_group = subtract ? subtract->data.get() : nullptr;
  return s;
}

kernels::Dest CodecFuzzCase::Dest(void* data) const {
  kernels::Dest d;
  d.data = data;
  d.dtype = dest_dtype;
  d.first = chunk.begin;
  d.add_per_group = add ? add->data.get() : nullptr;
  return d;
}

int NumVariants(CodecId id) {
  switch (id) {
    case CodecId::kDynamiq:
      return 96;
    case CodecId::kUniform:
    case CodecId::kGlobalQsgd:
      return 14;
    case CodecId::kThc:
      return 2;
    case CodecId::kFlash:
      return 7;
    case CodecId::kArcTopK:
      return 5;
    default:
      return 1;
  }
}

absl::StatusOr<CodecFuzzCase> MakeCodecFuzzCase(CodecId id, absl::Span<const uint8_t> p) {
  if (p.size() < kCaseParamBytes) return absl::InvalidArgumentError("short parameters");
  CodecFuzzCase c;
  DQ_ASSIGN_OR_RETURN(c.codec, CachedCodec(id, p[0] % NumVariants(id)));
  c.flags = p[1];
  c.simd_target = (p[1] >> 6) | ((p[12] >> 7) << 2);
  const size_t n = (p[2] | (p[3] << 8)) % (kMaxFuzzElements + 1);
  const uint32_t world = (p[4] & 15) + 1;
  const uint32_t rank = (p[4] >> 4) % world;
  const size_t num_sg = (n + kSg - 1) / kSg;
  const size_t begin = std::min(n, kSg * (p[5] % (num_sg + 1)));
  const size_t count = (p[6] | (p[7] << 8)) % (n - begin + 1);
  kernels::RoundInfo round;
  round.round = U32(p.data() + 8);
  round.rank = rank;
  round.world_size = world;

  std::vector<float> values = LocalValues(n, p[13], p[14]);
  if ((c.flags & kFlagNonFinite) && count > 0) {
    values[begin + Mix(p[13]) % count] = (p[13] & 1) ? std::numeric_limits<float>::infinity() : NAN;
  }
  c.local_dtype = (c.flags & kFlagLocalBf16) ? kernels::DType::kBFloat16 : kernels::DType::kFloat32;
  c.dest_dtype = (c.flags & kFlagDestBf16) ? kernels::DType::kBFloat16 : kernels::DType::kFloat32;
  std::vector<uint16_t> bf16(n);
  for (size_t i = 0; i < n; ++i) bf16[i] = kernels::FloatToBf16(values[i]);
  kernels::Source whole;
  whole.dtype = c.local_dtype;
  whole.data = c.local_dtype == kernels::DType::kFloat32 ? static_cast<const void*>(values.data()) : bf16.data();

  // Statistics as a reduction over ranks would give them: this rank's scaled by the world size
  // (sums) or its own (max), then optionally one replaced by a hostile value.
  const size_t stats_len = c.codec->StatsLength(n);
  std::vector<float> local_stats(stats_len), reduced(stats_len);
  if (stats_len > 0) c.codec->ComputeStats(whole, n, local_stats.data());
  for (size_t k = 0; k < stats_len; ++k) {
    reduced[k] =
        c.codec->stats_reduction() == kernels::StatsReduction::kSum ? local_stats[k] * world : local_stats[k] * 1.5f;
  }
  if (p[15] >= 128 && stats_len > 0) reduced[((p[15] >> 3) & 15) % stats_len] = HostileValue(p[15]);
  DQ_ASSIGN_OR_RETURN(c.plan, c.codec->MakePlan(round, n, local_stats, reduced));

  c.chunk.chunk_id = static_cast<uint32_t>(begin / kSg);
  c.chunk.begin = begin;
  c.chunk.count = count;
  c.dar_chunk = c.chunk;
  c.dar_chunk.rounding_size = (p[12] & 3) + 1;
  c.dar_chunk.rounding_index = ((p[12] >> 2) & 3) % c.dar_chunk.rounding_size;
  c.dar_chunk.rounding_group = (p[12] >> 4) & 7;

  const size_t elem = kernels::DTypeSize(c.local_dtype);
  const uint8_t* src = static_cast<const uint8_t*>(whole.data) + begin * elem;
  c.local = std::make_unique<ExactBuffer<uint8_t>>(src, count * elem);
  if ((c.flags & kFlagMeans) && !c.plan.local_means.empty()) {
    c.subtract = std::make_unique<ExactBuffer<float>>(c.plan.local_means.data(), c.plan.local_means.size());
    c.add = std::make_unique<ExactBuffer<float>>(c.plan.mean_sums.data(), c.plan.mean_sums.size());
  }
  return c;
}

absl::StatusOr<std::vector<uint8_t>> ValidEncoding(const CodecFuzzCase& c, bool aggregated) {
  const kernels::Codec& codec = *c.codec;
  std::vector<uint8_t> bytes(codec.MaxEncodedBytes(c.plan, c.chunk));
  DQ_ASSIGN_OR_RETURN(size_t n, codec.Compress(c.plan, c.chunk, c.Source(), absl::MakeSpan(bytes)));
  bytes.resize(n);
  if (!aggregated) return bytes;
  std::vector<uint8_t> out(codec.MaxEncodedBytes(c.plan, c.chunk));
  DQ_ASSIGN_OR_RETURN(
      size_t m, codec.DecompressAccumulateRecompress(c.plan, c.dar_chunk, bytes, c.Source(), absl::MakeSpan(out)));
  out.resize(m);
  return out;
}

void ApplyEdits(absl::Span<const uint8_t> edits, std::vector<uint8_t>* bytes) {
  for (size_t e = 0; e < kMaxEdits && 4 * e + 4 <= edits.size(); ++e) {
    const uint8_t* d = edits.data() + 4 * e;
    const size_t pos = (d[0] | (d[1] << 8)) % (bytes->size() + 1);
    switch (d[2] & 3) {
      case 0:
        if (pos < bytes->size()) (*bytes)[pos] ^= d[3];
        break;
      case 1:
        if (pos < bytes->size()) (*bytes)[pos] = d[3];
        break;
      case 2:
        bytes->resize(pos);
        break;
      default:
        bytes->insert(bytes->begin() + static_cast<std::ptrdiff_t>(pos), d[3]);
        break;
    }
  }
}

}  // namespace dynamiq::fuzz

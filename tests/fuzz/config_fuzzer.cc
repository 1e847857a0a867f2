// libFuzzer harness for what an operator's SetCompression request and a peer's statistics reach
// before any chunk flows: the pieces of server::MakeJobConfig (ParseCodecId, the allocator name,
// ValidateCodecConfig, ParseTopology), CreateCodec with any `bits` double, MakeSchedule with any
// world size, and MakePlan with arbitrary reduced statistics (they arrive from other ranks). A plan
// that MakePlan returns must be usable: it must have a valid width per super-group (DynamiQ), and a
// whole-bucket Compress / Decompress round trip with it must succeed.
//
// Input: [0] bit 0: `bits` is the raw IEEE double in [1..8], else one of kBitsTable chosen by [1]
// (DynamiQ builds measure their quantizer, milliseconds each: most inputs reuse a cached codec);
// [9] world size (low 7 bits; bit 7: pad or cut the statistics to the length the codec wants);
// [10..11] bucket elements; [12..19] round; then "codec|topology|allocator|" and the reduced
// statistics as raw little-endian floats.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_split.h"
#include "engine/schedule.h"
#include "kernels/codec_registry.h"
#include "tests/fuzz/codec_fuzz_case.h"

namespace {

using namespace dynamiq;

[[noreturn]] void Fail(const std::string& what) {
  fprintf(stderr, "config_fuzzer: %s\n", what.c_str());
  abort();
}

// DynamiQ's constructor measures its quantizer (milliseconds): keep the recent configurations.
const kernels::Codec* CachedCodec(const kernels::CodecConfig& config) {
  using Key = std::tuple<int, uint64_t, int>;
  static auto* cache = new std::map<Key, std::unique_ptr<kernels::Codec>>();
  uint64_t bits;
  memcpy(&bits, &config.bits, 8);
  const Key key(static_cast<int>(config.id), bits, static_cast<int>(config.allocator));
  auto it = cache->find(key);
  if (it != cache->end()) return it->second.get();
  absl::StatusOr<std::unique_ptr<kernels::Codec>> codec = kernels::CreateCodec(config);
  if (!codec.ok()) return nullptr;
  if (cache->size() >= 64) cache->clear();
  return cache->emplace(key, *std::move(codec)).first->second.get();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr size_t kFixed = 20;
  static constexpr double kBitsTable[] = {0.0, 2.0, 3.0, 3.25, 4.0, 5.0, 5.5, 6.0, 7.75, 8.0, 8.5, -1.0};
  if (size < kFixed) return 0;
  kernels::CodecConfig config;
  if (data[0] & 1) {
    memcpy(&config.bits, data + 1, 8);
  } else {
    config.bits = kBitsTable[data[1] % (sizeof(kBitsTable) / sizeof(kBitsTable[0]))];
  }
  const int world = data[9] & 127;
  const bool fit_stats = (data[9] & 128) != 0;
  const size_t n = (data[10] | (data[11] << 8)) % (fuzz::kMaxFuzzElements + 1);
  kernels::RoundInfo round;
  memcpy(&round.round, data + 12, 8);
  round.world_size = static_cast<uint32_t>(world);
  round.rank = world > 0 ? static_cast<uint32_t>(round.round % static_cast<uint64_t>(world)) : 0;

  const std::string text(reinterpret_cast<const char*>(data + kFixed), size - kFixed);
  std::vector<absl::string_view> fields = absl::StrSplit(text, absl::MaxSplits('|', 3));
  if (fields.size() < 4) return 0;
  // MakeJobConfig's checks, in its order.
  absl::StatusOr<kernels::CodecId> id = kernels::ParseCodecId(fields[0]);
  absl::StatusOr<engine::Topology> topology = engine::ParseTopology(fields[1].empty() ? "ring" : fields[1]);
  if (!id.ok()) return 0;
  config.id = *id;
  if (fields[2] == "paper") {
    config.allocator = kernels::BitAllocator::kPaper;
  } else if (!fields[2].empty() && fields[2] != "measured") {
    return 0;
  }
  const absl::Status valid = kernels::ValidateCodecConfig(config);
  const kernels::Codec* codec = CachedCodec(config);
  if (valid.ok() != (codec != nullptr)) Fail("ValidateCodecConfig and CreateCodec disagree: " + valid.ToString());
  if (codec == nullptr || !topology.ok()) return 0;
  (void)engine::MakeSchedule(*topology, world);

  // The statistics: this rank's from deterministic data, the reduced ones from the input.
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = static_cast<float>((i * 2654435761u) % 1000) / 250.0f - 2.0f;
  kernels::Source local;
  local.data = values.data();
  const size_t stats_len = codec->StatsLength(n);
  std::vector<float> local_stats(stats_len);
  if (stats_len > 0) codec->ComputeStats(local, n, local_stats.data());
  const absl::string_view raw = fields[3];
  std::vector<float> reduced(raw.size() / 4);
  if (!reduced.empty()) memcpy(reduced.data(), raw.data(), 4 * reduced.size());
  if (fit_stats) {  // as many as the codec wants: the input's first, then this rank's
    for (size_t k = reduced.size(); k < stats_len; ++k) reduced.push_back(local_stats[k]);
    reduced.resize(stats_len);
  }
  absl::StatusOr<kernels::BucketPlan> plan = codec->MakePlan(round, n, local_stats, reduced);
  if (!plan.ok()) return 0;

  if (config.id == kernels::CodecId::kDynamiq) {
    if (plan->widths.size() != (n + 255) / 256) Fail("plan has the wrong number of widths");
    for (uint8_t w : plan->widths) {
      if (w == 1 || w > 8) Fail("plan holds width " + std::to_string(w));
    }
  }
  kernels::ChunkRef chunk;
  chunk.count = n;
  std::vector<uint8_t> bytes(codec->MaxEncodedBytes(*plan, chunk));
  absl::StatusOr<size_t> written = codec->Compress(*plan, chunk, local, absl::MakeSpan(bytes));
  if (!written.ok()) return 0;  // e.g. THC with a world it cannot sum
  std::vector<float> out(n);
  kernels::Dest dest;
  dest.data = out.data();
  absl::Status decoded = codec->Decompress(*plan, chunk, absl::MakeConstSpan(bytes.data(), *written), dest);
  if (!decoded.ok()) Fail("a plan's own encoding does not decode: " + decoded.ToString());
  return 0;
}

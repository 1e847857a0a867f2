#include "engine/simulator.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bench/synthetic_gradients.h"
#include "engine/schedule.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using kernels::CodecConfig;
using kernels::CodecId;
using ::testing::HasSubstr;

std::unique_ptr<kernels::Codec> Make(CodecId id, double bits = 5, bool correlated = true) {
  CodecConfig c;
  c.id = id;
  c.bits = bits;
  c.correlated_rounding = correlated;
  auto codec = kernels::CreateCodec(c);
  EXPECT_THAT(codec, IsOk());
  return std::move(codec).value();
}

struct SimRun {
  std::vector<std::vector<float>> outputs;
  SimulationResult result;
};

// With `hop_bits`, SimulateAllReduceHopBits (a b̄ per hop) instead of SimulateAllReduce.
SimRun Simulate(const kernels::Codec& codec, Topology topology, const std::vector<std::vector<float>>& inputs,
                uint64_t round = 1, const std::vector<double>& hop_bits = {}) {
  const int n = static_cast<int>(inputs.size());
  const size_t d = inputs[0].size();
  auto schedule = MakeSchedule(topology, n);
  EXPECT_THAT(schedule, IsOk());
  SimRun run;
  run.outputs.assign(n, std::vector<float>(d, NAN));
  std::vector<kernels::Source> in;
  std::vector<kernels::Dest> out;
  for (int r = 0; r < n; ++r) {
    in.push_back({inputs[r].data(), kernels::DType::kFloat32, 0, nullptr});
    out.push_back({run.outputs[r].data(), kernels::DType::kFloat32, 0, nullptr});
  }
  auto result = hop_bits.empty() ? SimulateAllReduce(codec, *schedule, d, round, in, out)
                                 : SimulateAllReduceHopBits(codec, *schedule, d, round, hop_bits, in, out);
  EXPECT_THAT(result, IsOk());
  if (result.ok()) run.result = *result;
  return run;
}

std::vector<std::vector<float>> Synthetic(int n, size_t d, uint64_t seed = 1, double rho = 0.5) {
  bench::SyntheticOptions o;
  o.workers = n;
  o.elements = d;
  o.seed = seed;
  o.correlation = rho;
  return bench::SyntheticGradients(o);
}

TEST(ScheduleTest, EveryChunkReachesItsOwnerThroughEveryRankOnce) {
  for (Topology t : {Topology::kRing, Topology::kButterfly}) {
    for (int n : {1, 2, 4, 8, 16, 32}) {
      auto s = MakeSchedule(t, n);
      ASSERT_THAT(s, IsOk());
      ASSERT_EQ(s->reduce_scatter.size(), static_cast<size_t>(n - 1));
      ASSERT_EQ(s->all_gather.size(), static_cast<size_t>(n - 1));
      std::vector<std::set<int>> senders(n);  // per chunk
      for (const auto& step : s->reduce_scatter) {
        std::vector<int> sends(n, 0), recvs(n, 0);
        for (const Transfer& x : step) {
          ++sends[x.from];
          ++recvs[x.to];
          EXPECT_TRUE(senders[x.chunk].insert(x.from).second) << "a rank sends a chunk twice";
          EXPECT_NE(x.from, s->owner[x.chunk]) << "the owner never sends during reduce-scatter";
        }
        for (int r = 0; r < n; ++r) EXPECT_LE(sends[r] + 0 * recvs[r], 1);
        for (int r = 0; r < n; ++r) EXPECT_LE(recvs[r], 1);
      }
      for (int c = 0; c < n; ++c) EXPECT_EQ(senders[c].size(), static_cast<size_t>(n - 1)) << "chunk " << c;
    }
  }
  EXPECT_THAT(MakeSchedule(Topology::kButterfly, 6),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power-of-two")));
  EXPECT_THAT(MakeSchedule(Topology::kRing, 0), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ScheduleTest, ChunksTileTheBucketOnSuperGroupBoundaries) {
  for (size_t d : {size_t{1}, size_t{255}, size_t{256}, size_t{1000}, size_t{100000}}) {
    for (int n : {1, 3, 8}) {
      size_t next = 0;
      for (int c = 0; c < n; ++c) {
        kernels::ChunkRef ch = ChunkOf(d, n, c);
        EXPECT_EQ(ch.begin, next);
        if (ch.count > 0 && ch.begin + ch.count < d) {
          EXPECT_EQ((ch.begin + ch.count) % 256, 0u);
        }
        next = ch.begin + ch.count;
      }
      EXPECT_EQ(next, d);
    }
  }
}

TEST(SimulatorTest, NoneIsTheExactSumInScheduleOrder) {
  auto codec = Make(CodecId::kNone);
  const int n = 5;
  auto inputs = Synthetic(n, 3000);
  SimRun run = Simulate(*codec, Topology::kRing, inputs);
  for (int c = 0; c < n; ++c) {
    kernels::ChunkRef ch = ChunkOf(3000, n, c);
    for (size_t k = ch.begin; k < ch.begin + ch.count; ++k) {
      float acc = inputs[c][k];  // the chunk's path: c, c+1, ..., c-1
      for (int h = 1; h < n; ++h) acc = acc + inputs[(c + h) % n][k];
      for (int r = 0; r < n; ++r) ASSERT_EQ(run.outputs[r][k], acc) << "rank " << r << " element " << k;
    }
  }
  // 32 bits per element plus one 32-byte header per message.
  EXPECT_NEAR(WireBitsPerCoord(run.result, 3000, n), 32.0 + 256.0 * n / 3000, 1e-9);
}

TEST(SimulatorTest, AllRanksGetBitIdenticalResults) {
  for (CodecId id : {CodecId::kDynamiq, CodecId::kBf16}) {
    for (Topology t : {Topology::kRing, Topology::kButterfly}) {
      auto codec = Make(id);
      auto inputs = Synthetic(8, 20000);
      SimRun run = Simulate(*codec, t, inputs);
      for (int r = 1; r < 8; ++r) {
        ASSERT_EQ(0, std::memcmp(run.outputs[r].data(), run.outputs[0].data(), 20000 * sizeof(float)))
            << kernels::CodecName(id) << " " << TopologyName(t) << " rank " << r;
      }
    }
  }
}

TEST(SimulatorTest, VnmseStrictlyDecreasesWithBits) {
  auto inputs = Synthetic(8, 1 << 16);
  auto exact = bench::ExactSum(inputs);
  double previous = INFINITY;
  for (double bits : {3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0}) {
    auto codec = Make(CodecId::kDynamiq, bits);
    SimRun run = Simulate(*codec, Topology::kRing, inputs);
    const double v = bench::Vnmse(run.outputs[0].data(), exact);
    EXPECT_LT(v, previous) << "bits " << bits;
    // The budget counts all metadata; on top come 32-byte chunk headers, one per message of the main
    // all-reduce, 256 * n / d bits per coordinate (the statistics travel as bare bf16).
    const double headers = 256.0 * 8 / (1 << 16);
    EXPECT_NEAR(WireBitsPerCoord(run.result, 1 << 16, 8) - headers, bits, 0.01) << "bits " << bits;
    previous = v;
  }
}

TEST(SimulatorTest, MeetsTheAccuracyTargetAtFiveBits) {
  auto inputs = Synthetic(8, 1 << 18);
  auto exact = bench::ExactSum(inputs);
  auto codec = Make(CodecId::kDynamiq, 5);
  const double ring = bench::Vnmse(Simulate(*codec, Topology::kRing, inputs).outputs[0].data(), exact);
  const double butterfly = bench::Vnmse(Simulate(*codec, Topology::kButterfly, inputs).outputs[0].data(), exact);
  EXPECT_LT(ring, 2e-3);
  EXPECT_GT(ring, 2e-4) << "suspiciously low: is the codec quantizing at all?";
  EXPECT_LE(butterfly, ring);
}

TEST(SimulatorTest, MeasuredAllocatorBeatsThePapers) {
  auto inputs = Synthetic(8, 1 << 17);
  auto exact = bench::ExactSum(inputs);
  CodecConfig c;
  c.bits = 4;
  auto measured = kernels::CreateCodec(c);
  c.allocator = kernels::BitAllocator::kPaper;
  auto paper = kernels::CreateCodec(c);
  ASSERT_THAT(measured, IsOk());
  ASSERT_THAT(paper, IsOk());
  double v_measured = 0, v_paper = 0;
  for (uint64_t round = 0; round < 3; ++round) {
    v_measured += bench::Vnmse(Simulate(**measured, Topology::kRing, inputs, round).outputs[0].data(), exact);
    v_paper += bench::Vnmse(Simulate(**paper, Topology::kRing, inputs, round).outputs[0].data(), exact);
  }
  EXPECT_LT(v_measured, v_paper);
}

TEST(SimulatorTest, CorrelatedRoundingLowersButterflyError) {
  // Butterfly trees have siblings whose rounding is stratified; a ring is a path and has none.
  auto inputs = Synthetic(8, 1 << 17);
  auto exact = bench::ExactSum(inputs);
  auto correlated = Make(CodecId::kDynamiq, 5, true);
  auto independent = Make(CodecId::kDynamiq, 5, false);
  double vc = 0, vi = 0;
  for (uint64_t round = 0; round < 3; ++round) {
    vc += bench::Vnmse(Simulate(*correlated, Topology::kButterfly, inputs, round).outputs[0].data(), exact);
    vi += bench::Vnmse(Simulate(*independent, Topology::kButterfly, inputs, round).outputs[0].data(), exact);
    EXPECT_EQ(Simulate(*correlated, Topology::kRing, inputs, round).outputs[0],
              Simulate(*independent, Topology::kRing, inputs, round).outputs[0]);
  }
  EXPECT_LT(vc, 0.95 * vi);
}

// Per-coordinate mean error of the all-reduced sum over K rounds is within 4 sigma / sqrt(K).
// Sensitive enough to catch correlated rounding along a ring's hops (z > 20 for most coordinates).
class UnbiasedTest : public ::testing::TestWithParam<std::tuple<Topology, CodecId, double>> {};

TEST_P(UnbiasedTest, WholeAllReduceIsUnbiased) {
  const auto [topology, id, bits] = GetParam();
  const int n = 4;
  const size_t d = 512;
  auto inputs = Synthetic(n, d, 3, 0.3);
  for (int r = 0; r < n; ++r) {
    for (size_t k = 0; k < d; ++k) inputs[r][k] = inputs[r][k] * 1e3f + 0.05f * r;  // non-zero means
  }
  auto exact = bench::ExactSum(inputs);
  auto codec = Make(id, bits);
  constexpr int kRounds = 3000;
  std::vector<double> sum(d, 0), sum_sq(d, 0);
  for (int round = 0; round < kRounds; ++round) {
    SimRun run = Simulate(*codec, topology, inputs, round);
    for (size_t k = 0; k < d; ++k) {
      const double e = run.outputs[0][k] - exact[k];
      sum[k] += e;
      sum_sq[k] += e * e;
    }
  }
  int outside = 0;
  for (size_t k = 0; k < d; ++k) {
    const double mean = sum[k] / kRounds;
    const double sigma = std::sqrt(std::max(sum_sq[k] / kRounds - mean * mean, 1e-30));
    outside += std::fabs(mean) > 4 * sigma / std::sqrt(double(kRounds));
  }
  EXPECT_LE(outside, 1);
}

INSTANTIATE_TEST_SUITE_P(Topologies, UnbiasedTest,
                         ::testing::Values(std::make_tuple(Topology::kRing, CodecId::kDynamiq, 4.0),
                                           std::make_tuple(Topology::kButterfly, CodecId::kDynamiq, 4.0),
                                           std::make_tuple(Topology::kRing, CodecId::kDynamiq, 7.0)));

TEST(SimulatorTest, ExtremeRangesNeverProduceInfOrNan) {
  for (int n : {2, 16, 64}) {
    const size_t d = 256 * 64;
    std::vector<std::vector<float>> inputs(n, std::vector<float>(d));
    for (int r = 0; r < n; ++r) {
      for (size_t k = 0; k < d; ++k) {
        // Magnitudes from 1e-30 to 1e30 across super-groups, varying signs across ranks.
        const double exponent = -30.0 + 60.0 * static_cast<double>(k / 256) / 63.0;
        inputs[r][k] = static_cast<float>(std::pow(10.0, exponent) * (((k * 7 + r * 13) % 5) - 2.0) / 2.0);
      }
    }
    auto exact = bench::ExactSum(inputs);
    for (Topology t : {Topology::kRing, Topology::kButterfly}) {
      auto codec = Make(CodecId::kDynamiq, 5);
      SimRun run = Simulate(*codec, t, inputs);
      for (size_t k = 0; k < d; ++k) ASSERT_TRUE(std::isfinite(run.outputs[0][k])) << "n " << n << " k " << k;
      // Each super-group's error stays bounded relative to the energy of its inputs, however small
      // or large they are (the sums themselves may cancel, so they are not the yardstick).
      for (size_t sg = 0; sg < d / 256; ++sg) {
        double err = 0, norm = 0;
        for (size_t k = sg * 256; k < sg * 256 + 256; ++k) {
          err += (run.outputs[0][k] - exact[k]) * (run.outputs[0][k] - exact[k]);
          for (int r = 0; r < n; ++r) norm += double(inputs[r][k]) * inputs[r][k];
        }
        // Path error grows at most like n^2 times one quantization's (< 1 even at 2 bits).
        if (norm > 0) {
          EXPECT_LT(err / norm, double(n) * n) << "n " << n << " super-group " << sg;
        }
      }
    }
  }
}

TEST(SimulatorTest, OneBudgetPerHopEverywhereIsTheFusedAllReduceBitForBit) {
  for (Topology t : {Topology::kRing, Topology::kButterfly}) {
    for (int n : {1, 2, 8}) {
      auto codec = Make(CodecId::kDynamiq, 4.5);
      auto inputs = Synthetic(n, 20000 + 37);
      SimRun fused = Simulate(*codec, t, inputs);
      SimRun hops = Simulate(*codec, t, inputs, 1, std::vector<double>(n, 4.5));
      EXPECT_EQ(hops.result.total_bytes_sent, fused.result.total_bytes_sent) << TopologyName(t) << " n " << n;
      EXPECT_EQ(hops.result.bytes_sent, fused.result.bytes_sent);
      for (int r = 0; r < n; ++r) {
        ASSERT_EQ(0, std::memcmp(hops.outputs[r].data(), fused.outputs[r].data(), inputs[0].size() * sizeof(float)))
            << TopologyName(t) << " n " << n << " rank " << r;
      }
    }
  }
}

TEST(SimulatorTest, BudgetsPerHopCostWhatTheySayAndStayIdenticalOnAllRanks) {
  const int n = 8;
  const size_t d = 1 << 16;
  auto inputs = Synthetic(n, d);
  const auto exact = bench::ExactSum(inputs);
  auto codec = Make(CodecId::kDynamiq, 5);
  // Cheap first hops, an expensive last reduce-scatter hop and final sum.
  const std::vector<double> hop_bits = {3, 4, 4, 5, 5, 6, 7, 6};
  SimRun hops = Simulate(*codec, Topology::kRing, inputs, 1, hop_bits);
  for (int r = 1; r < n; ++r) {
    ASSERT_EQ(0, std::memcmp(hops.outputs[r].data(), hops.outputs[0].data(), d * sizeof(float))) << "rank " << r;
  }
  // Ring: one message per k < n per chunk, the final sum forwarded n - 1 times.
  double mean = 0;
  for (int k = 0; k < n - 1; ++k) mean += hop_bits[k];
  mean = (mean + (n - 1) * hop_bits[n - 1]) / (2 * (n - 1));
  EXPECT_NEAR(WireBitsPerCoord(hops.result, d, n), mean, 0.1);
  // Each hop's plan, not one: more error than 6 bits everywhere, less than 3.
  const double v = bench::Vnmse(hops.outputs[0].data(), exact);
  EXPECT_LT(v, bench::Vnmse(Simulate(*Make(CodecId::kDynamiq, 3), Topology::kRing, inputs).outputs[0].data(), exact));
  EXPECT_GT(v, bench::Vnmse(Simulate(*Make(CodecId::kDynamiq, 6), Topology::kRing, inputs).outputs[0].data(), exact));
}

TEST(SimulatorTest, BudgetsPerHopNeedOnePerSummandCount) {
  auto schedule = MakeSchedule(Topology::kRing, 2);
  ASSERT_THAT(schedule, IsOk());
  auto codec = Make(CodecId::kDynamiq);
  std::vector<float> x(512, 1.0f), y(512);
  std::vector<kernels::Source> in(2, kernels::Source{x.data(), kernels::DType::kFloat32, 0, nullptr});
  std::vector<kernels::Dest> out(2, kernels::Dest{y.data(), kernels::DType::kFloat32, 0, nullptr});
  const std::vector<double> one = {5};
  EXPECT_THAT(SimulateAllReduceHopBits(*codec, *schedule, 512, 0, one, in, out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("need 2 hop budgets")));
}

// Two-shot: the owner adds its children in the order they are listed (ranks o - 1, o - 2, ...) to
// its own values; the ranks send what they send on the ring: each chunk n - 1 times either way.
TEST(SimulatorTest, TwoShotIsTheExactSumInTheOwnersOrderOnTheRingsBytes) {
  auto codec = Make(CodecId::kNone);
  for (int n : {1, 2, 3, 5, 8}) {
    auto inputs = Synthetic(n, 3000);
    SimRun run = Simulate(*codec, Topology::kTwoShot, inputs);
    for (int c = 0; c < n; ++c) {
      const int owner = (c + n - 1) % n;
      kernels::ChunkRef ch = ChunkOf(3000, n, c);
      for (size_t k = ch.begin; k < ch.begin + ch.count; ++k) {
        float acc = inputs[owner][k];
        for (int i = 1; i < n; ++i) acc = acc + inputs[(owner - i + n) % n][k];
        for (int r = 0; r < n; ++r) ASSERT_EQ(run.outputs[r][k], acc) << "n " << n << " rank " << r << " " << k;
      }
    }
    // In all (per rank they differ where chunks do: the last ones are shorter).
    SimRun ring = Simulate(*codec, Topology::kRing, inputs);
    EXPECT_EQ(run.result.total_bytes_sent, ring.result.total_bytes_sent) << n;
  }
}

TEST(SimulatorTest, TwoShotGivesAllRanksBitIdenticalResults) {
  for (CodecId id : {CodecId::kDynamiq, CodecId::kBf16, CodecId::kInt8, CodecId::kMxfp8}) {
    for (int n : {2, 3, 8}) {
      auto codec = Make(id);
      auto inputs = Synthetic(n, 20000);
      SimRun run = Simulate(*codec, Topology::kTwoShot, inputs);
      for (int r = 1; r < n; ++r) {
        ASSERT_EQ(0, std::memcmp(run.outputs[r].data(), run.outputs[0].data(), 20000 * sizeof(float)))
            << kernels::CodecName(id) << " n " << n << " rank " << r;
      }
    }
  }
}

TEST(SimulatorTest, TwoShotWithOneBudgetPerHopIsTheFusedAllReduceBitForBit) {
  for (int n : {1, 2, 3, 8}) {
    auto codec = Make(CodecId::kDynamiq, 4.5);
    auto inputs = Synthetic(n, 20000 + 37);
    SimRun fused = Simulate(*codec, Topology::kTwoShot, inputs);
    SimRun hops = Simulate(*codec, Topology::kTwoShot, inputs, 1, std::vector<double>(n, 4.5));
    EXPECT_EQ(hops.result.bytes_sent, fused.result.bytes_sent) << n;
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(0, std::memcmp(hops.outputs[r].data(), fused.outputs[r].data(), inputs[0].size() * sizeof(float)))
          << "n " << n << " rank " << r;
    }
  }
}

// Two-shot quantizes a chunk twice (each leaf, then its owner once for the sum of all n), the
// ring n times (every hop re-quantizes a growing partial sum): for the same codec and wire bytes,
// two-shot's error is below the ring's, by more as n grows. Measured here (synthetic gradients,
// 2^17 elements, mean of 3 rounds), two-shot / ring: dynamiq 4 bits 0.654, 5 bits 0.621, int8 0.918,
// flash 4 bits 0.632, 8 bits 0.635, uniform 4 bits 0.577 at n = 4; 0.393, 0.358, 0.830, 0.359,
// 0.331, 0.313 at n = 8 (issue 39's target: two-shot int4 no worse than ring int4). int8's error is
// mostly its clipping of the heavy tail at +-6 sigma, which the schedule does not change. Asserted
// with room for other data or rounding streams: at most 0.8 of the ring's at n = 4 and 0.5 at
// n = 8; int8 below the ring.
TEST(SimulatorTest, TwoShotErrorIsBelowTheRingsForTheSameCodec) {
  for (int n : {4, 8}) {
    auto inputs = Synthetic(n, 1 << 17);
    auto exact = bench::ExactSum(inputs);
    for (auto [id, bits] :
         {std::pair{CodecId::kDynamiq, 4.0}, std::pair{CodecId::kDynamiq, 5.0}, std::pair{CodecId::kInt8, 8.0},
          std::pair{CodecId::kFlash, 4.0}, std::pair{CodecId::kFlash, 8.0}, std::pair{CodecId::kUniform, 4.0}}) {
      auto codec = Make(id, bits);
      double ring = 0, two_shot = 0;
      for (uint64_t round = 0; round < 3; ++round) {
        SimRun r = Simulate(*codec, Topology::kRing, inputs, round);
        SimRun t = Simulate(*codec, Topology::kTwoShot, inputs, round);
        ring += bench::Vnmse(r.outputs[0].data(), exact) / 3;
        two_shot += bench::Vnmse(t.outputs[0].data(), exact) / 3;
        EXPECT_EQ(t.result.total_bytes_sent, r.result.total_bytes_sent);
      }
      std::printf("n=%d %s bits %g: vNMSE ring %.4g, two_shot %.4g (ratio %.3f)\n", n,
                  std::string(kernels::CodecName(id)).c_str(), bits, ring, two_shot, two_shot / ring);
      const double bound = id == CodecId::kInt8 ? 1.0 : (n == 4 ? 0.8 : 0.5);
      EXPECT_LT(two_shot, bound * ring) << kernels::CodecName(id) << " " << bits << " n " << n;
      EXPECT_GT(two_shot, 0) << "is the codec quantizing at all?";
    }
  }
}

TEST(SimulatorTest, RejectsWrongNumberOfRanks) {
  auto schedule = MakeSchedule(Topology::kButterfly, 4);
  ASSERT_THAT(schedule, IsOk());
  auto codec = Make(CodecId::kNone);
  std::vector<kernels::Source> in(3);
  std::vector<kernels::Dest> out(3);
  EXPECT_THAT(SimulateAllReduce(*codec, *schedule, 10, 0, in, out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("need 4 inputs")));
}

}  // namespace
}  // namespace dynamiq::engine

#include "engine/allreduce.h"

#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "bench/synthetic_gradients.h"
#include "common/thread_pool.h"
#include "engine/gloo_transport.h"
#include "engine/memory_transport.h"
#include "engine/side_lane.h"
#include "engine/simulator.h"
#include "engine/step_header.h"
#include "engine/store.h"
#include "engine/tcp_transport.h"
#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_registry.h"
#include "kernels/parallel_codec.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/transport_test_util.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using kernels::CodecConfig;
using kernels::CodecId;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

std::unique_ptr<kernels::Codec> Make(CodecId id, double bits = 5) {
  CodecConfig c;
  c.id = id;
  c.bits = id == CodecId::kUniform || id == CodecId::kThc || id == CodecId::kFlash
               ? 4
               : (id == CodecId::kArcTopK ? 0.3 : bits);
  auto codec = kernels::CreateCodec(c);
  EXPECT_THAT(codec, IsOk());
  return std::move(codec).value();
}

std::vector<std::vector<float>> Inputs(int n, size_t d, uint64_t seed = 1) {
  bench::SyntheticOptions o;
  o.workers = n;
  o.elements = d;
  o.seed = seed;
  return bench::SyntheticGradients(o);
}

struct RankRun {
  std::vector<std::vector<float>> outputs;
  std::vector<absl::StatusOr<AllReduceResult>> results;
};

// Runs the all-reduce with every rank on its own thread over in-memory transports.
// `options_for(rank)` lets a test give one rank a different configuration.
template <typename OptionsFor>
RankRun RunThreads(const kernels::Codec& codec, const std::vector<std::vector<float>>& inputs, OptionsFor options_for,
                   int skip_rank = -1) {
  const int n = static_cast<int>(inputs.size());
  const size_t d = inputs[0].size();
  auto transports = MakeMemoryTransports(n);
  RankRun run;
  run.outputs.assign(n, std::vector<float>(d, NAN));
  run.results.assign(n, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    if (r == skip_rank) continue;
    threads.emplace_back([&, r] {
      kernels::Source src{inputs[r].data(), kernels::DType::kFloat32, 0, nullptr};
      kernels::Dest dst{run.outputs[r].data(), kernels::DType::kFloat32, 0, nullptr};
      run.results[r] = AllReduce(codec, *transports[r], options_for(r), src, dst, d);
    });
  }
  for (auto& t : threads) t.join();
  return run;
}

AllReduceOptions Options(Topology t = Topology::kRing, size_t block = 0) {
  AllReduceOptions o;
  o.topology = t;
  o.job_id = 42;
  o.sequence = 3;
  o.block_elements = block;
  o.timeout = absl::Seconds(20);
  return o;
}

TEST(AllReduceTest, NoneIsExactForEveryWorldSize) {
  auto codec = Make(CodecId::kNone);
  for (int n : {1, 2, 3, 5, 8}) {
    const size_t d = 5000;
    auto inputs = Inputs(n, d);
    for (size_t block : {size_t{0}, size_t{1024}}) {
      RankRun run = RunThreads(*codec, inputs, [&](int) { return Options(Topology::kRing, block); });
      for (int r = 0; r < n; ++r) ASSERT_THAT(run.results[r], IsOk()) << "n " << n;
      // Chunk c of each block travels c, c+1, ..., c-1: the sum in that order, exactly.
      const size_t b = block == 0 ? d : block;
      for (size_t begin = 0; begin < d; begin += b) {
        const size_t count = std::min(b, d - begin);
        for (int c = 0; c < n; ++c) {
          kernels::ChunkRef ch = ChunkOf(count, n, c);
          for (size_t k = begin + ch.begin; k < begin + ch.begin + ch.count; ++k) {
            float acc = inputs[c][k];
            for (int h = 1; h < n; ++h) acc = acc + inputs[(c + h) % n][k];
            for (int r = 0; r < n; ++r) ASSERT_EQ(run.outputs[r][k], acc) << "n " << n << " rank " << r << " k " << k;
          }
        }
      }
    }
  }
}

TEST(AllReduceTest, BitIdenticalOnAllRanksForEveryCodecAndTopology) {
  const int n = 4;
  const size_t d = 20000;
  auto inputs = Inputs(n, d);
  for (CodecId id :
       {CodecId::kNone, CodecId::kBf16, CodecId::kDynamiq, CodecId::kMxfp8, CodecId::kMxfp6, CodecId::kMxfp4,
        CodecId::kThc, CodecId::kUniform, CodecId::kInt8, CodecId::kGlobalQsgd, CodecId::kArcTopK, CodecId::kFlash}) {
    auto codec = Make(id);
    for (Topology t : {Topology::kRing, Topology::kButterfly}) {
      if (t == Topology::kButterfly && !codec->SupportsButterfly()) continue;
      RankRun run = RunThreads(*codec, inputs, [&](int) { return Options(t, 4096); });
      for (int r = 0; r < n; ++r) {
        ASSERT_THAT(run.results[r], IsOk()) << kernels::CodecName(id) << " " << TopologyName(t);
        ASSERT_EQ(0, std::memcmp(run.outputs[r].data(), run.outputs[0].data(), d * sizeof(float)))
            << kernels::CodecName(id) << " " << TopologyName(t) << " rank " << r;
      }
    }
  }
}

TEST(AllReduceTest, MatchesTheSimulatorBitForBit) {
  // One block: the engine runs exactly the simulator's schedule, statistics exchange included.
  const int n = 8;
  const size_t d = 1 << 16;
  auto inputs = Inputs(n, d, 7);
  auto exact = bench::ExactSum(inputs);
  for (Topology t : {Topology::kRing, Topology::kButterfly}) {
    auto codec = Make(CodecId::kDynamiq, 5);
    RankRun run = RunThreads(*codec, inputs, [&](int) { return Options(t, 0); });
    ASSERT_THAT(run.results[0], IsOk());
    auto schedule = MakeSchedule(t, n);
    std::vector<std::vector<float>> sim(n, std::vector<float>(d));
    std::vector<kernels::Source> in;
    std::vector<kernels::Dest> out;
    for (int r = 0; r < n; ++r) {
      in.push_back({inputs[r].data(), kernels::DType::kFloat32, 0, nullptr});
      out.push_back({sim[r].data(), kernels::DType::kFloat32, 0, nullptr});
    }
    // The engine's round for block 0 of collective `sequence` is sequence * 2^20.
    ASSERT_THAT(SimulateAllReduce(*codec, *schedule, d, 3 * 1048576, in, out), IsOk());
    EXPECT_EQ(run.outputs[0], sim[0]) << TopologyName(t);
    EXPECT_LT(bench::Vnmse(run.outputs[0].data(), exact), 2e-3);
  }
}

TEST(AllReduceTest, PipeliningKeepsTheErrorOfOneBlock) {
  const int n = 4;
  const size_t d = 1 << 16;
  auto inputs = Inputs(n, d, 9);
  auto exact = bench::ExactSum(inputs);
  auto codec = Make(CodecId::kDynamiq, 5);
  RankRun whole = RunThreads(*codec, inputs, [&](int) { return Options(Topology::kRing, 0); });
  RankRun blocks = RunThreads(*codec, inputs, [&](int) { return Options(Topology::kRing, 4096); });
  ASSERT_THAT(whole.results[0], IsOk());
  ASSERT_THAT(blocks.results[0], IsOk());
  EXPECT_EQ(blocks.results[0]->blocks, 16);
  const double v_whole = bench::Vnmse(whole.outputs[0].data(), exact);
  const double v_blocks = bench::Vnmse(blocks.outputs[0].data(), exact);
  EXPECT_LT(v_blocks, 1.5 * v_whole);
  EXPECT_GT(v_blocks, 0.5 * v_whole);
}

TEST(AllReduceTest, ConfigMismatchFailsOnEveryRankNamingTheRank) {
  const int n = 4;
  auto inputs = Inputs(n, 3000);
  auto codec = Make(CodecId::kDynamiq, 5);
  AllReduceOptions base = Options();
  base.timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  RankRun run = RunThreads(*codec, inputs, [&](int r) {
    AllReduceOptions o = base;
    if (r == 2) o.config_epoch = 7;
    return o;
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (int r = 0; r < n; ++r) {
    EXPECT_FALSE(run.results[r].ok()) << "rank " << r;
    EXPECT_THAT(run.results[r].status().message(), HasSubstr("rank")) << run.results[r].status();
  }
  // A rank that exchanges with rank 2 sees the mismatch itself (the first to see it aborts the
  // group, so the others fail at once instead of at the timeout).
  int saw_mismatch = 0;
  for (int r = 0; r < n; ++r) {
    saw_mismatch += !run.results[r].ok() && run.results[r].status().code() == absl::StatusCode::kFailedPrecondition &&
                    absl::StrContains(run.results[r].status().message(), "config epoch");
  }
  EXPECT_GE(saw_mismatch, 1);
}

TEST(AllReduceTest, PerCollectiveBitsReplaceTheCodecsBudget) {
  // A 5-bit codec told to run this collective at 7 bits: the same bytes and result as a 7-bit
  // codec (pipelined, so every block's plan takes it), bit-identical on all ranks.
  const int n = 4;
  const size_t d = 1 << 15;
  auto inputs = Inputs(n, d, 5);
  auto five = Make(CodecId::kDynamiq, 5);
  auto seven = Make(CodecId::kDynamiq, 7);
  for (size_t block : {size_t{0}, size_t{8192}}) {
    RankRun at7 = RunThreads(*seven, inputs, [&](int) { return Options(Topology::kRing, block); });
    RankRun told7 = RunThreads(*five, inputs, [&](int) {
      AllReduceOptions o = Options(Topology::kRing, block);
      o.bits = 7;
      return o;
    });
    RankRun at5 = RunThreads(*five, inputs, [&](int) { return Options(Topology::kRing, block); });
    for (int r = 0; r < n; ++r) {
      ASSERT_THAT(told7.results[r], IsOk());
      ASSERT_THAT(at7.results[r], IsOk());
      EXPECT_EQ(told7.outputs[r], at7.outputs[0]) << "rank " << r << " block " << block;
    }
    EXPECT_EQ(told7.results[0]->bytes_sent, at7.results[0]->bytes_sent);
    EXPECT_GT(told7.results[0]->bytes_sent, at5.results[0]->bytes_sent * 13 / 10);
  }
}

TEST(AllReduceTest, RanksThatDisagreeOnPerCollectiveBitsFailNamingTheBits) {
  const int n = 3;
  auto inputs = Inputs(n, 3000);
  auto codec = Make(CodecId::kDynamiq, 5);
  RankRun run = RunThreads(*codec, inputs, [&](int r) {
    AllReduceOptions o = Options();
    o.timeout = absl::Seconds(3);
    o.bits = r == 1 ? 6.5 : 6.25;
    return o;
  });
  int saw_bits = 0;
  for (int r = 0; r < n; ++r) {
    EXPECT_FALSE(run.results[r].ok()) << "rank " << r;
    saw_bits += !run.results[r].ok() && absl::StrContains(run.results[r].status().message(), "bits");
  }
  EXPECT_GE(saw_bits, 1);
  // Outside the codec's range: every rank's plan refuses it.
  RankRun bad = RunThreads(*codec, inputs, [&](int) {
    AllReduceOptions o = Options();
    o.timeout = absl::Seconds(3);
    o.bits = 9;
    return o;
  });
  // (The first rank to fail aborts the group: the others may see that instead.)
  int invalid = 0;
  for (int r = 0; r < n; ++r) {
    EXPECT_FALSE(bad.results[r].ok()) << "rank " << r;
    invalid += !bad.results[r].ok() && bad.results[r].status().code() == absl::StatusCode::kInvalidArgument;
  }
  EXPECT_GE(invalid, 1);
}

TEST(AllReduceTest, DifferentSizesOrCodecsFail) {
  const int n = 3;
  auto inputs = Inputs(n, 3000);
  auto dynamiq = Make(CodecId::kDynamiq, 5);
  auto mx = Make(CodecId::kMxfp8);
  AllReduceOptions o = Options();
  o.timeout = absl::Seconds(3);
  auto transports = MakeMemoryTransports(n);
  std::vector<std::vector<float>> out(n, std::vector<float>(3000));
  std::vector<absl::StatusOr<AllReduceResult>> results(n, absl::UnknownError(""));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const kernels::Codec& c = r == 1 ? *mx : *dynamiq;
      const size_t d = r == 2 ? 2999 : 3000;
      results[r] = AllReduce(c, *transports[r], o, {inputs[r].data(), kernels::DType::kFloat32, 0, nullptr},
                             {out[r].data(), kernels::DType::kFloat32, 0, nullptr}, d);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_FALSE(results[r].ok()) << r;
  EXPECT_THAT(results[2].status().message(), AnyOf(HasSubstr("codec mxfp8"), HasSubstr("rank 1")));
}

// The side lane (contribution accounting): every rank ends with the same exact fp64 sums, added in
// rank order, and the data's result is the one without a side lane, bit for bit.
TEST(AllReduceTest, SideSumsAreExactAndBitIdenticalOnEveryRankBesideAnUnchangedResult) {
  const int n = 4;
  const size_t d = 5000;
  auto inputs = Inputs(n, d);
  for (CodecId id : {CodecId::kNone, CodecId::kDynamiq, CodecId::kThc, CodecId::kMxfp8}) {
    for (Topology t : {Topology::kRing, Topology::kButterfly}) {
      auto codec = Make(id);
      if (t == Topology::kButterfly && !codec->SupportsButterfly()) continue;
      SCOPED_TRACE(absl::StrCat(kernels::CodecName(id), " ", TopologyName(t)));
      // Weights that fp32 could not sum exactly, and a count.
      std::vector<std::vector<double>> side(n);
      double expected_weight = 0;
      for (int r = 0; r < n; ++r) {
        side[r] = {0.1 * (r + 1) + 1e-12 * r, 3.0};
        expected_weight += side[r][0];
      }
      const RankRun plain = RunThreads(*codec, inputs, [&](int) { return Options(t, 1024); });
      const RankRun with_side = RunThreads(*codec, inputs, [&](int r) {
        AllReduceOptions o = Options(t, 1024);
        o.side_sums = absl::MakeSpan(side[r]);
        return o;
      });
      for (int r = 0; r < n; ++r) {
        ASSERT_THAT(with_side.results[r], IsOk());
        EXPECT_EQ(side[r][0], expected_weight) << r;
        EXPECT_EQ(side[r][1], 3.0 * n) << r;
        EXPECT_EQ(std::memcmp(with_side.outputs[r].data(), plain.outputs[r].data(), d * sizeof(float)), 0) << r;
      }
      // The side lane's messages are headers and 8 bytes per value to each other rank.
      EXPECT_EQ(with_side.results[0]->bytes_sent - plain.results[0]->bytes_sent,
                (n - 1) * (kStepHeaderBytes + 2 * sizeof(double)));
    }
  }
}

TEST(AllReduceTest, ARankWithAnotherNumberOfSideSumsIsNamed) {
  const int n = 3;
  auto inputs = Inputs(n, 3000);
  auto codec = Make(CodecId::kDynamiq);
  std::vector<std::vector<double>> side = {{1, 1}, {1, 1}, {1, 1, 1}};
  const RankRun run = RunThreads(*codec, inputs, [&](int r) {
    AllReduceOptions o = Options();
    o.timeout = absl::Seconds(5);
    o.side_sums = absl::MakeSpan(side[r]);
    return o;
  });
  // Every rank fails; the first to find the difference names it (the others may see the abort).
  int named = 0;
  for (int r = 0; r < n; ++r) {
    ASSERT_FALSE(run.results[r].ok()) << r;
    const absl::Status& s = run.results[r].status();
    if (absl::StrContains(s.message(), "rank 2 sent 3 side-lane values (24 bytes), this rank 2") ||
        absl::StrContains(s.message(), "sent 2 side-lane values (16 bytes), this rank 3")) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      ++named;
    }
  }
  EXPECT_GE(named, 1);
  // More than a side lane carries is refused before anything is sent.
  std::vector<double> many(kMaxSideSums + 1, 1.0);
  const RankRun one = RunThreads(*codec, {inputs[0]}, [&](int) {
    AllReduceOptions o = Options();
    o.side_sums = absl::MakeSpan(many);
    return o;
  });
  EXPECT_THAT(one.results[0].status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 32")));
}

TEST(AllReduceTest, AMissingPeerFailsTheOthersWithinTheTimeout) {
  const int n = 4;
  auto inputs = Inputs(n, 3000);
  auto codec = Make(CodecId::kDynamiq, 5);
  AllReduceOptions o = Options();
  o.timeout = absl::Seconds(1);
  const absl::Time start = absl::Now();
  RankRun run = RunThreads(
      *codec, inputs, [&](int) { return o; }, /*skip_rank=*/1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  int timed_out = 0;
  for (int r : {0, 2, 3}) {
    EXPECT_THAT(run.results[r],
                StatusIs(AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kAborted), HasSubstr("rank")))
        << r;
    timed_out += run.results[r].status().code() == absl::StatusCode::kDeadlineExceeded;
  }
  EXPECT_GE(timed_out, 1);
}

TEST(AllReduceTest, EveryMixOfBlocksAndStepsCompletesBitIdentically) {
  // The wavefront (block k's step g at index g + k + 1) with fewer, as many and more blocks than
  // the 2(n - 1) steps, on both topologies: every rank completes and decodes the same bytes, and
  // the statistics exchange (one per bucket) serves every block.
  const size_t d = 6144;
  auto codec = Make(CodecId::kDynamiq, 5);
  for (Topology t : {Topology::kRing, Topology::kButterfly}) {
    for (int n : {2, 4, 8}) {
      auto inputs = Inputs(n, d, 11);
      auto exact = bench::ExactSum(inputs);
      for (size_t block : {size_t{0}, size_t{4096}, size_t{2048}, size_t{256}}) {  // 1, 2, 3 and 24 blocks
        RankRun run = RunThreads(*codec, inputs, [&](int) { return Options(t, block); });
        for (int r = 0; r < n; ++r) {
          ASSERT_THAT(run.results[r], IsOk()) << TopologyName(t) << " n " << n << " block " << block;
          ASSERT_EQ(0, std::memcmp(run.outputs[r].data(), run.outputs[0].data(), d * sizeof(float)))
              << TopologyName(t) << " n " << n << " block " << block << " rank " << r;
        }
        // The sum, compressed (blocks of one super-group, each planned on its own, cost accuracy:
        // up to 4.5e-2 at n = 8; a wrong or missing block would be ~1).
        EXPECT_LT(bench::Vnmse(run.outputs[0].data(), exact), block == 256 ? 0.1 : 1e-2)
            << TopologyName(t) << " n " << n << " block " << block;
      }
    }
  }
}

TEST(AllReduceTest, CodecWorkSplitAcrossThreadsGivesTheResultsOfOneThread) {
  // The CPU data path's ParallelCodec (statistics, compress, DAR, decompress split into ranges of
  // super-groups) with 1, 2, 3 and 8 threads: every rank's result and byte count is the plain
  // codec's, on both topologies, one block or several, each rank with its own pool or all four
  // sharing one (concurrent callers).
  const int n = 4;
  const size_t d = 4 * 70000 + 123;  // chunks of ~273 super-groups: split from 2 threads on
  auto inputs = Inputs(n, d, 21);
  for (CodecId id : {CodecId::kDynamiq, CodecId::kUniform}) {
    auto codec = Make(id, 4);
    for (Topology t : {Topology::kRing, Topology::kButterfly}) {
      for (size_t block : {size_t{0}, size_t{150000}}) {
        SCOPED_TRACE(::testing::Message() << codec->Describe() << ", " << TopologyName(t) << ", block " << block);
        RankRun one = RunThreads(*codec, inputs, [&](int) { return Options(t, block); });
        for (int r = 0; r < n; ++r) ASSERT_THAT(one.results[r], IsOk());
        for (int threads : {1, 2, 3, 8}) {
          for (bool shared : {false, true}) {
            std::vector<std::unique_ptr<common::ThreadPool>> pools;
            for (int r = 0; r < (shared ? 1 : n); ++r) pools.push_back(std::make_unique<common::ThreadPool>(threads));
            std::vector<std::unique_ptr<kernels::ParallelCodec>> codecs;
            for (int r = 0; r < n; ++r) {
              codecs.push_back(std::make_unique<kernels::ParallelCodec>(*codec, pools[shared ? 0 : r].get()));
            }
            // As RunThreads, with each rank's own codec.
            std::vector<std::vector<float>> outputs(n, std::vector<float>(d, NAN));
            std::vector<absl::StatusOr<AllReduceResult>> results(n, absl::UnknownError("not run"));
            auto transports = MakeMemoryTransports(n);
            std::vector<std::thread> ranks;
            for (int r = 0; r < n; ++r) {
              ranks.emplace_back([&, r] {
                kernels::Source src{inputs[r].data(), kernels::DType::kFloat32, 0, nullptr};
                kernels::Dest dst{outputs[r].data(), kernels::DType::kFloat32, 0, nullptr};
                results[r] = AllReduce(*codecs[r], *transports[r], Options(t, block), src, dst, d);
              });
            }
            for (auto& th : ranks) th.join();
            for (int r = 0; r < n; ++r) {
              ASSERT_THAT(results[r], IsOk()) << threads << " threads";
              EXPECT_EQ(results[r]->bytes_sent, one.results[r]->bytes_sent) << threads << " threads, rank " << r;
              ASSERT_EQ(0, std::memcmp(outputs[r].data(), one.outputs[r].data(), d * sizeof(float)))
                  << threads << " threads (" << (shared ? "shared" : "own") << " pools), rank " << r;
            }
            if (id == CodecId::kDynamiq && threads > 1) {
              EXPECT_GT(pools[0]->split_calls(), 0u);
            }
          }
        }
      }
    }
  }
}

// THC's whole-bucket rotation runs around the schedule in the engine as in the simulator: the same
// bits, pipelined in blocks or not (the blocks cut the rotated bucket), within THC's error.
TEST(AllReduceTest, ThcRotatesTheWholeBucketLikeTheSimulator) {
  const int n = 8;
  const size_t d = 50000;  // rotated as 65536 coefficients
  auto inputs = Inputs(n, d, 9);
  auto exact = bench::ExactSum(inputs);
  auto codec = Make(CodecId::kThc);
  auto schedule = MakeSchedule(Topology::kRing, n);
  std::vector<std::vector<float>> sim(n, std::vector<float>(d));
  std::vector<kernels::Source> in;
  std::vector<kernels::Dest> out;
  for (int r = 0; r < n; ++r) {
    in.push_back({inputs[r].data(), kernels::DType::kFloat32, 0, nullptr});
    out.push_back({sim[r].data(), kernels::DType::kFloat32, 0, nullptr});
  }
  ASSERT_THAT(SimulateAllReduce(*codec, *schedule, d, 3 * 1048576, in, out), IsOk());
  const double whole = bench::Vnmse(sim[0].data(), exact);
  EXPECT_LT(whole, 0.03);
  for (size_t block : {size_t{0}, size_t{8192}}) {
    RankRun run = RunThreads(*codec, inputs, [&](int) { return Options(Topology::kRing, block); });
    for (int r = 0; r < n; ++r) {
      ASSERT_THAT(run.results[r], IsOk()) << block;
      ASSERT_EQ(run.outputs[r], run.outputs[0]) << "rank " << r << " block " << block;
    }
    if (block == 0) EXPECT_EQ(run.outputs[0], sim[0]);
    // A block normalizes by the whole bucket's coordinate scale (BucketPlan::scale_elements), not
    // its own length: the same error as one block, up to the rounding noise.
    EXPECT_LT(bench::Vnmse(run.outputs[0].data(), exact), 1.2 * whole) << block;
  }
}

TEST(AllReduceTest, BalancedChunksAreBitIdenticalOnAllRanksAndWithinTheCodecsError) {
  const int n = 4;
  const size_t d = 30000;
  auto inputs = Inputs(n, d);
  std::vector<double> exact(d, 0.0);
  for (const auto& v : inputs) {
    for (size_t i = 0; i < d; ++i) exact[i] += v[i];
  }
  for (CodecId id : {CodecId::kNone, CodecId::kDynamiq, CodecId::kArcTopK, CodecId::kThc}) {
    auto codec = Make(id);
    for (Topology t : {Topology::kRing, Topology::kButterfly}) {
      if (t == Topology::kButterfly && !codec->SupportsButterfly()) continue;
      RankRun plain = RunThreads(*codec, inputs, [&](int) { return Options(t, 8192); });
      RankRun balanced = RunThreads(*codec, inputs, [&](int) {
        AllReduceOptions o = Options(t, 8192);
        o.balanced_chunks = true;
        return o;
      });
      double err_plain = 0, err_balanced = 0, norm = 0;
      for (int r = 0; r < n; ++r) {
        ASSERT_THAT(balanced.results[r], IsOk()) << kernels::CodecName(id) << " " << TopologyName(t);
        ASSERT_EQ(0, std::memcmp(balanced.outputs[r].data(), balanced.outputs[0].data(), d * sizeof(float)))
            << kernels::CodecName(id) << " " << TopologyName(t) << " rank " << r;
      }
      for (size_t i = 0; i < d; ++i) {
        err_plain += (plain.outputs[0][i] - exact[i]) * (plain.outputs[0][i] - exact[i]);
        err_balanced += (balanced.outputs[0][i] - exact[i]) * (balanced.outputs[0][i] - exact[i]);
        norm += exact[i] * exact[i];
      }
      EXPECT_LE(err_balanced / norm, 2 * err_plain / norm + 1e-12) << kernels::CodecName(id) << " " << TopologyName(t);
    }
  }
}

TEST(AllReduceTest, TimelinesRecordEveryRanksCodecWorkChecksumsAndWaits) {
  const int n = 4;
  const size_t d = 3 * 4096 + 100;
  auto codec = Make(CodecId::kDynamiq);
  std::vector<Timeline> timelines(n);
  const auto inputs = Inputs(n, d);
  RankRun run = RunThreads(*codec, inputs, [&](int r) {
    AllReduceOptions o = Options(Topology::kRing, 4096);
    o.timeline = &timelines[r];
    return o;
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_THAT(run.results[r].status(), IsOk());
    const std::vector<int64_t> totals = timelines[r].Totals();
    std::vector<int> count(Timeline::kNumKinds, 0);
    std::vector<bool> blocks(run.results[r]->blocks, false);
    for (const Timeline::Span& s : timelines[r].spans()) {
      EXPECT_LE(s.begin_ns, s.end_ns);
      ++count[static_cast<int>(s.kind)];
      if (s.kind == Timeline::Kind::kDar) blocks.at(s.block) = true;
    }
    // Ring of 4, 4 blocks; per block each rank compresses its first message, decodes, accumulates
    // and re-encodes 3 received partial sums, and decodes its own final chunk and 3 others.
    EXPECT_EQ(count[static_cast<int>(Timeline::Kind::kCompress)], 4) << "rank " << r;
    EXPECT_EQ(count[static_cast<int>(Timeline::Kind::kDar)], 4 * 3) << "rank " << r;
    EXPECT_EQ(count[static_cast<int>(Timeline::Kind::kDecompress)], 4 * 4) << "rank " << r;
    EXPECT_GT(count[static_cast<int>(Timeline::Kind::kStats)], 0);
    EXPECT_EQ(count[static_cast<int>(Timeline::Kind::kPlan)], 4);
    // The statistics messages' checksums; the blocks' messages are checksummed and verified inside
    // the codec's spans (Codec::*Checksummed, *Verified).
    EXPECT_GT(count[static_cast<int>(Timeline::Kind::kChecksum)], 0);
    EXPECT_EQ(blocks, std::vector<bool>(4, true));
    EXPECT_GT(totals[static_cast<int>(Timeline::Kind::kDar)], 0);
    const std::string trace = timelines[r].ToChromeTrace(r);
    EXPECT_TRUE(absl::StartsWith(trace, R"({"traceEvents":[{"name":")")) << trace.substr(0, 80);
    EXPECT_THAT(trace, HasSubstr(absl::StrCat(R"("ph":"X","pid":)", r, R"(,"tid":0,"ts":)")));
  }
  // Without a timeline nothing is recorded, and the results are the same bits.
  RankRun plain = RunThreads(*codec, inputs, [&](int) { return Options(Topology::kRing, 4096); });
  for (int r = 0; r < n; ++r) EXPECT_EQ(std::memcmp(plain.outputs[r].data(), run.outputs[r].data(), 4 * d), 0);
}

TEST(AllReduceTest, TinyBucketsWithEmptyChunks) {
  // Fewer super-groups than ranks: some chunks are empty and start at the bucket's end.
  for (auto [n, d] : {std::pair<int, size_t>{2, 1}, {3, 777}, {8, 300}, {5, 256}}) {
    auto inputs = Inputs(n, d);
    for (CodecId id : {CodecId::kDynamiq, CodecId::kNone, CodecId::kMxfp8, CodecId::kUniform, CodecId::kThc,
                       CodecId::kInt8, CodecId::kGlobalQsgd, CodecId::kArcTopK, CodecId::kFlash}) {
      auto codec = Make(id);
      RankRun run = RunThreads(*codec, inputs, [&](int) { return Options(Topology::kRing, 0); });
      for (int r = 0; r < n; ++r) {
        ASSERT_THAT(run.results[r], IsOk()) << kernels::CodecName(id) << " n " << n << " d " << d;
        ASSERT_EQ(run.outputs[r], run.outputs[0]);
      }
    }
  }
}

TEST(AllReduceTest, ButterflyNeedsAPowerOfTwo) {
  auto inputs = Inputs(3, 1000);
  auto codec = Make(CodecId::kDynamiq, 5);
  RankRun run = RunThreads(*codec, inputs, [&](int) { return Options(Topology::kButterfly); });
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(run.results[r], StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power-of-two")));
  }
}

TEST(AllReduceTest, InPlaceBf16Buffers) {
  const int n = 4;
  const size_t d = 4000;
  auto inputs = Inputs(n, d);
  std::vector<std::vector<uint16_t>> buffers(n, std::vector<uint16_t>(d));
  for (int r = 0; r < n; ++r) {
    for (size_t k = 0; k < d; ++k) buffers[r][k] = kernels::FloatToBf16(inputs[r][k]);
  }
  auto codec = Make(CodecId::kDynamiq, 6);
  auto transports = MakeMemoryTransports(n);
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      status[r] = AllReduce(*codec, *transports[r], Options(Topology::kRing, 1024),
                            {buffers[r].data(), kernels::DType::kBFloat16, 0, nullptr},
                            {buffers[r].data(), kernels::DType::kBFloat16, 0, nullptr}, d)
                      .status();
    });
  }
  for (auto& t : threads) t.join();
  double err = 0, norm = 0;
  for (size_t k = 0; k < d; ++k) {
    double exact = 0;
    for (int r = 0; r < n; ++r) exact += kernels::Bf16ToFloat(kernels::FloatToBf16(inputs[r][k]));
    const double got = kernels::Bf16ToFloat(buffers[0][k]);
    err += (got - exact) * (got - exact);
    norm += exact * exact;
  }
  for (int r = 0; r < n; ++r) ASSERT_THAT(status[r], IsOk());
  EXPECT_LT(err / norm, 5e-3);  // 16 super-groups only: a coarse allocation
  for (int r = 1; r < n; ++r) EXPECT_EQ(buffers[r], buffers[0]);
}

// Forwards to another transport, as Gloo would: one buffer per message (no scatter/gather), or
// with `flip_body` scatter/gather whose first split message has a byte of its body flipped.
class Forwarding final : public testing::WrappedTransport {
 public:
  Forwarding(std::unique_ptr<Transport> inner, bool flip_body) : WrappedTransport(std::move(inner)), flip_(flip_body) {}
  std::string name() const override { return "forwarding"; }
  bool SupportsParts() const override { return flip_; }
  absl::StatusOr<Handle> PostSendParts(int peer, uint64_t tag,
                                       absl::Span<const absl::Span<const uint8_t>> parts) override {
    std::vector<uint8_t>& message = sent_.emplace_back();
    for (absl::Span<const uint8_t> part : parts) message.insert(message.end(), part.begin(), part.end());
    if (parts.size() == 2 && !parts[1].empty() && !flipped_) {
      message[parts[0].size()] ^= 0x10;
      flipped_ = true;
    }
    return inner().PostSend(peer, tag, message);
  }
  absl::StatusOr<Handle> PostRecvParts(int peer, uint64_t tag, absl::Span<const absl::Span<uint8_t>> parts) override {
    return inner().PostRecvParts(peer, tag, parts);
  }

 private:
  const bool flip_;
  bool flipped_ = false;
  std::deque<std::vector<uint8_t>> sent_;  // what the memory transport copies from
};

// none's message bodies stay where the values are (sent from the input, summed and received into
// the output) where the transport has scatter/gather: the exact sums, and the very bytes and
// results of the copying path, in place or not, through a ParallelCodec too. The two-shot sends the
// input's body n - 1 times at once.
TEST(AllReduceTest, NoneBodiesInPlaceGiveTheCopyingPathsResults) {
  const int n = 4;
  const size_t d = 50000;
  auto inputs = Inputs(n, d, 9);
  auto none = Make(CodecId::kNone);
  common::ThreadPool pool(2);
  const kernels::ParallelCodec parallel(*none, &pool);
  for (Topology topology : {Topology::kRing, Topology::kButterfly, Topology::kTwoShot}) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(absl::StrCat(TopologyName(topology), in_place ? " in place" : ""));
      std::vector<std::vector<std::vector<float>>> outputs(2);  // [parts?][rank]
      std::vector<std::vector<uint64_t>> sent(2, std::vector<uint64_t>(n));
      for (int parts = 0; parts < 2; ++parts) {
        auto transports = MakeMemoryTransports(n);
        outputs[parts] = inputs;
        std::vector<std::thread> threads;
        std::vector<absl::Status> status(n);
        for (int r = 0; r < n; ++r) {
          if (parts == 0) transports[r] = std::make_unique<Forwarding>(std::move(transports[r]), false);
          threads.emplace_back([&, r] {
            kernels::Source src{in_place ? outputs[parts][r].data() : inputs[r].data(), kernels::DType::kFloat32, 0,
                                nullptr};
            kernels::Dest dst{outputs[parts][r].data(), kernels::DType::kFloat32, 0, nullptr};
            auto result = AllReduce(parallel, *transports[r], Options(topology, 4096), src, dst, d);
            status[r] = result.status();
            if (result.ok()) sent[parts][r] = result->bytes_sent;
          });
        }
        for (auto& t : threads) t.join();
        for (int r = 0; r < n; ++r) ASSERT_THAT(status[r], IsOk());
      }
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(std::memcmp(outputs[1][r].data(), outputs[0][r].data(), 4 * d), 0) << r;
        EXPECT_EQ(sent[1][r], sent[0][r]) << r;
      }
      for (size_t k = 0; k < d; k += 997) {
        double exact = 0;
        for (int r = 0; r < n; ++r) exact += inputs[r][k];
        EXPECT_NEAR(outputs[1][0][k], exact, 1e-4 * (1 + std::abs(exact))) << k;
      }
    }
  }
}

// A body corrupted in transit fails the collective with DATA_LOSS, as a whole message would.
TEST(AllReduceTest, ACorruptedBodyInPlaceFailsItsChecksum) {
  const int n = 3;
  const size_t d = 20000;
  auto inputs = Inputs(n, d, 4);
  auto none = Make(CodecId::kNone);
  auto transports = MakeMemoryTransports(n);
  transports[1] = std::make_unique<Forwarding>(std::move(transports[1]), true);
  std::vector<std::vector<float>> outputs = inputs;
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      AllReduceOptions o = Options(Topology::kRing);
      o.timeout = absl::Seconds(5);
      status[r] = AllReduce(*none, *transports[r], o, {inputs[r].data(), kernels::DType::kFloat32, 0, nullptr},
                            {outputs[r].data(), kernels::DType::kFloat32, 0, nullptr}, d)
                      .status();
    });
  }
  for (auto& t : threads) t.join();
  // Rank 1's first split message goes to rank 2.
  EXPECT_THAT(status[2], StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr("from rank 1"), HasSubstr("checksum"))));
}

TEST(AllReduceTest, GlooLoopbackMatchesTheInMemoryTransportBitForBit) {
  // Ranks as threads over real loopback TCP (Gloo): same schedule, same bytes, same results.
  const int n = 4;
  const size_t d = 50000;
  auto inputs = Inputs(n, d, 5);
  InMemoryStore store;
  std::vector<std::unique_ptr<Transport>> gloo(n);
  {
    std::vector<std::thread> threads;
    std::vector<absl::Status> status(n);
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        auto t = ConnectGlooTransport(store, r, n, GlooTransportOptions{});
        status[r] = t.status();
        if (t.ok()) gloo[r] = std::move(t).value();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) ASSERT_THAT(status[r], IsOk());
  }
  for (CodecId id : {CodecId::kNone, CodecId::kDynamiq, CodecId::kMxfp8}) {
    for (Topology topology : {Topology::kRing, Topology::kButterfly}) {
      auto codec = Make(id);
      RankRun memory = RunThreads(*codec, inputs, [&](int) { return Options(topology, 8192); });
      std::vector<std::vector<float>> out(n, std::vector<float>(d));
      std::vector<absl::Status> status(n);
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          status[r] = AllReduce(*codec, *gloo[r], Options(topology, 8192),
                                {inputs[r].data(), kernels::DType::kFloat32, 0, nullptr},
                                {out[r].data(), kernels::DType::kFloat32, 0, nullptr}, d)
                          .status();
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < n; ++r) {
        ASSERT_THAT(status[r], IsOk()) << kernels::CodecName(id);
        ASSERT_EQ(out[r], memory.outputs[r]) << kernels::CodecName(id) << " " << TopologyName(topology);
      }
    }
  }
}

// Two-shot (engine/schedule.h): n - 1 sends and n - 1 receives per rank in each of its two steps.
// Every rank ends with the same bits, the simulator's; with none, the exact sum in the owner's
// order: its own values, then its children's in the order they are listed (ranks o - 1, o - 2, ...).
// 300 elements: a chunk of one super-group, a short one and empty ones.
TEST(AllReduceTest, TwoShotIsBitIdenticalOnEveryRankAndTheSimulators) {
  for (CodecId id : {CodecId::kNone, CodecId::kBf16, CodecId::kInt8, CodecId::kDynamiq}) {
    auto codec = Make(id, 5);
    for (auto [n, d] : {std::pair{2, size_t{20000}}, std::pair{3, size_t{20000}}, std::pair{4, size_t{20000}},
                        std::pair{4, size_t{300}}}) {
      auto inputs = Inputs(n, d, 13 + n);
      for (size_t block : {size_t{0}, size_t{4096}}) {
        SCOPED_TRACE(absl::StrCat(kernels::CodecName(id), " n=", n, " d=", d, " block=", block));
        RankRun run = RunThreads(*codec, inputs, [&](int) { return Options(Topology::kTwoShot, block); });
        for (int r = 0; r < n; ++r) {
          ASSERT_THAT(run.results[r], IsOk());
          EXPECT_EQ(run.results[r]->topology, Topology::kTwoShot);
          ASSERT_EQ(0, std::memcmp(run.outputs[r].data(), run.outputs[0].data(), d * sizeof(float))) << "rank " << r;
        }
        if (id == CodecId::kNone) {
          const size_t b = block == 0 ? d : block;
          for (size_t begin = 0; begin < d; begin += b) {
            const size_t count = std::min(b, d - begin);
            for (int c = 0; c < n; ++c) {
              const int owner = (c + n - 1) % n;
              const kernels::ChunkRef ch = ChunkOf(count, n, c);
              for (size_t k = begin + ch.begin; k < begin + ch.begin + ch.count; ++k) {
                float acc = inputs[owner][k];
                for (int i = 1; i < n; ++i) acc = acc + inputs[(owner - i + n) % n][k];
                ASSERT_EQ(run.outputs[0][k], acc) << "element " << k;
              }
            }
          }
        }
        if (block == 0) {  // one block: the simulator's collective, statistics exchange included
          auto schedule = MakeSchedule(Topology::kTwoShot, n);
          ASSERT_THAT(schedule, IsOk());
          std::vector<std::vector<float>> sim(n, std::vector<float>(d));
          std::vector<kernels::Source> in;
          std::vector<kernels::Dest> out;
          for (int r = 0; r < n; ++r) {
            in.push_back({inputs[r].data(), kernels::DType::kFloat32, 0, nullptr});
            out.push_back({sim[r].data(), kernels::DType::kFloat32, 0, nullptr});
          }
          ASSERT_THAT(SimulateAllReduce(*codec, *schedule, d, 3 * 1048576, in, out), IsOk());
          EXPECT_EQ(0, std::memcmp(run.outputs[0].data(), sim[0].data(), d * sizeof(float)));
        }
        // The sum, compressed (int8 clips the heavy tail at +-6 sigma: 1-3e-2 here, as on the ring).
        if (id != CodecId::kNone && d > 300) {
          EXPECT_LT(bench::Vnmse(run.outputs[0].data(), bench::ExactSum(inputs)), id == CodecId::kInt8 ? 0.1 : 1e-2);
        }
      }
    }
  }
}

// Over real loopback TCP (engine/tcp_transport.h), where the n - 1 messages of a step arrive in
// any order and interleave with the next blocks': the in-memory transport's bits, on every rank.
TEST(AllReduceTest, TwoShotOverTcpLoopbackMatchesTheInMemoryTransportBitForBit) {
  const size_t d = 50000;
  for (int n : {2, 3, 4}) {
    auto inputs = Inputs(n, d, 17);
    InMemoryStore store;
    std::vector<std::unique_ptr<Transport>> tcp(n);
    {
      std::vector<std::thread> threads;
      std::vector<absl::Status> status(n);
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          TcpTransportOptions o;
          o.hostname = "127.0.0.1";
          o.timeout = absl::Seconds(20);
          auto t = ConnectTcpTransport(store, r, n, o);
          status[r] = t.status();
          if (t.ok()) tcp[r] = std::move(t).value();
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < n; ++r) ASSERT_THAT(status[r], IsOk());
    }
    for (CodecId id : {CodecId::kNone, CodecId::kBf16, CodecId::kInt8, CodecId::kDynamiq}) {
      SCOPED_TRACE(absl::StrCat(kernels::CodecName(id), " n=", n));
      auto codec = Make(id, 5);
      RankRun memory = RunThreads(*codec, inputs, [&](int) { return Options(Topology::kTwoShot, 8192); });
      std::vector<std::vector<float>> out(n, std::vector<float>(d, NAN));
      std::vector<absl::Status> status(n);
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          status[r] = AllReduce(*codec, *tcp[r], Options(Topology::kTwoShot, 8192),
                                {inputs[r].data(), kernels::DType::kFloat32, 0, nullptr},
                                {out[r].data(), kernels::DType::kFloat32, 0, nullptr}, d)
                          .status();
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < n; ++r) {
        ASSERT_THAT(memory.results[r], IsOk());
        ASSERT_THAT(status[r], IsOk()) << "rank " << r;
        ASSERT_EQ(0, std::memcmp(out[r].data(), memory.outputs[r].data(), d * sizeof(float))) << "rank " << r;
        ASSERT_EQ(0, std::memcmp(out[r].data(), out[0].data(), d * sizeof(float))) << "rank " << r;
      }
    }
  }
}

TEST(AllReduceTest, TwoShotNeedsACodecThatSumsSeveralChildren) {
  auto thc = Make(CodecId::kThc);
  auto inputs = Inputs(3, 4096);
  RankRun run = RunThreads(*thc, inputs, [&](int) { return Options(Topology::kTwoShot); });
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(run.results[r],
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not support the two_shot topology")));
  }
}

}  // namespace
}  // namespace dynamiq::engine

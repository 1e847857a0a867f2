// HostDataPath (server/host_data_path.h): the local reduce and write-back of CPU nodes, its codec
// thread pool, and how its cross-node step composes error feedback and the error probe. (The
// decorators have their own tests; the daemon's multi-node tests cover the rest.)
#include "server/host_data_path.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "bench/synthetic_gradients.h"
#include "common/thread_pool.h"
#include "engine/memory_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_registry.h"
#include "server/error_feedback.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::ElementsAre;

DataPath::Region Fp32(std::vector<float>& v) {
  return {reinterpret_cast<uint8_t*>(v.data()), kernels::DType::kFloat32, false};
}
DataPath::Region Bf16(std::vector<uint16_t>& v) {
  return {reinterpret_cast<uint8_t*>(v.data()), kernels::DType::kBFloat16, false};
}

TEST(HostDataPathTest, SumsInPlaceInTheFirstFp32BufferAndWritesEveryOutput) {
  HostDataPath path("j", absl::Seconds(1));
  std::vector<float> a = {1, 2, 4}, b = {10, 20, 40};
  std::vector<uint16_t> c = {kernels::FloatToBf16(100), kernels::FloatToBf16(200), kernels::FloatToBf16(400)};
  const DataPath::Region inputs[] = {Fp32(a), Fp32(b), Bf16(c)};
  ASSERT_THAT(path.LocalReduce(inputs, 3), IsOk());
  EXPECT_THAT(a, ElementsAre(111, 222, 444));  // the sum lives in local rank 0's buffer
  const DataPath::Output outputs[] = {{Fp32(a), true}, {Fp32(b), false}, {Bf16(c), false}};
  ASSERT_THAT(path.WriteBack(outputs, 3, 0.5f), IsOk());
  EXPECT_THAT(a, ElementsAre(55.5, 111, 222));
  EXPECT_THAT(b, ElementsAre(111, 222, 444));
  EXPECT_EQ(kernels::Bf16ToFloat(c[2]), 444);  // exact in bf16
}

TEST(HostDataPathTest, ABf16FirstBufferSumsInScratch) {
  HostDataPath path("j", absl::Seconds(1));
  std::vector<uint16_t> c = {kernels::FloatToBf16(1), kernels::FloatToBf16(2)};
  std::vector<float> a = {0.5, 0.25};
  const DataPath::Region inputs[] = {Bf16(c), Fp32(a)};
  ASSERT_THAT(path.LocalReduce(inputs, 2), IsOk());
  EXPECT_THAT(a, ElementsAre(0.5, 0.25));  // inputs other than the sum's home are read only
  const DataPath::Output outputs[] = {{Bf16(c), false}, {Fp32(a), false}};
  ASSERT_THAT(path.WriteBack(outputs, 2, 1.0f), IsOk());
  EXPECT_THAT(a, ElementsAre(1.5, 2.25));
  EXPECT_EQ(kernels::Bf16ToFloat(c[0]), 1.5);
}

TEST(HostDataPathTest, WeightsScaleEachRegionAndWeightsOfOneAddTheValuesAsTheyAre) {
  HostDataPath path("j", absl::Seconds(1));
  std::vector<float> a = {1, 2}, b = {10, 20}, c = {0.1f, 0.3f};
  std::vector<uint16_t> h = {kernels::FloatToBf16(4), kernels::FloatToBf16(8)};
  DataPath::Region ra = Fp32(a), rb = Fp32(b), rh = Bf16(h);
  ra.weight = 2;
  rb.weight = 0;
  rh.weight = 0.5f;
  const DataPath::Region weighted[] = {ra, rb, rh};
  ASSERT_THAT(path.LocalReduce(weighted, 2), IsOk());
  EXPECT_THAT(a, ElementsAre(4, 8));  // 2a + 0b + h/2
  // A bf16 first region sums in scratch with its weight too.
  std::vector<float> d = {1, 1};
  DataPath::Region first = Bf16(h), rd = Fp32(d);
  first.weight = 0.25f;
  const DataPath::Region bf16_first[] = {first, rd};
  ASSERT_THAT(path.LocalReduce(bf16_first, 2), IsOk());
  const DataPath::Output out[] = {{Fp32(d), false}};
  ASSERT_THAT(path.WriteBack(out, 2, 1.0f), IsOk());
  EXPECT_THAT(d, ElementsAre(2, 3));
  // Weights of 1: bit for bit the unweighted sum (not a multiply by 1.0 that could differ).
  std::vector<float> x = {0.1f, 0.7f}, y = {0.2f, 1e-8f};
  const DataPath::Region ones[] = {Fp32(x), Fp32(y)};
  ASSERT_THAT(path.LocalReduce(ones, 2), IsOk());
  EXPECT_EQ(x[0], 0.1f + 0.2f);
  EXPECT_EQ(x[1], 0.7f + 1e-8f);
  // Not a weight: refused.
  for (float bad : {-1.0f, std::nanf(""), float{INFINITY}}) {
    DataPath::Region r = Fp32(c);
    r.weight = bad;
    const DataPath::Region inputs[] = {r};
    EXPECT_THAT(path.LocalReduce(inputs, 2), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

TEST(HostDataPathTest, RefusesDeviceRegionsAndStepsOutOfOrder) {
  HostDataPath path("j", absl::Seconds(1));
  std::vector<float> a = {1};
  DataPath::Region device = Fp32(a);
  device.device = true;
  const DataPath::Region inputs[] = {device};
  EXPECT_THAT(path.LocalReduce(inputs, 1), StatusIs(absl::StatusCode::kInvalidArgument));
  const DataPath::Output outputs[] = {{Fp32(a), false}};
  EXPECT_THAT(path.WriteBack(outputs, 1, 1.0f), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// Three nodes' CrossNode of `d` synthetic values with DynamiQ, each node's path splitting its codec
// work across `pool` (null: none): every node's sum afterwards.
std::vector<std::vector<float>> CrossNodeSums(size_t d, const std::shared_ptr<common::ThreadPool>& pool) {
  constexpr int kNodes = 3;
  bench::SyntheticOptions synthetic;
  synthetic.workers = kNodes;
  synthetic.elements = d;
  std::vector<std::vector<float>> sums = bench::SyntheticGradients(synthetic);
  absl::StatusOr<std::unique_ptr<kernels::Codec>> codec = kernels::CreateCodec(kernels::CodecConfig{});
  EXPECT_THAT(codec, IsOk());
  auto transports = engine::MakeMemoryTransports(kNodes);
  std::vector<std::thread> nodes;
  for (int r = 0; r < kNodes; ++r) {
    nodes.emplace_back([&, r] {
      HostDataPath path("j", absl::Seconds(10), pool);
      const DataPath::Region inputs[] = {Fp32(sums[r])};
      ASSERT_THAT(path.LocalReduce(inputs, d), IsOk());
      engine::AllReduceOptions options;
      options.sequence = 7;
      options.timeout = absl::Seconds(20);
      EXPECT_THAT(path.CrossNode(**codec, *transports[r], options, d, 0.0), IsOk());
    });
  }
  for (std::thread& t : nodes) t.join();
  return sums;
}

TEST(HostDataPathTest, CodecThreadsGiveTheSumOfOneThread) {
  const size_t d = 3 * 50000 + 7;
  const std::vector<std::vector<float>> one = CrossNodeSums(d, nullptr);
  for (int threads : {2, 3, 8}) {
    auto pool = std::make_shared<common::ThreadPool>(threads);
    const std::vector<std::vector<float>> split = CrossNodeSums(d, pool);
    EXPECT_GT(pool->split_calls(), 0u) << threads << " threads: the engine's codec calls did not use the pool";
    for (size_t r = 0; r < one.size(); ++r) {
      EXPECT_EQ(0, std::memcmp(split[r].data(), one[r].data(), d * sizeof(float))) << threads << " threads, node " << r;
    }
  }
}

TEST(HostDataPathTest, TheProbeMeasuresWhatErrorFeedbackDelivers) {
  // probe(feedback(engine)): the dense first step of error feedback is exact, so its probe reads 0
  // (a probe inside the feedback would see codec none and sample nothing); a later compressed step
  // reads the same error > 0 on every node.
  constexpr int kNodes = 2;
  const size_t d = 8 * 256;
  kernels::CodecConfig config;
  config.id = kernels::CodecId::kArcTopK;
  config.bits = 0.25;
  auto codec = kernels::CreateCodec(config);
  ASSERT_THAT(codec, IsOk());
  auto transports = engine::MakeMemoryTransports(kNodes);
  std::vector<std::vector<std::optional<double>>> vnmse(kNodes);
  std::vector<std::thread> nodes;
  for (int r = 0; r < kNodes; ++r) {
    nodes.emplace_back([&, r] {
      HostDataPath path("j", absl::Seconds(20));
      ErrorFeedback feedback(size_t{1} << 20);
      std::mt19937 rng(11 + r);
      std::normal_distribution<float> dist;
      for (uint64_t seq = 1; seq <= 2; ++seq) {
        std::vector<float> sum(d);
        for (float& x : sum) x = dist(rng);
        const DataPath::Region inputs[] = {Fp32(sum)};
        ASSERT_THAT(path.LocalReduce(inputs, d), IsOk());
        auto state = feedback.Get("t", d, 1, seq);
        ASSERT_THAT(state, IsOk());
        path.SetErrorFeedback(*state, 1.0);
        engine::AllReduceOptions options;
        options.sequence = seq;
        options.timeout = absl::Seconds(20);
        auto result = path.CrossNode(**codec, *transports[r], options, d, /*error_sample_rate=*/1.0);
        ASSERT_THAT(result, IsOk());
        EXPECT_THAT(result->probe_status, IsOk());
        EXPECT_FALSE(result->regroup);
        vnmse[r].push_back(result->vnmse);
      }
    });
  }
  for (std::thread& t : nodes) t.join();
  for (int r = 0; r < kNodes; ++r) {
    ASSERT_EQ(vnmse[r].size(), 2u) << r;
    ASSERT_TRUE(vnmse[r][0].has_value() && vnmse[r][1].has_value()) << r;
    EXPECT_EQ(*vnmse[r][0], 0.0) << "node " << r << ": the dense first step";
    EXPECT_GT(*vnmse[r][1], 0.0) << r;
    EXPECT_EQ(*vnmse[r][1], *vnmse[0][1]) << "every node holds the same result and the same exact sum";
  }
}

}  // namespace
}  // namespace dynamiq::server

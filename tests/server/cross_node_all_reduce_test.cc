// EngineCrossNodeAllReduce (server/cross_node_all_reduce.h): the plain algorithm is the engine's
// all-reduce in place, bit for bit, with its bytes, schedule and selection reported.
#include "server/cross_node_all_reduce.h"

#include <cstring>
#include <random>
#include <vector>

#include "engine/memory_transport.h"
#include "gtest/gtest.h"
#include "tests/server/all_reduce_test_util.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::OnEveryNode;
using ::dynamiq::testing::TestCodec;

TEST(EngineCrossNodeAllReduceTest, IsTheEnginesAllReduceInPlace) {
  constexpr int kNodes = 3;
  constexpr size_t kD = 5 * 256 + 11;
  std::mt19937 rng(4);
  std::normal_distribution<float> dist;
  std::vector<std::vector<float>> inputs(kNodes, std::vector<float>(kD));
  for (auto& v : inputs) {
    for (float& x : v) x = dist(rng);
  }
  auto codec = TestCodec(kernels::CodecId::kArcTopK, 0.5);
  // The same collective twice: through the engine directly (out of place), then through Run.
  std::vector<std::vector<float>> direct(kNodes, std::vector<float>(kD)), ran = inputs;
  std::vector<engine::AllReduceResult> direct_results(kNodes);
  std::vector<CrossNodeAllReduce::Outcome> outcomes(kNodes);
  // A mesh each, so the second run's messages (same sequence, same tags) never meet the first's.
  auto transports = engine::MakeMemoryTransports(kNodes), again = engine::MakeMemoryTransports(kNodes);
  OnEveryNode(kNodes, [&](int r) {
    engine::AllReduceOptions o;
    o.sequence = 3;
    o.timeout = absl::Seconds(20);
    o.keep_plan_widths = true;
    auto d = engine::AllReduce(*codec, *transports[r], o, {inputs[r].data(), kernels::DType::kFloat32, 0, nullptr},
                               {direct[r].data(), kernels::DType::kFloat32, 0, nullptr}, kD);
    ASSERT_THAT(d, IsOk());
    direct_results[r] = *d;
    EngineCrossNodeAllReduce engine;
    auto out = engine.Run(*codec, *again[r], o, ran[r].data(), kD);
    ASSERT_THAT(out, IsOk());
    outcomes[r] = *out;
  });
  for (int r = 0; r < kNodes; ++r) {
    EXPECT_EQ(0, std::memcmp(ran[r].data(), direct[r].data(), kD * sizeof(float))) << r;
    EXPECT_EQ(outcomes[r].bytes_sent, direct_results[r].bytes_sent) << r;
    EXPECT_EQ(outcomes[r].topology, direct_results[r].topology) << r;
    EXPECT_EQ(outcomes[r].plan_widths, direct_results[r].plan_widths) << r;
    EXPECT_EQ(outcomes[r].plan_widths.size(), 6u) << r;
    EXPECT_FALSE(outcomes[r].vnmse.has_value());
  }
}

}  // namespace
}  // namespace dynamiq::server

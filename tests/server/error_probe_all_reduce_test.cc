// ErrorProbeAllReduce (server/error_probe_all_reduce.h) around fake inner algorithms whose results
// are known, over in-memory transports: the vNMSE it reports, when it samples, and how a failed
// measurement is reported without failing the collective.
#include "server/error_probe_all_reduce.h"

#include <thread>
#include <vector>

#include "engine/memory_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/error_probe.h"
#include "tests/server/all_reduce_test_util.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::OnEveryNode;
using ::dynamiq::testing::StatusIs;
using ::dynamiq::testing::TestCodec;
using ::testing::ElementsAreArray;

constexpr size_t kN = 512;
constexpr uint64_t kSequence = 7;

// A "cross-node all-reduce" of `nodes` nodes holding the same values that talks to no one: the
// exact sum (nodes * data) plus `delta`, or `fail` when set. Records what it was called with.
class PerturbedSum final : public CrossNodeAllReduce {
 public:
  PerturbedSum(int nodes, std::vector<float> delta) : nodes_(nodes), delta_(std::move(delta)) {}
  absl::StatusOr<Outcome> Run(const kernels::Codec& codec, engine::Transport&, const engine::AllReduceOptions& options,
                              float* data, size_t n) override {
    ++calls;
    sequence = options.sequence;
    codec_id = codec.id();
    if (!fail.ok()) return fail;
    for (size_t i = 0; i < n; ++i) data[i] = static_cast<float>(nodes_) * data[i] + delta_[i];
    Outcome out;
    out.bytes_sent = 1234;
    out.topology = engine::Topology::kButterfly;
    return out;
  }
  int calls = 0;
  uint64_t sequence = 0;
  kernels::CodecId codec_id = kernels::CodecId::kNone;
  absl::Status fail;

 private:
  const int nodes_;
  const std::vector<float> delta_;
};

// x = (3, 4, 0, ...): ||x||^2 = 25.
std::vector<float> Values() {
  std::vector<float> x(kN, 0.0f);
  x[0] = 3;
  x[1] = 4;
  return x;
}

engine::AllReduceOptions Options() {
  engine::AllReduceOptions o;
  o.sequence = kSequence;
  o.timeout = absl::Seconds(20);
  return o;
}

TEST(ErrorProbeAllReduceTest, ReportsTheVnmseOfTheInnerResultAgainstTheExactSum) {
  // Two nodes with x each: the exact sum is 2x (||2x||^2 = 100); the inner adds 0.5 to one value
  // and -1 to another, so vNMSE = (0.25 + 1) / 100 on both.
  std::vector<float> delta(kN, 0.0f);
  delta[0] = 0.5f;
  delta[kN - 1] = -1.0f;
  auto codec = TestCodec(kernels::CodecId::kDynamiq);
  auto transports = engine::MakeMemoryTransports(2);
  std::vector<absl::StatusOr<CrossNodeAllReduce::Outcome>> outcomes(2, absl::UnknownError("not run"));
  std::vector<std::vector<float>> results(2);
  std::vector<PerturbedSum> inners(2, PerturbedSum(2, delta));
  OnEveryNode(2, [&](int r) {
    ErrorProbeAllReduce probe(inners[r], "job", /*rate=*/1.0, absl::Seconds(20));
    results[r] = Values();
    outcomes[r] = probe.Run(*codec, *transports[r], Options(), results[r].data(), kN);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_THAT(outcomes[r], IsOk());
    const CrossNodeAllReduce::Outcome& out = *outcomes[r];
    EXPECT_THAT(out.probe_status, IsOk());
    EXPECT_FALSE(out.regroup);
    ASSERT_TRUE(out.vnmse.has_value()) << r;
    EXPECT_DOUBLE_EQ(*out.vnmse, 1.25 / 100) << r;
    EXPECT_GT(out.probe_seconds, 0) << r;
    // The inner's outcome and result come through as they are.
    EXPECT_EQ(out.bytes_sent, 1234u);
    EXPECT_EQ(out.topology, engine::Topology::kButterfly);
    EXPECT_EQ(results[r][0], 6.5f);
    EXPECT_EQ(results[r][kN - 1], -1.0f);
    EXPECT_EQ(inners[r].calls, 1);
    EXPECT_EQ(inners[r].sequence, kSequence) << "the collective runs under its own sequence";
    EXPECT_EQ(inners[r].codec_id, kernels::CodecId::kDynamiq);
  }
}

TEST(ErrorProbeAllReduceTest, TheSideAllReduceIsTheEnginesExactOneUnderTheProbeSequence) {
  // The peer does by hand what the contract says the probe does: engine::AllReduce with codec
  // none of its copy under ErrorProbeSequence, without a side lane. The probe's side all-reduce
  // meets it (any other codec, sequence or side lane would fail the step headers).
  auto codec = TestCodec(kernels::CodecId::kArcTopK);
  auto none = TestCodec(kernels::CodecId::kNone);
  auto transports = engine::MakeMemoryTransports(2);
  PerturbedSum inner(2, std::vector<float>(kN, 0.0f));
  absl::StatusOr<CrossNodeAllReduce::Outcome> outcome = absl::UnknownError("not run");
  std::thread peer([&] {
    std::vector<float> copy = Values();
    engine::AllReduceOptions o = Options();
    o.sequence = ErrorProbeSequence(kSequence);
    EXPECT_THAT(engine::AllReduce(*none, *transports[1], o, {copy.data(), kernels::DType::kFloat32, 0, nullptr},
                                  {copy.data(), kernels::DType::kFloat32, 0, nullptr}, kN),
                IsOk());
    EXPECT_EQ(copy[1], 8.0f);
  });
  std::vector<float> x = Values();
  double side[1] = {1.0};
  engine::AllReduceOptions o = Options();
  o.side_sums = absl::MakeSpan(side);  // the collective's, not the measurement's
  ErrorProbeAllReduce probe(inner, "job", 1.0, absl::Seconds(20));
  outcome = probe.Run(*codec, *transports[0], o, x.data(), kN);
  peer.join();
  ASSERT_THAT(outcome, IsOk());
  EXPECT_THAT(outcome->probe_status, IsOk());
  ASSERT_TRUE(outcome->vnmse.has_value());
  EXPECT_EQ(*outcome->vnmse, 0.0);
}

TEST(ErrorProbeAllReduceTest, UnsampledCollectivesAreTheInnerAlone) {
  // One node of two runs: a side all-reduce would wait for its deadline and report a failure.
  auto transports = engine::MakeMemoryTransports(2);
  const auto dynamiq = TestCodec(kernels::CodecId::kDynamiq), none = TestCodec(kernels::CodecId::kNone);
  struct Case {
    const kernels::Codec* codec;
    double rate;
  };
  for (const Case& c : {Case{dynamiq.get(), 0.0}, Case{none.get(), 1.0}}) {
    PerturbedSum inner(1, std::vector<float>(kN, 1.0f));
    ErrorProbeAllReduce probe(inner, "job", c.rate, absl::Milliseconds(200));
    std::vector<float> x = Values();
    auto out = probe.Run(*c.codec, *transports[0], Options(), x.data(), kN);
    ASSERT_THAT(out, IsOk());
    EXPECT_EQ(inner.calls, 1);
    EXPECT_FALSE(out->vnmse.has_value());
    EXPECT_THAT(out->probe_status, IsOk());
    EXPECT_FALSE(out->regroup);
    EXPECT_EQ(out->probe_seconds, 0);
    EXPECT_EQ(x[0], 4.0f);
  }
}

TEST(ErrorProbeAllReduceTest, AnInnerErrorIsTheCollectivesAndNoMeasurementRuns) {
  auto codec = TestCodec(kernels::CodecId::kDynamiq);
  auto transports = engine::MakeMemoryTransports(2);
  PerturbedSum inner(1, std::vector<float>(kN, 0.0f));
  inner.fail = absl::DeadlineExceededError("peer 1 did not answer");
  ErrorProbeAllReduce probe(inner, "job", 1.0, absl::Seconds(20));
  std::vector<float> x = Values();
  const absl::Time start = absl::Now();
  EXPECT_THAT(probe.Run(*codec, *transports[0], Options(), x.data(), kN),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "no side all-reduce waited for its deadline";
}

TEST(ErrorProbeAllReduceTest, AFailedMeasurementKeepsTheResultAndAsksForANewGroup) {
  // The peer never runs the side all-reduce: it fails at the probe's own deadline.
  auto codec = TestCodec(kernels::CodecId::kDynamiq);
  auto transports = engine::MakeMemoryTransports(2);
  std::vector<float> delta(kN, 0.0f);
  delta[2] = 1.0f;
  PerturbedSum inner(2, delta);
  ErrorProbeAllReduce probe(inner, "job", 1.0, absl::Milliseconds(200));
  std::vector<float> x = Values();
  auto out = probe.Run(*codec, *transports[0], Options(), x.data(), kN);
  ASSERT_THAT(out, IsOk());
  EXPECT_FALSE(out->probe_status.ok());
  EXPECT_TRUE(out->regroup);
  EXPECT_FALSE(out->vnmse.has_value());
  EXPECT_GT(out->probe_seconds, 0);
  std::vector<float> expected = Values();
  for (size_t i = 0; i < kN; ++i) expected[i] = 2 * expected[i] + delta[i];
  EXPECT_THAT(x, ElementsAreArray(expected));
}

}  // namespace
}  // namespace dynamiq::server

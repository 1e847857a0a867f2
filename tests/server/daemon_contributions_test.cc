// Contribution accounting end to end (server/contributions.h): two in-process daemons on loopback,
// two workers each, driven through the worker gRPC API. Weighted all-reduce (Request::weight): with
// codec none the result is sum(w_i g_i) / sum(w_i) to fp32 rounding, identical on every worker, and
// every worker reads what was summed (contributors, the sum of the weights). The straggler view:
// a worker that submits late is named, on its node by its local rank and on the other by its node.
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::ConnectTestWorker;
using ::dynamiq::testing::ConnectTestWorkers;
using ::dynamiq::testing::DaemonTestWorker;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StartTestCluster;
using ::dynamiq::testing::TempDir;
using ::testing::HasSubstr;

constexpr size_t kElements = 3000;

float Value(size_t worker, size_t k) { return std::sin(0.01f * k * (worker + 1)) + 0.25f * worker; }

class DaemonWeightsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto cluster = StartTestCluster(dir_.path(), 2, *MakeJobConfig(GetParam(), 0, "ring", 0, "measured"));
    ASSERT_THAT(cluster, IsOk());
    daemons_ = *std::move(cluster);
    auto workers = ConnectTestWorkers(dir_.path(), 2, 2, kElements);
    ASSERT_THAT(workers, IsOk());
    workers_ = *std::move(workers);
  }

  // Every worker submits tensor `name` with its weight (none where unset), at once.
  // `late` (if set) is the worker that submits `delay` after the others.
  std::vector<grpc::Status> Run(const std::string& name, const std::vector<std::optional<double>>& weights,
                                bool average, std::vector<dynamiq::v1::AllReduceResponse>* responses,
                                std::optional<size_t> late = std::nullopt,
                                absl::Duration delay = absl::ZeroDuration()) {
    responses->assign(workers_.size(), {});
    std::vector<grpc::Status> status(workers_.size());
    std::vector<std::thread> threads;
    for (size_t w = 0; w < workers_.size(); ++w) {
      for (size_t k = 0; k < kElements; ++k) workers_[w].data()[k] = Value(w, k);
      threads.emplace_back([&, w] {
        if (late == w) absl::SleepFor(delay);
        status[w] = workers_[w].AllReduce(name, kElements, average, &(*responses)[w], std::nullopt, weights[w]);
      });
    }
    for (auto& t : threads) t.join();
    return status;
  }

  TempDir dir_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::vector<DaemonTestWorker> workers_;
};

TEST_P(DaemonWeightsTest, TheMeanIsWeightedByWhatEachWorkerSaysAndEveryWorkerReadsWhatWasSummed) {
  const bool exact = GetParam() == "none";
  const std::vector<std::optional<double>> weights = {3.0, 0.0, 1.5, 2.5};
  std::vector<dynamiq::v1::AllReduceResponse> responses;
  for (int round = 0; round < 2; ++round) {
    const std::vector<grpc::Status> status = Run("g", weights, /*average=*/true, &responses);
    double err = 0, norm = 0;
    for (size_t k = 0; k < kElements; ++k) {
      double expected = 0;
      for (size_t w = 0; w < 4; ++w) expected += *weights[w] * Value(w, k);
      expected /= 7.0;
      err += (workers_[0].data()[k] - expected) * (workers_[0].data()[k] - expected);
      norm += expected * expected;
      if (exact) ASSERT_NEAR(workers_[0].data()[k], expected, 1e-5 * (1 + std::abs(expected))) << k;
    }
    EXPECT_LT(err / norm, exact ? 1e-12 : 5e-3);
    for (size_t w = 0; w < 4; ++w) {
      ASSERT_TRUE(status[w].ok()) << w << ": " << status[w].error_message();
      EXPECT_EQ(responses[w].weight_sum(), 7.0) << w;
      EXPECT_EQ(responses[w].contributors(), 4u) << w;
      EXPECT_EQ(0, std::memcmp(workers_[w].data(), workers_[0].data(), kElements * 4)) << "worker " << w;
    }
  }
  // Without `average`: the weighted sum; every weight 0: nothing to average, zeros.
  std::vector<grpc::Status> status = Run("g", weights, /*average=*/false, &responses);
  for (const grpc::Status& s : status) ASSERT_TRUE(s.ok()) << s.error_message();
  double expected0 = 0;
  for (size_t w = 0; w < 4; ++w) expected0 += *weights[w] * Value(w, 0);
  EXPECT_NEAR(workers_[3].data()[0], expected0, exact ? 1e-5 : 0.05);
  status = Run("g", {0.0, 0.0, 0.0, 0.0}, /*average=*/true, &responses);
  for (size_t w = 0; w < 4; ++w) {
    ASSERT_TRUE(status[w].ok()) << status[w].error_message();
    EXPECT_EQ(responses[w].weight_sum(), 0.0);
    EXPECT_EQ(workers_[w].data()[7], 0.0f);
  }
  // And an unweighted collective after them: the plain mean over 4 workers, which it reports.
  status = Run("g", {std::nullopt, std::nullopt, std::nullopt, std::nullopt}, /*average=*/true, &responses);
  for (size_t w = 0; w < 4; ++w) {
    ASSERT_TRUE(status[w].ok()) << status[w].error_message();
    EXPECT_EQ(responses[w].weight_sum(), 4.0);
    EXPECT_EQ(responses[w].contributors(), 4u);
  }
  if (exact) {
    double mean = 0;
    for (size_t w = 0; w < 4; ++w) mean += Value(w, 11);
    EXPECT_NEAR(workers_[1].data()[11], mean / 4, 1e-6);
  }
}

TEST_P(DaemonWeightsTest, WorkersThatDisagreeOnWeightingFailClearlyAndTheJobGoesOn) {
  std::vector<dynamiq::v1::AllReduceResponse> responses;
  // Two workers of one node: named at once, on that node; the other node learns why.
  std::vector<grpc::Status> status = Run("g", {1.0, std::nullopt, 1.0, 1.0}, true, &responses);
  for (const grpc::Status& s : status) EXPECT_FALSE(s.ok());
  EXPECT_THAT(status[0].error_message(), HasSubstr("with a weight"));
  EXPECT_EQ(status[0].error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Two nodes: node 0 weighted, node 1 not. A different collective on the wire: both nodes fail it.
  status = Run("g", {1.0, 1.0, std::nullopt, std::nullopt}, true, &responses);
  for (const grpc::Status& s : status) EXPECT_FALSE(s.ok());
  EXPECT_THAT(status[0].error_message(), HasSubstr("different tensors"));
  // A weight that is not a sample count is refused for its worker alone, before any collective.
  dynamiq::v1::AllReduceResponse response;
  for (double bad : {-1.0, std::nan(""), double{INFINITY}}) {
    const grpc::Status refused = workers_[0].AllReduce("g", kElements, true, &response, std::nullopt, bad);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_THAT(refused.error_message(), HasSubstr("finite and >= 0")) << bad;
  }
  // The job goes on.
  status = Run("g", {2.0, 2.0, 2.0, 2.0}, true, &responses);
  for (size_t w = 0; w < 4; ++w) {
    ASSERT_TRUE(status[w].ok()) << status[w].error_message();
    EXPECT_EQ(responses[w].weight_sum(), 8.0);
  }
}

TEST_P(DaemonWeightsTest, TheStragglerViewNamesTheLateWorkerOnItsNodeAndItsNodeOnTheOther) {
  std::vector<dynamiq::v1::AllReduceResponse> responses;
  const std::vector<std::optional<double>> none(4);
  constexpr int kCollectives = 4;
  const absl::Duration delay = absl::Milliseconds(200);
  for (int i = 0; i < kCollectives; ++i) {
    for (const grpc::Status& s : Run("g", none, true, &responses, /*late=*/3, delay)) {
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
  }
  const Job::Status node0 = daemons_[0]->JobStatuses().at("job");
  const Job::Status node1 = daemons_[1]->JobStatuses().at("job");
  // Node 1's local rank 1 came last every time, about 200 ms after its local peer.
  ASSERT_TRUE(node1.local_wait_seconds.count(1)) << "node 1 names its late local rank";
  EXPECT_GE(node1.local_wait_seconds.at(1), 0.8 * kCollectives * absl::ToDoubleSeconds(delay));
  EXPECT_EQ(node1.local_wait_seconds.count(0), 0u) << "the prompt local rank is never last";
  // Node 0 waited for node 1 (from the second collective on: the first has no previous one to
  // measure from), and node 1 for itself only.
  ASSERT_TRUE(node0.node_wait_seconds.count(1)) << "node 0 names node 1";
  EXPECT_GE(node0.node_wait_seconds.at(1), 0.8 * (kCollectives - 1) * absl::ToDoubleSeconds(delay));
  EXPECT_EQ(node0.node_wait_seconds.count(0), 0u);
  EXPECT_LT(node1.node_wait_seconds.count(1) ? node1.node_wait_seconds.at(1) : 0.0, 0.05);
  // On node 0, both local workers submit together: its local waits stay small.
  double local0 = 0;
  for (const auto& [rank, seconds] : node0.local_wait_seconds) local0 += seconds;
  EXPECT_LT(local0, 0.5 * kCollectives * absl::ToDoubleSeconds(delay));
  // The same figures are Prometheus series.
  const std::string metrics0 = daemons_[0]->metrics().Render(), metrics1 = daemons_[1]->metrics().Render();
  EXPECT_THAT(metrics0, HasSubstr("dynamiq_node_wait_seconds_total{job=\"job\",node=\"1\"}"));
  EXPECT_THAT(metrics0, HasSubstr("dynamiq_node_last_ready_total{job=\"job\",node=\"1\"} 3"));
  EXPECT_THAT(metrics1, HasSubstr("dynamiq_local_last_submissions_total{job=\"job\",local_rank=\"1\"} 4"));
}

// Configuration changes travel without a round trip to node 0 per collective: a node asks the
// coordinator only at its first collective, after a failed one, and up to a change's boundary,
// which the side lane announces; the change still applies at the same collective on every node.
TEST_P(DaemonWeightsTest, ConfigurationChangesApplyTogetherWithoutAskingNodeZeroAtEveryCollective) {
  std::vector<dynamiq::v1::AllReduceResponse> responses;
  const std::vector<std::optional<double>> none(4);
  auto run = [&](int collectives) {
    for (int i = 0; i < collectives; ++i) {
      for (const grpc::Status& s : Run("g", none, true, &responses)) ASSERT_TRUE(s.ok()) << s.error_message();
    }
  };
  run(10);
  for (int node = 0; node < 2; ++node) {
    EXPECT_LE(daemons_[node]->JobStatuses().at("job").config_polls, 1u) << "node " << node;
  }
  // A change through node 1 (as dynamiqctl set-compression does).
  const std::string codec = GetParam() == "none" ? "bf16" : "none";
  absl::StatusOr<PublishedChange> published = daemons_[1]->SetCompression(
      "job", [&](const JobConfig&) { return MakeJobConfig(codec, 0, "ring", 0, "measured"); }, std::nullopt);
  ASSERT_THAT(published, IsOk());
  run(4);
  const Job::Status s0 = daemons_[0]->JobStatuses().at("job"), s1 = daemons_[1]->JobStatuses().at("job");
  EXPECT_EQ(s0.config_epoch, published->epoch);
  EXPECT_EQ(s1.config_epoch, published->epoch);
  EXPECT_LE(s0.config_polls, 4u);
  EXPECT_LE(s1.config_polls, 4u);
  EXPECT_EQ(s0.failed + s1.failed, 0u);
  // Every node ran every collective under the same epoch.
  auto r0 = daemons_[0]->FlightRecorder("job", 0), r1 = daemons_[1]->FlightRecorder("job", 0);
  ASSERT_THAT(r0, IsOk());
  ASSERT_THAT(r1, IsOk());
  ASSERT_EQ(r0->size(), r1->size());
  for (size_t i = 0; i < r0->size(); ++i) {
    EXPECT_EQ((*r0)[i].config_epoch, (*r1)[i].config_epoch) << "collective " << (*r0)[i].sequence;
  }
}

// Nodes with different numbers of workers: the unweighted mean divides by the workers of every node
// (3 here), which the side lane counts, not by nodes x this node's workers.
TEST(DaemonContributionsTest, TheMeanOfNodesWithDifferentNumbersOfWorkersDividesByAllOfThem) {
  TempDir dir;
  auto cluster = StartTestCluster(dir.path(), 2, *MakeJobConfig("none", 0, "ring", 0, "measured"));
  ASSERT_THAT(cluster, IsOk());
  std::vector<DaemonTestWorker> workers;
  for (auto [node, rank, size] : {std::tuple{0u, 0u, 1u}, {1u, 0u, 2u}, {1u, 1u, 2u}}) {
    auto w = ConnectTestWorker(absl::StrCat(dir.path(), "/node", node, ".sock"), "job", rank, size, kElements);
    ASSERT_THAT(w, IsOk());
    workers.push_back(*std::move(w));
  }
  std::vector<grpc::Status> status(3);
  std::vector<dynamiq::v1::AllReduceResponse> responses(3);
  std::vector<std::thread> threads;
  for (size_t w = 0; w < 3; ++w) {
    for (size_t k = 0; k < kElements; ++k) workers[w].data()[k] = static_cast<float>(w + 1);  // 1, 2, 3
    threads.emplace_back([&, w] { status[w] = workers[w].AllReduce("g", kElements, true, &responses[w]); });
  }
  for (auto& t : threads) t.join();
  for (size_t w = 0; w < 3; ++w) {
    ASSERT_TRUE(status[w].ok()) << status[w].error_message();
    EXPECT_EQ(workers[w].data()[0], 2.0f) << "worker " << w;  // (1 + 2 + 3) / 3
    EXPECT_EQ(responses[w].contributors(), 3u);
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, DaemonWeightsTest, ::testing::Values("none", "dynamiq"));

}  // namespace
}  // namespace dynamiq::server

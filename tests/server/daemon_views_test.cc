// Group views end to end (server/group_view.h): three in-process daemons on loopback, one worker
// each, codec none. A view of nodes 0 and 2, claimed on node 0 while the job runs, applies at its
// first collective on every node: until then all three nodes sum; from then on the members'
// collectives connect among themselves and average over their two workers (and report it), while
// node 1's worker learns at once that its node is out. Every node's status shows the view, and
// the members kept the connection they had.
#include <atomic>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::ConnectTestWorkers;
using ::dynamiq::testing::DaemonTestWorker;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StartTestCluster;
using ::dynamiq::testing::StatusIs;
using ::dynamiq::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr size_t kElements = 2048;

float Value(size_t node, size_t k) { return static_cast<float>((k % 7) + 10 * node); }

class DaemonViewsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = StartTestCluster(dir_.path(), 3, *MakeJobConfig("none", 0, "ring", 0, "measured"));
    ASSERT_THAT(cluster, IsOk());
    daemons_ = *std::move(cluster);
    auto workers = ConnectTestWorkers(dir_.path(), 3, 1, kElements);
    ASSERT_THAT(workers, IsOk());
    workers_ = *std::move(workers);
  }

  // The workers of `nodes` average tensor "g" at once.
  std::vector<grpc::Status> Run(const std::vector<uint32_t>& nodes,
                                std::vector<dynamiq::v1::AllReduceResponse>* responses) {
    responses->assign(3, {});
    std::vector<grpc::Status> status(3);
    std::vector<std::thread> threads;
    for (uint32_t node : nodes) {
      for (size_t k = 0; k < kElements; ++k) workers_[node].data()[k] = Value(node, k);
      threads.emplace_back(
          [&, node] { status[node] = workers_[node].AllReduce("g", kElements, true, &(*responses)[node]); });
    }
    for (auto& t : threads) t.join();
    return status;
  }

  TempDir dir_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::vector<DaemonTestWorker> workers_;
};

TEST_F(DaemonViewsTest, AViewClaimedWhileTheJobRunsAppliesOnEveryNodeAtItsFirstCollective) {
  std::vector<dynamiq::v1::AllReduceResponse> responses;
  std::vector<grpc::Status> status = Run({0, 1, 2}, &responses);
  for (const grpc::Status& s : status) ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(responses[1].contributors(), 3u);

  EXPECT_THAT(daemons_[0]->ChangeView("nope", {0}).status(), StatusIs(absl::StatusCode::kNotFound));
  absl::StatusOr<GroupView> view = daemons_[0]->ChangeView("job", {2, 0});
  ASSERT_THAT(view, IsOk());
  EXPECT_EQ(view->epoch(), 1u);
  EXPECT_THAT(view->members(), ElementsAre(0, 2));
  EXPECT_EQ(view->first_sequence(), 3u);  // two collectives after the next one to run (1)
  EXPECT_EQ(daemons_[0]->JobStatuses().at("job").view_epoch, 0u) << "not before its first collective";

  // Collectives 1 and 2: still every node.
  for (int i = 0; i < 2; ++i) {
    status = Run({0, 1, 2}, &responses);
    for (uint32_t node = 0; node < 3; ++node) {
      ASSERT_TRUE(status[node].ok()) << node << ": " << status[node].error_message();
      EXPECT_EQ(responses[node].contributors(), 3u);
      EXPECT_FLOAT_EQ(workers_[node].data()[5], (Value(0, 5) + Value(1, 5) + Value(2, 5)) / 3);
    }
  }
  // Collective 3: view 1, nodes 0 and 2; node 1 is out.
  status = Run({0, 1, 2}, &responses);
  EXPECT_EQ(status[1].error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status[1].error_message();
  EXPECT_THAT(status[1].error_message(), HasSubstr("node 1 is not a member of the job's view 1 (nodes 0, 2"));
  for (uint32_t node : {0u, 2u}) {
    ASSERT_TRUE(status[node].ok()) << node << ": " << status[node].error_message();
    EXPECT_EQ(responses[node].contributors(), 2u);
    for (size_t k : {0, 5, 2047}) {
      EXPECT_EQ(workers_[node].data()[k], (Value(0, k) + Value(2, k)) / 2) << node << " " << k;
    }
  }
  for (uint32_t node = 0; node < 3; ++node) {
    const Job::Status s = daemons_[node]->JobStatuses().at("job");
    EXPECT_EQ(s.view_epoch, 1u) << node;
    EXPECT_THAT(s.view_members, ElementsAre(0, 2)) << node;
  }
  // Collective 4 runs on without node 1's worker.
  status = Run({0, 2}, &responses);
  for (uint32_t node : {0u, 2u}) {
    ASSERT_TRUE(status[node].ok()) << node << ": " << status[node].error_message();
    EXPECT_EQ(responses[node].contributors(), 2u);
  }
  // View 1 kept the connection between nodes 0 and 2 that view 0 made (engine/tcp_mesh.h).
  for (uint32_t node : {0u, 2u}) {
    const std::string metrics = daemons_[node]->metrics().Render();
    EXPECT_THAT(metrics, HasSubstr("dynamiq_peer_connections_total{outcome=\"made\"} 2")) << node;
    EXPECT_THAT(metrics, HasSubstr("dynamiq_peer_connections_total{outcome=\"kept\"} 1")) << node;
  }
}

// Thirty views claimed through either node while both run small collectives back to back: each
// applies at its boundary on both nodes, no collective fails, and every view after the first runs
// over the connection the first made (fenced per view: engine/tcp_mesh.h).
TEST(DaemonViewChangesTest, ViewsClaimedWhileCollectivesRunKeepTheConnectionAndFailNothing) {
  TempDir dir;
  auto cluster = StartTestCluster(dir.path(), 2, *MakeJobConfig("none", 0, "ring", 0, "measured"));
  ASSERT_THAT(cluster, IsOk());
  auto workers = ConnectTestWorkers(dir.path(), 2, 1, kElements);
  ASSERT_THAT(workers, IsOk());
  std::atomic<bool> stop{false};
  std::atomic<int> claimed{0};
  std::thread operators([&] {
    for (int i = 0; i < 30; ++i) {
      absl::SleepFor(absl::Milliseconds(15));
      if ((*cluster)[i % 2]->ChangeView("job", {0, 1}).ok()) ++claimed;
    }
    stop = true;
  });
  int collectives = 0, failed = 0;
  std::string first_failure;
  while (!stop && collectives < 20000) {
    std::vector<grpc::Status> status(2);
    std::vector<std::thread> threads;
    for (uint32_t node = 0; node < 2; ++node) {
      threads.emplace_back([&, node] {
        dynamiq::v1::AllReduceResponse r;
        status[node] = (*workers)[node].AllReduce("g", kElements, true, &r);
      });
    }
    for (auto& t : threads) t.join();
    ++collectives;
    for (const grpc::Status& s : status) {
      if (!s.ok() && failed++ == 0) first_failure = s.error_message();
    }
  }
  operators.join();
  std::cout << collectives << " collectives, " << claimed << " views claimed, " << failed << " failed" << std::endl;
  EXPECT_GT(claimed, 5);
  EXPECT_EQ(failed, 0) << first_failure;
  // Every view that connected kept the first view's connection: none made another. Views that
  // apply at the same collective (claims faster than collectives, as under ASan) connect once, so
  // at most as many were kept as epochs ran (a view claimed after the last collective never ran).
  const uint64_t views = (*cluster)[0]->JobStatuses().at("job").view_epoch;
  for (uint32_t node = 0; node < 2; ++node) {
    const std::string metrics = (*cluster)[node]->metrics().Render();
    EXPECT_THAT(metrics, HasSubstr("dynamiq_peer_connections_total{outcome=\"made\"} 1")) << node;
    const std::string kept_series = "dynamiq_peer_connections_total{outcome=\"kept\"} ";
    const size_t at = metrics.find(kept_series);
    ASSERT_NE(at, std::string::npos) << node;
    const double kept = std::stod(metrics.substr(at + kept_series.size()));
    EXPECT_GE(kept, 1) << node;
    EXPECT_LE(kept, static_cast<double>(views)) << node;
  }
}

}  // namespace
}  // namespace dynamiq::server

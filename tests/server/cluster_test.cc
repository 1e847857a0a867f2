// Cluster (server/cluster.h): the coordinator protocol between nodes, against a real in-process
// coordinator (RendezvousService over gRPC on loopback), two nodes on two threads.
#include "server/cluster.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/rendezvous_service.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::IsOkAndHolds;
using ::dynamiq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1)); }

  Cluster::Options NodeOptions(uint32_t rank, uint32_t nodes = 2) {
    Cluster::Options o;
    o.node_rank = rank;
    o.num_nodes = nodes;
    o.coordinator = address_;
    o.timeout = absl::Seconds(10);
    return o;
  }

  // Both nodes join at once (Join returns when all have).
  void JoinTwo() {
    absl::StatusOr<std::unique_ptr<Cluster>> joined[2];
    std::thread other(
        [&] { joined[1] = Cluster::Join(NodeOptions(1), std::make_unique<GrpcStore>(address_), "10.0.0.2:7070"); });
    joined[0] = Cluster::Join(NodeOptions(0), std::make_unique<GrpcStore>(address_), "10.0.0.1:7070");
    other.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_THAT(joined[r], IsOk());
      nodes_[r] = *std::move(joined[r]);
    }
  }

  RendezvousService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<Cluster> nodes_[2];
};

TEST_F(ClusterTest, JoinGivesEveryNodeTheMembersAndStartUpSettingsAgree) {
  JoinTwo();
  EXPECT_THAT(nodes_[1]->members(), ElementsAre("10.0.0.1:7070", "10.0.0.2:7070"));
  // Node 0's sample rate applies everywhere; the device must match.
  absl::StatusOr<double> rate[2];
  std::thread other([&] { rate[1] = nodes_[1]->AgreeOnErrorSampleRate(0.5); });
  rate[0] = nodes_[0]->AgreeOnErrorSampleRate(0.25);
  other.join();
  ASSERT_THAT(rate[1], IsOk());
  EXPECT_EQ(*rate[1], 0.25);
  ASSERT_THAT(nodes_[0]->AgreeOnDevice("cpu"), IsOk());
  EXPECT_THAT(nodes_[1]->AgreeOnDevice("cuda"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("node 0 runs --device=cpu")));
  // One budget per step: all nodes or none.
  ASSERT_THAT(nodes_[0]->AgreeOnStepBudget(true), IsOk());
  EXPECT_THAT(nodes_[1]->AgreeOnStepBudget(false),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("node 0 runs --step_budget=true")));
  EXPECT_THAT(nodes_[1]->AgreeOnStepBudget(true), IsOk());
}

TEST_F(ClusterTest, JoinNamesTheMissingRankAndStopsWhenCancelled) {
  Cluster::Options o = NodeOptions(0, 3);
  o.timeout = absl::Milliseconds(1500);
  EXPECT_THAT(Cluster::Join(o, std::make_unique<GrpcStore>(address_), "a:1"),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("node ranks 1, 2 of 3 have not joined yet")));
  std::atomic<bool> cancel{true};
  o.timeout = absl::Seconds(30);
  o.cancelled = [&cancel] { return cancel.load(); };
  const absl::Time start = absl::Now();
  EXPECT_THAT(Cluster::Join(o, std::make_unique<GrpcStore>(address_), "a:1"), StatusIs(absl::StatusCode::kCancelled));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(ClusterTest, IncarnationsCountPerNodeAndTheHintNamesTheOddOneOut) {
  JoinTwo();
  EXPECT_THAT(nodes_[0]->ClaimIncarnation("j"), IsOk());
  EXPECT_EQ(nodes_[0]->IncarnationHint("j", 1),
            " (node 1 has no workers in job 'j': every node's workers must "
            "register the same job id (DQ_JOB), and every node of the cluster "
            "must have workers in it)");
  EXPECT_EQ(*nodes_[1]->ClaimIncarnation("j"), 1u);
  EXPECT_EQ(nodes_[0]->IncarnationHint("j", 1), "");
  EXPECT_EQ(*nodes_[1]->ClaimIncarnation("j"), 2u);
  EXPECT_THAT(nodes_[0]->IncarnationHint("j", 1), HasSubstr("node 1 is at incarnation 2 of job j"));
}

TEST_F(ClusterTest, ChangesBuildOnTheNewestEpochAndApplyAtTheirBoundaryOnEveryNode) {
  JoinTwo();
  const JobConfig initial = *MakeJobConfig("dynamiq", 5, "ring", 1024, "measured");
  auto set_bits = [](double bits) {
    return [bits](const JobConfig& newest) -> absl::StatusOr<JobConfig> {
      JobConfig c = newest;
      c.codec.bits = bits;
      return c;
    };
  };
  auto first = nodes_[0]->PublishConfig(
      "j", 1, initial, set_bits(4), [] { return uint64_t{3}; }, std::nullopt);
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->epoch, 1u);
  // Through the other node, on top of the staged epoch 1: its newest is epoch 1's config.
  double seen_bits = 0;
  auto second = nodes_[1]->PublishConfig(
      "j", 1, initial,
      [&](const JobConfig& newest) -> absl::StatusOr<JobConfig> {
        seen_bits = newest.codec.bits;
        JobConfig c = newest;
        c.min_compress_elements = 64;
        return c;
      },
      [] { return uint64_t{5}; }, 1);
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(second->epoch, 2u);
  EXPECT_EQ(seen_bits, 4);
  EXPECT_THAT(nodes_[0]->PublishConfig(
                  "j", 1, initial, set_bits(6), [] { return uint64_t{9}; }, 1),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("is at config epoch 2, not 1")));
  // Each node applies an epoch once its collective is reached.
  for (auto& node : nodes_) {
    uint64_t epoch = 0;
    JobConfig config = initial;
    EXPECT_THAT(node->PollConfig("j", 1, 2, &epoch, &config), IsOkAndHolds(false));
    EXPECT_THAT(node->PollConfig("j", 1, 3, &epoch, &config), IsOkAndHolds(true));
    EXPECT_EQ(epoch, 1u);
    EXPECT_EQ(config.codec.bits, 4);
    EXPECT_THAT(node->PollConfig("j", 1, 5, &epoch, &config), IsOkAndHolds(true));
    EXPECT_EQ(epoch, 2u);
    EXPECT_EQ(config.codec.bits, 4);
    EXPECT_EQ(config.min_compress_elements, 64u);
  }
  // Another incarnation starts from its own epoch 0.
  uint64_t epoch = 0;
  JobConfig config = initial;
  EXPECT_THAT(nodes_[0]->PollConfig("j", 2, 100, &epoch, &config), IsOkAndHolds(false));
}

TEST_F(ClusterTest, AFailureReportedByOneNodeIsFoundByTheOther) {
  JoinTwo();
  ASSERT_THAT(nodes_[1]->ReportFailure("j", 1, 7, absl::DeadlineExceededError("worker 3 stalled"),
                                       absl::Now() + absl::Seconds(5)),
              IsOk());
  std::optional<Cluster::Failure> failure = nodes_[0]->LookupFailure("j", 1, 7, absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(failure->node, 1u);
  EXPECT_THAT(failure->status, StatusIs(absl::StatusCode::kDeadlineExceeded, "worker 3 stalled"));
  // A node ignores its own report, and nothing is found for another collective.
  EXPECT_FALSE(nodes_[1]->LookupFailure("j", 1, 7, absl::Now() + absl::Milliseconds(200)).has_value());
  EXPECT_FALSE(nodes_[0]->LookupFailure("j", 1, 8, absl::Now() + absl::Milliseconds(200)).has_value());
}

TEST_F(ClusterTest, ALocalClusterNeedsNoCoordinator) {
  Cluster::Options o;
  std::unique_ptr<Cluster> local = Cluster::Local(o, "127.0.0.1:7070");
  EXPECT_THAT(local->members(), ElementsAre("127.0.0.1:7070"));
  EXPECT_THAT(local->AgreeOnErrorSampleRate(0.3), IsOkAndHolds(0.3));
  EXPECT_THAT(local->RejoinIfForgotten(), IsOkAndHolds(false));
  EXPECT_EQ(*local->ClaimIncarnation("j"), 1u);
  EXPECT_EQ(*local->ClaimIncarnation("j"), 2u);
}

}  // namespace
}  // namespace dynamiq::server

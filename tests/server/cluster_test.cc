// Cluster (server/cluster.h): the coordinator protocol between nodes, against a real in-process
// coordinator (RendezvousService over gRPC on loopback), two nodes on two threads.
#include "server/cluster.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/cluster_job_coordinator.h"
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

  // Each node's coordinator of incarnation `incarnation` of job `job`.
  std::vector<std::unique_ptr<ClusterJobCoordinator>> JobCoordinators(const std::string& job, uint64_t incarnation) {
    std::vector<std::unique_ptr<ClusterJobCoordinator>> coordinators;
    for (uint32_t r = 0; r < 2; ++r) {
      JobTransportSettings settings;
      settings.node_rank = r;
      settings.num_nodes = 2;
      coordinators.push_back(std::make_unique<ClusterJobCoordinator>(*nodes_[r], job, incarnation, settings));
    }
    return coordinators;
  }

  RendezvousService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<Cluster> nodes_[2];
};

TEST_F(ClusterTest, JoinGivesEveryNodeTheMembersAndStartUpSettingsAgree) {
  JoinTwo();
  EXPECT_THAT(nodes_[1]->members(), ElementsAre("10.0.0.1:7070", "10.0.0.2:7070"));
  // Node 0's sample rate applies everywhere.
  absl::StatusOr<double> rate[2];
  std::thread other([&] { rate[1] = nodes_[1]->AgreeOnErrorSampleRate(0.5); });
  rate[0] = nodes_[0]->AgreeOnErrorSampleRate(0.25);
  other.join();
  ASSERT_THAT(rate[1], IsOk());
  EXPECT_EQ(*rate[1], 0.25);
}

// Issue 44.3/44.4: the settings that change what goes between nodes are compared as a node joins.
// A node whose settings differ from node 0's is refused at once (not at its first collective, after
// --timeout), the message naming every differing setting with both values, and it never becomes a
// member: node 0 goes on waiting for a node with the right settings, which then joins in its place.
TEST_F(ClusterTest, ANodeWhoseSettingsDifferFromNodeZerosIsRefusedAtJoinAndNeverListed) {
  const NodeSettings node0 = {{"device", "cpu"}, {"transport", "tcp"}, {"arc_topk_error_feedback", "false"}};
  service_.RequireSettings(node0);
  absl::StatusOr<std::unique_ptr<Cluster>> joined0;
  Cluster::Options o0 = NodeOptions(0);
  o0.settings = node0;
  std::thread first([&] { joined0 = Cluster::Join(o0, std::make_unique<GrpcStore>(address_), "10.0.0.1:7070"); });
  Cluster::Options o1 = NodeOptions(1);
  o1.settings = {{"device", "cpu"}, {"transport", "gloo"}, {"arc_topk_error_feedback", "true"}};
  const absl::Time start = absl::Now();
  EXPECT_THAT(Cluster::Join(o1, std::make_unique<GrpcStore>(address_), "10.0.0.9:7070"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("node 0 runs --transport=tcp --arc_topk_error_feedback=false but node 1 runs "
                                 "--transport=gloo --arc_topk_error_feedback=true: every node of a cluster must run "
                                 "the same --transport and --arc_topk_error_feedback")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "refused at once, not after the timeout";
  // A node that sends no settings (an older dynamiqd) is refused too.
  Cluster::Options bare = NodeOptions(1);
  EXPECT_THAT(Cluster::Join(bare, std::make_unique<GrpcStore>(address_), "10.0.0.9:7070"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("node 1 sent none of its settings")));
  // The refused node took no place: the right one joins from another address, and is the member.
  o1.settings = node0;
  absl::StatusOr<std::unique_ptr<Cluster>> joined1 =
      Cluster::Join(o1, std::make_unique<GrpcStore>(address_), "10.0.0.2:7070");
  first.join();
  ASSERT_THAT(joined1, IsOk());
  ASSERT_THAT(joined0, IsOk());
  EXPECT_THAT((*joined0)->members(), ElementsAre("10.0.0.1:7070", "10.0.0.2:7070"));
}

// A joiner's settings reach node 0's log and the joiner's error: too many are refused, and what a
// stranger writes there is bounded and cannot break a log line.
TEST_F(ClusterTest, AJoinsSettingsAreBoundedAndMadeSafeBeforeTheyAreCompared) {
  service_.RequireSettings({{"transport", "tcp"}});
  Cluster::Options many = NodeOptions(1);
  for (int i = 0; i < 65; ++i) many.settings.emplace_back(absl::StrCat("s", i), "x");
  EXPECT_THAT(Cluster::Join(many, std::make_unique<GrpcStore>(address_), "10.0.0.9:7070"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("join with 65 settings, at most 64")));
  Cluster::Options forged = NodeOptions(1);
  forged.settings = {{"transport", "tcp\ndynamiqd: forged line" + std::string(1000, 'y')}};
  absl::StatusOr<std::unique_ptr<Cluster>> refused =
      Cluster::Join(forged, std::make_unique<GrpcStore>(address_), "10.0.0.9:7070");
  ASSERT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("tcp\\x0a")));
  EXPECT_EQ(refused.status().message().find('\n'), std::string::npos);
  EXPECT_LT(refused.status().message().size(), 900u);
}

TEST(NodeSettingsTest, TheComparisonNamesEachDifferenceAndBothValues) {
  EXPECT_THAT(CompareNodeSettings({{"a", "1"}, {"b", "2"}}, {{"a", "1"}, {"b", "2"}}, 1), IsOk());
  EXPECT_THAT(CompareNodeSettings({{"step_budget", "true"}}, {{"step_budget", "false"}}, 3),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("node 0 runs --step_budget=true but node 3 runs --step_budget=false: every node of "
                                 "a cluster must run the same --step_budget")));
  EXPECT_THAT(
      CompareNodeSettings({{"a", "1"}}, {{"a", "1"}, {"c", "x"}}, 1),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("node 0 runs --c=(unset) but node 1 runs --c=x")));
  EXPECT_THAT(CompareNodeSettings({{"a", "1"}, {"b", "1"}, {"c", "1"}}, {{"a", "2"}, {"b", "2"}, {"c", "2"}}, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("the same --a, --b and --c")));
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

// Writes the keys a transport writes for the connection of view 0 made for collective `sequence`,
// as node `rank` (through its Cluster's store, as server/cluster_job_coordinator.cc does).
void WriteRendezvousKeys(Cluster& node, uint32_t rank, const std::string& job_id, uint64_t incarnation,
                         uint64_t sequence) {
  engine::PrefixStore scoped(Cluster::RendezvousPrefix(job_id, incarnation, 0, sequence), node.store());
  ASSERT_THAT(scoped.Set(absl::StrCat("tcp/", rank), "127.0.0.1:40000"), IsOk());
}

JobConfig Initial() { return *MakeJobConfig("dynamiq", 5, "ring", 1024, "measured"); }

absl::StatusOr<PublishedChange> PublishBits(Cluster& node, const std::string& job_id, uint64_t incarnation, double bits,
                                            uint64_t apply_at) {
  return node.PublishConfig(
      job_id, incarnation, Initial(),
      [bits](const JobConfig& newest) -> absl::StatusOr<JobConfig> {
        JobConfig c = newest;
        c.codec.bits = bits;
        return c;
      },
      [apply_at] { return apply_at; }, std::nullopt);
}

// Issue 42, item 9: the coordinator's store never deleted a key, so every job id grew node 0 for
// good. A job's keys (its live keys, incarnation counts, rendezvous, configurations and failure
// reports) now go when the last node retires it: the store returns to its size after each job,
// plus one key for good (the incarnation floor).
TEST_F(ClusterTest, AJobsKeysAreDeletedWhenTheLastNodeRetiresIt) {
  JoinTwo();
  const size_t baseline = service_.KeyCount();
  uint64_t previous = 0;
  for (int i = 0; i < 1000; ++i) {
    SCOPED_TRACE(absl::StrCat("job ", i));
    const std::string job = absl::StrCat("soak/", i);  // distinct ids, as launchers make them
    absl::StatusOr<uint64_t> incarnation = nodes_[0]->ClaimIncarnation(job);
    ASSERT_THAT(incarnation, IsOk());
    EXPECT_GT(*incarnation, previous);
    previous = *incarnation;
    ASSERT_THAT(nodes_[1]->ClaimIncarnation(job), IsOkAndHolds(*incarnation));
    for (uint32_t r = 0; r < 2; ++r) WriteRendezvousKeys(*nodes_[r], r, job, *incarnation, 0);
    ASSERT_THAT(PublishBits(*nodes_[i % 2], job, *incarnation, 4, 3), IsOk());
    ASSERT_THAT(
        nodes_[1]->ReportFailure(job, *incarnation, 7, absl::AbortedError("stopped"), absl::Now() + absl::Seconds(5)),
        IsOk());
    nodes_[0]->RetireJob(job, *incarnation);
    if (i == 0) {
      // Node 1 still runs the job: nothing of it goes yet, and node 1 still reads its keys.
      EXPECT_GT(service_.KeyCount(), baseline + 5);
      uint64_t epoch = 0;
      JobConfig config = Initial();
      EXPECT_THAT(nodes_[1]->PollConfig(job, *incarnation, 3, &epoch, &config), IsOkAndHolds(true));
      EXPECT_EQ(nodes_[1]->IncarnationHint(job, *incarnation), "");
    }
    nodes_[1]->RetireJob(job, *incarnation);
    ASSERT_EQ(service_.KeyCount(), baseline + 1);
  }
  // An id used again starts afresh, above every incarnation before it (messages recorded from an
  // earlier run never fit a later one), the same on every node.
  absl::StatusOr<uint64_t> again = nodes_[0]->ClaimIncarnation("soak/0");
  ASSERT_THAT(again, IsOk());
  EXPECT_GT(*again, previous);
  EXPECT_THAT(nodes_[1]->ClaimIncarnation("soak/0"), IsOkAndHolds(*again));
  EXPECT_EQ(nodes_[0]->IncarnationHint("soak/0", *again), "");
}

// While a job runs, what its failures add is bounded too: the rendezvous keys of old connections
// (one per failed collective), this node's failure reports past the newest 64, and configuration
// epochs past the newest 16. The newest of each still work.
TEST_F(ClusterTest, ARunningJobsConnectionsFailureReportsAndEpochsAreBounded) {
  JoinTwo();
  const size_t baseline = service_.KeyCount();
  for (uint32_t r = 0; r < 2; ++r) ASSERT_THAT(nodes_[r]->ClaimIncarnation("j"), IsOkAndHolds(1u));
  const size_t started = service_.KeyCount();
  for (uint64_t g = 0; g < 300; ++g) {
    for (uint32_t r = 0; r < 2; ++r) WriteRendezvousKeys(*nodes_[r], r, "j", 1, g);
    ASSERT_THAT(nodes_[g % 2]->ReportFailure("j", 1, g, absl::DeadlineExceededError(absl::StrCat("timed out ", g)),
                                             absl::Now() + absl::Seconds(5)),
                IsOk());
  }
  for (uint64_t e = 1; e <= 100; ++e) {
    absl::StatusOr<PublishedChange> change = PublishBits(*nodes_[e % 2], "j", 1, 4 + e % 3, 10 + e);
    ASSERT_THAT(change, IsOk());
    ASSERT_EQ(change->epoch, e);
  }
  // Two connections x 2 ranks, 64 reports per node, 16 epochs and the latest epoch.
  EXPECT_LE(service_.KeyCount() - started, 4u + 2 * 64 + 16 + 1);
  // The newest connection is there to connect through, and so is the one before it.
  for (uint64_t g : {298, 299}) {
    engine::PrefixStore scoped(Cluster::RendezvousPrefix("j", 1, 0, g), nodes_[0]->store());
    EXPECT_THAT(scoped.Get("tcp/1", absl::ZeroDuration()), IsOk()) << "connection for collective " << g;
  }
  std::optional<Cluster::Failure> newest = nodes_[0]->LookupFailure("j", 1, 299, absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(newest.has_value());
  EXPECT_THAT(newest->status, StatusIs(absl::StatusCode::kDeadlineExceeded, "timed out 299"));
  // A node far behind applies the newest epoch whose boundary it reached, and does not wait for
  // the deleted ones.
  uint64_t epoch = 0;
  JobConfig config = Initial();
  const absl::Time start = absl::Now();
  EXPECT_THAT(nodes_[0]->PollConfig("j", 1, 50, &epoch, &config), IsOkAndHolds(false));
  EXPECT_THAT(nodes_[0]->PollConfig("j", 1, 1000, &epoch, &config), IsOkAndHolds(true));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(epoch, 100u);
  EXPECT_EQ(config.codec.bits, 4 + 100 % 3);
  for (uint32_t r = 0; r < 2; ++r) nodes_[r]->RetireJob("j", 1);
  EXPECT_EQ(service_.KeyCount(), baseline + 1);  // and the incarnation floor
}

// Group views (server/group_view.h) through the job's coordinator: two nodes that claim the same
// epoch at once both end with the one claimed first; a claim from a view older than the one before
// the newest is refused; the newest is what every node reads; old records go.
TEST_F(ClusterTest, GroupViewsAreClaimedOncePerEpochAndReadAlikeByEveryNode) {
  JoinTwo();
  for (uint32_t r = 0; r < 2; ++r) ASSERT_THAT(nodes_[r]->ClaimIncarnation("j"), IsOkAndHolds(1u));
  std::vector<std::unique_ptr<ClusterJobCoordinator>> coordinators = JobCoordinators("j", 1);
  const GroupView start = GroupView::Everyone(2, 0);
  EXPECT_THAT(coordinators[1]->NewestView(GroupView::Everyone(2, 1)), IsOkAndHolds(GroupView::Everyone(2, 1)));
  std::vector<absl::StatusOr<GroupView>> claimed(2, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] { claimed[r] = coordinators[r]->ClaimView(GroupView::Everyone(2, r), {r}, 10 + r); });
  }
  for (auto& t : threads) t.join();
  ASSERT_THAT(claimed[0], IsOk());
  ASSERT_THAT(claimed[1], IsOk());
  EXPECT_EQ(claimed[0]->Encode(), claimed[1]->Encode()) << "one claim per epoch";
  EXPECT_EQ(claimed[0]->epoch(), 1u);
  absl::StatusOr<GroupView> newest = coordinators[1]->NewestView(GroupView::Everyone(2, 1));
  ASSERT_THAT(newest, IsOk());
  EXPECT_EQ(newest->Encode(), claimed[0]->Encode());
  EXPECT_EQ(newest->node_rank(), 1u);
  // A late claimant of epoch 1 gets the view claimed first, not its own.
  absl::StatusOr<GroupView> late = coordinators[0]->ClaimView(start, {0, 1}, 20);
  ASSERT_THAT(late, IsOk());
  EXPECT_EQ(late->Encode(), claimed[0]->Encode());
  // Epochs go on from the newest; the store keeps the newest 16 records.
  GroupView current = *claimed[0];
  const size_t before = service_.KeyCount();
  for (uint64_t e = 2; e <= 40; ++e) {
    absl::StatusOr<GroupView> next = coordinators[e % 2]->ClaimView(current, {0, 1}, 20 + e);
    ASSERT_THAT(next, IsOk());
    ASSERT_EQ(next->epoch(), e);
    current = *next;
  }
  EXPECT_LE(service_.KeyCount() - before, 16u);
  newest = coordinators[0]->NewestView(start);
  ASSERT_THAT(newest, IsOk());
  EXPECT_EQ(newest->Encode(), "40|60|0,1");
  EXPECT_THAT(coordinators[0]->ClaimView(*claimed[0], {0}, 70).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("view 40 is the newest")));
  for (uint32_t r = 0; r < 2; ++r) nodes_[r]->RetireJob("j", 1);
}

// A collective boundary is one round trip: PollConfig reads the newest view's record with the
// configuration, and the ViewsAfter that follows uses it (once); later reads ask the store again.
TEST_F(ClusterTest, ABoundaryReadsTheConfigurationAndTheNewestViewTogether) {
  JoinTwo();
  for (uint32_t r = 0; r < 2; ++r) ASSERT_THAT(nodes_[r]->ClaimIncarnation("j"), IsOkAndHolds(1u));
  uint64_t epoch = 0;
  JobConfig config;
  std::optional<std::optional<std::string>> latest_view;
  EXPECT_THAT(nodes_[0]->PollConfig("j", 1, 1, &epoch, &config, &latest_view), IsOkAndHolds(false));
  ASSERT_TRUE(latest_view.has_value()) << "the coordinator answered";
  EXPECT_FALSE(latest_view->has_value()) << "no view claimed yet";

  std::vector<std::unique_ptr<ClusterJobCoordinator>> coordinators = JobCoordinators("j", 1);
  ASSERT_THAT(coordinators[1]->ClaimView(GroupView::Everyone(2, 1), {0}, 5), IsOk());
  ASSERT_THAT(nodes_[1]->PublishConfig(
                  "j", 1, Initial(), [](const JobConfig&) { return MakeJobConfig("bf16", 0, "ring", 0, "measured"); },
                  [] { return uint64_t{3}; }, std::nullopt),
              IsOk());
  EXPECT_THAT(nodes_[0]->PollConfig("j", 1, 3, &epoch, &config, &latest_view), IsOkAndHolds(true));
  EXPECT_EQ(epoch, 1u);
  EXPECT_EQ(latest_view, std::optional<std::optional<std::string>>(std::optional<std::string>("1")));

  // Through node 0's job coordinator: the view read at the boundary, then the store's.
  EXPECT_THAT(coordinators[0]->PollConfig(3, &epoch, &config), IsOkAndHolds(false));  // epoch 1 is known
  absl::StatusOr<std::vector<GroupView>> after = coordinators[0]->ViewsAfter(GroupView::Everyone(2, 0));
  ASSERT_THAT(after, IsOk());
  ASSERT_EQ(after->size(), 1u);
  EXPECT_EQ((*after)[0].Encode(), "1|5|0");
  ASSERT_THAT(coordinators[1]->ClaimView((*after)[0], {0, 1}, 9), IsOk());
  after = coordinators[0]->ViewsAfter(GroupView::Everyone(2, 0));
  ASSERT_THAT(after, IsOk());
  ASSERT_EQ(after->size(), 2u) << "the boundary's read is used once";
  EXPECT_EQ((*after)[1].Encode(), "2|9|0,1");
  for (uint32_t r = 0; r < 2; ++r) nodes_[r]->RetireJob("j", 1);
}

// A job id may hold '/': no job's keys lie under another's prefix, so retiring "a" keeps "a/inc1".
TEST_F(ClusterTest, RetiringAJobKeepsTheKeysOfAJobWhoseIdExtendsIt) {
  JoinTwo();
  const size_t baseline = service_.KeyCount();
  for (const char* job : {"a", "a/inc1", "a%2Finc1"}) {
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_THAT(nodes_[r]->ClaimIncarnation(job), IsOkAndHolds(1u));
      WriteRendezvousKeys(*nodes_[r], r, job, 1, 0);
    }
  }
  const size_t per_job = (service_.KeyCount() - baseline) / 3;
  for (uint32_t r = 0; r < 2; ++r) nodes_[r]->RetireJob("a", 1);
  EXPECT_EQ(service_.KeyCount(), baseline + 2 * per_job + 1);  // and the incarnation floor
  EXPECT_EQ(nodes_[0]->IncarnationHint("a/inc1", 1), "") << "node 1's count of a/inc1 is still there";
  for (uint32_t r = 0; r < 2; ++r) {
    engine::PrefixStore scoped(Cluster::RendezvousPrefix("a/inc1", 1, 0, 0), nodes_[r]->store());
    EXPECT_THAT(scoped.Get("tcp/0", absl::ZeroDuration()), IsOk());
  }
  for (const char* job : {"a/inc1", "a%2Finc1"}) {
    for (uint32_t r = 0; r < 2; ++r) nodes_[r]->RetireJob(job, 1);
  }
  EXPECT_EQ(service_.KeyCount(), baseline + 1);
}

// A node's next incarnation of a job may start before its previous one is retired (a worker
// registers while the last one of the previous run is leaving): the job stays live on that node,
// and its keys stay until it retires that one too.
TEST_F(ClusterTest, ANodesNextIncarnationKeepsTheJobLiveWhileItsPreviousRetires) {
  JoinTwo();
  const size_t baseline = service_.KeyCount();
  ASSERT_THAT(nodes_[0]->ClaimIncarnation("j"), IsOkAndHolds(1u));
  ASSERT_THAT(nodes_[0]->ClaimIncarnation("j"), IsOkAndHolds(2u));
  nodes_[0]->RetireJob("j", 1);
  nodes_[0]->RetireJob("j", 1);  // twice: the second does nothing
  EXPECT_THAT(nodes_[1]->ClaimIncarnation("j"), IsOkAndHolds(1u));
  nodes_[1]->RetireJob("j", 1);
  EXPECT_THAT(nodes_[0]->IncarnationHint("j", 2), HasSubstr("node 1 is at incarnation 1")) << "kept";
  nodes_[0]->RetireJob("j", 2);
  EXPECT_EQ(service_.KeyCount(), baseline + 1);
  // The next run starts above both.
  EXPECT_THAT(nodes_[1]->ClaimIncarnation("j"), IsOkAndHolds(3u));
}

// A compression change or a failure report that races the job's end on every node (written after
// the last retirement) does not leave its keys behind.
TEST_F(ClusterTest, AWriteRacingTheLastRetirementIsDeletedToo) {
  JoinTwo();
  const size_t baseline = service_.KeyCount();
  for (uint32_t r = 0; r < 2; ++r) ASSERT_THAT(nodes_[r]->ClaimIncarnation("j"), IsOkAndHolds(1u));
  for (uint32_t r = 0; r < 2; ++r) nodes_[r]->RetireJob("j", 1);
  ASSERT_EQ(service_.KeyCount(), baseline + 1);
  ASSERT_THAT(PublishBits(*nodes_[1], "j", 1, 4, 3), IsOk());
  ASSERT_THAT(nodes_[0]->ReportFailure("j", 1, 3, absl::AbortedError("stopped"), absl::Now() + absl::Seconds(5)),
              IsOk());
  EXPECT_EQ(service_.KeyCount(), baseline + 1);
}

TEST_F(ClusterTest, ALocalClusterNeedsNoCoordinator) {
  Cluster::Options o;
  std::unique_ptr<Cluster> local = Cluster::Local(o, "127.0.0.1:7070");
  EXPECT_THAT(local->members(), ElementsAre("127.0.0.1:7070"));
  EXPECT_THAT(local->AgreeOnErrorSampleRate(0.3), IsOkAndHolds(0.3));
  EXPECT_THAT(local->RejoinIfForgotten(), IsOkAndHolds(false));
  EXPECT_EQ(*local->ClaimIncarnation("j"), 1u);
  EXPECT_EQ(*local->ClaimIncarnation("j"), 2u);
  // Its in-process store forgets a job that no longer runs as well; the next run counts on.
  local->RetireJob("j", 1);
  local->RetireJob("j", 2);
  EXPECT_EQ(*local->ClaimIncarnation("j"), 3u);
}

}  // namespace
}  // namespace dynamiq::server

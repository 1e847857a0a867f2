// CrossNodeGroup (server/cross_node_group.h) with a fake coordinator: which view and collective each
// connection is made for, which transport a break aborts, how a peer's cause reaches this node, and
// how a new group view is adopted at its boundary.
#include "server/cross_node_group.h"

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::IsOkAndHolds;
using ::dynamiq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

// Carries nothing; counts its aborts.
class FakeTransport final : public engine::Transport {
 public:
  explicit FakeTransport(int* aborts) : aborts_(aborts) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string name() const override { return "fake"; }
  absl::StatusOr<Handle> PostSend(int, uint64_t, absl::Span<const uint8_t>) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<Handle> PostRecv(int, uint64_t, absl::Span<uint8_t>) override {
    return absl::UnimplementedError("fake");
  }
  absl::Status Wait(Handle, absl::Time) override { return absl::UnimplementedError("fake"); }
  void Abort() override { ++*aborts_; }

 private:
  int* aborts_;
};

// Records the connections made (view epoch, collective) and the causes reported; serves causes and
// a newest view set by the test.
class FakeCoordinator final : public JobCoordinator {
 public:
  absl::StatusOr<std::unique_ptr<engine::Transport>> Connect(const GroupView& view, uint64_t sequence) override {
    absl::MutexLock lock(&mu_);
    connects.emplace_back(view.epoch(), sequence);
    members.push_back(view.members());
    if (claim_during_connect.has_value()) {
      // Another node claims a view while this one waits (a member went silent): the wait ends.
      newest = *std::move(claim_during_connect);
      claim_during_connect.reset();
      return absl::AbortedError("a newer view was claimed");
    }
    if (!connect_error.ok()) return connect_error;
    aborts.push_back(0);
    return std::make_unique<FakeTransport>(&aborts.back());
  }
  absl::StatusOr<bool> PollConfig(uint64_t, uint64_t*, JobConfig*) override { return false; }
  absl::Status ReportFailure(uint64_t sequence, const absl::Status& cause, absl::Time) override {
    absl::MutexLock lock(&mu_);
    reported.emplace_back(sequence, std::string(cause.message()));
    return absl::OkStatus();
  }
  absl::StatusOr<GroupView> NewestView(const GroupView& current) override {
    absl::MutexLock lock(&mu_);
    ++view_reads;
    if (!newest.has_value() || newest->epoch() <= current.epoch()) return current;
    return *newest;
  }
  std::optional<FailureCause> LookupFailure(uint64_t sequence, absl::Time) override {
    absl::MutexLock lock(&mu_);
    auto it = causes.find(sequence);
    if (it == causes.end()) return std::nullopt;
    return it->second;
  }

  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, uint64_t>> connects;  // view epoch, sequence
  std::vector<std::vector<uint32_t>> members;           // of each connection's view
  std::optional<GroupView> newest;
  std::optional<GroupView> claim_during_connect;
  int view_reads = 0;
  std::vector<std::pair<uint64_t, std::string>> reported;
  std::map<uint64_t, FailureCause> causes;
  absl::Status connect_error;
  std::deque<int> aborts;  // per transport connected (stable addresses)
};

TEST(CrossNodeGroupTest, AfterAFailureTheNextCollectiveConnectsAgainUnderItsOwnKeys) {
  auto coordinator = std::make_shared<FakeCoordinator>();
  CrossNodeGroup group("j", GroupView::Everyone(2, 0), coordinator);
  ASSERT_THAT(group.Connected(0).status(), IsOk());
  ASSERT_THAT(group.Connected(1).status(), IsOk());  // reused
  // Two collectives failed here (a worker left with two queued), one across nodes.
  group.Announce(group.Decide({{2, absl::AbortedError("left")}, {3, absl::AbortedError("left")}}));
  ASSERT_THAT(group.Connected(4).status(), IsOk());
  group.Drop(/*abort=*/false);
  ASSERT_THAT(group.Connected(5).status(), IsOk());
  group.Drop(/*abort=*/true);
  EXPECT_THAT(coordinator->aborts, ElementsAre(1, 0, 1));
  // A failed connect is a failed collective too.
  coordinator->connect_error = absl::UnavailableError("peer gone");
  EXPECT_THAT(group.Connected(6).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("collective 6 of job j: peer gone")));
  coordinator->connect_error = absl::OkStatus();
  ASSERT_THAT(group.Connected(7).status(), IsOk());
  EXPECT_THAT(coordinator->connects, ElementsAre(Pair(0, 0), Pair(0, 4), Pair(0, 5), Pair(0, 6), Pair(0, 7)));
}

TEST(CrossNodeGroupTest, ABreakReportsItsCausesThenAbortsOnlyTheTransportItWasDecidedOn) {
  auto coordinator = std::make_shared<FakeCoordinator>();
  CrossNodeGroup group("j", GroupView::Everyone(2, 0), coordinator);
  ASSERT_THAT(group.Connected(0).status(), IsOk());
  const CrossNodeGroup::Break current = group.Decide({{1, absl::InvalidArgumentError("ranks disagree")}});
  group.Announce(current);
  EXPECT_THAT(coordinator->reported, ElementsAre(Pair(1, "ranks disagree")));
  EXPECT_THAT(coordinator->aborts, ElementsAre(1));
  // A break decided before the next collective connected must not abort the new transport.
  const CrossNodeGroup::Break stale = group.Decide({{2, absl::DeadlineExceededError("watchdog")}});
  ASSERT_THAT(group.Connected(3).status(), IsOk());
  group.Announce(stale);
  EXPECT_THAT(coordinator->aborts, ElementsAre(1, 0));
  group.Abort();  // the job stops: whatever runs now
  EXPECT_THAT(coordinator->aborts, ElementsAre(1, 1));
}

TEST(CrossNodeGroupTest, OneNodeHasNoGroup) {
  auto coordinator = std::make_shared<FakeCoordinator>();
  CrossNodeGroup group("j", GroupView::Everyone(1, 0), coordinator);
  const CrossNodeGroup::Break broken = group.Decide({{0, absl::AbortedError("left")}});
  EXPECT_TRUE(broken.failures.empty());
  group.Announce(broken);
  group.Report({{0, absl::AbortedError("left")}});
  EXPECT_TRUE(coordinator->reported.empty());
  EXPECT_THAT(group.WithRemoteCause(0, absl::UnavailableError("reset")), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(CrossNodeGroupTest, AResetOrDeadlineIsLedByThePeersPublishedCause) {
  auto coordinator = std::make_shared<FakeCoordinator>();
  coordinator->causes[5] = FailureCause{
      1, absl::InvalidArgumentError("collective 5 of job j: local rank 0 submitted 'a', local rank 1 submitted 'b'")};
  CrossNodeGroup group("j", GroupView::Everyone(2, 0), coordinator);
  EXPECT_THAT(group.WithRemoteCause(5, absl::UnavailableError("collective 5 of job j: from rank 1: connection reset")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "collective 5 of job j failed on node 1: local rank 0 submitted 'a', local rank 1 submitted "
                       "'b' (here: from rank 1: connection reset)"));
  EXPECT_THAT(group.WithRemoteCause(5, absl::DeadlineExceededError("step timed out")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(here: step timed out)")));
  // Not what a peer's break looks like (this node's own abort, a corrupt message): unchanged.
  EXPECT_THAT(group.WithRemoteCause(5, absl::AbortedError("stopped")), StatusIs(absl::StatusCode::kAborted, "stopped"));
  // Nobody published a cause (a daemon was killed): unchanged.
  EXPECT_THAT(group.WithRemoteCause(6, absl::UnavailableError("reset")),
              StatusIs(absl::StatusCode::kUnavailable, "reset"));
}

// A view claimed for collective 5 (of nodes 0 and 2 of three): the members keep their connection
// until then, look it up where every member looks (Refresh), and connect again in it at 5, ranked
// by their place in it; a node left out fails its collectives there and publishes nothing.
TEST(CrossNodeGroupTest, ANewViewAppliesAtItsFirstCollectiveAndALeftOutNodeStaysQuiet) {
  for (uint32_t node : {2u, 1u}) {
    auto coordinator = std::make_shared<FakeCoordinator>();
    CrossNodeGroup group("j", GroupView::Everyone(3, node), coordinator);
    ASSERT_THAT(group.Connected(3).status(), IsOk());
    absl::StatusOr<GroupView> next = GroupView::Make(1, {2, 0}, 5, 3, node);
    ASSERT_THAT(next, IsOk());
    coordinator->newest = *next;
    ASSERT_THAT(group.Refresh(4), IsOk());  // known, not yet in force
    EXPECT_EQ(group.view().epoch(), 0u);
    ASSERT_THAT(group.Connected(4).status(), IsOk());
    ASSERT_THAT(group.Refresh(5), IsOk());
    EXPECT_EQ(group.view(), *next);
    if (node == 2) {
      EXPECT_EQ(group.view().my_index(), 1);
      ASSERT_THAT(group.Connected(5).status(), IsOk());
      EXPECT_THAT(coordinator->connects, ElementsAre(Pair(0, 3), Pair(1, 5)));
      EXPECT_THAT(coordinator->members.back(), ElementsAre(0, 2));
      continue;
    }
    EXPECT_FALSE(group.view().is_member());
    EXPECT_THAT(group.Connected(5).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         "collective 5 of job j: node 1 is not a member of the job's view 1 (nodes 0, 2 from "
                         "collective 5)"));
    // Its own failures stay its own: announcing them would stop the members' connects.
    group.Announce(group.Decide({{6, absl::AbortedError("a worker left")}}));
    group.Report({{7, absl::AbortedError("a worker left")}});
    EXPECT_TRUE(coordinator->reported.empty());
    EXPECT_THAT(coordinator->connects, ElementsAre(Pair(0, 3)));
  }
}

// Node 2 of three goes silent (server/membership.h) while node 0 holds a connection: the
// transport is aborted (the collective on it fails, saying why, and is published), and a view
// without node 2 claimed while node 0 waits to connect for the next collective is connected in at
// once when it applies to that collective; one that applies later fails the collective instead.
TEST(CrossNodeGroupTest, ASilentMemberAbortsTheTransportAndAViewClaimedMeanwhileIsConnectedIn) {
  for (const uint64_t first : {4u, 6u}) {
    SCOPED_TRACE(first);
    auto coordinator = std::make_shared<FakeCoordinator>();
    CrossNodeGroup group("j", GroupView::Everyone(3, 0), coordinator);
    ASSERT_THAT(group.Connected(3).status(), IsOk());
    EXPECT_FALSE(group.AbortIfIncludes({5}, "node 5 is not a member"));
    EXPECT_TRUE(group.AbortIfIncludes({2}, "node 2 (silent for 2.0 s) stopped heartbeating"));
    EXPECT_THAT(coordinator->aborts, ElementsAre(1));
    EXPECT_THAT(group.WithRemoteCause(3, absl::AbortedError("rank 0: transport aborted")),
                StatusIs(absl::StatusCode::kUnavailable,
                         "collective 3 of job j: node 2 (silent for 2.0 s) stopped heartbeating (here: rank 0: "
                         "transport aborted)"));
    ASSERT_EQ(coordinator->reported.size(), 1u);
    EXPECT_EQ(coordinator->reported[0].first, 3u);
    absl::StatusOr<GroupView> claimed = GroupView::Make(1, {0, 1}, first, 3, 0);
    ASSERT_THAT(claimed, IsOk());
    coordinator->claim_during_connect = *claimed;
    if (first == 4) {
      ASSERT_THAT(group.Settle(4), IsOk());
      EXPECT_EQ(group.view(), *claimed);
      EXPECT_THAT(coordinator->connects, ElementsAre(Pair(0, 3), Pair(0, 4), Pair(1, 4)));
      EXPECT_THAT(coordinator->members.back(), ElementsAre(0, 1));
      ASSERT_THAT(group.Connected(4).status(), IsOk());  // the same connection
      EXPECT_EQ(coordinator->connects.size(), 3u);
    } else {
      EXPECT_THAT(group.Settle(4), StatusIs(absl::StatusCode::kAborted, HasSubstr("collective 4 of job j")));
      EXPECT_EQ(group.view().epoch(), 0u);
      ASSERT_THAT(group.Settle(6), IsOk());
      EXPECT_THAT(coordinator->connects, ElementsAre(Pair(0, 3), Pair(0, 4), Pair(1, 6)));
    }
  }
}

TEST(CrossNodeGroupTest, OneNodeNeverLooksForViews) {
  auto coordinator = std::make_shared<FakeCoordinator>();
  CrossNodeGroup group("j", GroupView::Everyone(1, 0), coordinator);
  ASSERT_THAT(group.Refresh(0), IsOk());
  EXPECT_EQ(coordinator->view_reads, 0);
}

}  // namespace
}  // namespace dynamiq::server

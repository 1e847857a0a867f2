// CrossNodeGroup (server/cross_node_group.h) with a fake coordinator: which generation each
// connection is made at, which transport a break aborts, and how a peer's cause reaches this node.
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

// Records the generations connected at and the causes reported; serves causes set by the test.
class FakeCoordinator final : public JobCoordinator {
 public:
  absl::StatusOr<std::unique_ptr<engine::Transport>> Connect(uint64_t generation, uint64_t sequence) override {
    absl::MutexLock lock(&mu_);
    connects.emplace_back(generation, sequence);
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
  std::optional<FailureCause> LookupFailure(uint64_t sequence, absl::Time) override {
    absl::MutexLock lock(&mu_);
    auto it = causes.find(sequence);
    if (it == causes.end()) return std::nullopt;
    return it->second;
  }

  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, uint64_t>> connects;  // generation, sequence
  std::vector<std::pair<uint64_t, std::string>> reported;
  std::map<uint64_t, FailureCause> causes;
  absl::Status connect_error;
  std::deque<int> aborts;  // per transport connected (stable addresses)
};

TEST(CrossNodeGroupTest, EveryFailedCollectiveMovesTheNextConnectionOneGenerationOn) {
  auto coordinator = std::make_shared<FakeCoordinator>();
  CrossNodeGroup group("j", 2, coordinator);
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
  EXPECT_THAT(coordinator->connects, ElementsAre(Pair(0, 0), Pair(2, 4), Pair(3, 5), Pair(4, 6), Pair(5, 7)));
}

TEST(CrossNodeGroupTest, ABreakReportsItsCausesThenAbortsOnlyTheTransportItWasDecidedOn) {
  auto coordinator = std::make_shared<FakeCoordinator>();
  CrossNodeGroup group("j", 2, coordinator);
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
  CrossNodeGroup group("j", 1, coordinator);
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
  CrossNodeGroup group("j", 2, coordinator);
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

}  // namespace
}  // namespace dynamiq::server

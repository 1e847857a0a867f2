#include "server/membership.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dynamiq::server {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

TEST(MembershipTrackerTest, ANodeIsSilentOnceNotHeardFromForLongerThanTheTimeout) {
  MembershipTracker tracker(absl::Seconds(2), 3);
  const absl::Time t0 = absl::Now();
  for (uint32_t node = 0; node < 4; ++node) tracker.Heard(node, t0);
  LiveSet first = tracker.Snapshot(4, t0 + absl::Seconds(1));
  EXPECT_THAT(first.live, ElementsAre(0, 1, 2, 3));
  EXPECT_TRUE(first.silent.empty());
  EXPECT_EQ(first.min_nodes, 3u);
  EXPECT_EQ(first.epoch, 1u);
  // Nodes 0-2 keep heartbeating; node 3 does not.
  for (uint32_t node = 0; node < 3; ++node) tracker.Heard(node, t0 + absl::Seconds(2));
  LiveSet same = tracker.Snapshot(4, t0 + absl::Seconds(2));
  EXPECT_EQ(same.epoch, 1u);  // nothing changed: the same epoch
  LiveSet later = tracker.Snapshot(4, t0 + absl::Seconds(2.5));
  EXPECT_THAT(later.live, ElementsAre(0, 1, 2));
  EXPECT_THAT(later.silent, ElementsAre(Pair(3u, 2.5)));
  EXPECT_EQ(later.epoch, 2u);
  EXPECT_FALSE(later.IsLive(3));
  EXPECT_THAT(later.Silent({1, 3}), ElementsAre(3u));
  EXPECT_EQ(later.DescribeSilent({3}), "node 3 (silent for 2.5 s)");
  // It comes back: live again, a new epoch.
  tracker.Heard(3, t0 + absl::Seconds(3));
  for (uint32_t node = 0; node < 3; ++node) tracker.Heard(node, t0 + absl::Seconds(3));
  LiveSet back = tracker.Snapshot(4, t0 + absl::Seconds(3));
  EXPECT_THAT(back.live, ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(back.epoch, 3u);
}

TEST(MembershipTrackerTest, TheCoordinatorIsAlwaysLiveAndANodeNeverHeardFromCountsFromTheStart) {
  MembershipTracker tracker(absl::Seconds(1), 0);
  const absl::Time start = absl::Now();
  // Nobody heartbeats, node 0 included: node 0 is where the tracker runs.
  LiveSet early = tracker.Snapshot(3, start);
  EXPECT_THAT(early.live, ElementsAre(0, 1, 2));
  LiveSet late = tracker.Snapshot(3, start + absl::Seconds(5));
  EXPECT_THAT(late.live, ElementsAre(0));
  ASSERT_EQ(late.silent.size(), 2u);
  EXPECT_EQ(late.silent[0].first, 1u);
  EXPECT_GE(late.silent[0].second, 4.0);
  EXPECT_EQ(late.DescribeSilent({1, 2}).substr(0, 9), "nodes 1 (");
}

TEST(LiveSetTest, WithoutAnAnswerEveryNodeCountsAsLive) {
  LiveSet unknown;
  EXPECT_TRUE(unknown.IsLive(7));
  EXPECT_TRUE(unknown.Silent({0, 1, 2}).empty());
}

}  // namespace
}  // namespace dynamiq::server

// Contributions (server/contributions.h): the side lane's layout, what was summed, and whom a
// collective waited for, with the cross-node sums written by hand as the side lane would.
#include "server/contributions.h"

#include <vector>

#include "gtest/gtest.h"

namespace dynamiq::server {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

TEST(ContributionsTest, OneNodeSumsItsWorkersAndNamesTheLastOne) {
  Contributions c(/*weighted=*/true, /*num_nodes=*/1, /*node_rank=*/0);
  c.AddWorker(0, 2.5, kT0 + absl::Milliseconds(30));
  c.AddWorker(1, 0.0, kT0);
  c.AddWorker(2, 1.0, kT0 + absl::Milliseconds(10));
  c.SetPreviousEnd(kT0 - absl::Seconds(1));
  EXPECT_TRUE(c.SideLane().empty()) << "nothing crosses the network";
  EXPECT_EQ(c.weight_sum(), 3.5);
  EXPECT_EQ(c.contributors(), 3u);
  const StragglerWait w = c.Waits();
  ASSERT_TRUE(w.local_rank.has_value());
  EXPECT_EQ(*w.local_rank, 0u);
  EXPECT_NEAR(w.local_seconds, 0.030, 1e-9);
  EXPECT_FALSE(w.node.has_value());
}

TEST(ContributionsTest, TheSideLaneHasASlotPerNodeAndTheSumsNameTheSlowestNode) {
  // Node 1 of 3, unweighted: [workers-as-weights, workers, lateness of nodes 0, 1, 2].
  Contributions c(/*weighted=*/false, 3, 1);
  c.AddWorker(0, std::nullopt, kT0);
  c.AddWorker(1, std::nullopt, kT0);
  c.SetPreviousEnd(kT0 - absl::Milliseconds(100));
  absl::Span<double> lane = c.SideLane();
  c.SetConfigBoundary(7);
  ASSERT_EQ(lane.size(), 8u);
  EXPECT_EQ(std::vector<double>(lane.begin(), lane.end()), (std::vector<double>{2, 2, 0, 0.1, 0, 0, 7, 0}));
  // What the side lane sums to over the three nodes (node 2 was ready 400 ms after its previous end;
  // node 0 knows a configuration change may apply at collective 9).
  const std::vector<double> summed = {6, 6, 0.05, 0.1, 0.4, 9, 7, 0};
  std::copy(summed.begin(), summed.end(), lane.begin());
  EXPECT_EQ(c.contributors(), 6u);
  EXPECT_EQ(c.weight_sum(), 6.0);
  const StragglerWait w = c.Waits();
  ASSERT_TRUE(w.node.has_value());
  EXPECT_EQ(*w.node, 2u);
  EXPECT_NEAR(w.node_seconds, 0.3, 1e-12);
  EXPECT_EQ(c.ConfigBoundary(), 9u);
  // A tie of local arrivals still names one rank, with no wait.
  EXPECT_TRUE(w.local_rank.has_value());
  EXPECT_EQ(w.local_seconds, 0.0);
}

TEST(ContributionsTest, WorkersThatSubmittedBeforeThePreviousCollectiveEndedAreNotLate) {
  Contributions c(false, 2, 1);
  c.AddWorker(0, std::nullopt, kT0);
  c.SetPreviousEnd(kT0 + absl::Seconds(2));  // queued ahead (DDP buckets)
  EXPECT_EQ(c.SideLane()[3], 0.0);
}

TEST(ContributionsTest, ANodesFirstCollectiveNamesNoNode) {
  Contributions c(false, 2, 0);
  c.AddWorker(0, std::nullopt, kT0);
  c.SetPreviousEnd(std::nullopt);  // no previous collective here
  absl::Span<double> lane = c.SideLane();
  ASSERT_EQ(lane.size(), 6u);
  EXPECT_EQ(lane[2], -1.0);
  lane[3] = 0.2;  // the other node had one
  EXPECT_FALSE(c.Waits().node.has_value());
  ASSERT_TRUE(c.Waits().local_rank.has_value()) << "one local worker is the last, waited for 0 s";
  EXPECT_EQ(c.Waits().local_seconds, 0.0);
}

TEST(ContributionsTest, LargeClustersAndPathsWithoutASideLaneKeepOnlyWhatTheyCanKnow) {
  // 20 nodes, unweighted: no side lane; every node has as many workers.
  Contributions big(false, 20, 3);
  big.AddWorker(0, std::nullopt, kT0);
  big.AddWorker(1, std::nullopt, kT0);
  EXPECT_TRUE(big.SideLane().empty());
  EXPECT_FALSE(big.has_node_slots());
  EXPECT_EQ(big.contributors(), 40u);
  EXPECT_EQ(big.weight_sum(), 40.0);
  // Weighted: the lane carries the sums only.
  Contributions weighted(true, 20, 3);
  weighted.AddWorker(0, 1.5, kT0);
  EXPECT_EQ(weighted.SideLane().size(), 2u);
  // A data path without a side lane (GPU nodes): none for unweighted collectives.
  Contributions device(false, 4, 0, /*lateness_lane=*/false);
  device.AddWorker(0, std::nullopt, kT0);
  EXPECT_TRUE(device.SideLane().empty());
  EXPECT_EQ(device.contributors(), 4u);
}

}  // namespace
}  // namespace dynamiq::server

// Fault suite, daemons: a three-node cluster of dynamiqd processes on loopback loses one daemon
// (SIGKILL) in the middle of a collective, a non-coordinator node and then the coordinator (node 0,
// which serves the rendezvous). The surviving nodes fail the collective at once with an error
// naming the dead node's rank, do not crash or leak, and once the daemon is restarted at the same
// address the cluster forms again: a restarted node re-joins the coordinator, a restarted
// coordinator is re-joined by the surviving daemons by themselves, and a training job restarted
// by its launcher (new worker processes on every node, the same job id: the job's next
// incarnation) runs exact collectives on all nodes.
#include <signal.h>

#include <iostream>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/faults/fault_harness.h"

namespace dynamiq::faults {
namespace {

using ::testing::HasSubstr;

constexpr double kTimeoutSeconds = 4;

// Kills node `victim` while job a's collective is in flight on the others, restarts it, and
// checks the failure, the survivors' health and the re-formed cluster.
void KillAndRestartNode(int victim) {
  ScratchDir dir;
  LoopbackCluster cluster(DQ_DYNAMIQD, dir.path(), 3, kTimeoutSeconds);
  ASSERT_TRUE(cluster.Start().ok());
  auto a = std::make_unique<JobWorkers>(DQ_FAULT_WORKER, dir.path(), "a", cluster.sockets(), 1, 16384);
  ASSERT_TRUE(a->Start().ok());
  for (int i = 0; i < 2; ++i) EXPECT_EQ(NotAllOk(AllReduceAll(a->all())), "");
  std::vector<int> survivors;
  for (int k = 0; k < 3; ++k) {
    if (k != victim) survivors.push_back(k);
  }
  std::map<int, Resources> before;
  for (int k : survivors) before[k] = cluster.node(k).resources();

  for (int k : survivors) a->at(k, 0).Submit();
  for (int k : survivors) ASSERT_TRUE(WaitInflight(cluster.node(k), "a"));
  absl::SleepFor(absl::Milliseconds(100));
  const pid_t dead_pid = cluster.node(victim).pid();
  const absl::Time killed = absl::Now();
  cluster.node(victim).Kill(SIGKILL);
  absl::Duration slowest;
  for (int k : survivors) {
    const std::string reply = a->at(k, 0).Result(absl::Seconds(3 * kTimeoutSeconds));
    slowest = std::max(slowest, absl::Now() - killed);
    SCOPED_TRACE(absl::StrCat("node ", k, ": ", reply));
    EXPECT_NE(ReplyCode(reply), "");
    EXPECT_THAT(reply, HasSubstr(absl::StrCat("rank ", victim)));
    EXPECT_THAT(reply, HasSubstr("job a"));
  }
  std::cout << "daemon SIGKILL on node " << victim << ": every surviving participant failed within "
            << absl::FormatDuration(slowest) << std::endl;
  EXPECT_LT(slowest, absl::Seconds(kTimeoutSeconds));
  // The dead daemon's workers lost their connection; the survivors' are idle. The launcher stops
  // the job everywhere.
  const std::string orphan = a->at(victim, 0).AllReduce("", absl::Seconds(3 * kTimeoutSeconds));
  EXPECT_EQ(ReplyCode(orphan), "UNAVAILABLE") << orphan;
  a.reset();
  // The survivors retire job a once its last local worker is gone.
  for (int k : survivors) EXPECT_TRUE(WaitJobRetired(cluster.node(k), "a")) << "node " << k;
  // Nothing of the dead daemon is left in /dev/shm (buffers are unlinked once mapped).
  EXPECT_EQ(ShmNamesOf(dead_pid), 0);
  for (int k : survivors) ASSERT_TRUE(cluster.node(k).Alive()) << Tail(cluster.node(k).log());

  // Restart the daemon at the same address: it re-joins (or, as coordinator, is re-joined).
  const absl::Time restart = absl::Now();
  const absl::Status restarted = cluster.Start({victim});
  ASSERT_TRUE(restarted.ok()) << restarted << "\nsurvivor logs:\n"
                              << Tail(cluster.node(survivors[0]).log()) << Tail(cluster.node(survivors[1]).log());
  std::cout << "node " << victim << " restarted and the cluster re-formed in "
            << absl::FormatDuration(absl::Now() - restart) << std::endl;
  // The job restarted under the same id runs on every node, exactly (its next incarnation
  // everywhere: the restarted node's count of incarnations is kept by the coordinator, or, when the
  // coordinator restarted, every node's count starts over); three times, so a transport is reused.
  JobWorkers again(DQ_FAULT_WORKER, dir.path(), "a", cluster.sockets(), 1, 16384);
  ASSERT_TRUE(again.Start().ok());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(NotAllOk(AllReduceAll(again.all())), "");
  for (int k = 0; k < 3; ++k) {
    auto status = JobStatusOf(cluster.node(k), "a");
    ASSERT_TRUE(status.has_value()) << "node " << k;
    std::cout << "node " << k << " runs job a at incarnation " << status->incarnation() << std::endl;
  }
  // The survivors hold the job's new incarnation and its connections, and no more shared memory
  // than before (the first incarnation's buffers were released when its workers left).
  for (int k : survivors) {
    ASSERT_TRUE(cluster.node(k).Alive());
    const Resources now = WaitForResources(cluster.node(k).pid(), before[k], before[k].shm_mappings, 4, 3);
    std::cout << "node " << k << " before: " << before[k].ToString() << "\n       after:  " << now.ToString()
              << std::endl;
    EXPECT_LE(now.fds, before[k].fds + 4) << "node " << k;
    EXPECT_LE(now.threads, before[k].threads + 3) << "node " << k;
    EXPECT_EQ(now.shm_mappings, before[k].shm_mappings) << "node " << k;
  }
  again.QuitAll();
  for (int k = 2; k >= 0; --k) EXPECT_TRUE(cluster.node(k).Stop()) << "node " << k << Tail(cluster.node(k).log());
}

TEST(NodeFaultTest, KilledDaemonFailsTheSurvivorsCollectivesAndTheRestartedNodeRejoins) { KillAndRestartNode(2); }

TEST(NodeFaultTest, KilledCoordinatorFailsTheOthersAndIsRejoinedWhenItRestarts) { KillAndRestartNode(0); }

}  // namespace
}  // namespace dynamiq::faults

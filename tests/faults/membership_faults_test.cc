// Fault suite, membership (server/membership.h): dynamiqd processes on loopback heartbeat to node 0.
// A node killed (SIGKILL) or stopped (SIGSTOP, as a cut link looks to the others) for longer than
// --heartbeat_timeout leaves the job's group: the next collective runs on the survivors and sums
// exactly over them, within twice the heartbeat timeout of the kill; below --min_nodes the
// collectives fail saying which node is silent, well before --timeout; a stop (or a cut link)
// shorter than the heartbeat timeout changes nothing, a longer one behaves like a kill.
#include <signal.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/faults/fault_harness.h"

namespace dynamiq::faults {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr double kTimeoutSeconds = 30;  // --timeout: far beyond what any wait here may take
constexpr double kHeartbeatSeconds = 1.5;

std::unique_ptr<LoopbackCluster> StartCluster(const std::string& dir, int nodes, int min_nodes) {
  auto cluster = std::make_unique<LoopbackCluster>(DQ_DYNAMIQD, dir, nodes, kTimeoutSeconds);
  for (int k = 0; k < nodes; ++k) {
    cluster->spec(k).flags = {absl::StrCat("--heartbeat_timeout=", kHeartbeatSeconds),
                              absl::StrCat("--min_nodes=", min_nodes)};
    cluster->spec(k).metrics_port = 0;
  }
  if (absl::Status s = cluster->Start(); !s.ok()) {
    ADD_FAILURE() << s;
    return nullptr;
  }
  return cluster;
}

// The "ok" reply's contributor count, and the nodes that took part ("0,1,2").
std::string Contributors(const std::string& reply) {
  std::vector<std::string> f = absl::StrSplit(reply, ' ');
  return f.size() == 7 ? f[5] : "";
}
std::string Nodes(const std::string& reply) {
  std::vector<std::string> f = absl::StrSplit(reply, ' ');
  return f.size() == 7 ? f[6] : "";
}

std::vector<uint32_t> ViewNodes(const DaemonProcess& daemon, const std::string& job) {
  auto status = JobStatusOf(daemon, job);
  if (!status.has_value()) return {};
  return std::vector<uint32_t>(status->view_nodes().begin(), status->view_nodes().end());
}

TEST(MembershipFaultTest, AKilledNodeLeavesAndTheNextCollectiveRunsOnTheSurvivorsExactly) {
  ScratchDir dir;
  auto cluster = StartCluster(dir.path(), 4, 3);
  ASSERT_NE(cluster, nullptr);
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", cluster->sockets(), 1, 16384);
  ASSERT_TRUE(a.Start().ok());
  for (int i = 0; i < 2; ++i) EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  // Node 3 dies while the others are in a collective it never joins.
  for (int k = 0; k < 3; ++k) a.at(k, 0).Submit();
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(WaitInflight(cluster->node(k), "a"));
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time killed = absl::Now();
  cluster->node(3).Kill(SIGKILL);
  for (int k = 0; k < 3; ++k) {
    const std::string broken = a.at(k, 0).Result(absl::Seconds(kTimeoutSeconds));
    std::cout << "node " << k << ", the collective node 3 broke: " << broken << std::endl;
    EXPECT_THAT(broken, StartsWith("err ")) << "node " << k;
  }
  // The next collective runs on nodes 0-2 and sums exactly over their workers (ranks 0, 1, 2).
  for (int k = 0; k < 3; ++k) {
    a.at(k, 0).child().Send("ranks 0,1,2");
    EXPECT_THAT(a.at(k, 0).Result(), StartsWith("ok ranks 6"));
  }
  for (int k = 0; k < 3; ++k) a.at(k, 0).Submit();
  for (int k = 0; k < 3; ++k) {
    const std::string reply = a.at(k, 0).Result(absl::Seconds(kTimeoutSeconds));
    SCOPED_TRACE(absl::StrCat("node ", k, ": ", reply, "\n", Tail(cluster->node(k).log())));
    EXPECT_THAT(reply, StartsWith("ok "));
    EXPECT_EQ(Contributors(reply), "3");
    EXPECT_EQ(Nodes(reply), "0,1,2");
  }
  const absl::Duration after = absl::Now() - killed;
  std::cout << "node 3 killed; the next collective completed on nodes 0-2 after " << absl::FormatDuration(after)
            << " (heartbeat timeout " << kHeartbeatSeconds << " s)" << std::endl;
  EXPECT_LT(after, absl::Seconds(2 * kHeartbeatSeconds));
  for (int k = 0; k < 3; ++k) EXPECT_THAT(ViewNodes(cluster->node(k), "a"), ElementsAre(0, 1, 2)) << "node " << k;
  EXPECT_THAT(cluster->node(0).log(), HasSubstr("node 3 (silent for"));
  EXPECT_THAT(cluster->node(0).log(), HasSubstr("job a: view 1 (nodes 0, 1, 2 from collective"));
  // And on: every result exact (bit-identical on every survivor: the exact sum).
  std::vector<Worker*> survivors = {&a.at(0, 0), &a.at(1, 0), &a.at(2, 0)};
  for (int i = 0; i < 20; ++i) ASSERT_EQ(NotAllOk(AllReduceAll(survivors)), "") << "collective " << i;
  // The survivors' view kept the connections among them that view 0 made (engine/tcp_mesh.h).
  for (int k = 0; k < 3; ++k) {
    const std::string metrics = ScrapeMetrics(cluster->node(k).log());
    const double made = MetricValue(metrics, "dynamiq_peer_connections_total", {"outcome=\"made\""});
    const double kept = MetricValue(metrics, "dynamiq_peer_connections_total", {"outcome=\"kept\""});
    std::cout << "node " << k << ": connections made " << made << ", kept " << kept << std::endl;
    EXPECT_EQ(made, 3) << "node " << k << ": one per other node, for view 0";
    EXPECT_EQ(kept, 2) << "node " << k << ": view 1 kept the other survivors'";
  }
  for (Worker* w : survivors) w->Quit();
  for (int k = 2; k >= 0; --k) EXPECT_TRUE(cluster->node(k).Stop()) << "node " << k << Tail(cluster->node(k).log());
}

// From here each of `workers`' results sums the workers of the nodes that took part, which are the
// lowest ones (the fault worker's "ranks auto").
void SumOverTakingPart(const std::vector<Worker*>& workers) {
  for (Worker* w : workers) {
    w->child().Send("ranks auto");
    ASSERT_THAT(w->Result(), StartsWith("ok ranks auto"));
  }
}

// Node 3's restarted worker submits once; the members run collectives until it is admitted (its
// all-reduce completes), each of theirs succeeding on the nodes of its view. Node 3's reply.
std::string AdmitJoiner(LoopbackCluster& cluster, JobWorkers& a, const std::vector<Worker*>& members,
                        absl::Time restart) {
  Worker& joiner = a.at(3, 0);
  SumOverTakingPart({&joiner});
  joiner.Submit();  // waits in its daemon until the members admit the node
  std::string admitted;
  int rounds = 0;
  for (; rounds < 40 && admitted.empty(); ++rounds) {
    for (Worker* w : members) w->Submit();
    for (Worker* w : members) {
      const std::string reply = w->Result(absl::Seconds(kTimeoutSeconds));
      // The collective a restart broke fails; every other one completes.
      if (!absl::StartsWith(reply, "ok ")) std::cout << "round " << rounds << ": " << reply << std::endl;
    }
    const std::string reply = joiner.Result(absl::Milliseconds(200));
    if (reply != "(no reply)") admitted = reply;
  }
  std::cout << "node 3 restarted; admitted after " << rounds << " collectives of the others, "
            << absl::FormatDuration(absl::Now() - restart) << ": " << admitted << std::endl;
  return admitted;
}

// The node comes back: its restarted dynamiqd rejoins the members' incarnation of the job, is
// admitted at a collective boundary, its worker takes the members' state (SyncState), and from
// there every collective runs on all four nodes, the same on every one of them (the exact sum,
// codec none).
TEST(MembershipFaultTest, ARestartedNodeIsAdmittedAtACollectiveBoundary) {
  ScratchDir dir;
  auto cluster = StartCluster(dir.path(), 4, 3);
  ASSERT_NE(cluster, nullptr);
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", cluster->sockets(), 1, 16384);
  ASSERT_TRUE(a.Start().ok());
  ASSERT_NO_FATAL_FAILURE(SumOverTakingPart(a.all()));
  for (int i = 0; i < 2; ++i) EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  cluster->node(3).Kill(SIGKILL);
  std::vector<Worker*> members = {&a.at(0, 0), &a.at(1, 0), &a.at(2, 0)};
  std::string last;
  for (int i = 0; i < 5 && Contributors(last) != "3"; ++i) {
    std::vector<std::string> replies = AllReduceAll(members, "", absl::Seconds(kTimeoutSeconds));
    last = NotAllOk(replies).empty() ? replies[0] : "";
  }
  ASSERT_EQ(Contributors(last), "3") << "the survivors never ran on three nodes";
  // Node 3 restarts; its worker too (a training launcher restarts the process on that node).
  const absl::Time restart = absl::Now();
  ASSERT_TRUE(cluster->Start({3}).ok());
  ASSERT_TRUE(a.Restart(3, 0).ok());
  const std::string admitted = AdmitJoiner(*cluster, a, members, restart);
  ASSERT_THAT(admitted, StartsWith("ok ")) << Tail(cluster->node(3).log()) << Tail(cluster->node(0).log());
  EXPECT_EQ(Contributors(admitted), "4");
  EXPECT_EQ(Nodes(admitted), "0,1,2,3");
  EXPECT_THAT(cluster->node(3).log(), HasSubstr("job a: rejoining incarnation 1"));
  EXPECT_THAT(cluster->node(0).log(), HasSubstr("admits node 3"));
  // The joiner takes the members' state (its own differs): every worker ends with the same hash.
  for (int k = 0; k < 4; ++k) a.at(k, 0).child().Send(k == 3 ? "sync 0" : "sync 7");
  std::vector<std::string> synced;
  for (int k = 0; k < 4; ++k) synced.push_back(a.at(k, 0).Result(absl::Seconds(kTimeoutSeconds)));
  for (int k = 0; k < 4; ++k) {
    std::vector<std::string> f = absl::StrSplit(synced[k], ' ');
    ASSERT_EQ(f.size(), 7u) << synced[k];
    EXPECT_EQ(f[0] + f[1], "oksynced") << synced[k];
    EXPECT_EQ(f[2], k == 3 ? "1" : "0") << synced[k];  // only the joiner's bytes were replaced
    EXPECT_EQ(f[4], "3") << synced[k];                 // three workers held the members' state
    EXPECT_EQ(f[5], std::vector<std::string>(absl::StrSplit(synced[0], ' '))[5]) << synced[k];
    EXPECT_EQ(f[6], "equal") << synced[k];
  }
  // From here on every collective runs on all four nodes, exactly.
  for (int i = 0; i < 100; ++i) {
    const std::vector<std::string> replies = AllReduceAll(a.all(), "", absl::Seconds(kTimeoutSeconds));
    ASSERT_EQ(NotAllOk(replies), "") << "collective " << i;
    for (const std::string& r : replies) ASSERT_EQ(Contributors(r), "4") << r;
  }
  for (int k = 0; k < 4; ++k) EXPECT_THAT(ViewNodes(cluster->node(k), "a"), ElementsAre(0, 1, 2, 3)) << "node " << k;
  a.QuitAll();
  for (int k = 3; k >= 0; --k) EXPECT_TRUE(cluster->node(k).Stop()) << "node " << k << Tail(cluster->node(k).log());
}

// A dynamiqd restarted before the heartbeat timeout: never silent, but it joined the cluster
// again, so the members drop its predecessor and admit it as above.
TEST(MembershipFaultTest, ARestartFasterThanTheHeartbeatTimeoutIsDroppedAndAdmitted) {
  ScratchDir dir;
  auto cluster = StartCluster(dir.path(), 4, 3);
  ASSERT_NE(cluster, nullptr);
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", cluster->sockets(), 1, 4096);
  ASSERT_TRUE(a.Start().ok());
  ASSERT_NO_FATAL_FAILURE(SumOverTakingPart(a.all()));
  EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  cluster->node(3).Kill(SIGKILL);
  const absl::Time restart = absl::Now();
  ASSERT_TRUE(cluster->Start({3}).ok());
  ASSERT_TRUE(a.Restart(3, 0).ok());
  std::vector<Worker*> members = {&a.at(0, 0), &a.at(1, 0), &a.at(2, 0)};
  const std::string admitted = AdmitJoiner(*cluster, a, members, restart);
  ASSERT_THAT(admitted, StartsWith("ok ")) << Tail(cluster->node(3).log()) << Tail(cluster->node(0).log());
  EXPECT_EQ(Contributors(admitted), "4");
  EXPECT_THAT(cluster->node(0).log(), HasSubstr("node 3 restarted (a new dynamiqd joined the cluster in its place)"));
  for (int i = 0; i < 10; ++i) ASSERT_EQ(NotAllOk(AllReduceAll(a.all())), "") << "collective " << i;
  a.QuitAll();
  for (int k = 3; k >= 0; --k) EXPECT_TRUE(cluster->node(k).Stop()) << "node " << k;
}

TEST(MembershipFaultTest, BelowMinNodesTheCollectivesFailSayingWhichNodeIsSilent) {
  ScratchDir dir;
  auto cluster = StartCluster(dir.path(), 3, 0);  // 0: every node, the group never shrinks
  ASSERT_NE(cluster, nullptr);
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", cluster->sockets(), 1, 4096);
  ASSERT_TRUE(a.Start().ok());
  EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  const absl::Time killed = absl::Now();
  cluster->node(2).Kill(SIGKILL);
  // The first collective may fail on the broken connection; within a few heartbeats they fail
  // saying why, far from --timeout.
  std::string reply;
  for (int i = 0; i < 10 && ReplyCode(reply) != "FAILED_PRECONDITION"; ++i) {
    reply = a.at(0, 0).AllReduce("", absl::Seconds(kTimeoutSeconds));
    EXPECT_THAT(reply, StartsWith("err ")) << i;
  }
  std::cout << "after " << absl::FormatDuration(absl::Now() - killed) << ": " << reply << std::endl;
  EXPECT_EQ(ReplyCode(reply), "FAILED_PRECONDITION") << reply;
  EXPECT_THAT(reply, HasSubstr("node 2 (silent for"));
  EXPECT_THAT(reply, HasSubstr("below --min_nodes=3"));
  EXPECT_LT(absl::Now() - killed, absl::Seconds(kTimeoutSeconds / 2));
  EXPECT_THAT(ViewNodes(cluster->node(0), "a"), ElementsAre(0, 1, 2));  // no view was claimed
  a.at(0, 0).Quit();
  a.at(1, 0).Quit();
  for (int k = 1; k >= 0; --k) EXPECT_TRUE(cluster->node(k).Stop()) << "node " << k;
}

TEST(MembershipFaultTest, AShortStopChangesNothingALongOneLeavesTheGroup) {
  ScratchDir dir;
  auto cluster = StartCluster(dir.path(), 3, 2);
  ASSERT_NE(cluster, nullptr);
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", cluster->sockets(), 1, 4096);
  ASSERT_TRUE(a.Start().ok());
  EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  // Half the heartbeat timeout: a pause the group rides out.
  cluster->node(2).child().Signal(SIGSTOP);
  absl::SleepFor(absl::Seconds(kHeartbeatSeconds / 2));
  cluster->node(2).child().Signal(SIGCONT);
  absl::SleepFor(absl::Seconds(kHeartbeatSeconds));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  EXPECT_THAT(ViewNodes(cluster->node(0), "a"), ElementsAre(0, 1, 2));
  // Stopped for longer than the timeout (a cut link): nodes 0 and 1 go on without it.
  cluster->node(2).child().Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  for (int k = 0; k < 2; ++k) {
    a.at(k, 0).child().Send("ranks 0,1");
    EXPECT_THAT(a.at(k, 0).Result(), StartsWith("ok ranks 3"));
  }
  std::string replies[2];
  for (int attempt = 0; attempt < 3; ++attempt) {
    for (int k = 0; k < 2; ++k) a.at(k, 0).Submit();
    for (int k = 0; k < 2; ++k) replies[k] = a.at(k, 0).Result(absl::Seconds(kTimeoutSeconds));
    if (absl::StartsWith(replies[0], "ok ") && absl::StartsWith(replies[1], "ok ")) break;
  }
  std::cout << "node 2 stopped; nodes 0 and 1 ran on after " << absl::FormatDuration(absl::Now() - stopped) << ": "
            << replies[0] << " | " << replies[1] << std::endl;
  for (int k = 0; k < 2; ++k) {
    EXPECT_THAT(replies[k], StartsWith("ok ")) << Tail(cluster->node(k).log());
    EXPECT_EQ(Contributors(replies[k]), "2");
  }
  // Node 2 comes back: it is no member of the job's view any more, and its worker is told so at once.
  cluster->node(2).child().Signal(SIGCONT);
  const std::string left_out = a.at(2, 0).AllReduce("", absl::Seconds(kTimeoutSeconds));
  std::cout << "node 2 after SIGCONT: " << left_out << std::endl;
  EXPECT_THAT(left_out, StartsWith("err "));
  for (int k = 0; k < 3; ++k) a.at(k, 0).Quit();
  for (int k = 2; k >= 0; --k) EXPECT_TRUE(cluster->node(k).Stop()) << "node " << k;
}

// A cut link (`ip link set down` in network namespaces; needs root, skips otherwise): shorter than
// the heartbeat timeout it changes nothing; longer, it behaves like a kill: the other two nodes go
// on without node 2, and when the link comes back node 2's worker is refused, not hung.
TEST(MembershipFaultTest, ACutLinkLongerThanTheTimeoutBehavesLikeAKillAShorterOneChangesNothing) {
  ScratchDir dir;
  NetnsCluster net("dqfm", 3, 233);
  if (!net.ok()) GTEST_SKIP() << "network namespaces unavailable: " << net.error();
  std::vector<std::unique_ptr<DaemonProcess>> daemons =
      net.Daemons(DQ_DYNAMIQD, dir.path(), kTimeoutSeconds,
                  {absl::StrCat("--heartbeat_timeout=", kHeartbeatSeconds), "--min_nodes=2"});
  std::vector<std::string> sockets;
  for (const auto& d : daemons) sockets.push_back(d->spec().socket);
  for (auto& d : daemons) ASSERT_TRUE(d->Spawn().ok());
  for (auto& d : daemons) ASSERT_TRUE(d->WaitReady().ok()) << Tail(d->log());
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", sockets, 1, 4096);
  ASSERT_TRUE(a.Start().ok());
  EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  // Down for a third of the timeout, while nothing runs: no membership change.
  ASSERT_TRUE(net.SetLink(2, false));
  absl::SleepFor(absl::Seconds(kHeartbeatSeconds / 3));
  ASSERT_TRUE(net.SetLink(2, true));
  absl::SleepFor(absl::Seconds(kHeartbeatSeconds));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "") << i;
  EXPECT_THAT(ViewNodes(*daemons[0], "a"), ElementsAre(0, 1, 2));
  // Down for good (until restored below): nodes 0 and 1 go on over their own workers.
  ASSERT_TRUE(net.SetLink(2, false));
  const absl::Time cut = absl::Now();
  std::vector<Worker*> members = {&a.at(0, 0), &a.at(1, 0)};
  for (Worker* w : members) {
    w->child().Send("ranks 0,1");
    ASSERT_THAT(w->Result(), StartsWith("ok ranks 3"));
  }
  std::vector<std::string> replies;
  for (int attempt = 0; attempt < 3; ++attempt) {
    replies = AllReduceAll(members, "", absl::Seconds(kTimeoutSeconds));
    if (NotAllOk(replies).empty()) break;
  }
  std::cout << "node 2's link cut; nodes 0 and 1 ran on after " << absl::FormatDuration(absl::Now() - cut) << ": "
            << absl::StrJoin(replies, " | ") << std::endl;
  ASSERT_EQ(NotAllOk(replies), "") << Tail(daemons[0]->log());
  for (const std::string& r : replies) EXPECT_EQ(Nodes(r), "0,1") << r;
  EXPECT_THAT(daemons[0]->log(), HasSubstr("node 2 (silent for"));
  // The link comes back: node 2 is no member of the job's view any more; its worker is told so.
  ASSERT_TRUE(net.SetLink(2, true));
  const std::string left_out = a.at(2, 0).AllReduce("", absl::Seconds(kTimeoutSeconds));
  std::cout << "node 2 after its link came back: " << left_out << std::endl;
  EXPECT_THAT(left_out, StartsWith("err "));
  a.QuitAll();
  for (int k = 2; k >= 0; --k) EXPECT_TRUE(daemons[k]->Stop()) << "node " << k;
}

}  // namespace
}  // namespace dynamiq::faults

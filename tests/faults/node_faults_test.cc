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
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/faults/fault_harness.h"

namespace dynamiq::faults {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

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

// Issue 23.1 (and 22.7): a daemon waiting for its cluster, as node 0 for the others or as another
// node for an unreachable coordinator, says what it waits for every 5 s, answers gRPC health with
// NOT_SERVING (so a readiness probe fails), and stops at SIGTERM/SIGINT within seconds (exit 0),
// not at --timeout (300 s here).
TEST(NodeFaultTest, ADaemonWaitingForItsClusterIsNotReadyAndStopsAtASignal) {
  ScratchDir dir;
  const std::string node0 = absl::StrCat("127.0.0.1:", FreePort());
  struct Case {
    DaemonSpec spec;
    int signal;
    std::string waiting_for;
  };
  DaemonSpec first;
  first.num_nodes = 2;
  first.listen = node0;
  first.socket = dir.path() + "/node0.sock";
  first.timeout_seconds = 300;
  DaemonSpec second = first;
  second.node_rank = 1;
  second.listen = absl::StrCat("127.0.0.1:", FreePort());
  second.coordinator = node0;  // nobody there
  second.socket = dir.path() + "/node1.sock";
  for (const Case& c : {Case{first, SIGTERM, "node rank 1 of 2 has not joined yet"},
                        Case{second, SIGINT, absl::StrCat("the coordinator at ", node0, " does not answer")}}) {
    SCOPED_TRACE(absl::StrCat("node ", c.spec.node_rank));
    DaemonProcess d(DQ_DYNAMIQD, c.spec, absl::StrCat(dir.path(), "/wait", c.spec.node_rank, ".log"));
    ASSERT_TRUE(d.Spawn().ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(15);
    while (absl::Now() < deadline && !absl::StrContains(d.log(), c.waiting_for)) absl::SleepFor(absl::Milliseconds(50));
    EXPECT_THAT(d.log(), HasSubstr(absl::StrCat("waiting for the cluster to form: ", c.waiting_for)));
    if (c.spec.node_rank == 0) {
      // Its operator port answers, but not ready.
      auto health =
          grpc::health::v1::Health::NewStub(grpc::CreateChannel(c.spec.listen, grpc::InsecureChannelCredentials()));
      for (const std::string service : {"", "dynamiq.v1.Control"}) {
        grpc::health::v1::HealthCheckRequest request;
        request.set_service(service);
        grpc::health::v1::HealthCheckResponse response;
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        ASSERT_TRUE(health->Check(&context, request, &response).ok()) << service;
        EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING) << "'" << service << "'";
      }
    }
    const absl::Time signalled = absl::Now();
    d.child().Signal(c.signal);
    const std::optional<int> status = d.child().Wait(absl::Seconds(10));
    ASSERT_TRUE(status.has_value()) << "still running 10 s after the signal: " << Tail(d.log());
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << Tail(d.log());
    EXPECT_LT(absl::Now() - signalled, absl::Seconds(3));
    EXPECT_THAT(d.log(), HasSubstr("stopped before the cluster formed"));
  }
}

// Issue 22.7: after the coordinator restarted, the workers that stayed registered on the other
// nodes belong to a job whose state died with it. Their next all-reduce fails at once saying so
// (and what to do), rather than at --timeout (30 s here) with no hint.
TEST(NodeFaultTest, WorkersLeftOverFromBeforeACoordinatorRestartAreToldWhyTheirJobCannotGoOn) {
  constexpr double kLongTimeoutSeconds = 30;
  ScratchDir dir;
  LoopbackCluster cluster(DQ_DYNAMIQD, dir.path(), 2, kLongTimeoutSeconds);
  ASSERT_TRUE(cluster.Start().ok());
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", cluster.sockets(), 1, 4096);
  ASSERT_TRUE(a.Start().ok());
  EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  cluster.node(0).Kill(SIGKILL);
  ASSERT_TRUE(cluster.Start({0}).ok()) << Tail(cluster.node(1).log());  // node 1 re-joins
  const absl::Time start = absl::Now();
  const std::string reply = a.at(1, 0).AllReduce("", absl::Seconds(2 * kLongTimeoutSeconds));
  std::cout << "left-over worker on node 1 after " << absl::FormatDuration(absl::Now() - start) << ": " << reply
            << std::endl;
  EXPECT_EQ(ReplyCode(reply), "UNAVAILABLE") << reply;
  EXPECT_THAT(reply, HasSubstr("the coordinator (node 0) restarted"));
  EXPECT_THAT(reply, HasSubstr("restart the job's workers"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Once the job's workers are restarted everywhere, it runs again.
  a.QuitAll();
  ASSERT_TRUE(WaitJobRetired(cluster.node(1), "a"));
  JobWorkers again(DQ_FAULT_WORKER, dir.path(), "a", cluster.sockets(), 1, 4096);
  ASSERT_TRUE(again.Start().ok());
  EXPECT_EQ(NotAllOk(AllReduceAll(again.all())), "");
  again.QuitAll();
  EXPECT_TRUE(cluster.node(1).Stop());
  EXPECT_TRUE(cluster.node(0).Stop());
}

// Worker ids start at 1 in every dynamiqd. A worker left over from a daemon that died, which
// quits after the daemon restarted and a new worker took id 1, sends its teardown (ReleaseBuffer,
// Unregister of "its" worker 1) to the new daemon on the same socket: refused there, because the
// call does not come from the process that registered worker 1, so the new worker goes on. (It
// used to lose its buffer or its registration: a restarted membership test failed with "buffer 1
// is not allocated to worker 1" when the old worker's teardown won the race.)
TEST(NodeFaultTest, AWorkerOfAnEarlierDaemonCannotTouchTheNewWorkerWithItsId) {
  ScratchDir dir;
  LoopbackCluster cluster(DQ_DYNAMIQD, dir.path(), 1, kTimeoutSeconds);
  ASSERT_TRUE(cluster.Start().ok());
  WorkerSpec spec;
  spec.socket = cluster.sockets()[0];
  auto old = Worker::Start(DQ_FAULT_WORKER, spec, absl::StrCat(dir.path(), "/old.log"));
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_THAT((*old)->AllReduce(), StartsWith("ok "));
  cluster.node(0).Kill(SIGKILL);
  ASSERT_TRUE(cluster.Start({0}).ok());
  auto fresh = Worker::Start(DQ_FAULT_WORKER, spec, absl::StrCat(dir.path(), "/new.log"));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  (*old)->Quit();  // its teardown reaches the new daemon
  EXPECT_THAT(cluster.node(0).log(), HasSubstr("a worker id is good only in the process that registered it"));
  for (int i = 0; i < 3; ++i) EXPECT_THAT((*fresh)->AllReduce(), StartsWith("ok "));
  (*fresh)->Quit();
  EXPECT_TRUE(cluster.node(0).Stop());
}

}  // namespace
}  // namespace dynamiq::faults

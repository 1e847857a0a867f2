// Fault suite, workers: a worker process killed (SIGKILL) or stopped (SIGSTOP) in the middle of a
// collective on a two-node cluster of real dynamiqd processes. The collective fails on every
// participant of both nodes within the timeout, naming the worker (local rank, pid) or the node
// (rank); another job on the same daemons keeps working throughout; the daemons neither crash nor
// leak (fds, threads, shared-memory mappings); and a replacement worker (or the resumed one) gets
// the job going again.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/faults/fault_harness.h"

namespace dynamiq::faults {
namespace {

using ::testing::HasSubstr;

constexpr double kTimeoutSeconds = 4;

// Checks the daemons against their resources before the faults (bounded wait for cleanup).
void ExpectNoLeaks(LoopbackCluster& cluster, const std::vector<Resources>& before) {
  for (int k = 0; k < cluster.size(); ++k) {
    ASSERT_TRUE(cluster.node(k).Alive()) << "node " << k << " died:\n" << Tail(cluster.node(k).log());
    const Resources now = WaitForResources(cluster.node(k).pid(), before[k], before[k].shm_mappings);
    std::cout << "node " << k << " before: " << before[k].ToString() << "\n       after:  " << now.ToString()
              << std::endl;
    EXPECT_LE(now.fds, before[k].fds + 2) << "node " << k;
    EXPECT_LE(now.threads, before[k].threads + 3) << "node " << k;
    EXPECT_EQ(now.shm_mappings, before[k].shm_mappings) << "node " << k;
  }
}

// Worker SIGKILL while the collective waits for it, first on node 0, then on node 1: the dead
// worker's local peers get ABORTED naming its local rank and pid (the daemon watches its pidfd),
// the other node fails the same collective at once (the group is broken) with the same cause,
// naming the node, job b is untouched, and a replacement process takes the rank and the job goes
// on with exact sums.
TEST(WorkerFaultTest, KilledWorkerFailsTheCollectiveOnEveryNodeAndAReplacementRejoins) {
  ScratchDir dir;
  LoopbackCluster cluster(DQ_DYNAMIQD, dir.path(), 2, kTimeoutSeconds);
  ASSERT_TRUE(cluster.Start().ok());
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", cluster.sockets(), 2, 4096);
  JobWorkers b(DQ_FAULT_WORKER, dir.path(), "b", cluster.sockets(), 1, 4096);
  ASSERT_TRUE(a.Start().ok());
  ASSERT_TRUE(b.Start().ok());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
    EXPECT_EQ(NotAllOk(AllReduceAll(b.all())), "");
  }
  std::vector<Resources> before = {cluster.node(0).resources(), cluster.node(1).resources()};

  for (int round = 0; round < 2; ++round) {
    const int victim_node = round, victim_local = 1 - round, other_node = 1 - round;
    Worker& victim = a.at(victim_node, victim_local);
    const pid_t victim_pid = victim.pid();
    std::vector<Worker*> others = a.except(&victim);
    for (Worker* w : others) w->Submit();
    ASSERT_TRUE(WaitInflight(cluster.node(0), "a"));
    ASSERT_TRUE(WaitInflight(cluster.node(1), "a"));
    absl::SleepFor(absl::Milliseconds(100));  // the other node is inside its cross-node step
    for (Worker* w : b.all()) w->Submit();    // job b runs through the fault
    const absl::Time killed = absl::Now();
    victim.child().Signal(SIGKILL);
    ASSERT_TRUE(victim.child().Wait(absl::Seconds(5)).has_value());
    absl::Duration slowest;
    for (int node = 0; node < 2; ++node) {
      for (int local = 0; local < 2; ++local) {
        if (node == victim_node && local == victim_local) continue;
        const std::string reply = a.at(node, local).Result(absl::Seconds(2 * kTimeoutSeconds));
        slowest = std::max(slowest, absl::Now() - killed);
        SCOPED_TRACE(absl::StrCat("round ", round, ", node ", node, " local rank ", local, ": ", reply));
        std::cout << "  node " << node << " local rank " << local << ": " << reply << std::endl;
        if (node == victim_node) {
          EXPECT_EQ(ReplyCode(reply), "ABORTED");
          EXPECT_THAT(reply, HasSubstr(absl::StrCat("local rank ", victim_local, " left")));
          EXPECT_THAT(reply, HasSubstr(absl::StrCat("pid ", victim_pid, ") exited")));
        } else {
          // The cause, as the victim's node published it before breaking the group.
          EXPECT_EQ(ReplyCode(reply), "ABORTED");
          EXPECT_THAT(reply, HasSubstr(absl::StrCat("of job a failed on node ", victim_node, ": local rank ",
                                                    victim_local, " left (")));
          EXPECT_THAT(reply, HasSubstr(absl::StrCat("pid ", victim_pid, ") exited")));
          EXPECT_THAT(reply, HasSubstr("(here: "));
        }
      }
    }
    std::cout << "round " << round << ": worker SIGKILL on node " << victim_node
              << " -> every participant failed within " << absl::FormatDuration(slowest) << std::endl;
    EXPECT_LT(slowest, absl::Seconds(kTimeoutSeconds)) << "detected by the pidfd, not by the timeout";
    EXPECT_EQ(NotAllOk({b.at(0, 0).Result(), b.at(1, 0).Result()}), "") << "job b was affected";

    // Recovery: a new process registers the same local rank; the job continues with exact sums.
    ASSERT_TRUE(a.Restart(victim_node, victim_local).ok());
    EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
    EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
    EXPECT_EQ(NotAllOk(AllReduceAll(b.all())), "");
    (void)other_node;
  }
  ExpectNoLeaks(cluster, before);
  a.QuitAll();
  b.QuitAll();
  EXPECT_TRUE(cluster.node(1).Stop());
  EXPECT_TRUE(cluster.node(0).Stop());
  EXPECT_EQ(ShmNamesOf(cluster.node(0).pid()) + ShmNamesOf(cluster.node(1).pid()), 0);
}

// Issue 22.2: the same SIGKILL in the job's first collective, before the nodes ever connected: the
// other node waits in its rendezvous for a node that will not come, not in an engine step whose
// connection the victim's node resets. It must still fail at once with the published cause, not
// at --timeout (30 s here, so that the difference shows).
TEST(WorkerFaultTest, KilledWorkerBeforeTheNodesConnectedFailsTheOtherNodeAtOnce) {
  constexpr double kLongTimeoutSeconds = 30;
  ScratchDir dir;
  LoopbackCluster cluster(DQ_DYNAMIQD, dir.path(), 2, kLongTimeoutSeconds);
  ASSERT_TRUE(cluster.Start().ok());
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", cluster.sockets(), 2, 4096);
  ASSERT_TRUE(a.Start().ok());
  Worker& victim = a.at(0, 1);
  const pid_t victim_pid = victim.pid();
  for (Worker* w : a.except(&victim)) w->Submit();
  ASSERT_TRUE(WaitInflight(cluster.node(0), "a"));
  ASSERT_TRUE(WaitInflight(cluster.node(1), "a"));
  absl::SleepFor(absl::Milliseconds(300));  // node 1 waits in the rendezvous for node 0
  const absl::Time killed = absl::Now();
  victim.child().Signal(SIGKILL);
  ASSERT_TRUE(victim.child().Wait(absl::Seconds(5)).has_value());
  for (int local = 0; local < 2; ++local) {
    const std::string reply = a.at(1, local).Result(absl::Seconds(2 * kLongTimeoutSeconds));
    const absl::Duration took = absl::Now() - killed;
    std::cout << "  node 1 local rank " << local << " failed after " << absl::FormatDuration(took) << ": " << reply
              << std::endl;
    EXPECT_EQ(ReplyCode(reply), "ABORTED") << reply;
    EXPECT_THAT(reply, HasSubstr("of job a failed on node 0: local rank 1 left ("));
    EXPECT_THAT(reply, HasSubstr(absl::StrCat("pid ", victim_pid, ") exited")));
    EXPECT_LT(took, absl::Seconds(5)) << "node 1 waited out its rendezvous";
  }
  EXPECT_EQ(ReplyCode(a.at(0, 0).Result()), "ABORTED");
  // The job goes on once the rank is back.
  ASSERT_TRUE(a.Restart(0, 1).ok());
  EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  a.QuitAll();
  EXPECT_TRUE(cluster.node(1).Stop());
  EXPECT_TRUE(cluster.node(0).Stop());
}

// Issue 23.7: refused requests are logged with who sent them (the worker's pid and uid, from the
// socket's credentials), rate-limited, so the DynamiqRequestsRejected runbook can find the client.
TEST(WorkerFaultTest, RefusedRequestsAreLoggedWithTheWorkersPidAndUidAtABoundedRate) {
  ScratchDir dir;
  LoopbackCluster cluster(DQ_DYNAMIQD, dir.path(), 1, kTimeoutSeconds);
  ASSERT_TRUE(cluster.Start().ok());
  auto stub = dynamiq::v1::Worker::NewStub(
      grpc::CreateChannel("unix:" + cluster.socket(0), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 50; ++i) {
    dynamiq::v1::RegisterRequest request;  // no job id
    request.set_local_world_size(1);
    dynamiq::v1::RegisterResponse response;
    grpc::ClientContext context;
    ASSERT_EQ(stub->Register(&context, request, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  const std::string log = cluster.node(0).log();
  const std::string line = absl::StrCat("refused a request of worker pid ", getpid(), " uid ", geteuid(), " (fd:");
  EXPECT_THAT(log, HasSubstr(line)) << Tail(log);
  EXPECT_THAT(log, HasSubstr("INVALID_ARGUMENT: job id is empty"));
  int lines = 0;
  for (size_t at = log.find("refused a request"); at != std::string::npos; at = log.find("refused a request", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 1);
  EXPECT_LE(lines, 20) << "the log is not rate-limited";
  EXPECT_TRUE(cluster.node(0).Stop());
}

// SIGSTOP: a stopped worker never submits. The local watchdog fails the collective after
// --timeout naming the stalled worker (local rank, worker id, pid), counts it as a timeout fault,
// and the other node fails it too with the same cause (naming node 0 and the stalled local rank);
// job b keeps completing collectives meanwhile.
// After SIGCONT the resumed worker's stale request is refused (its collective already failed) and
// the next collective of all four workers succeeds.
TEST(WorkerFaultTest, StoppedWorkerIsNamedByTheWatchdogAndTheJobRecoversAfterSigcont) {
  ScratchDir dir;
  LoopbackCluster cluster(DQ_DYNAMIQD, dir.path(), 2, kTimeoutSeconds);
  cluster.spec(0).metrics_port = 0;
  ASSERT_TRUE(cluster.Start().ok());
  JobWorkers a(DQ_FAULT_WORKER, dir.path(), "a", cluster.sockets(), 2, 4096);
  JobWorkers b(DQ_FAULT_WORKER, dir.path(), "b", cluster.sockets(), 1, 4096);
  ASSERT_TRUE(a.Start().ok());
  ASSERT_TRUE(b.Start().ok());
  EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  EXPECT_EQ(NotAllOk(AllReduceAll(b.all())), "");
  std::vector<Resources> before = {cluster.node(0).resources(), cluster.node(1).resources()};

  Worker& victim = a.at(0, 1);
  victim.child().Signal(SIGSTOP);
  victim.Submit();  // waits in the pipe until SIGCONT
  const absl::Time start = absl::Now();
  for (Worker* w : a.except(&victim)) w->Submit();
  // Job b completes collectives while job a is stalled.
  int b_ok = 0;
  while (absl::Now() - start < absl::Seconds(kTimeoutSeconds - 1)) {
    b_ok += NotAllOk(AllReduceAll(b.all())).empty();
  }
  EXPECT_GT(b_ok, 0);
  absl::Duration slowest;
  for (Worker* w : a.except(&victim)) {
    const std::string reply = w->Result(absl::Seconds(3 * kTimeoutSeconds));
    const absl::Duration took = absl::Now() - start;
    slowest = std::max(slowest, took);
    SCOPED_TRACE(reply);
    std::cout << "  " << reply << std::endl;
    // Every participant reads the watchdog's verdict; node 1 after "failed on node 0".
    EXPECT_EQ(ReplyCode(reply), "DEADLINE_EXCEEDED");
    EXPECT_THAT(reply, HasSubstr(absl::StrCat("local ranks that did not submit: 1 (worker ")));
    EXPECT_THAT(reply, HasSubstr(absl::StrCat("pid ", victim.pid(), ")")));
    if (w != &a.at(0, 0)) {
      EXPECT_THAT(reply, HasSubstr("of job a failed on node 0: timed out after "));
      EXPECT_THAT(reply, HasSubstr("(here: "));
    }
    EXPECT_GE(took, absl::Seconds(kTimeoutSeconds) - absl::Milliseconds(100));
  }
  std::cout << "SIGSTOP: watchdog (--timeout=" << kTimeoutSeconds << "s) failed every participant within "
            << absl::FormatDuration(slowest) << "; job b completed " << b_ok << " collectives meanwhile" << std::endl;
  EXPECT_LT(slowest, absl::Seconds(kTimeoutSeconds + 2));
  EXPECT_GE(
      MetricValue(ScrapeMetrics(cluster.node(0).log()), "dynamiq_faults_total", {"job=\"a\"", "kind=\"timeout\""}), 1);

  victim.child().Signal(SIGCONT);
  const std::string stale = victim.Result(absl::Seconds(10));
  EXPECT_EQ(ReplyCode(stale), "INVALID_ARGUMENT") << stale;
  EXPECT_THAT(stale, HasSubstr("already ran"));
  EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  EXPECT_EQ(NotAllOk(AllReduceAll(a.all())), "");
  EXPECT_EQ(NotAllOk(AllReduceAll(b.all())), "");
  ExpectNoLeaks(cluster, before);
}

}  // namespace
}  // namespace dynamiq::faults

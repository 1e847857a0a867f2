// End-to-end: a job's lifetime on a daemon. A job is retired when its last local worker leaves or
// dies (its reducer thread, status and metrics go), and a job id registered again is a new
// incarnation with its own rendezvous and configuration keys, on one node, on a two-node cluster,
// across a configuration staged by the old incarnation, and across a restart of a non-coordinator
// daemon; nodes at different incarnations fail saying so.
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "dynamiq/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/grpc_store.h"
#include "server/metrics.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::AllReduceTogether;
using ::dynamiq::testing::ConnectTestWorker;
using ::dynamiq::testing::DaemonTestWorker;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StartTestCluster;
using ::dynamiq::testing::TempDir;
using ::dynamiq::testing::TestDaemonOptions;
using ::testing::HasSubstr;

// Threads of this process named like a job's reducer (server/job.cc names it "dq-reducer").
int ReducerThreads() {
  int count = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream comm(absl::StrCat("/proc/self/task/", e->d_name, "/comm"));
      std::string name;
      std::getline(comm, name);
      count += name == "dq-reducer";
    }
    closedir(d);
  }
  return count;
}

// Polls `done` every 10 ms for up to `limit`; true once it holds.
template <typename F>
bool WaitFor(F done, absl::Duration limit = absl::Seconds(20)) {
  const absl::Time deadline = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

grpc::Status Unregister(DaemonTestWorker& w) {
  dynamiq::v1::UnregisterRequest req;
  req.set_worker_id(w.id);
  dynamiq::v1::UnregisterResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return w.stub->Unregister(&ctx, req, &resp);
}

// Registers local ranks 0..local-1 of `job` on every node of `sockets`, mapping `n` floats each.
std::vector<DaemonTestWorker> ConnectAll(const std::vector<std::string>& sockets, const std::string& job,
                                         uint32_t local, size_t n) {
  std::vector<DaemonTestWorker> workers;
  for (const std::string& socket : sockets) {
    for (uint32_t r = 0; r < local; ++r) {
      auto w = ConnectTestWorker(socket, job, r, local, n);
      EXPECT_THAT(w, IsOk());
      if (w.ok()) workers.push_back(std::move(w).value());
    }
  }
  return workers;
}

// One all-reduce of every worker at once; worker w contributes (w + 1) * (k % 7 + round) at
// element k, so the exact sum is known. Returns the failures ("" when all succeeded exactly).
std::string AllReduceExactly(std::vector<DaemonTestWorker>& workers, size_t n, int round) {
  const float base = static_cast<float>(workers.size() * (workers.size() + 1) / 2);
  for (size_t w = 0; w < workers.size(); ++w) {
    for (size_t k = 0; k < n; ++k) workers[w].data()[k] = static_cast<float>(w + 1) * (k % 7 + round);
  }
  const std::vector<grpc::Status> status = AllReduceTogether(workers, "grad", n);
  std::string failures;
  for (size_t w = 0; w < workers.size(); ++w) {
    if (!status[w].ok()) {
      absl::StrAppend(&failures, "worker ", w, ": ", status[w].error_message(), "\n");
      continue;
    }
    for (size_t k = 0; k < n; ++k) {
      const float exact = base * (k % 7 + round);
      if (workers[w].data()[k] != exact) {
        absl::StrAppend(&failures, "worker ", w, " element ", k, ": ", workers[w].data()[k], " != ", exact, "\n");
        break;
      }
    }
  }
  return failures;
}

// Unregisters every worker (the launcher stops the job everywhere).
void UnregisterAll(std::vector<DaemonTestWorker>& workers) {
  for (DaemonTestWorker& w : workers) {
    grpc::Status s = Unregister(w);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  workers.clear();
}

std::vector<std::string> Sockets(const std::string& dir, uint32_t nodes) {
  std::vector<std::string> sockets;
  for (uint32_t r = 0; r < nodes; ++r) sockets.push_back(absl::StrCat(dir, "/node", r, ".sock"));
  return sockets;
}

// The value of the exposition line of `name` whose labels contain `label` (e.g. job="j"); -1: none.
double Sample(const std::string& exposition, const std::string& name, const std::string& label) {
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (!absl::StartsWith(line, absl::StrCat(name, "{")) || !absl::StrContains(line, label)) continue;
    return std::stod(std::string(line.substr(line.rfind(' ') + 1)));
  }
  return -1;
}

JobConfig NoCompression() { return *MakeJobConfig("none", 0, "ring", 0, "measured"); }

TEST(DaemonJobsTest, LastWorkerLeavingRetiresTheJobAndItsReducerThread) {
  TempDir temp;
  DaemonOptions o = TestDaemonOptions(temp.path(), 0, 1, NoCompression());
  o.metrics_port = 0;  // served: a retired job's series stay for one more collection
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  const int reducers_before = ReducerThreads();
  const size_t n = 4096;
  std::vector<DaemonTestWorker> workers = ConnectAll(Sockets(temp.path(), 1), "job", 2, n);
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(ReducerThreads(), reducers_before + 1);
  ASSERT_EQ(AllReduceExactly(workers, n, 1), "");
  auto statuses = daemon.JobStatuses();
  ASSERT_EQ(statuses.count("job"), 1u);
  EXPECT_EQ(statuses["job"].incarnation, 1u);
  EXPECT_EQ(Sample(daemon.metrics().Render(), "dynamiq_collectives_total", "result=\"ok\""), 1);

  // One worker leaves: the job stays. The second leaves: the job is retired.
  grpc::Status s = Unregister(workers[1]);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(daemon.JobStatuses().count("job"), 1u);
  s = Unregister(workers[0]);
  ASSERT_TRUE(s.ok()) << s.error_message();
  workers.clear();
  EXPECT_TRUE(daemon.JobStatuses().empty());
  EXPECT_TRUE(WaitFor([&] { return ReducerThreads() == reducers_before; }))
      << ReducerThreads() << " reducer threads, " << reducers_before << " before the job";
  // Its flight recorder stays readable; its series are exported once more, then gone.
  auto records = daemon.FlightRecorder("job", 0);
  ASSERT_THAT(records, IsOk());
  ASSERT_EQ(records->size(), 1u);
  EXPECT_EQ((*records)[0].state, "ok");
  std::string text = daemon.metrics().Render();
  EXPECT_EQ(Sample(text, "dynamiq_collectives_total", "result=\"ok\""), 1) << "final values exported";
  EXPECT_EQ(Sample(text, "dynamiq_connected_workers", "job=\"job\""), -1) << "state gauges go at once";
  text = daemon.metrics().Render();
  EXPECT_EQ(Sample(text, "dynamiq_collectives_total", "job=\"job\""), -1) << text;
  EXPECT_EQ(Sample(text, "dynamiq_faults_total", "job=\"job\""), -1);
  EXPECT_EQ(Sample(text, "dynamiq_collective_duration_seconds_count", "job=\"job\""), -1);

  // The id again: incarnation 2, a new reducer, exact sums.
  workers = ConnectAll(Sockets(temp.path(), 1), "job", 2, n);
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(daemon.JobStatuses()["job"].incarnation, 2u);
  EXPECT_EQ(ReducerThreads(), reducers_before + 1);
  EXPECT_EQ(AllReduceExactly(workers, n, 2), "");
  UnregisterAll(workers);
  EXPECT_TRUE(WaitFor([&] { return ReducerThreads() == reducers_before; }));
  daemon.Shutdown();
}

// The last local worker dies (SIGKILL, noticed through its pidfd) while it waits in a collective:
// the job is retired as by an unregistration, and its id works again.
TEST(DaemonJobsTest, LastWorkerDyingRetiresTheJob) {
  TempDir temp;
  Daemon daemon(TestDaemonOptions(temp.path(), 0, 1, NoCompression()));
  ASSERT_THAT(daemon.Start(), IsOk());
  const std::string socket = Sockets(temp.path(), 1)[0];
  const int reducers_before = ReducerThreads();
  // Local rank 0 of 2: its first collective waits for a rank 1 that never comes.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    setenv("DQ_LOCAL_RANK", "0", 1);
    setenv("DQ_LOCAL_WORLD_SIZE", "2", 1);
    execl(DQ_EXAMPLE_WORKER, DQ_EXAMPLE_WORKER, ("--socket=" + socket).c_str(), "--job=job", "--elements=4096",
          "--iterations=1", static_cast<char*>(nullptr));
    _exit(127);
  }
  const bool submitted = WaitFor([&] {
    auto s = daemon.JobStatuses();
    return s.count("job") && s["job"].inflight == 1;
  });
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  ASSERT_TRUE(submitted) << "the worker process never submitted";
  EXPECT_TRUE(WaitFor([&] { return daemon.JobStatuses().empty(); })) << "the job outlived its last worker";
  EXPECT_TRUE(WaitFor([&] { return ReducerThreads() == reducers_before; }));
  auto w = ConnectTestWorker(socket, "job", 0, 1, 1024);
  ASSERT_THAT(w, IsOk());
  EXPECT_EQ(daemon.JobStatuses()["job"].incarnation, 2u);
  std::vector<DaemonTestWorker> workers;
  workers.push_back(std::move(w).value());
  EXPECT_EQ(AllReduceExactly(workers, 1024, 3), "");
  daemon.Shutdown();
}

TEST(DaemonJobsTest, AJobRestartedOnEveryNodeIsTheNextIncarnationAndAllReducesExactly) {
  TempDir temp;
  auto daemons = StartTestCluster(temp.path(), 2, NoCompression());
  ASSERT_THAT(daemons, IsOk());
  const size_t n = 20000;
  const std::vector<std::string> sockets = Sockets(temp.path(), 2);
  for (uint64_t incarnation = 1; incarnation <= 3; ++incarnation) {
    SCOPED_TRACE(absl::StrCat("incarnation ", incarnation));
    std::vector<DaemonTestWorker> workers = ConnectAll(sockets, "job", 2, n);
    ASSERT_EQ(workers.size(), 4u);
    for (auto& d : *daemons) EXPECT_EQ(d->JobStatuses()["job"].incarnation, incarnation);
    // Twice: the group forms, then its transport is reused.
    for (int round = 0; round < 2; ++round) EXPECT_EQ(AllReduceExactly(workers, n, round), "");
    UnregisterAll(workers);
    for (auto& d : *daemons) EXPECT_TRUE(d->JobStatuses().empty());
  }
  for (auto& d : *daemons) d->Shutdown();
}

TEST(DaemonJobsTest, ACompressionChangeStagedByAnEarlierIncarnationDoesNotApply) {
  TempDir temp;
  auto daemons = StartTestCluster(temp.path(), 2, NoCompression());
  ASSERT_THAT(daemons, IsOk());
  const size_t n = 8192;
  const std::vector<std::string> sockets = Sockets(temp.path(), 2);
  std::vector<DaemonTestWorker> workers = ConnectAll(sockets, "job", 1, n);
  ASSERT_EQ(workers.size(), 2u);
  ASSERT_EQ(AllReduceExactly(workers, n, 0), "");
  // Staged for sequence 3 of incarnation 1, which never gets there: the launcher restarts the job.
  auto control = dynamiq::v1::Control::NewStub(
      grpc::CreateChannel((*daemons)[1]->listen_address(), grpc::InsecureChannelCredentials()));
  dynamiq::v1::SetCompressionRequest set;
  set.set_job_id("job");
  set.mutable_config()->set_codec("uniform");
  set.mutable_config()->set_bits(2);
  dynamiq::v1::SetCompressionResponse resp;
  {
    grpc::ClientContext ctx;
    grpc::Status s = control->SetCompression(&ctx, set, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(resp.epoch(), 1u);
  UnregisterAll(workers);

  // Incarnation 2 runs past that sequence uncompressed (2-bit uniform would not be exact).
  workers = ConnectAll(sockets, "job", 1, n);
  ASSERT_EQ(workers.size(), 2u);
  for (int round = 0; round < 6; ++round) EXPECT_EQ(AllReduceExactly(workers, n, round), "") << "round " << round;
  for (auto& d : *daemons) {
    const Job::Status status = d->JobStatuses()["job"];
    EXPECT_EQ(status.incarnation, 2u);
    EXPECT_EQ(status.config_epoch, 0u);
    EXPECT_EQ(status.config.codec.id, kernels::CodecId::kNone);
  }
  // Its own changes start again at epoch 1 and do apply.
  {
    grpc::ClientContext ctx;
    set.mutable_config()->set_bits(8);
    grpc::Status s = control->SetCompression(&ctx, set, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(resp.epoch(), 1u);
  for (int round = 0; round < 3; ++round) {
    for (auto& w : workers) std::fill(w.data(), w.data() + n, 1.0f);
    grpc::Status s0;
    std::thread t([&] { s0 = workers[0].AllReduce("grad", n); });
    grpc::Status s1 = workers[1].AllReduce("grad", n);
    t.join();
    EXPECT_TRUE(s0.ok()) << s0.error_message();
    EXPECT_TRUE(s1.ok()) << s1.error_message();
  }
  for (auto& d : *daemons) {
    auto records = d->FlightRecorder("job", 1);
    ASSERT_THAT(records, IsOk());
    ASSERT_EQ(records->size(), 1u);
    EXPECT_EQ(records->back().config_epoch, 1u);
    EXPECT_EQ(records->back().config.codec.id, kernels::CodecId::kUniform);
  }
  UnregisterAll(workers);
  for (auto& d : *daemons) d->Shutdown();
}

TEST(DaemonJobsTest, ARestartedNodeContinuesItsIncarnationCountAndTheJobIdWorksAgain) {
  TempDir temp;
  auto daemons = StartTestCluster(temp.path(), 2, NoCompression());
  ASSERT_THAT(daemons, IsOk());
  const size_t n = 8192;
  const std::vector<std::string> sockets = Sockets(temp.path(), 2);
  std::vector<DaemonTestWorker> workers = ConnectAll(sockets, "job", 1, n);
  ASSERT_EQ(workers.size(), 2u);
  ASSERT_EQ(AllReduceExactly(workers, n, 0), "");

  // Node 1's daemon goes away with its job live; the launcher stops the job on node 0.
  const std::string node1_address = (*daemons)[1]->listen_address();
  (*daemons)[1]->Shutdown();
  (*daemons)[1].reset();
  grpc::Status s = Unregister(workers[0]);
  EXPECT_TRUE(s.ok()) << s.error_message();
  workers.clear();
  EXPECT_TRUE((*daemons)[0]->JobStatuses().empty());

  // Node 1 restarts at the same address; the job id is reused on both nodes.
  DaemonOptions o = TestDaemonOptions(temp.path(), 1, 2, NoCompression());
  o.coordinator = (*daemons)[0]->listen_address();
  o.listen = node1_address;
  (*daemons)[1] = std::make_unique<Daemon>(o);
  ASSERT_THAT((*daemons)[1]->Start(), IsOk());
  workers = ConnectAll(sockets, "job", 1, n);
  ASSERT_EQ(workers.size(), 2u);
  for (auto& d : *daemons) EXPECT_EQ(d->JobStatuses()["job"].incarnation, 2u);
  for (int round = 0; round < 2; ++round) EXPECT_EQ(AllReduceExactly(workers, n, round), "");
  UnregisterAll(workers);
  for (auto& d : *daemons) d->Shutdown();
}

// Issue 42, item 9: the coordinator's store kept every job's keys for good (20k register/unregister
// cycles with distinct job ids grew node 0 by 8 MiB). A job's keys now go once every node has
// retired it, and a reused id still counts its incarnations on.
TEST(DaemonJobsTest, TheCoordinatorForgetsAJobOnceEveryNodeRetiredIt) {
  TempDir temp;
  auto daemons = StartTestCluster(temp.path(), 2, NoCompression());
  ASSERT_THAT(daemons, IsOk());
  const std::vector<std::string> sockets = Sockets(temp.path(), 2);
  GrpcStore coordinator((*daemons)[0]->listen_address());
  auto is_set = [&](const std::string& key) { return coordinator.Get(key, absl::ZeroDuration()).ok(); };
  const size_t n = 1024;
  for (int i = 0; i < 150; ++i) {
    SCOPED_TRACE(absl::StrCat("job ", i));
    const std::string job = absl::StrCat("run-", i);
    std::vector<DaemonTestWorker> workers = ConnectAll(sockets, job, 1, n);
    ASSERT_EQ(workers.size(), 2u);
    const uint64_t incarnation = (*daemons)[0]->JobStatuses()[job].incarnation;
    const std::string rendezvous = absl::StrCat("job/", job, "/inc", incarnation, "/view0-from0/tcp/0");
    if (i % 50 == 0) ASSERT_EQ(AllReduceExactly(workers, n, 0), "");  // the transport's keys too
    const bool rendezvous_set = is_set(rendezvous);
    for (int r = 0; r < 2; ++r) EXPECT_TRUE(is_set(absl::StrCat("job/", job, "/node", r, "/incarnations")));
    // Node 0 retires it first: node 1 still runs it, so its keys stay.
    grpc::Status s = Unregister(workers[0]);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(is_set(absl::StrCat("job/", job, "/node1/incarnations")));
    s = Unregister(workers[1]);
    ASSERT_TRUE(s.ok()) << s.error_message();
    workers.clear();
    for (int r = 0; r < 2; ++r) EXPECT_FALSE(is_set(absl::StrCat("job/", job, "/node", r, "/incarnations")));
    if (rendezvous_set) EXPECT_FALSE(is_set(rendezvous));
  }
  // An id used again: its next incarnation, on both nodes, and it all-reduces exactly.
  std::vector<DaemonTestWorker> workers = ConnectAll(sockets, "run-0", 1, n);
  ASSERT_EQ(workers.size(), 2u);
  const uint64_t again = (*daemons)[0]->JobStatuses()["run-0"].incarnation;
  EXPECT_GT(again, 1u);
  EXPECT_EQ((*daemons)[1]->JobStatuses()["run-0"].incarnation, again);
  EXPECT_EQ(AllReduceExactly(workers, n, 1), "");
  UnregisterAll(workers);
  for (auto& d : *daemons) d->Shutdown();
}

// A node whose workers restarted alone is an incarnation ahead: its collectives cannot meet the
// other node's, and the error says why.
TEST(DaemonJobsTest, NodesAtDifferentIncarnationsFailNamingBoth) {
  TempDir temp;
  auto daemons = StartTestCluster(temp.path(), 2, NoCompression());
  ASSERT_THAT(daemons, IsOk());
  // StartTestCluster's 20 s timeout applies to the rendezvous too; this test waits for it once.
  const size_t n = 1024;
  const std::vector<std::string> sockets = Sockets(temp.path(), 2);
  std::vector<DaemonTestWorker> workers = ConnectAll(sockets, "job", 1, n);
  ASSERT_EQ(workers.size(), 2u);
  ASSERT_EQ(AllReduceExactly(workers, n, 0), "");
  grpc::Status s = Unregister(workers[0]);
  ASSERT_TRUE(s.ok()) << s.error_message();
  auto again = ConnectTestWorker(sockets[0], "job", 0, 1, n);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ((*daemons)[0]->JobStatuses()["job"].incarnation, 2u);
  EXPECT_EQ((*daemons)[1]->JobStatuses()["job"].incarnation, 1u);
  s = again->AllReduce("grad", n);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.error_message(), HasSubstr("node 1 is at incarnation 1 of job job, this node at 2"));
  workers.push_back(std::move(again).value());
  workers.erase(workers.begin());
  UnregisterAll(workers);
  for (auto& d : *daemons) d->Shutdown();
}

// Issue 23.5: workers of the two nodes registered different job ids. The node waiting in the
// rendezvous says which node has no workers in its job, not only which store key was missing.
TEST(DaemonJobsTest, NodesWhoseWorkersUseDifferentJobIdsSayWhichNodeHasNone) {
  TempDir temp;
  auto daemons = StartTestCluster(temp.path(), 2, NoCompression(), absl::Seconds(3));
  ASSERT_THAT(daemons, IsOk());
  const size_t n = 1024;
  const std::vector<std::string> sockets = Sockets(temp.path(), 2);
  auto a = ConnectTestWorker(sockets[0], "jobA", 0, 1, n);
  auto b = ConnectTestWorker(sockets[1], "jobB", 0, 1, n);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  grpc::Status sa;
  std::thread t([&] { sa = a->AllReduce("grad", n); });
  const grpc::Status sb = b->AllReduce("grad", n);
  t.join();
  EXPECT_EQ(sa.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << sa.error_message();
  EXPECT_THAT(sa.error_message(), HasSubstr("node 1 has no workers in job 'jobA'"));
  EXPECT_THAT(sb.error_message(), HasSubstr("node 0 has no workers in job 'jobB'"));
  EXPECT_THAT(sa.error_message(), HasSubstr("DQ_JOB"));
  for (auto& d : *daemons) d->Shutdown();
}

// Issue 23.6: a collective failed by the local watchdog is in the flight recorder, and
// GetFlightRecorder without a job id still shows a retired job's records.
TEST(DaemonJobsTest, WatchdogTimeoutsAreRecordedAndRetiredJobsStayReadableWithoutAJobId) {
  TempDir temp;
  DaemonOptions o = TestDaemonOptions(temp.path(), 0, 1, NoCompression());
  o.timeout = absl::Seconds(1);
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  auto a = ConnectTestWorker(o.worker_socket, "job", 0, 2, 16);
  auto b = ConnectTestWorker(o.worker_socket, "job", 1, 2, 16);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  const grpc::Status s = a->AllReduce("lonely", 16);  // local rank 1 never submits
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  ASSERT_TRUE(Unregister(*a).ok());
  ASSERT_TRUE(Unregister(*b).ok());  // the job retires
  ASSERT_TRUE(WaitFor([&] { return daemon.JobStatuses().empty(); }));
  auto control =
      dynamiq::v1::Control::NewStub(grpc::CreateChannel(daemon.listen_address(), grpc::InsecureChannelCredentials()));
  dynamiq::v1::GetFlightRecorderRequest request;  // no job id: every job with a record
  dynamiq::v1::GetFlightRecorderResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(control->GetFlightRecorder(&context, request, &response).ok());
  ASSERT_EQ(response.records_size(), 1);
  const dynamiq::v1::CollectiveRecord& r = response.records(0);
  EXPECT_EQ(r.job_id(), "job");
  EXPECT_EQ(r.tensor_name(), "lonely");
  EXPECT_EQ(r.state(), "failed");
  EXPECT_THAT(r.error(), HasSubstr("timed out after 1s (dynamiqd --timeout); local ranks that did not submit: 1"));
  EXPECT_NEAR(r.seconds(), 1.0, 1e-9);
  daemon.Shutdown();
}

}  // namespace
}  // namespace dynamiq::server

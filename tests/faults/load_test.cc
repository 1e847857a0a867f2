// Load test (label `load`): two dynamiqd processes on loopback, four jobs with fourteen worker
// processes (dq-fault-worker in load mode, C++ client): three jobs of two workers per node
// all-reducing small tensors (256..2048 elements, uncompressed and exact) back to back, and one
// job of one worker per node all-reducing 256K and 1M-element tensors (DynamiQ, as four
// concurrent asynchronous requests each), while operators change the jobs' compression through
// both nodes several times a second. Two rounds with fresh worker processes: every collective
// succeeds and checks, and the daemons' fds, threads and shared memory after the second round
// equal those after the first (no per-collective or per-worker leak). Prints the load held.
#include <signal.h>

#include <atomic>
#include <iostream>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/faults/fault_harness.h"

namespace dynamiq::faults {
namespace {

constexpr absl::Duration kRoundLimit = absl::Seconds(120);  // bounds a round

struct LoadJob {
  std::string id;
  int per_node;
  std::string sizes;
  double tolerance;  // max relative error per element; lossy jobs check the vNMSE instead
  int64_t elements;
  int iterations;  // per worker and round (all workers of a job stop after the same collective)
};

struct Totals {
  uint64_t collectives = 0;  // per job (one worker's count), summed over jobs
  uint64_t small = 0;
  uint64_t payload_bytes = 0;  // per job, summed
  double seconds = 0;
};

// Runs one round: every job's workers in load mode; returns the totals.
Totals RunRound(LoopbackCluster& cluster, const std::string& dir, const std::vector<LoadJob>& jobs, int round) {
  std::vector<std::unique_ptr<Child>> workers;
  std::vector<const LoadJob*> job_of;
  for (const LoadJob& j : jobs) {
    for (int node = 0; node < 2; ++node) {
      for (int local = 0; local < j.per_node; ++local) {
        std::vector<std::string> argv = {DQ_FAULT_WORKER,
                                         absl::StrCat("--socket=", cluster.socket(node)),
                                         absl::StrCat("--job=", j.id),
                                         absl::StrCat("--local_rank=", local),
                                         absl::StrCat("--local_world_size=", j.per_node),
                                         absl::StrCat("--global_rank=", node * j.per_node + local),
                                         absl::StrCat("--world=", 2 * j.per_node),
                                         absl::StrCat("--elements=", j.elements),
                                         absl::StrCat("--sizes=", j.sizes),
                                         absl::StrCat("--tolerance=", j.tolerance),
                                         j.tolerance > 0 ? "--max_vnmse=0.05" : "--max_vnmse=0",
                                         absl::StrCat("--loop_iterations=", j.iterations)};
        auto child = Child::Spawn(argv, absl::StrCat(dir, "/load.", j.id, ".", node, ".", local, ".r", round, ".log"));
        EXPECT_TRUE(child.ok()) << child.status();
        if (!child.ok()) continue;
        workers.push_back(*std::move(child));
        job_of.push_back(&j);
      }
    }
  }
  Totals t;
  std::map<std::string, bool> counted;
  for (size_t i = 0; i < workers.size(); ++i) {
    std::optional<std::string> line = workers[i]->ReadLine(kRoundLimit);
    std::optional<int> status = workers[i]->Wait(absl::Seconds(30));
    EXPECT_TRUE(line.has_value()) << "worker of job " << job_of[i]->id
                                  << " printed nothing: " << Tail(workers[i]->log());
    if (!line.has_value()) continue;
    EXPECT_TRUE(status.has_value() && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *line << "\n"
                                                                                       << Tail(workers[i]->log());
    // done <collectives> <errors> <bad> <payload_bytes> <seconds>
    std::vector<std::string> f = absl::StrSplit(*line, ' ');
    EXPECT_EQ(f.size(), 6u) << *line;
    if (f.size() != 6) continue;
    EXPECT_EQ(f[2], "0") << "errors in job " << job_of[i]->id << ": " << Tail(workers[i]->log());
    EXPECT_EQ(f[3], "0") << "wrong sums in job " << job_of[i]->id << ": " << Tail(workers[i]->log());
    if (!counted[job_of[i]->id]) {  // every worker of a job runs the same collectives
      counted[job_of[i]->id] = true;
      uint64_t c = 0, b = 0;
      double s = 0;
      (void)absl::SimpleAtoi(f[1], &c);
      (void)absl::SimpleAtoi(f[4], &b);
      (void)absl::SimpleAtod(f[5], &s);
      t.collectives += c;
      if (job_of[i]->tolerance == 0) t.small += c;
      t.payload_bytes += b;
      t.seconds = std::max(t.seconds, s);
    }
  }
  return t;
}

TEST(LoadTest, ManyWorkersAndJobsWithConcurrentCompressionChangesRunCleanAndLeakNothing) {
  ScratchDir dir;
  LoopbackCluster cluster(DQ_DYNAMIQD, dir.path(), 2, 30, "dynamiq");
  for (int k = 0; k < 2; ++k) cluster.spec(k).flags = {"--min_compress_elements=4096", "--bits=5"};
  ASSERT_TRUE(cluster.Start().ok());
  const std::vector<LoadJob> jobs = {
      {"s0", 2, "256,1024,2048", 0, 2048, 1500},
      {"s1", 2, "2048,256", 0, 2048, 1500},
      {"s2", 2, "1024", 0, 1024, 1500},
      {"big", 1, "262144,1048576", 1e9, 1 << 20, 24},
  };
  // Operators: SetCompression through both nodes, cycling codecs and bits, on every job.
  std::atomic<bool> stop{false};
  std::atomic<int> changes{0}, refused{0};
  std::thread operators([&] {
    const std::vector<std::pair<std::string, double>> configs = {
        {"dynamiq", 4}, {"dynamiq", 6}, {"mxfp8", 0}, {"dynamiq", 5}, {"none", 0}};
    for (int i = 0; !stop; ++i) {
      // Often enough for 20 changes while the rounds run (about 1.5 s each over --transport=tcp,
      // 4,700 collectives: small ones take tens of microseconds since the submission rings).
      absl::SleepFor(absl::Milliseconds(25));
      auto control = cluster.node(i % 2).Control();
      dynamiq::v1::SetCompressionRequest set;
      set.set_job_id(jobs[i % jobs.size()].id);
      set.mutable_config()->set_codec(configs[i % configs.size()].first);
      set.mutable_config()->set_bits(configs[i % configs.size()].second);
      set.mutable_config()->set_min_compress_elements(4096);
      dynamiq::v1::SetCompressionResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      grpc::Status s = control->SetCompression(&ctx, set, &resp);
      // NOT_FOUND until the job's first worker registered on that node.
      if (s.ok()) {
        ++changes;
      } else if (s.error_code() != grpc::StatusCode::NOT_FOUND) {
        ++refused;
        std::cerr << "SetCompression: " << s.error_message() << std::endl;
      }
    }
  });
  std::vector<Resources> after_first;
  std::vector<Totals> totals;
  for (int round = 0; round < 2; ++round) {
    totals.push_back(RunRound(cluster, dir.path(), jobs, round));
    const Totals& t = totals.back();
    std::cout << "round " << round << ": 14 workers, 4 jobs, 2 nodes: " << t.collectives << " collectives (" << t.small
              << " small) in " << t.seconds << " s = " << t.collectives / t.seconds << " collectives/s, "
              << t.payload_bytes / t.seconds / 1e6 << " MB/s payload; " << changes << " compression changes so far"
              << std::endl;
    for (int k = 0; k < 2; ++k) {
      ASSERT_TRUE(cluster.node(k).Alive()) << Tail(cluster.node(k).log());
      std::cout << "  node " << k << ": " << cluster.node(k).resources().ToString() << std::endl;
    }
    if (round == 0) after_first = {cluster.node(0).resources(), cluster.node(1).resources()};
  }
  stop = true;
  operators.join();
  EXPECT_GT(changes, 20);
  EXPECT_EQ(refused, 0);
  EXPECT_GE(totals[0].small + totals[1].small, 5000u) << "thousands of small all-reduces";
  for (int k = 0; k < 2; ++k) {
    const Resources now = WaitForResources(cluster.node(k).pid(), after_first[k], 0, 2, 3);
    std::cout << "node " << k << " after round 1: " << after_first[k].ToString()
              << "\n       after round 2: " << now.ToString() << std::endl;
    EXPECT_LE(now.fds, after_first[k].fds + 2) << "node " << k;
    EXPECT_LE(now.threads, after_first[k].threads + 3) << "node " << k;
    EXPECT_EQ(now.shm_mappings, 0) << "node " << k;
    EXPECT_LT(now.rss_kb, after_first[k].rss_kb * 5 / 4 + 8192) << "node " << k;
  }
  EXPECT_TRUE(cluster.node(1).Stop());
  EXPECT_TRUE(cluster.node(0).Stop());
}

}  // namespace
}  // namespace dynamiq::faults

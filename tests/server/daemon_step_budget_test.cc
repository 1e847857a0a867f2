// End-to-end: dynamiqd --step_budget on two nodes. A step all-reduces a large bucket of small
// gradients and a small bucket of large ones (a CNN's dense and conv layers); with one budget per
// step the second gets more bits and the first fewer, the step sends about what it did, every
// worker still gets the same bits, and the step's error drops.
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/job.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::AllReduceTogether;
using ::dynamiq::testing::ConnectTestWorkers;
using ::dynamiq::testing::DaemonTestWorker;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StartTestCluster;
using ::dynamiq::testing::TempDir;
using ::dynamiq::testing::TestDaemonOptions;

constexpr size_t kQuiet = 64 * 1024, kLoud = 8 * 1024;

// Worker w's gradient element k of bucket `loud` at `step`: uncorrelated across workers (flat
// buckets, like late training), the loud bucket 30x larger.
float Value(bool loud, size_t k, size_t w, int step) {
  const double x = static_cast<double>(k);
  const double v = std::sin(0.37 * x * (w + 2) + 1.3 * step) + 0.5 * std::cos(0.011 * x + w);
  return static_cast<float>(loud ? 30 * v : v);
}

struct StepRun {
  double error = 0, energy = 0;  // of the whole step, summed over its buckets
  uint64_t wire_bytes[2] = {0, 0};
};

// Runs `steps` steps on a fresh 2-node cluster (1 worker each); returns what the last one did.
StepRun RunSteps(bool step_budget, int steps) {
  TempDir temp;
  auto config = MakeJobConfig("dynamiq", 5, "ring", /*min_compress_elements=*/1024, "measured");
  EXPECT_THAT(config, IsOk());
  auto daemons = StartTestCluster(temp.path(), 2, *config, absl::Seconds(20),
                                  [&](DaemonOptions& o) { o.step_budget = step_budget; });
  EXPECT_THAT(daemons, IsOk());
  if (!daemons.ok()) return {};
  auto connected = ConnectTestWorkers(temp.path(), 2, 1, kQuiet);
  EXPECT_THAT(connected, IsOk());
  if (!connected.ok()) return {};
  std::vector<DaemonTestWorker>& workers = *connected;
  StepRun last;
  for (int step = 0; step < steps; ++step) {
    last = StepRun{};
    for (int b = 0; b < 2; ++b) {
      const bool loud = b == 1;
      const size_t n = loud ? kLoud : kQuiet;
      for (size_t w = 0; w < 2; ++w) {
        for (size_t k = 0; k < n; ++k) workers[w].data()[k] = Value(loud, k, w, step);
      }
      std::vector<dynamiq::v1::AllReduceResponse> response;
      const std::vector<grpc::Status> status =
          AllReduceTogether(workers, absl::StrCat("model.bucket", b), n, &response);
      for (size_t w = 0; w < 2; ++w) EXPECT_TRUE(status[w].ok()) << status[w].error_message();
      EXPECT_EQ(0, std::memcmp(workers[0].data(), workers[1].data(), n * 4)) << "step " << step << " bucket " << b;
      last.wire_bytes[b] = response[0].wire_bytes();
      for (size_t k = 0; k < n; ++k) {
        const double exact = static_cast<double>(Value(loud, k, 0, step)) + Value(loud, k, 1, step);
        const double d = workers[0].data()[k] - exact;
        last.error += d * d;
        last.energy += exact * exact;
      }
    }
  }
  for (auto& d : *daemons) d->Shutdown();
  return last;
}

TEST(DaemonStepBudgetTest, TheLoudBucketGetsMoreBitsAndTheStepLessError) {
  const StepRun per_bucket = RunSteps(false, 3);
  const StepRun per_step = RunSteps(true, 3);
  ASSERT_GT(per_bucket.energy, 0);
  ASSERT_EQ(per_step.energy, per_bucket.energy);
  EXPECT_GT(per_step.wire_bytes[1], per_bucket.wire_bytes[1] * 13 / 10);  // ~8 bits instead of 5
  EXPECT_LT(per_step.wire_bytes[0], per_bucket.wire_bytes[0]);
  const uint64_t step_bytes = per_step.wire_bytes[0] + per_step.wire_bytes[1];
  const uint64_t bucket_bytes = per_bucket.wire_bytes[0] + per_bucket.wire_bytes[1];
  EXPECT_LE(step_bytes, bucket_bytes * 101 / 100);
  RecordProperty("vnmse_per_bucket", absl::StrCat(per_bucket.error / per_bucket.energy));
  RecordProperty("vnmse_per_step", absl::StrCat(per_step.error / per_step.energy));
  RecordProperty("wire_bytes_per_bucket", absl::StrCat(per_bucket.wire_bytes[0], " + ", per_bucket.wire_bytes[1]));
  RecordProperty("wire_bytes_per_step", absl::StrCat(per_step.wire_bytes[0], " + ", per_step.wire_bytes[1]));
  EXPECT_LT(per_step.error, 0.5 * per_bucket.error) << "vNMSE per bucket " << per_bucket.error / per_bucket.energy
                                                    << ", per step " << per_step.error / per_step.energy;
}

TEST(DaemonStepBudgetTest, NodesThatDisagreeDoNotStart) {
  TempDir temp;
  auto config = MakeJobConfig("dynamiq", 5, "ring", /*min_compress_elements=*/1024, "measured");
  ASSERT_THAT(config, IsOk());
  // Node 1 is refused as it joins (the settings are compared at join); node 0 goes on waiting for a
  // node 1 that agrees, until stopped.
  DaemonOptions o0 = TestDaemonOptions(temp.path(), 0, 2, *config);
  o0.step_budget = true;
  Daemon node0(o0);
  absl::Status started0;
  std::thread start0([&] { started0 = node0.Start(); });
  for (int i = 0; i < 1000 && node0.listen_address().empty(); ++i) absl::SleepFor(absl::Milliseconds(10));
  DaemonOptions o1 = TestDaemonOptions(temp.path(), 1, 2, *config);
  o1.coordinator = node0.listen_address();
  Daemon node1(o1);
  const absl::Status started1 = node1.Start();
  node0.CancelStart();
  start0.join();
  EXPECT_EQ(started1.code(), absl::StatusCode::kFailedPrecondition) << started1;
  EXPECT_NE(started1.message().find("node 0 runs --step_budget=true but node 1 runs --step_budget=false"),
            absl::string_view::npos)
      << started1;
  EXPECT_FALSE(started0.ok());
}

}  // namespace
}  // namespace dynamiq::server

// End-to-end: compression changes made at the same time through different nodes get distinct
// epochs (claimed with compare-and-set on the coordinator's store) and every node applies each at
// the same collective.
#include <grpcpp/grpcpp.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dynamiq/v1/control.grpc.pb.h"
#include "gtest/gtest.h"
#include "server/job.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::ConnectTestWorkers;
using ::dynamiq::testing::DaemonTestWorker;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StartTestCluster;
using ::dynamiq::testing::TempDir;

TEST(DaemonConfigTest, ConcurrentChangesThroughDifferentNodesGetDistinctEpochsAppliedEverywhereAlike) {
  TempDir temp;
  auto config = MakeJobConfig("dynamiq", 5, "ring", 1024, "measured");
  ASSERT_THAT(config, IsOk());
  auto daemons = StartTestCluster(temp.path(), 2, *config);
  ASSERT_THAT(daemons, IsOk());
  const size_t n = 8192;
  auto connected = ConnectTestWorkers(temp.path(), 2, 1, n);
  ASSERT_THAT(connected, IsOk());
  std::vector<DaemonTestWorker>& workers = *connected;
  auto run = [&] {
    for (auto& w : workers) {
      for (size_t k = 0; k < n; ++k) w.data()[k] = 0.001f * static_cast<float>(k % 97);
    }
    grpc::Status s0;
    std::thread t([&] { s0 = workers[0].AllReduce("g", n); });
    grpc::Status s1 = workers[1].AllReduce("g", n);
    t.join();
    EXPECT_TRUE(s0.ok()) << s0.error_message();
    EXPECT_TRUE(s1.ok()) << s1.error_message();
  };
  run();

  // Eight operators at once, four through each node, each asking for different bits.
  constexpr int kCalls = 8;
  std::vector<uint64_t> epochs(kCalls, 0);
  std::vector<grpc::Status> status(kCalls);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] {
      auto control = dynamiq::v1::Control::NewStub(
          grpc::CreateChannel((*daemons)[i % 2]->listen_address(), grpc::InsecureChannelCredentials()));
      dynamiq::v1::SetCompressionRequest set;
      set.set_job_id("job");
      set.mutable_config()->set_codec("dynamiq");
      set.mutable_config()->set_bits(3.5 + 0.5 * i);
      dynamiq::v1::SetCompressionResponse resp;
      grpc::ClientContext ctx;
      status[i] = control->SetCompression(&ctx, set, &resp);
      epochs[i] = resp.epoch();
    });
  }
  for (auto& t : threads) t.join();
  std::set<uint64_t> distinct;
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(status[i].ok()) << status[i].error_message();
    distinct.insert(epochs[i]);
  }
  EXPECT_EQ(distinct.size(), static_cast<size_t>(kCalls));
  EXPECT_EQ(*distinct.begin(), 1u);
  EXPECT_EQ(*distinct.rbegin(), static_cast<uint64_t>(kCalls));

  for (int i = 0; i < 4; ++i) run();
  auto r0 = (*daemons)[0]->FlightRecorder("job", 0);
  auto r1 = (*daemons)[1]->FlightRecorder("job", 0);
  ASSERT_THAT(r0, IsOk());
  ASSERT_THAT(r1, IsOk());
  ASSERT_EQ(r0->size(), r1->size());
  for (size_t i = 0; i < r0->size(); ++i) {
    EXPECT_EQ((*r0)[i].config_epoch, (*r1)[i].config_epoch) << "sequence " << (*r0)[i].sequence;
    EXPECT_EQ((*r0)[i].config.codec.bits, (*r1)[i].config.codec.bits) << "sequence " << (*r0)[i].sequence;
  }
  EXPECT_EQ(r0->back().config_epoch, static_cast<uint64_t>(kCalls)) << "the newest change is in force";
  // The epoch a caller was told is the one whose bits are in force.
  const int newest = static_cast<int>(std::find(epochs.begin(), epochs.end(), kCalls) - epochs.begin());
  EXPECT_EQ(r0->back().config.codec.bits, 3.5 + 0.5 * newest);
  for (auto& d : *daemons) d->Shutdown();
}

}  // namespace
}  // namespace dynamiq::server

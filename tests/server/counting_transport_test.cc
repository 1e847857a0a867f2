#include "server/counting_transport.h"

#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "engine/allreduce.h"
#include "engine/memory_transport.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;

// Collects what a transport reports, per (peer, sent).
class Recorder : public PeerBytesSink {
 public:
  void AddPeerBytes(int peer, bool sent, uint64_t bytes) override {
    absl::MutexLock lock(&mu_);
    bytes_[{peer, sent}] += bytes;
  }
  uint64_t Get(int peer, bool sent) {
    absl::MutexLock lock(&mu_);
    return bytes_[{peer, sent}];
  }
  uint64_t Total(bool sent) {
    absl::MutexLock lock(&mu_);
    uint64_t total = 0;
    for (const auto& [key, bytes] : bytes_) total += key.second == sent ? bytes : 0;
    return total;
  }

 private:
  absl::Mutex mu_;
  std::map<std::pair<int, bool>, uint64_t> bytes_;
};

TEST(CountingTransportTest, CountsCompletedTransfersPerPeer) {
  auto inner = engine::MakeMemoryTransports(2);
  Recorder r0, r1;
  CountingTransport t0(std::move(inner[0]), &r0), t1(std::move(inner[1]), &r1);
  EXPECT_EQ(t0.rank(), 0);
  EXPECT_EQ(t0.size(), 2);
  EXPECT_EQ(t0.name(), "memory");
  std::vector<uint8_t> data(1000, 7), buffer(1000);
  auto send = t0.PostSend(1, 5, data);
  ASSERT_THAT(send, IsOk());
  auto recv = t1.PostRecv(0, 5, absl::MakeSpan(buffer));
  ASSERT_THAT(recv, IsOk());
  EXPECT_EQ(r0.Get(1, true), 0u) << "nothing counted before Wait";
  ASSERT_THAT(t1.Wait(*recv, absl::Now() + absl::Seconds(10)), IsOk());
  ASSERT_THAT(t0.Wait(*send, absl::Now() + absl::Seconds(10)), IsOk());
  EXPECT_EQ(r0.Get(1, true), 1000u);
  // Received bytes are what the receiver says the message was (receives may be posted larger).
  EXPECT_EQ(r1.Get(0, false), 0u);
  t1.MessageReceived(0, 1000);
  EXPECT_EQ(r1.Get(0, false), 1000u);
  EXPECT_EQ(r0.Get(1, false), 0u);
  EXPECT_EQ(buffer[999], 7);
}

TEST(CountingTransportTest, FailedSendsCountNothing) {
  auto inner = engine::MakeMemoryTransports(2);
  Recorder r1;
  CountingTransport t1(std::move(inner[1]), &r1);
  std::vector<uint8_t> data(64, 1);
  t1.Abort();
  auto send = t1.PostSend(0, 1, data);
  if (send.ok()) {
    EXPECT_FALSE(t1.Wait(*send, absl::Now() + absl::Seconds(10)).ok());
  }
  EXPECT_EQ(r1.Total(true), 0u);
}

// A whole all-reduce: what the decorator counts is exactly what the engine says it moved.
TEST(CountingTransportTest, MatchesTheEnginesByteCounts) {
  const int n = 3;
  const size_t d = 5000;
  auto inner = engine::MakeMemoryTransports(n);
  std::vector<Recorder> recorders(n);
  std::vector<std::unique_ptr<CountingTransport>> transports;
  for (int r = 0; r < n; ++r)
    transports.push_back(std::make_unique<CountingTransport>(std::move(inner[r]), &recorders[r]));
  kernels::CodecConfig config;
  config.id = kernels::CodecId::kDynamiq;
  config.bits = 5;
  auto codec = kernels::CreateCodec(config);
  ASSERT_THAT(codec, IsOk());
  std::vector<std::vector<float>> data(n, std::vector<float>(d));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < d; ++i) data[r][i] = static_cast<float>((i * (r + 3)) % 101) - 50;
  }
  std::vector<absl::StatusOr<engine::AllReduceResult>> results(n, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      engine::AllReduceOptions o;
      o.timeout = absl::Seconds(30);
      results[r] = engine::AllReduce(**codec, *transports[r], o, {data[r].data(), kernels::DType::kFloat32, 0, nullptr},
                                     {data[r].data(), kernels::DType::kFloat32, 0, nullptr}, d);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_THAT(results[r], IsOk());
    // Headers and payloads, exactly as the engine counts them (receives are posted with an upper
    // bound; what counts is the size the header announced).
    EXPECT_EQ(recorders[r].Total(true), results[r]->bytes_sent) << r;
    EXPECT_EQ(recorders[r].Total(false), results[r]->bytes_received) << r;
    EXPECT_EQ(recorders[r].Get(r, true), 0u) << "no bytes to itself";
  }
  // Every byte sent to a peer is received by it.
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a != b) {
        EXPECT_EQ(recorders[a].Get(b, true), recorders[b].Get(a, false)) << a << "->" << b;
      }
    }
  }
}

}  // namespace
}  // namespace dynamiq::server

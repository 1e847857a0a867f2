// NcclTransport tests. NcclTransportTest runs everywhere (no device needed: connecting must fail
// with a clear status, never crash). NcclTransportGpuTest needs CUDA devices and skips without
// them: ranks are threads of this process, rank r on device r, rendezvousing through an
// InMemoryStore (gloo's spawn pattern).
#include "engine/nccl_transport.h"

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

int VisibleDevices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

// A device index that cannot be used here: 0 without any device, else one past the last.
int UnusableDevice() {
  const int devices = VisibleDevices();
  return devices == 0 ? 0 : devices;
}

#define DQ_REQUIRE_DEVICES(n)                                                              \
  do {                                                                                     \
    const int dq_devices_ = VisibleDevices();                                              \
    if (dq_devices_ < (n)) {                                                               \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s), " << dq_devices_ << " visible"; \
    }                                                                                      \
  } while (0)

// ---- Without a device.

TEST(NcclTransportTest, ConnectWithoutUsableDeviceFailsCleanly) {
  InMemoryStore base;
  PrefixStore store("group0/epoch0", base);
  const bool no_device = VisibleDevices() == 0;
  absl::StatusOr<std::unique_ptr<Transport>> transport =
      ConnectNcclTransport(store, /*rank=*/0, /*size=*/2, UnusableDevice(), absl::Seconds(5));
  EXPECT_THAT(transport, StatusIs(absl::StatusCode::kFailedPrecondition,
                                  AllOf(HasSubstr("NCCL transport rank 0 of 2"),
                                        HasSubstr(no_device ? "no usable CUDA device" : "does not exist"))));
  // Rank 0 published its failure, so the other ranks fail at once instead of at their timeout.
  absl::StatusOr<std::string> value = base.Get(absl::StrCat("group0/epoch0/", kNcclUniqueIdKey), absl::Seconds(1));
  ASSERT_THAT(value, IsOk());
  EXPECT_THAT(*value, StartsWith("error:"));
}

TEST(NcclTransportTest, NonRootRankChecksItsDeviceBeforeWaitingForTheId) {
  InMemoryStore store;  // rank 0 never publishes
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Transport>> transport =
      ConnectNcclTransport(store, /*rank=*/1, /*size=*/2, UnusableDevice(), absl::Seconds(30));
  EXPECT_THAT(transport, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("NCCL transport rank 1 of 2")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(NcclTransportTest, RejectsInvalidRankOrSize) {
  InMemoryStore store;
  EXPECT_THAT(ConnectNcclTransport(store, /*rank=*/2, /*size=*/2, 0, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ConnectNcclTransport(store, /*rank=*/-1, /*size=*/2, 0, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ConnectNcclTransport(store, /*rank=*/0, /*size=*/0, 0, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---- With devices.

// cudaMalloc'ed bytes on one device.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes) : device_(device), bytes_(bytes) {
    EXPECT_EQ(cudaSetDevice(device_), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&ptr_, bytes_ == 0 ? 1 : bytes_), cudaSuccess);
  }
  ~DeviceBuffer() {
    (void)cudaSetDevice(device_);
    (void)cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  absl::Span<uint8_t> span() { return {static_cast<uint8_t*>(ptr_), bytes_}; }
  void Upload(const std::vector<uint8_t>& host) {
    ASSERT_EQ(host.size(), bytes_);
    if (bytes_ == 0) return;
    EXPECT_EQ(cudaSetDevice(device_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    // A pageable upload may still be in DMA when cudaMemcpy returns, and the transport's stream
    // does not wait for other streams.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::vector<uint8_t> Download() {
    std::vector<uint8_t> host(bytes_);
    if (bytes_ == 0) return host;
    EXPECT_EQ(cudaSetDevice(device_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  int device_;
  size_t bytes_;
  void* ptr_ = nullptr;
};

std::vector<uint8_t> Pattern(int rank, int round, size_t index, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(rank * 131 + round * 71 + index * 29 + i * 7);
  return out;
}

class NcclTransportGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (VisibleDevices() == 0) GTEST_SKIP() << "no CUDA device: the NCCL transport tests need GPUs";
  }

  // Runs fn(rank) on one thread per rank and joins them.
  static void OnRanks(int n, const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
    for (std::thread& t : threads) t.join();
  }

  // Connects `n` ranks concurrently, rank r on device r, under a fresh store prefix.
  std::vector<std::unique_ptr<Transport>> ConnectAll(int n, const std::string& prefix) {
    PrefixStore store(prefix, store_);
    std::vector<absl::StatusOr<std::unique_ptr<Transport>>> results(n);
    OnRanks(n, [&](int r) { results[r] = ConnectNcclTransport(store, r, n, /*device=*/r, absl::Seconds(120)); });
    std::vector<std::unique_ptr<Transport>> out;
    for (auto& result : results) {
      EXPECT_THAT(result, IsOk());
      if (result.ok()) out.push_back(std::move(*result));
    }
    return out;
  }

  // Destroys the transports concurrently: a clean finalize waits for every rank.
  static void DestroyAll(std::vector<std::unique_ptr<Transport>>& transports) {
    OnRanks(static_cast<int>(transports.size()), [&](int r) { transports[r].reset(); });
  }

  InMemoryStore store_;
};

TEST_F(NcclTransportGpuTest, ConnectsAndFinalizesOneRank) {
  auto transports = ConnectAll(1, "one/epoch0");
  ASSERT_EQ(transports.size(), 1u);
  Transport& t = *transports[0];
  EXPECT_EQ(t.name(), "nccl");
  EXPECT_EQ(t.rank(), 0);
  EXPECT_EQ(t.size(), 1);
  DeviceBuffer buffer(0, 16);
  EXPECT_THAT(t.PostSend(0, 0, buffer.span()), StatusIs(absl::StatusCode::kInvalidArgument));  // itself
  EXPECT_THAT(t.Wait(12345, absl::Now() + absl::Seconds(1)), StatusIs(absl::StatusCode::kInvalidArgument));
  const absl::Time start = absl::Now();
  transports.clear();
  EXPECT_LT(absl::Now() - start, kNcclFinalizeTimeout);
}

TEST_F(NcclTransportGpuTest, PeerSeesRootFailureAtOnce) {
  InMemoryStore base;
  PrefixStore store("rootfail/epoch0", base);
  EXPECT_THAT(ConnectNcclTransport(store, 0, 2, UnusableDevice(), absl::Seconds(5)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  const absl::Time start = absl::Now();
  EXPECT_THAT(ConnectNcclTransport(store, 1, 2, /*device=*/0, absl::Seconds(60)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 0 could not create the NCCL unique id")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_F(NcclTransportGpuTest, InitTimesOutWhenAPeerNeverJoins) {
  PrefixStore store("lonely/epoch0", store_);
  const absl::Time start = absl::Now();
  EXPECT_THAT(ConnectNcclTransport(store, 0, 2, /*device=*/0, absl::Seconds(3)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("init did not complete")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));  // the abort after the timeout is bounded too
}

TEST_F(NcclTransportGpuTest, ExchangesBuffersBetweenTwoRanks) {
  DQ_REQUIRE_DEVICES(2);
  auto transports = ConnectAll(2, "exchange/epoch0");
  ASSERT_EQ(transports.size(), 2u);
  OnRanks(2, [&](int rank) {
    Transport& t = *transports[rank];
    EXPECT_EQ(t.name(), "nccl");
    EXPECT_EQ(t.rank(), rank);
    EXPECT_EQ(t.size(), 2);
    const int peer = 1 - rank;
    // A fixed-size header, a payload of odd size, an empty message; two rounds, so two launches.
    const std::vector<size_t> sizes = {64, (size_t{1} << 20) + 3, 0};
    for (int round = 0; round < 2; ++round) {
      std::vector<std::unique_ptr<DeviceBuffer>> sends, recvs;
      for (size_t i = 0; i < sizes.size(); ++i) {
        sends.push_back(std::make_unique<DeviceBuffer>(rank, sizes[i]));
        sends.back()->Upload(Pattern(rank, round, i, sizes[i]));
        recvs.push_back(std::make_unique<DeviceBuffer>(rank, sizes[i]));
      }
      // The ranks interleave sends and receives differently: only the order of the sends to a
      // peer, and of the receives from it, has to agree.
      std::vector<Transport::Handle> handles;
      auto post_sends = [&] {
        for (size_t i = 0; i < sizes.size(); ++i) {
          absl::StatusOr<Transport::Handle> h = t.PostSend(peer, /*tag=*/i, sends[i]->span());
          ASSERT_THAT(h, IsOk());
          handles.push_back(*h);
        }
      };
      auto post_recvs = [&] {
        for (size_t i = 0; i < sizes.size(); ++i) {
          absl::StatusOr<Transport::Handle> h = t.PostRecv(peer, /*tag=*/i, recvs[i]->span());
          ASSERT_THAT(h, IsOk());
          handles.push_back(*h);
        }
      };
      if (rank == 0) {
        post_sends();
        post_recvs();
      } else {
        post_recvs();
        post_sends();
      }
      // Waiting on the last handle launches the whole group; the others are then already done.
      for (auto it = handles.rbegin(); it != handles.rend(); ++it) {
        EXPECT_THAT(t.Wait(*it, absl::Now() + absl::Seconds(60)), IsOk());
      }
      for (size_t i = 0; i < sizes.size(); ++i) {
        EXPECT_EQ(recvs[i]->Download(), Pattern(peer, round, i, sizes[i])) << "rank " << rank << " message " << i;
      }
      // A handle is forgotten once waited for.
      EXPECT_THAT(t.Wait(handles[0], absl::Now() + absl::Seconds(1)), StatusIs(absl::StatusCode::kInvalidArgument));
    }
    // Buffers NCCL cannot use are refused up front, without breaking the transport.
    std::vector<uint8_t> host(16);
    EXPECT_THAT(t.PostSend(peer, 0, host), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("host memory")));
    DeviceBuffer other_device(peer, 16);
    EXPECT_THAT(t.PostRecv(peer, 0, other_device.span()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(absl::StrCat("on device ", peer))));
    EXPECT_THAT(t.PostSend(rank, 0, other_device.span()), StatusIs(absl::StatusCode::kInvalidArgument));
  });
  DestroyAll(transports);
}

TEST_F(NcclTransportGpuTest, WaitOnUnmatchedReceiveTimesOut) {
  DQ_REQUIRE_DEVICES(2);
  auto transports = ConnectAll(2, "timeout/epoch0");
  ASSERT_EQ(transports.size(), 2u);
  DeviceBuffer buffer(0, 256);
  absl::StatusOr<Transport::Handle> h = transports[0]->PostRecv(1, /*tag=*/42, buffer.span());
  ASSERT_THAT(h, IsOk());
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      transports[0]->Wait(*h, absl::Now() + absl::Milliseconds(500)),
      StatusIs(absl::StatusCode::kDeadlineExceeded, AllOf(HasSubstr("rank 0 of 2"), HasSubstr("from rank 1"),
                                                          HasSubstr("tag 42"), HasSubstr("did not complete within"))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // After a failure the transport is unusable.
  EXPECT_THAT(transports[0]->PostSend(1, 0, buffer.span()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("unusable")));
  // The receive's kernel waits forever: the owner aborts every rank, then teardown is prompt.
  OnRanks(2, [&](int r) { transports[r]->Abort(); });
  DestroyAll(transports);
}

TEST_F(NcclTransportGpuTest, AbortUnblocksWait) {
  DQ_REQUIRE_DEVICES(2);
  auto transports = ConnectAll(2, "abort/epoch0");
  ASSERT_EQ(transports.size(), 2u);
  DeviceBuffer buffer(0, 256);
  absl::StatusOr<Transport::Handle> h = transports[0]->PostRecv(1, /*tag=*/7, buffer.span());
  ASSERT_THAT(h, IsOk());
  absl::Status status;
  std::thread waiter([&] { status = transports[0]->Wait(*h, absl::Now() + absl::Seconds(300)); });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time abort_start = absl::Now();
  transports[0]->Abort();
  transports[0]->Abort();  // idempotent
  waiter.join();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kAborted, AllOf(HasSubstr("from rank 1"), HasSubstr("tag 7"))));
  EXPECT_LT(absl::Now() - abort_start, absl::Seconds(60));
  EXPECT_THAT(transports[0]->PostSend(1, 0, buffer.span()), StatusIs(absl::StatusCode::kAborted));
  transports[1]->Abort();
  DestroyAll(transports);
}

}  // namespace
}  // namespace dynamiq::engine

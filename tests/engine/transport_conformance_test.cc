// The transport conformance suite: what engine/transport.h promises, checked on every registered
// transport that runs on a CPU (engine/transport_registry.h). A new transport joins the
// parameter list and passes every test here before any engine may use it. (nccl passes the same
// contract on GPUs: tests/engine/nccl_transport_test.cc.)
#include <stdint.h>

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "engine/host_transport.h"
#include "engine/memory_transport.h"
#include "engine/store.h"
#include "engine/tcp_mesh.h"
#include "engine/transport.h"
#include "engine/transport_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/transport_test_util.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::Deadline;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::Pattern;
using ::testing::AnyOf;
using ::testing::HasSubstr;

class TransportConformanceTest : public ::testing::TestWithParam<std::string> {
 protected:
  // Runs `size` ranks of the transport under test as threads, each running `fn`; expects all OK.
  void RunRanks(int size, const testing::TransportRankFn& fn) {
    InMemoryStore store;
    auto hub = std::make_shared<MemoryHub>(size);
    std::vector<absl::Status> results = testing::RunTransportRanks(
        size, store,
        [&](Store& s, int rank, int n) -> absl::StatusOr<std::unique_ptr<Transport>> {
          if (GetParam() == "memory") return std::unique_ptr<Transport>(new InMemoryTransport(hub, rank));
          if (GetParam() == "tcp_kept") return SecondViewOfAMesh(s, rank, n);
          return ConnectHostTransport(GetParam(), s, rank, n, "127.0.0.1", absl::Seconds(20));
        },
        fn);
    testing::ExpectAllOk(results);
  }

  // The kind the transport under test reports.
  std::string Kind() const { return GetParam() == "tcp_kept" ? "tcp" : GetParam(); }

  // "tcp_kept": the transport of a job's second group view over its connection mesh
  // (engine/tcp_mesh.h), on connections the first view made and gave up (so every message of it
  // travels behind a fence, after the first view's "gave up" frames).
  static absl::StatusOr<std::unique_ptr<Transport>> SecondViewOfAMesh(Store& store, int rank, int size) {
    TcpTransportOptions options;
    options.timeout = absl::Seconds(20);
    TcpMesh mesh(rank, size, options);
    std::vector<int> everyone;
    for (int r = 0; r < size; ++r) everyone.push_back(r);
    PrefixStore first("first/", store), second("second/", store);
    DQ_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, mesh.Connect(first, everyone, {0, 0}));
    t.reset();
    DQ_ASSIGN_OR_RETURN(t, mesh.Connect(second, everyone, {1, 4}));
    if (mesh.counts().kept != static_cast<uint64_t>(size - 1)) {
      return absl::InternalError(absl::StrCat("rank ", rank, " kept ", mesh.counts().kept, " connections"));
    }
    return t;
  }
};

TEST_P(TransportConformanceTest, StatesTheCapabilitiesItsRegistryRowPromises) {
  RunRanks(2, [this](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    const TransportCapabilities got = t->capabilities();
    absl::StatusOr<TransportKind> row = FindTransportKind(got.kind);
    EXPECT_THAT(row, IsOk());
    if (!row.ok()) return absl::OkStatus();
    EXPECT_EQ(got.kind, Kind());
    EXPECT_EQ(got.reliable, row->capabilities.reliable);
    EXPECT_EQ(got.ordered, row->capabilities.ordered);
    EXPECT_EQ(got.device_memory, row->capabilities.device_memory);
    EXPECT_EQ(got.scatter_gather, row->capabilities.scatter_gather);
    EXPECT_EQ(got.scatter_gather, t->SupportsParts());
    EXPECT_EQ(t->rank(), rank);
    EXPECT_EQ(t->size(), 2);
    return absl::OkStatus();
  });
}

TEST_P(TransportConformanceTest, EveryPairExchangesExactBytesOfEverySize) {
  const std::vector<size_t> sizes = {0, 1, 4096, size_t{3} << 20};
  RunRanks(3, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    for (size_t k = 0; k < sizes.size(); ++k) {
      const uint64_t tag = 10 + k;
      std::vector<std::vector<uint8_t>> out(3), in(3);
      std::vector<Transport::Handle> handles;
      for (int peer = 0; peer < 3; ++peer) {
        if (peer == rank) continue;
        out[peer] = Pattern(rank, tag + 100 * peer, sizes[k]);
        in[peer].assign(sizes[k], 0xEE);
        DQ_ASSIGN_OR_RETURN(Transport::Handle r, t->PostRecv(peer, tag, absl::MakeSpan(in[peer])));
        DQ_ASSIGN_OR_RETURN(Transport::Handle s, t->PostSend(peer, tag, out[peer]));
        handles.push_back(r);
        handles.push_back(s);
      }
      for (Transport::Handle h : handles) DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
      for (int peer = 0; peer < 3; ++peer) {
        if (peer != rank) EXPECT_EQ(in[peer], Pattern(peer, tag + 100 * rank, sizes[k])) << sizes[k] << " bytes";
      }
    }
    return absl::OkStatus();
  });
}

TEST_P(TransportConformanceTest, MessagesOfOneTagArriveInPostingOrder) {
  RunRanks(2, [](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    constexpr int kMessages = 5;
    constexpr uint64_t kTag = 7;
    std::vector<std::vector<uint8_t>> bufs(kMessages);
    std::vector<Transport::Handle> handles;
    for (int m = 0; m < kMessages; ++m) {
      if (rank == 0) {
        bufs[m] = Pattern(0, m, 1000 + m);
        DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, kTag, bufs[m]));
        handles.push_back(h);
      } else {
        bufs[m].assign(1000 + m, 0);
        DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, kTag, absl::MakeSpan(bufs[m])));
        handles.push_back(h);
      }
    }
    for (Transport::Handle h : handles) DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
    if (rank == 1) {
      for (int m = 0; m < kMessages; ++m) EXPECT_EQ(bufs[m], Pattern(0, m, 1000 + m)) << "message " << m;
    }
    return absl::OkStatus();
  });
}

TEST_P(TransportConformanceTest, ScatterGatherWhereDeclaredAndUnimplementedWhereNot) {
  RunRanks(2, [](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    const std::vector<uint8_t> whole = Pattern(0, 3, 3000);
    if (!t->capabilities().scatter_gather) {
      std::vector<uint8_t> a(10), b(10);
      const std::vector<absl::Span<const uint8_t>> parts = {a, b};
      EXPECT_THAT(t->PostSendParts(1 - rank, 3, parts), testing::StatusIs(absl::StatusCode::kUnimplemented));
      return absl::OkStatus();
    }
    if (rank == 0) {
      const absl::Span<const uint8_t> all(whole);
      const std::vector<absl::Span<const uint8_t>> parts = {all.subspan(0, 100), all.subspan(100, 0), all.subspan(100)};
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSendParts(1, 3, parts));
      return t->Wait(h, Deadline());
    }
    std::vector<uint8_t> head(1000, 0), tail(2000, 0);
    const std::vector<absl::Span<uint8_t>> parts = {absl::MakeSpan(head), absl::MakeSpan(tail)};
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecvParts(0, 3, parts));
    DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
    EXPECT_TRUE(std::equal(head.begin(), head.end(), whole.begin()));
    EXPECT_TRUE(std::equal(tail.begin(), tail.end(), whole.begin() + 1000));
    return absl::OkStatus();
  });
}

TEST_P(TransportConformanceTest, RejectsBadPeersAndHandles) {
  RunRanks(2,
           [](int rank, std::unique_ptr<Transport>& t) { return testing::ExpectBadPeersAndHandlesRejected(rank, *t); });
}

TEST_P(TransportConformanceTest, AWaitPastItsDeadlineFailsWithDeadlineExceeded) {
  absl::Notification done;  // rank 0 stays connected, silent, until rank 1 has timed out
  RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    if (rank == 0) {
      done.WaitForNotificationWithTimeout(absl::Seconds(20));
    } else {
      std::vector<uint8_t> buf(16);
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 99, absl::MakeSpan(buf)));
      const absl::Time start = absl::Now();
      EXPECT_THAT(t->Wait(h, absl::Now() + absl::Milliseconds(300)),
                  testing::StatusIs(absl::StatusCode::kDeadlineExceeded));
      EXPECT_LT(absl::Now() - start, absl::Seconds(5));
      t->Abort();  // the transport is unusable after a failure; the posted receive must not outlive it
      done.Notify();
    }
    return absl::OkStatus();
  });
}

TEST_P(TransportConformanceTest, AbortFromAnotherThreadFailsAPendingWaitPromptly) {
  // Rank 0 keeps its transport until rank 1 is done: a peer that left first fails rank 1's receive
  // on its own (Gloo refuses to post it at all), which is not what this test is about.
  absl::Notification done;
  RunRanks(2, [&done](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    if (rank != 1) {
      done.WaitForNotificationWithTimeout(absl::Seconds(30));
      return absl::OkStatus();
    }
    absl::Cleanup finished = [&done] { done.Notify(); };
    std::vector<uint8_t> buf(16);
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 42, absl::MakeSpan(buf)));
    std::thread watchdog([&] {
      absl::SleepFor(absl::Milliseconds(200));
      t->Abort();
    });
    const absl::Time start = absl::Now();
    const absl::Status waited = t->Wait(h, absl::Now() + absl::Seconds(30));
    watchdog.join();
    EXPECT_FALSE(waited.ok());
    EXPECT_THAT(waited.code(),
                AnyOf(absl::StatusCode::kAborted, absl::StatusCode::kUnavailable, absl::StatusCode::kCancelled));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << waited;
    // And every later operation fails too.
    absl::StatusOr<Transport::Handle> again = t->PostRecv(0, 43, absl::MakeSpan(buf));
    if (again.ok()) EXPECT_FALSE(t->Wait(*again, absl::Now() + absl::Seconds(5)).ok());
    return absl::OkStatus();
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportConformanceTest, ::testing::Values("memory", "tcp", "tcp_kept", "gloo"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// Every kind the daemon can select on a CPU node is in the suite above. Datagram kinds are neither
// reliable nor ordered and never made as an engine::Transport (their suite:
// tests/engine/udp_transport_test.cc).
TEST(TransportRegistryTest, EveryHostSelectableKindIsCoveredAndUnknownNamesAreNamed) {
  for (const TransportKind& k : TransportKinds()) {
    if (k.host_selectable) EXPECT_THAT(k.capabilities.kind, AnyOf("tcp", "gloo")) << "add it to the suite";
    if (k.datagram) {
      EXPECT_FALSE(k.host_selectable) << k.capabilities.kind;
      EXPECT_FALSE(k.capabilities.reliable) << k.capabilities.kind;
      EXPECT_FALSE(k.capabilities.ordered) << k.capabilities.kind;
    } else {
      EXPECT_TRUE(k.capabilities.reliable) << k.capabilities.kind << ": the engines need reliable transports";
    }
  }
  EXPECT_EQ(HostTransportNames(), "tcp or gloo");
  absl::StatusOr<TransportKind> udp = FindTransportKind("udp");
  ASSERT_THAT(udp, IsOk());
  EXPECT_TRUE(udp->datagram);
  EXPECT_THAT(FindTransportKind("quic"),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tcp, gloo, nccl, memory, udp")));
  InMemoryStore store;
  EXPECT_THAT(ConnectHostTransport("nccl", store, 0, 2, "127.0.0.1", absl::Seconds(1)),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--transport takes tcp or gloo")));
  EXPECT_THAT(ConnectHostTransport("udp", store, 0, 2, "127.0.0.1", absl::Seconds(1)),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("carries datagrams")));
}

}  // namespace
}  // namespace dynamiq::engine

#include "engine/gloo_transport.h"

#include <stdint.h>

#include <atomic>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/tcp_store.h"
#include "common/status_macros.h"
#include "engine/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/transport_test_util.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::Deadline;
using ::dynamiq::testing::ExpectAllOk;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::Pattern;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using RankFn = testing::TransportRankFn;

GlooTransportOptions TestOptions(absl::Duration timeout = absl::Seconds(10)) {
  GlooTransportOptions o;
  o.hostname = "127.0.0.1";
  o.timeout = timeout;
  return o;
}

// Runs `size` ranks as threads: each connects through `store` and runs `fn`. Returns each rank's
// status (the connect error, or what `fn` returned).
std::vector<absl::Status> RunRanks(int size, Store& store, const RankFn& fn,
                                   const GlooTransportOptions& options = TestOptions()) {
  return testing::RunTransportRanks(
      size, store, [&](Store& s, int rank, int n) { return ConnectGlooTransport(s, rank, n, options); }, fn);
}

std::vector<absl::Status> RunRanks(int size, const RankFn& fn, const GlooTransportOptions& options = TestOptions()) {
  InMemoryStore store;
  return RunRanks(size, store, fn, options);
}

TEST(GlooTransportTest, ConnectsAndNamesItself) {
  ExpectAllOk(RunRanks(2, [](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    EXPECT_EQ(t->name(), "gloo_tcp");
    EXPECT_EQ(t->rank(), rank);
    EXPECT_EQ(t->size(), 2);
    return absl::OkStatus();
  }));
}

TEST(GlooTransportTest, SingleRankGroupConnects) {
  ExpectAllOk(RunRanks(1, [](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    EXPECT_THAT(t->PostSend(0, 1, {}), StatusIs(absl::StatusCode::kInvalidArgument));
    return absl::OkStatus();
  }));
}

TEST(GlooTransportTest, RejectsBadArguments) {
  InMemoryStore store;
  EXPECT_THAT(ConnectGlooTransport(store, 2, 2, TestOptions()), StatusIs(absl::StatusCode::kInvalidArgument));
  GlooTransportOptions no_host = TestOptions();
  no_host.hostname = "";
  EXPECT_THAT(ConnectGlooTransport(store, 0, 1, no_host), StatusIs(absl::StatusCode::kInvalidArgument));
  ExpectAllOk(RunRanks(
      2, [](int rank, std::unique_ptr<Transport>& t) { return testing::ExpectBadPeersAndHandlesRejected(rank, *t); }));
}

// Every rank sends kMessages messages (distinct tags, varied sizes including 0) to its right
// neighbour and receives as many from its left one. Receives are posted first and waited in
// reverse order, so matching relies on tags alone.
class GlooRingTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooRingTest, RingExchangeWithDistinctTags) {
  const int size = GetParam();
  constexpr int kMessages = 40;
  auto bytes_for = [](int i) -> size_t { return i % 5 == 0 ? 0 : static_cast<size_t>(i * 997 % 70000); };
  ExpectAllOk(RunRanks(size, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    const int right = (rank + 1) % size, left = (rank + size - 1) % size;
    std::vector<std::vector<uint8_t>> out(kMessages), in(kMessages);
    std::vector<Transport::Handle> sends, recvs;
    for (int i = 0; i < kMessages; ++i) {
      const uint64_t tag = 1000 + static_cast<uint64_t>(i) * 3;
      in[i].resize(bytes_for(i));
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(left, tag, absl::MakeSpan(in[i])));
      recvs.push_back(h);
    }
    for (int i = 0; i < kMessages; ++i) {
      const uint64_t tag = 1000 + static_cast<uint64_t>(i) * 3;
      out[i] = Pattern(rank, tag, bytes_for(i));
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(right, tag, out[i]));
      sends.push_back(h);
    }
    const absl::Time deadline = Deadline();
    for (int i = kMessages - 1; i >= 0; --i) {
      DQ_RETURN_IF_ERROR(t->Wait(recvs[i], deadline));
      if (in[i] != Pattern(left, 1000 + static_cast<uint64_t>(i) * 3, bytes_for(i))) {
        return absl::DataLossError(absl::StrCat("rank ", rank, ": message ", i, " from ", left, " corrupted"));
      }
    }
    for (Transport::Handle h : sends) DQ_RETURN_IF_ERROR(t->Wait(h, deadline));
    return absl::OkStatus();
  }));
}

INSTANTIATE_TEST_SUITE_P(Sizes, GlooRingTest, ::testing::Values(2, 3, 4, 5),
                         [](const ::testing::TestParamInfo<int>& info) { return absl::StrCat(info.param, "ranks"); });

TEST(GlooTransportTest, SameTagMatchesInPostingOrderAndAllPairsTalk) {
  // Full mesh, several messages per pair on one tag: each pair's messages arrive in order.
  constexpr int kSize = 4, kPerPair = 6;
  ExpectAllOk(RunRanks(kSize, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    std::vector<std::vector<uint8_t>> out, in;
    std::vector<std::pair<int, int>> recv_meta;  // (peer, index)
    std::vector<Transport::Handle> sends, recvs;
    out.reserve(kSize * kPerPair);
    in.reserve(kSize * kPerPair);
    for (int peer = 0; peer < kSize; ++peer) {
      if (peer == rank) continue;
      for (int k = 0; k < kPerPair; ++k) {
        in.emplace_back(64 + k);
        DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(peer, 7, absl::MakeSpan(in.back())));
        recvs.push_back(h);
        recv_meta.emplace_back(peer, k);
        out.push_back(Pattern(rank * 100 + peer, static_cast<uint64_t>(k), 64 + k));
        DQ_ASSIGN_OR_RETURN(h, t->PostSend(peer, 7, out.back()));
        sends.push_back(h);
      }
    }
    const absl::Time deadline = Deadline();
    for (size_t i = 0; i < recvs.size(); ++i) {
      DQ_RETURN_IF_ERROR(t->Wait(recvs[i], deadline));
      const auto [peer, k] = recv_meta[i];
      if (in[i] != Pattern(peer * 100 + rank, static_cast<uint64_t>(k), 64 + k)) {
        return absl::DataLossError(absl::StrCat("rank ", rank, ": message ", k, " from ", peer, " out of order"));
      }
    }
    for (Transport::Handle h : sends) DQ_RETURN_IF_ERROR(t->Wait(h, deadline));
    return absl::OkStatus();
  }));
}

TEST(GlooTransportTest, LargeMessage64MiB) {
  constexpr size_t kBytes = size_t{64} << 20;
  ExpectAllOk(RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    const absl::Time deadline = Deadline(absl::Seconds(20));
    if (rank == 0) {
      std::vector<uint8_t> data(kBytes);
      for (size_t i = 0; i < kBytes; ++i) data[i] = static_cast<uint8_t>((i * 131) ^ (i >> 12));
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, 42, data));
      return t->Wait(h, deadline);
    }
    std::vector<uint8_t> data(kBytes, 0);
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 42, absl::MakeSpan(data)));
    DQ_RETURN_IF_ERROR(t->Wait(h, deadline));
    for (size_t i = 0; i < kBytes; ++i) {
      if (data[i] != static_cast<uint8_t>((i * 131) ^ (i >> 12))) {
        return absl::DataLossError(absl::StrCat("byte ", i, " differs"));
      }
    }
    return absl::OkStatus();
  }));
}

TEST(GlooTransportTest, ZeroByteMessages) {
  // Zero-byte messages (null spans) on their own tags and interleaved with data on a shared tag.
  ExpectAllOk(RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    const int peer = 1 - rank;
    const absl::Time deadline = Deadline();
    std::vector<Transport::Handle> handles;
    std::vector<uint8_t> payload = Pattern(rank, 5, 16), got(16);
    for (uint64_t tag = 0; tag < 10; ++tag) {
      DQ_ASSIGN_OR_RETURN(Transport::Handle s, t->PostSend(peer, tag, absl::Span<const uint8_t>()));
      DQ_ASSIGN_OR_RETURN(Transport::Handle r, t->PostRecv(peer, tag, absl::Span<uint8_t>()));
      handles.push_back(s);
      handles.push_back(r);
    }
    // Shared tag 99: empty, 16 bytes, empty, in this order on both sides.
    DQ_ASSIGN_OR_RETURN(Transport::Handle s1, t->PostSend(peer, 99, absl::Span<const uint8_t>()));
    DQ_ASSIGN_OR_RETURN(Transport::Handle s2, t->PostSend(peer, 99, payload));
    DQ_ASSIGN_OR_RETURN(Transport::Handle s3, t->PostSend(peer, 99, absl::Span<const uint8_t>()));
    DQ_ASSIGN_OR_RETURN(Transport::Handle r1, t->PostRecv(peer, 99, absl::Span<uint8_t>()));
    DQ_ASSIGN_OR_RETURN(Transport::Handle r2, t->PostRecv(peer, 99, absl::MakeSpan(got)));
    DQ_ASSIGN_OR_RETURN(Transport::Handle r3, t->PostRecv(peer, 99, absl::Span<uint8_t>()));
    for (Transport::Handle h : {r3, r2, r1, s1, s2, s3}) handles.push_back(h);
    for (Transport::Handle h : handles) DQ_RETURN_IF_ERROR(t->Wait(h, deadline));
    if (got != Pattern(peer, 5, 16)) return absl::DataLossError("payload between empty messages corrupted");
    return absl::OkStatus();
  }));
}

TEST(GlooTransportTest, RecvWithoutSendTimesOutNamingPeerAndTag) {
  absl::Notification done;
  std::vector<absl::Status> results = RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    if (rank == 0) {
      done.WaitForNotificationWithTimeout(absl::Seconds(10));  // Stays connected but never sends.
      return absl::OkStatus();
    }
    std::vector<uint8_t> buf(128);
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 77, absl::MakeSpan(buf)));
    const absl::Time start = absl::Now();
    absl::Status s = t->Wait(h, start + absl::Milliseconds(300));
    const absl::Duration took = absl::Now() - start;
    done.Notify();
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded,
                            AllOf(HasSubstr("peer 0"), HasSubstr("tag 77"), HasSubstr("300ms"))));
    EXPECT_GE(took, absl::Milliseconds(290));
    EXPECT_LT(took, absl::Seconds(3));
    // The transport is unusable afterwards; later operations fail at once.
    absl::StatusOr<Transport::Handle> again = t->PostRecv(0, 78, absl::MakeSpan(buf));
    EXPECT_THAT(again, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("already failed")));
    return absl::OkStatus();
  });
  ExpectAllOk(results);
}

TEST(GlooTransportTest, PeerThatDisappearsFailsTheOtherSideFast) {
  // Rank 0 exchanges a few messages, then destroys its transport in the middle of the exchange;
  // rank 1, blocked on the next message with a 20 s deadline, fails with UNAVAILABLE at once.
  std::vector<absl::Status> results = RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    std::vector<uint8_t> buf(1024);
    if (rank == 0) {
      for (uint64_t tag = 0; tag < 3; ++tag) {
        std::vector<uint8_t> data = Pattern(0, tag, buf.size());
        DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, tag, data));
        DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
      }
      absl::SleepFor(absl::Milliseconds(200));
      t.reset();  // Gone: the process died, from rank 1's point of view.
      return absl::OkStatus();
    }
    for (uint64_t tag = 0; tag < 3; ++tag) {
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, tag, absl::MakeSpan(buf)));
      DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
    }
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 3, absl::MakeSpan(buf)));
    const absl::Time start = absl::Now();
    absl::Status s = t->Wait(h, start + absl::Seconds(20));
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("peer 0")));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    return absl::OkStatus();
  });
  ExpectAllOk(results);
}

TEST(GlooTransportTest, AbortFromAnotherThreadUnblocksWaitAndFailsPeersFast) {
  absl::Notification rank1_posted;
  std::vector<absl::Status> results = RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    std::vector<uint8_t> buf(256);
    if (rank == 0) {
      // Blocked on a message rank 1 will never send; rank 1's Abort closes the connection, so
      // this fails well before its 20 s deadline.
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(1, 5, absl::MakeSpan(buf)));
      const absl::Time start = absl::Now();
      absl::Status s = t->Wait(h, start + absl::Seconds(20));
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("peer 1")));
      EXPECT_LT(absl::Now() - start, absl::Seconds(5));
      return absl::OkStatus();
    }
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 6, absl::MakeSpan(buf)));
    DQ_ASSIGN_OR_RETURN(Transport::Handle never_waited, t->PostRecv(0, 8, absl::MakeSpan(buf)));
    Transport* raw = t.get();
    std::thread watchdog([raw] {
      absl::SleepFor(absl::Milliseconds(200));
      raw->Abort();
    });
    const absl::Time start = absl::Now();
    absl::Status s = t->Wait(h, start + absl::Seconds(20));
    const absl::Duration took = absl::Now() - start;
    watchdog.join();
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted, HasSubstr("peer 0")));
    EXPECT_GE(took, absl::Milliseconds(150));
    EXPECT_LT(took, absl::Seconds(2));
    // Every later Post and Wait fails at once.
    EXPECT_THAT(t->Wait(never_waited, Deadline()), StatusIs(absl::StatusCode::kAborted));
    EXPECT_THAT(t->PostSend(0, 9, buf), StatusIs(absl::StatusCode::kAborted));
    return absl::OkStatus();
  });
  ExpectAllOk(results);
}

TEST(GlooTransportTest, AbortBeforeWaitFailsAtOnce) {
  std::atomic<int> posted{0};
  ExpectAllOk(RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    std::vector<uint8_t> buf(8);
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(1 - rank, 1, absl::MakeSpan(buf)));
    // Both ranks post before either aborts (a peer's abort closes the connection, and a later post
    // would fail at once instead).
    posted.fetch_add(1);
    const absl::Time until = absl::Now() + absl::Seconds(5);
    while (posted.load() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    t->Abort();
    t->Abort();  // Idempotent.
    const absl::Time start = absl::Now();
    // ABORTED, or UNAVAILABLE when the peer's own abort closed the connection first (the transport
    // keeps its first error).
    EXPECT_THAT(t->Wait(h, Deadline()),
                StatusIs(::testing::AnyOf(absl::StatusCode::kAborted, absl::StatusCode::kUnavailable)));
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
    return absl::OkStatus();
  }));
}

TEST(GlooTransportTest, UnwaitedOperationsAreCleanedUpOnDestruction) {
  // The engine may return early on an error with operations still posted. Every rank posts, then
  // all destroy their transports at about the same time (their peers' operations still pending).
  constexpr int kSize = 3;
  std::atomic<int> posted{0};
  ExpectAllOk(RunRanks(kSize, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    std::vector<uint8_t> in(4096), out = Pattern(rank, 0, 4096);
    absl::Status status;
    for (int peer = 0; peer < kSize && status.ok(); ++peer) {
      if (peer == rank) continue;
      status.Update(t->PostRecv(peer, 0, absl::MakeSpan(in)).status());
      status.Update(t->PostSend(peer, 1, out).status());
    }
    posted.fetch_add(1);
    const absl::Time deadline = Deadline(absl::Seconds(5));
    while (posted.load() < kSize && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    t.reset();
    return status;
  }));
}

// The two Gloo size-mismatch behaviours the engine's StepHeader (exact-size receives) exists for.
// The transport cannot detect them; these tests pin them down so a Gloo upgrade that changes them
// is noticed.
TEST(GlooTransportTest, ShortSendIntoLargerRecvCompletesSilently) {
  ExpectAllOk(RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    if (rank == 0) {
      std::vector<uint8_t> data(16, 0xab);
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, 3, data));
      return t->Wait(h, Deadline());
    }
    std::vector<uint8_t> buf(64, 0);
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 3, absl::MakeSpan(buf)));
    DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
    EXPECT_EQ(buf[15], 0xab);
    EXPECT_EQ(buf[16], 0);  // Only partly filled, and nothing says so.
    return absl::OkStatus();
  }));
}

TEST(GlooTransportDeathTest, OversizedSendTerminatesTheReceivingProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
          std::vector<uint8_t> buf(rank == 0 ? 64 : 16);
          DQ_ASSIGN_OR_RETURN(Transport::Handle h,
                              rank == 0 ? t->PostSend(1, 3, buf) : t->PostRecv(0, 3, absl::MakeSpan(buf)));
          return t->Wait(h, Deadline(absl::Seconds(5)));
        });
      },
      "preamble.length <= op.nbytes");
}

TEST(GlooTransportTest, ConnectTimesOutWhenAPeerNeverShowsUp) {
  InMemoryStore store;
  const absl::Time start = absl::Now();
  EXPECT_THAT(ConnectGlooTransport(store, 0, 2, TestOptions(absl::Milliseconds(500))),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("rendezvous")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// dynamiq-bench allreduce's set-up: separate ranks rendezvous through bench/tcp_store.h.
TEST(GlooTransportTest, RendezvousThroughTcpStore) {
  auto server = bench::TcpStoreServer::Start("127.0.0.1:0");
  ASSERT_THAT(server, IsOk());
  constexpr int kSize = 3;
  std::vector<absl::Status> results(kSize);
  std::vector<std::thread> threads;
  for (int r = 0; r < kSize; ++r) {
    threads.emplace_back([&, r] {
      results[r] = [&]() -> absl::Status {
        DQ_ASSIGN_OR_RETURN(auto client, bench::TcpStoreClient::Connect((*server)->address(), absl::Seconds(5)));
        PrefixStore store("job7/epoch0", *client);
        DQ_ASSIGN_OR_RETURN(auto t, ConnectGlooTransport(store, r, kSize, TestOptions()));
        std::vector<uint8_t> out = Pattern(r, 1, 1000), in(1000);
        DQ_ASSIGN_OR_RETURN(auto s, t->PostSend((r + 1) % kSize, 1, out));
        DQ_ASSIGN_OR_RETURN(auto h, t->PostRecv((r + kSize - 1) % kSize, 1, absl::MakeSpan(in)));
        DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
        DQ_RETURN_IF_ERROR(t->Wait(s, Deadline()));
        if (in != Pattern((r + kSize - 1) % kSize, 1, 1000)) return absl::DataLossError("corrupted");
        return absl::OkStatus();
      }();
    });
  }
  for (auto& t : threads) t.join();
  ExpectAllOk(results);
}

}  // namespace
}  // namespace dynamiq::engine

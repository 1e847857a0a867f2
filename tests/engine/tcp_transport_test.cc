#include "engine/tcp_transport.h"

#include <stdint.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/synthetic_gradients.h"
#include "common/safe_text.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "engine/allreduce.h"
#include "engine/memory_transport.h"
#include "engine/store.h"
#include "engine/tcp_hello.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "tests/testing/raw_tcp_peer.h"
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
using std::string_literals::operator""s;

TcpTransportOptions TestOptions() {
  TcpTransportOptions o;
  o.hostname = "127.0.0.1";
  o.timeout = absl::Seconds(10);
  return o;
}

// Runs `size` ranks as threads, each connecting through one in-memory store and running `fn`.
std::vector<absl::Status> RunRanks(int size, const RankFn& fn, const TcpTransportOptions& options = TestOptions()) {
  InMemoryStore store;
  return testing::RunTransportRanks(
      size, store, [&](Store& s, int rank, int n) { return ConnectTcpTransport(s, rank, n, options); }, fn);
}

TEST(TcpTransportTest, ConnectsAndNamesItself) {
  ExpectAllOk(RunRanks(3, [](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    EXPECT_EQ(t->name(), "tcp");
    EXPECT_EQ(t->rank(), rank);
    EXPECT_EQ(t->size(), 3);
    return absl::OkStatus();
  }));
}

TEST(TcpTransportTest, RejectsBadArguments) {
  InMemoryStore store;
  EXPECT_THAT(ConnectTcpTransport(store, 2, 2, TestOptions()), StatusIs(absl::StatusCode::kInvalidArgument));
  TcpTransportOptions no_host = TestOptions();
  no_host.hostname = "";
  EXPECT_THAT(ConnectTcpTransport(store, 0, 1, no_host), StatusIs(absl::StatusCode::kInvalidArgument));
  ExpectAllOk(RunRanks(
      2, [](int rank, std::unique_ptr<Transport>& t) { return testing::ExpectBadPeersAndHandlesRejected(rank, *t); }));
}

TEST(TcpTransportTest, MissingPeersTimeOut) {
  InMemoryStore store;
  TcpTransportOptions o = TestOptions();
  o.timeout = absl::Milliseconds(300);
  EXPECT_THAT(ConnectTcpTransport(store, 0, 2, o), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("rank")));
}

// Every rank sends to every other rank messages of distinct tags and varied sizes (0 to 1 MiB).
// Half the receives are posted before the messages can arrive, half after the senders are done
// (the messages wait as early bytes); they are waited in reverse order.
TEST(TcpTransportTest, AllPairsExchangeWithReceivesPostedBeforeAndAfter) {
  constexpr int kSize = 3;
  const std::vector<size_t> sizes = {0, 1, 1000, 65536, 1 << 20};
  ExpectAllOk(RunRanks(kSize, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    std::vector<std::vector<uint8_t>> sent, received;
    std::vector<Transport::Handle> sends, recvs;
    auto post_recvs = [&](bool first_half) -> absl::Status {
      for (int q = 0; q < kSize; ++q) {
        for (size_t i = 0; i < sizes.size(); ++i) {
          if (q == rank || (i % 2 == 0) != first_half) continue;
          received.emplace_back(sizes[i]);
          DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(q, 100 + i, absl::MakeSpan(received.back())));
          recvs.push_back(h);
        }
      }
      return absl::OkStatus();
    };
    received.reserve(64);
    DQ_RETURN_IF_ERROR(post_recvs(true));
    sent.reserve(64);
    for (int q = 0; q < kSize; ++q) {
      if (q == rank) continue;
      for (size_t i = 0; i < sizes.size(); ++i) {
        sent.push_back(Pattern(rank, 100 + i, sizes[i]));
        DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(q, 100 + i, sent.back()));
        sends.push_back(h);
      }
    }
    for (Transport::Handle h : sends) DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
    absl::SleepFor(absl::Milliseconds(50));  // the other half now arrives before its receive
    DQ_RETURN_IF_ERROR(post_recvs(false));
    for (auto it = recvs.rbegin(); it != recvs.rend(); ++it) DQ_RETURN_IF_ERROR(t->Wait(*it, Deadline()));
    size_t k = 0;
    for (bool first_half : {true, false}) {
      for (int q = 0; q < kSize; ++q) {
        for (size_t i = 0; i < sizes.size(); ++i) {
          if (q == rank || (i % 2 == 0) != first_half) continue;
          EXPECT_EQ(received[k++], Pattern(q, 100 + i, sizes[i])) << "rank " << rank << " from " << q << " tag " << i;
        }
      }
    }
    return absl::OkStatus();
  }));
}

TEST(TcpTransportTest, SameTagMatchesInPostingOrderAndShortMessagesFitLargerReceives) {
  ExpectAllOk(RunRanks(2, [](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    if (rank == 0) {
      std::vector<std::vector<uint8_t>> m = {Pattern(0, 1, 10), Pattern(0, 2, 20), Pattern(0, 3, 30)};
      std::vector<Transport::Handle> hs;
      for (auto& v : m) {
        DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, 7, v));
        hs.push_back(h);
      }
      for (auto h : hs) DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
    } else {
      absl::SleepFor(absl::Milliseconds(30));  // the first ones arrive early
      std::vector<std::vector<uint8_t>> got(3, std::vector<uint8_t>(64, 0xee));
      std::vector<Transport::Handle> hs;
      for (auto& v : got) {
        DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 7, absl::MakeSpan(v)));
        hs.push_back(h);
      }
      for (auto h : hs) DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
      for (int i = 0; i < 3; ++i) {
        const std::vector<uint8_t> want = Pattern(0, i + 1, 10 * (i + 1));
        EXPECT_TRUE(std::equal(want.begin(), want.end(), got[i].begin())) << i;
        EXPECT_EQ(got[i][want.size()], 0xee) << i;  // nothing past the message
      }
    }
    return absl::OkStatus();
  }));
}

// Scatter/gather: a message sent from several buffers arrives as their bytes in order, and a
// receive in several buffers fills them in order, whether it was posted before or after the message
// arrived; a shorter message leaves the rest of the parts as they were.
TEST(TcpTransportTest, PartsGatherOnSendAndScatterOnReceive) {
  ExpectAllOk(RunRanks(2, [](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    EXPECT_TRUE(t->SupportsParts());
    const std::vector<uint8_t> a = Pattern(0, 1, 3), b = Pattern(0, 2, 1000), c = Pattern(0, 3, 5000);
    std::vector<uint8_t> whole = a;
    whole.insert(whole.end(), b.begin(), b.end());
    if (rank == 0) {
      const absl::Span<const uint8_t> parts[] = {a, {}, b};
      std::vector<Transport::Handle> hs;
      for (uint64_t tag : {1, 2}) {  // tag 2's receive is posted late: it arrives early
        DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSendParts(1, tag, parts));
        hs.push_back(h);
      }
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, 3, c));
      hs.push_back(h);
      for (auto h : hs) DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
    } else {
      std::vector<uint8_t> first(whole.size(), 0xee), head(2, 0xee), body(1500, 0xee), big(10, 0xee), rest(6000, 0xee);
      DQ_ASSIGN_OR_RETURN(Transport::Handle h1, t->PostRecv(0, 1, absl::MakeSpan(first)));
      DQ_RETURN_IF_ERROR(t->Wait(h1, Deadline()));
      absl::SleepFor(absl::Milliseconds(30));
      const absl::Span<uint8_t> parts[] = {absl::MakeSpan(head), absl::MakeSpan(body)};
      DQ_ASSIGN_OR_RETURN(Transport::Handle h2, t->PostRecvParts(0, 2, parts));
      const absl::Span<uint8_t> parts3[] = {absl::MakeSpan(big), absl::MakeSpan(rest)};
      DQ_ASSIGN_OR_RETURN(Transport::Handle h3, t->PostRecvParts(0, 3, parts3));
      DQ_RETURN_IF_ERROR(t->Wait(h2, Deadline()));
      DQ_RETURN_IF_ERROR(t->Wait(h3, Deadline()));
      EXPECT_EQ(first, whole);
      EXPECT_TRUE(std::equal(head.begin(), head.end(), whole.begin()));
      EXPECT_TRUE(std::equal(whole.begin() + 2, whole.end(), body.begin()));
      EXPECT_EQ(body[whole.size() - 2], 0xee);  // nothing past the message
      EXPECT_TRUE(std::equal(big.begin(), big.end(), c.begin()));
      EXPECT_TRUE(std::equal(c.begin() + 10, c.end(), rest.begin()));
      EXPECT_EQ(rest[c.size() - 10], 0xee);
    }
    return absl::OkStatus();
  }));
}

// With room for one early message only, the peer's connection waits until the receive of the
// message in its way is posted; every message still arrives.
TEST(TcpTransportTest, EarlyBytesAreBoundedAndThePeerWaits) {
  TcpTransportOptions o = TestOptions();
  o.max_early_bytes = 1000;
  ExpectAllOk(RunRanks(
      2,
      [](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
        if (rank == 0) {
          std::vector<std::vector<uint8_t>> m = {Pattern(0, 1, 800), Pattern(0, 2, 800), Pattern(0, 3, 800)};
          std::vector<Transport::Handle> hs;
          for (int i = 0; i < 3; ++i) {
            DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, i + 1, m[i]));
            hs.push_back(h);
          }
          for (auto h : hs) DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
        } else {
          absl::SleepFor(absl::Milliseconds(50));
          std::vector<std::vector<uint8_t>> got(3, std::vector<uint8_t>(800));
          std::vector<Transport::Handle> hs(3);
          for (int i : {1, 0, 2}) {  // tag 2 first: tag 1 sits early, tag 2 waits in the stream
            DQ_ASSIGN_OR_RETURN(hs[i], t->PostRecv(0, i + 1, absl::MakeSpan(got[i])));
          }
          for (auto h : hs) DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
          for (int i = 0; i < 3; ++i) EXPECT_EQ(got[i], Pattern(0, i + 1, 800)) << i;
        }
        return absl::OkStatus();
      },
      o));
}

// Messages kept before their receive are charged their bookkeeping too, and counted per peer: a
// flood of empty messages under tags nobody receives stops at the bound (the message behind it
// waits) instead of growing the process; receiving them lets the rest through.
TEST(TcpTransportTest, EarlyMessagesAreChargedTheirCostAndCountedPerPeer) {
  struct Case {
    const char* name;
    size_t max_bytes, max_messages, flood_bytes;
  };
  for (const Case& c :
       {Case{"bytes: empty messages cost too", 16 << 10, 4096, 0}, Case{"count per peer", 64 << 20, 8, 1}}) {
    SCOPED_TRACE(c.name);
    constexpr int kFlood = 40;
    TcpTransportOptions o = TestOptions();
    o.max_early_bytes = c.max_bytes;
    o.max_early_messages = c.max_messages;
    absl::Notification flooded;
    ExpectAllOk(RunRanks(
        2,
        [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
          std::vector<uint8_t> flood(c.flood_bytes, 1);
          const std::vector<uint8_t> last = Pattern(0, 7, 8);
          if (rank == 0) {
            std::vector<Transport::Handle> hs;
            for (int i = 0; i < kFlood; ++i) {
              DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, 1000 + i, flood));
              hs.push_back(h);
            }
            DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, 7, last));
            hs.push_back(h);
            flooded.Notify();
            for (auto h : hs) DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
            return absl::OkStatus();
          }
          flooded.WaitForNotification();
          absl::SleepFor(absl::Milliseconds(200));  // the flood has arrived as far as it may
          std::vector<uint8_t> got(8);
          DQ_ASSIGN_OR_RETURN(Transport::Handle h7, t->PostRecv(0, 7, absl::MakeSpan(got)));
          EXPECT_THAT(t->Wait(h7, Deadline(absl::Milliseconds(300))), StatusIs(absl::StatusCode::kDeadlineExceeded));
          std::vector<std::vector<uint8_t>> sink(kFlood, std::vector<uint8_t>(1));
          for (int i = 0; i < kFlood; ++i) {
            DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 1000 + i, absl::MakeSpan(sink[i])));
            DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
          }
          // The receive that timed out is still posted: the message now reaches it.
          DQ_RETURN_IF_ERROR(t->Wait(h7, Deadline()));
          EXPECT_EQ(got, last);
          return absl::OkStatus();
        },
        o));
  }
}

TEST(TcpTransportTest, AMessageLongerThanItsReceiveFailsTheTransport) {
  auto results = RunRanks(2, [](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    std::vector<uint8_t> big(100, 1), small(10);
    if (rank == 0) {
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(1, 5, big));
      return t->Wait(h, Deadline());
    }
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 5, absl::MakeSpan(small)));
    return t->Wait(h, Deadline());
  });
  EXPECT_THAT(results[1], StatusIs(absl::StatusCode::kInvalidArgument,
                                   AllOf(HasSubstr("100 bytes"), HasSubstr("receive of 10 bytes"))));
}

TEST(TcpTransportTest, WaitPastItsDeadlineNamesThePeerAndTag) {
  absl::Notification done;  // rank 0 stays connected until then
  ExpectAllOk(RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    if (rank == 0) {
      done.WaitForNotification();
      return absl::OkStatus();
    }
    std::vector<uint8_t> buf(8);
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 99, absl::MakeSpan(buf)));
    EXPECT_THAT(t->Wait(h, Deadline(absl::Milliseconds(100))),
                StatusIs(absl::StatusCode::kDeadlineExceeded, AllOf(HasSubstr("rank 0"), HasSubstr("tag 99"))));
    t->Abort();
    done.Notify();
    return absl::OkStatus();
  }));
}

TEST(TcpTransportTest, AbortFailsAPendingWaitPromptly) {
  absl::Notification done;  // rank 1 stays connected until then
  ExpectAllOk(RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    if (rank == 1) {
      done.WaitForNotification();
    } else {
      std::vector<uint8_t> buf(8);
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(1, 3, absl::MakeSpan(buf)));
      std::thread aborter([&] {
        absl::SleepFor(absl::Milliseconds(50));
        t->Abort();
      });
      const absl::Time start = absl::Now();
      EXPECT_THAT(t->Wait(h, Deadline()), StatusIs(absl::StatusCode::kAborted));
      EXPECT_LT(absl::Now() - start, absl::Seconds(5));
      aborter.join();
      EXPECT_THAT(t->PostSend(1, 4, buf), StatusIs(absl::StatusCode::kAborted));
      done.Notify();
    }
    return absl::OkStatus();
  }));
}

// A rank that gives up (Abort) still delivers what was posted to its peers (a step header that
// tells them why the collective failed) and says why it gave up: here, the peer it lost first.
TEST(TcpTransportTest, AbortDeliversWhatWasPostedAndTellsThePeersWhy) {
  absl::Notification rank2_gone, rank0_aborted;
  auto results = RunRanks(3, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    if (rank == 2) {
      t.reset();
      rank2_gone.Notify();
      return absl::OkStatus();
    }
    if (rank == 0) {
      std::vector<uint8_t> buf(8);
      DQ_ASSIGN_OR_RETURN(Transport::Handle from2, t->PostRecv(2, 3, absl::MakeSpan(buf)));
      rank2_gone.WaitForNotification();
      EXPECT_THAT(t->Wait(from2, Deadline()), StatusIs(absl::StatusCode::kUnavailable));
      const std::vector<uint8_t> last = Pattern(0, 5, 64);
      EXPECT_THAT(t->PostSend(1, 5, last), IsOk());
      t->Abort();
      rank0_aborted.Notify();
      return absl::OkStatus();
    }
    rank0_aborted.WaitForNotification();
    std::vector<uint8_t> got(64), more(8);
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(0, 5, absl::MakeSpan(got)));
    DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
    EXPECT_EQ(got, Pattern(0, 5, 64));
    DQ_ASSIGN_OR_RETURN(Transport::Handle next, t->PostRecv(0, 6, absl::MakeSpan(more)));
    return t->Wait(next, Deadline());
  });
  EXPECT_THAT(results[0], IsOk());
  EXPECT_THAT(results[1], StatusIs(absl::StatusCode::kUnavailable,
                                   AllOf(HasSubstr("rank 0 gave up"), HasSubstr("connection to rank 2 lost"))));
}

TEST(TcpTransportTest, APeerThatGoesAwayFailsWithUnavailable) {
  absl::Notification gone;
  auto results = RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    if (rank == 1) {
      t.reset();
      gone.Notify();
      return absl::OkStatus();
    }
    std::vector<uint8_t> buf(8);
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(1, 3, absl::MakeSpan(buf)));
    gone.WaitForNotification();
    return t->Wait(h, Deadline());
  });
  EXPECT_THAT(results[0], StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 1")));
}

// A peer that sent a message and then gave up: a send posted to it afterwards fails only at its
// Wait, and the message it sent first is still delivered, so whoever waits for that message
// first meets the peer's own first error (a bad header, say) rather than "connection lost".
TEST(TcpTransportTest, ASendToALostPeerFailsAtItsWaitAfterWhatThePeerSentIsDelivered) {
  absl::Notification gone;
  ExpectAllOk(RunRanks(2, [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
    const std::vector<uint8_t> header = Pattern(1, 5, 64);
    if (rank == 1) {
      DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostSend(0, 5, header));
      DQ_RETURN_IF_ERROR(t->Wait(h, Deadline()));
      t->Abort();
      gone.Notify();
      return absl::OkStatus();
    }
    gone.WaitForNotification();
    std::vector<uint8_t> probe(8);
    DQ_ASSIGN_OR_RETURN(Transport::Handle lost, t->PostRecv(1, 9, absl::MakeSpan(probe)));
    EXPECT_THAT(t->Wait(lost, Deadline()), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 1 gave up")));
    const std::vector<uint8_t> mine = Pattern(0, 5, 64);
    absl::StatusOr<Transport::Handle> send = t->PostSend(1, 5, mine);
    EXPECT_THAT(send, IsOk());
    std::vector<uint8_t> got(64);
    DQ_ASSIGN_OR_RETURN(Transport::Handle recv, t->PostRecv(1, 5, absl::MakeSpan(got)));
    EXPECT_THAT(t->Wait(recv, Deadline()), IsOk());
    EXPECT_EQ(got, header);
    if (send.ok()) EXPECT_THAT(t->Wait(*send, Deadline()), StatusIs(absl::StatusCode::kUnavailable));
    return absl::OkStatus();
  }));
}

// What a peer says when it gives up reaches this rank's errors (and from there logs, workers and
// the flight recorder) only as safe text: no line breaks, escape codes, NUL or invalid UTF-8.
TEST(TcpTransportTest, APeersGaveUpReasonIsMadeSafeText) {
  InMemoryStore store;
  absl::StatusOr<std::unique_ptr<Transport>> rank0;
  std::thread t0([&] { rank0 = ConnectTcpTransport(store, 0, 2, TestOptions()); });
  const int fd = testing::ConnectToRank(store, 0);  // without a key anyone may claim rank 1
  ASSERT_TRUE(testing::SendRaw(fd, testing::Cat(testing::kPlainHelloMagic, testing::LittleEndian(1, 4))));
  t0.join();
  ASSERT_THAT(rank0, IsOk());
  std::vector<uint8_t> buf(8);
  absl::StatusOr<Transport::Handle> h = (*rank0)->PostRecv(1, 3, absl::MakeSpan(buf));
  ASSERT_THAT(h, IsOk());
  const std::string reason = "ok\r\n2026-11-27 E dynamiqd: forged line\x1b[2J\0\xff\xc3"s;
  ASSERT_TRUE(testing::SendRaw(fd, testing::Frame(~uint64_t{0}, reason)));
  const absl::Status s = (*rank0)->Wait(*h, Deadline());
  common::CloseFd(fd);
  EXPECT_THAT(
      s, StatusIs(absl::StatusCode::kUnavailable,
                  HasSubstr("rank 1 gave up: ok\\x0d\\x0a2026-11-27 E dynamiqd: forged line\\x1b[2J\\x00\\xff\\xc3")));
  EXPECT_TRUE(common::IsValidUtf8(s.message()));
  EXPECT_EQ(std::string(s.message()).find_first_of(std::string("\r\n\x1b\0", 4)), std::string::npos);
}

// With a key, a "gave up" frame must carry its sender's MAC under the connection's session key:
// an honest peer's reason arrives; one without the MAC is refused and its text not shown.
TEST(TcpTransportTest, WithAKeyOnlyTheSendersGaveUpFrameIsBelieved) {
  TcpTransportOptions keyed = TestOptions();
  keyed.key.emplace();
  keyed.key->fill(9);
  auto honest = RunRanks(
      2,
      [&](int rank, std::unique_ptr<Transport>& t) -> absl::Status {
        if (rank == 1) {
          t->Abort();
          return absl::OkStatus();
        }
        std::vector<uint8_t> buf(8);
        DQ_ASSIGN_OR_RETURN(Transport::Handle h, t->PostRecv(1, 3, absl::MakeSpan(buf)));
        return t->Wait(h, Deadline());
      },
      keyed);
  EXPECT_THAT(honest[0], StatusIs(absl::StatusCode::kUnavailable,
                                  HasSubstr("rank 1 gave up: tcp transport rank 1: transport aborted")));

  // A peer that holds the key (it completed the hello) but sends a frame without the MAC.
  InMemoryStore store;
  absl::StatusOr<std::unique_ptr<Transport>> rank0;
  std::thread t0([&] { rank0 = ConnectTcpTransport(store, 0, 2, keyed); });
  absl::StatusOr<std::string> address = store.Get("tcp/0", absl::Seconds(10));
  ASSERT_THAT(address, IsOk());
  auto host_port = common::SplitHostPort(*address);
  ASSERT_THAT(host_port, IsOk());
  absl::StatusOr<TcpLink> link = DialPeer(host_port->first, host_port->second, 1, 0, keyed.key, Deadline());
  t0.join();
  ASSERT_THAT(link, IsOk());
  ASSERT_THAT(rank0, IsOk());
  std::vector<uint8_t> buf(8);
  absl::StatusOr<Transport::Handle> h = (*rank0)->PostRecv(1, 3, absl::MakeSpan(buf));
  ASSERT_THAT(h, IsOk());
  ASSERT_TRUE(
      testing::SendRaw(link->fd, testing::Frame(~uint64_t{0}, std::string("forged reason") + std::string(32, 'm'))));
  const absl::Status s = (*rank0)->Wait(*h, Deadline());
  common::CloseFd(link->fd);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("without its sender's MAC")));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("forged")));
}

// The engine over this transport gives the in-memory transport's bytes, ring and butterfly.
TEST(TcpTransportTest, AllReduceMatchesTheMemoryTransportBitForBit) {
  constexpr int kSize = 4;
  constexpr size_t kElements = 300000;
  bench::SyntheticOptions data;
  data.workers = kSize;
  data.elements = kElements;
  const std::vector<std::vector<float>> inputs = bench::SyntheticGradients(data);
  for (kernels::CodecId id : {kernels::CodecId::kDynamiq, kernels::CodecId::kNone}) {
    for (Topology topology : {Topology::kRing, Topology::kButterfly}) {
      kernels::CodecConfig config;
      config.id = id;
      config.bits = 5;
      auto codec = kernels::CreateCodec(config);
      ASSERT_THAT(codec, IsOk());
      AllReduceOptions o;
      o.topology = topology;
      o.job_id = 7;
      o.sequence = 1;
      o.block_elements = 65536;
      o.timeout = absl::Seconds(20);
      auto run = [&](std::vector<std::unique_ptr<Transport>>& transports) {
        std::vector<std::vector<float>> out(kSize, std::vector<float>(kElements, NAN));
        std::vector<std::thread> threads;
        for (int r = 0; r < kSize; ++r) {
          threads.emplace_back([&, r] {
            EXPECT_THAT(AllReduce(**codec, *transports[r], o, {inputs[r].data(), kernels::DType::kFloat32, 0, nullptr},
                                  {out[r].data(), kernels::DType::kFloat32, 0, nullptr}, kElements),
                        IsOk());
          });
        }
        for (auto& t : threads) t.join();
        return out;
      };
      auto memory = MakeMemoryTransports(kSize);
      const auto expected = run(memory);
      InMemoryStore store;
      std::vector<std::unique_ptr<Transport>> tcp(kSize);
      std::vector<std::thread> connect;
      for (int r = 0; r < kSize; ++r) {
        connect.emplace_back([&, r] {
          auto t = ConnectTcpTransport(store, r, kSize, TestOptions());
          ASSERT_THAT(t, IsOk());
          tcp[r] = std::move(t).value();
        });
      }
      for (auto& t : connect) t.join();
      for (auto& t : tcp) ASSERT_NE(t, nullptr);
      const auto got = run(tcp);
      for (int r = 0; r < kSize; ++r) {
        EXPECT_EQ(std::memcmp(got[r].data(), expected[r].data(), kElements * sizeof(float)), 0)
            << kernels::CodecName(id) << " " << TopologyName(topology) << " rank " << r;
      }
    }
  }
}

}  // namespace
}  // namespace dynamiq::engine

// The datagram conformance suite (engine/datagram_transport.h: one TEST_P every datagram transport
// passes), run on the UDP transport over IPv4 and IPv6 loopback, with and without a key; then what
// is UDP's own: raw datagrams injected at a rank's port from a plain socket (garbage, truncated,
// wrong MAC, another connection's, replayed, stray), each dropped and counted under its reason;
// the rendezvous' errors; and a loopback throughput measurement that prints (not a timed assertion).
#include "engine/udp_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "engine/datagram_transport.h"
#include "engine/step_auth.h"
#include "engine/store.h"
#include "engine/transport_registry.h"
#include "engine/udp_datagram.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/transport_test_util.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::Pattern;
using ::dynamiq::testing::StatusIs;
using ::testing::AnyOf;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

common::HmacSha256::Digest JobKey(const char* job = "job") { return StepAuthenticator::KeyForJob("secret", job); }

// Whether this machine has IPv6 loopback (containers may not).
bool HaveIpv6Loopback() {
  const int fd = socket(AF_INET6, SOCK_DGRAM, 0);
  if (fd < 0) return false;
  sockaddr_in6 a = {};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// ---------------------------------------------------------------------------------------------
// The datagram conformance suite. A new datagram transport adds its cases to Connect and the
// instantiation below and passes every test.

struct DatagramCase {
  std::string name;
  std::string kind;  // the registry's
  std::string hostname;
  bool keyed = false;
};

// Names the case in test listings (ctest would print its bytes).
void PrintTo(const DatagramCase& c, std::ostream* os) { *os << c.name; }

using DatagramRankFn = std::function<absl::Status(int rank, DatagramTransport& transport)>;

class DatagramConformanceTest : public ::testing::TestWithParam<DatagramCase> {
 protected:
  void SetUp() override {
    if (GetParam().hostname == "::1" && !HaveIpv6Loopback()) GTEST_SKIP() << "no IPv6 loopback here";
  }

  absl::StatusOr<std::unique_ptr<DatagramTransport>> Connect(Store& store, int rank, int size) {
    const DatagramCase& c = GetParam();
    if (c.kind == "udp") {
      UdpTransportOptions o;
      o.hostname = c.hostname;
      o.timeout = absl::Seconds(20);
      if (c.keyed) o.key = JobKey();
      DQ_ASSIGN_OR_RETURN(std::unique_ptr<UdpTransport> t, ConnectUdpTransport(store, rank, size, o));
      return std::unique_ptr<DatagramTransport>(std::move(t));
    }
    return absl::UnimplementedError(absl::StrCat("no datagram transport ", c.kind, " in the suite"));
  }

  // Runs `size` ranks as threads, each connecting through one store and running `fn`; expects all OK.
  void RunRanks(int size, const DatagramRankFn& fn) {
    InMemoryStore store;
    std::vector<absl::Status> results(size);
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<DatagramTransport>> t = Connect(store, r, size);
        results[r] = t.ok() ? fn(r, **t) : t.status();
      });
    }
    for (auto& t : threads) t.join();
    testing::ExpectAllOk(results);
  }
};

TEST_P(DatagramConformanceTest, StatesItsRegistryRowAndAPayloadLimit) {
  RunRanks(2, [](int rank, DatagramTransport& t) -> absl::Status {
    const DatagramCapabilities c = t.capabilities();
    absl::StatusOr<TransportKind> row = FindTransportKind(c.transport.kind);
    EXPECT_THAT(row, IsOk());
    if (!row.ok()) return absl::OkStatus();
    EXPECT_EQ(c.transport.kind, GetParam().kind);
    EXPECT_TRUE(row->datagram);
    EXPECT_FALSE(c.transport.reliable);
    EXPECT_FALSE(c.transport.ordered);
    EXPECT_EQ(c.transport.device_memory, row->capabilities.device_memory);
    EXPECT_GT(c.max_payload, 0u);
    EXPECT_EQ(t.rank(), rank);
    EXPECT_EQ(t.size(), 2);
    return absl::OkStatus();
  });
}

// Every payload size from 0 to the maximum, between every ordered pair of 2, 3 and 4 ranks: each
// arrives intact, with its source and tag. The suite checks what arrives, not how much is lost: a
// sender sends a window of sizes, waits until its peer has them, and sends again what did not arrive.
TEST_P(DatagramConformanceTest, EveryPairDeliversEveryPayloadSizeUpToTheMaxIntact) {
  constexpr size_t kSizes = 1500;  // room for every payload size of the transports here
  constexpr size_t kWindow = 32;
  for (int n = 2; n <= 4; ++n) {
    // arrived[(destination * n + source) * kSizes + size]
    std::vector<std::atomic<bool>> arrived(n * n * kSizes);
    RunRanks(n, [&](int rank, DatagramTransport& t) -> absl::Status {
      const size_t max = t.capabilities().max_payload;
      if (max >= kSizes) return absl::InternalError("the suite's table is too small for this transport");
      const size_t expected = (n - 1) * (max + 1);
      std::thread receiver([&] {
        std::vector<uint8_t> buffer(max);
        size_t distinct = 0;
        const absl::Time give_up = absl::Now() + absl::Seconds(60);
        while (distinct < expected && absl::Now() < give_up) {
          absl::StatusOr<ReceivedDatagram> got =
              t.Receive(absl::MakeSpan(buffer), absl::Now() + absl::Milliseconds(100));
          if (!got.ok()) {
            EXPECT_THAT(got.status(), StatusIs(absl::StatusCode::kDeadlineExceeded));
            continue;
          }
          const uint64_t to = got->tag >> 32, size = got->tag & 0xFFFFFFFF;
          ASSERT_TRUE(got->source >= 0 && got->source < n && got->source != rank) << got->source;
          ASSERT_EQ(to, static_cast<uint64_t>(rank));
          ASSERT_EQ(got->bytes, size);
          ASSERT_TRUE(std::equal(buffer.begin(), buffer.begin() + size, Pattern(got->source, got->tag, size).begin()))
              << size << " bytes from rank " << got->source;
          if (!arrived[(rank * n + got->source) * kSizes + size].exchange(true)) ++distinct;
        }
        EXPECT_EQ(distinct, expected) << "rank " << rank;
      });
      absl::Status sent = absl::OkStatus();
      for (int peer = 0; peer < n && sent.ok(); ++peer) {
        if (peer == rank) continue;
        for (size_t first = 0; first <= max && sent.ok(); first += kWindow) {
          const size_t last = std::min(first + kWindow, max + 1);
          bool all = false;
          for (int attempt = 0; attempt < 200 && !all; ++attempt) {
            for (size_t size = first; size < last; ++size) {
              if (arrived[(peer * n + rank) * kSizes + size]) continue;
              const uint64_t tag = (uint64_t{static_cast<uint32_t>(peer)} << 32) | size;
              const absl::Status s = t.Send(peer, tag, Pattern(rank, tag, size));
              if (!s.ok() && !absl::IsResourceExhausted(s)) sent = s;
            }
            for (int wait = 0; wait < 50 && !all; ++wait) {
              all = true;
              for (size_t size = first; size < last && all; ++size) all = arrived[(peer * n + rank) * kSizes + size];
              if (!all) absl::SleepFor(absl::Milliseconds(1));
            }
          }
          if (!all && sent.ok())
            sent = absl::DeadlineExceededError(absl::StrCat("sizes from ", first, " to rank ", peer));
        }
      }
      receiver.join();
      const DatagramCounters c = t.counters();
      EXPECT_GE(c.sent, expected);
      EXPECT_GE(c.received, expected);
      // Nothing honest is misread as bad.
      EXPECT_EQ(c.dropped(), 0u) << "malformed " << c.malformed << ", unauthenticated " << c.unauthenticated
                                 << ", foreign " << c.foreign << ", replayed " << c.replayed << ", stray " << c.stray;
      return sent;
    });
  }
}

TEST_P(DatagramConformanceTest, RefusesPayloadsOverTheMaxBadPeersAndSmallBuffers) {
  RunRanks(2, [](int rank, DatagramTransport& t) -> absl::Status {
    const size_t max = t.capabilities().max_payload;
    const int peer = 1 - rank;
    EXPECT_THAT(t.Send(peer, 1, std::vector<uint8_t>(max + 1)), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(t.Send(peer, 1, std::vector<uint8_t>(70000)), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(t.Send(rank, 1, std::vector<uint8_t>(8)), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(t.Send(-1, 1, std::vector<uint8_t>(8)), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(t.Send(2, 1, std::vector<uint8_t>(8)), StatusIs(absl::StatusCode::kInvalidArgument));
    std::vector<uint8_t> small(max - 1);
    EXPECT_THAT(t.Receive(absl::MakeSpan(small), absl::Now()), StatusIs(absl::StatusCode::kInvalidArgument));
    const DatagramCounters c = t.counters();
    EXPECT_EQ(c.sent + c.send_dropped, 0u) << "a refused send is not a datagram";
    return absl::OkStatus();
  });
}

TEST_P(DatagramConformanceTest, ReceiveHonoursItsDeadlineAndAPastOneStillTakesWhatWaits) {
  absl::Notification timed_out, sent;
  RunRanks(2, [&](int rank, DatagramTransport& t) -> absl::Status {
    std::vector<uint8_t> buffer(t.capabilities().max_payload);
    if (rank == 0) {
      timed_out.WaitForNotificationWithTimeout(absl::Seconds(20));
      DQ_RETURN_IF_ERROR(t.Send(1, 5, Pattern(0, 5, 100)));
      sent.Notify();
      return absl::OkStatus();
    }
    for (absl::Duration d : {absl::Milliseconds(300), absl::ZeroDuration(), absl::Milliseconds(-500)}) {
      const absl::Time start = absl::Now();
      EXPECT_THAT(t.Receive(absl::MakeSpan(buffer), start + d), StatusIs(absl::StatusCode::kDeadlineExceeded));
      const absl::Duration took = absl::Now() - start;
      EXPECT_GE(took, d - absl::Milliseconds(1));
      EXPECT_LT(took, std::max(d, absl::ZeroDuration()) + absl::Seconds(2)) << "bounded margin";
    }
    timed_out.Notify();
    sent.WaitForNotificationWithTimeout(absl::Seconds(20));
    // The datagram is on its way or waiting: a Receive whose deadline has passed still takes it.
    absl::StatusOr<ReceivedDatagram> got = absl::DeadlineExceededError("not yet");
    for (const absl::Time give_up = absl::Now() + absl::Seconds(5); !got.ok() && absl::Now() < give_up;) {
      got = t.Receive(absl::MakeSpan(buffer), absl::InfinitePast());
      if (!got.ok()) absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_THAT(got, IsOk());
    if (got.ok()) {
      EXPECT_EQ(got->tag, 5u);
    }
    return absl::OkStatus();
  });
}

TEST_P(DatagramConformanceTest, AbortFromAnotherThreadWakesAPendingReceivePromptly) {
  RunRanks(2, [](int rank, DatagramTransport& t) -> absl::Status {
    if (rank != 1) return absl::OkStatus();
    std::vector<uint8_t> buffer(t.capabilities().max_payload);
    std::thread watchdog([&] {
      absl::SleepFor(absl::Milliseconds(200));
      t.Abort();
    });
    const absl::Time start = absl::Now();
    const absl::StatusOr<ReceivedDatagram> got = t.Receive(absl::MakeSpan(buffer), absl::Now() + absl::Seconds(30));
    watchdog.join();
    EXPECT_THAT(got, StatusIs(absl::StatusCode::kAborted));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    // And everything later fails, at once.
    EXPECT_THAT(t.Receive(absl::MakeSpan(buffer), absl::Now() + absl::Seconds(30)),
                StatusIs(absl::StatusCode::kAborted));
    EXPECT_THAT(t.Send(0, 1, Pattern(1, 1, 10)), StatusIs(absl::StatusCode::kAborted));
    t.Abort();  // idempotent
    return absl::OkStatus();
  });
}

TEST_P(DatagramConformanceTest, TagsOutsideTheAcceptedRangeAreStray) {
  absl::Notification ready;
  RunRanks(2, [&](int rank, DatagramTransport& t) -> absl::Status {
    if (rank == 0) {
      ready.WaitForNotificationWithTimeout(absl::Seconds(20));
      for (uint64_t tag : {5, 15, 25, 16}) DQ_RETURN_IF_ERROR(t.Send(1, tag, Pattern(0, tag, 64)));
      return absl::OkStatus();
    }
    t.AcceptTags(10, 20);
    ready.Notify();
    std::vector<uint8_t> buffer(t.capabilities().max_payload);
    std::vector<uint64_t> tags;
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    while (absl::Now() < give_up && (tags.size() < 2 || t.counters().stray < 2)) {
      absl::StatusOr<ReceivedDatagram> got = t.Receive(absl::MakeSpan(buffer), absl::Now() + absl::Milliseconds(50));
      if (got.ok()) tags.push_back(got->tag);
    }
    std::sort(tags.begin(), tags.end());
    EXPECT_THAT(tags, ElementsAreArray({15, 16}));
    EXPECT_EQ(t.counters().stray, 2u);
    return absl::OkStatus();
  });
}

INSTANTIATE_TEST_SUITE_P(Datagrams, DatagramConformanceTest,
                         ::testing::Values(DatagramCase{"udp", "udp", "127.0.0.1", false},
                                           DatagramCase{"udp_keyed", "udp", "127.0.0.1", true},
                                           DatagramCase{"udp_ipv6_keyed", "udp", "::1", true}),
                         [](const ::testing::TestParamInfo<DatagramCase>& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// UDP's own: a real rank 0 and the test as rank 1, a plain socket that publishes itself in the
// store as any rank does, so it knows the connection and can speak (and misspeak) the wire format.

class RawUdpSocket {
 public:
  RawUdpSocket() : fd_(socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    timeval tv = {5, 0};  // receives never hang a test
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~RawUdpSocket() { close(fd_); }
  std::string address() const {
    sockaddr_storage ss = {};
    socklen_t len = sizeof(ss);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&ss), &len);
    return common::SockaddrString(ss);
  }
  void SendTo(const std::string& address, absl::Span<const uint8_t> bytes) const {
    auto host_port = common::SplitHostPort(address);
    ASSERT_THAT(host_port, IsOk());
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(host_port->second)));
    inet_pton(AF_INET, host_port->first.c_str(), &a.sin_addr);
    ASSERT_EQ(sendto(fd_, bytes.data(), bytes.size(), 0, reinterpret_cast<sockaddr*>(&a), sizeof(a)),
              static_cast<ssize_t>(bytes.size()));
  }
  std::vector<uint8_t> ReceiveOne() const {
    std::vector<uint8_t> b(70000);
    const ssize_t n = recv(fd_, b.data(), b.size(), 0);
    b.resize(n < 0 ? 0 : n);
    return b;
  }

 private:
  int fd_;
};

struct RawPeerGroup {
  // Rank 0 a UdpTransport, rank 1 `raw`, through `store`.
  static std::unique_ptr<RawPeerGroup> Make(std::optional<common::HmacSha256::Digest> key) {
    auto g = std::make_unique<RawPeerGroup>();
    EXPECT_THAT(g->store.Set("udp/1", absl::StrCat(g->raw.address(), " 0123456789abcdef")), IsOk());
    UdpTransportOptions o;
    o.timeout = absl::Seconds(10);
    o.key = key;
    absl::StatusOr<std::unique_ptr<UdpTransport>> t = ConnectUdpTransport(g->store, 0, 2, o);
    EXPECT_THAT(t, IsOk());
    if (!t.ok()) return nullptr;
    g->transport = std::move(*t);
    std::vector<std::string> published(2);
    for (int q = 0; q < 2; ++q) published[q] = *g->store.Get(absl::StrCat("udp/", q), absl::Seconds(1));
    const uint64_t connection = UdpConnectionId(published);
    EXPECT_EQ(connection, g->transport->connection_id());
    g->key = std::make_unique<DatagramKey>(connection, key);
    return g;
  }

  // Sends `bytes` to rank 0.
  void Inject(absl::Span<const uint8_t> bytes) { raw.SendTo(transport->local_address(), bytes); }
  // A valid datagram from rank 1 to rank 0.
  std::vector<uint8_t> Valid(uint64_t tag, size_t bytes) {
    return SealDatagram(*key, 1, 0, tag, next_sequence++, Pattern(1, tag, bytes));
  }
  // Sends a valid datagram and expects rank 0 to deliver it next: whatever was injected before it
  // (loopback keeps a socket's order) has been looked at and counted by then.
  void ExpectDeliveredNext(uint64_t tag = 777) {
    Inject(Valid(tag, 32));
    ExpectReceived(tag, 32);
  }
  // Rank 0 delivers Valid(tag, bytes) next.
  void ExpectReceived(uint64_t tag, size_t bytes) {
    std::vector<uint8_t> buffer(transport->capabilities().max_payload);
    absl::StatusOr<ReceivedDatagram> got = transport->Receive(absl::MakeSpan(buffer), absl::Now() + absl::Seconds(5));
    ASSERT_THAT(got, IsOk());
    EXPECT_EQ(got->source, 1);
    EXPECT_EQ(got->tag, tag);
    ASSERT_EQ(got->bytes, bytes);
    EXPECT_TRUE(std::equal(buffer.begin(), buffer.begin() + bytes, Pattern(1, tag, bytes).begin()));
  }

  InMemoryStore store;
  RawUdpSocket raw;
  std::unique_ptr<UdpTransport> transport;
  std::unique_ptr<DatagramKey> key;
  uint64_t next_sequence = 1;
};

std::vector<uint8_t> Garbage(size_t n, uint32_t seed) { return Pattern(99, seed, n); }

TEST(UdpTransportTest, DropsAndCountsEveryKindOfBadDatagramAndKeepsWorking) {
  auto g = RawPeerGroup::Make(JobKey());
  ASSERT_NE(g, nullptr);
  UdpTransport& t = *g->transport;
  const size_t max = t.capabilities().max_payload;
  EXPECT_EQ(max, 1472 - kDatagramOverheadBytes);
  g->ExpectDeliveredNext();
  DatagramCounters want = t.counters();
  EXPECT_EQ(want.received, 1u);
  auto expect_counters = [&](const char* after) {
    g->ExpectDeliveredNext();
    ++want.received;
    const DatagramCounters c = t.counters();
    EXPECT_EQ(c.received, want.received) << after;
    EXPECT_EQ(c.malformed, want.malformed) << after;
    EXPECT_EQ(c.unauthenticated, want.unauthenticated) << after;
    EXPECT_EQ(c.foreign, want.foreign) << after;
    EXPECT_EQ(c.replayed, want.replayed) << after;
    EXPECT_EQ(c.stray, want.stray) << after;
  };

  // Garbage of every interesting length, an empty datagram, and more than a datagram holds.
  for (size_t n : {size_t{0}, size_t{1}, size_t{43}, size_t{59}, size_t{60}, size_t{100}, size_t{1472}, size_t{4000}}) {
    g->Inject(Garbage(n, static_cast<uint32_t>(n)));
    ++want.malformed;
  }
  // A valid header in front of garbage.
  std::vector<uint8_t> framed = g->Valid(1, 100);
  framed.resize(framed.size() + 7, 0xAB);
  g->Inject(framed);
  ++want.malformed;
  expect_counters("garbage");

  // Truncated: a valid datagram cut anywhere; and one longer than max_datagram_bytes (cut by the kernel).
  const std::vector<uint8_t> whole = g->Valid(2, 500);
  for (size_t cut : {size_t{1}, size_t{16}, size_t{17}, size_t{500}, whole.size() - kDatagramHeaderBytes}) {
    g->Inject(absl::MakeConstSpan(whole).subspan(0, whole.size() - cut));
    ++want.malformed;
  }
  g->Inject(SealDatagram(*g->key, 1, 0, 3, g->next_sequence++, Pattern(1, 3, max + 100)));
  ++want.malformed;
  expect_counters("truncated");

  // Wrong MAC: a flipped bit in the payload, tag or sequence; another job's key; no key.
  for (size_t offset : {size_t{24}, size_t{33}, kDatagramHeaderBytes + 5}) {
    std::vector<uint8_t> d = g->Valid(4, 64);
    d[offset] ^= 1;
    g->Inject(d);
    ++want.unauthenticated;
  }
  const DatagramKey other_job(g->key->connection(), JobKey("another job"));
  g->Inject(SealDatagram(other_job, 1, 0, 4, g->next_sequence++, Pattern(1, 4, 64)));
  const DatagramKey no_key(g->key->connection(), std::nullopt);
  g->Inject(SealDatagram(no_key, 1, 0, 4, g->next_sequence++, Pattern(1, 4, 64)));
  want.unauthenticated += 2;
  expect_counters("wrong MAC");

  // Another connection's: forged with this job's key, and a real one captured from another group
  // (its rank 0 sends to its rank 1, a plain socket here, and the test forwards it).
  const DatagramKey other_connection(g->key->connection() ^ 1, JobKey());
  g->Inject(SealDatagram(other_connection, 1, 0, 5, g->next_sequence++, Pattern(1, 5, 64)));
  ++want.foreign;
  auto other = RawPeerGroup::Make(JobKey());
  ASSERT_NE(other, nullptr);
  EXPECT_NE(other->transport->connection_id(), t.connection_id());
  ASSERT_THAT(other->transport->Send(1, 6, Pattern(0, 6, 200)), IsOk());
  const std::vector<uint8_t> captured = other->raw.ReceiveOne();
  ASSERT_EQ(captured.size(), kDatagramOverheadBytes + 200);
  g->Inject(captured);
  ++want.foreign;
  expect_counters("foreign");

  // Replayed: a valid datagram delivered once, then the same bytes again (twice), and one so old
  // that the window cannot tell.
  const std::vector<uint8_t> first = g->Valid(8, 80);
  g->Inject(first);
  g->ExpectReceived(8, 80);
  ++want.received;
  g->Inject(first);
  g->Inject(first);
  want.replayed += 2;
  expect_counters("replayed");
  const uint64_t old = g->next_sequence;
  g->next_sequence += ReplayWindow::kWindow + 10;
  g->ExpectDeliveredNext();
  ++want.received;
  g->Inject(SealDatagram(*g->key, 1, 0, 9, old, Pattern(1, 9, 80)));
  ++want.replayed;
  expect_counters("too old");

  // Stray: a source outside the group, rank 0 itself as the source, addressed to rank 1, a tag not
  // accepted now.
  g->Inject(SealDatagram(*g->key, 2, 0, 10, 1, Pattern(2, 10, 10)));
  g->Inject(SealDatagram(*g->key, 0, 0, 10, 1, Pattern(0, 10, 10)));
  g->Inject(SealDatagram(*g->key, 1, 1, 10, g->next_sequence++, Pattern(1, 10, 10)));
  want.stray += 3;
  t.AcceptTags(700, 800);
  g->Inject(g->Valid(10, 10));
  ++want.stray;
  expect_counters("stray");
  t.AcceptTags(0, ~uint64_t{0});

  // Still working both ways: what rank 0 sends parses at "rank 1" with the same functions.
  ASSERT_THAT(t.Send(1, 42, Pattern(0, 42, max)), IsOk());
  const std::vector<uint8_t> out = g->raw.ReceiveOne();
  const ParsedDatagram parsed = ParseDatagram(out, *g->key, 1, 2, max);
  ASSERT_EQ(parsed.verdict, DatagramVerdict::kAccepted);
  EXPECT_EQ(parsed.header.source, 0u);
  EXPECT_EQ(parsed.header.tag, 42u);
  EXPECT_EQ(parsed.header.sequence, 1u);
  EXPECT_THAT(parsed.payload, ElementsAreArray(Pattern(0, 42, max)));
  EXPECT_EQ(t.counters().sent, 1u);
}

TEST(UdpTransportTest, WithoutAKeyAChecksumStillCatchesCorruption) {
  auto g = RawPeerGroup::Make(std::nullopt);
  ASSERT_NE(g, nullptr);
  g->ExpectDeliveredNext();
  std::vector<uint8_t> d = g->Valid(3, 300);
  d[kDatagramHeaderBytes + 150] ^= 0x20;
  g->Inject(d);
  const DatagramKey keyed(g->key->connection(), JobKey());
  g->Inject(SealDatagram(keyed, 1, 0, 3, g->next_sequence++, Pattern(1, 3, 300)));
  g->ExpectDeliveredNext();
  EXPECT_EQ(g->transport->counters().unauthenticated, 2u);
  EXPECT_EQ(g->transport->counters().received, 2u);
}

TEST(UdpTransportTest, ASendNeverBlocksAndEveryDatagramIsSentOrCounted) {
  auto g = RawPeerGroup::Make(JobKey());
  ASSERT_NE(g, nullptr);
  UdpTransport& t = *g->transport;
  // The raw peer never reads: its buffer fills and the kernel drops there; this side never waits.
  const std::vector<uint8_t> payload = Pattern(0, 1, t.capabilities().max_payload);
  constexpr int kSends = 20000;
  int ok = 0, exhausted = 0;
  const absl::Time start = absl::Now();
  for (int i = 0; i < kSends; ++i) {
    const absl::Status s = t.Send(1, i, payload);
    if (s.ok()) ++ok;
    EXPECT_THAT(s, AnyOf(IsOk(), StatusIs(absl::StatusCode::kResourceExhausted)));
    if (absl::IsResourceExhausted(s)) ++exhausted;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  const DatagramCounters c = t.counters();
  EXPECT_EQ(c.sent, static_cast<uint64_t>(ok));
  EXPECT_EQ(c.send_dropped, static_cast<uint64_t>(exhausted));
  EXPECT_EQ(ok + exhausted, kSends);
}

TEST(UdpTransportTest, RendezvousErrorsAreNamed) {
  UdpTransportOptions o;
  o.timeout = absl::Milliseconds(300);
  {
    InMemoryStore store;
    EXPECT_THAT(ConnectUdpTransport(store, 2, 2, o), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(ConnectUdpTransport(store, 0, 0, o), StatusIs(absl::StatusCode::kInvalidArgument));
    UdpTransportOptions tiny = o;
    tiny.max_datagram_bytes = kDatagramOverheadBytes;
    EXPECT_THAT(ConnectUdpTransport(store, 0, 1, tiny), StatusIs(absl::StatusCode::kInvalidArgument));
    tiny.max_datagram_bytes = 70000;
    EXPECT_THAT(ConnectUdpTransport(store, 0, 1, tiny), StatusIs(absl::StatusCode::kInvalidArgument));
  }
  {
    InMemoryStore store;  // rank 1 never comes
    const absl::Time start = absl::Now();
    EXPECT_THAT(ConnectUdpTransport(store, 0, 2, o), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("udp/1")));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  for (const char* bad :
       {"nonsense", "127.0.0.1:1 short", "127.0.0.1 0123456789abcdef", "[::1]:4000 0123456789abcdef"}) {
    InMemoryStore store;
    ASSERT_THAT(store.Set("udp/1", bad), IsOk());
    EXPECT_THAT(ConnectUdpTransport(store, 0, 2, o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 1")))
        << bad;
  }
}

TEST(UdpTransportTest, ThePayloadLimitFollowsTheFamilyOrTheOption) {
  struct Case {
    std::string hostname;
    size_t max_datagram_bytes;
    size_t payload;
  };
  std::vector<Case> cases = {{"127.0.0.1", 0, 1412}, {"127.0.0.1", 9000, 9000 - kDatagramOverheadBytes}};
  if (HaveIpv6Loopback()) cases.push_back({"::1", 0, 1392});
  for (const Case& c : cases) {
    UdpTransportOptions o;
    o.hostname = c.hostname;
    o.max_datagram_bytes = c.max_datagram_bytes;
    o.timeout = absl::Seconds(10);
    InMemoryStore store;
    std::vector<absl::Status> results(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<UdpTransport>> t = ConnectUdpTransport(store, r, 2, o);
        if (!t.ok()) {
          results[r] = t.status();
          return;
        }
        EXPECT_EQ((*t)->capabilities().max_payload, c.payload) << c.hostname;
        EXPECT_GT((*t)->receive_buffer_bytes(), 0);
        // The largest payload goes through (resent until it arrives: the suite checks what arrives).
        std::vector<uint8_t> buffer(c.payload);
        for (int attempt = 0; attempt < 50; ++attempt) {
          if (r == 0) {
            results[r] = (*t)->Send(1, 1, Pattern(0, 1, c.payload));
            absl::SleepFor(absl::Milliseconds(20));
            if ((*t)->Receive(absl::MakeSpan(buffer), absl::Now()).ok()) return;  // rank 1's "got it"
            continue;
          }
          absl::StatusOr<ReceivedDatagram> got = (*t)->Receive(absl::MakeSpan(buffer), absl::Now() + absl::Seconds(1));
          if (!got.ok()) continue;
          EXPECT_EQ(got->bytes, c.payload);
          EXPECT_EQ(buffer, Pattern(0, 1, c.payload));
          results[r] = (*t)->Send(0, 2, {});
          return;
        }
        results[r] = absl::DeadlineExceededError("the largest payload never arrived");
      });
    }
    for (auto& t : threads) t.join();
    testing::ExpectAllOk(results);
  }
}

// Loopback throughput, one rank to another, 1400-byte payloads, about a second per setting. Prints;
// asserts only that datagrams arrived. A sender that meets a full socket buffer yields and goes on.
TEST(UdpTransportBench, LoopbackThroughputOf1400BytePayloads) {
  constexpr size_t kPayload = 1400;
  for (bool keyed : {false, true}) {
    InMemoryStore store;
    UdpTransportOptions o;
    o.timeout = absl::Seconds(10);
    if (keyed) o.key = JobKey();
    absl::StatusOr<std::unique_ptr<UdpTransport>> connected[2];
    std::thread connect1([&] { connected[1] = ConnectUdpTransport(store, 1, 2, o); });
    connected[0] = ConnectUdpTransport(store, 0, 2, o);
    connect1.join();
    ASSERT_THAT(connected[0], IsOk());
    ASSERT_THAT(connected[1], IsOk());
    std::unique_ptr<UdpTransport> t[2] = {std::move(*connected[0]), std::move(*connected[1])};
    std::atomic<bool> sending{true};
    std::atomic<uint64_t> received_bytes{0};
    std::thread receiver([&] {
      std::vector<uint8_t> buffer(t[1]->capabilities().max_payload);
      absl::Time quiet_until = absl::InfiniteFuture();
      while (absl::Now() < quiet_until) {
        if (!sending && quiet_until == absl::InfiniteFuture()) quiet_until = absl::Now() + absl::Milliseconds(200);
        absl::StatusOr<ReceivedDatagram> got =
            t[1]->Receive(absl::MakeSpan(buffer), absl::Now() + absl::Milliseconds(50));
        if (got.ok()) received_bytes += got->bytes;
      }
    });
    const std::vector<uint8_t> payload = Pattern(0, 1, kPayload);
    const absl::Time start = absl::Now();
    const absl::Time end = start + absl::Seconds(1);
    uint64_t tag = 0;
    while (absl::Now() < end) {
      for (int i = 0; i < 64; ++i) {
        if (absl::IsResourceExhausted(t[0]->Send(1, ++tag, payload))) std::this_thread::yield();
      }
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    sending = false;
    receiver.join();
    const DatagramCounters s = t[0]->counters(), r = t[1]->counters();
    std::printf(
        "udp loopback, %zu-byte payloads, %s: sent %.0f datagrams/s (%.1f MB/s), received %.0f datagrams/s "
        "(%.1f MB/s of payload), lost %.2f%%, send buffer full %llu times; socket buffers rcv %d snd %d bytes\n",
        kPayload, keyed ? "HMAC-SHA256" : "checksum", s.sent / seconds, s.sent * kPayload / seconds / 1e6,
        r.received / seconds, received_bytes / seconds / 1e6,
        s.sent == 0 ? 0.0 : 100.0 * (s.sent - r.received) / s.sent, static_cast<unsigned long long>(s.send_dropped),
        t[1]->receive_buffer_bytes(), t[0]->send_buffer_bytes());
    EXPECT_GT(r.received, 0u);
    EXPECT_EQ(r.dropped(), 0u);
  }
}

}  // namespace
}  // namespace dynamiq::engine

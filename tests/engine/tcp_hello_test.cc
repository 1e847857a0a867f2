// The TCP transport's hello (engine/tcp_hello.h) against strangers: processes that reach a rank's
// listening port and claim a rank, with or without the job's key, or say nothing at all.
#include "engine/tcp_hello.h"

#include <sys/socket.h>

#include <array>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "engine/store.h"
#include "engine/tcp_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/raw_tcp_peer.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/transport_test_util.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::Cat;
using ::dynamiq::testing::ClosedByPeer;
using ::dynamiq::testing::ConnectToRank;
using ::dynamiq::testing::Deadline;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::kKeyedHelloMagic;
using ::dynamiq::testing::kPlainHelloMagic;
using ::dynamiq::testing::Pattern;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

using Key = common::HmacSha256::Digest;

std::vector<uint8_t> U32(uint32_t v) { return testing::LittleEndian(v, 4); }
bool Send(int fd, const std::vector<uint8_t>& bytes) { return testing::SendRaw(fd, bytes); }

Key KeyOf(uint8_t fill) {
  Key k;
  k.fill(fill);
  return k;
}

TcpTransportOptions Options(std::optional<Key> key, absl::Duration timeout = absl::Seconds(10)) {
  TcpTransportOptions o;
  o.hostname = "127.0.0.1";
  o.timeout = timeout;
  o.key = key;
  return o;
}

// Connects rank `rank` of `size` in a thread; the result lands in `*out`.
std::thread ConnectInThread(Store& store, int rank, int size, TcpTransportOptions o,
                            absl::StatusOr<std::unique_ptr<Transport>>* out) {
  return std::thread([&store, rank, size, o, out] { *out = ConnectTcpTransport(store, rank, size, o); });
}

// Both transports work: one message each way.
void ExpectTheyTalk(Transport& a, Transport& b) {
  const std::vector<uint8_t> sent = Pattern(a.rank(), 7, 100);
  std::vector<uint8_t> got(100);
  auto r = b.PostRecv(a.rank(), 7, absl::MakeSpan(got));
  auto s = a.PostSend(b.rank(), 7, sent);
  ASSERT_THAT(r, IsOk());
  ASSERT_THAT(s, IsOk());
  EXPECT_THAT(a.Wait(*s, Deadline()), IsOk());
  EXPECT_THAT(b.Wait(*r, Deadline()), IsOk());
  EXPECT_EQ(got, sent);
}

// With the key, a stranger's claims of rank 1 (a wrong proof, a plain hello, a wrong key) are all
// turned away while rank 0 waits, and the real rank 1 then connects.
TEST(TcpHelloTest, WithAKeyAStrangerCannotTakeARank) {
  InMemoryStore store;
  absl::StatusOr<std::unique_ptr<Transport>> rank0, rank1;
  std::thread t0 = ConnectInThread(store, 0, 2, Options(KeyOf(1)), &rank0);

  // A keyed hello, then a proof made up without the key.
  int fd = ConnectToRank(store, 0);
  std::vector<uint8_t> nonce(16, 0x42);
  ASSERT_TRUE(Send(fd, Cat(Cat(kKeyedHelloMagic, U32(1)), nonce)));
  std::array<char, 48> challenge;
  ASSERT_THAT(common::ReadFull(fd, challenge.data(), challenge.size(), Deadline(), "challenge"), IsOk());
  ASSERT_TRUE(Send(fd, std::vector<uint8_t>(32, 0)));
  EXPECT_TRUE(ClosedByPeer(fd));
  common::CloseFd(fd);
  // A plain hello.
  fd = ConnectToRank(store, 0);
  ASSERT_TRUE(Send(fd, Cat(kPlainHelloMagic, U32(1))));
  EXPECT_TRUE(ClosedByPeer(fd));
  common::CloseFd(fd);
  // The protocol with another key: rank 0's proof fails there.
  absl::StatusOr<std::string> address = store.Get("tcp/0", absl::Seconds(1));
  ASSERT_THAT(address, IsOk());
  auto host_port = common::SplitHostPort(*address);
  ASSERT_THAT(host_port, IsOk());
  EXPECT_THAT(DialPeer(host_port->first, host_port->second, 1, 0, KeyOf(2), Deadline()),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("proof of the job's key is wrong")));

  std::thread t1 = ConnectInThread(store, 1, 2, Options(KeyOf(1)), &rank1);
  t0.join();
  t1.join();
  ASSERT_THAT(rank0, IsOk());
  ASSERT_THAT(rank1, IsOk());
  ExpectTheyTalk(**rank0, **rank1);
  ExpectTheyTalk(**rank1, **rank0);
}

// Nodes with different keys never connect; both say why.
TEST(TcpHelloTest, DifferentKeysAreRefusedAndNamed) {
  InMemoryStore store;
  absl::StatusOr<std::unique_ptr<Transport>> rank0, rank1;
  std::thread t0 = ConnectInThread(store, 0, 2, Options(KeyOf(1), absl::Seconds(2)), &rank0);
  std::thread t1 = ConnectInThread(store, 1, 2, Options(KeyOf(2), absl::Seconds(2)), &rank1);
  t0.join();
  t1.join();
  EXPECT_THAT(rank1, StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("rank 0")));
  EXPECT_THAT(rank0, StatusIs(absl::StatusCode::kDeadlineExceeded,
                              AllOf(HasSubstr("1 higher rank(s) did not connect"), HasSubstr("turned away"))));
}

// A keyed rank and a rank without a key: the keyed one names the mismatch.
TEST(TcpHelloTest, AKeyedRankTurnsAwayAPlainHelloAndSaysWhy) {
  InMemoryStore store;
  absl::StatusOr<std::unique_ptr<Transport>> rank0, rank1;
  std::thread t0 = ConnectInThread(store, 0, 2, Options(KeyOf(1), absl::Seconds(2)), &rank0);
  std::thread t1 = ConnectInThread(store, 1, 2, Options(std::nullopt, absl::Seconds(2)), &rank1);
  t0.join();
  t1.join();
  EXPECT_THAT(rank0, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("unauthenticated hello")));
}

// Without a key the first claim of a rank holds (so, unauthenticated, a stranger that comes first
// takes the place: docs/security.md); a later claim of the same rank is turned away and does not
// displace it.
TEST(TcpHelloTest, ASecondClaimOfARankDoesNotDisplaceTheFirst) {
  InMemoryStore store;
  absl::StatusOr<std::unique_ptr<Transport>> rank0;
  std::thread t0 = ConnectInThread(store, 0, 3, Options(std::nullopt, absl::Seconds(1.5)), &rank0);
  const int first = ConnectToRank(store, 0);
  ASSERT_TRUE(Send(first, Cat(kPlainHelloMagic, U32(1))));
  absl::SleepFor(absl::Milliseconds(100));  // rank 0 has taken the first claim
  const int second = ConnectToRank(store, 0);
  ASSERT_TRUE(Send(second, Cat(kPlainHelloMagic, U32(1))));
  EXPECT_TRUE(ClosedByPeer(second));
  EXPECT_FALSE(ClosedByPeer(first, absl::Milliseconds(200)));
  t0.join();  // rank 2 never comes
  common::CloseFd(first);
  common::CloseFd(second);
  EXPECT_THAT(rank0, StatusIs(absl::StatusCode::kDeadlineExceeded,
                              AllOf(HasSubstr("1 higher rank(s) did not connect"),
                                    HasSubstr("claimed rank 1, which is not a free higher rank"))));
}

// Connections that say nothing (more than the table of pending hellos holds) do not keep the real
// rank out: hellos are read concurrently, each with its own deadline.
TEST(TcpHelloTest, SilentConnectionsDoNotKeepARankOut) {
  for (const bool keyed : {false, true}) {
    SCOPED_TRACE(keyed ? "keyed" : "plain");
    InMemoryStore store;
    std::optional<Key> key;
    if (keyed) key = KeyOf(3);
    absl::StatusOr<std::unique_ptr<Transport>> rank0, rank1;
    // Less than one silent connection's hello deadline: one at a time, the first would outlast it.
    TcpTransportOptions o = Options(key, absl::Seconds(2.5));
    std::thread t0 = ConnectInThread(store, 0, 2, o, &rank0);
    std::vector<int> silent;
    for (size_t i = 0; i < HelloAcceptor::kMaxPendingHellos + 6; ++i) silent.push_back(ConnectToRank(store, 0));
    absl::SleepFor(absl::Milliseconds(100));  // rank 0 has accepted them all
    const absl::Time start = absl::Now();
    std::thread t1 = ConnectInThread(store, 1, 2, o, &rank1);
    t0.join();
    t1.join();
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
    for (int fd : silent) common::CloseFd(fd);
    ASSERT_THAT(rank0, IsOk());
    ASSERT_THAT(rank1, IsOk());
    ExpectTheyTalk(**rank0, **rank1);
  }
}

// A hello that never completes costs its connection only: turned away after its own deadline,
// counted in the message of a rendezvous that times out.
TEST(TcpHelloTest, AStalledHelloIsTurnedAwayAndCounted) {
  InMemoryStore store;
  absl::StatusOr<std::unique_ptr<Transport>> rank0;
  TcpTransportOptions o = Options(std::nullopt, absl::Seconds(1.5));
  o.hello_timeout = absl::Milliseconds(300);
  std::thread t0 = ConnectInThread(store, 0, 2, o, &rank0);
  const int fd = ConnectToRank(store, 0);
  ASSERT_TRUE(Send(fd, {0x44, 0x43}));  // two bytes of a hello, then nothing
  EXPECT_TRUE(ClosedByPeer(fd, absl::Seconds(1.2)));
  common::CloseFd(fd);
  t0.join();
  EXPECT_THAT(rank0, StatusIs(absl::StatusCode::kDeadlineExceeded,
                              AllOf(HasSubstr("1 connection(s) turned away"), HasSubstr("hello's deadline"))));
}

}  // namespace
}  // namespace dynamiq::engine

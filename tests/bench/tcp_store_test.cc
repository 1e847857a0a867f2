#include "bench/tcp_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::bench {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

std::unique_ptr<TcpStoreServer> StartServer() {
  auto server = TcpStoreServer::Start("127.0.0.1:0");
  EXPECT_THAT(server, IsOk());
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<TcpStoreClient> ConnectClient(const TcpStoreServer& server) {
  auto client = TcpStoreClient::Connect(server.address(), absl::Seconds(5));
  EXPECT_THAT(client, IsOk());
  return client.ok() ? std::move(*client) : nullptr;
}

// A raw TCP connection to the server, for sending hand-made frames.
class RawSocket {
 public:
  explicit RawSocket(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawSocket() {
    if (fd_ >= 0) close(fd_);
  }
  bool connected() const { return connected_; }
  bool Send(const std::string& bytes) {
    return send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }
  // True when the server closed the connection (EOF or reset) within `timeout`, after sending
  // nothing back.
  bool ClosedByServerWithin(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      pollfd p = {fd_, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      char buf[64];
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
      if (n > 0) return false;  // The server answered instead of closing.
    }
    return false;
  }
  // Everything the server sends until it closes the connection; "<open>" if it is still open
  // after `timeout`.
  std::string ReadUntilClosed(absl::Duration timeout) {
    std::string out;
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      pollfd p = {fd_, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      char buf[256];
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return out;
      if (n > 0) out.append(buf, static_cast<size_t>(n));
    }
    return "<open>";
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

std::string U32(uint32_t v) {
  std::string s(4, '\0');
  s[0] = static_cast<char>(v >> 24);
  s[1] = static_cast<char>(v >> 16);
  s[2] = static_cast<char>(v >> 8);
  s[3] = static_cast<char>(v);
  return s;
}
std::string U64(uint64_t v) { return U32(static_cast<uint32_t>(v >> 32)) + U32(static_cast<uint32_t>(v)); }
std::string Frame(const std::string& payload) { return U32(static_cast<uint32_t>(payload.size())) + payload; }

TEST(TcpStoreTest, StartBindsEphemeralLoopbackPort) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  EXPECT_GT(server->port(), 0);
  EXPECT_EQ(server->address(), absl::StrCat("127.0.0.1:", server->port()));
}

TEST(TcpStoreTest, RejectsBadAddresses) {
  EXPECT_THAT(TcpStoreServer::Start("no-port"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(TcpStoreServer::Start("127.0.0.1:99999"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(TcpStoreClient::Connect(":123", absl::Milliseconds(10)), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(TcpStoreTest, SetGetAcrossClients) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto a = ConnectClient(*server);
  auto b = ConnectClient(*server);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  DQ_ASSERT_OK(a->Set("k", "v1"));
  EXPECT_THAT(b->Get("k", absl::Seconds(1)), ::dynamiq::testing::IsOk());
  EXPECT_EQ(*b->Get("k", absl::Seconds(1)), "v1");
  DQ_ASSERT_OK(b->Set("k", "v2"));  // Overwrite.
  EXPECT_EQ(*a->Get("k", absl::Seconds(1)), "v2");
  // Binary keys and values, and empty values, survive the trip.
  const std::string key("bin\0key", 7), value("\0\1\2\xff", 4);
  DQ_ASSERT_OK(a->Set(key, value));
  EXPECT_EQ(*b->Get(key, absl::Seconds(1)), value);
  DQ_ASSERT_OK(a->Set("empty", ""));
  EXPECT_EQ(*b->Get("empty", absl::Seconds(1)), "");
  DQ_EXPECT_OK(b->Wait({"k", key, "empty"}, absl::Seconds(1)));
}

TEST(TcpStoreTest, GetBlocksUntilAnotherClientSets) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto setter = ConnectClient(*server);
  auto getter = ConnectClient(*server);
  ASSERT_NE(setter, nullptr);
  ASSERT_NE(getter, nullptr);
  const absl::Time start = absl::Now();
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(150));
    EXPECT_THAT(setter->Set("late", "value"), IsOk());
  });
  absl::StatusOr<std::string> v = getter->Get("late", absl::Seconds(10));
  const absl::Duration took = absl::Now() - start;
  t.join();
  ASSERT_THAT(v, IsOk());
  EXPECT_EQ(*v, "value");
  EXPECT_GE(took, absl::Milliseconds(100));
  EXPECT_LT(took, absl::Seconds(5));
}

TEST(TcpStoreTest, OneClientSharedByThreadsNeverSerializesBlockedGets) {
  // Every thread first blocks on the key of the next thread, which that thread sets only after
  // its own Get has been issued: with a single shared connection this would deadlock.
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = ConnectClient(*server);
  ASSERT_NE(client, nullptr);
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(kThreads);
  std::atomic<int> started{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      std::thread setter([&, i] {
        // Set this thread's key once every thread is (about to be) blocked in Get.
        const absl::Time deadline = absl::Now() + absl::Seconds(5);
        while (started.load() < kThreads && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
        absl::SleepFor(absl::Milliseconds(50));
        EXPECT_THAT(client->Set(absl::StrCat("key", i), absl::StrCat("value", i)), IsOk());
      });
      started.fetch_add(1);
      absl::StatusOr<std::string> v = client->Get(absl::StrCat("key", (i + 1) % kThreads), absl::Seconds(10));
      results[i] = v.status();
      if (v.ok() && *v != absl::StrCat("value", (i + 1) % kThreads)) results[i] = absl::InternalError(*v);
      setter.join();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_THAT(results[i], IsOk()) << "thread " << i;
}

TEST(TcpStoreTest, ManyClientsManyKeys) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  constexpr int kClients = 16;
  constexpr int kKeys = 20;
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(kClients);
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto client = TcpStoreClient::Connect(server->address(), absl::Seconds(5));
      if (!client.ok()) {
        results[c] = client.status();
        return;
      }
      for (int k = 0; k < kKeys; ++k) {
        absl::Status s = (*client)->Set(absl::StrCat("c", c, "/", k), absl::StrCat(c * 1000 + k));
        if (!s.ok()) {
          results[c] = s;
          return;
        }
      }
      // Read everyone's last key (blocks until each client got that far).
      std::vector<std::string> keys;
      for (int other = 0; other < kClients; ++other) keys.push_back(absl::StrCat("c", other, "/", kKeys - 1));
      results[c] = (*client)->Wait(keys, absl::Seconds(10));
      if (!results[c].ok()) return;
      for (int other = 0; other < kClients; ++other) {
        auto v = (*client)->Get(absl::StrCat("c", other, "/3"), absl::Seconds(1));
        if (!v.ok() || *v != absl::StrCat(other * 1000 + 3)) {
          results[c] = absl::InternalError(absl::StrCat("bad value for client ", other));
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int c = 0; c < kClients; ++c) EXPECT_THAT(results[c], IsOk()) << "client " << c;
}

TEST(TcpStoreTest, GetTimeoutNamesTheKey) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = ConnectClient(*server);
  ASSERT_NE(client, nullptr);
  const absl::Time start = absl::Now();
  EXPECT_THAT(client->Get("never/set", absl::Milliseconds(200)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("never/set")));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(190));
  EXPECT_LT(took, absl::Seconds(3));
  // The connection stays usable after a timeout.
  DQ_EXPECT_OK(client->Set("after", "timeout"));
  EXPECT_EQ(*client->Get("after", absl::Seconds(1)), "timeout");
}

TEST(TcpStoreTest, WaitTimeoutNamesOnlyMissingKeys) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = ConnectClient(*server);
  ASSERT_NE(client, nullptr);
  DQ_ASSERT_OK(client->Set("present", "1"));
  absl::Status s = client->Wait({"present", "missing_a", "missing_b"}, absl::Milliseconds(150));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("missing_a, missing_b")));
  EXPECT_THAT(std::string(s.message()), ::testing::Not(HasSubstr("present")));
  // A zero timeout polls.
  DQ_EXPECT_OK(client->Wait({"present"}, absl::ZeroDuration()));
  EXPECT_THAT(client->Get("missing_a", absl::ZeroDuration()), StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST(TcpStoreTest, LargeValuesAndLimits) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = ConnectClient(*server);
  ASSERT_NE(client, nullptr);
  std::string big(kMaxValueBytes, '\0');
  for (size_t i = 0; i < big.size(); i += 4093) big[i] = static_cast<char>(i * 7);
  DQ_ASSERT_OK(client->Set("big", big));
  absl::StatusOr<std::string> v = client->Get("big", absl::Seconds(5));
  ASSERT_THAT(v, IsOk());
  EXPECT_TRUE(*v == big);
  EXPECT_THAT(client->Set("too_big", std::string(kMaxValueBytes + 1, 'x')),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(client->Set(std::string(kMaxKeyBytes + 1, 'k'), "v"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(client->Get(std::string(kMaxKeyBytes + 1, 'k'), absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  const std::string max_key(kMaxKeyBytes, 'k');
  DQ_EXPECT_OK(client->Set(max_key, "v"));
  EXPECT_EQ(*client->Get(max_key, absl::Seconds(1)), "v");
}

TEST(TcpStoreTest, MalformedFramesCloseOnlyThatConnection) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto good = ConnectClient(*server);
  ASSERT_NE(good, nullptr);
  DQ_ASSERT_OK(good->Set("before", "1"));

  // A Get blocked on another connection must survive the bad connections too.
  std::thread blocked([&] {
    auto other = TcpStoreClient::Connect(server->address(), absl::Seconds(5));
    ASSERT_THAT(other, IsOk());
    EXPECT_EQ(*(*other)->Get("after", absl::Seconds(10)), "2");
  });

  const std::vector<std::pair<std::string, std::string>> bad_frames = {
      {"oversized length", U32(0xffffffffu) + "xx"},
      {"just over the frame limit", U32(static_cast<uint32_t>(kMaxFrameBytes + 1))},
      {"empty frame", U32(0)},
      {"unknown type", Frame(std::string(1, '\x07') + "abc")},
      {"SET key length beyond the frame", Frame(std::string(1, '\x01') + U32(100) + "k")},
      {"SET key over 4 KiB",
       Frame(std::string(1, '\x01') + U32(kMaxKeyBytes + 1) + std::string(kMaxKeyBytes + 1, 'k') + U32(1) + "v")},
      {"SET value length over 64 MiB", Frame(std::string(1, '\x01') + U32(1) + "k" + U32(0x7fffffffu))},
      {"SET trailing bytes", Frame(std::string(1, '\x01') + U32(1) + "k" + U32(1) + "v" + "junk")},
      {"GET truncated timeout", Frame(std::string(1, '\x02') + "\x01\x02")},
      {"WAIT absurd key count", Frame(std::string(1, '\x03') + U64(10) + U32(0xffffffffu))},
      {"WAIT key length beyond the frame", Frame(std::string(1, '\x03') + U64(10) + U32(2) + U32(1) + "a" + U32(9))},
  };
  for (const auto& [name, bytes] : bad_frames) {
    SCOPED_TRACE(name);
    RawSocket raw(server->port());
    ASSERT_TRUE(raw.connected());
    ASSERT_TRUE(raw.Send(bytes));
    EXPECT_TRUE(raw.ClosedByServerWithin(absl::Seconds(3)));
    // The server keeps serving the well-behaved client on its existing connection.
    DQ_ASSERT_OK(good->Set(name, "ok"));
    EXPECT_EQ(*good->Get(name, absl::Seconds(1)), "ok");
  }
  // A client that hangs up mid-frame, and one that sends a valid frame then garbage, are dropped
  // without harm too.
  {
    RawSocket raw(server->port());
    ASSERT_TRUE(raw.connected());
    ASSERT_TRUE(raw.Send(U32(100) + "partial"));
  }
  {
    RawSocket raw(server->port());
    ASSERT_TRUE(raw.connected());
    ASSERT_TRUE(raw.Send(Frame(std::string(1, '\x01') + U32(3) + "raw" + U32(1) + "x") + U32(0)));
    // Answers the SET (OK, empty body), then closes on the empty frame.
    EXPECT_EQ(raw.ReadUntilClosed(absl::Seconds(3)), U32(1) + std::string(1, '\0'));
  }
  EXPECT_EQ(*good->Get("raw", absl::Seconds(1)), "x");
  DQ_ASSERT_OK(good->Set("after", "2"));
  blocked.join();
}

TEST(TcpStoreTest, ConnectRetriesUntilTheServerStarts) {
  int port;
  {
    auto probe = StartServer();  // Find a free port, then release it.
    ASSERT_NE(probe, nullptr);
    port = probe->port();
  }
  const std::string address = absl::StrCat("127.0.0.1:", port);
  std::unique_ptr<TcpStoreServer> late;
  std::thread starter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    auto s = TcpStoreServer::Start(address);
    EXPECT_THAT(s, IsOk());
    if (s.ok()) late = std::move(*s);
  });
  const absl::Time start = absl::Now();
  auto client = TcpStoreClient::Connect(address, absl::Seconds(10));
  starter.join();
  ASSERT_THAT(client, IsOk());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  DQ_EXPECT_OK((*client)->Set("x", "y"));
  EXPECT_EQ(*(*client)->Get("x", absl::Seconds(1)), "y");
}

TEST(TcpStoreTest, ConnectGivesUpAfterTimeout) {
  int port;
  {
    auto probe = StartServer();
    ASSERT_NE(probe, nullptr);
    port = probe->port();
  }
  const absl::Time start = absl::Now();
  EXPECT_THAT(TcpStoreClient::Connect(absl::StrCat("127.0.0.1:", port), absl::Milliseconds(300)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("Connection refused")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(TcpStoreTest, ServerShutdownFailsBlockedGetsPromptly) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  // Reconnects retry for the connect timeout; keep it short so the last check is quick.
  auto client = TcpStoreClient::Connect(server->address(), absl::Milliseconds(300));
  ASSERT_THAT(client, IsOk());
  absl::Notification issued;
  absl::Status result;
  absl::Time returned;
  std::thread t([&] {
    issued.Notify();
    result = (*client)->Get("never", absl::Seconds(20)).status();
    returned = absl::Now();
  });
  issued.WaitForNotification();
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time stop = absl::Now();
  server.reset();
  EXPECT_LT(absl::Now() - stop, absl::Seconds(3));  // Bounded shutdown.
  t.join();
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_LT(returned - stop, absl::Seconds(3));
  // Later calls fail after the reconnect window instead of hanging.
  const absl::Time set_start = absl::Now();
  EXPECT_THAT((*client)->Set("a", "b"), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("Connection refused")));
  EXPECT_LT(absl::Now() - set_start, absl::Seconds(2));
}

TEST(TcpStoreTest, PooledConnectionsSurviveAServerRestartOnTheSamePort) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  const std::string address = server->address();
  auto client = ConnectClient(*server);
  ASSERT_NE(client, nullptr);
  DQ_ASSERT_OK(client->Set("a", "1"));
  server.reset();
  auto restarted = TcpStoreServer::Start(address);
  ASSERT_THAT(restarted, IsOk());
  // The pooled connection is stale; the client retries once on a fresh one.
  DQ_EXPECT_OK(client->Set("b", "2"));
  EXPECT_EQ(*client->Get("b", absl::Seconds(1)), "2");
}

TEST(TcpStoreTest, PrefixStoreOverTcp) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = ConnectClient(*server);
  ASSERT_NE(client, nullptr);
  engine::PrefixStore job1("job1", *client), job2("job2", *client);
  DQ_ASSERT_OK(job1.Set("k", "one"));
  DQ_ASSERT_OK(job2.Set("k", "two"));
  EXPECT_EQ(*job1.Get("k", absl::Seconds(1)), "one");
  EXPECT_EQ(*client->Get("job2/k", absl::Seconds(1)), "two");
}

}  // namespace
}  // namespace dynamiq::bench

// TcpStoreServer / TcpStoreClient: the Store (engine/store.h) for ranks that are separate
// processes, over plain TCP. One process (the launcher, rank 0, or the daemon) runs a
// TcpStoreServer; every rank connects a TcpStoreClient to it and rendezvouses through it (Gloo's
// connection setup, anything a group must agree on before it can talk). Keys live only in the
// server's memory; they are never deleted.
//
// Wire protocol (version 1). Every integer is unsigned big-endian (network order). Requests and
// responses are frames:
//
//   u32 length      bytes that follow in this frame (1 .. kMaxFrameBytes)
//   u8  type        request: 1 SET, 2 GET, 3 WAIT; response: an absl::StatusCode (0 = OK)
//   ... body        `length - 1` bytes, depending on the type:
//
//   SET   u32 key_len, key, u32 value_len, value        -> OK, empty body
//   GET   u64 timeout_ms, u32 key_len, key             -> OK, body = value
//   WAIT  u64 timeout_ms, u32 n, n x (u32 key_len, key) -> OK, empty body
//   any error                                          -> status code, body = message (UTF-8)
//
// Limits: a key is at most kMaxKeyBytes, a value at most kMaxValueBytes, a WAIT names at most
// kMaxWaitKeys keys, and the server caps a timeout at kMaxServerTimeout. GET and WAIT block on
// the server until every key exists or the timeout passes (DEADLINE_EXCEEDED naming the keys).
// A client sends one request per connection at a time and reads its response before the next.
// The server answers a malformed request (unknown type, oversized frame or field, lengths that do
// not add up to the frame) by logging one line to stderr and closing that connection; every other
// connection is unaffected. The server runs one thread per connection and refuses connections
// beyond 4096 (with a log line).
//
// Thread-safety: both classes are thread-safe. TcpStoreClient keeps a small pool of connections,
// so a Get blocked on one thread never delays a Set on another.
#ifndef DQ_BENCH_TCP_STORE_H_
#define DQ_BENCH_TCP_STORE_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/store.h"

namespace dynamiq::bench {

inline constexpr size_t kMaxKeyBytes = 4 << 10;
inline constexpr size_t kMaxValueBytes = 64 << 20;
inline constexpr size_t kMaxWaitKeys = 16 << 10;
// Largest frame either side accepts: a SET of the largest key and value plus headers.
inline constexpr size_t kMaxFrameBytes = kMaxValueBytes + kMaxKeyBytes + 64;
inline constexpr absl::Duration kMaxServerTimeout = absl::Hours(24);

namespace internal {
struct TcpStoreServerState;
}  // namespace internal

class TcpStoreServer {
 public:
  // Binds and listens on `listen_address` ("host:port"; port 0 picks a free port; "[::1]:0" for
  // IPv6) and starts serving. Binds only that address.
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> Start(const std::string& listen_address = "127.0.0.1:0");

  // Stops accepting, wakes every blocked request (they answer UNAVAILABLE) and closes every
  // connection, then joins the server threads. Every blocking point of a server thread is
  // interrupted by shutdown(2) or the stop flag, so the join is bounded; a thread that still has
  // not finished after 5 s is detached (it only touches state it shares ownership of).
  ~TcpStoreServer();

  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  // The bound port (the chosen one when started with port 0).
  int port() const { return port_; }
  // "host:port" of the bound socket, e.g. "127.0.0.1:41234", to hand to TcpStoreClient::Connect.
  std::string address() const { return address_; }

 private:
  TcpStoreServer(std::shared_ptr<internal::TcpStoreServerState> state, int port, std::string address);
  void AcceptLoop();

  std::shared_ptr<internal::TcpStoreServerState> state_;
  const int port_;
  const std::string address_;
  std::thread accept_thread_;
};

class TcpStoreClient final : public engine::Store {
 public:
  // Connects to a TcpStoreServer at "host:port", retrying until `timeout` passes (the server may
  // start after the client). UNAVAILABLE (with the last connect error) when it never answers.
  static absl::StatusOr<std::unique_ptr<TcpStoreClient>> Connect(const std::string& address, absl::Duration timeout);

  ~TcpStoreClient() override;

  // INVALID_ARGUMENT when the key or value exceeds the protocol limits; UNAVAILABLE when the
  // server cannot be reached or drops the connection.
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  // The server waits up to `timeout` (capped at kMaxServerTimeout); the client bounds its own
  // socket wait at `timeout` plus a grace period, so a dead server cannot hang it.
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;

  const std::string& address() const { return address_; }

 private:
  TcpStoreClient(std::string host, std::string port, absl::Duration connect_timeout, int first_fd);

  // Sends `request` (a complete frame) and reads the response frame; returns the response status
  // and, for OK, its body. Retries once on a fresh connection when a pooled connection turns out to
  // be stale (closed before any response byte arrived).
  absl::StatusOr<std::string> Call(const std::string& request, absl::Duration server_timeout);
  absl::StatusOr<int> TakeConnection(absl::Time deadline, bool* reused);
  void ReturnConnection(int fd);

  const std::string host_;
  const std::string port_;
  const std::string address_;
  const absl::Duration connect_timeout_;
  absl::Mutex mu_;
  std::vector<int> idle_fds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dynamiq::bench

#endif  // DQ_BENCH_TCP_STORE_H_

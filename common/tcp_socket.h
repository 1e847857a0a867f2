// Plain TCP socket helpers with deadlines, shared by the rendezvous store of dynamiq-bench's
// processes (bench/tcp_store.h) and the engine's TCP transport (engine/tcp_transport.h): address
// parsing and resolution, a connect that never blocks past its deadline (with retries), and whole
// reads and writes that wait with poll(2) when a non-blocking socket is not ready. Errors are
// absl::Status naming what was being done; socket descriptors are plain ints the caller owns.
#ifndef DQ_COMMON_TCP_SOCKET_H_
#define DQ_COMMON_TCP_SOCKET_H_

#include <netdb.h>
#include <stddef.h>
#include <sys/socket.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace dynamiq::common {

// `what`: strerror(err) (errno err).
absl::Status ErrnoStatus(absl::StatusCode code, absl::string_view what, int err);
// Closes `fd` if it is one (never retried on EINTR).
void CloseFd(int fd);

// Owns a descriptor: closes it unless released.
struct UniqueFd {
  explicit UniqueFd(int f = -1) : fd(f) {}
  UniqueFd(UniqueFd&& other) noexcept : fd(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    reset(other.release());
    return *this;
  }
  ~UniqueFd() { CloseFd(fd); }
  void reset(int f = -1) {
    CloseFd(fd);
    fd = f;
  }
  int release() { return std::exchange(fd, -1); }
  int fd;
};

// "host:port" (or "[v6]:port") -> (host, port); INVALID_ARGUMENT naming the address otherwise.
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& address);

struct AddrInfoDeleter {
  void operator()(addrinfo* ai) const { freeaddrinfo(ai); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;
// getaddrinfo for a stream socket (numeric port; `passive`: for binding). UNAVAILABLE if it fails.
absl::StatusOr<AddrInfoPtr> Resolve(const std::string& host, const std::string& port, bool passive);

// A listening TCP socket (non-blocking, close-on-exec, SO_REUSEADDR) on the first of `host`'s
// addresses that binds; port "0" picks a free one (getsockname tells which). UNAVAILABLE naming
// host:port and the failing call otherwise.
absl::StatusOr<int> ListenOn(const std::string& host, const std::string& port, int backlog);

// "host:port" of an address / of a socket's peer ("?" when unknown).
std::string SockaddrString(const sockaddr_storage& ss);
std::string PeerName(int fd);

// TCP_NODELAY (latency only; a failure is ignored).
void SetNoDelay(int fd);

// Waits until `fd` is ready for `events` or `deadline` passes (InfiniteFuture: no limit); polls
// at least once, so a ready socket is never a timeout. DEADLINE_EXCEEDED names `what`.
absl::Status PollFd(int fd, short events, absl::Time deadline, absl::string_view what);
// Writes all of `data` / reads exactly `n` bytes, waiting for a non-blocking socket until `deadline`.
// UNAVAILABLE when the peer closed or the call failed. `*received` (optional) counts the bytes read,
// to tell a connection closed between messages from one closed in the middle.
absl::Status WriteFull(int fd, absl::string_view data, absl::Time deadline, absl::string_view what);
absl::Status ReadFull(int fd, char* out, size_t n, absl::Time deadline, absl::string_view what,
                      size_t* received = nullptr);

// One non-blocking TCP connection attempt (TCP_NODELAY set; the socket stays non-blocking),
// bounded by `deadline`.
absl::StatusOr<int> ConnectOnce(const std::string& host, const std::string& port, absl::Time deadline);
// ConnectOnce with backoff until `deadline`; UNAVAILABLE "cannot reach <what> at host:port (last
// error: ...)" when it never succeeds.
absl::StatusOr<int> ConnectWithRetry(const std::string& host, const std::string& port, absl::Time deadline,
                                     absl::string_view what);

}  // namespace dynamiq::common

#endif  // DQ_COMMON_TCP_SOCKET_H_

#include "common/tcp_socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace dynamiq::common {

absl::Status ErrnoStatus(absl::StatusCode code, absl::string_view what, int err) {
  return absl::Status(code, absl::StrCat(what, ": ", strerror(err), " (errno ", err, ")"));
}

void CloseFd(int fd) {
  if (fd >= 0) ::close(fd);  // Never retried on EINTR: Linux releases the descriptor regardless.
}

absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& address) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "' is not host:port"));
  }
  std::string host = address.substr(0, colon);
  std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port_number = 0;
  if (host.empty() || !absl::SimpleAtoi(port, &port_number) || port_number < 0 || port_number > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "' is not host:port"));
  }
  return std::make_pair(host, port);
}

absl::StatusOr<AddrInfoPtr> Resolve(const std::string& host, const std::string& port, bool passive) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  int rc;
  do {
    rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &result);
  } while (rc == EAI_SYSTEM && errno == EINTR);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve '", host, ":", port,
                                               "': ", rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc)));
  }
  return AddrInfoPtr(result);
}

std::string SockaddrString(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* sin = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &sin->sin_addr, host, sizeof(host));
    return absl::StrCat(host, ":", ntohs(sin->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &sin6->sin6_addr, host, sizeof(host));
    return absl::StrCat("[", host, "]:", ntohs(sin6->sin6_port));
  }
  return "?";
}

std::string PeerName(int fd) {
  sockaddr_storage ss = {};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  return SockaddrString(ss);
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // Latency only; failure is harmless.
}

absl::Status PollFd(int fd, short events, absl::Time deadline, absl::string_view what) {
  for (;;) {
    // Polls at least once, even past the deadline, so a ready socket is never reported as a timeout.
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
      timeout_ms = static_cast<int>(
          std::min<int64_t>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), 1 << 30));
    }
    pollfd p = {fd, events, 0};
    int rc = poll(&p, 1, timeout_ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(absl::StatusCode::kInternal, absl::StrCat(what, ": poll"), errno);
    }
    if (rc > 0) return absl::OkStatus();  // Readiness or an error: the next recv/send reports which.
    if (absl::Now() >= deadline) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
  }
}

absl::Status WriteFull(int fd, absl::string_view data, absl::Time deadline, absl::string_view what) {
  while (!data.empty()) {
    ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      DQ_RETURN_IF_ERROR(PollFd(fd, POLLOUT, deadline, what));
      continue;
    }
    return ErrnoStatus(absl::StatusCode::kUnavailable, absl::StrCat(what, ": send"), n < 0 ? errno : EPIPE);
  }
  return absl::OkStatus();
}

absl::Status ReadFull(int fd, char* out, size_t n, absl::Time deadline, absl::string_view what, size_t* received) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = recv(fd, out + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
      if (received != nullptr) *received = got;
      continue;
    }
    if (r == 0) return absl::UnavailableError(absl::StrCat(what, ": connection closed by peer"));
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      DQ_RETURN_IF_ERROR(PollFd(fd, POLLIN, deadline, what));
      continue;
    }
    return ErrnoStatus(absl::StatusCode::kUnavailable, absl::StrCat(what, ": recv"), errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ListenOn(const std::string& host, const std::string& port, int backlog) {
  DQ_ASSIGN_OR_RETURN(AddrInfoPtr addrs, Resolve(host, port, /*passive=*/true));
  const std::string where = absl::StrCat(host, ":", port);
  absl::Status last = absl::UnavailableError(absl::StrCat("no address to listen on at ", where));
  for (addrinfo* ai = addrs.get(); ai != nullptr; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last = ErrnoStatus(absl::StatusCode::kUnavailable, "socket", errno);
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      last = ErrnoStatus(absl::StatusCode::kUnavailable, absl::StrCat("bind ", where), errno);
      CloseFd(fd);
      continue;
    }
    if (listen(fd, backlog) != 0) {
      last = ErrnoStatus(absl::StatusCode::kUnavailable, absl::StrCat("listen ", where), errno);
      CloseFd(fd);
      continue;
    }
    return fd;
  }
  return last;
}

absl::StatusOr<int> ConnectOnce(const std::string& host, const std::string& port, absl::Time deadline) {
  DQ_ASSIGN_OR_RETURN(AddrInfoPtr addrs, Resolve(host, port, /*passive=*/false));
  absl::Status last = absl::UnavailableError("no address");
  for (addrinfo* ai = addrs.get(); ai != nullptr; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last = ErrnoStatus(absl::StatusCode::kUnavailable, "socket", errno);
      continue;
    }
    int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno != EINPROGRESS && errno != EINTR) {
      last = ErrnoStatus(absl::StatusCode::kUnavailable, absl::StrCat("connect to ", host, ":", port), errno);
      CloseFd(fd);
      continue;
    }
    if (rc != 0) {
      absl::Status s = PollFd(fd, POLLOUT, deadline, absl::StrCat("connect to ", host, ":", port));
      int err = 0;
      socklen_t len = sizeof(err);
      if (s.ok() && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (!s.ok() || err != 0) {
        last =
            s.ok() ? ErrnoStatus(absl::StatusCode::kUnavailable, absl::StrCat("connect to ", host, ":", port), err) : s;
        CloseFd(fd);
        continue;
      }
    }
    SetNoDelay(fd);
    return fd;
  }
  return last;
}

absl::StatusOr<int> ConnectWithRetry(const std::string& host, const std::string& port, absl::Time deadline,
                                     absl::string_view what) {
  absl::Duration backoff = absl::Milliseconds(10);
  absl::Status last;
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<int> fd = ConnectOnce(host, port, deadline);
    if (fd.ok()) return fd;
    // Keep the most telling error: "refused" says more than the last attempt's "timed out".
    if (last.ok() || !absl::IsDeadlineExceeded(fd.status())) last = fd.status();
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    absl::SleepFor(std::min(backoff, left));
    backoff = std::min(backoff * 2, absl::Milliseconds(200));
  }
  return absl::UnavailableError(
      absl::StrCat("cannot reach ", what, " at ", host, ":", port, " (last error: ", last.message(), ")"));
}

}  // namespace dynamiq::common

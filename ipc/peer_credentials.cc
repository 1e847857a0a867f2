#include "ipc/peer_credentials.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace dynamiq::ipc {
namespace {

constexpr mode_t kSocketMode = S_IRUSR | S_IWUSR;  // 0600

absl::Status SocketErrno(int err, absl::string_view call, absl::string_view path) {
  return absl::ErrnoToStatus(err, absl::StrCat(call, "(", path, ")"));
}

absl::StatusOr<sockaddr_un> MakeAddress(const std::string& path) {
  sockaddr_un addr;
  memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid Unix socket path \"", absl::CEscape(path), "\": must be non-empty, without NUL bytes"));
  }
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrFormat("Unix socket path %s is %d bytes long; the limit is %d", path,
                                                      path.size(), sizeof(addr.sun_path) - 1));
  }
  memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

// Removes `path` if it is a stale socket owned by us; leaves a missing path alone; refuses
// anything else. A connect() probe tells stale from live: nothing listening is ECONNREFUSED.
absl::Status RemoveStaleSocket(const std::string& path, const sockaddr_un& addr) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return SocketErrno(errno, "lstat", path);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::AlreadyExistsError(absl::StrFormat(
        "%s already exists and is not a Unix socket (mode 0%o); refusing to replace it", path, st.st_mode));
  }
  if (st.st_uid != geteuid()) {
    return absl::PermissionDeniedError(
        absl::StrFormat("%s is a socket owned by uid %d, not by this process's uid %d; refusing to replace it", path,
                        st.st_uid, geteuid()));
  }
  const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (probe < 0) return SocketErrno(errno, "socket", path);
  const int rc = connect(probe, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  close(probe);
  // A full backlog (EAGAIN) still means someone is listening.
  if (rc == 0 || err == EAGAIN || err == EINPROGRESS) {
    return absl::AlreadyExistsError(absl::StrCat("a process is already listening on ", path,
                                                 " (another dynamiqd?); stop it or choose another path"));
  }
  if (err == ENOENT) return absl::OkStatus();  // Removed since the lstat.
  if (err != ECONNREFUSED) return SocketErrno(err, "connect (probing for a stale socket)", path);
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return SocketErrno(errno, "unlink (stale socket)", path);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PeerCredentials> GetPeerCredentials(int unix_socket_fd) {
  int domain = 0;
  socklen_t len = sizeof(domain);
  if (getsockopt(unix_socket_fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0) {
    const int err = errno;
    absl::Status status = absl::ErrnoToStatus(err, absl::StrCat("getsockopt(fd ", unix_socket_fd, ", SO_DOMAIN)"));
    // A closed or bogus descriptor is the caller's mistake (abseil maps EBADF to FAILED_PRECONDITION).
    if (err == EBADF) return absl::InvalidArgumentError(status.message());
    return status;
  }
  if (domain != AF_UNIX) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "fd %d is a socket of family %d, not AF_UNIX: it carries no peer credentials", unix_socket_fd, domain));
  }
  ucred cred;
  len = sizeof(cred);
  if (getsockopt(unix_socket_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("getsockopt(fd ", unix_socket_fd, ", SO_PEERCRED)"));
  }
  // An unconnected socket reports pid 0 and the overflow uid.
  if (cred.pid == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("fd ", unix_socket_fd, " has no peer (not connected); no credentials to check"));
  }
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

absl::Status CheckSameUser(const PeerCredentials& peer) {
  const uid_t self = geteuid();
  if (peer.uid == self) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrFormat("peer pid %d runs as uid %d but this process runs as uid %d; only processes of the same user "
                      "may share buffers with it",
                      peer.pid, peer.uid, self));
}

absl::Status CheckPrivateDirectory(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return SocketErrno(errno, "stat", dir);
  if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(dir, " is not a directory"));
  if (st.st_uid != geteuid()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the socket's folder %s belongs to uid %d, not to this process's uid %d: its owner could replace the socket "
        "and receive the workers' connections; use a folder of your own",
        dir, st.st_uid, geteuid()));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the socket's folder %s has mode 0%o, which lets other users rename or replace the socket and receive the "
        "workers' connections; use a folder only its owner can write (run: chmod go-w %s, or choose a folder of your "
        "own)",
        dir, st.st_mode & 07777, dir));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ListenUnixSocket(const std::string& path) {
  DQ_ASSIGN_OR_RETURN(const sockaddr_un addr, MakeAddress(path));
  DQ_RETURN_IF_ERROR(RemoveStaleSocket(path, addr));
  // Bound and listening under a private name first, then linked into place: a worker that finds
  // the file can connect at once (bind() creates the file before listen(), so binding at `path`
  // itself left a moment in which a worker got "Connection refused"). link() also fails with EEXIST
  // instead of replacing a socket another dynamiqd put there meanwhile.
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, std::max<size_t>(slash, 1));
  static std::atomic<uint64_t> counter{0};
  std::string staging =
      absl::StrFormat("%s/.dq%x.%x", dir, static_cast<unsigned>(getpid()), static_cast<unsigned>(counter.fetch_add(1)));
  // A path so long that the private name does not fit is bound in place (the old way).
  const bool staged = MakeAddress(staging).ok();
  if (!staged) staging = path;
  const sockaddr_un staging_addr = *MakeAddress(staging);
  if (staged) unlink(staging.c_str());  // a leftover of a crashed process with the same pid

  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return SocketErrno(errno, "socket", path);
  // Linux creates the socket file with the socket inode's mode minus the umask, so this fchmod
  // makes bind() create it 0600 (or narrower) straight away. The chmod after bind() is what we
  // rely on (portable, and exact): no client can connect before listen() in any case.
  (void)fchmod(fd, kSocketMode);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&staging_addr), sizeof(staging_addr)) != 0) {
    const int err = errno;
    close(fd);
    return SocketErrno(err, "bind", staging);
  }
  // From here on failures remove the files we created.
  auto fail = [&](absl::Status status) {
    unlink(staging.c_str());
    close(fd);
    return status;
  };
  if (chmod(staging.c_str(), kSocketMode) != 0) return fail(SocketErrno(errno, "chmod", staging));
  struct stat st;
  if (lstat(staging.c_str(), &st) != 0) return fail(SocketErrno(errno, "lstat", staging));
  if (!S_ISSOCK(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 07777) != kSocketMode) {
    return fail(absl::InternalError(absl::StrFormat(
        "%s: after bind and chmod the file has mode 0%o and owner uid %d, expected a socket with mode 0600 owned "
        "by uid %d",
        staging, st.st_mode, st.st_uid, geteuid())));
  }
  if (listen(fd, SOMAXCONN) != 0) return fail(SocketErrno(errno, "listen", staging));
  if (!staged) return fd;
  if (link(staging.c_str(), path.c_str()) != 0) {
    const int err = errno;
    if (err == EEXIST) {
      return fail(absl::AlreadyExistsError(absl::StrCat(
          "link(", path, "): the path appeared while replacing a stale socket; is another dynamiqd starting?")));
    }
    return fail(SocketErrno(err, "link", path));
  }
  unlink(staging.c_str());
  return fd;
}

}  // namespace dynamiq::ipc

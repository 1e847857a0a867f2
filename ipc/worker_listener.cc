#include "ipc/worker_listener.h"

#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dynamiq::ipc {

absl::StatusOr<std::unique_ptr<WorkerListener>> WorkerListener::Start(const std::string& path, grpc::Server* server,
                                                                      RejectFn on_reject) {
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    const std::string dir = path.substr(0, slash);
    if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::UnavailableError(absl::StrCat("cannot create ", dir, ": ", std::strerror(errno)));
    }
    if (absl::Status s = CheckPrivateDirectory(dir); !s.ok()) {
      return common::Annotate(s, absl::StrCat("refusing --worker_socket ", path));
    }
  }
  DQ_ASSIGN_OR_RETURN(int fd, ListenUnixSocket(path));
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("lstat ", path));
  }
  return std::unique_ptr<WorkerListener>(
      new WorkerListener(path, fd, st.st_dev, st.st_ino, server, std::move(on_reject)));
}

WorkerListener::WorkerListener(std::string path, int listen_fd, dev_t dev, ino_t ino, grpc::Server* server,
                               RejectFn on_reject)
    : path_(std::move(path)),
      listen_fd_(listen_fd),
      dev_(dev),
      ino_(ino),
      server_(server),
      on_reject_(std::move(on_reject)) {
  thread_ = std::thread([this] { AcceptLoop(); });
}

WorkerListener::~WorkerListener() {
  stop_ = true;
  thread_.join();
  close(listen_fd_);
  // Only the socket this listener created: whatever else is at the path now is not ours to remove.
  struct stat st;
  if (lstat(path_.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_) unlink(path_.c_str());
}

std::optional<PeerCredentials> WorkerListener::CredentialsOf(const std::string& grpc_peer) const {
  int fd;
  if (!absl::StartsWith(grpc_peer, "fd:") || !absl::SimpleAtoi(grpc_peer.substr(3), &fd)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return std::nullopt;
  return it->second;
}

void WorkerListener::AcceptLoop() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    // Short timeout: the destructor sets stop_ and waits for this loop to notice.
    if (poll(&p, 1, 100) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;  // the peer went away, or EMFILE: retried on the next poll
    absl::StatusOr<PeerCredentials> peer = GetPeerCredentials(fd);
    absl::Status ok = peer.ok() ? CheckSameUser(*peer) : peer.status();
    if (!ok.ok()) {
      close(fd);
      ++rejected_;
      if (on_reject_) on_reject_(ok);
      continue;
    }
    {
      // A descriptor number is reused only after gRPC closed the previous connection on it.
      absl::MutexLock lock(&mu_);
      by_fd_[fd] = *peer;
    }
    ++accepted_;
    grpc::AddInsecureChannelFromFd(server_, fd);
  }
}

}  // namespace dynamiq::ipc

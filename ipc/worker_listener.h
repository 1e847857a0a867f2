// WorkerListener: dynamiqd's worker socket. Listens on a Unix socket of mode 0600
// (ListenUnixSocket), accepts connections itself, checks each peer's SO_PEERCRED credentials
// (same uid as the daemon, CheckSameUser) and only then hands the connection to the gRPC worker
// server (grpc::AddInsecureChannelFromFd). A refused peer is disconnected before it can send a
// byte of gRPC, and reported through `on_reject`.
//
// gRPC names a connection added this way "fd:<n>" (ServerContext::peer()); CredentialsOf() maps
// that name back to the credentials checked at accept time, which is how the daemon learns the pid
// of the worker process it serves (to notice when it dies).
//
// The socket's folder must be the daemon user's own and writable by nobody else (CheckPrivateDirectory):
// otherwise another local user could rename the socket and bind their own in its place, then
// receive the workers' connections. A missing folder is created with mode 0700.
//
// Thread-safe. The destructor stops accepting, closes the listening socket and unlinks its path if
// it is still the socket this listener created (same inode); connections already handed to gRPC
// belong to the server.
#ifndef DQ_IPC_WORKER_LISTENER_H_
#define DQ_IPC_WORKER_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "ipc/peer_credentials.h"

namespace grpc {
class Server;
}

namespace dynamiq::ipc {

class WorkerListener {
 public:
  using RejectFn = std::function<void(const absl::Status&)>;

  // Creates the socket's directory (mode 0700) if missing, checks that it is private, listens on
  // `path` and starts accepting into `server` (which must outlive this object and be started).
  // Errors: FAILED_PRECONDITION for a folder others can write (CheckPrivateDirectory), else see
  // ListenUnixSocket.
  static absl::StatusOr<std::unique_ptr<WorkerListener>> Start(const std::string& path, grpc::Server* server,
                                                               RejectFn on_reject = nullptr);
  ~WorkerListener();
  WorkerListener(const WorkerListener&) = delete;
  WorkerListener& operator=(const WorkerListener&) = delete;

  // The credentials of the connection gRPC calls `grpc_peer` ("fd:<n>"); nullopt for other names.
  std::optional<PeerCredentials> CredentialsOf(const std::string& grpc_peer) const;
  uint64_t accepted() const { return accepted_.load(); }
  uint64_t rejected() const { return rejected_.load(); }

 private:
  WorkerListener(std::string path, int listen_fd, dev_t dev, ino_t ino, grpc::Server* server, RejectFn on_reject);
  void AcceptLoop();

  const std::string path_;
  const int listen_fd_;
  // The socket file this listener created: only that one is unlinked at the end.
  const dev_t dev_;
  const ino_t ino_;
  grpc::Server* const server_;
  const RejectFn on_reject_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> rejected_{0};
  mutable absl::Mutex mu_;
  std::map<int, PeerCredentials> by_fd_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_WORKER_LISTENER_H_

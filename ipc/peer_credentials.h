// PeerCredentials: who is on the other end of a Unix socket, and the listening side of dynamiqd's
// worker socket (issue 4: "Worker API ... on a Unix socket (mode 0600)").
//
// The worker socket is guarded twice: the socket file has mode 0600, so only its owner (and root)
// can connect, and the daemon checks every accepted connection with GetPeerCredentials() +
// CheckSameUser(), so a worker never maps a buffer of a daemon run by another user and vice versa.
// SO_PEERCRED reports the credentials the peer had when it called connect() (or socketpair()); the
// kernel fills them in, so a peer cannot forge them.
//
// Thread-safety: every function here is thread-safe (no shared state; ListenUnixSocket() does not
// touch the process umask).
#ifndef DQ_IPC_PEER_CREDENTIALS_H_
#define DQ_IPC_PEER_CREDENTIALS_H_

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dynamiq::ipc {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// Reads SO_PEERCRED from a connected AF_UNIX socket (an accepted connection, a connected client
// socket, or one end of a socketpair). INVALID_ARGUMENT for a bad descriptor, a non-socket or a
// socket of another family (TCP sockets have no peer credentials); FAILED_PRECONDITION for a
// socket that has no peer (never connected).
absl::StatusOr<PeerCredentials> GetPeerCredentials(int unix_socket_fd);

// OK if the peer runs as this process's effective uid; otherwise PERMISSION_DENIED naming the
// peer's pid and uid and ours.
absl::Status CheckSameUser(const PeerCredentials& peer);

// OK if `dir` is a directory owned by this process's effective uid that neither group nor others can
// write: nobody else can then rename, replace or remove a socket in it. Otherwise
// FAILED_PRECONDITION saying what is wrong and what to do (or the stat error).
absl::Status CheckPrivateDirectory(const std::string& dir);

// Creates a listening SOCK_STREAM Unix socket at `path` (close-on-exec) whose file has mode
// exactly 0600, owned by this process's effective uid, whatever the umask: the mode is set
// before listen(), so nobody can connect while it is wider, and verified with lstat(). The file
// appears at `path` only once the socket listens (it is bound under a private name in the same
// directory and linked into place), so whoever finds it can connect.
//
// An existing file at `path` is replaced only if it is a stale socket of ours (nothing accepts
// connections on it, which is what a crashed daemon leaves behind). A live socket or anything that
// is not a socket is ALREADY_EXISTS; a socket owned by another uid is PERMISSION_DENIED; a path
// that does not fit sockaddr_un (107 bytes) is INVALID_ARGUMENT. The parent directory must exist.
//
// The caller owns the returned descriptor: it closes it and unlinks `path` on shutdown.
absl::StatusOr<int> ListenUnixSocket(const std::string& path);

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_PEER_CREDENTIALS_H_

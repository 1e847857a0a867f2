#include "ipc/peer_credentials.h"

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::ipc {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(30);
constexpr uid_t kNobody = 65534;

// Runs `body` in a fork()ed child that exits with its return value (never returning into gtest).
pid_t ForkChild(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  return pid;
}

// Waits at most `timeout` for `pid`; kills it if it overruns. Returns its exit code, or -1 if it
// was killed or died from a signal.
int WaitChild(pid_t pid, absl::Duration timeout = kTimeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (true) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return -1;
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// accept() with a bounded wait; -1 on timeout or error.
int AcceptWithin(int listen_fd, absl::Duration timeout = kTimeout) {
  pollfd p{listen_fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1) return -1;
  return accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
}

// A connected client socket, or -1 with errno set.
int ConnectTo(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

// A bound (not listening) Unix socket at `path` with the file mode `mode`; -1 on error.
int BindRawSocket(const std::string& path, mode_t mode) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 || chmod(path.c_str(), mode) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

mode_t FileMode(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return 0;
  return st.st_mode;
}

class PeerCredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dq-peer-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr) << strerror(errno);
    dir_ = tmpl;
    path_ = dir_ + "/worker.sock";
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::string dir_;
  std::string path_;
};

TEST_F(PeerCredentialsTest, SocketPairReportsThisProcess) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  for (int fd : fds) {
    absl::StatusOr<PeerCredentials> cred = GetPeerCredentials(fd);
    ASSERT_THAT(cred, IsOk());
    EXPECT_EQ(cred->pid, getpid());
    EXPECT_EQ(cred->uid, geteuid());
    EXPECT_EQ(cred->gid, getegid());
    DQ_EXPECT_OK(CheckSameUser(*cred));
  }
  close(fds[0]);
  close(fds[1]);
}

TEST_F(PeerCredentialsTest, ListeningSocketReportsConnectingProcess) {
  absl::StatusOr<int> listener = ListenUnixSocket(path_);
  ASSERT_THAT(listener, IsOk());
  const int client = ConnectTo(path_);
  ASSERT_GE(client, 0) << strerror(errno);
  const int conn = AcceptWithin(*listener);
  ASSERT_GE(conn, 0) << strerror(errno);

  absl::StatusOr<PeerCredentials> server_view = GetPeerCredentials(conn);
  ASSERT_THAT(server_view, IsOk());
  EXPECT_EQ(server_view->pid, getpid());
  EXPECT_EQ(server_view->uid, geteuid());
  EXPECT_EQ(server_view->gid, getegid());
  DQ_EXPECT_OK(CheckSameUser(*server_view));
  // The client sees the listener's credentials (also this process).
  absl::StatusOr<PeerCredentials> client_view = GetPeerCredentials(client);
  ASSERT_THAT(client_view, IsOk());
  EXPECT_EQ(client_view->pid, getpid());
  EXPECT_EQ(client_view->uid, geteuid());
  for (int fd : {conn, client, *listener}) close(fd);
}

TEST_F(PeerCredentialsTest, ForkedWorkerIsReportedWithItsPid) {
  absl::StatusOr<int> listener = ListenUnixSocket(path_);
  ASSERT_THAT(listener, IsOk());
  const std::string path = path_;
  const pid_t child = ForkChild([&]() -> int {
    const int fd = ConnectTo(path);
    if (fd < 0) return 10;
    // Hold the connection until the daemon side closes it (bounded).
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kTimeout)));
    return 0;
  });
  ASSERT_GT(child, 0);
  const int conn = AcceptWithin(*listener);
  EXPECT_GE(conn, 0) << strerror(errno);
  if (conn >= 0) {
    absl::StatusOr<PeerCredentials> cred = GetPeerCredentials(conn);
    ASSERT_THAT(cred, IsOk());
    EXPECT_EQ(cred->pid, child);
    EXPECT_EQ(cred->uid, geteuid());
    DQ_EXPECT_OK(CheckSameUser(*cred));
    close(conn);
  }
  EXPECT_EQ(WaitChild(child), 0);
  close(*listener);
}

TEST_F(PeerCredentialsTest, SocketFileIsExactly0600WhateverTheUmask) {
  for (mode_t mask : {mode_t{0}, mode_t{0022}, mode_t{0077}, mode_t{0277}}) {
    const mode_t old = umask(mask);
    absl::StatusOr<int> listener = ListenUnixSocket(path_);
    umask(old);
    ASSERT_THAT(listener, IsOk()) << "umask 0" << std::oct << mask;
    const mode_t mode = FileMode(path_);
    EXPECT_TRUE(S_ISSOCK(mode));
    EXPECT_EQ(mode & 07777, 0600u) << "umask 0" << std::oct << mask;
    struct stat st;
    ASSERT_EQ(lstat(path_.c_str(), &st), 0);
    EXPECT_EQ(st.st_uid, geteuid());
    close(*listener);
    unlink(path_.c_str());
  }
}

TEST_F(PeerCredentialsTest, ReplacesStaleSocket) {
  // A crashed daemon's socket: bound (once listening), then closed without unlink.
  const int old_fd = BindRawSocket(path_, 0600);
  ASSERT_GE(old_fd, 0) << strerror(errno);
  ASSERT_EQ(listen(old_fd, 1), 0);
  close(old_fd);
  ASSERT_TRUE(S_ISSOCK(FileMode(path_)));

  absl::StatusOr<int> listener = ListenUnixSocket(path_);
  ASSERT_THAT(listener, IsOk());
  const int client = ConnectTo(path_);
  EXPECT_GE(client, 0) << strerror(errno);
  if (client >= 0) close(client);
  close(*listener);
}

// The file appears only once the socket listens: a worker polling for it (as one started together
// with dynamiqd does) connects at its first try, and nothing is left in the directory but the
// socket.
TEST_F(PeerCredentialsTest, TheSocketFileAppearsOnlyOnceItAcceptsConnections) {
  for (int round = 0; round < 30; ++round) {
    std::atomic<int> refused{0};
    std::thread watcher([&] {
      const absl::Time stop = absl::Now() + absl::Seconds(5);
      while (absl::Now() < stop) {
        if (!S_ISSOCK(FileMode(path_))) continue;
        const int client = ConnectTo(path_);
        if (client < 0) {
          if (errno == ECONNREFUSED) ++refused;
        } else {
          close(client);
        }
        return;
      }
    });
    absl::StatusOr<int> listener = ListenUnixSocket(path_);
    watcher.join();
    ASSERT_THAT(listener, IsOk());
    EXPECT_EQ(refused.load(), 0) << "round " << round << ": the path existed before the socket listened";
    std::vector<std::string> entries;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) entries.push_back(e.path().filename().string());
    EXPECT_THAT(entries, ::testing::ElementsAre("worker.sock"));
    close(*listener);
    unlink(path_.c_str());
  }
}

TEST_F(PeerCredentialsTest, RefusesLiveSocket) {
  absl::StatusOr<int> first = ListenUnixSocket(path_);
  ASSERT_THAT(first, IsOk());
  EXPECT_THAT(ListenUnixSocket(path_),
              StatusIs(absl::StatusCode::kAlreadyExists, AllOf(HasSubstr("already listening"), HasSubstr(path_))));
  // The first daemon's socket is untouched.
  const int client = ConnectTo(path_);
  EXPECT_GE(client, 0) << strerror(errno);
  const int conn = AcceptWithin(*first);
  EXPECT_GE(conn, 0);
  for (int fd : {client, conn, *first}) {
    if (fd >= 0) close(fd);
  }
}

TEST_F(PeerCredentialsTest, RefusesToClobberNonSockets) {
  {
    std::ofstream file(path_);
    file << "precious";
  }
  EXPECT_THAT(ListenUnixSocket(path_),
              StatusIs(absl::StatusCode::kAlreadyExists, AllOf(HasSubstr("not a Unix socket"), HasSubstr(path_))));
  std::ifstream file(path_);
  std::string contents;
  file >> contents;
  EXPECT_EQ(contents, "precious");

  const std::string subdir = dir_ + "/subdir";
  ASSERT_EQ(mkdir(subdir.c_str(), 0700), 0);
  EXPECT_THAT(ListenUnixSocket(subdir), StatusIs(absl::StatusCode::kAlreadyExists));

  const std::string link = dir_ + "/link";
  ASSERT_EQ(symlink(path_.c_str(), link.c_str()), 0);
  EXPECT_THAT(ListenUnixSocket(link), StatusIs(absl::StatusCode::kAlreadyExists));
}

TEST_F(PeerCredentialsTest, RejectsBadPaths) {
  EXPECT_THAT(ListenUnixSocket(""), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ListenUnixSocket(dir_ + "/" + std::string(200, 's')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("107")));
  EXPECT_THAT(ListenUnixSocket(std::string("/tmp/nul\0byte", 13)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ListenUnixSocket(dir_ + "/missing/worker.sock"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("bind")));
}

TEST_F(PeerCredentialsTest, GetPeerCredentialsRejectsWhatIsNotAConnectedUnixSocket) {
  EXPECT_THAT(GetPeerCredentials(-1), StatusIs(absl::StatusCode::kInvalidArgument));
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  EXPECT_THAT(GetPeerCredentials(pipe_fds[0]), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("SO_DOMAIN")));
  close(pipe_fds[0]);
  close(pipe_fds[1]);

  const int tcp = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(tcp, 0);
  EXPECT_THAT(GetPeerCredentials(tcp), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not AF_UNIX")));
  close(tcp);

  const int unconnected = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(unconnected, 0);
  EXPECT_THAT(GetPeerCredentials(unconnected), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no peer")));
  close(unconnected);
}

TEST_F(PeerCredentialsTest, CheckSameUserNamesBothUids) {
  const uid_t self = geteuid();
  DQ_EXPECT_OK(CheckSameUser(PeerCredentials{1234, self, getegid()}));
  const uid_t other = self == 4321 ? 4322 : 4321;
  EXPECT_THAT(CheckSameUser(PeerCredentials{1234, other, 0}),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       AllOf(HasSubstr(absl::StrCat("uid ", other)), HasSubstr(absl::StrCat("uid ", self)),
                             HasSubstr("pid 1234"))));
}

// As root, a child that drops to "nobody" plays a worker of another user.
TEST_F(PeerCredentialsTest, OtherUserCannotConnectToWorkerSocket) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a child as another uid";
  ASSERT_EQ(chmod(dir_.c_str(), 0755), 0);  // The directory does not stop them; the socket mode must.
  absl::StatusOr<int> listener = ListenUnixSocket(path_);
  ASSERT_THAT(listener, IsOk());
  const std::string path = path_;
  const pid_t child = ForkChild([&]() -> int {
    if (setgid(kNobody) != 0 || setuid(kNobody) != 0) return 10;
    const int fd = ConnectTo(path);
    if (fd >= 0) return 11;
    return errno == EACCES ? 0 : 12;
  });
  ASSERT_GT(child, 0);
  EXPECT_EQ(WaitChild(child), 0);
  close(*listener);
}

TEST_F(PeerCredentialsTest, OtherUserIsDeniedByTheUidCheck) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a child as another uid";
  // A careless listener (mode 0777, not ListenUnixSocket) lets anyone connect; the uid check
  // still refuses the peer.
  ASSERT_EQ(chmod(dir_.c_str(), 0755), 0);
  const int listener = BindRawSocket(path_, 0777);
  ASSERT_GE(listener, 0) << strerror(errno);
  ASSERT_EQ(listen(listener, 4), 0);
  const std::string path = path_;
  const pid_t child = ForkChild([&]() -> int {
    if (setgid(kNobody) != 0 || setuid(kNobody) != 0) return 10;
    const int fd = ConnectTo(path);
    if (fd < 0) return 11;
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kTimeout)));
    return 0;
  });
  ASSERT_GT(child, 0);
  const int conn = AcceptWithin(listener);
  EXPECT_GE(conn, 0);
  if (conn >= 0) {
    absl::StatusOr<PeerCredentials> cred = GetPeerCredentials(conn);
    ASSERT_THAT(cred, IsOk());
    EXPECT_EQ(cred->pid, child);
    EXPECT_EQ(cred->uid, kNobody);
    EXPECT_EQ(cred->gid, kNobody);
    EXPECT_THAT(CheckSameUser(*cred),
                StatusIs(absl::StatusCode::kPermissionDenied,
                         AllOf(HasSubstr(absl::StrCat("pid ", child)), HasSubstr("uid 65534"), HasSubstr("uid 0"))));
    close(conn);
  }
  EXPECT_EQ(WaitChild(child), 0);
  close(listener);
}

}  // namespace
}  // namespace dynamiq::ipc

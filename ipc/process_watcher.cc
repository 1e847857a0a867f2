#include "ipc/process_watcher.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dynamiq::ipc {
namespace {

int PidfdOpen(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

ProcessWatcher::ProcessWatcher() {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  thread_ = std::thread([this] { Loop(); });
  loop_thread_ = thread_.get_id();
}

ProcessWatcher::~ProcessWatcher() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  thread_.join();
  for (auto& [handle, e] : entries_) close(e.pidfd);
  close(wake_fd_);
}

absl::StatusOr<uint64_t> ProcessWatcher::Watch(pid_t pid, std::function<void()> on_exit) {
  if (pid <= 0) return absl::InvalidArgumentError(absl::StrCat("no process has pid ", pid));
  const int fd = PidfdOpen(pid);
  if (fd < 0) {
    if (errno == ESRCH) return absl::NotFoundError(absl::StrCat("process ", pid, " does not exist"));
    return absl::InternalError(absl::StrCat("pidfd_open(", pid, "): ", std::strerror(errno)));
  }
  uint64_t handle;
  {
    absl::MutexLock lock(&mu_);
    handle = next_handle_++;
    entries_[handle] = Entry{fd, std::move(on_exit)};
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  return handle;
}

void ProcessWatcher::Unwatch(uint64_t handle) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(handle);
  if (it != entries_.end()) {
    close(it->second.pidfd);
    entries_.erase(it);
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));  // stop polling the closed descriptor
  }
  if (std::this_thread::get_id() == loop_thread_) return;  // called from the callback itself
  auto not_running = [this, handle]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ != handle; };
  mu_.Await(absl::Condition(&not_running));
}

void ProcessWatcher::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> handles;
  while (true) {
    fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
    handles.assign(1, 0);
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      for (const auto& [handle, e] : entries_) {
        fds.push_back(pollfd{e.pidfd, POLLIN, 0});
        handles.push_back(handle);
      }
    }
    // The timeout only bounds how long a missed wake-up could delay a change; wake_fd_ is the
    // normal path.
    if (poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR) return;
    if (fds[0].revents & POLLIN) {
      uint64_t drained;
      (void)!read(wake_fd_, &drained, sizeof(drained));
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      std::function<void()> callback;
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
        auto it = entries_.find(handles[i]);
        if (it == entries_.end()) continue;  // unwatched meanwhile
        callback = std::move(it->second.on_exit);
        close(it->second.pidfd);
        entries_.erase(it);
        running_ = handles[i];
      }
      callback();
      absl::MutexLock lock(&mu_);
      running_ = 0;
    }
  }
}

}  // namespace dynamiq::ipc

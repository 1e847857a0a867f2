#include "ipc/process_watcher.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::ipc {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;

pid_t SpawnSleeper() {
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sleep", "sleep", "30", static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

TEST(ProcessWatcherTest, CallsBackPromptlyWhenTheProcessExits) {
  absl::Notification exited;  // outlives the watcher's thread
  ProcessWatcher watcher;
  const pid_t pid = SpawnSleeper();
  ASSERT_GT(pid, 0);
  ASSERT_THAT(watcher.Watch(pid, [&] { exited.Notify(); }), IsOk());
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(exited.HasBeenNotified());
  kill(pid, SIGKILL);
  EXPECT_TRUE(exited.WaitForNotificationWithTimeout(absl::Seconds(5)));
  waitpid(pid, nullptr, 0);
}

TEST(ProcessWatcherTest, UnwatchedProcessesDoNotCallBack) {
  std::atomic<int> calls{0};  // outlives the watcher's thread
  ProcessWatcher watcher;
  const pid_t pid = SpawnSleeper();
  ASSERT_GT(pid, 0);
  auto handle = watcher.Watch(pid, [&] { ++calls; });
  ASSERT_THAT(handle, IsOk());
  watcher.Unwatch(*handle);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(calls.load(), 0);
}

TEST(ProcessWatcherTest, ManyWatchesFireIndependently) {
  constexpr int kProcesses = 4;
  pid_t pids[kProcesses];
  // Before the watcher: its thread may still call back for the processes killed at the end, until
  // the watcher is destroyed (first).
  std::atomic<int> calls[kProcesses] = {};
  ProcessWatcher watcher;
  for (int i = 0; i < kProcesses; ++i) {
    pids[i] = SpawnSleeper();
    ASSERT_GT(pids[i], 0);
    ASSERT_THAT(watcher.Watch(pids[i], [&calls, i] { ++calls[i]; }), IsOk());
  }
  kill(pids[1], SIGKILL);
  waitpid(pids[1], nullptr, 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (calls[1].load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(calls[0].load() + calls[2].load() + calls[3].load(), 0);
  EXPECT_EQ(calls[1].load(), 1);
  for (int i : {0, 2, 3}) {
    kill(pids[i], SIGKILL);
    waitpid(pids[i], nullptr, 0);
  }
}

TEST(ProcessWatcherTest, MissingProcessIsNotFound) {
  ProcessWatcher watcher;
  const pid_t pid = SpawnSleeper();
  ASSERT_GT(pid, 0);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);  // reaped: the pid no longer names a process
  EXPECT_THAT(watcher.Watch(pid, [] {}), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(watcher.Watch(-1, [] {}), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dynamiq::ipc

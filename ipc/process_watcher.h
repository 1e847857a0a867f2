// ProcessWatcher: calls back when a watched process exits. dynamiqd watches every registered
// worker's process (its pid comes from SO_PEERCRED of the worker's connection), so a worker that
// dies without unregistering is removed at once: its queued collectives fail naming it, its shared
// memory is released, and its local rank can register again.
//
// Uses pidfds (pidfd_open, Linux >= 5.3), which refer to one process and not to a recyclable pid
// number, so a pid reused by another process is never mistaken for the worker.
//
// Thread-safe. Callbacks run on the watcher's own thread, one at a time, without internal locks
// held; they may call Watch/Unwatch. The destructor stops the thread without running callbacks.
#ifndef DQ_IPC_PROCESS_WATCHER_H_
#define DQ_IPC_PROCESS_WATCHER_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace dynamiq::ipc {

class ProcessWatcher {
 public:
  ProcessWatcher();
  ~ProcessWatcher();
  ProcessWatcher(const ProcessWatcher&) = delete;
  ProcessWatcher& operator=(const ProcessWatcher&) = delete;

  // Calls `on_exit` once when process `pid` exits (at once if it already has). Returns a handle
  // for Unwatch. NOT_FOUND if no such process exists; INTERNAL for other pidfd_open failures.
  absl::StatusOr<uint64_t> Watch(pid_t pid, std::function<void()> on_exit);
  // Cancels a watch (no-op if it already fired or is unknown). After Unwatch returns, its callback
  // neither runs nor is running, unless Unwatch is called from that callback itself.
  void Unwatch(uint64_t handle);

 private:
  struct Entry {
    int pidfd = -1;
    std::function<void()> on_exit;
  };
  void Loop();

  absl::Mutex mu_;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t running_ ABSL_GUARDED_BY(mu_) = 0;  // handle whose callback runs now (0: none)
  std::thread::id loop_thread_;
  int wake_fd_ = -1;  // eventfd: wakes the loop when the set of watches changes
  std::thread thread_;
};

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_PROCESS_WATCHER_H_

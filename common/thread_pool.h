// ThreadPool: a fixed set of threads that help their callers run one loop's independent ranges
// concurrently (ParallelFor). Made once by its owner (the daemon's CPU data path, a benchmark) and
// never resized: no thread is created per call. The calling thread is one of the pool's threads:
// a pool of `threads` starts threads - 1 workers, and a pool of 1 starts none and runs every loop
// on the caller.
//
// Thread-safe: any number of threads may call ParallelFor at the same time (each call's ranges
// are queued in call order and the workers share them out); a call made from inside another
// call's fn completes too, since its caller works through its own ranges whatever the workers do.
// The destructor joins the workers; no call may be running then.
#ifndef DQ_COMMON_THREAD_POOL_H_
#define DQ_COMMON_THREAD_POOL_H_

#include <stddef.h>
#include <stdint.h>

#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace dynamiq::common {

class ThreadPool {
 public:
  // `threads` >= 1 (smaller values count as 1), the caller's included.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  static constexpr size_t kRangesPerThread = 4;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) once for each of up to kRangesPerThread * threads() consecutive ranges
  // that together cover [0, n), each at least `min_range` long (one range, on this thread, when
  // n < 2 * min_range), and returns when every call has returned. Threads claim ranges as they
  // become free (a thread that is descheduled holds up one small range, not a 1/threads share).
  // Which thread runs which range is unspecified: `fn` must give the same result for any split.
  void ParallelFor(size_t n, size_t min_range, absl::FunctionRef<void(size_t, size_t)> fn);

  // ParallelFor calls so far that were split into more than one range.
  uint64_t split_calls() const;

 private:
  struct Loop;
  void WorkerMain();
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }
  // Claims the next range of `loop` (the front of the queue unless given) and runs it.
  void RunOne(Loop* loop) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::deque<Loop*> queue_ ABSL_GUARDED_BY(mu_);  // loops with unclaimed ranges, oldest first
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t split_calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> workers_;
};

// The number of CPUs this process may run on (its affinity mask; at least 1).
int AvailableCpus();

// The most threads a pool given by a flag may have, and the check of such a flag's value
// (INVALID_ARGUMENT "<flag> must be in [1, 256], got N").
inline constexpr int kMaxPoolThreads = 256;
absl::Status CheckPoolThreads(absl::string_view flag, int threads);

}  // namespace dynamiq::common

#endif  // DQ_COMMON_THREAD_POOL_H_

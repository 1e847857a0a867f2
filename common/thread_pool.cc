#include "common/thread_pool.h"

#include <sched.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace dynamiq::common {

struct ThreadPool::Loop {
  Loop(size_t n, size_t ranges, absl::FunctionRef<void(size_t, size_t)> fn) : n(n), ranges(ranges), fn(fn) {}
  const size_t n;
  const size_t ranges;
  const absl::FunctionRef<void(size_t, size_t)> fn;
  bool Done() const { return finished == ranges; }
  size_t claimed = 0;  // guarded by the pool's mu_, as is `finished`
  size_t finished = 0;
};

ThreadPool::ThreadPool(int threads) {
  const int workers = std::max(threads, 1) - 1;
  workers_.reserve(static_cast<size_t>(workers));
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerMain(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunOne(Loop* loop) {
  const size_t r = loop->claimed++;
  if (loop->claimed == loop->ranges) queue_.erase(std::find(queue_.begin(), queue_.end(), loop));
  // Range r of `ranges` near-equal ones; each is at least min_range long (ranges <= n / min_range).
  const size_t begin = loop->n * r / loop->ranges, end = loop->n * (r + 1) / loop->ranges;
  mu_.Unlock();
  loop->fn(begin, end);
  mu_.Lock();
  ++loop->finished;  // the loop's owner may return (and free it) as soon as mu_ is released
}

void ThreadPool::WorkerMain() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(this, &ThreadPool::HasWorkOrStop));
    if (queue_.empty()) return;  // stopping, and nothing left to help with
    RunOne(queue_.front());
  }
}

void ThreadPool::ParallelFor(size_t n, size_t min_range, absl::FunctionRef<void(size_t, size_t)> fn) {
  if (workers_.empty()) {
    if (n > 0) fn(0, n);
    return;
  }
  const size_t ranges = std::min(kRangesPerThread * (workers_.size() + 1), n / std::max<size_t>(min_range, 1));
  if (ranges <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  Loop loop(n, ranges, fn);
  absl::MutexLock lock(&mu_);
  queue_.push_back(&loop);
  ++split_calls_;
  // This thread works through its own ranges: the call completes even when every worker is busy.
  while (loop.claimed < loop.ranges) RunOne(&loop);
  mu_.Await(absl::Condition(&loop, &Loop::Done));
}

uint64_t ThreadPool::split_calls() const {
  absl::MutexLock lock(&mu_);
  return split_calls_;
}

absl::Status CheckPoolThreads(absl::string_view flag, int threads) {
  if (threads >= 1 && threads <= kMaxPoolThreads) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, " must be in [1, ", kMaxPoolThreads, "], got ", threads));
}

int AvailableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return count;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace dynamiq::common

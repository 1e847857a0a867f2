// ThreadPool (common/thread_pool.h): ParallelFor covers every index once in ranges of the promised
// size, really runs them at the same time, and stays correct with concurrent and nested callers.
#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dynamiq::common {
namespace {

// The ranges one ParallelFor call made, in order.
std::vector<std::pair<size_t, size_t>> Ranges(ThreadPool& pool, size_t n, size_t min_range) {
  absl::Mutex mu;
  std::vector<std::pair<size_t, size_t>> ranges;
  pool.ParallelFor(n, min_range, [&](size_t begin, size_t end) {
    absl::MutexLock lock(&mu);
    ranges.emplace_back(begin, end);
  });
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

TEST(ThreadPoolTest, RangesCoverEveryIndexOnceAndAreLongEnough) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{5}, size_t{127}, size_t{128}, size_t{1000}, size_t{100003}}) {
      for (size_t min_range : {size_t{1}, size_t{64}}) {
        SCOPED_TRACE(testing::Message() << threads << " threads, n " << n << ", min_range " << min_range);
        const auto ranges = Ranges(pool, n, min_range);
        if (n == 0) {
          EXPECT_TRUE(ranges.empty());
          continue;
        }
        ASSERT_FALSE(ranges.empty());
        EXPECT_LE(ranges.size(), ThreadPool::kRangesPerThread * threads);
        if (threads == 1 || n < 2 * min_range) {
          EXPECT_EQ(ranges.size(), 1u);
        }
        size_t next = 0;
        for (const auto& [begin, end] : ranges) {
          EXPECT_EQ(begin, next);
          EXPECT_GT(end, begin);
          if (ranges.size() > 1) {
            EXPECT_GE(end - begin, min_range);
          }
          next = end;
        }
        EXPECT_EQ(next, n);
      }
    }
  }
}

TEST(ThreadPoolTest, SmallLoopsRunOnTheCallingThreadAndAreNotCountedAsSplit) {
  ThreadPool pool(4);
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  pool.ParallelFor(127, 64, [&](size_t, size_t) { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, caller);
  EXPECT_EQ(pool.split_calls(), 0u);
  pool.ParallelFor(128, 64, [](size_t, size_t) {});
  EXPECT_EQ(pool.split_calls(), 1u);
}

TEST(ThreadPoolTest, RangesRunConcurrentlyOnAsManyThreadsAsThePoolHas) {
  // Every range waits until all four have started: only four threads at once get past it.
  constexpr int kThreads = 4;
  ThreadPool pool(kThreads);
  absl::Mutex mu;
  int started = 0;
  bool all_met = true;
  std::set<std::thread::id> ids;
  pool.ParallelFor(kThreads, 1, [&](size_t, size_t) {
    absl::MutexLock lock(&mu);
    ++started;
    ids.insert(std::this_thread::get_id());
    auto everyone = [&] { return started == kThreads; };
    if (!mu.AwaitWithTimeout(absl::Condition(&everyone), absl::Seconds(20))) all_met = false;
  });
  EXPECT_TRUE(all_met) << "only " << started << " ranges ran at once";
  EXPECT_EQ(ids.size(), static_cast<size_t>(kThreads));
}

TEST(ThreadPoolTest, ConcurrentAndNestedCallersAllComplete) {
  ThreadPool pool(3);
  constexpr size_t kN = 1000;
  std::vector<std::thread> callers;
  std::atomic<int> wrong{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int rep = 0; rep < 50; ++rep) {
        std::vector<std::atomic<int>> hits(kN);
        pool.ParallelFor(kN / 10, 2, [&](size_t begin, size_t end) {
          for (size_t i = begin; i < end; ++i) {
            // Each outer index covers ten inner ones, through a nested call on the same pool.
            pool.ParallelFor(10, 1, [&](size_t b, size_t e) {
              for (size_t k = b; k < e; ++k) hits[i * 10 + k].fetch_add(1);
            });
          }
        });
        for (const auto& h : hits) {
          if (h.load() != 1) wrong.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(ThreadPoolTest, AvailableCpusIsAtLeastOne) { EXPECT_GE(AvailableCpus(), 1); }

}  // namespace
}  // namespace dynamiq::common

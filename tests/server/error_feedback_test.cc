#include "server/error_feedback.h"

#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// What one state of `n` elements named `name` costs (momentum off).
size_t Cost(size_t n, absl::string_view name) { return 8 * n + ErrorFeedback::kStateOverheadBytes + name.size(); }

TEST(ErrorFeedbackTest, StatesPersistAndResetOnEpochOrSizeChange) {
  ErrorFeedback ef(/*max_bytes=*/8 * 1000 + ErrorFeedback::kStateOverheadBytes + 1);
  auto a = ef.Get("a", 600, 1, 1);
  ASSERT_THAT(a, IsOk());
  (*a)->initialized = true;
  EXPECT_EQ(ef.bytes(), Cost(600, "a"));
  auto again = ef.Get("a", 600, 1, 2);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(*again, *a);
  EXPECT_TRUE((*again)->initialized) << "same tensor, same epoch: the state persists";
  auto changed = ef.Get("a", 600, 2, 3);  // a compression change
  ASSERT_THAT(changed, IsOk());
  EXPECT_FALSE((*changed)->initialized);
  (*changed)->initialized = true;
  auto resized = ef.Get("a", 400, 2, 4);
  ASSERT_THAT(resized, IsOk());
  EXPECT_FALSE((*resized)->initialized);
  EXPECT_EQ(ef.bytes(), Cost(400, "a"));
  ASSERT_THAT(ef.Get("b", 500, 2, 5), IsOk());
  EXPECT_EQ(ef.tensors(), 2u);
  EXPECT_EQ(ef.evicted(), 0u);
  ef.Clear();
  EXPECT_EQ(ef.bytes(), 0u);
  EXPECT_EQ(ef.tensors(), 0u);
}

TEST(ErrorFeedbackTest, LeastRecentlyUsedStatesMakeRoomInsteadOfFailing) {
  // Room for three states of 1000 elements. A fourth evicts the least recently used, and the
  // evicted tensor restarts with the dense first step when it comes back.
  const size_t limit = 3 * Cost(1000, "t0");
  ErrorFeedback ef(limit);
  for (int t = 0; t < 3; ++t) {
    auto s = ef.Get(absl::StrCat("t", t), 1000, 1, t);
    ASSERT_THAT(s, IsOk());
    (*s)->initialized = true;
  }
  ASSERT_THAT(ef.Get("t0", 1000, 1, 3), IsOk());  // t0 used again: t1 is now the oldest
  auto t3 = ef.Get("t3", 1000, 1, 4);
  ASSERT_THAT(t3, IsOk());
  EXPECT_EQ(ef.evicted(), 1u);
  EXPECT_EQ(ef.tensors(), 3u);
  EXPECT_LE(ef.bytes(), limit);
  auto t0 = ef.Get("t0", 1000, 1, 5);
  ASSERT_THAT(t0, IsOk());
  EXPECT_TRUE((*t0)->initialized) << "recently used: kept";
  auto t1 = ef.Get("t1", 1000, 1, 6);
  ASSERT_THAT(t1, IsOk());
  EXPECT_FALSE((*t1)->initialized) << "evicted: starts over";
  EXPECT_EQ(ef.evicted(), 2u) << "t1 came back in place of t2";
}

TEST(ErrorFeedbackTest, NamesThatNeverRepeatNeverFailAndStayBounded) {
  // What the torch backend once sent: a new name for every collective. The state used to grow
  // until --error_feedback_mib and then fail every collective with RESOURCE_EXHAUSTED for good.
  const size_t limit = 40 * Cost(4096, "torch.allreduce.0000");
  ErrorFeedback ef(limit, 1.0, /*max_idle_collectives=*/100);
  for (uint64_t seq = 0; seq < 5000; ++seq) {
    auto s = ef.Get(absl::StrCat("torch.allreduce.", seq), 4096, 1, seq);
    ASSERT_THAT(s, IsOk()) << "collective " << seq;
    (*s)->initialized = true;
    ASSERT_LE(ef.bytes(), limit);
  }
  EXPECT_LE(ef.tensors(), 40u);
  EXPECT_GT(ef.evicted(), 4000u);
  // The same under the idle rule alone (a limit never reached): at most max_idle + 1 states.
  ErrorFeedback idle(size_t{1} << 40, 1.0, /*max_idle_collectives=*/100);
  for (uint64_t seq = 0; seq < 5000; ++seq) {
    ASSERT_THAT(idle.Get(absl::StrCat("torch.allreduce.", seq), 16, 1, seq), IsOk());
    ASSERT_LE(idle.tensors(), 101u);
  }
  EXPECT_EQ(idle.evicted(), 0u);
  EXPECT_EQ(idle.retired_idle(), 5000u - 101u);
}

TEST(ErrorFeedbackTest, IdleStatesAreRetiredAndBusyOnesKept) {
  // A step of two tensors every 3 collectives, and a tensor used once: after max_idle
  // collectives without it, only the step's tensors remain.
  ErrorFeedback ef(size_t{1} << 30, 1.0, /*max_idle_collectives=*/50);
  ASSERT_THAT(ef.Get("once", 100, 1, 0), IsOk());
  for (uint64_t seq = 1; seq < 300; seq += 3) {
    for (const char* name : {"bucket0", "bucket1"}) {
      auto s = ef.Get(name, 1000, 1, seq);
      ASSERT_THAT(s, IsOk());
      if (seq > 1) EXPECT_TRUE((*s)->initialized) << name << " at " << seq;
      (*s)->initialized = true;
    }
  }
  EXPECT_EQ(ef.tensors(), 2u);
  EXPECT_EQ(ef.retired_idle(), 1u);
  EXPECT_EQ(ef.bytes(), Cost(1000, "bucket0") + Cost(1000, "bucket1"));
}

TEST(ErrorFeedbackTest, OnlyATensorBeyondTheWholeLimitFails) {
  ErrorFeedback ef(Cost(1000, "small"));
  ASSERT_THAT(ef.Get("small", 1000, 1, 0), IsOk());
  EXPECT_THAT(ef.Get("huge", 2000, 1, 1).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("'huge' needs"), HasSubstr("--error_feedback_mib"))));
  EXPECT_EQ(ef.tensors(), 1u) << "a tensor that cannot fit evicts nothing";
  EXPECT_EQ(ef.evicted(), 0u);
  ASSERT_THAT(ef.Get("small", 1000, 1, 2), IsOk());
}

TEST(ErrorFeedbackTest, EveryNodeRetiresTheSameStates) {
  // Two nodes see the same collectives (names, sizes, sequence numbers) under the same limit:
  // identical decisions, so a tensor is never dense on one node and compressed on another.
  const size_t limit = 5 * Cost(300, "x.00");
  ErrorFeedback a(limit, 1.0, 40), b(limit, 1.0, 40);
  std::mt19937 rng(3);
  for (uint64_t seq = 0; seq < 2000; ++seq) {
    const std::string name = absl::StrCat("x.", rng() % 12);
    const size_t n = 100 + 100 * (rng() % 3);
    auto sa = a.Get(name, n, 1, seq);
    auto sb = b.Get(name, n, 1, seq);
    ASSERT_THAT(sa, IsOk());
    ASSERT_THAT(sb, IsOk());
    ASSERT_EQ((*sa)->initialized, (*sb)->initialized) << seq;
    (*sa)->initialized = (*sb)->initialized = true;
  }
  EXPECT_EQ(a.evicted(), b.evicted());
  EXPECT_EQ(a.retired_idle(), b.retired_idle());
  EXPECT_GT(a.evicted(), 0u);
}

}  // namespace
}  // namespace dynamiq::server

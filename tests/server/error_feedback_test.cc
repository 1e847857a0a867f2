#include "server/error_feedback.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/memory_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
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

// Runs `steps` EF21 steps of constant per-rank gradients on `n` ranks; returns every rank's result
// of every step.
std::vector<std::vector<std::vector<float>>> RunSteps(const kernels::Codec& codec,
                                                      const std::vector<std::vector<float>>& grads, int steps,
                                                      std::vector<ErrorFeedbackState>* states) {
  const int n = static_cast<int>(grads.size());
  const size_t d = grads[0].size();
  auto transports = engine::MakeMemoryTransports(n);
  states->assign(n, ErrorFeedbackState{});
  for (auto& s : *states) {
    s.local.assign(d, 0.0f);
    s.global.assign(d, 0.0f);
  }
  std::vector<std::vector<std::vector<float>>> out(steps, std::vector<std::vector<float>>(n));
  for (int t = 0; t < steps; ++t) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        std::vector<float> x = grads[r];
        engine::AllReduceOptions o;
        o.job_id = 7;
        o.sequence = 100 + t;
        o.block_elements = 1024;
        o.timeout = absl::Seconds(20);
        auto result = ErrorFeedbackAllReduce(codec, *transports[r], o, x.data(), d, (*states)[r]);
        EXPECT_THAT(result, IsOk()) << "step " << t << " rank " << r;
        out[t][r] = x;
      });
    }
    for (auto& th : threads) th.join();
  }
  return out;
}

TEST(ErrorFeedbackTest, Ef21IsBitIdenticalAcrossNodesAndDeliversWhatWasLeftBehind) {
  const int n = 3;
  const size_t d = 16 * 256 + 40;
  std::mt19937 rng(5);
  std::normal_distribution<float> dist;
  std::vector<std::vector<float>> grads(n, std::vector<float>(d));
  for (auto& g : grads) {
    for (size_t i = 0; i < d; ++i) g[i] = dist(rng) * (1.0f + static_cast<float>(i / 256 % 5));
  }
  std::vector<double> exact(d, 0.0);
  for (const auto& g : grads) {
    for (size_t i = 0; i < d; ++i) exact[i] += g[i];
  }
  kernels::CodecConfig c;
  c.id = kernels::CodecId::kArcTopK;
  c.bits = 0.25;
  auto codec = kernels::CreateCodec(c);
  ASSERT_THAT(codec, IsOk());
  std::vector<ErrorFeedbackState> states;
  const auto out = RunSteps(**codec, grads, 12, &states);
  auto error = [&](const std::vector<float>& y) {
    double num = 0, den = 0;
    for (size_t i = 0; i < d; ++i) {
      num += (y[i] - exact[i]) * (y[i] - exact[i]);
      den += exact[i] * exact[i];
    }
    return num / den;
  };
  for (const auto& step : out) {
    for (int r = 1; r < n; ++r) {
      ASSERT_EQ(0, std::memcmp(step[r].data(), step[0].data(), d * sizeof(float))) << "rank " << r;
    }
  }
  EXPECT_LT(error(out[0][0]), 1e-12) << "the first step is the dense, exact all-reduce";
  // The same gradient every step: after the dense first step u = x - g_i = 0, so the estimate
  // stays exact (the next test changes the gradient).
  EXPECT_LT(error(out.back()[0]), 1e-10);
  // Invariant G = sum_i g_i.
  for (size_t i = 0; i < d; i += 97) {
    double sum = 0;
    for (const auto& s : states) sum += s.local[i];
    EXPECT_NEAR(states[0].global[i], sum, 1e-4 * (1 + std::fabs(sum))) << i;
  }
}

TEST(ErrorFeedbackTest, Ef21CatchesUpWithANewGradientRowsAtATime) {
  // Step 0 all-reduces zeros (dense); from step 1 on every rank's gradient is g. Each step the
  // density lets a quarter of the rows through, so after a few steps G is the exact sum of g,
  // while one step of ARC-Top-K alone (without feedback) keeps only a quarter of the energy.
  const int n = 2;
  const size_t d = 8 * 256;
  std::mt19937 rng(9);
  std::normal_distribution<float> dist;
  std::vector<float> g(d);
  for (size_t i = 0; i < d; ++i) g[i] = dist(rng);
  kernels::CodecConfig c;
  c.id = kernels::CodecId::kArcTopK;
  c.bits = 0.25;
  auto codec = kernels::CreateCodec(c);
  ASSERT_THAT(codec, IsOk());
  auto transports = engine::MakeMemoryTransports(n);
  std::vector<ErrorFeedbackState> states(n);
  for (auto& s : states) {
    s.local.assign(d, 0.0f);
    s.global.assign(d, 0.0f);
  }
  std::vector<std::vector<double>> err(n);
  for (int t = 0; t < 7; ++t) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        std::vector<float> x = t == 0 ? std::vector<float>(d, 0.0f) : g;
        engine::AllReduceOptions o;
        o.job_id = 8;
        o.sequence = 1 + t;
        o.timeout = absl::Seconds(20);
        ASSERT_THAT(ErrorFeedbackAllReduce(**codec, *transports[r], o, x.data(), d, states[r]), IsOk());
        double num = 0, den = 0;
        for (size_t i = 0; i < d; ++i) {
          num += (x[i] - n * g[i]) * (x[i] - n * g[i]);
          den += (n * g[i]) * (n * g[i]);
        }
        err[r].push_back(num / den);
      });
    }
    for (auto& th : threads) th.join();
  }
  EXPECT_EQ(err[0], err[1]);
  EXPECT_NEAR(err[0][1], 0.75, 0.1) << "step 1: two of eight rows";
  EXPECT_LT(err[0][2], err[0][1]);
  EXPECT_LT(err[0][4], 1e-12) << "after 4 steps every row has been sent once";
  EXPECT_LT(err[0][6], 1e-12);
}

TEST(ErrorFeedbackTest, MomentumTracksTheAverageOfTheGradients) {
  // EF21M with eta = 0.5 at density 1 (every row kept): after the dense first step with x0, the
  // step with x1 returns sum_i (0.5 x0_i + 0.5 x1_i) exactly, and the state costs 12 bytes per element.
  ErrorFeedback ef(1 << 20, 0.5);
  auto s = ef.Get("t", 1000, 1, 1);
  ASSERT_THAT(s, IsOk());
  EXPECT_EQ(ef.bytes(), 12u * 1000 + ErrorFeedback::kStateOverheadBytes + 1);
  EXPECT_EQ((*s)->momentum.size(), 1000u);
  const int n = 2;
  const size_t d = 1000;
  kernels::CodecConfig c;
  c.id = kernels::CodecId::kArcTopK;
  c.bits = 1.0;
  auto codec = kernels::CreateCodec(c);
  ASSERT_THAT(codec, IsOk());
  auto transports = engine::MakeMemoryTransports(n);
  std::vector<ErrorFeedbackState> states(n);
  for (auto& st : states) {
    st.local.assign(d, 0.0f);
    st.global.assign(d, 0.0f);
    st.momentum.assign(d, 0.0f);
  }
  auto x = [](int t, int r, size_t i) { return static_cast<float>((t + 1) * (r + 1)) * (0.25f + (i % 3)); };
  std::vector<std::vector<float>> out(n);
  for (int t = 0; t < 2; ++t) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        std::vector<float> v(d);
        for (size_t i = 0; i < d; ++i) v[i] = x(t, r, i);
        engine::AllReduceOptions o;
        o.job_id = 9;
        o.sequence = 1 + t;
        o.timeout = absl::Seconds(20);
        ASSERT_THAT(ErrorFeedbackAllReduce(**codec, *transports[r], o, v.data(), d, states[r], 0.5), IsOk());
        out[r] = v;
      });
    }
    for (auto& th : threads) th.join();
  }
  for (size_t i = 0; i < d; ++i) {
    float expected = 0;
    for (int r = 0; r < n; ++r) expected += 0.5f * x(0, r, i) + 0.5f * x(1, r, i);
    ASSERT_FLOAT_EQ(out[0][i], expected) << i;
    ASSERT_EQ(out[1][i], out[0][i]) << i;
  }
}

}  // namespace
}  // namespace dynamiq::server

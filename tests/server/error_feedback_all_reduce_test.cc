// ErrorFeedbackAllReduce (server/error_feedback_all_reduce.h): around a recording inner algorithm,
// which codec and options each step hands it and what the state becomes; around the engine, EF21
// and EF21M over in-memory transports.
#include "server/error_feedback_all_reduce.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/memory_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/all_reduce_test_util.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::OnEveryNode;
using ::dynamiq::testing::StatusIs;
using ::dynamiq::testing::TestCodec;
using ::testing::Each;
using ::testing::ElementsAre;

constexpr size_t kD = 2 * 256;  // two rows of ARC-Top-K's selection

// A one-node "all-reduce" that records each call and, for a codec with a selection, keeps the rows
// of `widths` (ARC-Top-K's C: the other rows' sums are zero) and reports them when asked.
class RecordingInner final : public CrossNodeAllReduce {
 public:
  struct Call {
    kernels::CodecId codec;
    bool keep_plan_widths;
    uint64_t sequence;
    std::vector<float> input;
  };
  absl::StatusOr<Outcome> Run(const kernels::Codec& codec, engine::Transport&, const engine::AllReduceOptions& options,
                              float* data, size_t n) override {
    calls.push_back({codec.id(), options.keep_plan_widths, options.sequence, std::vector<float>(data, data + n)});
    if (!fail.ok()) return fail;
    Outcome out;
    out.bytes_sent = 100 + calls.size();
    if (codec.id() == kernels::CodecId::kArcTopK) {
      for (size_t i = 0; i < n; ++i) {
        if (i / 256 < widths.size() && widths[i / 256] == 0) data[i] = 0;
      }
    }
    if (options.keep_plan_widths) out.plan_widths = widths;
    return out;
  }
  std::vector<Call> calls;
  std::vector<uint8_t> widths = {1, 1};
  absl::Status fail;
};

ErrorFeedbackState State(size_t n) {
  ErrorFeedbackState s;
  s.local.assign(n, 0.0f);
  s.global.assign(n, 0.0f);
  return s;
}

engine::AllReduceOptions Options(uint64_t sequence) {
  engine::AllReduceOptions o;
  o.sequence = sequence;
  return o;
}

TEST(ErrorFeedbackAllReduceTest, TheDenseFirstStepAndTheCompressedStepsGoThroughTheInner) {
  auto arc = TestCodec(kernels::CodecId::kArcTopK);
  auto transports = engine::MakeMemoryTransports(1);
  RecordingInner inner;
  ErrorFeedbackState state = State(kD);
  ErrorFeedbackAllReduce ef(inner, state);
  // Values whose sums and differences are exact in fp32.
  const std::vector<float> x0(kD, 1.0f), x1(kD, 3.0f);
  std::vector<float> x = x0;
  auto first = ef.Run(*arc, *transports[0], Options(1), x.data(), kD);
  ASSERT_THAT(first, IsOk());
  ASSERT_EQ(inner.calls.size(), 1u);
  EXPECT_EQ(inner.calls[0].codec, kernels::CodecId::kNone) << "the first step is dense";
  EXPECT_FALSE(inner.calls[0].keep_plan_widths);
  EXPECT_EQ(inner.calls[0].sequence, 1u);
  EXPECT_EQ(inner.calls[0].input, x0);
  EXPECT_EQ(first->bytes_sent, 101u) << "the inner's outcome";
  EXPECT_EQ(x, x0);
  EXPECT_TRUE(state.initialized);
  // Step 2 keeps row 0 only: it is sent (u = x1 - g_i = 2), row 1 stays behind in x - g_i.
  inner.widths = {1, 0};
  x = x1;
  auto second = ef.Run(*arc, *transports[0], Options(2), x.data(), kD);
  ASSERT_THAT(second, IsOk());
  ASSERT_EQ(inner.calls.size(), 2u);
  EXPECT_EQ(inner.calls[1].codec, kernels::CodecId::kArcTopK);
  EXPECT_TRUE(inner.calls[1].keep_plan_widths) << "the decorator needs the rows C kept";
  EXPECT_THAT(inner.calls[1].input, Each(2.0f)) << "u = x - g_i";
  EXPECT_THAT(second->plan_widths, ElementsAre(1, 0));
  EXPECT_EQ(x[0], 3.0f);
  EXPECT_EQ(x[kD - 1], 1.0f) << "G: row 1 still the first step's";
  EXPECT_EQ(state.local[0], 3.0f);
  EXPECT_EQ(state.local[kD - 1], 1.0f);
  // Step 3, same gradient, both rows kept: only what was left behind is sent, and G catches up.
  inner.widths = {1, 1};
  x = x1;
  ASSERT_THAT(ef.Run(*arc, *transports[0], Options(3), x.data(), kD), IsOk());
  EXPECT_EQ(inner.calls[2].input[0], 0.0f);
  EXPECT_EQ(inner.calls[2].input[kD - 1], 2.0f);
  EXPECT_EQ(x, x1);
  EXPECT_EQ(state.global, x1);
}

TEST(ErrorFeedbackAllReduceTest, OtherCodecsPassStraightThrough) {
  auto dynamiq = TestCodec(kernels::CodecId::kDynamiq);
  auto transports = engine::MakeMemoryTransports(1);
  RecordingInner inner;
  ErrorFeedbackState state = State(kD);
  ErrorFeedbackAllReduce ef(inner, state);
  std::vector<float> x(kD, 5.0f);
  ASSERT_THAT(ef.Run(*dynamiq, *transports[0], Options(4), x.data(), kD), IsOk());
  ASSERT_EQ(inner.calls.size(), 1u);
  EXPECT_EQ(inner.calls[0].codec, kernels::CodecId::kDynamiq);
  EXPECT_FALSE(inner.calls[0].keep_plan_widths);
  EXPECT_THAT(x, Each(5.0f));
  EXPECT_FALSE(state.initialized);
  EXPECT_THAT(state.local, Each(0.0f)) << "the state is left alone";
}

TEST(ErrorFeedbackAllReduceTest, AFailedStepResetsTheStateToTheDenseStep) {
  auto arc = TestCodec(kernels::CodecId::kArcTopK);
  auto transports = engine::MakeMemoryTransports(1);
  RecordingInner inner;
  ErrorFeedbackState state = State(kD);
  ErrorFeedbackAllReduce ef(inner, state);
  std::vector<float> x(kD, 1.0f);
  ASSERT_THAT(ef.Run(*arc, *transports[0], Options(1), x.data(), kD), IsOk());
  inner.fail = absl::UnavailableError("peer 1 went away");
  EXPECT_THAT(ef.Run(*arc, *transports[0], Options(2), x.data(), kD), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_FALSE(state.initialized);
  // An inner that does not report the selection: INTERNAL, and reset too.
  inner.fail = absl::OkStatus();
  ASSERT_THAT(ef.Run(*arc, *transports[0], Options(3), x.data(), kD), IsOk());
  EXPECT_EQ(inner.calls.back().codec, kernels::CodecId::kNone) << "dense again after the failure";
  inner.widths = {1};
  EXPECT_THAT(ef.Run(*arc, *transports[0], Options(4), x.data(), kD), StatusIs(absl::StatusCode::kInternal));
  EXPECT_FALSE(state.initialized);
}

// One EF21(M) step of `x` over the engine: the decorator around the plain all-reduce.
absl::StatusOr<CrossNodeAllReduce::Outcome> Ef21Step(const kernels::Codec& codec, engine::Transport& transport,
                                                     const engine::AllReduceOptions& options, float* x, size_t n,
                                                     ErrorFeedbackState& state, double eta = 1.0) {
  EngineCrossNodeAllReduce engine;
  return ErrorFeedbackAllReduce(engine, state, eta).Run(codec, transport, options, x, n);
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
    OnEveryNode(n, [&](int r) {
      std::vector<float> x = grads[r];
      engine::AllReduceOptions o;
      o.job_id = 7;
      o.sequence = 100 + t;
      o.block_elements = 1024;
      o.timeout = absl::Seconds(20);
      auto result = Ef21Step(codec, *transports[r], o, x.data(), d, (*states)[r]);
      EXPECT_THAT(result, IsOk()) << "step " << t << " rank " << r;
      out[t][r] = x;
    });
  }
  return out;
}

TEST(ErrorFeedbackAllReduceTest, Ef21IsBitIdenticalAcrossNodesAndDeliversWhatWasLeftBehind) {
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
  auto codec = TestCodec(kernels::CodecId::kArcTopK, 0.25);
  std::vector<ErrorFeedbackState> states;
  const auto out = RunSteps(*codec, grads, 12, &states);
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

TEST(ErrorFeedbackAllReduceTest, Ef21CatchesUpWithANewGradientRowsAtATime) {
  // Step 0 all-reduces zeros (dense); from step 1 on every rank's gradient is g. Each step the
  // density lets a quarter of the rows through, so after a few steps G is the exact sum of g,
  // while one step of ARC-Top-K alone (without feedback) keeps only a quarter of the energy.
  const int n = 2;
  const size_t d = 8 * 256;
  std::mt19937 rng(9);
  std::normal_distribution<float> dist;
  std::vector<float> g(d);
  for (size_t i = 0; i < d; ++i) g[i] = dist(rng);
  auto codec = TestCodec(kernels::CodecId::kArcTopK, 0.25);
  auto transports = engine::MakeMemoryTransports(n);
  std::vector<ErrorFeedbackState> states(n);
  for (auto& s : states) {
    s.local.assign(d, 0.0f);
    s.global.assign(d, 0.0f);
  }
  std::vector<std::vector<double>> err(n);
  for (int t = 0; t < 7; ++t) {
    OnEveryNode(n, [&](int r) {
      std::vector<float> x = t == 0 ? std::vector<float>(d, 0.0f) : g;
      engine::AllReduceOptions o;
      o.job_id = 8;
      o.sequence = 1 + t;
      o.timeout = absl::Seconds(20);
      ASSERT_THAT(Ef21Step(*codec, *transports[r], o, x.data(), d, states[r]), IsOk());
      double num = 0, den = 0;
      for (size_t i = 0; i < d; ++i) {
        num += (x[i] - n * g[i]) * (x[i] - n * g[i]);
        den += (n * g[i]) * (n * g[i]);
      }
      err[r].push_back(num / den);
    });
  }
  EXPECT_EQ(err[0], err[1]);
  EXPECT_NEAR(err[0][1], 0.75, 0.1) << "step 1: two of eight rows";
  EXPECT_LT(err[0][2], err[0][1]);
  EXPECT_LT(err[0][4], 1e-12) << "after 4 steps every row has been sent once";
  EXPECT_LT(err[0][6], 1e-12);
}

TEST(ErrorFeedbackAllReduceTest, MomentumTracksTheAverageOfTheGradients) {
  // EF21M with eta = 0.5 at density 1 (every row kept): after the dense first step with x0, the
  // step with x1 returns sum_i (0.5 x0_i + 0.5 x1_i) exactly, and the state costs 12 bytes per element.
  ErrorFeedback ef(1 << 20, 0.5);
  auto s = ef.Get("t", 1000, 1, 1);
  ASSERT_THAT(s, IsOk());
  EXPECT_EQ(ef.bytes(), 12u * 1000 + ErrorFeedback::kStateOverheadBytes + 1);
  EXPECT_EQ((*s)->momentum.size(), 1000u);
  const int n = 2;
  const size_t d = 1000;
  auto codec = TestCodec(kernels::CodecId::kArcTopK, 1.0);
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
    OnEveryNode(n, [&](int r) {
      std::vector<float> v(d);
      for (size_t i = 0; i < d; ++i) v[i] = x(t, r, i);
      engine::AllReduceOptions o;
      o.job_id = 9;
      o.sequence = 1 + t;
      o.timeout = absl::Seconds(20);
      ASSERT_THAT(Ef21Step(*codec, *transports[r], o, v.data(), d, states[r], 0.5), IsOk());
      out[r] = v;
    });
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

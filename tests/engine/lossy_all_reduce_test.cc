// LossyAllReduceMean (engine/lossy_all_reduce.h) over real UDP transports on loopback, with losses
// made by a transport that drops what it is told to (seeded) on the sending side.
#include "engine/lossy_all_reduce.h"

#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "engine/store.h"
#include "engine/udp_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;

// Loses each datagram it sends with probability `loss` (its own seeded generator), and every one
// to or from rank `cut` (-1: none): what a lossy network does to the sender's datagrams.
class DroppingTransport final : public DatagramTransport {
 public:
  DroppingTransport(std::unique_ptr<DatagramTransport> base, uint64_t seed) : base_(std::move(base)), rng_(seed) {}
  void set_loss(double loss) { loss_ = loss; }
  void set_cut(int cut) { cut_ = cut; }
  // Datagrams dropped since the last call.
  uint64_t TakeDropped() {
    absl::MutexLock lock(&mu_);
    return std::exchange(dropped_, 0);
  }

  int rank() const override { return base_->rank(); }
  int size() const override { return base_->size(); }
  DatagramCapabilities capabilities() const override { return base_->capabilities(); }
  absl::Status Send(int peer, uint64_t tag, absl::Span<const uint8_t> payload) override {
    bool drop = peer == cut_ || rank() == cut_;
    {
      absl::MutexLock lock(&mu_);
      drop = std::bernoulli_distribution(loss_)(rng_) || drop;
      if (drop) ++dropped_;
    }
    return drop ? absl::OkStatus() : base_->Send(peer, tag, payload);  // OK: it left, as a lost one does
  }
  absl::StatusOr<ReceivedDatagram> Receive(absl::Span<uint8_t> buffer, absl::Time deadline) override {
    return base_->Receive(buffer, deadline);
  }
  void AcceptTags(uint64_t lowest, uint64_t highest) override { base_->AcceptTags(lowest, highest); }
  void Abort() override { base_->Abort(); }
  DatagramCounters counters() const override { return base_->counters(); }

 private:
  std::unique_ptr<DatagramTransport> base_;
  absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  double loss_ = 0;
  int cut_ = -1;
};

class LossyAllReduceTest : public ::testing::Test {
 protected:
  void Connect(int n) {
    transports_.resize(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        UdpTransportOptions o;
        o.timeout = absl::Seconds(20);
        absl::StatusOr<std::unique_ptr<UdpTransport>> t = ConnectUdpTransport(store_, r, n, o);
        ASSERT_THAT(t, IsOk());
        transports_[r] = std::make_unique<DroppingTransport>(*std::move(t), 1000 + r);
      });
    }
    for (auto& t : threads) t.join();
    for (auto& t : transports_) ASSERT_NE(t, nullptr);
  }

  // Every rank all-reduces inputs[rank] under `options` at once.
  std::vector<absl::StatusOr<LossyAllReduceResult>> Run(const std::vector<std::vector<float>>& inputs,
                                                        std::vector<std::vector<float>>& outputs,
                                                        const LossyAllReduceOptions& options) {
    const int n = static_cast<int>(transports_.size());
    std::vector<absl::StatusOr<LossyAllReduceResult>> results(n, absl::UnknownError("not run"));
    outputs.assign(n, std::vector<float>(inputs[0].size()));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back(
          [&, r] { results[r] = LossyAllReduceMean(*transports_[r], options, inputs[r], absl::MakeSpan(outputs[r])); });
    }
    for (auto& t : threads) t.join();
    return results;
  }

  // Rank r's values: (r + 1) (1 + i mod 5), so the mean of element i is known exactly.
  static std::vector<std::vector<float>> Inputs(int n, size_t elements) {
    std::vector<std::vector<float>> in(n, std::vector<float>(elements));
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < elements; ++i) in[r][i] = static_cast<float>((r + 1) * (1 + i % 5));
    }
    return in;
  }
  static double ExactMean(int n, size_t i) { return (n + 1) / 2.0 * (1 + i % 5); }

  // Element i's owner (the rank whose chunk holds it) for `elements` over `n` ranks.
  static int Owner(size_t elements, int n, size_t i) {
    int c = 0;
    while (c + 1 < n && elements * (c + 1) / n <= i) ++c;
    return c;
  }

  InMemoryStore store_;
  std::vector<std::unique_ptr<DroppingTransport>> transports_;
};

// Nothing lost: every rank ends with the group's mean, the same bits everywhere, with every
// contribution and every slice counted; more elements than one datagram carries included.
TEST_F(LossyAllReduceTest, WithoutLossEveryRankGetsTheMean) {
  constexpr int kRanks = 3;
  Connect(kRanks);
  for (size_t elements : {size_t{1}, size_t{7}, size_t{5000}}) {
    SCOPED_TRACE(elements);
    const std::vector<std::vector<float>> in = Inputs(kRanks, elements);
    std::vector<std::vector<float>> out;
    LossyAllReduceOptions o;
    o.sequence = elements;
    o.phase_timeout = absl::Seconds(5);
    const absl::Time start = absl::Now();
    std::vector<absl::StatusOr<LossyAllReduceResult>> r = Run(in, out, o);
    EXPECT_LT(absl::Now() - start, absl::Seconds(4)) << "nothing lost: no deadline waited for";
    for (int k = 0; k < kRanks; ++k) {
      ASSERT_THAT(r[k], IsOk());
      EXPECT_EQ(r[k]->coverage(), 1.0);
      EXPECT_EQ(r[k]->gathered(), 1.0);
      EXPECT_EQ(r[k]->rejected, 0u);
      EXPECT_EQ(r[k]->kept_own_elements, 0u);
      EXPECT_EQ(r[k]->arrived_from, r[k]->expected_from);
      for (size_t i = 0; i < elements; ++i) {
        EXPECT_FLOAT_EQ(out[k][i], ExactMean(kRanks, i)) << "rank " << k << " element " << i;
        EXPECT_EQ(memcmp(&out[k][i], &out[0][i], sizeof(float)), 0);
      }
    }
  }
}

// In place (output is the input): the same means.
TEST_F(LossyAllReduceTest, InPlaceGivesTheMeanToo) {
  constexpr int kRanks = 3;
  constexpr size_t kElements = 1000;
  Connect(kRanks);
  std::vector<std::vector<float>> data = Inputs(kRanks, kElements);
  std::vector<absl::StatusOr<LossyAllReduceResult>> r(kRanks, absl::UnknownError("not run"));
  LossyAllReduceOptions o;
  o.sequence = 5;
  o.phase_timeout = absl::Seconds(5);
  std::vector<std::thread> threads;
  for (int k = 0; k < kRanks; ++k) {
    threads.emplace_back([&, k] { r[k] = LossyAllReduceMean(*transports_[k], o, data[k], absl::MakeSpan(data[k])); });
  }
  for (auto& t : threads) t.join();
  for (int k = 0; k < kRanks; ++k) {
    ASSERT_THAT(r[k], IsOk());
    for (size_t i = 0; i < kElements; ++i) EXPECT_FLOAT_EQ(data[k][i], ExactMean(kRanks, i)) << k << " " << i;
  }
}

// The owners' means over 1,000 trials at 10 % loss: the average error is zero within three
// standard errors; divided by the group size instead, the same test sees the bias. Only random
// loss is unbiased: a datagram that misses its 4 ms phase because the machine is busy is the same
// one trial after trial (the last sent), so a trial where more went missing than the transport
// dropped is run again, with twice the phase timeout (up to 64 ms).
TEST_F(LossyAllReduceTest, OwnersMeansAreUnbiasedUnderLossAndTheTestSeesBias) {
  constexpr int kRanks = 3;
  constexpr size_t kElements = 9;
  Connect(kRanks);
  for (auto& t : transports_) t->set_loss(0.10);
  const std::vector<std::vector<float>> in = Inputs(kRanks, kElements);
  uint64_t sequence = 0;
  int late_trials = 0;
  // Per trial: the owners' relative error, averaged over the elements.
  auto trials = [&](bool normalize, int count, double* coverage) {
    std::vector<double> errors;
    uint64_t arrived = 0, expected = 0;
    absl::Duration phase_timeout = absl::Milliseconds(4);
    for (int t = 0, attempts = 0; t < count && attempts < 3 * count; ++attempts) {
      std::vector<std::vector<float>> out;
      LossyAllReduceOptions o;
      o.sequence = ++sequence;
      o.phase_timeout = phase_timeout;
      o.normalize = normalize;
      for (auto& transport : transports_) transport->TakeDropped();
      std::vector<absl::StatusOr<LossyAllReduceResult>> r = Run(in, out, o);
      uint64_t missing = 0, dropped = 0;
      for (const auto& x : r) {
        if (x.ok()) {
          missing += x->contributions_expected - x->contributions_arrived + x->gathered_expected - x->gathered_arrived;
        }
      }
      for (auto& transport : transports_) dropped += transport->TakeDropped();
      if (missing > dropped) {  // late, not lost: run it again with more time
        phase_timeout = std::min(2 * phase_timeout, absl::Milliseconds(64));
        ++late_trials;
        continue;
      }
      ++t;
      double e = 0;
      for (size_t i = 0; i < kElements; ++i) {
        const int owner = Owner(kElements, kRanks, i);
        e += (out[owner][i] - ExactMean(kRanks, i)) / ExactMean(kRanks, i) / kElements;
      }
      for (const auto& x : r) {
        EXPECT_THAT(x, IsOk());
        if (x.ok()) arrived += x->contributions_arrived, expected += x->contributions_expected;
      }
      errors.push_back(e);
    }
    EXPECT_EQ(errors.size(), static_cast<size_t>(count)) << "too many trials lost datagrams to lateness, not loss";
    *coverage = static_cast<double>(arrived) / static_cast<double>(expected);
    double mean = 0, var = 0;
    for (double e : errors) mean += e / errors.size();
    for (double e : errors) var += (e - mean) * (e - mean) / (errors.size() - 1);
    return std::make_pair(mean, std::sqrt(var / errors.size()));  // mean error, its standard error
  };
  double coverage = 0;
  const auto [unbiased, se] = trials(/*normalize=*/true, 1000, &coverage);
  EXPECT_LT(coverage, 0.95) << "the losses happened";
  EXPECT_GT(coverage, 0.5);
  EXPECT_GT(se, 0) << "the estimates vary with what was lost";
  EXPECT_LT(std::abs(unbiased), 3 * se) << "mean relative error " << unbiased << ", standard error " << se;
  const auto [biased, se_biased] = trials(/*normalize=*/false, 300, &coverage);
  EXPECT_LT(biased, -3 * se_biased) << "dividing by the group size under loss is biased low";
  std::printf(
      "owners' mean relative error: %.3g (standard error %.3g) at coverage %.3f; divided by the group size: "
      "%.3g (%.3g); %d trials run again (a datagram late, not lost)\n",
      unbiased, se, coverage, biased, se_biased, late_trials);
}

// One rank cut off entirely: every call ends by its two deadlines; the others' chunks are the mean
// of those that arrived, the cut rank's chunk keeps each rank's own values, and the cut rank keeps
// its own values everywhere.
TEST_F(LossyAllReduceTest, ACutRankCostsTheDeadlinesAndNoMore) {
  constexpr int kRanks = 3;
  constexpr size_t kElements = 30;
  Connect(kRanks);
  for (auto& t : transports_) t->set_cut(2);
  const std::vector<std::vector<float>> in = Inputs(kRanks, kElements);
  std::vector<std::vector<float>> out;
  LossyAllReduceOptions o;
  o.sequence = 7;
  o.phase_timeout = absl::Milliseconds(200);
  const absl::Time start = absl::Now();
  std::vector<absl::StatusOr<LossyAllReduceResult>> r = Run(in, out, o);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(400 + 500));
  for (int k = 0; k < kRanks; ++k) {
    ASSERT_THAT(r[k], IsOk());
    EXPECT_EQ(r[k]->coverage(), k == 2 ? 0.0 : 0.5);
    EXPECT_EQ(r[k]->gathered(), k == 2 ? 0.0 : 0.5);
    // Per source: nothing from rank 2 (nor, for rank 2, from anyone); its chunk (elements 20-29)
    // kept the receiver's own values, and rank 2 kept its own everywhere but its chunk.
    for (int source = 0; source < kRanks; ++source) {
      EXPECT_EQ(r[k]->arrived_from[source], k == 2 || source == 2 ? 0 : r[k]->expected_from[source]);
    }
    EXPECT_EQ(r[k]->kept_own_elements, k == 2 ? 20u : 10u);
    for (size_t i = 0; i < kElements; ++i) {
      const int owner = Owner(kElements, kRanks, i);
      const float want = (k == 2 || owner == 2) ? in[k][i] : (in[0][i] + in[1][i]) / 2;
      EXPECT_FLOAT_EQ(out[k][i], want) << "rank " << k << " element " << i;
    }
  }
}

// Every datagram carries its sender's announcement: each rank learns the highest of those it heard
// from, and from how many ranks it heard; a cut rank is not heard (and hears nobody).
TEST_F(LossyAllReduceTest, EachRankHearsTheOthersAnnouncements) {
  constexpr int kRanks = 3;
  Connect(kRanks);
  for (bool cut : {false, true}) {
    SCOPED_TRACE(cut);
    if (cut) {
      for (auto& t : transports_) t->set_cut(2);
    }
    const std::vector<std::vector<float>> in = Inputs(kRanks, 100);
    std::vector<std::vector<float>> out(kRanks, std::vector<float>(100));
    std::vector<absl::StatusOr<LossyAllReduceResult>> r(kRanks, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int k = 0; k < kRanks; ++k) {
      threads.emplace_back([&, k] {
        LossyAllReduceOptions o;
        o.sequence = cut ? 21 : 20;
        o.phase_timeout = absl::Milliseconds(cut ? 200 : 5000);
        o.announcement = 100 + k;
        r[k] = LossyAllReduceMean(*transports_[k], o, in[k], absl::MakeSpan(out[k]));
      });
    }
    for (auto& t : threads) t.join();
    for (int k = 0; k < kRanks; ++k) {
      ASSERT_THAT(r[k], IsOk());
      if (cut && k == 2) {
        EXPECT_EQ(r[k]->ranks_heard, 0);
        EXPECT_EQ(r[k]->highest_announcement, 0u);
        continue;
      }
      EXPECT_EQ(r[k]->ranks_heard, cut ? 1 : 2) << k;
      const uint64_t want = cut ? 100 + (1 - k) : (k == 2 ? 101 : 102);
      EXPECT_EQ(r[k]->highest_announcement, want) << k;
    }
  }
}

// bf16 on the wire: every rank gets the mean of the bf16-rounded values, rounded to bf16, the same
// bits everywhere, in datagrams of twice the elements.
TEST_F(LossyAllReduceTest, Bf16ValuesGiveEveryRankTheSameRoundedMean) {
  constexpr int kRanks = 3;
  constexpr size_t kElements = 3000;
  Connect(kRanks);
  std::vector<std::vector<float>> in(kRanks, std::vector<float>(kElements));
  for (int r = 0; r < kRanks; ++r) {
    for (size_t i = 0; i < kElements; ++i) in[r][i] = 1.0f + 0.001f * static_cast<float>((r + 1) * (i % 97));
  }
  std::vector<std::vector<float>> out;
  LossyAllReduceOptions o;
  o.sequence = 11;
  o.phase_timeout = absl::Seconds(5);
  o.values = LossyValues::kBf16;
  std::vector<absl::StatusOr<LossyAllReduceResult>> r = Run(in, out, o);
  auto bf16 = [](float v) { return kernels::Bf16ToFloat(kernels::FloatToBf16(v)); };
  for (int k = 0; k < kRanks; ++k) {
    ASSERT_THAT(r[k], IsOk());
    EXPECT_EQ(r[k]->coverage(), 1.0);
    EXPECT_EQ(r[k]->gathered(), 1.0);
    for (size_t i = 0; i < kElements; ++i) {
      double sum = 0;
      for (int j = 0; j < kRanks; ++j) sum += bf16(in[j][i]);
      ASSERT_EQ(out[k][i], bf16(static_cast<float>(sum / kRanks))) << "rank " << k << " element " << i;
    }
    EXPECT_EQ(out[k], out[0]);
  }
}

// int8 on the wire (a scale per datagram): every rank gets the same values, each within two
// quantization steps of the exact mean (one for the contributions, one for the mean), in datagrams
// of four times the elements; a NaN makes its slice NaN everywhere instead of vanishing.
TEST_F(LossyAllReduceTest, Int8ValuesGiveEveryRankTheSameMeanWithinTwoSteps) {
  constexpr int kRanks = 3;
  constexpr size_t kElements = 5000;
  Connect(kRanks);
  std::vector<std::vector<float>> in(kRanks, std::vector<float>(kElements));
  float largest = 0;
  for (int r = 0; r < kRanks; ++r) {
    for (size_t i = 0; i < kElements; ++i) {
      in[r][i] = std::sin(0.001f * static_cast<float>(i * (r + 3))) * static_cast<float>(1 + r);
      largest = std::max(largest, std::fabs(in[r][i]));
    }
  }
  std::vector<std::vector<float>> out;
  LossyAllReduceOptions o;
  o.sequence = 12;
  o.phase_timeout = absl::Seconds(5);
  o.values = LossyValues::kInt8;
  std::vector<absl::StatusOr<LossyAllReduceResult>> r = Run(in, out, o);
  for (int k = 0; k < kRanks; ++k) {
    ASSERT_THAT(r[k], IsOk());
    EXPECT_EQ(r[k]->coverage(), 1.0);
    EXPECT_EQ(r[k]->gathered(), 1.0);
    EXPECT_LT(r[k]->bytes_sent, 2 * kElements * 2 / 3 + 2000) << "about a byte per element and phase";
    for (size_t i = 0; i < kElements; ++i) {
      const double mean = (in[0][i] + in[1][i] + in[2][i]) / 3.0;
      ASSERT_NEAR(out[k][i], mean, 2 * largest / 254 + 1e-6) << "rank " << k << " element " << i;
    }
    EXPECT_EQ(out[k], out[0]);
  }
  in[1][10] = std::numeric_limits<float>::quiet_NaN();
  o.sequence = 13;
  r = Run(in, out, o);
  for (int k = 0; k < kRanks; ++k) {
    ASSERT_THAT(r[k], IsOk());
    EXPECT_TRUE(std::isnan(out[k][10])) << k;
    EXPECT_FALSE(std::isnan(out[k][kElements - 1])) << k;
  }
}

// Paced: each rank sends at most the given rate, so the collective takes at least its bytes' time
// at that rate, and nothing is lost on the way.
TEST_F(LossyAllReduceTest, PacedSendsKeepTheirRate) {
  constexpr int kRanks = 2;
  constexpr size_t kElements = 50000;  // each rank sends half of 200 KB in each phase
  Connect(kRanks);
  const std::vector<std::vector<float>> in = Inputs(kRanks, kElements);
  std::vector<std::vector<float>> out;
  LossyAllReduceOptions o;
  o.sequence = 3;
  o.phase_timeout = absl::Seconds(5);
  o.send_bytes_per_second = 2e6;  // 100 KB + headers per phase: at least 50 ms each
  const absl::Time start = absl::Now();
  std::vector<absl::StatusOr<LossyAllReduceResult>> r = Run(in, out, o);
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(100));
  EXPECT_LT(took, absl::Seconds(4)) << "everything arrived: no deadline waited for";
  for (int k = 0; k < kRanks; ++k) {
    ASSERT_THAT(r[k], IsOk());
    EXPECT_EQ(r[k]->coverage(), 1.0);
    EXPECT_EQ(r[k]->gathered(), 1.0);
    EXPECT_FLOAT_EQ(out[k][kElements - 1], ExactMean(kRanks, kElements - 1));
  }
}

// What a rank sends that does not fit is dropped and counted: too short, a length that disagrees
// with its count, elements outside the owner's chunk, a second contributor count, a repeat of a
// counted slice. The valid slice among them counts once.
TEST_F(LossyAllReduceTest, MalformedAndRepeatedDatagramsAreRejected) {
  constexpr int kRanks = 3;
  constexpr size_t kElements = 6;  // chunk 0: elements 0 and 1, one slice
  Connect(kRanks);
  const uint64_t tag = 2 * 11;  // sequence 11, reduce-scatter
  auto payload = [](uint64_t first, uint32_t count, uint32_t contributors, std::vector<float> values) {
    std::vector<uint8_t> p(24 + 4 * values.size());  // the announcement (bytes 16-23) 0
    for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(first >> (8 * i));
    for (int i = 0; i < 4; ++i) p[8 + i] = static_cast<uint8_t>(count >> (8 * i));
    for (int i = 0; i < 4; ++i) p[12 + i] = static_cast<uint8_t>(contributors >> (8 * i));
    memcpy(p.data() + 24, values.data(), 4 * values.size());
    return p;
  };
  DatagramTransport& rogue = *transports_[2];
  const std::vector<uint8_t> short_one(8, 0);
  ASSERT_THAT(rogue.Send(0, tag, short_one), IsOk());
  ASSERT_THAT(rogue.Send(0, tag, payload(0, 2, 1, {3, 6, 9})), IsOk());   // 3 values, count 2
  ASSERT_THAT(rogue.Send(0, tag, payload(2, 2, 1, {3, 6})), IsOk());      // chunk 1's elements
  ASSERT_THAT(rogue.Send(0, tag, payload(0, 2, 2, {3, 6})), IsOk());      // contributors 2
  ASSERT_THAT(rogue.Send(0, tag, payload(0, 2, 1, {3, 6})), IsOk());      // valid: rank 2's values
  ASSERT_THAT(rogue.Send(0, tag, payload(0, 2, 1, {300, 600})), IsOk());  // a repeat
  absl::SleepFor(absl::Milliseconds(50));                                 // they wait at rank 0
  const std::vector<std::vector<float>> in = Inputs(kRanks, kElements);
  std::vector<std::vector<float>> out(2, std::vector<float>(kElements));
  LossyAllReduceOptions o;
  o.sequence = 11;
  o.phase_timeout = absl::Milliseconds(300);
  absl::StatusOr<LossyAllReduceResult> r0 = absl::UnknownError("not run");
  std::thread other([&] { (void)LossyAllReduceMean(*transports_[1], o, in[1], absl::MakeSpan(out[1])); });
  r0 = LossyAllReduceMean(*transports_[0], o, in[0], absl::MakeSpan(out[0]));
  other.join();
  ASSERT_THAT(r0, IsOk());
  EXPECT_EQ(r0->rejected, 5u);
  EXPECT_EQ(r0->contributions_arrived, 2u);
  EXPECT_FLOAT_EQ(out[0][0], (1 + 2 + 3) / 3.0f);
  EXPECT_FLOAT_EQ(out[0][1], (2 + 4 + 6) / 3.0f);
  // Bad arguments.
  std::vector<float> small(3);
  EXPECT_THAT(LossyAllReduceMean(*transports_[0], o, in[0], absl::MakeSpan(small)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dynamiq::engine

#include "server/error_probe.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace dynamiq::server {
namespace {

TEST(SampleForErrorTest, IsAPureFunctionOfJobSequenceAndRate) {
  for (uint64_t seq = 0; seq < 1000; ++seq) {
    EXPECT_EQ(SampleForError("job", seq, 0.3), SampleForError("job", seq, 0.3)) << seq;
  }
}

TEST(SampleForErrorTest, RateZeroNeverAndRateOneAlways) {
  for (uint64_t seq = 0; seq < 1000; ++seq) {
    EXPECT_FALSE(SampleForError("job", seq, 0)) << seq;
    EXPECT_FALSE(SampleForError("job", seq, -1)) << seq;
    EXPECT_FALSE(SampleForError("job", seq, std::numeric_limits<double>::quiet_NaN())) << seq;
    EXPECT_TRUE(SampleForError("job", seq, 1)) << seq;
    EXPECT_TRUE(SampleForError("job", seq, 2)) << seq;
  }
}

TEST(SampleForErrorTest, SamplesTheRequestedFraction) {
  const uint64_t n = 200000;
  for (double rate : {0.01, 0.3}) {
    uint64_t hits = 0;
    for (uint64_t seq = 0; seq < n; ++seq) hits += SampleForError("resnet", seq, rate);
    // Binomial: within 5 standard deviations.
    const double mean = n * rate, sigma = std::sqrt(n * rate * (1 - rate));
    EXPECT_NEAR(static_cast<double>(hits), mean, 5 * sigma) << rate;
  }
}

TEST(SampleForErrorTest, NestedRatesAndIndependentJobs) {
  uint64_t both = 0, a = 0, b = 0;
  for (uint64_t seq = 0; seq < 100000; ++seq) {
    // A sample at a lower rate is also one at any higher rate (one threshold on one hash).
    if (SampleForError("a", seq, 0.05)) {
      EXPECT_TRUE(SampleForError("a", seq, 0.2)) << seq;
    }
    const bool sa = SampleForError("a", seq, 0.1), sb = SampleForError("b", seq, 0.1);
    a += sa;
    b += sb;
    both += sa && sb;
  }
  // Different jobs pick (nearly) independent collectives: about 0.1 x 0.1 of them overlap, not 0.1.
  EXPECT_GT(a, 9000u);
  EXPECT_GT(b, 9000u);
  EXPECT_LT(both, 1500u);
  EXPECT_GT(both, 500u);
}

// The engine's transport tags keep the low 24 bits of the sequence (engine/allreduce.cc).
uint64_t TagBits(uint64_t sequence) { return sequence & 0xffffff; }

TEST(ErrorProbeSequenceTest, NeverCollidesWithNeighbouringCollectives) {
  for (uint64_t seq : {uint64_t{0}, uint64_t{1}, uint64_t{12345}, uint64_t{0x7fffff}, uint64_t{0x800000},
                       uint64_t{0xffffff}, uint64_t{0x1000000}, uint64_t{1} << 40}) {
    const uint64_t probe = ErrorProbeSequence(seq);
    EXPECT_NE(probe >> 63, 0u) << seq;  // headers: no real collective has bit 63
    for (uint64_t other : {seq - 1, seq, seq + 1}) {
      EXPECT_NE(probe, other) << seq;
      EXPECT_NE(TagBits(probe), TagBits(other)) << seq << " vs " << other;
    }
    // Nor with the probes of the neighbours.
    EXPECT_NE(TagBits(probe), TagBits(ErrorProbeSequence(seq + 1)));
    EXPECT_NE(probe, ErrorProbeSequence(seq + 1));
  }
}

TEST(VnmseTest, KnownValues) {
  const std::vector<float> exact = {3, 4, 0, 0};  // norm^2 = 25
  std::vector<float> result = exact;
  ASSERT_TRUE(Vnmse(result.data(), exact.data(), 4).has_value());
  EXPECT_EQ(*Vnmse(result.data(), exact.data(), 4), 0.0);
  result = {3, 4, 1, 0};  // error^2 = 1
  EXPECT_DOUBLE_EQ(*Vnmse(result.data(), exact.data(), 4), 1.0 / 25);
  result = {0, 0, 0, 0};  // everything lost: 1
  EXPECT_DOUBLE_EQ(*Vnmse(result.data(), exact.data(), 4), 1.0);
  result = {3.5f, 3, 0.5f, -0.5f};  // 0.25 + 1 + 0.25 + 0.25
  EXPECT_DOUBLE_EQ(*Vnmse(result.data(), exact.data(), 4), 1.75 / 25);
}

TEST(VnmseTest, UndefinedCasesAreNullopt) {
  const std::vector<float> zero(8, 0.0f), one(8, 1.0f);
  EXPECT_FALSE(Vnmse(one.data(), zero.data(), 8).has_value());
  std::vector<float> bad = one;
  bad[3] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(Vnmse(bad.data(), one.data(), 8).has_value());
  EXPECT_FALSE(Vnmse(one.data(), bad.data(), 8).has_value());
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(Vnmse(bad.data(), one.data(), 8).has_value());
}

}  // namespace
}  // namespace dynamiq::server

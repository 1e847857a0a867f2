#include "bench/sweep_bench.h"

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::bench {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

SweepOptions Small() {
  SweepOptions o;
  o.world_size = 2;
  o.transport = "tcp";
  o.topologies = {"ring", "two_shot"};
  kernels::CodecConfig none, dynamiq;
  none.id = kernels::CodecId::kNone;
  dynamiq.id = kernels::CodecId::kDynamiq;
  dynamiq.bits = 5;
  o.codecs = {none, dynamiq};
  o.min_bytes = 8;
  o.max_bytes = 32 << 10;
  o.factor = 8;
  o.min_iterations = 2;
  o.max_iterations = 3;
  o.warmup = 1;
  o.timeout = absl::Seconds(30);
  return o;
}

// Every codec x schedule x size, in order, reported as measured; uncompressed has rounding error
// only, DynamiQ a small error; bus bandwidth is the algorithm's at two ranks.
TEST(SweepBenchTest, MeasuresEveryPointOverRealTransports) {
  const SweepOptions o = Small();
  std::vector<std::string> heard;
  absl::StatusOr<std::vector<SweepPoint>> points =
      RunSweep(o, [&](const SweepPoint& p) { heard.push_back(FormatSweepRow(p)); });
  ASSERT_THAT(points, IsOk());
  // Sizes 8 B, 64 B, 512 B, 4 KiB, 32 KiB: 5 per codec and schedule.
  ASSERT_EQ(points->size(), 2u * 2u * 5u);
  EXPECT_EQ(heard.size(), points->size());
  const std::vector<size_t> elements = {2, 16, 128, 1024, 8192};
  for (size_t i = 0; i < points->size(); ++i) {
    const SweepPoint& p = (*points)[i];
    SCOPED_TRACE(FormatSweepRow(p));
    EXPECT_EQ(p.codec, i < 10 ? "none" : "dynamiq");
    EXPECT_EQ(p.topology, (i / 5) % 2 == 0 ? "ring" : "two_shot");
    EXPECT_EQ(p.elements, elements[i % 5]);
    EXPECT_EQ(p.bytes, 4 * p.elements);
    EXPECT_EQ(p.iterations, 3);
    EXPECT_GT(p.median_us, 0);
    EXPECT_GE(p.p99_us, p.median_us);
    EXPECT_DOUBLE_EQ(p.busbw_gbps, p.algbw_gbps);
    EXPECT_GT(p.wire_bytes_per_rank, 0u);
    if (p.codec == "none") {
      EXPECT_LT(p.vnmse, 1e-12);  // the fp32 sum against the exact (double) one: rounding only
      EXPECT_EQ(p.bits, 0);
    } else {
      EXPECT_TRUE(std::isfinite(p.vnmse));
      if (p.elements >= 1024) {
        EXPECT_GT(p.vnmse, 1e-6);
        EXPECT_LT(p.vnmse, 0.05);
      }
      EXPECT_EQ(p.bits, 5);
    }
  }
  EXPECT_THAT(FormatSweepJson((*points)[0], o), HasSubstr(R"("codec":"none","bits":0,"topology":"ring")"));
}

TEST(SweepBenchTest, RefusesWhatItCannotRun) {
  SweepOptions o = Small();
  o.factor = 1;
  EXPECT_THAT(RunSweep(o, nullptr).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--factor")));
  o = Small();
  o.topologies = {"star"};
  EXPECT_FALSE(RunSweep(o, nullptr).ok());
  o = Small();
  o.codecs.clear();
  EXPECT_THAT(RunSweep(o, nullptr).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dynamiq::bench

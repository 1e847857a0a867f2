#include "engine/stats_exchange.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bf16_math.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(StatsExchangeTest, Bf16RoundTripIsRoundToNearestEven) {
  const std::vector<float> values = {0.0f, -1.5f, 1.0f + 1.0f / 256, 3.14159f, 1e30f, -1e-30f, INFINITY, NAN};
  const std::vector<uint8_t> bytes = EncodeStatsBf16(values);
  ASSERT_EQ(bytes.size(), 2 * values.size());
  std::vector<float> back(values.size());
  ASSERT_THAT(DecodeStatsBf16(bytes, absl::MakeSpan(back)), IsOk());
  for (size_t i = 0; i < values.size(); ++i) {
    const float expected = kernels::Bf16ToFloat(kernels::FloatToBf16(values[i]));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(back[i])) << i;
    } else {
      EXPECT_EQ(back[i], expected) << i;
    }
  }
  EXPECT_EQ(back[2], 1.0f) << "1 + 2^-8 is a tie between bf16 1 and 1 + 2^-7: rounds to even";
}

TEST(StatsExchangeTest, SumsInRankOrderInFp32AndRoundsOnce) {
  // 256 + 1 + 1: in rank order fp32 gives 258 exactly (bf16 keeps it: 8 significant bits); bf16
  // after every addition would stay at 256 (256 + 1 rounds back to 256).
  const std::vector<uint8_t> a = EncodeStatsBf16(std::vector<float>{256.0f, 2.0f});
  const std::vector<uint8_t> b = EncodeStatsBf16(std::vector<float>{1.0f, 3.0f});
  const std::vector<uint8_t> c = EncodeStatsBf16(std::vector<float>{1.0f, -5.0f});
  const std::vector<absl::Span<const uint8_t>> parts = {a, b, c};
  absl::StatusOr<std::vector<uint8_t>> sum = SumStatsBf16(parts, 4);
  ASSERT_THAT(sum, IsOk());
  std::vector<float> out(2);
  ASSERT_THAT(DecodeStatsBf16(*sum, absl::MakeSpan(out)), IsOk());
  EXPECT_EQ(out[0], 258.0f);
  EXPECT_EQ(out[1], 0.0f);
}

TEST(StatsExchangeTest, SizeMismatchesNameTheRank) {
  const std::vector<uint8_t> good(8, 0), short_one(6, 0);
  const std::vector<absl::Span<const uint8_t>> parts = {good, short_one, good};
  EXPECT_THAT(SumStatsBf16(parts, 8), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("statistics from rank 1 have 6 bytes, expected 8")));
  EXPECT_THAT(SumStatsBf16({}, 3), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("odd byte count")));
  std::vector<float> out(3);
  EXPECT_THAT(DecodeStatsBf16(good, absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8 bytes, expected 6")));
}

}  // namespace
}  // namespace dynamiq::engine

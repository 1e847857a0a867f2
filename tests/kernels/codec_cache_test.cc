#include "kernels/codec_cache.h"

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::StatusIs;

TEST(CodecCacheTest, BuildsEachConfigurationOnceAndKeepsTheNewest) {
  CodecCache cache(/*capacity=*/2);
  CodecConfig dq5{CodecId::kDynamiq, 5.0};
  CodecConfig dq4{CodecId::kDynamiq, 4.0};
  CodecConfig none{CodecId::kNone};
  absl::StatusOr<Codec*> first = cache.Get(dq5);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*cache.Get(dq5), *first);  // the same codec, not a rebuilt one
  absl::StatusOr<Codec*> four = cache.Get(dq4);
  ASSERT_TRUE(four.ok());
  EXPECT_NE(*four, *first);
  EXPECT_EQ((*four)->id(), CodecId::kDynamiq);
  // Every field that changes the codec's output is part of the key.
  CodecConfig reseeded = dq4;
  reseeded.seed += 1;
  EXPECT_NE(*cache.Get(reseeded), *four);
  // dq5 was the oldest of three: built again on its next use.
  EXPECT_EQ((*cache.Get(none))->id(), CodecId::kNone);
  EXPECT_THAT(cache.Get(CodecConfig{CodecId::kDynamiq, 12.0}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dynamiq::kernels

#include "common/safe_text.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dynamiq::common {
namespace {

using std::string_literals::operator""s;

TEST(SafeTextTest, KeepsPrintableAsciiAndWellFormedUtf8) {
  EXPECT_EQ(SafeText("rank 1 gave up: b\xcc\x84 = 5, \xe2\x9c\x93 \xf0\x9f\x98\x80"),
            "rank 1 gave up: b\xcc\x84 = 5, \xe2\x9c\x93 \xf0\x9f\x98\x80");
}

TEST(SafeTextTest, EscapesControlsSoNoLineCanBeForgedOrRecoloured) {
  EXPECT_EQ(SafeText("a\r\nE1127 forged\x1b[31m\x7f\t"), "a\\x0d\\x0aE1127 forged\\x1b[31m\\x7f\\x09");
  EXPECT_EQ(SafeText("nul\0here"s), "nul\\x00here");
  EXPECT_EQ(SafeText("c1 \xc2\x85 next"), "c1 \\xc2\\x85 next");  // U+0085, NEL
}

TEST(SafeTextTest, EscapesEveryByteThatIsNotWellFormedUtf8) {
  EXPECT_EQ(SafeText("\xff\xfe"), "\\xff\\xfe");
  EXPECT_EQ(SafeText("stray \x80"), "stray \\x80");
  EXPECT_EQ(SafeText("overlong \xc0\xaf"), "overlong \\xc0\\xaf");
  EXPECT_EQ(SafeText("surrogate \xed\xa0\x80"), "surrogate \\xed\\xa0\\x80");
  EXPECT_EQ(SafeText("too big \xf4\x90\x80\x80"), "too big \\xf4\\x90\\x80\\x80");
  EXPECT_EQ(SafeText("truncated \xe2\x9c"), "truncated \\xe2\\x9c");
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    EXPECT_TRUE(IsValidUtf8(SafeText(one))) << b;
  }
}

TEST(SafeTextTest, CutsAtMaxBytesWithoutSplittingASequence) {
  EXPECT_EQ(SafeText("abcdef", 3), "abc...");
  EXPECT_EQ(SafeText("ab\xe2\x9c\x93", 3), "ab...");
  EXPECT_EQ(SafeText("abc", 3), "abc");
}

TEST(SafeTextTest, IsValidUtf8) {
  EXPECT_TRUE(IsValidUtf8("plain \xe2\x9c\x93"));
  EXPECT_TRUE(IsValidUtf8("controls are valid \x01\n"));
  EXPECT_FALSE(IsValidUtf8("\xff"));
  EXPECT_FALSE(IsValidUtf8("\xe2\x9c"));
}

}  // namespace
}  // namespace dynamiq::common

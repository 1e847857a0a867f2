#include "common/hmac.h"

#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace dynamiq::common {
namespace {

std::string Hex(const HmacSha256::Digest& d) { return HexEncode(d); }

// RFC 4231 test cases 1, 2 and 6 (a key longer than the block size).
TEST(HmacSha256Test, MatchesRfc4231) {
  EXPECT_EQ(Hex(HmacSha256(std::string(20, '\x0b')).Mac("Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(Hex(HmacSha256("Jefe").Mac("what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(Hex(HmacSha256(std::string(131, '\xaa')).Mac("Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(HmacSha256Test, PartsAreConcatenated) {
  const HmacSha256 mac("key");
  EXPECT_EQ(mac.Mac({AsBytes("what do "), AsBytes(""), AsBytes("ya want")}), mac.Mac("what do ya want"));
  EXPECT_NE(mac.Mac("what do ya want"), mac.Mac("what do ya wanT"));
  EXPECT_NE(HmacSha256("key2").Mac("what do ya want"), mac.Mac("what do ya want"));
}

TEST(HmacSha256Test, ConcurrentUseOfOneKeyAgrees) {
  const HmacSha256 mac("shared key");
  const HmacSha256::Digest want = mac.Mac("message");
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) mismatches[t] += mac.Mac("message") != want;
    });
  }
  for (auto& t : threads) t.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST(ConstantTimeEqualsTest, ComparesContentsAndLengths) {
  EXPECT_TRUE(ConstantTimeEquals("secret-token-123", "secret-token-123"));
  EXPECT_FALSE(ConstantTimeEquals("secret-token-123", "secret-token-124"));
  EXPECT_FALSE(ConstantTimeEquals("secret-token-123", "secret-token-12"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

}  // namespace
}  // namespace dynamiq::common

#include "engine/udp_datagram.h"

#include <stdint.h>

#include <string>
#include <vector>

#include "engine/step_auth.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dynamiq::engine {
namespace {

using ::testing::ElementsAreArray;

constexpr uint64_t kConnection = 0x1122334455667788;
constexpr uint32_t kReceiver = 1, kSize = 4;
constexpr size_t kMaxPayload = 1412;

common::HmacSha256::Digest JobKey(const char* job = "job") { return StepAuthenticator::KeyForJob("secret", job); }

std::vector<uint8_t> Payload(size_t n) {
  std::vector<uint8_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(i * 31 + 7);
  return p;
}

DatagramVerdict Verdict(const std::vector<uint8_t>& d, const DatagramKey& key) {
  return ParseDatagram(d, key, kReceiver, kSize, kMaxPayload).verdict;
}

TEST(UdpDatagramTest, TheHeaderIsLittleEndianAtFixedOffsets) {
  DatagramHeader h;
  h.keyed = true;
  h.connection = kConnection;
  h.source = 2;
  h.destination = 3;
  h.tag = 0x0102030405060708;
  h.sequence = 9;
  h.payload_bytes = 0x0A0B;
  const DatagramHeaderBytes b = EncodeDatagramHeader(h);
  EXPECT_EQ(std::string(b.begin(), b.begin() + 4), "DQDG");
  EXPECT_EQ(b[4], 1);  // version
  EXPECT_EQ(b[5], 1);  // keyed
  EXPECT_EQ(b[6] | b[7], 0);
  EXPECT_EQ(b[8], 0x88);
  EXPECT_EQ(b[15], 0x11);
  EXPECT_EQ(b[16], 2);
  EXPECT_EQ(b[20], 3);
  EXPECT_EQ(b[24], 0x08);
  EXPECT_EQ(b[31], 0x01);
  EXPECT_EQ(b[32], 9);
  EXPECT_EQ(b[40], 0x0B);
  EXPECT_EQ(b[41], 0x0A);
}

TEST(UdpDatagramTest, ASealedDatagramParsesBackWithItsFieldsAndPayload) {
  for (bool keyed : {false, true}) {
    const DatagramKey key(kConnection, keyed ? std::optional(JobKey()) : std::nullopt);
    for (size_t n : {size_t{0}, size_t{1}, size_t{100}, kMaxPayload}) {
      const std::vector<uint8_t> payload = Payload(n);
      const std::vector<uint8_t> d = SealDatagram(key, 3, kReceiver, 42, 7, payload);
      ASSERT_EQ(d.size(), kDatagramOverheadBytes + n);
      const ParsedDatagram p = ParseDatagram(d, key, kReceiver, kSize, kMaxPayload);
      ASSERT_EQ(p.verdict, DatagramVerdict::kAccepted) << n << " bytes, keyed " << keyed;
      EXPECT_EQ(p.header.keyed, keyed);
      EXPECT_EQ(p.header.connection, kConnection);
      EXPECT_EQ(p.header.source, 3u);
      EXPECT_EQ(p.header.destination, kReceiver);
      EXPECT_EQ(p.header.tag, 42u);
      EXPECT_EQ(p.header.sequence, 7u);
      EXPECT_EQ(p.header.payload_bytes, n);
      EXPECT_THAT(p.payload, ElementsAreArray(payload));
      EXPECT_EQ(p.payload.data(), d.data() + kDatagramHeaderBytes);
    }
  }
}

TEST(UdpDatagramTest, EveryTruncationAndEveryExtensionIsMalformed) {
  const DatagramKey key(kConnection, JobKey());
  const std::vector<uint8_t> d = SealDatagram(key, 0, kReceiver, 1, 1, Payload(200));
  for (size_t n = 0; n < d.size(); ++n) {
    EXPECT_EQ(Verdict(std::vector<uint8_t>(d.begin(), d.begin() + n), key), DatagramVerdict::kMalformed) << n;
  }
  std::vector<uint8_t> longer = d;
  longer.push_back(0);
  EXPECT_EQ(Verdict(longer, key), DatagramVerdict::kMalformed);
}

TEST(UdpDatagramTest, BadFixedFieldsAreMalformed) {
  const DatagramKey key(kConnection, JobKey());
  const std::vector<uint8_t> good = SealDatagram(key, 0, kReceiver, 1, 1, Payload(10));
  ASSERT_EQ(Verdict(good, key), DatagramVerdict::kAccepted);
  // Magic, version, unknown flag bits, reserved, payload length.
  for (size_t offset : {size_t{0}, size_t{3}, size_t{4}, size_t{6}, size_t{7}, size_t{40}, size_t{43}}) {
    std::vector<uint8_t> d = good;
    d[offset] ^= 0x10;
    EXPECT_EQ(Verdict(d, key), DatagramVerdict::kMalformed) << "byte " << offset;
  }
  std::vector<uint8_t> flags = good;
  flags[5] |= 2;
  EXPECT_EQ(Verdict(flags, key), DatagramVerdict::kMalformed);
  // Sequence 0 is never sent.
  EXPECT_EQ(Verdict(SealDatagram(key, 0, kReceiver, 1, 0, Payload(10)), key), DatagramVerdict::kMalformed);
  // A payload over the receiver's limit, though the datagram is consistent.
  const std::vector<uint8_t> big = SealDatagram(key, 0, kReceiver, 1, 1, Payload(kMaxPayload + 1));
  EXPECT_EQ(Verdict(big, key), DatagramVerdict::kMalformed);
}

TEST(UdpDatagramTest, AnotherConnectionsDatagramIsForeignAndStraysAreStray) {
  const DatagramKey key(kConnection, JobKey());
  const DatagramKey other(kConnection + 1, JobKey());
  EXPECT_EQ(Verdict(SealDatagram(other, 0, kReceiver, 1, 1, Payload(10)), key), DatagramVerdict::kForeign);
  EXPECT_EQ(Verdict(SealDatagram(key, kSize, kReceiver, 1, 1, Payload(10)), key), DatagramVerdict::kStray);
  EXPECT_EQ(Verdict(SealDatagram(key, kReceiver, kReceiver, 1, 1, Payload(10)), key), DatagramVerdict::kStray);
  EXPECT_EQ(Verdict(SealDatagram(key, 0, 2, 1, 1, Payload(10)), key), DatagramVerdict::kStray);
}

TEST(UdpDatagramTest, AnyChangedBitAnotherKeyOrNoKeyFailsAuthentication) {
  const DatagramKey key(kConnection, JobKey());
  const std::vector<uint8_t> good = SealDatagram(key, 0, kReceiver, 5, 9, Payload(64));
  // Fields whose change the fixed checks do not catch: tag, sequence, the payload, the trailer.
  for (size_t offset : {size_t{24}, size_t{32}, kDatagramHeaderBytes, kDatagramHeaderBytes + 63, good.size() - 1}) {
    std::vector<uint8_t> d = good;
    d[offset] ^= 1;
    EXPECT_EQ(Verdict(d, key), DatagramVerdict::kUnauthenticated) << "byte " << offset;
  }
  const DatagramKey other_job(kConnection, JobKey("another job"));
  EXPECT_EQ(Verdict(SealDatagram(other_job, 0, kReceiver, 5, 9, Payload(64)), key), DatagramVerdict::kUnauthenticated);
  const DatagramKey checksum(kConnection, std::nullopt);
  EXPECT_EQ(Verdict(SealDatagram(checksum, 0, kReceiver, 5, 9, Payload(64)), key), DatagramVerdict::kUnauthenticated);
  // ... and a keyed datagram at a transport without the key.
  EXPECT_EQ(Verdict(good, checksum), DatagramVerdict::kUnauthenticated);
  // Without a key the checksum still catches corruption.
  std::vector<uint8_t> corrupt = SealDatagram(checksum, 0, kReceiver, 5, 9, Payload(64));
  ASSERT_EQ(Verdict(corrupt, checksum), DatagramVerdict::kAccepted);
  corrupt[kDatagramHeaderBytes + 10] ^= 0x40;
  EXPECT_EQ(Verdict(corrupt, checksum), DatagramVerdict::kUnauthenticated);
}

TEST(ReplayWindowTest, EachSequenceOnceInAnyOrderWithinTheWindow) {
  ReplayWindow w;
  EXPECT_FALSE(w.Accept(0));
  EXPECT_TRUE(w.Accept(1));
  EXPECT_FALSE(w.Accept(1));
  EXPECT_TRUE(w.Accept(5));
  EXPECT_TRUE(w.Accept(3));  // late, but not seen
  EXPECT_FALSE(w.Accept(3));
  EXPECT_TRUE(w.Accept(2));
  EXPECT_TRUE(w.Accept(4));
  for (uint64_t s = 1; s <= 5; ++s) EXPECT_FALSE(w.Accept(s)) << s;
  EXPECT_EQ(w.highest(), 5u);
}

TEST(ReplayWindowTest, TooOldIsRefusedAndSlotsAreReusedCleanly) {
  ReplayWindow w;
  const uint64_t kW = ReplayWindow::kWindow;
  EXPECT_TRUE(w.Accept(10));
  EXPECT_TRUE(w.Accept(10 + kW - 1));  // 10 still inside
  EXPECT_FALSE(w.Accept(10));
  EXPECT_TRUE(w.Accept(11));
  EXPECT_TRUE(w.Accept(10 + kW));  // 10 slides out: too old, even though never seen twice
  EXPECT_FALSE(w.Accept(10));
  // The slot of 11 is 11 + kW's: advancing to it must not read 11's bit as its own.
  EXPECT_TRUE(w.Accept(11 + kW));
  EXPECT_FALSE(w.Accept(11 + kW));
  // A jump past the whole window forgets everything below it.
  EXPECT_TRUE(w.Accept(100 * kW));
  EXPECT_FALSE(w.Accept(11 + kW));
  EXPECT_TRUE(w.Accept(100 * kW - 1));
  EXPECT_TRUE(w.Accept(99 * kW + 1));
  EXPECT_FALSE(w.Accept(99 * kW));
}

TEST(ReplayWindowTest, AgreesWithAModelOnAShuffledStreamWithDuplicates) {
  ReplayWindow w;
  std::vector<bool> seen(20000, false);
  uint64_t highest = 0;
  uint32_t x = 12345;
  for (int i = 0; i < 50000; ++i) {
    x = x * 1664525u + 1013904223u;
    // Mostly forward, sometimes far back or a repeat.
    const uint64_t s = std::max<int64_t>(
        1, std::min<int64_t>(19999, static_cast<int64_t>(i / 3) - static_cast<int64_t>((x >> 8) % 5000)));
    const bool fresh = !seen[s] && (s > highest || highest - s < ReplayWindow::kWindow);
    EXPECT_EQ(w.Accept(s), fresh) << "sequence " << s << " after " << highest;
    if (fresh) {
      seen[s] = true;
      highest = std::max(highest, s);
    }
  }
}

TEST(UdpConnectionIdTest, DependsOnEveryValueAndItsPlace) {
  const std::vector<std::string> a = {"127.0.0.1:1000 00112233aabbccdd", "127.0.0.1:1001 0011223344556677"};
  std::vector<std::string> b = a;
  EXPECT_EQ(UdpConnectionId(a), UdpConnectionId(b));
  b[1].back() = '8';  // a rank's new incarnation
  EXPECT_NE(UdpConnectionId(a), UdpConnectionId(b));
  EXPECT_NE(UdpConnectionId(a), UdpConnectionId({a[1], a[0]}));
  // Length-prefixed: moving bytes between values changes it.
  EXPECT_NE(UdpConnectionId({"ab", "c"}), UdpConnectionId({"a", "bc"}));
}

}  // namespace
}  // namespace dynamiq::engine

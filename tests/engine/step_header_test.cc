#include "engine/step_header.h"

#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

StepHeader Sample() {
  StepHeader h;
  h.phase = Phase::kAllGather;
  h.codec = 2;
  h.bits_x1000 = 5000;
  h.sender = 3;
  h.job_id = 0x1122334455667788ull;
  h.config_epoch = 9;
  h.sequence = 1234567;
  h.step = 6;
  h.block = 2;
  h.payload_bytes = 4096;
  h.checksum = 0xdeadbeefcafef00dull;
  return h;
}

TEST(StepHeaderTest, RoundTrip) {
  auto bytes = EncodeStepHeader(Sample());
  auto h = DecodeStepHeader(bytes);
  ASSERT_THAT(h, IsOk());
  EXPECT_EQ(h->phase, Phase::kAllGather);
  EXPECT_EQ(h->job_id, 0x1122334455667788ull);
  EXPECT_EQ(h->sequence, 1234567u);
  EXPECT_EQ(h->payload_bytes, 4096u);
  EXPECT_EQ(h->checksum, 0xdeadbeefcafef00dull);
  EXPECT_THAT(MatchStepHeader(*h, Sample()), IsOk());
}

TEST(StepHeaderTest, RejectsGarbage) {
  auto bytes = EncodeStepHeader(Sample());
  auto bad = bytes;
  bad[0] ^= 1;
  EXPECT_THAT(DecodeStepHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("magic")));
  bad = bytes;
  bad[5] = 9;
  EXPECT_THAT(DecodeStepHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("phase")));
  bad = bytes;
  bad[53] = 1;
  EXPECT_THAT(DecodeStepHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reserved")));
  EXPECT_THAT(DecodeStepHeader(absl::MakeConstSpan(bytes.data(), 10)), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(StepHeaderTest, MismatchNamesTheRankAndBothValues) {
  StepHeader got = Sample(), want = Sample();
  got.config_epoch = 8;
  got.codec = 3;
  EXPECT_THAT(MatchStepHeader(got, want),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("rank 3 runs a different collective: config epoch 8 (expected 9), codec mxfp8 "
                                 "(expected dynamiq)")));
}

TEST(StepHeaderTest, ChecksumSeesEveryByte) {
  std::vector<uint8_t> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7);
  const uint64_t base = PayloadChecksum(data);
  for (size_t i = 0; i < data.size(); i += 37) {
    data[i] ^= 0x10;
    EXPECT_NE(PayloadChecksum(data), base) << i;
    data[i] ^= 0x10;
  }
  EXPECT_NE(PayloadChecksum(absl::MakeConstSpan(data.data(), 999)), base);
}

}  // namespace
}  // namespace dynamiq::engine

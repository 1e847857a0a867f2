#include "engine/step_header.h"

#include <cstring>
#include <vector>

#include "common/status_macros.h"
#include "engine/schedule.h"
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

TEST(StepHeaderTest, AuthenticatedHeadersCarryATagInsteadOfTheChecksum) {
  StepHeader h = Sample();
  h.authenticated = true;
  for (size_t i = 0; i < kStepTagBytes; ++i) h.tag[i] = static_cast<uint8_t>(0xa0 + i);
  const auto bytes = EncodeStepHeader(h);
  EXPECT_EQ(bytes[7], 1);  // flags
  EXPECT_EQ(0, std::memcmp(&bytes[kStepHeaderMacCoverage], h.tag.data(), kStepTagBytes));
  auto decoded = DecodeStepHeader(bytes);
  ASSERT_THAT(decoded, IsOk());
  EXPECT_TRUE(decoded->authenticated);
  EXPECT_EQ(decoded->tag, h.tag);
  EXPECT_EQ(decoded->checksum, 0u);
  EXPECT_THAT(MatchStepHeader(*decoded, Sample()), IsOk());
  // Unauthenticated headers have flags 0 and no tag.
  auto plain = DecodeStepHeader(EncodeStepHeader(Sample()));
  ASSERT_THAT(plain, IsOk());
  EXPECT_FALSE(plain->authenticated);
  EXPECT_EQ(plain->tag, StepTag{});
}

TEST(StepHeaderTest, RejectsUnknownFlagsAndVersionOne) {
  auto bytes = EncodeStepHeader(Sample());
  EXPECT_EQ(bytes[4], 2);
  auto bad = bytes;
  bad[7] = 0x10;  // bits 1-3 are the schedule
  EXPECT_THAT(DecodeStepHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown flags 16")));
  bad = bytes;
  bad[4] = 1;
  EXPECT_THAT(DecodeStepHeader(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version 1, this build speaks 2")));
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

TEST(StepHeaderTest, CarriesTheScheduleAndRefusesARankThatRunsAnother) {
  StepHeader butterfly = Sample();
  butterfly.schedule = ScheduleId(Topology::kButterfly);
  butterfly.authenticated = true;  // the schedule bits sit beside the authentication flag
  auto decoded = DecodeStepHeader(EncodeStepHeader(butterfly));
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(decoded->schedule, ScheduleId(Topology::kButterfly));
  EXPECT_TRUE(decoded->authenticated);
  EXPECT_EQ(DecodeStepHeader(EncodeStepHeader(Sample()))->schedule, ScheduleId(Topology::kRing));
  EXPECT_THAT(MatchStepHeader(*decoded, Sample()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("schedule butterfly (expected ring)")));
}

// Two-shot is schedule 2 in the flags' bits 1-3, named in a mismatch either way.
TEST(StepHeaderTest, CarriesTheTwoShotScheduleAndNamesIt) {
  StepHeader two_shot = Sample();
  two_shot.schedule = ScheduleId(Topology::kTwoShot);
  EXPECT_EQ(two_shot.schedule, 2);
  const auto bytes = EncodeStepHeader(two_shot);
  EXPECT_EQ(bytes[7], 2 << 1);
  auto decoded = DecodeStepHeader(bytes);
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(decoded->schedule, ScheduleId(Topology::kTwoShot));
  StepHeader butterfly = Sample();
  butterfly.schedule = ScheduleId(Topology::kButterfly);
  EXPECT_THAT(MatchStepHeader(*decoded, butterfly),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("schedule two_shot (expected butterfly)")));
  EXPECT_THAT(MatchStepHeader(Sample(), *decoded),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("schedule ring (expected two_shot)")));
}

TEST(StepHeaderTest, AnotherCollectiveIdIsTypedThroughAnnotations) {
  StepHeader got = Sample(), want = Sample();
  got.job_id = want.job_id + 1;  // another tensor, size or dtype hashes to another id
  const absl::Status mismatch = MatchStepHeader(got, want);
  EXPECT_TRUE(IsDifferentCollective(mismatch));
  // What the engine and the daemon put before it on the way up keeps the mark.
  const absl::Status annotated = common::Annotate(common::Annotate(mismatch, "from rank 3"), "rank 0");
  EXPECT_THAT(annotated, StatusIs(absl::StatusCode::kFailedPrecondition,
                                  HasSubstr("rank 0: from rank 3: rank 3 runs a different collective: job")));
  EXPECT_TRUE(IsDifferentCollective(annotated));
  // The same collective under another configuration epoch is not another collective.
  StepHeader later = Sample();
  later.config_epoch = want.config_epoch + 1;
  EXPECT_FALSE(IsDifferentCollective(MatchStepHeader(later, want)));
  EXPECT_FALSE(IsDifferentCollective(absl::FailedPreconditionError("rank 3 runs a different collective: job 1")));
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

TEST(StepHeaderTest, ChecksumSeesOrder) {
  // Bytes in the wrong place (stripes or words swapped, e.g. a receive into the wrong offset).
  std::vector<uint8_t> data(4096);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  const uint64_t base = PayloadChecksum(data);
  std::vector<uint8_t> stripes = data;
  std::swap_ranges(stripes.begin(), stripes.begin() + 64, stripes.begin() + 640);
  EXPECT_NE(PayloadChecksum(stripes), base);
  std::vector<uint8_t> words = data;
  std::swap_ranges(words.begin() + 128, words.begin() + 136, words.begin() + 136);
  EXPECT_NE(PayloadChecksum(words), base);
  std::vector<uint8_t> zeros(4096, 0), more_zeros(4160, 0);
  EXPECT_NE(PayloadChecksum(zeros), PayloadChecksum(more_zeros));
}

}  // namespace
}  // namespace dynamiq::engine

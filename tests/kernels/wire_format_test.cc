#include "kernels/wire_format.h"

#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::kernels {
namespace {

using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<uint8_t> Encoded(const ChunkHeader& h, size_t payload) {
  std::vector<uint8_t> bytes(kChunkHeaderBytes + payload, 0xab);
  WriteChunkHeader(h, absl::MakeSpan(bytes));
  return bytes;
}

ChunkHeader Sample() {
  ChunkHeader h;
  h.codec = CodecId::kDynamiq;
  h.element_bits = 0;
  h.flags = kFlagCorrelated;
  h.num_elements = 1000;
  h.chunk_id = 3;
  h.round = 77;
  h.num_summands = 5;
  h.payload_bytes = 40;
  h.param = 1.5f;
  return h;
}

TEST(WireFormatTest, RoundTrip) {
  auto bytes = Encoded(Sample(), 40);
  auto parsed = ParseChunkHeader(bytes);
  DQ_ASSERT_OK(parsed);
  EXPECT_EQ(parsed->codec, CodecId::kDynamiq);
  EXPECT_EQ(parsed->flags, kFlagCorrelated);
  EXPECT_EQ(parsed->num_elements, 1000u);
  EXPECT_EQ(parsed->chunk_id, 3u);
  EXPECT_EQ(parsed->round, 77u);
  EXPECT_EQ(parsed->num_summands, 5);
  EXPECT_EQ(parsed->payload_bytes, 40u);
  EXPECT_EQ(parsed->param, 1.5f);
  EXPECT_EQ(bytes[0], 'D');
  EXPECT_EQ(bytes[1], 'Q');
  EXPECT_EQ(bytes[2], 'C');
  EXPECT_EQ(bytes[3], '1');
}

TEST(WireFormatTest, RejectsTruncatedHeader) {
  auto bytes = Encoded(Sample(), 40);
  for (size_t n = 0; n < kChunkHeaderBytes; ++n) {
    EXPECT_THAT(ParseChunkHeader(absl::MakeConstSpan(bytes.data(), n)),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
  }
}

TEST(WireFormatTest, RejectsTruncatedPayload) {
  auto bytes = Encoded(Sample(), 40);
  bytes.resize(bytes.size() - 1);
  EXPECT_THAT(ParseChunkHeader(bytes), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("announces 40")));
}

TEST(WireFormatTest, RejectsBadFields) {
  auto bytes = Encoded(Sample(), 40);
  auto bad = bytes;
  bad[0] = 'X';
  EXPECT_THAT(ParseChunkHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("magic")));
  bad = bytes;
  bad[4] = 9;
  EXPECT_THAT(ParseChunkHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version 9")));
  bad = bytes;
  bad[5] = 200;
  EXPECT_THAT(ParseChunkHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("codec id 200")));
  bad = bytes;
  bad[22] = 1;
  EXPECT_THAT(ParseChunkHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reserved")));
  bad = bytes;
  bad[11] = 0x7f;  // ~2^30 * 2 elements
  EXPECT_THAT(ParseChunkHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("limit")));
  bad = bytes;
  bad[20] = bad[21] = 0;
  EXPECT_THAT(ParseChunkHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 summands")));
  bad = bytes;
  bad[31] = 0x7f;
  bad[30] = 0xc0;  // param = NaN
  EXPECT_THAT(ParseChunkHeader(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not finite")));
}

TEST(WireFormatTest, ValidateNamesTheMismatch) {
  ChunkHeader h = Sample();
  BucketPlan plan;
  plan.round.round = 77;
  ChunkRef chunk{3, 0, 1000};
  EXPECT_TRUE(ValidateChunkHeader(h, CodecId::kDynamiq, plan, chunk, 40).ok());
  EXPECT_THAT(ValidateChunkHeader(h, CodecId::kMxfp8, plan, chunk, 40),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("codec dynamiq, expected mxfp8")));
  EXPECT_THAT(ValidateChunkHeader(h, CodecId::kDynamiq, plan, ChunkRef{3, 0, 999}, 40),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1000 elements, expected 999")));
  plan.round.round = 78;
  EXPECT_THAT(ValidateChunkHeader(h, CodecId::kDynamiq, plan, chunk, 40),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("round 77, expected round 78")));
}

}  // namespace
}  // namespace dynamiq::kernels

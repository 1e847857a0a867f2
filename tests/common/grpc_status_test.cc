// common/grpc_status.h: codes and messages cross gRPC unchanged; long messages are cut.
#include "common/grpc_status.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dynamiq::common {
namespace {

using ::testing::EndsWith;

TEST(GrpcStatusTest, CodesAndMessagesRoundTrip) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  for (absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound, absl::StatusCode::kFailedPrecondition,
        absl::StatusCode::kUnavailable, absl::StatusCode::kResourceExhausted, absl::StatusCode::kDeadlineExceeded}) {
    const absl::Status s(code, "what went wrong");
    const grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), static_cast<int>(code));
    EXPECT_EQ(g.error_message(), "what went wrong");
    EXPECT_EQ(FromGrpcStatus(g), s);
  }
}

TEST(GrpcStatusTest, LongMessagesAreCutAndSayHowLongTheyWere) {
  const grpc::Status g = ToGrpcStatus(absl::InvalidArgumentError(std::string(10000, 'x')));
  EXPECT_LT(g.error_message().size(), 2100u);
  EXPECT_THAT(g.error_message(), EndsWith("... (10000 bytes)"));
}

}  // namespace
}  // namespace dynamiq::common

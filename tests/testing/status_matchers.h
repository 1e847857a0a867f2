// GoogleTest helpers for absl::Status (abseil 20220623 has no status_matchers.h).
#ifndef DQ_TESTS_TESTING_STATUS_MATCHERS_H_
#define DQ_TESTS_TESTING_STATUS_MATCHERS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dynamiq::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status: " << s;
  return s.ok();
}

// StatusIs(code) / StatusIs(code, HasSubstr("...")): test the specific error, never just "not ok".
MATCHER_P(StatusIs, code, "") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status: " << s;
  return ::testing::Matches(code)(s.code());
}
MATCHER_P2(StatusIs, code, message_matcher, "") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status: " << s;
  return ::testing::Matches(code)(s.code()) && ::testing::Matches(message_matcher)(std::string(s.message()));
}

// A StatusOr that is OK and whose value matches `value_matcher`.
MATCHER_P(IsOkAndHolds, value_matcher, "") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace dynamiq::testing

#define DQ_ASSERT_OK(expr) ASSERT_THAT((expr), ::dynamiq::testing::IsOk())
#define DQ_EXPECT_OK(expr) EXPECT_THAT((expr), ::dynamiq::testing::IsOk())

#endif  // DQ_TESTS_TESTING_STATUS_MATCHERS_H_

// DaemonOptions (server/daemon_options.h): the checks ValidateDaemonOptions makes before a daemon
// binds anything; here --codec_threads.
#include "server/daemon_options.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(DaemonOptionsTest, CodecThreadsMustBeOneToTheMaximum) {
  DaemonOptions o;
  EXPECT_EQ(o.codec_threads, 1);  // in-process daemons start no codec threads unless asked
  for (int threads : {1, 2, 16, kMaxCodecThreads}) {
    o.codec_threads = threads;
    EXPECT_THAT(ValidateDaemonOptions(o), IsOk()) << threads;
  }
  for (int threads : {0, -1, kMaxCodecThreads + 1, 100000}) {
    o.codec_threads = threads;
    EXPECT_THAT(ValidateDaemonOptions(o),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("--codec_threads must be in [1, 256], got ", threads))));
  }
}

}  // namespace
}  // namespace dynamiq::server

#include "common/secret_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::common {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

class SecretFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dqsecret-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& contents, mode_t mode) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << contents;
    EXPECT_EQ(chmod(path.c_str(), mode), 0);
    return path;
  }

  std::string dir_;
};

TEST_F(SecretFileTest, ReadsAnOwnerOnlyFileAndTrimsIt) {
  const std::string path = Write("secret", "  0123456789abcdef0123\n", 0600);
  EXPECT_THAT(ReadSecret(path, "--cluster_secret_file"), IsOk());
  EXPECT_EQ(*ReadSecret(path, "--cluster_secret_file"), "0123456789abcdef0123");
  EXPECT_EQ(*ReadSecret(Write("ro", "0123456789abcdef0123", 0400), "--f"), "0123456789abcdef0123");
}

TEST_F(SecretFileTest, RefusesFilesOthersCanReadOrWrite) {
  for (mode_t mode : {0640, 0604, 0644, 0620, 0602, 0660, 0666}) {
    const std::string path = Write("loose", "0123456789abcdef0123", mode);
    char octal[8];
    std::snprintf(octal, sizeof(octal), "0%o", mode);
    EXPECT_THAT(
        ReadSecret(path, "--operator_token_file"),
        StatusIs(absl::StatusCode::kFailedPrecondition,
                 AllOf(HasSubstr("--operator_token_file"), HasSubstr(path), HasSubstr(octal), HasSubstr("chmod 600"))))
        << octal;
  }
}

TEST_F(SecretFileTest, FollowsSymlinksAndChecksTheTarget) {
  // Kubernetes mounts Secret keys as symlinks into a ..data directory.
  const std::string target = Write("target", "0123456789abcdef0123", 0600);
  const std::string link = dir_ + "/link";
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  EXPECT_THAT(ReadSecret(link, "--f"), IsOk());
  ASSERT_EQ(chmod(target.c_str(), 0644), 0);
  EXPECT_THAT(ReadSecret(link, "--f"), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("0644")));
}

TEST_F(SecretFileTest, MissingShortDirectoryAndEmpty) {
  EXPECT_THAT(ReadSecret(dir_ + "/nope", "--f"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  EXPECT_THAT(ReadSecret(dir_, "--f"), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a regular")));
  EXPECT_THAT(ReadSecret(Write("short", "abc\n", 0600), "--f"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("openssl rand -hex 32")));
  EXPECT_THAT(ReadSecret("", "--f"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ReadTokens(Write("empty", "\n\n", 0600), "--f"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no token")));
}

TEST_F(SecretFileTest, TokensOnePerLineVisibleAsciiNeverEchoed) {
  EXPECT_THAT(*ReadTokens(Write("two", "first-token-0123456\n\n  second-token-0123456  \n", 0600), "--f"),
              ElementsAre("first-token-0123456", "second-token-0123456"));
  const absl::StatusOr<std::vector<std::string>> spaced =
      ReadTokens(Write("spaced", "tok en-0123456789abcdef\n", 0600), "--f");
  EXPECT_THAT(spaced, StatusIs(absl::StatusCode::kInvalidArgument,
                               AllOf(HasSubstr("line 1"), Not(HasSubstr("0123456789abcdef")))));
  EXPECT_THAT(ReadTokens(Write("shorttok", "ok-token-0123456789\nshort\n", 0600), "--f"),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("line 2"), Not(HasSubstr("short\"")))));
}

TEST_F(SecretFileTest, PublicFilesSkipTheModeCheck) {
  EXPECT_THAT(ReadPublicFile(Write("cert", "-----BEGIN CERTIFICATE-----\n", 0644), "--tls_cert"), IsOk());
}

}  // namespace
}  // namespace dynamiq::common

// What this binary was built from: the CMake project version and the git commit at configure time
// (`git rev-parse --short HEAD`; "unknown" outside a git checkout). Reported as
// dynamiq_build_info{version, git_commit} and in GetStatus.
#ifndef DQ_SERVER_BUILD_INFO_H_
#define DQ_SERVER_BUILD_INFO_H_

#include "absl/strings/string_view.h"

namespace dynamiq::server {

absl::string_view BuildVersion();
absl::string_view BuildGitCommit();

}  // namespace dynamiq::server

#endif  // DQ_SERVER_BUILD_INFO_H_

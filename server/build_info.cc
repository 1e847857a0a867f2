#include "server/build_info.h"

// Set by server/CMakeLists.txt on this file only, so a new commit recompiles one file.
#ifndef DQ_VERSION
#define DQ_VERSION "unknown"
#endif
#ifndef DQ_GIT_COMMIT
#define DQ_GIT_COMMIT "unknown"
#endif

namespace dynamiq::server {

absl::string_view BuildVersion() { return DQ_VERSION; }
absl::string_view BuildGitCommit() { return DQ_GIT_COMMIT; }

}  // namespace dynamiq::server

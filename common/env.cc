#include "common/env.h"

#include <stdlib.h>
#include <unistd.h>

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace dynamiq::common {
namespace {

// Records the first error only: the message should name the variable to fix first.
void AddError(ClientEnv& env, absl::string_view name, absl::string_view value, absl::string_view expected) {
  if (!env.status.ok()) return;
  env.status = absl::InvalidArgumentError(absl::StrCat("environment variable ", name, "='", value, "' is not ",
                                                       expected, " (unset it to use the default)"));
}

}  // namespace

std::string DefaultWorkerSocket() {
  const uid_t uid = geteuid();
  if (uid == 0) return "/run/dynamiq/dynamiqd.sock";
  return absl::StrCat("/tmp/dynamiq-", uid, "/dynamiqd.sock");
}

ClientEnv ClientEnv::Parse(absl::FunctionRef<const char*(const char*)> lookup) {
  ClientEnv env;
  auto get = [&](const char* name) -> absl::string_view {
    const char* v = lookup(name);
    return v == nullptr ? absl::string_view() : absl::string_view(v);
  };

  if (absl::string_view v = get("DQ_SOCKET"); !v.empty()) env.socket_path = std::string(v);
  if (absl::string_view v = get("DQ_JOB"); !v.empty()) env.job_id = std::string(v);

  uint32_t local_world_size = env.local_world_size;
  if (absl::string_view v = get("DQ_LOCAL_WORLD_SIZE"); !v.empty()) {
    if (absl::SimpleAtoi(v, &local_world_size) && local_world_size >= 1) {
      env.local_world_size = local_world_size;
    } else {
      AddError(env, "DQ_LOCAL_WORLD_SIZE", v, "a positive integer");
    }
  }
  if (absl::string_view v = get("DQ_LOCAL_RANK"); !v.empty()) {
    uint32_t local_rank = 0;
    if (!absl::SimpleAtoi(v, &local_rank)) {
      AddError(env, "DQ_LOCAL_RANK", v, "a non-negative integer");
    } else if (local_rank >= env.local_world_size) {
      AddError(env, "DQ_LOCAL_RANK", v, absl::StrCat("below DQ_LOCAL_WORLD_SIZE (", env.local_world_size, ")"));
    } else {
      env.local_rank = local_rank;
    }
  }
  if (absl::string_view v = get("DQ_TIMEOUT_SECONDS"); !v.empty()) {
    double seconds = 0;
    if (absl::SimpleAtod(v, &seconds) && std::isfinite(seconds) && seconds > 0) {
      env.timeout = absl::Seconds(seconds);
    } else {
      AddError(env, "DQ_TIMEOUT_SECONDS", v, "a positive number of seconds");
    }
  }
  if (absl::string_view v = get("DQ_SUBMISSION_RING"); !v.empty()) {
    bool on = true;
    if (absl::SimpleAtob(v, &on)) {
      env.submission_ring = on;
    } else {
      AddError(env, "DQ_SUBMISSION_RING", v, "1, 0, true or false");
    }
  }
  return env;
}

const ClientEnv& ClientEnv::Get() {
  static const ClientEnv* const env = new ClientEnv(Parse([](const char* name) { return ::getenv(name); }));
  return *env;
}

}  // namespace dynamiq::common

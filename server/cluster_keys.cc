#include "server/cluster_keys.h"

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace dynamiq::server::internal {

std::string JobPrefix(const std::string& job_id) {
  std::string escaped;
  for (char c : job_id) {
    if (c == '%') {
      escaped += "%25";
    } else if (c == '/') {
      escaped += "%2F";
    } else {
      escaped += c;
    }
  }
  return absl::StrCat("job/", escaped, "/");
}

std::string JobKey(const std::string& job_id, uint64_t incarnation) {
  return absl::StrCat(JobPrefix(job_id), "inc", incarnation);
}

absl::StatusOr<std::pair<uint64_t, std::optional<std::string>>> ReadCounter(engine::Store& store,
                                                                            const std::string& key) {
  absl::StatusOr<std::string> value = store.Get(key, absl::ZeroDuration());
  if (value.ok()) {
    uint64_t count = 0;
    if (!absl::SimpleAtoi(*value, &count)) {
      return absl::DataLossError(absl::StrCat("malformed ", key, " '", *value, "'"));
    }
    return std::make_pair(count, std::optional<std::string>(*value));
  }
  if (!absl::IsDeadlineExceeded(value.status()) && !absl::IsNotFound(value.status())) return value.status();
  return std::make_pair(uint64_t{0}, std::optional<std::string>());
}

}  // namespace dynamiq::server::internal

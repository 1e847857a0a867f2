#include "server/reject_log.h"

#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace dynamiq::server {

RejectLog::RejectLog(Metrics& metrics, int max_lines, absl::Duration window)
    : metrics_(metrics), max_lines_(max_lines), window_(window) {}

void RejectLog::Record(const absl::Status& status, absl::string_view who) {
  if (status.ok()) return;
  metrics_.OnRejected(status.code());
  uint64_t left_out = 0;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - window_start_ >= window_) {
      window_start_ = now;
      lines_in_window_ = 0;
    }
    if (lines_in_window_ >= max_lines_) {
      ++not_logged_;
      return;
    }
    ++lines_in_window_;
    left_out = std::exchange(not_logged_, 0);
  }
  common::Log("refused a request of %s: %s%s", std::string(who).c_str(), status.ToString().c_str(),
              left_out > 0 ? absl::StrCat(" (and ", left_out, " more refusals not logged)").c_str() : "");
}

}  // namespace dynamiq::server

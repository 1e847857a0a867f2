// RejectLog: what the daemon does with a request it refuses (from a worker, an operator or a peer):
// counts it in the metrics (dynamiq_rejected_requests_total, by code) and logs it to stderr with
// who sent it, at most `max_lines` lines per `window` (the next line logged says how many were left
// out), so a broken or hostile client cannot flood the log. Thread-safe.
#ifndef DQ_SERVER_REJECT_LOG_H_
#define DQ_SERVER_REJECT_LOG_H_

#include <stdint.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/metrics.h"

namespace dynamiq::server {

class RejectLog {
 public:
  // `metrics` must outlive the log.
  explicit RejectLog(Metrics& metrics, int max_lines = 20, absl::Duration window = absl::Seconds(10));

  // Counts and logs a refusal; OK is ignored. The message is logged as is: it quotes what the
  // caller sent only in part and escaped (server/request_names.h).
  void Record(const absl::Status& status, absl::string_view who);

 private:
  Metrics& metrics_;
  const int max_lines_;
  const absl::Duration window_;
  absl::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_);
  int lines_in_window_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t not_logged_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_REJECT_LOG_H_

// Log: dynamiqd's one logging home. Every line the daemon logs (start-up, refused requests, jobs'
// incarnations, cluster events) goes through here as "dynamiqd: <line>" on stderr, written with a
// single write(2) so that lines logged by different threads never interleave. Messages that carry
// a peer's or a worker's words are made safe first (common/safe_text.h). Thread-safe.
#ifndef DQ_COMMON_LOG_H_
#define DQ_COMMON_LOG_H_

#include <unistd.h>

#include <cerrno>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace dynamiq::common {

inline void LogLine(absl::string_view line) {
  const std::string text = absl::StrCat("dynamiqd: ", line, "\n");
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // stderr is gone: nothing else to tell it to
    done += static_cast<size_t>(n);
  }
}

// printf-style (absl::StrFormat, checked at compile time), without the "dynamiqd: " and the newline.
template <typename... Args>
void Log(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(absl::StrFormat(format, args...));
}

}  // namespace dynamiq::common

#endif  // DQ_COMMON_LOG_H_

// Names that arrive in requests (job ids, tensor names, worker ids, codec names): what dynamiqd
// accepts, and how its messages quote what it refused.
//
// A name is 1..max_bytes bytes (or empty where allowed) of valid UTF-8 without control characters:
// it ends up in log lines, error messages, metric labels and JSON, where a newline or a stray byte
// would forge or break a line. Anything quoted back to the caller is cut to a prefix, so a 1 MB
// name cannot push an error past gRPC's metadata limit.
#ifndef DQ_SERVER_REQUEST_NAMES_H_
#define DQ_SERVER_REQUEST_NAMES_H_

#include <stddef.h>
#include <stdint.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dynamiq::server {

inline constexpr size_t kMaxJobIdBytes = 256;
inline constexpr size_t kMaxTensorNameBytes = 1024;
inline constexpr size_t kMaxConfigNameBytes = 64;  // codec, topology, allocator

// OK, or INVALID_ARGUMENT naming `what` ("job id") and saying what is wrong with `value`.
absl::Status CheckRequestName(absl::string_view what, absl::string_view value, size_t max_bytes,
                              bool allow_empty = false);

// `value` for a message: its first `max_bytes` bytes, C-escaped, in single quotes, followed by
// "... (N bytes)" when it was longer.
std::string QuoteName(absl::string_view value, size_t max_bytes = 64);

// A worker id as the daemon handed it out: decimal digits only, 1..20 of them, not 0.
absl::StatusOr<uint64_t> ParseWorkerId(absl::string_view id);

}  // namespace dynamiq::server

#endif  // DQ_SERVER_REQUEST_NAMES_H_

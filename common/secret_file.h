// ReadSecretFile: reads a credential (an operator bearer token, the cluster secret, a TLS private
// key) from a file, refusing files other users could read or replace. Used by dynamiqd (its
// --operator_token_file, --cluster_secret_file and --tls_key flags), dynamiqctl (--token_file) and
// the Python Control class, so every program applies the same rule.
//
// Thread-safe (no state).
#ifndef DQ_COMMON_SECRET_FILE_H_
#define DQ_COMMON_SECRET_FILE_H_

#include <stddef.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dynamiq::common {

// Shortest token or secret accepted: 16 bytes (e.g. `openssl rand -hex 32` gives 64).
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretFileBytes = 64 << 10;

// The file's contents. `flag` names where the path came from, for errors ("--cluster_secret_file").
// Errors: NOT_FOUND / PERMISSION_DENIED when it cannot be opened, FAILED_PRECONDITION when it is not
// a regular file, is larger than kMaxSecretFileBytes, or its mode grants any access to group or
// others (the message says which mode and how to fix it). Symbolic links are followed (Kubernetes
// mounts Secrets through them); the mode checked is the target's.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view flag);

// A secret: the file's contents without surrounding whitespace (a trailing newline is usual).
// INVALID_ARGUMENT when shorter than kMinSecretBytes.
absl::StatusOr<std::string> ReadSecret(const std::string& path, absl::string_view flag);

// Bearer tokens: one per non-empty line (several lines let a token be rotated without downtime:
// add the new one, move the clients, remove the old one). Each must be at least kMinSecretBytes of
// visible ASCII without spaces (what an HTTP/2 header value can carry); INVALID_ARGUMENT otherwise,
// without echoing the token.
absl::StatusOr<std::vector<std::string>> ReadTokens(const std::string& path, absl::string_view flag);

// A file that is not secret (a TLS certificate or CA bundle): no mode check, same size bound.
absl::StatusOr<std::string> ReadPublicFile(const std::string& path, absl::string_view flag);

}  // namespace dynamiq::common

#endif  // DQ_COMMON_SECRET_FILE_H_

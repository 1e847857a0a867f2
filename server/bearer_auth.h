// BearerAuthenticator: checks the "authorization: Bearer <token>" metadata of a gRPC call against
// the accepted tokens, in constant time. dynamiqd uses one for dynamiq.v1.Control (the operator
// token, --operator_token_file) and one for dynamiq.v1.Rendezvous (a token derived from the
// cluster secret, server/security.h). Services call Check() first thing in every handler.
//
// A file-backed authenticator re-reads its file when it changes (checked at most once a second),
// so an operator token can be rotated without restarting the daemon: add the new token as a
// second line, move the clients to it, remove the old line. A file that becomes unreadable or
// invalid keeps the previous tokens in force (and says so on stderr once per change).
//
// Thread-safe.
#ifndef DQ_SERVER_BEARER_AUTH_H_
#define DQ_SERVER_BEARER_AUTH_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace grpc {
class ServerContext;
}

namespace dynamiq::server {

class BearerAuthenticator {
 public:
  struct Messages {
    std::string missing;   // the call carries no bearer token
    std::string mismatch;  // it carries one that is not accepted
  };

  // Accepts any of `tokens` (non-empty).
  BearerAuthenticator(std::vector<std::string> tokens, Messages messages);
  // Tokens from `path` (common/secret_file.h ReadTokens: owner-only mode, one per line), reloaded
  // when the file changes. Errors: those of ReadTokens, with `flag` naming the path's origin.
  static absl::StatusOr<std::unique_ptr<BearerAuthenticator>> FromFile(const std::string& path, const std::string& flag,
                                                                       Messages messages);

  // OK, or UNAUTHENTICATED with the matching message (tokens are never echoed).
  absl::Status Check(const grpc::ServerContext& context) const;
  // The same check on the metadata value itself ("Bearer <token>"; empty: none was sent).
  absl::Status CheckHeader(absl::string_view authorization) const;

 private:
  BearerAuthenticator(std::vector<std::string> tokens, Messages messages, std::string path, std::string flag);
  void MaybeReload() const ABSL_LOCKS_EXCLUDED(mu_);

  const Messages messages_;
  const std::string path_, flag_;  // empty path: fixed tokens
  mutable absl::Mutex mu_;
  mutable std::vector<std::string> tokens_ ABSL_GUARDED_BY(mu_);
  mutable absl::Time last_check_ ABSL_GUARDED_BY(mu_);
  // What the file looked like when last read (or last failed to read). The change time also moves
  // on chmod, so fixing a file's mode is noticed.
  struct FileId {
    dev_t dev = 0;
    ino_t ino = 0;
    int64_t mtime_ns = 0;
    int64_t ctime_ns = 0;
    int64_t size = -1;
    bool operator==(const FileId&) const = default;
  };
  static FileId Identify(const std::string& path);
  mutable FileId file_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_BEARER_AUTH_H_

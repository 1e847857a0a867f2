#include "server/bearer_auth.h"

#include <grpcpp/server_context.h>
#include <sys/stat.h>

#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/hmac.h"
#include "common/log.h"
#include "common/secret_file.h"

namespace dynamiq::server {
namespace {

constexpr absl::Duration kReloadInterval = absl::Seconds(1);
constexpr absl::string_view kAuthorization = "authorization";

}  // namespace

BearerAuthenticator::BearerAuthenticator(std::vector<std::string> tokens, Messages messages)
    : BearerAuthenticator(std::move(tokens), std::move(messages), "", "") {}

BearerAuthenticator::BearerAuthenticator(std::vector<std::string> tokens, Messages messages, std::string path,
                                         std::string flag)
    : messages_(std::move(messages)),
      path_(std::move(path)),
      flag_(std::move(flag)),
      tokens_(std::move(tokens)),
      last_check_(absl::Now()) {}

BearerAuthenticator::FileId BearerAuthenticator::Identify(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return FileId{};
  return FileId{st.st_dev, st.st_ino, st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec,
                st.st_ctim.tv_sec * 1000000000ll + st.st_ctim.tv_nsec, st.st_size};
}

absl::StatusOr<std::unique_ptr<BearerAuthenticator>> BearerAuthenticator::FromFile(const std::string& path,
                                                                                   const std::string& flag,
                                                                                   Messages messages) {
  // Identified before reading: a change in between is picked up by the next reload check.
  const FileId id = Identify(path);
  absl::StatusOr<std::vector<std::string>> tokens = common::ReadTokens(path, flag);
  if (!tokens.ok()) return tokens.status();
  std::unique_ptr<BearerAuthenticator> auth(
      new BearerAuthenticator(*std::move(tokens), std::move(messages), path, flag));
  absl::MutexLock lock(&auth->mu_);
  auth->file_ = id;
  return auth;
}

void BearerAuthenticator::MaybeReload() const {
  if (path_.empty()) return;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - last_check_ < kReloadInterval) return;
    last_check_ = now;
    const FileId id = Identify(path_);
    if (id == file_) return;
    file_ = id;
  }
  // Read outside the lock; a concurrent reload of the same change is harmless.
  absl::StatusOr<std::vector<std::string>> tokens = common::ReadTokens(path_, flag_);
  if (!tokens.ok()) {
    common::Log("%s changed but cannot be used (keeping the previous tokens): %s", path_.c_str(),
                std::string(tokens.status().message()).c_str());
    return;
  }
  common::Log("reloaded %zu token(s) from %s", tokens->size(), path_.c_str());
  absl::MutexLock lock(&mu_);
  tokens_ = *std::move(tokens);
}

absl::Status BearerAuthenticator::CheckHeader(absl::string_view authorization) const {
  MaybeReload();
  // RFC 6750: the scheme is case-insensitive, then one space and the token.
  constexpr absl::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(messages_.missing);
  }
  const absl::string_view presented = authorization.substr(kScheme.size());
  bool accepted = false;
  absl::MutexLock lock(&mu_);
  // Compare with every token (no early exit), so timing does not tell which one matched.
  for (const std::string& token : tokens_) accepted |= common::ConstantTimeEquals(presented, token);
  return accepted ? absl::OkStatus() : absl::UnauthenticatedError(messages_.mismatch);
}

absl::Status BearerAuthenticator::Check(const grpc::ServerContext& context) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(grpc::string_ref(kAuthorization.data(), kAuthorization.size()));
  if (it == metadata.end()) return CheckHeader("");
  return CheckHeader(absl::string_view(it->second.data(), it->second.size()));
}

}  // namespace dynamiq::server

#include "common/secret_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace dynamiq::common {
namespace {

absl::Status OpenError(int err, absl::string_view flag, const std::string& path) {
  const std::string message = absl::StrCat(flag, ": cannot open ", path, ": ", std::strerror(err));
  if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  return absl::UnavailableError(message);
}

absl::StatusOr<std::string> Read(const std::string& path, absl::string_view flag, bool secret) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": empty path"));
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return OpenError(errno, flag, path);
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  // fstat on the descriptor read from: no window between the check and the read.
  struct stat st;
  if (fstat(fd, &st) != 0) return OpenError(errno, flag, path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(flag, ": ", path, " is not a regular file"));
  }
  if (secret && (st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: %s has mode 0%o, which lets other users read or change it; refusing to use it (run: chmod 600 %s)", flag,
        path, st.st_mode & 07777, path));
  }
  if (static_cast<size_t>(st.st_size) > kMaxSecretFileBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": ", path, " has ", st.st_size, " bytes, more than ", kMaxSecretFileBytes));
  }
  std::string out;
  char buffer[4096];
  while (true) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::UnavailableError(absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(errno)));
    if (n == 0) break;
    out.append(buffer, static_cast<size_t>(n));
    if (out.size() > kMaxSecretFileBytes) {
      return absl::FailedPreconditionError(
          absl::StrCat(flag, ": ", path, " grew past ", kMaxSecretFileBytes, " bytes"));
    }
  }
  return out;
}

absl::Status TooShort(absl::string_view flag, const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": ", what, " in ", path, " is shorter than ", kMinSecretBytes,
                                                 " bytes; generate one with: openssl rand -hex 32"));
}

}  // namespace

absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view flag) {
  return Read(path, flag, /*secret=*/true);
}

absl::StatusOr<std::string> ReadPublicFile(const std::string& path, absl::string_view flag) {
  return Read(path, flag, /*secret=*/false);
}

absl::StatusOr<std::string> ReadSecret(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> contents = ReadSecretFile(path, flag);
  if (!contents.ok()) return contents.status();
  std::string secret(absl::StripAsciiWhitespace(*contents));
  if (secret.size() < kMinSecretBytes) return TooShort(flag, path, "the secret");
  return secret;
}

absl::StatusOr<std::vector<std::string>> ReadTokens(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> contents = ReadSecretFile(path, flag);
  if (!contents.ok()) return contents.status();
  std::vector<std::string> tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(*contents, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    for (char c : line) {
      if (c < 0x21 || c > 0x7e) {
        return absl::InvalidArgumentError(absl::StrCat(flag, ": the token on line ", line_number, " of ", path,
                                                       " has a character other than visible ASCII"));
      }
    }
    if (line.size() < kMinSecretBytes) return TooShort(flag, path, absl::StrCat("the token on line ", line_number));
    tokens.emplace_back(line);
  }
  if (tokens.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " holds no token"));
  return tokens;
}

}  // namespace dynamiq::common

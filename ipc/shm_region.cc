#include "ipc/shm_region.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace dynamiq::ipc {
namespace {

// A fresh name collides only if 128 random bits repeat; a few retries cover a broken RNG seed.
constexpr int kMaxCreateAttempts = 4;
constexpr mode_t kRegionMode = S_IRUSR | S_IWUSR;  // 0600

// Runs `call` (a syscall returning -1 and setting errno) again while it fails with EINTR.
template <typename F>
auto RetryOnEintr(F call) {
  decltype(call()) result;
  do {
    result = call();
  } while (result == -1 && errno == EINTR);
  return result;
}

absl::Status ShmErrno(int err, absl::string_view call, absl::string_view name) {
  return absl::ErrnoToStatus(err, absl::StrCat(call, "(", name, ")"));
}

// ENOSPC from a tmpfs almost always means /dev/shm is too small (Docker: 64 MB by default).
absl::Status NoSpaceError(absl::string_view call, absl::string_view name, size_t bytes) {
  std::string space;
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) == 0) {
    space = absl::StrFormat("; /dev/shm has %d of %d bytes free", uint64_t{vfs.f_bavail} * vfs.f_frsize,
                            uint64_t{vfs.f_blocks} * vfs.f_frsize);
  }
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%s(%s, %d bytes): No space left on device%s. Shared-memory buffers live in /dev/shm (a tmpfs); Docker "
      "limits it to 64 MB by default: start the container with --shm-size=<bytes> or --ipc=host, or use "
      "smaller buffers",
      call, name, bytes, space));
}

absl::Status CheckRegionSize(size_t bytes, absl::string_view what) {
  if (bytes == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": size must be positive"));
  if (bytes > kMaxShmRegionBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d bytes exceeds the %d-byte limit of a shared-memory region", what, bytes, kMaxShmRegionBytes));
  }
  return absl::OkStatus();
}

// "/name": one leading slash, no other slash, not "." or "..", fits NAME_MAX.
absl::Status ValidateShmName(absl::string_view name) {
  const bool ok = name.size() >= 2 && name.size() <= NAME_MAX && name[0] == '/' &&
                  name.find('/', 1) == absl::string_view::npos && name.find('\0') == absl::string_view::npos &&
                  name != "/." && name != "/..";
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("invalid shared-memory name \"", absl::CEscape(name),
                                                   "\": expected \"/name\" with no other '/', at most ", NAME_MAX,
                                                   " characters"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> MakeName(absl::string_view hint) {
  unsigned char random[16];
  size_t got = 0;
  while (got < sizeof(random)) {
    const ssize_t n = getrandom(random + got, sizeof(random) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, "getrandom (for a shared-memory name)");
    }
    got += static_cast<size_t>(n);
  }
  std::string name = absl::StrCat(kShmNamePrefix, getpid(), "-");
  const absl::string_view cut = hint.substr(0, kMaxShmNameHintChars);
  if (!cut.empty()) {
    for (char c : cut) name.push_back(absl::ascii_isalnum(static_cast<unsigned char>(c)) ? c : '_');
    name.push_back('-');
  }
  for (unsigned char b : random) absl::StrAppend(&name, absl::Hex(b, absl::kZeroPad2));
  return name;
}

}  // namespace

ShmRegion::ShmRegion(std::string name, uint8_t* data, size_t size, bool created)
    : name_(std::move(name)), data_(data), size_(size), created_(created), linked_(true) {}

ShmRegion::ShmRegion(ShmRegion&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      created_(std::exchange(other.created_, false)),
      linked_(std::exchange(other.linked_, false)) {
  other.name_.clear();
}

ShmRegion& ShmRegion::operator=(ShmRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    other.name_.clear();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    created_ = std::exchange(other.created_, false);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

ShmRegion::~ShmRegion() { Reset(); }

void ShmRegion::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  // Destructors cannot report errors; an unlink failure here leaves a 0600 object that only its
  // owner can open, and shm names are unguessable.
  if (created_ && linked_) shm_unlink(name_.c_str());
  name_.clear();
  data_ = nullptr;
  size_ = 0;
  created_ = false;
  linked_ = false;
}

absl::StatusOr<ShmRegion> ShmRegion::Create(size_t bytes, absl::string_view name_hint) {
  DQ_RETURN_IF_ERROR(CheckRegionSize(bytes, "ShmRegion::Create"));

  std::string name;
  int fd = -1;
  for (int attempt = 0; attempt < kMaxCreateAttempts; ++attempt) {
    DQ_ASSIGN_OR_RETURN(name, MakeName(name_hint));
    fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, kRegionMode);
    if (fd >= 0 || errno != EEXIST) break;
  }
  if (fd < 0) return ShmErrno(errno, "shm_open", name);

  // From here on every failure closes the descriptor and removes the half-made object.
  auto fail = [&](absl::Status status) {
    close(fd);
    shm_unlink(name.c_str());
    return status;
  };
  // The umask can only clear bits of kRegionMode; fchmod makes the mode exactly 0600 regardless.
  if (fchmod(fd, kRegionMode) != 0) return fail(ShmErrno(errno, "fchmod", name));
  if (RetryOnEintr([&] { return ftruncate(fd, static_cast<off_t>(bytes)); }) != 0) {
    const int err = errno;
    return fail(err == ENOSPC ? NoSpaceError("ftruncate", name, bytes) : ShmErrno(err, "ftruncate", name));
  }
  // tmpfs allocates pages on first touch; reserving them now turns "tmpfs full" into ENOSPC here
  // instead of SIGBUS in whichever process writes first. posix_fallocate returns the error number.
  int err;
  do {
    err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (err == EINTR);
  if (err == ENOSPC) return fail(NoSpaceError("posix_fallocate", name, bytes));
  if (err != 0 && err != EOPNOTSUPP) return fail(ShmErrno(err, "posix_fallocate", name));

  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return fail(ShmErrno(errno, "mmap", name));
  close(fd);  // The mapping keeps the object alive; the descriptor is no longer needed.
  return ShmRegion(std::move(name), static_cast<uint8_t*>(data), bytes, /*created=*/true);
}

absl::StatusOr<ShmRegion> ShmRegion::Open(const std::string& name, size_t expected_bytes) {
  DQ_RETURN_IF_ERROR(ValidateShmName(name));
  DQ_RETURN_IF_ERROR(CheckRegionSize(expected_bytes, absl::StrCat("ShmRegion::Open(", name, ")")));

  // glibc's shm_open adds O_NOFOLLOW; O_CLOEXEC keeps the descriptor out of exec'd children.
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    absl::Status status = ShmErrno(err, "shm_open", name);
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat(status.message(),
                                              " (the creator never made it, or already unlinked it: open it before ",
                                              "reporting it as mapped)"));
    }
    return status;
  }
  auto fail = [fd](absl::Status status) {
    close(fd);
    return status;
  };

  struct stat st;
  if (fstat(fd, &st) != 0) return fail(ShmErrno(errno, "fstat", name));
  if (!S_ISREG(st.st_mode)) {
    return fail(absl::FailedPreconditionError(absl::StrCat(name, " is not a shared-memory object")));
  }
  if (st.st_uid != geteuid()) {
    return fail(absl::PermissionDeniedError(absl::StrFormat(
        "%s is owned by uid %d but this process runs as uid %d; refusing to map it", name, st.st_uid, geteuid())));
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    return fail(absl::PermissionDeniedError(
        absl::StrFormat("%s has mode 0%o, which grants group/other access; refusing to map it (expected 0600)", name,
                        st.st_mode & 07777)));
  }
  const size_t actual = static_cast<size_t>(st.st_size);
  if (st.st_size < 0 || actual < expected_bytes) {
    return fail(absl::FailedPreconditionError(
        absl::StrFormat("%s holds %d bytes but %d were expected", name, st.st_size, expected_bytes)));
  }
  if (actual > kMaxShmRegionBytes) {
    return fail(absl::FailedPreconditionError(absl::StrFormat(
        "%s holds %d bytes, more than the %d-byte limit of a shared-memory region", name, actual, kMaxShmRegionBytes)));
  }

  void* data = mmap(nullptr, actual, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return fail(ShmErrno(errno, "mmap", name));
  close(fd);
  return ShmRegion(name, static_cast<uint8_t*>(data), actual, /*created=*/false);
}

absl::Status ShmRegion::Unlink() {
  if (!linked_) return absl::OkStatus();
  if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT) return ShmErrno(errno, "shm_unlink", name_);
  linked_ = false;
  return absl::OkStatus();
}

size_t ShmRegion::UnlinkOrphans() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  const absl::string_view prefix = kShmNamePrefix.substr(1);  // the entries have no leading '/'
  size_t unlinked = 0;
  while (dirent* e = readdir(dir)) {
    const absl::string_view name = e->d_name;
    if (!absl::StartsWith(name, prefix)) continue;
    const absl::string_view rest = name.substr(prefix.size());
    int64_t pid = 0;
    const size_t dash = rest.find('-');
    if (dash == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(0, dash), &pid) || pid <= 0 ||
        pid == getpid()) {
      continue;
    }
    struct stat st;
    if (fstatat(dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid()) {
      continue;
    }
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // the creator lives (or is not ours)
    if (shm_unlink(absl::StrCat("/", name).c_str()) == 0) ++unlinked;
  }
  closedir(dir);
  return unlinked;
}

}  // namespace dynamiq::ipc

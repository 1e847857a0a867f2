#include "ipc/shm_region.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::ipc {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;
using ::testing::StartsWith;

constexpr absl::Duration kChildTimeout = absl::Seconds(30);

// Entries of /dev/shm whose name starts with "dynamiq-<this pid>-" + `more`: the objects this
// test process created.
std::vector<std::string> OurShmEntries(absl::string_view more = "") {
  const std::string prefix = absl::StrCat(kShmNamePrefix.substr(1), getpid(), "-", more);
  std::vector<std::string> found;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return found;
  while (const dirent* entry = readdir(dir)) {
    if (absl::StartsWith(entry->d_name, prefix)) found.emplace_back(entry->d_name);
  }
  closedir(dir);
  return found;
}

std::string DevShmPath(const std::string& name) { return absl::StrCat("/dev/shm", name); }

// Runs `body` in a fork()ed child that exits with its return value (never returning into gtest).
pid_t ForkChild(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  return pid;
}

// Waits at most `timeout` for `pid`; kills it if it overruns. Returns its exit code, or -1 if it
// was killed or died from a signal.
int WaitChild(pid_t pid, absl::Duration timeout = kChildTimeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (true) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return -1;
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// One byte over a pipe, with a bounded wait on the reading side.
bool SendByte(int fd, char c) { return write(fd, &c, 1) == 1; }
bool ReceiveByte(int fd, char expected, absl::Duration timeout = kChildTimeout) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1) return false;
  char c = 0;
  return read(fd, &c, 1) == 1 && c == expected;
}

uint8_t Pattern(size_t i) { return static_cast<uint8_t>((i * 131 + 7) & 0xff); }

class ShmRegionTest : public ::testing::Test {
 protected:
  // Every test must leave no object of ours behind in /dev/shm.
  void TearDown() override { EXPECT_THAT(OurShmEntries(), IsEmpty()); }
};

TEST_F(ShmRegionTest, CreateMapsZeroedMemoryWithMode0600) {
  absl::StatusOr<ShmRegion> region = ShmRegion::Create(4097, "grad");
  ASSERT_THAT(region, IsOk());
  EXPECT_EQ(region->size(), 4097u);
  ASSERT_NE(region->data(), nullptr);
  EXPECT_TRUE(region->created());
  EXPECT_TRUE(region->linked());
  EXPECT_THAT(region->name(), StartsWith(absl::StrCat("/dynamiq-", getpid(), "-grad-")));
  for (size_t i = 0; i < region->size(); ++i) ASSERT_EQ(region->data()[i], 0) << i;
  region->data()[4096] = 0xab;

  struct stat st;
  ASSERT_EQ(stat(DevShmPath(region->name()).c_str(), &st), 0) << strerror(errno);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, geteuid());
  EXPECT_EQ(st.st_size, 4097);
  EXPECT_THAT(OurShmEntries(), SizeIs(1));
}

TEST_F(ShmRegionTest, ModeIsExactly0600WhateverTheUmask) {
  for (mode_t mask : {mode_t{0}, mode_t{0022}, mode_t{0277}}) {
    const mode_t old = umask(mask);
    absl::StatusOr<ShmRegion> region = ShmRegion::Create(64, "umask");
    umask(old);
    ASSERT_THAT(region, IsOk()) << "umask 0" << std::oct << mask;
    struct stat st;
    ASSERT_EQ(stat(DevShmPath(region->name()).c_str(), &st), 0) << strerror(errno);
    EXPECT_EQ(st.st_mode & 07777, 0600u) << "umask 0" << std::oct << mask;
  }
}

TEST_F(ShmRegionTest, NamesAreUniqueAndHintsAreSanitized) {
  absl::StatusOr<ShmRegion> a = ShmRegion::Create(64, "same");
  absl::StatusOr<ShmRegion> b = ShmRegion::Create(64, "same");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_NE(a->name(), b->name());

  absl::StatusOr<ShmRegion> odd = ShmRegion::Create(64, "a/b c.d-" + std::string(100, 'x'));
  ASSERT_THAT(odd, IsOk());
  const std::string& name = odd->name();
  EXPECT_EQ(name.find('/', 1), std::string::npos) << name;
  const std::string expected_hint = "a_b_c_d_" + std::string(kMaxShmNameHintChars - 8, 'x');
  EXPECT_THAT(name, StartsWith(absl::StrCat("/dynamiq-", getpid(), "-", expected_hint, "-")));
  // The rest is 128 random bits in hex.
  const std::string random = name.substr(name.rfind('-') + 1);
  EXPECT_EQ(random.size(), 32u) << name;
  EXPECT_EQ(random.find_first_not_of("0123456789abcdef"), std::string::npos) << name;

  absl::StatusOr<ShmRegion> no_hint = ShmRegion::Create(64, "");
  ASSERT_THAT(no_hint, IsOk());
  EXPECT_EQ(no_hint->name().size(), absl::StrCat("/dynamiq-", getpid(), "-").size() + 32) << no_hint->name();
}

TEST_F(ShmRegionTest, RejectsZeroAndHugeSizes) {
  EXPECT_THAT(ShmRegion::Create(0, "x"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("positive")));
  EXPECT_THAT(ShmRegion::Create(kMaxShmRegionBytes + 1, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("limit")));
  EXPECT_THAT(ShmRegion::Create(std::numeric_limits<size_t>::max(), "x"), StatusIs(absl::StatusCode::kInvalidArgument));

  absl::StatusOr<ShmRegion> region = ShmRegion::Create(64, "open0");
  ASSERT_THAT(region, IsOk());
  EXPECT_THAT(ShmRegion::Open(region->name(), 0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ShmRegion::Open(region->name(), kMaxShmRegionBytes + 1), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(ShmRegionTest, OpenRejectsMalformedNames) {
  for (const std::string& name :
       {std::string(""), std::string("/"), std::string("noslash"), std::string("/a/b"), std::string("/.."),
        std::string("/x") + std::string(300, 'y'), std::string("/nul\0byte", 9)}) {
    EXPECT_THAT(ShmRegion::Open(name, 64), StatusIs(absl::StatusCode::kInvalidArgument)) << name;
  }
}

TEST_F(ShmRegionTest, OpenOfMissingObjectIsNotFound) {
  EXPECT_THAT(ShmRegion::Open(absl::StrCat("/dynamiq-", getpid(), "-missing-0"), 64),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("No such file or directory")));
}

TEST_F(ShmRegionTest, ForkedChildReadsParentWritesAndParentReadsChildWrites) {
  constexpr size_t kBytes = 1 << 20;
  absl::StatusOr<ShmRegion> region = ShmRegion::Create(kBytes, "fork");
  ASSERT_THAT(region, IsOk());
  for (size_t i = 0; i < kBytes / 2; ++i) region->data()[i] = Pattern(i);
  const std::string name = region->name();

  const pid_t child = ForkChild([&]() -> int {
    absl::StatusOr<ShmRegion> mapped = ShmRegion::Open(name, kBytes);
    if (!mapped.ok()) return 10;
    if (mapped->size() != kBytes || mapped->created()) return 11;
    for (size_t i = 0; i < kBytes / 2; ++i) {
      if (mapped->data()[i] != Pattern(i)) return 12;
    }
    for (size_t i = kBytes / 2; i < kBytes; ++i) mapped->data()[i] = static_cast<uint8_t>(~Pattern(i));
    return 0;  // _exit: the opened region's destructor does not run (and would not unlink anyway).
  });
  ASSERT_GT(child, 0) << strerror(errno);
  ASSERT_EQ(WaitChild(child), 0);
  for (size_t i = kBytes / 2; i < kBytes; ++i) ASSERT_EQ(region->data()[i], static_cast<uint8_t>(~Pattern(i))) << i;
}

TEST_F(ShmRegionTest, UnlinkOnceChildMappedKeepsBothMappingsWorking) {
  constexpr size_t kBytes = 64 << 10;
  absl::StatusOr<ShmRegion> region = ShmRegion::Create(kBytes, "unlink");
  ASSERT_THAT(region, IsOk());
  const std::string name = region->name();
  int to_child[2], to_parent[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(to_parent), 0);

  const pid_t child = ForkChild([&]() -> int {
    close(to_child[1]);
    close(to_parent[0]);
    absl::StatusOr<ShmRegion> mapped = ShmRegion::Open(name, kBytes);
    if (!mapped.ok()) return 10;
    if (!SendByte(to_parent[1], 'm')) return 11;    // "mapped"
    if (!ReceiveByte(to_child[0], 'u')) return 12;  // parent unlinked and wrote
    if (mapped->data()[0] != 0x5a) return 13;       // parent's write after unlink is visible
    if (ShmRegion::Open(name, kBytes).status().code() != absl::StatusCode::kNotFound) return 14;
    mapped->data()[kBytes - 1] = 0xa5;  // our write after unlink
    if (!SendByte(to_parent[1], 'w')) return 15;
    return 0;
  });
  ASSERT_GT(child, 0) << strerror(errno);
  // Our copies of the child's ends go, so a child that dies early is seen as EOF, not a timeout.
  close(to_parent[1]);
  close(to_child[0]);
  const bool mapped = ReceiveByte(to_parent[0], 'm');
  EXPECT_TRUE(mapped);
  if (mapped) {
    DQ_EXPECT_OK(region->Unlink());
    EXPECT_FALSE(region->linked());
    EXPECT_EQ(region->name(), name);
    struct stat st;
    EXPECT_EQ(stat(DevShmPath(name).c_str(), &st), -1);
    EXPECT_EQ(errno, ENOENT);
    EXPECT_THAT(OurShmEntries(), IsEmpty());
    region->data()[0] = 0x5a;
    EXPECT_TRUE(SendByte(to_child[1], 'u'));
    EXPECT_TRUE(ReceiveByte(to_parent[0], 'w'));
  }
  close(to_child[1]);
  close(to_parent[0]);
  EXPECT_EQ(WaitChild(child), 0);
  EXPECT_EQ(region->data()[kBytes - 1], 0xa5);
}

TEST_F(ShmRegionTest, OpenAfterUnlinkIsNotFoundAndUnlinkIsIdempotent) {
  absl::StatusOr<ShmRegion> region = ShmRegion::Create(4096, "reopen");
  ASSERT_THAT(region, IsOk());
  absl::StatusOr<ShmRegion> opened = ShmRegion::Open(region->name(), 4096);
  ASSERT_THAT(opened, IsOk());
  EXPECT_FALSE(opened->created());
  DQ_ASSERT_OK(region->Unlink());
  DQ_EXPECT_OK(region->Unlink());
  EXPECT_THAT(ShmRegion::Open(region->name(), 4096), StatusIs(absl::StatusCode::kNotFound, HasSubstr(region->name())));
  // The opener may unlink too: the name is already gone, which is what it wants.
  DQ_EXPECT_OK(opened->Unlink());
  opened->data()[1] = 7;
  EXPECT_EQ(region->data()[1], 7);
}

TEST_F(ShmRegionTest, OpenerUnlinkIsSeenByCreator) {
  absl::StatusOr<ShmRegion> region = ShmRegion::Create(4096, "opener");
  ASSERT_THAT(region, IsOk());
  absl::StatusOr<ShmRegion> opened = ShmRegion::Open(region->name(), 4096);
  ASSERT_THAT(opened, IsOk());
  DQ_ASSERT_OK(opened->Unlink());
  EXPECT_THAT(OurShmEntries(), IsEmpty());
  DQ_EXPECT_OK(region->Unlink());  // ENOENT: already gone, still OK.
}

TEST_F(ShmRegionTest, DestructorUnlinksWhatItCreated) {
  {
    std::vector<ShmRegion> regions;
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<ShmRegion> region = ShmRegion::Create(4096, "dtor");
      ASSERT_THAT(region, IsOk());
      regions.push_back(*std::move(region));
    }
    EXPECT_THAT(OurShmEntries("dtor-"), SizeIs(3));
  }
  EXPECT_THAT(OurShmEntries(), IsEmpty());
}

TEST_F(ShmRegionTest, OpenedRegionDestructorLeavesNameAlone) {
  absl::StatusOr<ShmRegion> region = ShmRegion::Create(4096, "keep");
  ASSERT_THAT(region, IsOk());
  { DQ_ASSERT_OK(ShmRegion::Open(region->name(), 4096)); }
  EXPECT_THAT(OurShmEntries("keep-"), SizeIs(1));
  DQ_EXPECT_OK(ShmRegion::Open(region->name(), 4096));
}

TEST_F(ShmRegionTest, MovesTransferOwnership) {
  absl::StatusOr<ShmRegion> a = ShmRegion::Create(4096, "movea");
  absl::StatusOr<ShmRegion> b = ShmRegion::Create(8192, "moveb");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  const std::string b_name = b->name();
  b->data()[0] = 42;

  ShmRegion moved(*std::move(b));
  EXPECT_EQ(b->data(), nullptr);
  EXPECT_EQ(b->size(), 0u);
  EXPECT_FALSE(b->linked());
  EXPECT_THAT(b->name(), IsEmpty());
  DQ_EXPECT_OK(b->Unlink());  // Empty region: nothing to do.
  EXPECT_EQ(moved.name(), b_name);
  EXPECT_EQ(moved.data()[0], 42);

  // Move-assigning over a region releases (and unlinks) the old one.
  *a = std::move(moved);
  EXPECT_EQ(a->name(), b_name);
  EXPECT_EQ(a->size(), 8192u);
  EXPECT_THAT(OurShmEntries(), ElementsAre(b_name.substr(1)));
}

TEST_F(ShmRegionTest, OpenRejectsTooSmallObject) {
  absl::StatusOr<ShmRegion> region = ShmRegion::Create(4096, "small");
  ASSERT_THAT(region, IsOk());
  EXPECT_THAT(ShmRegion::Open(region->name(), 8192),
              StatusIs(absl::StatusCode::kFailedPrecondition, AllOf(HasSubstr("4096"), HasSubstr("8192"))));
  absl::StatusOr<ShmRegion> smaller = ShmRegion::Open(region->name(), 100);
  ASSERT_THAT(smaller, IsOk());
  EXPECT_EQ(smaller->size(), 4096u);  // The whole object is mapped.
}

// Creates an object the way a careless or hostile process would, bypassing ShmRegion::Create.
class RawShmObject {
 public:
  explicit RawShmObject(absl::string_view tag) : name_(absl::StrCat("/dynamiq-", getpid(), "-raw-", tag)) {
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd_ >= 0 && ftruncate(fd_, 4096) != 0) fd_ = -1;
  }
  ~RawShmObject() {
    if (fd_ >= 0) close(fd_);
    shm_unlink(name_.c_str());
  }
  int fd() const { return fd_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  int fd_ = -1;
};

TEST_F(ShmRegionTest, OpenRejectsGroupOrOtherAccess) {
  RawShmObject raw("mode");
  ASSERT_GE(raw.fd(), 0) << strerror(errno);
  for (mode_t mode : {mode_t{0640}, mode_t{0604}, mode_t{0666}}) {
    ASSERT_EQ(fchmod(raw.fd(), mode), 0);
    char octal[8];
    snprintf(octal, sizeof(octal), "0%o", mode);
    EXPECT_THAT(ShmRegion::Open(raw.name(), 4096),
                StatusIs(absl::StatusCode::kPermissionDenied, AllOf(HasSubstr(octal), HasSubstr("group/other"))));
  }
  ASSERT_EQ(fchmod(raw.fd(), 0600), 0);
  DQ_EXPECT_OK(ShmRegion::Open(raw.name(), 4096));
}

TEST_F(ShmRegionTest, OpenRejectsObjectOfAnotherUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give an object to another uid";
  RawShmObject raw("owner");
  ASSERT_GE(raw.fd(), 0) << strerror(errno);
  ASSERT_EQ(fchown(raw.fd(), 65534, 65534), 0) << strerror(errno);
  EXPECT_THAT(ShmRegion::Open(raw.name(), 4096),
              StatusIs(absl::StatusCode::kPermissionDenied, AllOf(HasSubstr("uid 65534"), HasSubstr("uid 0"))));
}

// /dev/shm (a tmpfs) cannot hold kMaxShmRegionBytes on any machine we run on: the reservation
// fails up front with ENOSPC (tmpfs checks the size before allocating a page).
TEST_F(ShmRegionTest, FullShmIsResourceExhaustedWithDockerHint) {
  struct statvfs vfs;
  ASSERT_EQ(statvfs("/dev/shm", &vfs), 0);
  const uint64_t total = uint64_t{vfs.f_blocks} * vfs.f_frsize;
  if (total == 0 || total >= kMaxShmRegionBytes) GTEST_SKIP() << "/dev/shm is unlimited or >= 1 TiB";
  EXPECT_THAT(ShmRegion::Create(kMaxShmRegionBytes, "huge"),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("No space left on device"), HasSubstr("--shm-size"), HasSubstr("/dev/shm"))));
}

}  // namespace
}  // namespace dynamiq::ipc

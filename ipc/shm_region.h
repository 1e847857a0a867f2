// ShmRegion: one POSIX shared-memory object (shm_open + ftruncate + mmap MAP_SHARED), the host
// buffer through which dynamiqd and a local worker process exchange gradients (docs/systems.md
// section 4, issue 4).
//
// Lifecycle, as the daemon uses it:
//   1. The daemon calls Create(): a new object with an unguessable name
//      ("/dynamiq-<pid>-<hint>-<128 random bits in hex>"), created with O_CREAT|O_EXCL and mode
//      exactly 0600 (whatever the umask), sized and mapped.
//   2. It sends the name and size to the worker over the 0600 worker socket (after an SO_PEERCRED
//      same-user check, ipc/peer_credentials.h); the worker calls Open(), which maps the object
//      only if it is owned by the worker's effective uid, has no group/other permission bits and is
//      at least as large as announced.
//   3. Once the worker reports that it has mapped the object, the daemon calls Unlink(): the name
//      disappears from /dev/shm while both mappings stay valid, so nothing leaks if either process
//      crashes afterwards. The memory is freed when the last mapping goes away.
//   The destructor munmaps; on the creating side it also unlinks a name that is still linked.
//
// Memory is reserved when the region is created (posix_fallocate), not on first touch: an
// over-full tmpfs then fails Create() with RESOURCE_EXHAUSTED instead of killing a process with
// SIGBUS in the middle of a collective. Note that Docker gives a container a 64 MB /dev/shm by
// default, which holds very few gradient buckets: run such containers with --shm-size=<bytes> (or
// --ipc=host). Create() reports ENOSPC as RESOURCE_EXHAUSTED with that hint and the free space.
//
// Errors are absl::Status values that carry the failing call, the object name and the errno text.
// Sizes of zero or above kMaxShmRegionBytes are INVALID_ARGUMENT.
//
// Thread-safety: const methods (the accessors) may be called concurrently; Unlink(), moves and
// destruction need external synchronisation. The bytes behind data() are shared with another
// process: ordering reads and writes across processes is the caller's protocol (the worker socket).
#ifndef DQ_IPC_SHM_REGION_H_
#define DQ_IPC_SHM_REGION_H_

#include <stddef.h>
#include <stdint.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dynamiq::ipc {

// Every object Create() makes is named "/dynamiq-<creator pid>-...": operators can find (and
// tests can scan /dev/shm for) the objects of one daemon.
inline constexpr absl::string_view kShmNamePrefix = "/dynamiq-";
// Largest region Create() and Open() accept (1 TiB): larger requests are bugs, not gradients.
inline constexpr size_t kMaxShmRegionBytes = size_t{1} << 40;
// name_hint is reduced to [A-Za-z0-9_] (anything else becomes '_') and cut to this many chars.
inline constexpr size_t kMaxShmNameHintChars = 32;

class ShmRegion {
 public:
  // Creates, sizes (with memory reserved up front) and maps a new object of `bytes` bytes, mode
  // 0600. `name_hint` (may be empty) only makes the name easier to read; uniqueness comes from the
  // pid and 128 random bits. The region owns the name: its destructor unlinks it unless Unlink()
  // ran first.
  static absl::StatusOr<ShmRegion> Create(size_t bytes, absl::string_view name_hint);

  // Maps an existing object read-write. `name` must look like "/name" (one leading slash, no
  // other slash). Fails with NOT_FOUND if no such object exists (for example once it has been
  // unlinked), PERMISSION_DENIED if it is owned by another uid or grants group/other access,
  // FAILED_PRECONDITION if it is smaller than `expected_bytes` (which must be positive). The
  // mapping covers the whole object; size() reports its actual size. The destructor never unlinks
  // an opened object's name.
  static absl::StatusOr<ShmRegion> Open(const std::string& name, size_t expected_bytes);

  // Unlinks the objects a crashed daemon left behind (created, never unlinked because the worker
  // never said it mapped them): those in /dev/shm named kShmNamePrefix<pid>-..., owned by this
  // process's effective uid, whose creator <pid> no longer exists. Objects of live processes and
  // of other users are left alone. Returns how many it unlinked. dynamiqd calls it at start.
  static size_t UnlinkOrphans();

  // An empty region: no mapping, no name. A moved-from region is empty too.
  ShmRegion() = default;
  ShmRegion(ShmRegion&& other) noexcept;
  ShmRegion& operator=(ShmRegion&& other) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  ~ShmRegion();

  // Removes the name from the shm namespace; existing mappings (here and in other processes) stay
  // valid. Idempotent: OK if this region already unlinked it, if someone else did (ENOENT), or if
  // the region is empty. Either side may call it; the daemon does once the worker has mapped.
  absl::Status Unlink();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  absl::Span<uint8_t> span() const { return absl::Span<uint8_t>(data_, size_); }
  // The shm name ("/dynamiq-..."); it stays readable after Unlink().
  const std::string& name() const { return name_; }
  // True if this side created the object (and therefore unlinks it on destruction if needed).
  bool created() const { return created_; }
  // True until Unlink() succeeded (or, for an empty region, always false).
  bool linked() const { return linked_; }

 private:
  ShmRegion(std::string name, uint8_t* data, size_t size, bool created);
  // Unmaps and, on the creating side, unlinks a still-linked name; leaves the region empty.
  void Reset();

  std::string name_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool created_ = false;
  bool linked_ = false;
};

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_SHM_REGION_H_

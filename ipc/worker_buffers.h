// WorkerBuffers: the bookkeeping both of the daemon's buffer registries share (shared memory,
// ipc/shm_registry.h; device memory, ipc/device_buffers.h): buffers keyed by (worker id,
// buffer id), the limits of ipc/buffer_limits.h, and the reserve-allocate-commit protocol that
// lets a registry create a buffer's memory outside its lock.
//
//   1. Reserve admits a new buffer against the limits and reserves its bytes and id;
//   2. the registry creates the memory without holding the lock;
//   3. Commit keeps it when the worker is still the one admitted (a ReleaseWorker in between makes
//      the entry go or come back as a new generation), else destroys it: ABORTED.
//
// Using a buffer and releasing it are one atomic admission: Use() counts a use of the buffer under
// the lock before anyone touches its memory, and the use ends when the returned BufferUse (and
// every copy of it) is gone. Release() refuses a buffer in use (FAILED_PRECONDITION); ReleaseWorker()
// (the worker is gone) takes the buffer out of the table at once but frees its memory only when the
// last use ends. So no memory is unmapped or freed under a collective that still reads it.
//
// `Buffer` owns its memory (destroying it frees it), is movable and has `uint8_t* data() const`
// and `size_t size() const`. Buffers are destroyed outside the lock. Ids are never reused, so a
// stale id is NOT_FOUND rather than someone else's memory. Thread-safe (one absl::Mutex). The
// registry must outlive every BufferUse it handed out.
#ifndef DQ_IPC_WORKER_BUFFERS_H_
#define DQ_IPC_WORKER_BUFFERS_H_

#include <stddef.h>
#include <stdint.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "ipc/buffer_limits.h"

namespace dynamiq::ipc {

// Bytes of a worker's buffer, held in use (see WorkerBuffers::Use). Copyable; the use ends when
// the last copy is gone.
struct BufferUse {
  absl::Span<uint8_t> region;
  std::shared_ptr<const void> hold;
};

template <typename Buffer>
class WorkerBuffers {
 public:
  // How messages name the buffers, their memory and their creation: "shared-memory",
  // "shared memory", "created"; "device", "device memory", "allocated".
  struct Names {
    std::string kind, memory, created;
  };
  // An admitted buffer whose memory is being created.
  struct Reservation {
    uint64_t worker_id = 0;
    uint64_t buffer_id = 0;
    uint64_t generation = 0;
    size_t bytes = 0;
  };

  WorkerBuffers(BufferLimits limits, Names names, uint64_t first_buffer_id)
      : limits_(limits), names_(std::move(names)), next_buffer_id_(first_buffer_id) {}
  WorkerBuffers(const WorkerBuffers&) = delete;
  WorkerBuffers& operator=(const WorkerBuffers&) = delete;

  // Step 1. RESOURCE_EXHAUSTED over a limit, changing nothing.
  absl::StatusOr<Reservation> Reserve(uint64_t worker_id, size_t bytes) {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = workers_.try_emplace(worker_id);
    WorkerState& worker = it->second;
    if (inserted) worker.generation = next_generation_++;
    const absl::Status refused = AdmitBuffer(
        limits_, names_.kind, names_.memory, worker_id, bytes, worker.buffers.size() + worker.reserved_buffers,
        worker.bytes + worker.reserved_bytes, num_buffers_ + reserved_buffers_, total_ + reserved_total_);
    if (!refused.ok()) {
      if (inserted) workers_.erase(it);
      return refused;
    }
    worker.reserved_bytes += bytes;
    ++worker.reserved_buffers;
    reserved_total_ += bytes;
    ++reserved_buffers_;
    return Reservation{worker_id, next_buffer_id_++, worker.generation, bytes};
  }

  // Step 3: ends the reservation with the created memory, or with why it could not be created
  // (returned as is). OK: the buffer is the worker's under r.buffer_id.
  absl::Status Commit(const Reservation& r, absl::StatusOr<Buffer> created) {
    absl::StatusOr<Buffer> discard = absl::UnknownError("");  // destroyed after the lock is released
    absl::MutexLock lock(&mu_);
    reserved_total_ -= r.bytes;
    --reserved_buffers_;
    auto it = workers_.find(r.worker_id);
    if (it == workers_.end() || it->second.generation != r.generation) {
      discard = std::move(created);
      return absl::AbortedError(absl::StrCat("worker ", r.worker_id, " was released while its ", names_.kind,
                                             " buffer ", r.buffer_id, " was being ", names_.created));
    }
    WorkerState& worker = it->second;
    worker.reserved_bytes -= r.bytes;
    --worker.reserved_buffers;
    if (!created.ok()) {
      if (worker.buffers.empty() && worker.reserved_buffers == 0) workers_.erase(it);
      return created.status();
    }
    worker.buffers.emplace(r.buffer_id, std::make_unique<Stored>(*std::move(created)));
    worker.bytes += r.bytes;
    total_ += r.bytes;
    ++num_buffers_;
    return absl::OkStatus();
  }

  // The bytes [offset, offset + length) of a buffer of `worker_id`, in use until the result is
  // gone. NOT_FOUND for an unknown buffer (including another worker's), OUT_OF_RANGE if the region
  // does not lie inside it.
  absl::StatusOr<BufferUse> Use(uint64_t worker_id, uint64_t buffer_id, size_t offset, size_t length) {
    absl::MutexLock lock(&mu_);
    Stored* stored = FindLocked(worker_id, buffer_id);
    if (stored == nullptr) return Unknown(worker_id, buffer_id);
    const Buffer& b = stored->buffer;
    if (offset > b.size() || length > b.size() - offset) {
      return absl::OutOfRangeError(
          absl::StrFormat("region at offset %d of length %d does not fit in %s buffer %d of worker %d (%d bytes)",
                          offset, length, names_.kind, buffer_id, worker_id, b.size()));
    }
    ++stored->uses;
    return BufferUse{absl::Span<uint8_t>(b.data() + offset, length), std::make_shared<const Hold>(this, stored)};
  }

  // OK if `worker_id` has the buffer, else NOT_FOUND.
  absl::Status Find(uint64_t worker_id, uint64_t buffer_id) const {
    absl::ReaderMutexLock lock(&mu_);
    return FindLocked(worker_id, buffer_id) != nullptr ? absl::OkStatus() : Unknown(worker_id, buffer_id);
  }

  // Runs `fn(buffer)` under the lock; NOT_FOUND for an unknown buffer.
  template <typename Fn>
  absl::Status With(uint64_t worker_id, uint64_t buffer_id, Fn fn) {
    absl::MutexLock lock(&mu_);
    Stored* stored = FindLocked(worker_id, buffer_id);
    if (stored == nullptr) return Unknown(worker_id, buffer_id);
    return fn(stored->buffer);
  }

  // Frees one buffer. NOT_FOUND for an unknown buffer, FAILED_PRECONDITION (changing nothing) for
  // one in use.
  absl::Status Release(uint64_t worker_id, uint64_t buffer_id) {
    std::unique_ptr<Stored> released;  // freed after the lock is released
    absl::MutexLock lock(&mu_);
    auto worker = workers_.find(worker_id);
    if (worker == workers_.end()) return Unknown(worker_id, buffer_id);
    WorkerState& state = worker->second;
    auto buffer = state.buffers.find(buffer_id);
    if (buffer == state.buffers.end()) return Unknown(worker_id, buffer_id);
    if (buffer->second->uses > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(names_.kind, " buffer ", buffer_id, " of worker ", worker_id,
                       " is used by an all-reduce that has not completed: wait for it before releasing the buffer"));
    }
    const size_t size = buffer->second->buffer.size();
    state.bytes -= size;
    total_ -= size;
    --num_buffers_;
    released = std::move(buffer->second);
    state.buffers.erase(buffer);
    if (state.buffers.empty() && state.reserved_buffers == 0) workers_.erase(worker);
    return absl::OkStatus();
  }

  // Takes every buffer of `worker_id` (none is fine) out of the table and returns how many there
  // were. Buffers not in use are freed now, the others when their last use ends (they count
  // towards TotalBytes and NumBuffers until then). Pending reservations stay counted until their
  // Commit, which then finds the entry gone or newer.
  size_t ReleaseWorker(uint64_t worker_id) {
    std::vector<std::unique_ptr<Stored>> released;  // freed after the lock is released
    absl::MutexLock lock(&mu_);
    auto worker = workers_.find(worker_id);
    if (worker == workers_.end()) return 0;
    const size_t count = worker->second.buffers.size();
    for (auto& [id, stored] : worker->second.buffers) {
      if (stored->uses > 0) {
        stored->orphaned = true;  // EndUse frees it
        orphans_.push_back(std::move(stored));
        continue;
      }
      total_ -= stored->buffer.size();
      --num_buffers_;
      released.push_back(std::move(stored));
    }
    workers_.erase(worker);
    return count;
  }

  size_t TotalBytes() const {
    absl::ReaderMutexLock lock(&mu_);
    return total_;
  }
  size_t WorkerBytes(uint64_t worker_id) const {
    absl::ReaderMutexLock lock(&mu_);
    auto worker = workers_.find(worker_id);
    return worker == workers_.end() ? 0 : worker->second.bytes;
  }
  size_t NumBuffers() const {
    absl::ReaderMutexLock lock(&mu_);
    return num_buffers_;
  }

 private:
  struct Stored {
    explicit Stored(Buffer b) : buffer(std::move(b)) {}
    Buffer buffer;
    size_t uses = 0;        // BufferUse objects alive (see Use)
    bool orphaned = false;  // its worker was released: in orphans_, freed when `uses` drops to 0
  };
  // What a BufferUse holds: ends one use when destroyed.
  class Hold {
   public:
    Hold(WorkerBuffers* owner, Stored* stored) : owner_(owner), stored_(stored) {}
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() { owner_->EndUse(stored_); }

   private:
    WorkerBuffers* owner_;
    Stored* stored_;
  };
  struct WorkerState {
    uint64_t generation = 0;  // tells this entry from one re-created after ReleaseWorker()
    absl::flat_hash_map<uint64_t, std::unique_ptr<Stored>> buffers;  // stable addresses for Hold
    size_t bytes = 0;
    // Admitted buffers whose memory is still being created.
    size_t reserved_bytes = 0;
    size_t reserved_buffers = 0;
  };

  absl::Status Unknown(uint64_t worker_id, uint64_t buffer_id) const {
    return absl::NotFoundError(
        absl::StrCat(names_.kind, " buffer ", buffer_id, " is not allocated to worker ", worker_id));
  }
  Stored* FindLocked(uint64_t worker_id, uint64_t buffer_id) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto worker = workers_.find(worker_id);
    if (worker == workers_.end()) return nullptr;
    auto buffer = worker->second.buffers.find(buffer_id);
    return buffer == worker->second.buffers.end() ? nullptr : buffer->second.get();
  }
  void EndUse(Stored* stored) {
    std::unique_ptr<Stored> freed;  // destroyed after the lock is released
    absl::MutexLock lock(&mu_);
    if (--stored->uses > 0 || !stored->orphaned) return;
    auto it = std::find_if(orphans_.begin(), orphans_.end(), [&](const auto& o) { return o.get() == stored; });
    freed = std::move(*it);
    orphans_.erase(it);
    total_ -= freed->buffer.size();
    --num_buffers_;
  }

  const BufferLimits limits_;
  const Names names_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, WorkerState> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Stored>> orphans_ ABSL_GUARDED_BY(mu_);  // released workers' buffers in use
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
  size_t reserved_total_ ABSL_GUARDED_BY(mu_) = 0;
  size_t reserved_buffers_ ABSL_GUARDED_BY(mu_) = 0;
  size_t num_buffers_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_buffer_id_ ABSL_GUARDED_BY(mu_);
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_WORKER_BUFFERS_H_

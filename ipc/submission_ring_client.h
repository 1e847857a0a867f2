// SubmissionRingClient: a worker's end of its submission ring (layout and protocol:
// ipc/submission_ring_layout.h; the daemon's end: ipc/submission_ring_server.h). A request goes
// into a free slot, its index into the ring, and a futex wakes the daemon if it sleeps; the answer
// comes back in the same slot, and a futex wakes the thread that waits for it. No system call on
// either side while the other is awake.
//
// Open() maps the ring the daemon created, checks its header, takes a descriptor for the liveness
// check (the daemon holds an exclusive flock on the ring while it lives) and unlinks the name.
//
// Thread-safety: every method may be called from any thread; a slot belongs to whoever acquired
// it until Take() frees it, and only that owner waits for it.
#ifndef DQ_IPC_SUBMISSION_RING_CLIENT_H_
#define DQ_IPC_SUBMISSION_RING_CLIENT_H_

#include <stdint.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ipc/shm_region.h"
#include "ipc/submission_ring_layout.h"

namespace dynamiq::ipc {

class SubmissionRingClient {
 public:
  // Maps ring `shm_name` of `bytes` bytes. ShmRegion::Open's errors; FAILED_PRECONDITION for a
  // header this version does not understand or whose geometry does not fit the object.
  static absl::StatusOr<std::unique_ptr<SubmissionRingClient>> Open(const std::string& shm_name, size_t bytes);
  ~SubmissionRingClient();

  SubmissionRingClient(const SubmissionRingClient&) = delete;
  SubmissionRingClient& operator=(const SubmissionRingClient&) = delete;

  uint32_t slots() const { return geometry_.slots; }

  // A free slot, or nothing when every slot is in flight.
  std::optional<uint32_t> Acquire();
  // Writes `request` into an acquired slot and pushes it to the daemon.
  void Submit(uint32_t slot, const ring::RingRequest& request);
  // Waits until the slot's completion is there (OK), `deadline` passes (DEADLINE_EXCEEDED), or the
  // ring is unusable (Health()'s error). Spins for up to `spin` first.
  absl::Status WaitDone(uint32_t slot, absl::Time deadline, absl::Duration spin = absl::ZeroDuration());
  bool IsDone(uint32_t slot) const;
  // The completion of a done slot, which is free again afterwards.
  ring::RingCompletion Take(uint32_t slot);

  // OK while the daemon lives and keeps the ring open; UNAVAILABLE once the daemon exited; the
  // daemon's reason once it closed the ring.
  absl::Status Health() const;

  // The reaper's doorbell: how many async submissions (RingRequest::async) have completed, and a
  // wait until that count differs from `seen`, at most `timeout` (one waiter at a time).
  uint32_t AsyncDone() const;
  void WaitAsync(uint32_t seen, absl::Duration timeout);

 private:
  SubmissionRingClient(ShmRegion region, int lock_fd, ring::Geometry geometry);
  ring::Header& header() const { return *reinterpret_cast<ring::Header*>(region_.data()); }
  uint32_t& sq(uint32_t i) const {
    return reinterpret_cast<uint32_t*>(region_.data() + geometry_.sq_offset)[i % geometry_.slots];
  }
  ring::Slot& slot(uint32_t i) const {
    return *reinterpret_cast<ring::Slot*>(region_.data() + geometry_.slot_offset + geometry_.slot_bytes * i);
  }

  ShmRegion region_;
  const int lock_fd_;
  const ring::Geometry geometry_;
  absl::Mutex mu_;
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
  uint32_t head_ ABSL_GUARDED_BY(mu_) = 0;  // submissions pushed
};

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_SUBMISSION_RING_CLIENT_H_

// SubmissionRingServer: the daemon's end of one worker's submission ring, the fast path that
// carries all-reduce requests and their completions through shared memory instead of one gRPC call
// each (layout and protocol: ipc/submission_ring_layout.h; the worker's end:
// ipc/submission_ring_client.h).
//
// The daemon creates the ring for a registered worker and sends it the name over the worker socket;
// the worker maps it and unlinks the name. One daemon thread calls Wait() in a loop and hands each
// submission to the job; whichever thread finishes the all-reduce calls Complete(). While the ring
// exists the daemon holds an exclusive flock on it: the worker's liveness check, which sees the
// lock go when the daemon dies, in whatever pid namespace either runs.
//
// Hostile workers: every request is copied out of the shared memory once and checked there. A bad
// request (a name too long, unknown flags) is returned with its own error, to be answered on its
// slot. A broken protocol (a slot index out of range, a slot submitted again before its
// completion, more submissions than slots) closes the ring: Wait() returns FAILED_PRECONDITION and
// the worker's next calls get that reason.
//
// Thread-safety: Wait() from one thread at a time; Complete(), Stop() and accessors from any.
// Close() once the waiting thread has returned for good.
#ifndef DQ_IPC_SUBMISSION_RING_SERVER_H_
#define DQ_IPC_SUBMISSION_RING_SERVER_H_

#include <stdint.h>

#include <atomic>
#include <memory>
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

class SubmissionRingServer {
 public:
  struct Options {
    uint32_t slots = 64;     // 1..ring::kMaxSlots
    uint32_t num_nodes = 1;  // 1..ring::kMaxNodes: completions say which of them took part
    std::string name_hint;   // for the shm name (ShmRegion::Create)
    // How long Wait() looks for a submission before it sleeps on the doorbell (common/spin.h).
    absl::Duration spin = absl::Microseconds(100);
  };
  // INVALID_ARGUMENT for options out of range; ShmRegion::Create's errors.
  static absl::StatusOr<std::unique_ptr<SubmissionRingServer>> Create(const Options& options);
  ~SubmissionRingServer();  // drops the lock (the worker's next liveness check fails), unmaps

  SubmissionRingServer(const SubmissionRingServer&) = delete;
  SubmissionRingServer& operator=(const SubmissionRingServer&) = delete;

  const std::string& shm_name() const { return region_.name(); }
  size_t bytes() const { return region_.size(); }
  uint32_t slots() const { return geometry_.slots; }

  struct Submission {
    uint32_t slot = 0;
    ring::RingRequest request;
    absl::Status bad;  // not OK: the request is malformed; answer it with this error
  };
  // Waits up to `timeout` for submissions and returns those that arrived, in submission order
  // (none after the timeout or Stop()). FAILED_PRECONDITION when the worker broke the protocol:
  // the ring is closed then, and Wait() returns that error from then on.
  absl::StatusOr<std::vector<Submission>> Wait(absl::Duration timeout);

  // Writes the completion of a slot Wait() returned and wakes whoever sleeps on it. Non-blocking.
  // Ignored for a slot not in flight.
  void Complete(uint32_t slot, const ring::RingCompletion& completion);

  // Makes Wait() return at once, now and from then on.
  void Stop();
  bool stopping() const { return stopping_.load(std::memory_order_acquire); }
  // Closes the ring for `why`: submissions not yet taken by Wait() complete with it, and the
  // worker's later submissions and waits fail with it. Call once Wait() has returned for good.
  void Close(const absl::Status& why);

  // Slots taken by Wait() and not completed yet.
  uint32_t InFlight() const;

 private:
  SubmissionRingServer(ShmRegion region, int lock_fd, ring::Geometry geometry, absl::Duration spin);
  ring::Header& header() const { return *reinterpret_cast<ring::Header*>(region_.data()); }
  uint32_t& sq(uint32_t i) const {
    return reinterpret_cast<uint32_t*>(region_.data() + geometry_.sq_offset)[i % geometry_.slots];
  }
  ring::Slot& slot(uint32_t i) const {
    return *reinterpret_cast<ring::Slot*>(region_.data() + geometry_.slot_offset + geometry_.slot_bytes * i);
  }
  // The submissions pushed since the last call (all of them checked), or the protocol error.
  absl::StatusOr<std::vector<Submission>> Take(uint32_t head);
  // Marks the ring closed for `why` in the shared header and wakes every sleeper.
  void MarkClosed(const absl::Status& why);

  ShmRegion region_;
  const int lock_fd_;
  const ring::Geometry geometry_;
  const absl::Duration spin_;
  uint32_t tail_ = 0;  // the next submission to take (Wait's thread only)
  std::atomic<bool> stopping_{false};
  absl::Status broken_;  // the protocol error that closed the ring (Wait's thread only)
  mutable absl::Mutex mu_;
  std::vector<bool> in_flight_ ABSL_GUARDED_BY(mu_);  // by slot: taken by Wait, not completed
  std::vector<bool> async_ ABSL_GUARDED_BY(mu_);      // by slot: the worker's reaper waits for it
};

}  // namespace dynamiq::ipc

#endif  // DQ_IPC_SUBMISSION_RING_SERVER_H_

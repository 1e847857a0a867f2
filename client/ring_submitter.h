// Internals of the client library (not installed): a Client's all-reduces through its submission
// ring (ipc/submission_ring_client.h), the fast path that replaces one gRPC call per all-reduce.
//
// A synchronous all-reduce waits on its own slot (a futex the daemon wakes). Asynchronous ones are
// completed by the reaper, a thread started with the first of them, which sleeps on the ring's
// async doorbell and completes their futures. A synchronous all-reduce that passes its deadline
// leaves its slot to the reaper, which frees it when the daemon's late answer comes.
//
// Errors read as the gRPC path's do: the daemon's statuses unchanged (UNAVAILABLE and
// DEADLINE_EXCEEDED with "AllReduce to dynamiqd at <socket>" in front), the client's own deadline
// as "... (deadline <timeout>, DQ_TIMEOUT_SECONDS)", a daemon that exited as UNAVAILABLE.
//
// Thread-safe.
#ifndef DQ_CLIENT_RING_SUBMITTER_H_
#define DQ_CLIENT_RING_SUBMITTER_H_

#include <stdint.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dynamiq/options.h"
#include "ipc/submission_ring_client.h"

namespace dynamiq::client::internal {

class RingSubmitter {
 public:
  using Done = std::function<void(absl::Status status, AllReduceResult result)>;

  RingSubmitter(std::unique_ptr<ipc::SubmissionRingClient> ring, std::string socket_path, absl::Duration timeout);
  ~RingSubmitter();  // stops the reaper; asynchronous all-reduces still pending complete CANCELLED

  RingSubmitter(const RingSubmitter&) = delete;
  RingSubmitter& operator=(const RingSubmitter&) = delete;

  // A free slot for the next all-reduce, or nothing (every slot in flight: use gRPC).
  std::optional<uint32_t> Acquire() { return ring_->Acquire(); }
  // Runs `request` in `slot` and waits for it (deadline: now + the client's timeout).
  absl::StatusOr<AllReduceResult> Run(uint32_t slot, ipc::ring::RingRequest request);
  // Submits `request` in `slot`; `done` runs once, on the reaper's thread, with the outcome.
  void Start(uint32_t slot, ipc::ring::RingRequest request, Done done);

 private:
  struct Pending {
    uint32_t slot = 0;
    absl::Time deadline;
    Done done;  // empty: abandoned by a synchronous caller, only the slot to free
  };
  // The outcome of a done slot (which it frees); `deadline`: the all-reduce's.
  absl::StatusOr<AllReduceResult> Collect(uint32_t slot, absl::Time deadline);
  // The client's errors, worded as the gRPC path words them.
  absl::Status DeadlinePassed() const;
  absl::Status Unusable(const absl::Status& health) const;
  void Add(Pending pending);
  void Reap();

  const std::unique_ptr<ipc::SubmissionRingClient> ring_;
  const std::string socket_path_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  std::vector<Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dynamiq::client::internal

#endif  // DQ_CLIENT_RING_SUBMITTER_H_

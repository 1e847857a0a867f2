// WorkerRings: the daemon's submission rings (ipc/submission_ring_server.h), one per worker that
// asked for one (the OpenSubmissionRing RPC). Each is served by a thread of its own that sleeps on
// the ring's doorbell, hands every submission on as the AllReduce RPC does (`submit`: the daemon's
// checks, then the job), and writes each answer back into the worker's slot from whichever thread
// completes it. Malformed submissions are answered with their error; a worker that breaks the
// ring's protocol loses its ring (its next calls say why), never the daemon's or another worker's
// state.
//
// Thread-safe. Close() and CloseAll() never run on a ring's own thread.
#ifndef DQ_SERVER_WORKER_RINGS_H_
#define DQ_SERVER_WORKER_RINGS_H_

#include <stdint.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "ipc/submission_ring_server.h"

namespace dynamiq::server {

class WorkerRings {
 public:
  using Reply = std::function<void(const ipc::ring::RingCompletion&)>;
  // Runs one request of `worker_id`; `reply` runs exactly once with its answer and must not block.
  using Submit = std::function<void(uint64_t worker_id, const ipc::ring::RingRequest& request, Reply reply)>;
  // Counts and logs a refused request (Daemon::RecordRejected).
  using Reject = std::function<void(const absl::Status& status, absl::string_view who)>;

  WorkerRings(Submit submit, Reject reject);
  ~WorkerRings();  // CloseAll

  WorkerRings(const WorkerRings&) = delete;
  WorkerRings& operator=(const WorkerRings&) = delete;

  // Starts serving `ring` for `worker_id`; ALREADY_EXISTS (and `ring` dropped) if it has one.
  absl::Status Start(uint64_t worker_id, std::unique_ptr<ipc::SubmissionRingServer> ring);
  // Stops serving the worker's ring: its thread is joined, submissions it had not taken yet fail
  // with `why`, and so do the worker's later calls. Answers of collectives still running land in
  // the ring (which lives until the last of them). No ring: nothing.
  void Close(uint64_t worker_id, const absl::Status& why);
  void CloseAll(const absl::Status& why);
  size_t size() const;

 private:
  struct Served {
    std::shared_ptr<ipc::SubmissionRingServer> ring;
    std::thread thread;
  };
  void Serve(uint64_t worker_id, std::shared_ptr<ipc::SubmissionRingServer> ring);
  static void Stop(Served& served, const absl::Status& why);

  const Submit submit_;
  const Reject reject_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Served> served_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_WORKER_RINGS_H_

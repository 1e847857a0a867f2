// ErrorProbeAllReduce: the sampled measurement of compression error (server/error_probe.h) as a
// decorator of the cross-node all-reduce (server/cross_node_all_reduce.h).
//
// Run decides whether the collective is sampled: a codec other than none and
// SampleForError(job id, options.sequence, rate), the same on every node. Unsampled, it is the
// inner algorithm and nothing more. Sampled, it keeps a copy of this node's sum, runs the inner
// algorithm on `data`, then the exact side all-reduce of the copy through the engine (codec none,
// whatever the inner is: the reference is the exact sum), over the same transport and step-header
// validation, under ErrorProbeSequence(options.sequence), without the side lane (the collective
// summed it) and with its own deadline; and reports vnmse = Vnmse(data, exact) and probe_seconds.
// A failed measurement never fails the collective (its result is fine): no memory for the copy
// aborts the transport at once (the peers are about to run the side all-reduce and would wait for
// their deadline) and a failed side all-reduce leaves it unusable; both set probe_status and
// regroup. An error of the inner algorithm is returned as it is, with no side all-reduce (every
// node fails the collective).
//
// Thread-safety: none (one collective at a time).
#ifndef DQ_SERVER_ERROR_PROBE_ALL_REDUCE_H_
#define DQ_SERVER_ERROR_PROBE_ALL_REDUCE_H_

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/cross_node_all_reduce.h"

namespace dynamiq::server {

class ErrorProbeAllReduce final : public CrossNodeAllReduce {
 public:
  // `inner` and the characters of `job_id` must outlive the object. `rate` is the share of
  // collectives sampled (0..1, node 0's, so every node's); `timeout` bounds the side all-reduce.
  ErrorProbeAllReduce(CrossNodeAllReduce& inner, absl::string_view job_id, double rate, absl::Duration timeout)
      : inner_(inner), job_id_(job_id), rate_(rate), timeout_(timeout) {}

  absl::StatusOr<Outcome> Run(const kernels::Codec& codec, engine::Transport& transport,
                              const engine::AllReduceOptions& options, float* data, size_t n) override;

 private:
  CrossNodeAllReduce& inner_;
  const absl::string_view job_id_;
  const double rate_;
  const absl::Duration timeout_;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_ERROR_PROBE_ALL_REDUCE_H_

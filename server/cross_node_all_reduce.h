// CrossNodeAllReduce: the all-reduce of this node's fp32 sum across the nodes, in place: the step
// of a collective between the local reduce and the write-back (server/data_path.h). The plain one,
// EngineCrossNodeAllReduce, is engine::AllReduce; decorators wrap another CrossNodeAllReduce and
// add to what it does without forking the data path:
//   ErrorFeedbackAllReduce (server/error_feedback_all_reduce.h): EF21(M) around arc_topk;
//   ErrorProbeAllReduce (server/error_probe_all_reduce.h): the sampled vNMSE measurement.
// HostDataPath composes them per collective: probe(feedback(engine)), feedback only where the job
// keeps error-feedback state for the tensor.
//
// Contract of Run: every rank of `transport` calls it for the same collective (same codec,
// options and n); on success `data` holds the cross-node result (bit-identical on every rank for
// every codec the engine runs), and options.side_sums their sums as the engine's side lane makes
// them. Errors as the engine's (the transport is then aborted and the caller re-forms the group);
// `data` is then unspecified. A decorator that runs more on the transport than its inner (a side
// all-reduce, a dense first step) does so the same way on every rank.
//
// Thread-safety: one Run at a time per object and per transport.
#ifndef DQ_SERVER_CROSS_NODE_ALL_REDUCE_H_
#define DQ_SERVER_CROSS_NODE_ALL_REDUCE_H_

#include <stddef.h>
#include <stdint.h>

#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/allreduce.h"
#include "engine/schedule.h"
#include "engine/transport.h"
#include "kernels/codec.h"

namespace dynamiq::server {

class CrossNodeAllReduce {
 public:
  // What the all-reduce did, and what a probe around it measured (unset where none ran).
  struct Outcome {
    uint64_t bytes_sent = 0;  // this node's, all phases, headers included
    // The schedule that ran (what topology=auto resolved to).
    engine::Topology topology = engine::Topology::kRing;
    // With options.keep_plan_widths: the plan's width per super-group (engine::AllReduceResult).
    std::vector<uint8_t> plan_widths;
    std::optional<double> vnmse;  // unset: not sampled, or undefined (zero or non-finite sum)
    double probe_seconds = 0;     // time the measurement took (not the collective's)
    absl::Status probe_status;    // a failed measurement does not fail the collective
    bool regroup = false;         // the measurement left the transport unusable: re-form the group
  };

  virtual ~CrossNodeAllReduce() = default;
  // All-reduces `data` (n floats) across the ranks of `transport` in place with `codec` (above).
  virtual absl::StatusOr<Outcome> Run(const kernels::Codec& codec, engine::Transport& transport,
                                      const engine::AllReduceOptions& options, float* data, size_t n) = 0;
};

// The plain algorithm: engine::AllReduce of `data` into itself.
class EngineCrossNodeAllReduce final : public CrossNodeAllReduce {
 public:
  absl::StatusOr<Outcome> Run(const kernels::Codec& codec, engine::Transport& transport,
                              const engine::AllReduceOptions& options, float* data, size_t n) override;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_CROSS_NODE_ALL_REDUCE_H_

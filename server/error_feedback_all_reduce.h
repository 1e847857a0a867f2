// ErrorFeedbackAllReduce: EF21(M) error feedback (server/error_feedback.h has the algorithm and
// its state) as a decorator of the cross-node all-reduce (server/cross_node_all_reduce.h). One
// object serves one collective of one tensor: it holds that tensor's state and momentum eta.
//
// Run with codec arc_topk is one EF21(M) step of this node's sum x = `data`, which is replaced by
// the estimate G. Both of the step's all-reduces go through the inner algorithm: the dense first
// step (or the one after a reset) with codec none and the caller's options; the later steps with
// arc_topk on u = v_i - g_i, with options.keep_plan_widths set (the inner must report the plan's
// widths: the rows C kept). On failure the state is reset (every node fails the collective too,
// so the next step is the dense first step everywhere) and `data` is unspecified.
// Any other codec passes straight through to the inner algorithm and leaves the state alone
// (error feedback is defined for ARC-Top-K's selection only).
//
// The Outcome is the inner's for the step's all-reduce (bytes, topology, widths).
// Thread-safety: none (the job's reducer thread, one collective at a time).
#ifndef DQ_SERVER_ERROR_FEEDBACK_ALL_REDUCE_H_
#define DQ_SERVER_ERROR_FEEDBACK_ALL_REDUCE_H_

#include "server/cross_node_all_reduce.h"
#include "server/error_feedback.h"

namespace dynamiq::server {

class ErrorFeedbackAllReduce final : public CrossNodeAllReduce {
 public:
  // `inner` and `state` must outlive the object; `eta` in (0, 1] (1: plain EF21; below 1 the state
  // carries its momentum vector).
  ErrorFeedbackAllReduce(CrossNodeAllReduce& inner, ErrorFeedbackState& state, double eta = 1.0)
      : inner_(inner), state_(state), eta_(eta) {}

  absl::StatusOr<Outcome> Run(const kernels::Codec& codec, engine::Transport& transport,
                              const engine::AllReduceOptions& options, float* data, size_t n) override;

 private:
  absl::StatusOr<Outcome> Step(const kernels::Codec& codec, engine::Transport& transport,
                               const engine::AllReduceOptions& options, float* x, size_t n);

  CrossNodeAllReduce& inner_;
  ErrorFeedbackState& state_;
  const double eta_;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_ERROR_FEEDBACK_ALL_REDUCE_H_

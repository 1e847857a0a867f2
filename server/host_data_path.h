// HostDataPath: the DataPath of CPU nodes (server/data_path.h). The sum lives in local rank 0's own
// buffer when that is fp32 host memory (no copy: the cross-node all-reduce runs in place in shared
// memory), else in scratch memory. The cross-node step over the job's transport (tcp or gloo) is
// composed per collective from server/cross_node_all_reduce.h: engine::AllReduce, inside EF21 error
// feedback where the job set a state (ErrorFeedbackAllReduce, arc_topk only), inside the sampled
// error probe (ErrorProbeAllReduce: an exact side all-reduce of a copy of this node's sum).
//
// Thread-safety: one collective at a time, as DataPath says.
#ifndef DQ_SERVER_HOST_DATA_PATH_H_
#define DQ_SERVER_HOST_DATA_PATH_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/thread_pool.h"
#include "engine/buffer_pool.h"
#include "server/data_path.h"

namespace dynamiq::server {

class HostDataPath final : public DataPath {
 public:
  // `job_id` decides which collectives are sampled (the same on every node); `probe_timeout` bounds
  // the exact side all-reduce; `codec_pool` splits each collective's codec work (statistics,
  // compress, DAR, decompress) across its threads (kernels/parallel_codec.h; null: this thread).
  HostDataPath(std::string job_id, absl::Duration probe_timeout,
               std::shared_ptr<common::ThreadPool> codec_pool = nullptr);

  absl::Status LocalReduce(absl::Span<const Region> inputs, size_t n) override;
  absl::StatusOr<CrossNodeResult> CrossNode(const kernels::Codec& codec, engine::Transport& transport,
                                            const engine::AllReduceOptions& options, size_t n,
                                            double error_sample_rate) override;
  absl::StatusOr<CrossNodeResult> CrossNodeLossy(engine::DatagramTransport& datagrams,
                                                 const engine::LossyAllReduceOptions& options, size_t n) override;
  bool ResultEnergies(size_t n, std::vector<double>* energies) override;
  absl::Status WriteBack(absl::Span<const Output> outputs, size_t n, float scale) override;
  void SetErrorFeedback(ErrorFeedbackState* state, double momentum) override {
    error_feedback_ = state;
    momentum_ = momentum;
  }

 private:
  const std::string job_id_;
  const absl::Duration probe_timeout_;
  const std::shared_ptr<common::ThreadPool> codec_pool_;
  float* sum_ = nullptr;  // the current collective's sum: local rank 0's buffer or scratch_
  std::vector<float> scratch_;
  engine::BufferPool buffers_;                    // the engine's per-collective buffers, reused
  ErrorFeedbackState* error_feedback_ = nullptr;  // for the next CrossNode only
  double momentum_ = 1.0;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_HOST_DATA_PATH_H_

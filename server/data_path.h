// DataPath: where a job's collectives run, after its local workers have agreed on one (Job): the
// local reduce of their regions into an fp32 sum, the all-reduce of that sum across nodes, and the
// write-back of the result into every region. Job runs every collective as these three calls; the
// implementations are
//   HostDataPath (server/host_data_path.h): CPU nodes; shared-memory regions, the sum in place in
//     local rank 0's buffer, the engine's all-reduce over the job's transport (tcp or gloo), and
//     the sampled error probe;
//   CudaDataPath (server/cuda_device.h): GPU nodes; device (or staged host) regions, CUDA reduce
//     kernels, engine::NcclAllReduce.
// This header is CUDA-free, so Job and its tests (with fake paths) need no CUDA.
//
// Thread-safety: one collective at a time (the job's reducer thread), its calls in order.
#ifndef DQ_SERVER_DATA_PATH_H_
#define DQ_SERVER_DATA_PATH_H_

#include <stddef.h>
#include <stdint.h>

#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/allreduce.h"
#include "engine/lossy_all_reduce.h"
#include "engine/transport.h"
#include "kernels/codec.h"
#include "kernels/dtype.h"
#include "server/error_feedback.h"

namespace dynamiq::server {

class DataPath {
 public:
  // One worker's region of `n` elements.
  struct Region {
    uint8_t* data = nullptr;
    kernels::DType dtype = kernels::DType::kFloat32;
    bool device = false;  // device memory of the path's device (else host memory)
    // The region's weight in LocalReduce's sum (contribution accounting: a worker's sample count);
    // finite and >= 0. Weights of 1 add the values as they are, bit for bit.
    float weight = 1.0f;
  };
  struct Output {
    Region region;
    bool average = false;  // write sum * scale instead of the sum
  };
  // What the cross-node step did: bytes this node sent, and, for a collective sampled for its
  // compression error (paths that can measure it), the vNMSE against an exact all-reduce on the side.
  struct CrossNodeResult {
    uint64_t bytes_sent = 0;
    // The schedule that ran (what topology=auto resolved to).
    engine::Topology topology = engine::Topology::kRing;
    std::optional<double> vnmse;  // unset: not sampled, or undefined (zero or non-finite sum)
    double probe_seconds = 0;     // time the measurement took (not the collective's)
    absl::Status probe_status;    // a failed measurement does not fail the collective
    bool regroup = false;         // the measurement left the transport unusable: re-form the group
    // CrossNodeLossy: what arrived (engine/lossy_all_reduce.h).
    std::optional<engine::LossyAllReduceResult> lossy;
  };

  virtual ~DataPath() = default;
  // The sum lives in device memory (GPU nodes): Job's messages say so ("local reduce on the device").
  virtual bool on_device() const { return false; }
  // CrossNode carries AllReduceOptions::side_sums (the straggler view then uses it for every
  // collective; weighted collectives need it).
  virtual bool has_side_lane() const { return true; }
  // The weighted sum of `inputs` (each region's values times its weight, in their order,
  // accumulated in fp32) becomes the collective's sum of `n` elements. Errors: RESOURCE_EXHAUSTED
  // (no memory for the sum), INTERNAL (device errors), UNIMPLEMENTED (weights other than 1 where
  // the path has no weighted reduce); messages without the collective's name (Job adds it).
  virtual absl::Status LocalReduce(absl::Span<const Region> inputs, size_t n) = 0;
  // All-reduces the sum across the ranks of `transport` in place with `codec`, and
  // options.side_sums (the exact side lane, engine/side_lane.h) beside it; measures the error
  // with probability `error_sample_rate` where the path can. Errors as the engine's;
  // INVALID_ARGUMENT for a transport the implementation cannot drive; UNIMPLEMENTED for a side
  // lane where the path has none.
  virtual absl::StatusOr<CrossNodeResult> CrossNode(const kernels::Codec& codec, engine::Transport& transport,
                                                    const engine::AllReduceOptions& options, size_t n,
                                                    double error_sample_rate) = 0;
  // The loss-tolerant all-reduce (engine/lossy_all_reduce.h) of the sum across the ranks of
  // `datagrams`: the sum becomes their estimate of the ranks' sum (the mean over the contributions
  // that arrived, times the ranks). UNIMPLEMENTED where the path has none (GPU nodes).
  virtual absl::StatusOr<CrossNodeResult> CrossNodeLossy(engine::DatagramTransport& datagrams,
                                                         const engine::LossyAllReduceOptions& options, size_t n) {
    return absl::UnimplementedError("this node's data path has no loss-tolerant all-reduce (CPU nodes only)");
  }
  // The EF21(M) state and momentum (server/error_feedback.h) the next CrossNode uses if its codec is arc_topk; null:
  // none. Paths without error feedback (the device path, which runs no arc_topk) ignore it.
  virtual void SetErrorFeedback(ErrorFeedbackState* state, double momentum) {}
  // Per 256-element super-group, the sum of squares of the cross-node result of `n` elements (call
  // after CrossNode, before WriteBack) into `energies`; false where the path cannot read it (the
  // sum lives in device memory). One budget per step plans from it (server/step_budget_planner.h).
  virtual bool ResultEnergies(size_t /*n*/, std::vector<double>* /*energies*/) { return false; }
  // Writes the sum (times `scale` for outputs that average), converted to each output's dtype, into
  // every output; returns once all of them hold it.
  virtual absl::Status WriteBack(absl::Span<const Output> outputs, size_t n, float scale) = 0;
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_DATA_PATH_H_

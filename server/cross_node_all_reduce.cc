#include "server/cross_node_all_reduce.h"

#include <utility>

#include "common/status_macros.h"

namespace dynamiq::server {

absl::StatusOr<CrossNodeAllReduce::Outcome> EngineCrossNodeAllReduce::Run(const kernels::Codec& codec,
                                                                          engine::Transport& transport,
                                                                          const engine::AllReduceOptions& options,
                                                                          float* data, size_t n) {
  DQ_ASSIGN_OR_RETURN(engine::AllReduceResult r,
                      engine::AllReduce(codec, transport, options, {data, kernels::DType::kFloat32, 0, nullptr},
                                        {data, kernels::DType::kFloat32, 0, nullptr}, n));
  Outcome out;
  out.bytes_sent = r.bytes_sent;
  out.topology = r.topology;
  out.plan_widths = std::move(r.plan_widths);
  return out;
}

}  // namespace dynamiq::server

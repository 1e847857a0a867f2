#include "server/error_probe_all_reduce.h"

#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/codec_registry.h"
#include "server/error_probe.h"

namespace dynamiq::server {

absl::StatusOr<CrossNodeAllReduce::Outcome> ErrorProbeAllReduce::Run(const kernels::Codec& codec,
                                                                     engine::Transport& transport,
                                                                     const engine::AllReduceOptions& options,
                                                                     float* data, size_t n) {
  // Every node decides the same way (SampleForError is a function of job, sequence and the shared rate).
  const bool sampled = codec.id() != kernels::CodecId::kNone && SampleForError(job_id_, options.sequence, rate_);
  if (!sampled) return inner_.Run(codec, transport, options, data, n);
  std::vector<float> exact;
  bool no_memory_for_probe = false;
  try {
    exact.assign(data, data + n);
  } catch (const std::bad_alloc&) {
    no_memory_for_probe = true;  // the collective itself is unaffected; its probe is skipped below
  }
  DQ_ASSIGN_OR_RETURN(Outcome out, inner_.Run(codec, transport, options, data, n));
  if (no_memory_for_probe) {
    // The peers are about to run the side all-reduce: make it fail now rather than at their
    // deadline, and re-form the group as they will (every node connects again for its next
    // collective).
    transport.Abort();
    out.regroup = true;
    out.probe_status = absl::ResourceExhaustedError(absl::StrCat("no memory for a ", n, "-element exact sum"));
    return out;
  }
  // The exact side all-reduce (codec none) of the copy, over the same transport and step-header
  // validation, under a sequence number no real collective uses.
  const absl::Time start = absl::Now();
  DQ_ASSIGN_OR_RETURN(auto none, kernels::CreateCodec(kernels::CodecConfig{kernels::CodecId::kNone}));
  engine::AllReduceOptions exact_options = options;
  exact_options.side_sums = {};  // summed once, by the collective itself
  exact_options.sequence = ErrorProbeSequence(options.sequence);
  exact_options.timeout = timeout_;  // a measurement on the side, with its own deadline
  auto exact_result =
      engine::AllReduce(*none, transport, exact_options, {exact.data(), kernels::DType::kFloat32, 0, nullptr},
                        {exact.data(), kernels::DType::kFloat32, 0, nullptr}, n);
  out.probe_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!exact_result.ok()) {
    // The result is fine but the group is broken: re-form it, as after a failed collective.
    out.regroup = true;
    out.probe_status = exact_result.status();
    return out;
  }
  out.vnmse = Vnmse(data, exact.data(), n);
  return out;
}

}  // namespace dynamiq::server

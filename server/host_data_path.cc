#include "server/host_data_path.h"

#include <cmath>
#include <new>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/bf16_math.h"
#include "kernels/dynamiq_math.h"
#include "kernels/parallel_codec.h"
#include "server/cross_node_all_reduce.h"
#include "server/error_feedback_all_reduce.h"
#include "server/error_probe_all_reduce.h"

namespace dynamiq::server {

HostDataPath::HostDataPath(std::string job_id, absl::Duration probe_timeout,
                           std::shared_ptr<common::ThreadPool> codec_pool)
    : job_id_(std::move(job_id)), probe_timeout_(probe_timeout), codec_pool_(std::move(codec_pool)) {}

absl::Status HostDataPath::LocalReduce(absl::Span<const Region> inputs, size_t n) {
  sum_ = nullptr;
  if (inputs.empty()) return absl::InvalidArgumentError("no regions to reduce");
  for (const Region& r : inputs) {
    if (r.device) return absl::InvalidArgumentError("a device region on a CPU node");
    if (!(r.weight >= 0 && std::isfinite(r.weight))) {
      return absl::InvalidArgumentError(
          absl::StrCat("a region's weight is ", r.weight, "; weights are finite and >= 0"));
    }
  }
  const float w0 = inputs[0].weight;
  if (inputs[0].dtype == kernels::DType::kFloat32) {
    sum_ = reinterpret_cast<float*>(inputs[0].data);
    // The sum lives in local rank 0's buffer, which the write-back overwrites anyway.
    if (w0 != 1.0f) {
      for (size_t i = 0; i < n; ++i) sum_[i] *= w0;
    }
  } else {
    try {
      scratch_.resize(n);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(absl::StrCat("no memory for a ", n, "-element sum"));
    }
    sum_ = scratch_.data();
    const uint16_t* h = reinterpret_cast<const uint16_t*>(inputs[0].data);
    if (w0 == 1.0f) {
      for (size_t i = 0; i < n; ++i) sum_[i] = kernels::Bf16ToFloat(h[i]);
    } else {
      for (size_t i = 0; i < n; ++i) sum_[i] = w0 * kernels::Bf16ToFloat(h[i]);
    }
  }
  // In local-rank order: deterministic. Weights of 1 take the unweighted loops (bit for bit).
  for (size_t k = 1; k < inputs.size(); ++k) {
    const float w = inputs[k].weight;
    if (inputs[k].dtype == kernels::DType::kFloat32) {
      const float* f = reinterpret_cast<const float*>(inputs[k].data);
      if (w == 1.0f) {
        for (size_t i = 0; i < n; ++i) sum_[i] += f[i];
      } else {
        for (size_t i = 0; i < n; ++i) sum_[i] += w * f[i];
      }
    } else {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(inputs[k].data);
      if (w == 1.0f) {
        for (size_t i = 0; i < n; ++i) sum_[i] += kernels::Bf16ToFloat(h[i]);
      } else {
        for (size_t i = 0; i < n; ++i) sum_[i] += w * kernels::Bf16ToFloat(h[i]);
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DataPath::CrossNodeResult> HostDataPath::CrossNode(const kernels::Codec& job_codec,
                                                                  engine::Transport& transport,
                                                                  const engine::AllReduceOptions& options, size_t n,
                                                                  double error_sample_rate) {
  // The engine's codec calls split their work across the pool (bit-identical to one thread).
  const kernels::ParallelCodec codec(job_codec, codec_pool_.get());
  if (sum_ == nullptr) return absl::FailedPreconditionError("CrossNode before LocalReduce");
  engine::AllReduceOptions o = options;
  o.buffers = &buffers_;
  ErrorFeedbackState* error_feedback = error_feedback_;
  error_feedback_ = nullptr;
  // probe(feedback(engine)): the probe measures what the job gets, error feedback included.
  EngineCrossNodeAllReduce engine;
  std::optional<ErrorFeedbackAllReduce> feedback;
  CrossNodeAllReduce* algorithm = &engine;
  if (error_feedback != nullptr) algorithm = &feedback.emplace(engine, *error_feedback, momentum_);
  ErrorProbeAllReduce probe(*algorithm, job_id_, error_sample_rate, probe_timeout_);
  DQ_ASSIGN_OR_RETURN(CrossNodeAllReduce::Outcome reduced, probe.Run(codec, transport, o, sum_, n));
  CrossNodeResult out;
  out.bytes_sent = reduced.bytes_sent;
  out.topology = reduced.topology;
  out.vnmse = reduced.vnmse;
  out.probe_seconds = reduced.probe_seconds;
  out.probe_status = std::move(reduced.probe_status);
  out.regroup = reduced.regroup;
  return out;
}

absl::StatusOr<DataPath::CrossNodeResult> HostDataPath::CrossNodeLossy(engine::DatagramTransport& datagrams,
                                                                       const engine::LossyAllReduceOptions& options,
                                                                       size_t n) {
  if (sum_ == nullptr) return absl::FailedPreconditionError("CrossNodeLossy before LocalReduce");
  const absl::Span<float> sum(sum_, n);
  DQ_ASSIGN_OR_RETURN(engine::LossyAllReduceResult lossy, engine::LossyAllReduceMean(datagrams, options, sum, sum));
  // The mean over what arrived, times the ranks: the estimate of the sum that WriteBack scales.
  const float ranks = static_cast<float>(datagrams.size());
  for (float& x : sum) x *= ranks;
  CrossNodeResult out;
  out.bytes_sent = lossy.bytes_sent;
  out.topology = engine::Topology::kTwoShot;  // one hop each way: reduce-scatter, all-gather
  out.lossy = std::move(lossy);
  return out;
}

bool HostDataPath::ResultEnergies(size_t n, std::vector<double>* energies) {
  if (sum_ == nullptr) return false;
  energies->assign((n + kernels::kSuperGroupSize - 1) / kernels::kSuperGroupSize, 0.0);
  for (size_t i = 0; i < n; ++i) {
    const double x = sum_[i];
    (*energies)[i / kernels::kSuperGroupSize] += x * x;
  }
  return true;
}

absl::Status HostDataPath::WriteBack(absl::Span<const Output> outputs, size_t n, float scale) {
  if (sum_ == nullptr) return absl::FailedPreconditionError("WriteBack before LocalReduce");
  // Every output but the one holding the sum first, then that one (scaled in place).
  for (size_t k = outputs.size(); k-- > 0;) {
    const Output& out = outputs[k];
    if (out.region.dtype == kernels::DType::kFloat32) {
      float* f = reinterpret_cast<float*>(out.region.data);
      if (f == sum_) {
        if (out.average) {
          for (size_t i = 0; i < n; ++i) f[i] = sum_[i] * scale;
        }
      } else {
        for (size_t i = 0; i < n; ++i) f[i] = out.average ? sum_[i] * scale : sum_[i];
      }
    } else {
      uint16_t* h = reinterpret_cast<uint16_t*>(out.region.data);
      for (size_t i = 0; i < n; ++i) h[i] = kernels::FloatToBf16(out.average ? sum_[i] * scale : sum_[i]);
    }
  }
  sum_ = nullptr;
  return absl::OkStatus();
}

}  // namespace dynamiq::server

#include "bench/controller_sim.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/synthetic_gradients.h"
#include "common/status_macros.h"
#include "engine/schedule.h"
#include "engine/simulator.h"
#include "kernels/codec_registry.h"

namespace dynamiq::bench {
namespace {

absl::Status Validate(const ControllerSimOptions& o) {
  if (o.ranks < 2 || o.ranks > 64)
    return absl::InvalidArgumentError(absl::StrCat("ranks must be 2..64, got ", o.ranks));
  if (o.elements < 256) return absl::InvalidArgumentError(absl::StrCat("elements must be >= 256, got ", o.elements));
  if (o.steps < 1 || o.steps > 100000) {
    return absl::InvalidArgumentError(absl::StrCat("steps must be 1..100000, got ", o.steps));
  }
  if (o.apply_delay < 0) return absl::InvalidArgumentError("apply_delay must be >= 0");
  for (double rho : {o.correlation_before, o.correlation_after}) {
    if (!(rho >= 0 && rho <= 1)) return absl::InvalidArgumentError(absl::StrCat("correlation must be 0..1, got ", rho));
  }
  for (double sigma : {o.magnitude_sigma_before, o.magnitude_sigma_after}) {
    if (!(sigma >= 0 && sigma <= 4)) {
      return absl::InvalidArgumentError(absl::StrCat("magnitude_sigma must be 0..4, got ", sigma));
    }
  }
  DQ_RETURN_IF_ERROR(server::ValidateErrorBudgetPolicy(o.policy));
  return server::ValidateControllerTuning(o.tuning);
}

// Runs the all-reduces of every step for the budgets a caller asks for, on data generated once
// per step; rounding is keyed by the step, so equal budgets give equal results in every run.
class StepRunner {
 public:
  static absl::StatusOr<std::unique_ptr<StepRunner>> Create(const ControllerSimOptions& o) {
    DQ_RETURN_IF_ERROR(Validate(o));
    DQ_ASSIGN_OR_RETURN(engine::Topology topology, engine::ParseTopology(o.topology));
    DQ_ASSIGN_OR_RETURN(engine::Schedule schedule, engine::MakeSchedule(topology, o.ranks));
    return std::unique_ptr<StepRunner>(new StepRunner(o, std::move(schedule)));
  }

  void Generate(int step) {
    SyntheticOptions s;
    s.workers = o_.ranks;
    s.elements = o_.elements;
    s.seed = o_.seed;
    s.step = static_cast<uint64_t>(step);
    const bool after = Shifted(o_, step);
    s.correlation = after ? o_.correlation_after : o_.correlation_before;
    s.magnitude_sigma = after ? o_.magnitude_sigma_after : o_.magnitude_sigma_before;
    inputs_ = SyntheticGradients(s);
    exact_ = ExactSum(inputs_);
    step_ = step;
  }

  // All-reduces the current step's data at `bits`; returns (vnmse, wire bits per coordinate).
  absl::StatusOr<std::pair<double, double>> Run(double bits) {
    DQ_ASSIGN_OR_RETURN(kernels::Codec * codec, CodecFor(bits));
    std::vector<kernels::Source> in;
    std::vector<kernels::Dest> out;
    outputs_.resize(o_.ranks);
    for (int r = 0; r < o_.ranks; ++r) {
      outputs_[r].resize(o_.elements);
      in.push_back(kernels::Source{inputs_[r].data(), kernels::DType::kFloat32, 0, nullptr});
      out.push_back(kernels::Dest{outputs_[r].data(), kernels::DType::kFloat32, 0, nullptr});
    }
    DQ_ASSIGN_OR_RETURN(engine::SimulationResult sim, engine::SimulateAllReduce(*codec, schedule_, o_.elements,
                                                                                static_cast<uint64_t>(step_), in, out));
    return std::make_pair(Vnmse(outputs_[0].data(), exact_), engine::WireBitsPerCoord(sim, o_.elements, o_.ranks));
  }

 private:
  StepRunner(const ControllerSimOptions& o, engine::Schedule schedule) : o_(o), schedule_(std::move(schedule)) {}

  absl::StatusOr<kernels::Codec*> CodecFor(double bits) {
    auto it = codecs_.find(bits);
    if (it == codecs_.end()) {
      kernels::CodecConfig c;
      c.id = kernels::CodecId::kDynamiq;
      c.bits = bits;
      DQ_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Codec> codec, kernels::CreateCodec(c));
      it = codecs_.emplace(bits, std::move(codec)).first;
    }
    return it->second.get();
  }

  const ControllerSimOptions o_;
  const engine::Schedule schedule_;
  std::map<double, std::unique_ptr<kernels::Codec>> codecs_;
  std::vector<std::vector<float>> inputs_, outputs_;
  std::vector<double> exact_;
  int step_ = 0;
};

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

bool Shifted(const ControllerSimOptions& o, int step) {
  return step >= o.shift_step && (o.revert_step <= o.shift_step || step < o.revert_step);
}

absl::StatusOr<SimResult> RunControllerSim(const ControllerSimOptions& o, const std::vector<double>& fixed_bits) {
  DQ_ASSIGN_OR_RETURN(std::unique_ptr<StepRunner> runner, StepRunner::Create(o));
  DQ_ASSIGN_OR_RETURN(std::unique_ptr<server::CompressionController> controller,
                      server::CompressionController::Create(o.policy, o.tuning));
  std::vector<double> budgets = fixed_bits;
  budgets.push_back(o.initial_bits);
  for (double b : budgets) {
    if (!(b >= server::kMinDynamiqBits && b <= server::kMaxDynamiqBits)) {
      return absl::InvalidArgumentError(absl::StrCat("initial and fixed bits must be 3..8, got ", b));
    }
  }
  struct Change {
    int step;
    double bits;
    uint64_t epoch;
  };
  std::deque<Change> scheduled;
  double bits = o.initial_bits;
  uint64_t epoch = 0, latest_epoch = 0;
  SimResult result;
  result.fixed_bits = fixed_bits;
  result.fixed_vnmse.assign(fixed_bits.size(), std::vector<double>(o.steps, std::nan("")));
  std::vector<bool> failed(fixed_bits.size(), false);
  for (int t = 0; t < o.steps; ++t) {
    while (!scheduled.empty() && scheduled.front().step <= t) {
      bits = scheduled.front().bits;
      epoch = scheduled.front().epoch;
      scheduled.pop_front();
    }
    runner->Generate(t);
    DQ_ASSIGN_OR_RETURN(auto measured, runner->Run(bits));
    SimStep s;
    s.step = t;
    s.bits = bits;
    s.epoch = epoch;
    s.vnmse = measured.first;
    s.wire_bits = measured.second;
    s.shifted = Shifted(o, t);
    std::optional<server::BitsDecision> d = controller->Observe({s.vnmse, bits, epoch});
    if (d.has_value()) {
      // Published at once, like Daemon::SetCompression: the next epoch, applied after the delay.
      controller->Published(++latest_epoch);
      scheduled.push_back(Change{t + 1 + o.apply_delay, d->bits, latest_epoch});
      s.decision = d->reason;
    }
    result.steps.push_back(std::move(s));
    for (size_t i = 0; i < fixed_bits.size(); ++i) {
      if (failed[i]) continue;
      DQ_ASSIGN_OR_RETURN(auto fixed, runner->Run(fixed_bits[i]));
      result.fixed_vnmse[i][t] = fixed.first;
      failed[i] = fixed.first > o.policy.target_vnmse;
    }
  }
  result.controller = controller->stats();
  return result;
}

std::optional<double> SmallestFixedBudgetMeeting(const SimResult& result, double target) {
  std::optional<double> best;
  for (size_t i = 0; i < result.fixed_bits.size(); ++i) {
    const std::vector<double>& v = result.fixed_vnmse[i];
    // NaN (not run after a failure) fails the comparison too.
    const bool met = std::all_of(v.begin(), v.end(), [&](double x) { return x <= target; });
    if (met && (!best.has_value() || result.fixed_bits[i] < *best)) best = result.fixed_bits[i];
  }
  return best;
}

std::string FormatSimJson(const std::vector<SimStep>& steps, const ControllerSimOptions& o) {
  std::string out;
  for (const SimStep& s : steps) {
    absl::StrAppendFormat(&out,
                          R"({"step":%d,"target":%.4g,"bits":%.4g,"vnmse":%.6g,"epoch":%d,"wire_bits":%.4f,)"
                          R"("shifted":%s,"decision":"%s"})"
                          "\n",
                          s.step, o.policy.target_vnmse, s.bits, s.vnmse, s.epoch, s.wire_bits,
                          s.shifted ? "true" : "false", JsonEscape(s.decision));
  }
  return out;
}

std::string FormatSimCsv(const std::vector<SimStep>& steps, const ControllerSimOptions& o) {
  std::string out = "step,target,bits,vnmse,epoch,wire_bits,shifted,decision\n";
  for (const SimStep& s : steps) {
    std::string reason = s.decision;
    for (char& c : reason) {
      if (c == ',' || c == '"') c = ';';
    }
    absl::StrAppendFormat(&out, "%d,%.4g,%.4g,%.6g,%d,%.4f,%d,%s\n", s.step, o.policy.target_vnmse, s.bits, s.vnmse,
                          s.epoch, s.wire_bits, s.shifted ? 1 : 0, reason);
  }
  return out;
}

}  // namespace dynamiq::bench

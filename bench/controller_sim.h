// Closed-loop simulation of error-budget compression (server/compression_controller.h): n ranks
// all-reduce synthetic gradients (bench/synthetic_gradients.h) with the real DynamiQ codec on the
// in-process multi-hop simulator (engine/simulator.h), one all-reduce per training step. The
// vNMSE of every step's result against the exact sum is fed to a CompressionController, and its
// decisions take effect `apply_delay` steps later, as in dynamiqd (a change published after
// collective t applies at t + 3: t + 1 and t + 2 still run the old budget under the old epoch).
//
// The gradients shift at `shift_step` (e.g. warm-up ending or a learning-rate change) and, when
// revert_step > shift_step, shift back there: the spread of the per-super-group magnitudes (and
// optionally the correlation between ranks) changes; a narrower spread raises the error at a given
// b̄ about 10x (bench/synthetic_gradients.h). Fixed budgets are measured in the same pass, on
// exactly the same data and rounding, for the comparison with the best fixed budget.
#ifndef DQ_BENCH_CONTROLLER_SIM_H_
#define DQ_BENCH_CONTROLLER_SIM_H_

#include <stdint.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/compression_controller.h"

namespace dynamiq::bench {

struct ControllerSimOptions {
  int ranks = 8;
  size_t elements = 1 << 16;
  std::string topology = "ring";
  int steps = 60;
  int shift_step = 20;
  int revert_step = -1;  // back to the data before the shift from here on (when > shift_step)
  // Data before and after the shift (bench/synthetic_gradients.h).
  double correlation_before = 0.5, correlation_after = 0.5;
  double magnitude_sigma_before = 1.22, magnitude_sigma_after = 0.5;
  uint64_t seed = 1;
  // Steps still run at the old budget after the step a decision was made on.
  int apply_delay = 2;
  double initial_bits = 5.0;
  server::ErrorBudgetPolicy policy;
  server::ControllerTuning tuning;
};

struct SimStep {
  int step = 0;
  double bits = 0;  // b̄ this step ran at
  uint64_t epoch = 0;
  double vnmse = 0;      // measured against the exact sum
  double wire_bits = 0;  // bits per coordinate per message actually sent
  bool shifted = false;  // the step drew the shifted distribution
  std::string decision;  // the decision made on this step's sample (its reason), or empty
};

struct SimResult {
  std::vector<SimStep> steps;                       // the closed loop
  server::CompressionController::Stats controller;  // at the end of the run
  // Fixed budgets measured on the same data and rounding in the same pass: fixed_vnmse[i][t] is
  // budget fixed_bits[i] at step t, NaN after its first step above the target (from then on it
  // can no longer be a budget that met the target throughout, and is not run any more).
  std::vector<double> fixed_bits;
  std::vector<std::vector<double>> fixed_vnmse;
};

// The closed loop, plus the fixed budgets `fixed_bits` (each 3..8). INVALID_ARGUMENT for bad
// options (policy and tuning included).
absl::StatusOr<SimResult> RunControllerSim(const ControllerSimOptions& options,
                                           const std::vector<double>& fixed_bits = {});

// The smallest of result.fixed_bits whose error stayed at or under `target` at every step.
std::optional<double> SmallestFixedBudgetMeeting(const SimResult& result, double target);

// True when step `step` draws the shifted distribution.
bool Shifted(const ControllerSimOptions& options, int step);

// One JSON object per line (step, target, bits, vnmse, epoch, wire_bits, shifted, decision), or CSV
// with a header line.
std::string FormatSimJson(const std::vector<SimStep>& steps, const ControllerSimOptions& options);
std::string FormatSimCsv(const std::vector<SimStep>& steps, const ControllerSimOptions& options);

}  // namespace dynamiq::bench

#endif  // DQ_BENCH_CONTROLLER_SIM_H_

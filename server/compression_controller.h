// CompressionController: error-budget compression. The operator sets a target vNMSE; the
// controller picks the lowest DynamiQ average bit budget b̄ that keeps the measured error at or
// under it, from the stream of exact vNMSE samples the daemon measures (server/error_probe.h).
//
// Model. DynamiQ's error falls geometrically with b̄: vNMSE(b') = vNMSE(b) x f^-(b' - b), with f =
// per_bit_factor. Measured with `dynamiq-bench codec --codec=dynamiq --bits=3,3.5,...,8` on the
// synthetic data (8 ranks, ring): 2.4-2.8x per half bit (f = 6-8) from 4 to 6.5 bits, steeper below
// 4 bits (10-20x per bit), and flat near 8 bits, where the 8-bit codes' own multi-hop error is a
// floor no budget gets under (1.6e-4 with 8 ranks, 1e-4 with 4). The default f = 6 is at the low
// end of the mid range: a raise then goes a little further than needed (safe) and a lowering
// predicts a larger increase than it will see (safe); only near the floor does a raise fall short,
// which the next samples correct. Only the slope is assumed: the level comes from every sample.
//
// Policy (docs/error_budget.md), counted in samples of the budget currently in force:
//   raise  as soon as one sample exceeds spike_factor x target, or raise_votes of the last
//          raise_window samples exceed the target. The new b̄ is the smallest step of the grid
//          (multiples of quantum_bits) at which the model predicts aim x target for the largest
//          sample in the window; max_bits when none does (the target may be unreachable).
//   lower  only after lower_after consecutive samples below lower_below x target, not within the
//          cooldown after a raise, and only to a b̄ at which the model predicts at most
//          aim x target for a high estimate of this budget's error: exp(mean + tail_sigmas x sd)
//          of ln(vNMSE) (mean over the last 2 x lower_after samples, sd from successive
//          differences over the last 32, so a step in the level does not inflate it), and at
//          least the largest sample of the run; at most max_lower_step bits at a time.
//   cooldown after a raise, lowering waits raise_cooldown samples. A raise that undoes the
//          lowering just before it doubles that wait (up to max_cooldown) and remembers the
//          budget that failed; the wait halves back for every raise_cooldown samples that a
//          budget at or below the failed one holds (the job's statistics changed).
//   clamp  a budget outside [min_bits, max_bits] (initial, or after a policy change) is clamped at
//          the first sample.
// Guarantee: when every sample of the budget in force exceeds the target, a raise is decided by
// the raise_votes-th (2nd) such sample, by the 1st when it exceeds spike_factor x target; it
// applies after the owner's switch delay (dynamiqd: 2 collectives), so with a model slope no
// steeper than the job's the error is back under target within raise_votes + delay samples (one
// more round of the same length when the slope is flatter, e.g. near the 8-bit floor). Lowering
// never happens while samples are near the target, and one decision at most per budget: samples
// measured under an older configuration epoch than the last decision are ignored. With the
// defaults and log-normal sample noise up to sd 0.7, a stationary job sees a few changes per
// thousand samples (tests/server/compression_controller_test.cc).
//
// Epochs. Every sample carries the config epoch and b̄ it was measured under. A decision is
// published by the owner (Daemon::SetCompression with expected_epoch = based_on_epoch) and then
// reported back: Published(epoch) with the epoch it got, or Rejected() when publishing failed.
// From the decision on, samples of epochs up to based_on_epoch are stale (the switch applies a
// few collectives later); a sample of a newer epoch starts a fresh window at its b̄, whoever made
// that change.
//
// Thread-safe (one internal leaf lock; never calls out).
#ifndef DQ_SERVER_COMPRESSION_CONTROLLER_H_
#define DQ_SERVER_COMPRESSION_CONTROLLER_H_

#include <stdint.h>

#include <deque>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace dynamiq::server {

// The DynamiQ b̄ range (kernels/codec_registry.cc ValidateCodecConfig).
inline constexpr double kMinDynamiqBits = 3.0;
inline constexpr double kMaxDynamiqBits = 8.0;

// What the operator asks for.
struct ErrorBudgetPolicy {
  double target_vnmse = 0;  // 0 < target < 1
  double min_bits = kMinDynamiqBits;
  double max_bits = kMaxDynamiqBits;
  // The fraction of the job's compressed collectives whose error is measured (the controller's
  // samples); 0: the daemon's --error_sample_rate. Not used by the controller itself.
  double sample_rate = 0;

  bool operator==(const ErrorBudgetPolicy&) const = default;
};

// INVALID_ARGUMENT with a message unless 0 < target_vnmse < 1, 3 <= min_bits <= max_bits <= 8 and
// 0 <= sample_rate <= 1.
absl::Status ValidateErrorBudgetPolicy(const ErrorBudgetPolicy& policy);

// The controller's parameters; the defaults are the documented ones (docs/error_budget.md).
struct ControllerTuning {
  double per_bit_factor = 6.0;  // f: vNMSE(b) / vNMSE(b + 1), > 1
  double quantum_bits = 0.25;   // decisions are multiples of this (or min_bits / max_bits)
  double aim = 0.7;             // steps aim at aim x target (safety margin 1/aim)
  double spike_factor = 2.0;    // one sample above spike_factor x target raises at once
  int raise_window = 3;         // recent samples of the budget in force considered for raising
  int raise_votes = 2;          // ... of which this many above target raise
  double lower_below = 0.5;     // "well below": under lower_below x target
  int lower_after = 6;          // K: consecutive samples well below target before lowering
  double tail_sigmas = 3.0;     // a lowering predicts from exp(mean + tail_sigmas x sd) of ln(samples)
  int raise_cooldown = 12;      // M: samples after a raise before lowering is considered
  int max_cooldown = 96;        // the cooldown's ceiling after repeated undone lowerings
  double max_lower_step = 1.0;  // bits per lowering decision
};

// INVALID_ARGUMENT with a message for out-of-range tuning.
absl::Status ValidateControllerTuning(const ControllerTuning& tuning);

// One measured compression error.
struct ErrorSample {
  double vnmse = 0;    // exact ||x^ - x||^2 / ||x||^2 of one sampled collective
  double bits = 0;     // the DynamiQ b̄ it was compressed with
  uint64_t epoch = 0;  // the job's config epoch it ran under
};

struct BitsDecision {
  enum class Kind { kRaise, kLower, kClamp };
  Kind kind = Kind::kRaise;
  double from_bits = 0;
  double bits = 0;              // the new b̄ to publish
  uint64_t based_on_epoch = 0;  // publish with expected_epoch = this (refused if it changed since)
  double predicted_vnmse = 0;   // the model's prediction at `bits` (0 for a clamp)
  std::string reason;           // one line for the flight recorder / events
};
absl::string_view BitsDecisionKindName(BitsDecision::Kind kind);  // "raise", "lower", "clamp"

class CompressionController {
 public:
  // INVALID_ARGUMENT for a bad policy or tuning.
  static absl::StatusOr<std::unique_ptr<CompressionController>> Create(const ErrorBudgetPolicy& policy,
                                                                       const ControllerTuning& tuning = {});

  // The b̄ to start a job at when its policy is set: the current DynamiQ b̄ clamped to the policy's
  // range, or `fallback` (clamped) when the job does not use DynamiQ now.
  static double InitialBits(const ErrorBudgetPolicy& policy, std::optional<double> current_dynamiq_bits,
                            double fallback = 5.0);

  // Feeds one sample; returns a decision to publish, or nullopt. Samples that are not finite, have
  // a negative vNMSE or a b̄ outside [3, 8] (e.g. a tensor sent uncompressed) are ignored.
  std::optional<BitsDecision> Observe(const ErrorSample& sample);
  // The last decision was published and got `epoch` (> based_on_epoch).
  void Published(uint64_t epoch);
  // The last decision could not be published (e.g. the epoch moved on): forget it and keep
  // measuring the budget in force. A raise is re-decided at the next sample that warrants it.
  void Rejected();

  struct Stats {
    double bits = 0;         // b̄ of the samples in use (0 before the first)
    uint64_t epoch = 0;      // their config epoch
    double last_vnmse = 0;   // the latest sample used
    double noise_sigma = 0;  // sd of ln(vNMSE) of the budget's last 32 samples (successive differences)
    bool decision_pending = false;
    bool saturated = false;  // at max_bits and the last sample still above target
    uint64_t samples_used = 0;
    uint64_t samples_stale = 0;  // from an epoch older than the last decision
    uint64_t samples_invalid = 0;
    uint64_t raises = 0, lowers = 0, clamps = 0, rejected = 0;
    int cooldown_left = 0;  // samples before lowering may be considered again
    int cooldown = 0;       // the current wait after a raise (raise_cooldown, doubled by undone lowerings)
  };
  Stats stats() const;
  const ErrorBudgetPolicy& policy() const { return policy_; }
  const ControllerTuning& tuning() const { return tuning_; }

  // The model: predicted vNMSE at `to_bits` given `vnmse` measured at `from_bits`.
  double Predict(double vnmse, double from_bits, double to_bits) const;

 private:
  CompressionController(const ErrorBudgetPolicy& policy, const ControllerTuning& tuning);
  // The smallest grid b̄ in [lo, hi] whose predicted error (from `vnmse` at `from`) is at most
  // `limit`; nullopt when none.
  std::optional<double> LowestMeeting(double vnmse, double from, double lo, double hi, double limit) const;
  BitsDecision Decide(BitsDecision::Kind kind, double to, double predicted, std::string reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartEpoch(uint64_t epoch, double bits) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Standard deviation of ln(vNMSE) over log_history_, robust to a step in the level (0 with fewer
  // than 2 samples).
  double NoiseSigma() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ErrorBudgetPolicy policy_;
  const ControllerTuning tuning_;
  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;  // of the samples in use
  double bits_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<double> window_ ABSL_GUARDED_BY(mu_);       // the last raise_window samples of this epoch
  std::deque<double> log_history_ ABSL_GUARDED_BY(mu_);  // ln of this epoch's last 32 samples
  // The current run of consecutive samples well below target: its length, and its last
  // lower_after samples (their largest is what a lowering is predicted from).
  int below_run_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<double> below_ ABSL_GUARDED_BY(mu_);
  int cooldown_left_ ABSL_GUARDED_BY(mu_) = 0;
  int cooldown_ ABSL_GUARDED_BY(mu_) = 0;                   // the current raise cooldown (backs off)
  std::optional<double> failed_bits_ ABSL_GUARDED_BY(mu_);  // the budget of the last undone lowering
  int epoch_samples_ ABSL_GUARDED_BY(mu_) = 0;              // samples used of this epoch
  // Samples of epochs <= stale_through_ are ignored once a decision was made on them.
  std::optional<uint64_t> stale_through_ ABSL_GUARDED_BY(mu_);
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<uint64_t> stale_before_decision_ ABSL_GUARDED_BY(mu_);  // restored by Rejected
  BitsDecision::Kind pending_kind_ ABSL_GUARDED_BY(mu_) = BitsDecision::Kind::kRaise;
  bool pending_undoes_lowering_ ABSL_GUARDED_BY(mu_) = false;
  double pending_from_bits_ ABSL_GUARDED_BY(mu_) = 0;
  // The epoch the last published lowering produced: a raise decided on it undoes that lowering.
  std::optional<uint64_t> lowered_epoch_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_COMPRESSION_CONTROLLER_H_

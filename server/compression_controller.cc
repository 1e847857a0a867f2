#include "server/compression_controller.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dynamiq::server {
namespace {

// Budgets are compared with this slack: they are sums of quarter bits, but travel as doubles.
constexpr double kEps = 1e-9;

// Samples of exactly 0 (e.g. all-zero tensors decode exactly) count as this in log space.
constexpr double kTinyVnmse = 1e-15;
// Samples of the budget in force kept for the noise estimate.
constexpr size_t kNoiseHistory = 32;

bool Finite(double x) { return std::isfinite(x); }

}  // namespace

absl::Status ValidateErrorBudgetPolicy(const ErrorBudgetPolicy& p) {
  if (!(p.target_vnmse > 0 && p.target_vnmse < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_vnmse must be between 0 and 1 (exclusive), got ", p.target_vnmse));
  }
  if (!(p.min_bits >= kMinDynamiqBits && p.min_bits <= kMaxDynamiqBits)) {
    return absl::InvalidArgumentError(absl::StrCat("min_bits must be between 3 and 8, got ", p.min_bits));
  }
  if (!(p.max_bits >= kMinDynamiqBits && p.max_bits <= kMaxDynamiqBits)) {
    return absl::InvalidArgumentError(absl::StrCat("max_bits must be between 3 and 8, got ", p.max_bits));
  }
  if (p.min_bits > p.max_bits) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_bits (", p.min_bits, ") must not exceed max_bits (", p.max_bits, ")"));
  }
  if (!(p.sample_rate >= 0 && p.sample_rate <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("sample_rate must be between 0 and 1, got ", p.sample_rate));
  }
  return absl::OkStatus();
}

absl::Status ValidateControllerTuning(const ControllerTuning& t) {
  if (!(Finite(t.per_bit_factor) && t.per_bit_factor > 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("per_bit_factor must be a finite factor > 1, got ", t.per_bit_factor));
  }
  if (!(t.quantum_bits > 0 && t.quantum_bits <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("quantum_bits must be in (0, 1], got ", t.quantum_bits));
  }
  if (!(t.aim > 0 && t.aim <= 1)) return absl::InvalidArgumentError(absl::StrCat("aim must be in (0, 1], got ", t.aim));
  if (!(Finite(t.spike_factor) && t.spike_factor >= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("spike_factor must be >= 1, got ", t.spike_factor));
  }
  if (t.raise_window < 1 || t.raise_votes < 1 || t.raise_votes > t.raise_window) {
    return absl::InvalidArgumentError(
        absl::StrCat("need 1 <= raise_votes <= raise_window, got ", t.raise_votes, " of ", t.raise_window));
  }
  if (!(t.lower_below > 0 && t.lower_below <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("lower_below must be in (0, 1], got ", t.lower_below));
  }
  if (!(Finite(t.tail_sigmas) && t.tail_sigmas >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("tail_sigmas must be >= 0, got ", t.tail_sigmas));
  }
  if (t.lower_after < 1)
    return absl::InvalidArgumentError(absl::StrCat("lower_after must be >= 1, got ", t.lower_after));
  if (t.raise_cooldown < 0 || t.max_cooldown < t.raise_cooldown) {
    return absl::InvalidArgumentError(
        absl::StrCat("need 0 <= raise_cooldown <= max_cooldown, got ", t.raise_cooldown, " and ", t.max_cooldown));
  }
  if (!(Finite(t.max_lower_step) && t.max_lower_step >= t.quantum_bits)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_lower_step must be >= quantum_bits (", t.quantum_bits, "), got ", t.max_lower_step));
  }
  return absl::OkStatus();
}

absl::string_view BitsDecisionKindName(BitsDecision::Kind kind) {
  switch (kind) {
    case BitsDecision::Kind::kRaise:
      return "raise";
    case BitsDecision::Kind::kLower:
      return "lower";
    case BitsDecision::Kind::kClamp:
      return "clamp";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<CompressionController>> CompressionController::Create(const ErrorBudgetPolicy& policy,
                                                                                     const ControllerTuning& tuning) {
  if (absl::Status s = ValidateErrorBudgetPolicy(policy); !s.ok()) return s;
  if (absl::Status s = ValidateControllerTuning(tuning); !s.ok()) return s;
  return std::unique_ptr<CompressionController>(new CompressionController(policy, tuning));
}

CompressionController::CompressionController(const ErrorBudgetPolicy& policy, const ControllerTuning& tuning)
    : policy_(policy), tuning_(tuning), cooldown_(tuning.raise_cooldown) {}

double CompressionController::InitialBits(const ErrorBudgetPolicy& policy, std::optional<double> current_dynamiq_bits,
                                          double fallback) {
  const double b = current_dynamiq_bits.has_value() && Finite(*current_dynamiq_bits) ? *current_dynamiq_bits : fallback;
  return std::clamp(b, policy.min_bits, policy.max_bits);
}

double CompressionController::Predict(double vnmse, double from_bits, double to_bits) const {
  return vnmse * std::pow(tuning_.per_bit_factor, from_bits - to_bits);
}

std::optional<double> CompressionController::LowestMeeting(double vnmse, double from, double lo, double hi,
                                                           double limit) const {
  // Candidates: lo, the grid points above it, hi.
  const double q = tuning_.quantum_bits;
  double b = lo;
  while (b <= hi + kEps) {
    if (Predict(vnmse, from, b) <= limit) return b;
    const double next = (std::floor(b / q + kEps) + 1) * q;
    if (b < hi - kEps && next > hi) {
      b = hi;
    } else {
      b = next;
    }
  }
  return std::nullopt;
}

double CompressionController::NoiseSigma() const {
  // From successive differences: a step in the level (the data changed within the epoch) moves one
  // difference, not the estimate. For normal noise, median |x_i - x_i-1| = 0.954 sigma.
  if (log_history_.size() < 2) return 0;
  std::vector<double> diffs;
  for (size_t i = 1; i < log_history_.size(); ++i) diffs.push_back(std::abs(log_history_[i] - log_history_[i - 1]));
  std::nth_element(diffs.begin(), diffs.begin() + diffs.size() / 2, diffs.end());
  return diffs[diffs.size() / 2] / 0.954;
}

void CompressionController::StartEpoch(uint64_t epoch, double bits) {
  epoch_ = epoch;
  bits_ = bits;
  window_.clear();
  log_history_.clear();
  epoch_samples_ = 0;
  below_run_ = 0;
  below_.clear();
}

BitsDecision CompressionController::Decide(BitsDecision::Kind kind, double to, double predicted, std::string reason) {
  BitsDecision d;
  d.kind = kind;
  d.from_bits = bits_;
  d.bits = to;
  d.based_on_epoch = epoch_;
  d.predicted_vnmse = predicted;
  d.reason = std::move(reason);
  pending_ = true;
  pending_kind_ = kind;
  pending_undoes_lowering_ = kind == BitsDecision::Kind::kRaise && lowered_epoch_ == epoch_;
  pending_from_bits_ = bits_;
  stale_before_decision_ = stale_through_;
  stale_through_ = epoch_;  // what was measured under this epoch no longer tells about the new budget
  return d;
}

std::optional<BitsDecision> CompressionController::Observe(const ErrorSample& s) {
  absl::MutexLock lock(&mu_);
  if (!Finite(s.vnmse) || s.vnmse < 0 || !Finite(s.bits) || s.bits < kMinDynamiqBits - kEps ||
      s.bits > kMaxDynamiqBits + kEps) {
    ++stats_.samples_invalid;
    return std::nullopt;
  }
  if ((stale_through_.has_value() && s.epoch <= *stale_through_) || (started_ && s.epoch < epoch_)) {
    ++stats_.samples_stale;
    return std::nullopt;
  }
  if (!started_ || s.epoch > epoch_) {
    started_ = true;
    StartEpoch(s.epoch, s.bits);
  } else if (std::abs(s.bits - bits_) > kEps) {
    ++stats_.samples_invalid;  // one epoch has one budget: not a sample of this job's DynamiQ collectives
    return std::nullopt;
  }
  const double target = policy_.target_vnmse;
  const double v = s.vnmse;
  ++stats_.samples_used;
  stats_.last_vnmse = v;
  window_.push_back(v);
  while (static_cast<int>(window_.size()) > tuning_.raise_window) window_.pop_front();
  log_history_.push_back(std::log(std::max(v, kTinyVnmse)));
  while (log_history_.size() > kNoiseHistory) log_history_.pop_front();
  stats_.noise_sigma = NoiseSigma();
  if (cooldown_left_ > 0) --cooldown_left_;
  ++epoch_samples_;
  if (failed_bits_.has_value() && bits_ <= *failed_bits_ + kEps &&
      epoch_samples_ % std::max(1, tuning_.raise_cooldown) == 0) {
    // A budget that once had to be undone holds now (the job's statistics changed): back off less.
    cooldown_ = std::max(tuning_.raise_cooldown, cooldown_ / 2);
    if (cooldown_ == tuning_.raise_cooldown) failed_bits_.reset();
  }
  if (v < tuning_.lower_below * target) {
    ++below_run_;
    below_.push_back(v);
    while (static_cast<int>(below_.size()) > tuning_.lower_after) below_.pop_front();
  } else {
    below_run_ = 0;
    below_.clear();
  }
  stats_.saturated = bits_ >= policy_.max_bits - kEps && v > target;
  if (pending_) return std::nullopt;  // one decision at a time

  if (bits_ < policy_.min_bits - kEps || bits_ > policy_.max_bits + kEps) {
    const double to = std::clamp(bits_, policy_.min_bits, policy_.max_bits);
    return Decide(BitsDecision::Kind::kClamp, to, 0,
                  absl::StrFormat("clamp %.2f -> %.2f: outside the policy's [%.2f, %.2f] bits", bits_, to,
                                  policy_.min_bits, policy_.max_bits));
  }

  const double goal = tuning_.aim * target;
  if (bits_ < policy_.max_bits - kEps) {
    const int votes =
        static_cast<int>(std::count_if(window_.begin(), window_.end(), [&](double x) { return x > target; }));
    const bool spike = v > tuning_.spike_factor * target;
    if (spike || votes >= tuning_.raise_votes) {
      // The largest sample of the window: raising too far costs bits until the slow lowering
      // reclaims them; raising too little costs another round above target.
      const double estimate = *std::max_element(window_.begin(), window_.end());
      const double above = (std::floor(bits_ / tuning_.quantum_bits + kEps) + 1) * tuning_.quantum_bits;
      const std::optional<double> meets =
          LowestMeeting(estimate, bits_, std::min(above, policy_.max_bits), policy_.max_bits, goal);
      const double to = meets.value_or(policy_.max_bits);
      const double predicted = Predict(estimate, bits_, to);
      const std::string why = spike
                                  ? absl::StrFormat("vNMSE %.3g > %.3g x target %.3g", v, tuning_.spike_factor, target)
                                  : absl::StrFormat("%d of the last %d samples > target %.3g (max %.3g)", votes,
                                                    static_cast<int>(window_.size()), target, estimate);
      return Decide(BitsDecision::Kind::kRaise, to, predicted,
                    absl::StrFormat("raise %.2f -> %.2f bits: %s; model predicts %.3g%s", bits_, to, why, predicted,
                                    meets.has_value() ? "" : " (target may be unreachable within max_bits)"));
    }
  }
  if (bits_ > policy_.min_bits + kEps && cooldown_left_ == 0 && below_run_ >= tuning_.lower_after) {
    const double lo = std::max(policy_.min_bits, bits_ - tuning_.max_lower_step);
    // A high quantile of this budget's error: its level over the last 2K samples (all of them: the
    // run below target alone is a selection biased low) plus tail_sigmas standard deviations of
    // the sample noise. With noisy samples, a budget whose typical error is just under the aim
    // would be raised again by chance.
    const size_t level_n = std::min(log_history_.size(), static_cast<size_t>(2 * tuning_.lower_after));
    double log_mean = 0;
    for (size_t i = log_history_.size() - level_n; i < log_history_.size(); ++i) log_mean += log_history_[i] / level_n;
    const double recent_max = std::max(*std::max_element(below_.begin(), below_.end()),
                                       std::exp(log_mean + tuning_.tail_sigmas * stats_.noise_sigma));
    const std::optional<double> meets = LowestMeeting(recent_max, bits_, lo, bits_, goal);
    if (meets.has_value() && *meets < bits_ - kEps) {
      const double predicted = Predict(recent_max, bits_, *meets);
      return Decide(
          BitsDecision::Kind::kLower, *meets, predicted,
          absl::StrFormat("lower %.2f -> %.2f bits: %d samples in a row < %.3g (high estimate %.3g); model "
                          "predicts %.3g <= %.3g",
                          bits_, *meets, below_run_, tuning_.lower_below * target, recent_max, predicted, goal));
    }
  }
  return std::nullopt;
}

void CompressionController::Published(uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  if (!pending_) return;
  pending_ = false;
  stale_through_ = std::max(stale_through_.value_or(0), epoch > 0 ? epoch - 1 : 0);
  switch (pending_kind_) {
    case BitsDecision::Kind::kRaise:
      ++stats_.raises;
      // A raise that undoes the previous lowering: that lowering was one step too far; wait longer
      // before the next one.
      if (pending_undoes_lowering_) {
        cooldown_ = std::min(2 * std::max(cooldown_, 1), tuning_.max_cooldown);
        failed_bits_ = pending_from_bits_;
      }
      cooldown_left_ = cooldown_;
      lowered_epoch_.reset();
      break;
    case BitsDecision::Kind::kLower:
      ++stats_.lowers;
      lowered_epoch_ = epoch;
      break;
    case BitsDecision::Kind::kClamp:
      ++stats_.clamps;
      lowered_epoch_.reset();
      break;
  }
}

void CompressionController::Rejected() {
  absl::MutexLock lock(&mu_);
  if (!pending_) return;
  pending_ = false;
  ++stats_.rejected;
  stale_through_ = stale_before_decision_;
  below_run_ = 0;  // lowering waits for lower_after fresh samples; a raise is re-decided at once
  below_.clear();
}

CompressionController::Stats CompressionController::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s = stats_;
  s.bits = started_ ? bits_ : 0;
  s.epoch = epoch_;
  s.decision_pending = pending_;
  s.cooldown_left = cooldown_left_;
  s.cooldown = cooldown_;
  return s;
}

}  // namespace dynamiq::server

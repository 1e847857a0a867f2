// What the link emulator (dynamiq-linkem, tools/linkem/) is told to do to a link: random loss, one
// way delay and jitter, and the named profiles of the network benchmarks. Parsing refuses what
// cannot be (a negative delay, a probability outside [0, 1], an unknown profile) with a message
// that names the setting.
#ifndef DQ_TOOLS_LINKEM_LINK_SETTINGS_H_
#define DQ_TOOLS_LINKEM_LINK_SETTINGS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tools/linkem/loss_model.h"

namespace dynamiq::linkem {

// Loss as a Gilbert-Elliott chain (loss_model.h); Bernoulli(p) is the chain that stays good.
struct LossModel {
  double loss_good = 0;
  double loss_bad = 1;
  double p_gb = 0;
  double p_bg = 1;

  static LossModel Bernoulli(double p) { return {p, 1, 0, 1}; }
  // The long-run fraction of packets lost.
  double MeanLoss() const;
  bool none() const { return MeanLoss() == 0; }
  // The fixed-point form the filter runs on.
  dq_loss_config ToConfig() const;
  std::string ToString() const;
};

// "P" (Bernoulli, e.g. 0.001) or "ge:P_GB,P_BG[,LOSS_BAD[,LOSS_GOOD]]" (bursts; LOSS_BAD defaults
// to 1, LOSS_GOOD to 0). INVALID_ARGUMENT naming `what` otherwise.
absl::StatusOr<LossModel> ParseLoss(absl::string_view text, absl::string_view what = "--loss");

// A delay or jitter: "150ms", "2.5ms", "0", "1s" (absl duration syntax; a bare 0 is zero). At
// least zero and at most 10 s.
absl::StatusOr<absl::Duration> ParseDelay(absl::string_view text, absl::string_view what);

// A named network the benchmarks emulate (docs/results.md has what each stands for).
struct Profile {
  std::string name;
  std::string rate;       // tc rate, e.g. "1gbit"
  absl::Duration rtt;     // round trip between two ranks
  absl::Duration jitter;  // standard deviation of each direction's delay
  std::string loss;       // ParseLoss's syntax
  std::string what;       // one line for --help
};
const std::vector<Profile>& Profiles();
absl::StatusOr<Profile> FindProfile(absl::string_view name);

}  // namespace dynamiq::linkem

#endif  // DQ_TOOLS_LINKEM_LINK_SETTINGS_H_

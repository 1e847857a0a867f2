#include "tools/linkem/link_settings.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace dynamiq::linkem {
namespace {

absl::StatusOr<double> Probability(absl::string_view text, absl::string_view what) {
  double p = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(text), &p) || !std::isfinite(p) || p < 0 || p > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": '", text, "' is not a probability (a number from 0 to 1, e.g. 0.001 for 0.1%)"));
  }
  return p;
}

dq_u32 Fixed(double p) { return p >= 1 ? 0xffffffffu : static_cast<dq_u32>(std::llround(p * 4294967296.0)); }

}  // namespace

double LossModel::MeanLoss() const {
  if (p_gb == 0) return loss_good;  // never leaves the good state
  if (p_bg == 0) return loss_bad;
  return (p_gb * loss_bad + p_bg * loss_good) / (p_gb + p_bg);
}

dq_loss_config LossModel::ToConfig() const { return {Fixed(loss_good), Fixed(loss_bad), Fixed(p_gb), Fixed(p_bg)}; }

std::string LossModel::ToString() const {
  if (p_gb == 0) return absl::StrCat(loss_good);
  return absl::StrCat("ge:", p_gb, ",", p_bg, ",", loss_bad, ",", loss_good);
}

absl::StatusOr<LossModel> ParseLoss(absl::string_view text, absl::string_view what) {
  if (!absl::ConsumePrefix(&text, "ge:")) {
    absl::StatusOr<double> p = Probability(text, what);
    if (!p.ok()) return p.status();
    return LossModel::Bernoulli(*p);
  }
  std::vector<absl::string_view> parts = absl::StrSplit(text, ',');
  if (parts.size() < 2 || parts.size() > 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": Gilbert-Elliott loss is ge:P_GB,P_BG[,LOSS_BAD[,LOSS_GOOD]], got 'ge:", text, "'"));
  }
  LossModel m;
  const char* names[] = {"P_GB", "P_BG", "LOSS_BAD", "LOSS_GOOD"};
  double* fields[] = {&m.p_gb, &m.p_bg, &m.loss_bad, &m.loss_good};
  for (size_t i = 0; i < parts.size(); ++i) {
    absl::StatusOr<double> p = Probability(parts[i], absl::StrCat(what, " ", names[i]));
    if (!p.ok()) return p.status();
    *fields[i] = *p;
  }
  if (m.p_gb > 0 && m.p_bg == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": P_BG is 0, so the chain never leaves the bad state"));
  }
  return m;
}

absl::StatusOr<absl::Duration> ParseDelay(absl::string_view text, absl::string_view what) {
  absl::Duration d;
  const std::string s(absl::StripAsciiWhitespace(text));
  if (s == "0") return absl::ZeroDuration();
  if (!absl::ParseDuration(s, &d)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": '", text, "' is not a duration (e.g. 30ms, 1.5ms, 0)"));
  }
  if (d < absl::ZeroDuration()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", s, " is negative"));
  if (d > absl::Seconds(10)) return absl::InvalidArgumentError(absl::StrCat(what, ": ", s, " is more than 10s"));
  return d;
}

const std::vector<Profile>& Profiles() {
  static const auto* profiles = new std::vector<Profile>{
      {"lan", "1gbit", absl::ZeroDuration(), absl::ZeroDuration(), "0", "1 Gbit/s, no added delay or loss"},
      {"cross-region", "1gbit", absl::Milliseconds(30), absl::ZeroDuration(), "0.0001",
       "1 Gbit/s, 30 ms RTT, 0.01% loss (two regions of one continent)"},
      {"cross-continent", "1gbit", absl::Milliseconds(150), absl::Milliseconds(2), "0.001",
       "1 Gbit/s, 150 ms RTT, 2 ms jitter, 0.1% loss (across an ocean)"},
      {"consumer", "100mbit", absl::Milliseconds(40), absl::ZeroDuration(), "0.005",
       "100 Mbit/s, 40 ms RTT, 0.5% loss (home broadband)"},
  };
  return *profiles;
}

absl::StatusOr<Profile> FindProfile(absl::string_view name) {
  std::vector<std::string> names;
  for (const Profile& p : Profiles()) {
    if (p.name == name) return p;
    names.push_back(p.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--profile: no profile '", name, "' (one of ", absl::StrJoin(names, ", "), ")"));
}

}  // namespace dynamiq::linkem

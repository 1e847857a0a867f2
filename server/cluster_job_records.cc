// Cluster's records of a running job in the coordinator's store: configuration epochs
// (PublishConfig, PollConfig), failure reports (ReportFailure, LookupFailure) and the keys of its
// group views and their rendezvous. The rest of Cluster is in server/cluster.cc.
#include <algorithm>
#include <deque>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "dynamiq/v1/rendezvous.pb.h"
#include "server/cluster.h"
#include "server/cluster_keys.h"

namespace dynamiq::server {
namespace {

using internal::JobKey;
using internal::ReadCounter;

// A published cause is cut to this (a watchdog's list of a thousand missing local ranks is long).
constexpr size_t kMaxCauseBytes = 4096;
// Of a lookup's time, what the coordinator's answer needs to come back after its wait for the key.
constexpr absl::Duration kLookupRoundTrip = absl::Milliseconds(100);

// Failure reports of an incarnation this node keeps in the store (its newest ones); a node looks a
// cause up within about a second of the failure, so only a burst this long could lose one.
constexpr size_t kKeptFailureReports = 64;
// Config epochs kept per incarnation: a node polls before every collective, so it never needs an
// epoch this far behind the newest (PollConfig stops at the first one deleted).
constexpr uint64_t kKeptConfigEpochs = 16;

std::string FailureKey(const std::string& job_id, uint64_t incarnation, uint64_t sequence) {
  return absl::StrCat(JobKey(job_id, incarnation), "/failed/", sequence);
}

std::string ConfigKey(absl::string_view job_key, uint64_t epoch) { return absl::StrCat(job_key, "/config/", epoch); }

// Doubles are exact in the proto, so every node decodes the b̄ and policy that were published.
std::string EncodeConfig(const JobConfig& c, uint64_t apply_at) {
  dynamiq::v1::PublishedConfig published;
  ToProto(c, published.mutable_config());
  published.set_apply_at(apply_at);
  return published.SerializeAsString();
}

absl::StatusOr<std::pair<JobConfig, uint64_t>> DecodeConfig(const std::string& s) {
  dynamiq::v1::PublishedConfig published;
  if (!published.ParseFromString(s)) return absl::DataLossError("malformed published configuration");
  absl::StatusOr<JobConfig> c = FromProto(published.config());
  if (!c.ok()) return absl::DataLossError(absl::StrCat("invalid published configuration: ", c.status().message()));
  return std::make_pair(*std::move(c), published.apply_at());
}

}  // namespace

std::string Cluster::RendezvousPrefix(const std::string& job_id, uint64_t incarnation, uint64_t view_epoch,
                                      uint64_t first_sequence) {
  return absl::StrCat(JobKey(job_id, incarnation), "/view", view_epoch, "-from", first_sequence);
}

std::string Cluster::LatestViewKey(const std::string& job_id, uint64_t incarnation) {
  return absl::StrCat(JobKey(job_id, incarnation), "/latest_view");
}

std::string Cluster::ViewKey(const std::string& job_id, uint64_t incarnation, uint64_t epoch) {
  return absl::StrCat(JobKey(job_id, incarnation), "/view/", epoch);
}

absl::StatusOr<PublishedChange> Cluster::PublishConfig(
    const std::string& job_id, uint64_t incarnation, const JobConfig& initial,
    absl::FunctionRef<absl::StatusOr<JobConfig>(const JobConfig& newest)> change,
    absl::FunctionRef<uint64_t()> apply_at, std::optional<uint64_t> expected_epoch) {
  // The live incarnation's keys: a change staged for an earlier one never applies to this one.
  const std::string prefix = JobKey(job_id, incarnation);
  const std::string latest_key = absl::StrCat(prefix, "/latest_epoch");
  // Claim the next epoch with a compare-and-set on the coordinator's store: changes made at the
  // same time through different nodes get distinct epochs, and a stale expected epoch is refused.
  for (int attempt = 0; attempt < 64; ++attempt) {
    // An unreachable coordinator fails the change here: nothing was changed.
    DQ_ASSIGN_OR_RETURN(auto counter, ReadCounter(*store_, latest_key));
    const auto& [current, seen] = counter;
    if (expected_epoch.has_value() && *expected_epoch != current) {
      return absl::AbortedError(
          absl::StrCat("job ", job_id, " is at config epoch ", current, ", not ", *expected_epoch));
    }
    // The change builds on the newest epoch, staged or applied (its key is written right after
    // its epoch is claimed), or on the configuration the job started with.
    JobConfig newest = initial;
    if (current > 0) {
      DQ_ASSIGN_OR_RETURN(std::string value, store_->Get(ConfigKey(prefix, current), absl::Seconds(5)));
      DQ_ASSIGN_OR_RETURN(auto decoded, DecodeConfig(value));
      newest = std::move(decoded.first);
    }
    DQ_ASSIGN_OR_RETURN(JobConfig config, change(newest));
    const uint64_t epoch = current + 1;
    std::optional<absl::string_view> expected;
    if (seen.has_value()) expected = *seen;
    DQ_ASSIGN_OR_RETURN(bool claimed, store_->CompareAndSet(latest_key, expected, absl::StrCat(epoch)));
    if (!claimed) continue;  // another node claimed it first: read the new epoch and try again
    // The boundary only now that the claim is visible: from here this node's collectives announce
    // it, and a node told of it must find the claim when it looks there (reserved before the
    // claim, a node that ran two collectives while the claim was on its way looked too early, kept
    // the old epoch and ran the boundary's collective against this node's new one).
    const uint64_t at = apply_at();
    // Nodes that see the claimed epoch wait (PollConfig) for this key, written right away.
    DQ_RETURN_IF_ERROR(store_->Set(ConfigKey(prefix, epoch), EncodeConfig(config, at)));
    if (epoch > kKeptConfigEpochs) {
      engine::Store::Deletion deletion;
      deletion.keys.push_back(ConfigKey(prefix, epoch - kKeptConfigEpochs));
      DeleteKeys(deletion, deletion.keys.back());
    }
    CleanUpIfRetired(job_id, incarnation);
    return PublishedChange{epoch, std::move(config)};
  }
  return absl::AbortedError(absl::StrCat("job ", job_id, ": configuration changed concurrently too often; retry"));
}

absl::StatusOr<bool> Cluster::PollConfig(const std::string& job_id, uint64_t incarnation, uint64_t sequence,
                                         uint64_t* epoch, JobConfig* config,
                                         std::optional<std::optional<std::string>>* latest_view) {
  const std::string prefix = JobKey(job_id, incarnation);
  std::vector<std::string> keys = {absl::StrCat(prefix, "/latest_epoch")};
  if (latest_view != nullptr) keys.push_back(LatestViewKey(job_id, incarnation));
  absl::StatusOr<std::vector<std::optional<std::string>>> latest = store_->GetMany(keys);
  if (!latest.ok()) return false;
  if (latest_view != nullptr) *latest_view = (*latest)[1];
  uint64_t newest = 0;
  if (!(*latest)[0].has_value() || !absl::SimpleAtoi(*(*latest)[0], &newest) || newest <= *epoch) return false;
  // Apply the newest epoch whose boundary has been reached. The newest may be claimed but not yet
  // written (a moment); the older ones are written, unless deleted as more than kKeptConfigEpochs
  // behind, where the search ends.
  for (uint64_t e = newest; e > *epoch; --e) {
    auto value = store_->Get(ConfigKey(prefix, e), e == newest ? absl::Seconds(5) : absl::ZeroDuration());
    if (e != newest && engine::IsKeyNotSet(value.status())) return false;
    if (!value.ok()) return value.status();
    DQ_ASSIGN_OR_RETURN(auto decoded, DecodeConfig(*value));
    if (decoded.second <= sequence) {
      *epoch = e;
      *config = decoded.first;
      return true;
    }
  }
  return false;
}

absl::Status Cluster::ReportFailure(const std::string& job_id, uint64_t incarnation, uint64_t sequence,
                                    const absl::Status& cause, absl::Time deadline) {
  absl::string_view message = cause.message();
  std::string value = absl::StrCat(static_cast<int>(cause.code()), "|", options_.node_rank, "|",
                                   message.substr(0, kMaxCauseBytes), message.size() > kMaxCauseBytes ? "..." : "");
  const std::string key = FailureKey(job_id, incarnation, sequence);
  absl::Status s = store_->SetBefore(key, value, deadline);
  if (!s.ok()) {
    common::Log("job %s: cannot tell the other nodes why collective %llu failed here: %s", job_id.c_str(),
                static_cast<unsigned long long>(sequence), std::string(s.message()).c_str());
    return s;
  }
  // Keep this node's newest reports of the incarnation; delete the older ones.
  engine::Store::Deletion deletion;
  {
    absl::MutexLock lock(&keys_mu_);
    auto it = incarnations_.find(JobKey(job_id, incarnation));
    if (it != incarnations_.end()) {
      std::deque<uint64_t>& reported = it->second.failures;
      if (std::find(reported.begin(), reported.end(), sequence) == reported.end()) reported.push_back(sequence);
      for (; reported.size() > kKeptFailureReports; reported.pop_front()) {
        deletion.keys.push_back(FailureKey(job_id, incarnation, reported.front()));
      }
    }
  }
  if (!deletion.keys.empty()) DeleteKeys(deletion, absl::StrCat("job ", job_id, "'s old failure reports"));
  CleanUpIfRetired(job_id, incarnation);
  return s;
}

std::optional<Cluster::Failure> Cluster::LookupFailure(const std::string& job_id, uint64_t incarnation,
                                                       uint64_t sequence, absl::Time deadline) {
  const std::string key = FailureKey(job_id, incarnation, sequence);
  const absl::Duration wait = std::max(absl::ZeroDuration(), deadline - absl::Now() - kLookupRoundTrip);
  absl::StatusOr<std::string> value = store_->GetBefore(key, wait, deadline);
  if (!value.ok()) return std::nullopt;  // no node reported a cause (or the coordinator is out of reach)
  std::vector<absl::string_view> f = absl::StrSplit(*value, absl::MaxSplits('|', 2));
  int code = 0;
  uint32_t node = 0;
  if (f.size() != 3 || !absl::SimpleAtoi(f[0], &code) || code <= 0 || code > 16 || !absl::SimpleAtoi(f[1], &node) ||
      node >= options_.num_nodes || node == options_.node_rank) {
    common::Log("job %s: ignoring malformed %s", job_id.c_str(), key.c_str());
    return std::nullopt;
  }
  return Failure{node, absl::Status(static_cast<absl::StatusCode>(code), f[2])};
}

std::optional<Cluster::Failure> Cluster::PublishedFailure(const std::string& job_id, uint64_t incarnation,
                                                          uint64_t sequence) {
  return LookupFailure(job_id, incarnation, sequence, absl::Now() + kLookupRoundTrip);
}

}  // namespace dynamiq::server

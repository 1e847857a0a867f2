// Job's cross-node step (server/job.h): the collective's id on the wire, the transport, codec,
// error feedback and side lane it runs with, and what a failure does to the group; and the job's
// group of nodes: view changes, claimed by an operator or when members go silent.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/allreduce.h"
#include "engine/step_header.h"
#include "server/job.h"

namespace dynamiq::server {
namespace {

// Stable 64-bit id of a job name for the engine's step headers (FNV-1a).
uint64_t JobHash(absl::string_view id) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : id) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

// What the step headers' job field carries: the job and its incarnation, the tensor's name, element
// count and dtype, so nodes whose workers submitted different tensors (or sizes, or dtypes: the
// cross-node sum is fp32 either way) fail the header check at once, and messages of an earlier
// incarnation of the job are refused.
uint64_t CollectiveId(absl::string_view job, uint64_t incarnation, absl::string_view tensor, uint64_t num_elements,
                      kernels::DType dtype, bool weighted) {
  const std::string nul(1, '\0');
  // Incarnation 1 is the plain job id.
  const std::string id = incarnation <= 1 ? std::string(job) : absl::StrCat(job, nul, "inc", incarnation);
  // A weighted collective is another collective: nodes that disagree fail the header check at
  // once instead of waiting for a side lane that never comes.
  return JobHash(absl::StrCat(id, nul, tensor, nul, num_elements, nul, kernels::DTypeName(dtype),
                              weighted ? absl::StrCat(nul, "weighted") : ""));
}

}  // namespace

void Job::AdoptBoundaryChanges(uint64_t sequence, JobConfig* config, uint64_t* epoch) {
  bool poll;
  {
    absl::MutexLock lock(&mu_);
    *config = config_;
    *epoch = config_epoch_;
    poll = poll_next_ || config_boundary_ >= sequence;
    if (poll && options_.coordinator != nullptr) ++totals_.config_polls;
  }
  if (poll && options_.coordinator != nullptr) {
    uint64_t new_epoch = *epoch;
    JobConfig new_config;
    absl::StatusOr<bool> changed = options_.coordinator->PollConfig(sequence, &new_epoch, &new_config);
    if (changed.ok() && *changed && new_epoch > *epoch) {
      absl::MutexLock lock(&mu_);
      config_epoch_ = *epoch = new_epoch;
      config_ = *config = new_config;
    }
    // A new group view applies at the same boundaries as configuration changes.
    if (absl::Status refreshed = group_.Refresh(sequence); !refreshed.ok()) {
      common::Log("job %s: cannot look up its group view at collective %d (keeping %s): %s", options_.id, sequence,
                  group_.view().ToString(), refreshed.message());
    }
  }
}

absl::StatusOr<DataPath::CrossNodeResult> Job::CrossNode(uint64_t sequence, const JobConfig& config, uint64_t epoch,
                                                         absl::string_view tensor_name, kernels::DType dtype, size_t n,
                                                         double bits, bool weighted, absl::Span<double> side_sums) {
  DQ_ASSIGN_OR_RETURN(engine::Transport * transport, group_.Connected(sequence));
  DQ_ASSIGN_OR_RETURN(kernels::Codec * codec, codecs_.Get(EffectiveCodec(config, n)));
  engine::AllReduceOptions o;
  o.topology = config.topology;
  o.job_id = CollectiveId(options_.id, options_.incarnation, tensor_name, n, dtype, weighted);
  o.side_sums = side_sums;
  o.config_epoch = epoch;
  o.sequence = sequence;
  o.bits = bits;
  o.timeout = std::max(absl::Milliseconds(1), deadline_ - absl::Now());
  o.authenticator = options_.authenticator.get();
  // A job under an error budget may sample more often than the daemon's default rate.
  const double rate = config.error_budget.has_value() && config.error_budget->sample_rate > 0
                          ? config.error_budget->sample_rate
                          : options_.error_sample_rate;
  // arc_topk's error feedback: the tensor's state, all of it dropped at a compression change.
  if (epoch != error_feedback_epoch_) {
    error_feedback_.Clear();
    error_feedback_epoch_ = epoch;
  }
  ErrorFeedbackState* error_feedback = nullptr;
  if (codec->id() == kernels::CodecId::kArcTopK && options_.arc_topk_error_feedback) {
    const uint64_t evicted = error_feedback_.evicted();
    absl::StatusOr<ErrorFeedbackState*> state = error_feedback_.Get(tensor_name, n, epoch, sequence);
    if (error_feedback_.evicted() > evicted && evicted == 0) {
      // Once per job: a step's tensors do not fit, so some restart with the dense step each time.
      common::Log(
          "job %s: arc_topk error feedback reached its limit of %zu bytes (--error_feedback_mib); least recently "
          "used tensors' state is dropped to make room",
          options_.id, options_.error_feedback_bytes);
    }
    if (!state.ok()) {
      const absl::Status failed(state.status().code(), absl::StrCat("collective ", sequence, " of job ", options_.id,
                                                                    ": ", state.status().message()));
      // Like a failed local reduce: the other nodes learn why instead of waiting for this one.
      group_.Announce(group_.Decide({{sequence, failed}}));
      return failed;
    }
    error_feedback = *state;
  }
  path_->SetErrorFeedback(error_feedback, error_feedback_.momentum());
  absl::StatusOr<DataPath::CrossNodeResult> result = path_->CrossNode(*codec, *transport, o, n, rate);
  if (!result.ok()) {
    group_.Drop(/*abort=*/false);
    std::string hint;
    if (engine::IsDifferentCollective(result.status())) {
      hint = absl::StrFormat(
          " (the nodes' workers submitted different tensors; this node all-reduces '%s', %d x %s: every worker "
          "of a job must submit the same tensors in the same order)",
          tensor_name, n, kernels::DTypeName(dtype));
    }
    return common::Restate(result.status(), absl::StrCat("collective ", sequence, " of job ", options_.id, ": ",
                                                         result.status().message(), hint));
  }
  if (result->regroup) group_.Drop(/*abort=*/false);  // the measurement on the side broke the group
  return result;
}

absl::StatusOr<DataPath::CrossNodeResult> Job::CrossNodeLossy(uint64_t sequence, const JobConfig& config,
                                                              absl::string_view tensor_name, kernels::DType dtype,
                                                              size_t n, uint64_t boundary) {
  DQ_ASSIGN_OR_RETURN(engine::Transport * transport, group_.Connected(sequence));
  engine::DatagramTransport* datagrams = transport->datagrams();
  if (datagrams == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("collective ", sequence, " of job ", options_.id,
                     ": the loss-tolerant all-reduce (lossy_phase_ms) needs dynamiqd --transport=udp"));
  }
  engine::LossyAllReduceOptions o;
  // The datagrams' tags name the collective (its sequence and what was submitted): a late datagram
  // of another collective, or of a node whose workers submitted another tensor, is never counted.
  o.sequence =
      CollectiveId(options_.id, options_.incarnation, tensor_name, n, dtype, false) + sequence * 0x9e3779b97f4a7c15ull;
  o.phase_timeout = config.lossy_phase;
  o.send_bytes_per_second = options_.lossy_send_bytes_per_second;
  o.values = engine::LossyValuesOf(EffectiveCodec(config, n).id).value_or(engine::LossyValues::kFp32);
  o.announcement = boundary;
  const uint64_t dropped = datagrams->counters().dropped();
  absl::StatusOr<DataPath::CrossNodeResult> result = path_->CrossNodeLossy(*datagrams, o, n);
  // What the transport refused meanwhile (forged, foreign, replayed, stray) counts with what the
  // all-reduce refused.
  if (result.ok()) result->lossy->rejected += datagrams->counters().dropped() - dropped;
  if (!result.ok()) {
    group_.Drop(/*abort=*/false);
    return common::Restate(result.status(), absl::StrCat("collective ", sequence, " of job ", options_.id,
                                                         ": loss-tolerant all-reduce: ", result.status().message()));
  }
  return result;
}

void Job::ReportLossy(const GroupView& view, bool exact, const DataPath::CrossNodeResult& cross) {
  if (exact) {
    absl::MutexLock lock(&mu_);
    totals_.lossy_drift_elements = 0;  // sync_state's exact all-reduces: the reliable resync
  }
  if (!cross.lossy.has_value()) return;
  const engine::LossyAllReduceResult& r = *cross.lossy;
  {
    absl::MutexLock lock(&mu_);
    for (size_t rank = 0; rank < r.expected_from.size(); ++rank) {
      totals_.lossy_expected += r.expected_from[rank];
      totals_.lossy_arrived += r.arrived_from[rank];
    }
    totals_.lossy_drift_elements += r.kept_own_elements;
  }
  if (options_.observer == nullptr) return;
  LossyOutcome outcome;
  for (size_t rank = 0; rank < r.expected_from.size() && rank < view.members().size(); ++rank) {
    if (static_cast<int>(rank) == view.my_index()) continue;
    outcome.peers.push_back(view.members()[rank]);
    outcome.expected.push_back(r.expected_from[rank]);
    outcome.arrived.push_back(r.arrived_from[rank]);
  }
  outcome.late = r.late;
  outcome.dropped = r.rejected;
  outcome.coverage = r.coverage();
  outcome.kept_own_elements = r.kept_own_elements;
  options_.observer->OnLossyCollective(options_.id, outcome);
}

absl::StatusOr<GroupView> Job::ChangeView(std::vector<uint32_t> members) {
  if (options_.num_nodes <= 1 || options_.coordinator == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("job ", options_.id, " runs on one node: it has no group view"));
  }
  DQ_ASSIGN_OR_RETURN(GroupView newest, options_.coordinator->NewestView(group_.view()));
  return ClaimAtBoundary(newest, std::move(members));
}

absl::StatusOr<GroupView> Job::ClaimAtBoundary(const GroupView& newest, std::vector<uint32_t> members) {
  uint64_t boundary;
  {
    // Reserved and held under one lock: the reducer cannot start the collective before the
    // boundary in between.
    absl::MutexLock lock(&mu_);
    boundary = ReserveConfigBoundaryLocked();
    claim_boundaries_.insert(boundary);
  }
  absl::StatusOr<GroupView> claimed = options_.coordinator->ClaimView(newest, std::move(members), boundary);
  absl::MutexLock lock(&mu_);
  claim_boundaries_.erase(claim_boundaries_.find(boundary));
  return claimed;
}

std::optional<GroupView> Job::OnMembership(const LiveSet& live) {
  if (options_.num_nodes <= 1 || options_.coordinator == nullptr || live.epoch == 0) return std::nullopt;
  const GroupView view = group_.view();
  // Gone: silent members, and members whose dynamiqd restarted (its count of joins moved on).
  const std::vector<uint32_t> silent = live.Silent(view.members());
  std::vector<uint32_t> gone = silent;
  std::vector<uint32_t> restarted;
  {
    absl::MutexLock lock(&membership_mu_);
    // Counted afresh in every view: a member admitted again comes with its new count.
    if (view.epoch() != generations_view_) {
      generations_.clear();
      generations_view_ = view.epoch();
    }
    for (uint32_t m : view.members()) {
      const uint64_t generation = live.Generation(m);
      if (generation == 0) continue;
      auto [it, first] = generations_.emplace(m, generation);
      if (!first && it->second != generation) restarted.push_back(m);
    }
  }
  gone.insert(gone.end(), restarted.begin(), restarted.end());
  std::sort(gone.begin(), gone.end());
  // Outsiders: live nodes outside the view, which may ask to be admitted.
  bool outsiders = false;
  for (uint32_t node : live.live) outsiders = outsiders || view.IndexOf(node) < 0;
  if (gone.empty() && !outsiders) return std::nullopt;
  std::vector<std::string> causes;
  if (!silent.empty())
    causes.push_back(absl::StrCat(live.DescribeSilent(silent), " stopped heartbeating to the coordinator"));
  if (!restarted.empty()) {
    causes.push_back(absl::StrCat(restarted.size() == 1 ? "node " : "nodes ", absl::StrJoin(restarted, ", "),
                                  " restarted (a new dynamiqd joined the cluster in its place)"));
  }
  const std::string why = absl::StrJoin(causes, "; ");
  if (!gone.empty()) group_.AbortIfIncludes(gone, why);
  if (!view.is_member()) return std::nullopt;
  auto is_gone = [&gone](uint32_t node) { return std::binary_search(gone.begin(), gone.end(), node); };
  // One claimant: the lowest member that stays (the others' connects wait for its view). Only it
  // reads the coordinator.
  for (uint32_t m : view.members()) {
    if (is_gone(m)) continue;
    if (m != options_.node_rank) return std::nullopt;
    break;
  }
  absl::StatusOr<GroupView> newest = options_.coordinator->NewestView(view);
  if (!newest.ok()) return std::nullopt;  // the next heartbeat tries again
  std::vector<uint32_t> rest;
  for (uint32_t m : newest->members()) {
    if (!is_gone(m)) rest.push_back(m);
  }
  if (rest.empty() || rest.front() != options_.node_rank) return std::nullopt;
  const bool shrink = rest.size() < newest->size();
  std::vector<uint32_t> joiners;
  // Admissions only in a view this node runs in already: its boundary is then past every pending
  // view's (CrossNodeGroup adopts each at its own).
  if (!shrink && newest->epoch() == view.epoch()) {
    for (uint32_t node : live.live) {
      if (newest->IndexOf(node) < 0 && !is_gone(node) && options_.coordinator->WantsToJoin(node)) {
        joiners.push_back(node);
      }
    }
  }
  if (!shrink && joiners.empty()) return std::nullopt;  // claimed already
  const uint32_t min_nodes = live.min_nodes == 0 ? options_.num_nodes : live.min_nodes;
  if (shrink && rest.size() < min_nodes) return std::nullopt;  // the members' collectives fail, saying why
  std::vector<uint32_t> members = rest;
  members.insert(members.end(), joiners.begin(), joiners.end());
  // A shrink applies from the first collective this node has not completed: every member fails the
  // one a silent node broke and connects for the next in the new view (a member that ran ahead
  // connects in it too). An admission applies where a configuration change would: the side lane
  // tells every member to look there (ReserveConfigBoundary), and the joiner numbers its
  // collectives from there.
  absl::StatusOr<GroupView> claimed =
      shrink ? options_.coordinator->ClaimView(*newest, members, NextSequence()) : ClaimAtBoundary(*newest, members);
  if (!claimed.ok()) {
    common::Log("job %s: cannot claim a view %s: %s", options_.id,
                shrink ? absl::StrCat("without nodes ", absl::StrJoin(gone, ", ")) : "that admits a restarted node",
                claimed.status().message());
    return std::nullopt;
  }
  if (shrink) {
    common::Log("job %s: %s claimed: %s", options_.id, claimed->ToString(), why);
  } else {
    options_.coordinator->Admitted(joiners);
    common::Log("job %s: %s claimed: admits node%s %s", options_.id, claimed->ToString(),
                joiners.size() == 1 ? "" : "s", absl::StrJoin(joiners, ", "));
  }
  return *claimed;
}

uint64_t Job::AwaitAdmission(uint64_t sequence) {
  const absl::Time deadline = absl::Now() + options_.timeout;
  while (true) {
    absl::StatusOr<GroupView> newest = options_.coordinator->NewestView(group_.view());
    absl::MutexLock lock(&mu_);
    if (stopping_) return sequence;
    if (newest.ok() && newest->is_member() && newest->epoch() > *options_.rejoin_after_view) {
      const uint64_t first = newest->first_sequence();
      joining_ = false;
      if (first < next_run_) {
        common::Log("job %s: %s admits this node from collective %d, which it has passed (at %d)", options_.id,
                    newest->ToString(), first, next_run_);
        return sequence;
      }
      // From here this node numbers its collectives as the members do: the queued ones move up.
      const uint64_t delta = first - next_run_;
      std::vector<std::map<uint64_t, Slot>::node_type> moved;
      while (!slots_.empty()) moved.push_back(slots_.extract(slots_.begin()));
      for (auto& node : moved) {
        node.key() += delta;
        slots_.insert(std::move(node));  // the node, and the reducer's pointer to its slot, stay
      }
      next_run_ += delta;
      for (auto& [id, next] : next_submit_) next += delta;
      for (auto& [id, base] : base_) base += delta;
      common::Log("job %s: admitted by %s", options_.id, newest->ToString());
      return sequence + delta;
    }
    auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
    if (absl::Now() >= deadline || mu_.AwaitWithTimeout(absl::Condition(&stopped), absl::Milliseconds(100))) {
      return sequence;  // not admitted in time: the collective fails as a non-member's
    }
  }
}

}  // namespace dynamiq::server

#include "server/cluster.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "dynamiq/v1/rendezvous.pb.h"
#include "server/cluster_keys.h"
#include "server/request_names.h"

namespace dynamiq::server {
namespace {

using internal::JobKey;
using internal::JobPrefix;
using internal::ReadCounter;

// Start-up waits (the coordinator, the other nodes, node 0's settings) go in slices this long, so a
// signal stops them promptly, and report what they wait for this often.
constexpr absl::Duration kStartSlice = absl::Seconds(1);
constexpr absl::Duration kStartProgressInterval = absl::Seconds(5);
// Incarnations retired here that a late write (CleanUpIfRetired) is still checked against.
constexpr size_t kRememberedRetirements = 64;

std::string MemberKey(uint32_t rank) { return absl::StrCat("member/", rank); }

std::string LivePrefix(const std::string& job_id) { return absl::StrCat(JobPrefix(job_id), "live/"); }
std::string LiveKey(const std::string& job_id, uint32_t rank) { return absl::StrCat(LivePrefix(job_id), rank); }

std::string IncarnationsKey(const std::string& job_id, uint32_t rank) {
  return absl::StrCat(JobPrefix(job_id), "node", rank, "/incarnations");
}

std::string BaseKey(const std::string& job_id) { return absl::StrCat(JobPrefix(job_id), "base"); }

// The highest incarnation of any job whose keys a node has let go: every run of a job id whose keys
// are created afresh numbers its incarnations above it.
constexpr char kIncarnationFloorKey[] = "cluster/incarnation_floor";

// "job/<id>/inc<k>" and (E, s) of a key under "job/<id>/inc<k>/view<E>-from<s>/" (RendezvousPrefix);
// false for any other key.
bool ParseRendezvousKey(absl::string_view key, absl::string_view* job_key, std::pair<uint64_t, uint64_t>* connection) {
  std::vector<absl::string_view> parts = absl::StrSplit(key, absl::MaxSplits('/', 4));
  if (parts.size() != 5 || parts[0] != "job" || !absl::StartsWith(parts[2], "inc") ||
      !absl::ConsumePrefix(&parts[3], "view")) {
    return false;
  }
  std::vector<absl::string_view> ids = absl::StrSplit(parts[3], absl::MaxSplits("-from", 1));
  if (ids.size() != 2 || !absl::SimpleAtoi(ids[0], &connection->first) ||
      !absl::SimpleAtoi(ids[1], &connection->second)) {
    return false;
  }
  *job_key = key.substr(0, parts[0].size() + parts[1].size() + parts[2].size() + 2);
  return true;
}

// The store with a callback after every write (what Cluster::store() hands out).
class NotingStore final : public engine::Store {
 public:
  NotingStore(engine::Store& base, std::function<void(absl::string_view key)> on_write)
      : base_(base), on_write_(std::move(on_write)) {}
  absl::Status Set(absl::string_view key, absl::string_view value) override {
    absl::Status s = base_.Set(key, value);
    if (s.ok()) on_write_(key);
    return s;
  }
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override {
    return base_.Get(key, timeout);
  }
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override {
    return base_.Wait(keys, timeout);
  }
  absl::StatusOr<bool> CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                     absl::string_view desired) override {
    absl::StatusOr<bool> swapped = base_.CompareAndSet(key, expected, desired);
    if (swapped.ok() && *swapped) on_write_(key);
    return swapped;
  }
  absl::StatusOr<std::string> GetBefore(absl::string_view key, absl::Duration timeout, absl::Time deadline) override {
    return base_.GetBefore(key, timeout, deadline);
  }
  absl::Status SetBefore(absl::string_view key, absl::string_view value, absl::Time deadline) override {
    absl::Status s = base_.SetBefore(key, value, deadline);
    if (s.ok()) on_write_(key);
    return s;
  }
  absl::StatusOr<std::vector<std::optional<std::string>>> GetMany(absl::Span<const std::string> keys) override {
    return base_.GetMany(keys);
  }
  absl::StatusOr<uint64_t> Delete(const Deletion& deletion) override { return base_.Delete(deletion); }

 private:
  engine::Store& base_;
  const std::function<void(absl::string_view key)> on_write_;
};

}  // namespace

Cluster::Cluster(Options options, std::unique_ptr<engine::Store> store, GrpcStore* coordinator, std::string me,
                 std::vector<std::string> members)
    : options_(std::move(options)),
      store_(std::move(store)),
      coordinator_(coordinator),
      noting_store_(std::make_unique<NotingStore>(*store_, [this](absl::string_view key) { NoteWrite(key); })),
      me_(std::move(me)),
      members_(std::move(members)) {}

std::unique_ptr<Cluster> Cluster::Local(Options options, const std::string& me) {
  return std::unique_ptr<Cluster>(
      new Cluster(std::move(options), std::make_unique<engine::InMemoryStore>(), nullptr, me, {me}));
}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Join(Options options, std::unique_ptr<GrpcStore> coordinator,
                                                       const std::string& me) {
  const absl::Time deadline = absl::Now() + options.timeout;
  absl::Time next_report = absl::Now() + kStartProgressInterval;
  while (true) {
    // Short joins, so that a signal and the progress report are never far away. A join is
    // idempotent: the coordinator keeps this node's address from the first one.
    const absl::Duration slice = std::min(kStartSlice, std::max(absl::Milliseconds(1), deadline - absl::Now()));
    absl::StatusOr<std::vector<std::string>> members =
        coordinator->Join(options.node_rank, options.num_nodes, me, slice, options.settings);
    if (members.ok()) {
      GrpcStore* raw = coordinator.get();
      return std::unique_ptr<Cluster>(
          new Cluster(std::move(options), std::move(coordinator), raw, me, *std::move(members)));
    }
    // UNAVAILABLE / DEADLINE_EXCEEDED: the coordinator is not up, or not every node has joined yet.
    if (!absl::IsDeadlineExceeded(members.status()) && !absl::IsUnavailable(members.status())) {
      return members.status();
    }
    if (options.cancelled && options.cancelled()) {
      return absl::CancelledError("stopped while waiting for the cluster to form");
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the cluster did not form within --timeout=", absl::FormatDuration(options.timeout), ": ",
                       DescribeJoinWait(options, *coordinator, members.status())));
    }
    if (absl::Now() >= next_report) {
      common::Log("waiting for the cluster to form: %s",
                  DescribeJoinWait(options, *coordinator, members.status()).c_str());
      next_report = absl::Now() + kStartProgressInterval;
    }
  }
}

std::string Cluster::DescribeJoinWait(const Options& options, GrpcStore& store, const absl::Status& last) {
  std::vector<std::string> missing;
  for (uint32_t r = 0; r < options.num_nodes; ++r) {
    absl::StatusOr<std::string> member = store.Get(MemberKey(r), absl::ZeroDuration());
    if (member.ok()) continue;
    if (!engine::IsKeyNotSet(member.status())) {
      return absl::StrCat("the coordinator at ", options.coordinator, " does not answer (", last.message(), ")");
    }
    missing.push_back(absl::StrCat(r));
  }
  return absl::StrCat(missing.size() == 1 ? "node rank " : "node ranks ", absl::StrJoin(missing, ", "), " of ",
                      options.num_nodes, missing.size() == 1 ? " has" : " have",
                      " not joined yet (each node runs dynamiqd with --num_nodes=", options.num_nodes,
                      " and --coordinator pointing at node 0)");
}

std::vector<std::string> Cluster::members() const {
  absl::MutexLock lock(&mu_);
  return members_;
}

absl::StatusOr<std::string> Cluster::WaitForStartKey(const std::string& key) {
  engine::InterruptibleStore store(
      *store_,
      [this] {
        return options_.cancelled && options_.cancelled()
                   ? absl::CancelledError("stopped while waiting for node 0's settings")
                   : absl::OkStatus();
      },
      kStartSlice);
  return store.Get(key, options_.timeout);
}

absl::StatusOr<double> Cluster::AgreeOnErrorSampleRate(double mine) {
  if (options_.num_nodes <= 1) return mine;
  // Every node must run the same side all-reduces (server/error_probe.h): node 0's rate applies.
  const std::string key = "cluster/error_sample_rate";
  if (options_.node_rank == 0) {
    DQ_RETURN_IF_ERROR(store_->Set(key, absl::StrFormat("%.17g", mine)));
    return mine;
  }
  DQ_ASSIGN_OR_RETURN(std::string value, WaitForStartKey(key));
  double rate = 0;
  if (!absl::SimpleAtod(value, &rate) || !(rate >= 0 && rate <= 1)) {
    return absl::DataLossError(absl::StrCat("malformed error sample rate '", value, "' from node 0"));
  }
  if (rate != mine) {
    common::Log("using node 0's --error_sample_rate=%g instead of %g", rate, mine);
  }
  return rate;
}

absl::StatusOr<bool> Cluster::RejoinIfForgotten() {
  if (coordinator_ == nullptr) return false;
  // Known to the coordinator, or the coordinator is down (then try again later). A missing key is
  // the coordinator's own answer (engine::IsKeyNotSet); an unreachable one (UNAVAILABLE, or a call
  // that timed out on a cut link) is not.
  absl::StatusOr<std::string> known = coordinator_->Get(MemberKey(options_.node_rank), absl::ZeroDuration());
  if (known.ok() || !engine::IsKeyNotSet(known.status())) return false;
  // It answers but does not know this node: it restarted with an empty rendezvous. Join again; the
  // coordinator records this node at once and its own start completes once all have.
  common::Log("the coordinator does not know this node (restarted?): joining again");
  DQ_ASSIGN_OR_RETURN(std::vector<std::string> members, coordinator_->Join(options_.node_rank, options_.num_nodes, me_,
                                                                           absl::Seconds(2), options_.settings));
  common::Log("re-joined the cluster");
  {
    absl::MutexLock lock(&mu_);
    members_ = std::move(members);
  }
  // The jobs still running here hold the new store's keys of them (for whatever they write next)
  // until they retire.
  absl::MutexLock lock(&live_mu_);
  for (const auto& [job_id, live] : live_jobs_) {
    if (absl::Status s = store_->Set(LiveKey(job_id, options_.node_rank), "1"); !s.ok()) break;
  }
  return true;
}

absl::StatusOr<LiveSet> Cluster::Heartbeat(absl::Time deadline) {
  if (coordinator_ == nullptr) return live();
  DQ_ASSIGN_OR_RETURN(LiveSet set, coordinator_->Heartbeat(options_.node_rank, me_, deadline));
  absl::MutexLock lock(&mu_);
  live_ = set;
  return set;
}

LiveSet Cluster::live() const {
  absl::MutexLock lock(&mu_);
  return live_;
}

absl::StatusOr<uint64_t> Cluster::ClaimIncarnation(const std::string& job_id) {
  {
    // Live first: a node retiring the job meanwhile must not delete its keys (the count among them)
    // under this claim. The live key is set for the first incarnation running here only.
    absl::MutexLock lock(&live_mu_);
    LiveJob& live = live_jobs_[job_id];
    if (live.incarnations == 0) {
      if (absl::Status s = store_->Set(LiveKey(job_id, options_.node_rank), "1"); !s.ok()) {
        live_jobs_.erase(job_id);
        return common::Annotate(s, absl::StrCat("cannot create job ", job_id));
      }
    }
    ++live.incarnations;
  }
  absl::StatusOr<uint64_t> incarnation = CountIncarnation(job_id);
  if (!incarnation.ok()) {
    ReleaseJob(job_id);
    return common::Annotate(incarnation.status(), absl::StrCat("cannot create job ", job_id));
  }
  {
    absl::MutexLock lock(&live_mu_);
    uint64_t& newest = live_jobs_[job_id].newest;
    newest = std::max(newest, *incarnation);
  }
  absl::MutexLock lock(&keys_mu_);
  incarnations_[JobKey(job_id, *incarnation)];
  return *incarnation;
}

absl::StatusOr<std::optional<Cluster::Rejoin>> Cluster::RejoinableIncarnation(const std::string& job_id,
                                                                              absl::Duration wait) {
  {
    absl::MutexLock lock(&live_mu_);
    if (live_jobs_.count(job_id)) return std::nullopt;  // this process runs it already
  }
  if (coordinator_ == nullptr) return std::nullopt;
  // This node's live key is still set only when its previous dynamiqd died running the job.
  absl::StatusOr<std::string> mine = store_->Get(LiveKey(job_id, options_.node_rank), absl::ZeroDuration());
  if (engine::IsKeyNotSet(mine.status())) return std::nullopt;
  if (!mine.ok()) return mine.status();
  DQ_ASSIGN_OR_RETURN(auto base, ReadCounter(*store_, BaseKey(job_id)));
  DQ_ASSIGN_OR_RETURN(auto count, ReadCounter(*store_, IncarnationsKey(job_id, options_.node_rank)));
  if (!base.second.has_value() || count.first == 0) return std::nullopt;
  const uint64_t incarnation = base.first + count.first;
  const absl::Time deadline = absl::Now() + wait;
  while (true) {
    // Another live node still runs the incarnation this node ran (the same count)...
    bool running = false;
    const LiveSet live = this->live();
    for (uint32_t node = 0; node < options_.num_nodes && !running; ++node) {
      if (node == options_.node_rank || !live.IsLive(node)) continue;
      absl::StatusOr<std::string> theirs = store_->Get(LiveKey(job_id, node), absl::ZeroDuration());
      if (!theirs.ok()) continue;
      DQ_ASSIGN_OR_RETURN(auto their_count, ReadCounter(*store_, IncarnationsKey(job_id, node)));
      running = their_count.first == count.first;
    }
    if (!running) return std::nullopt;  // every node starts the job afresh (its next incarnation)
    // ... and its members went on without this node: rejoin them.
    absl::StatusOr<std::string> latest = store_->Get(LatestViewKey(job_id, incarnation), absl::ZeroDuration());
    if (latest.ok()) {
      uint64_t epoch = 0;
      if (!absl::SimpleAtoi(*latest, &epoch)) return absl::DataLossError("a malformed newest view");
      DQ_ASSIGN_OR_RETURN(std::string record, store_->Get(ViewKey(job_id, incarnation, epoch), absl::ZeroDuration()));
      DQ_ASSIGN_OR_RETURN(GroupView view, GroupView::Decode(record, options_.num_nodes, options_.node_rank));
      if (!view.is_member()) return Rejoin{incarnation, epoch};
    }
    // Not yet left out: the members have not noticed that this node's dynamiqd restarted.
    if (absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(100));
  }
}

absl::Status Cluster::RejoinIncarnation(const std::string& job_id, uint64_t incarnation) {
  {
    absl::MutexLock lock(&live_mu_);
    LiveJob& live = live_jobs_[job_id];
    ++live.incarnations;
    live.newest = std::max(live.newest, incarnation);
  }
  {
    absl::MutexLock lock(&keys_mu_);
    incarnations_[JobKey(job_id, incarnation)];
  }
  // The members admit a live node that asks to (Job::OnMembership).
  absl::Status asked = store_->Set(JoinKey(job_id, incarnation, options_.node_rank), "1");
  if (!asked.ok()) RetireJob(job_id, incarnation);
  return asked;
}

std::string Cluster::JoinKey(const std::string& job_id, uint64_t incarnation, uint32_t node) {
  return absl::StrCat(JobKey(job_id, incarnation), "/join/", node);
}

absl::StatusOr<uint64_t> Cluster::CountIncarnation(const std::string& job_id) {
  DQ_ASSIGN_OR_RETURN(uint64_t base, IncarnationBase(job_id));
  const std::string key = IncarnationsKey(job_id, options_.node_rank);
  // Only this node writes its count; compare-and-set still keeps a misconfigured twin (two daemons
  // with one rank) from handing out one incarnation twice.
  for (int attempt = 0; attempt < 16; ++attempt) {
    DQ_ASSIGN_OR_RETURN(auto counter, ReadCounter(*store_, key));
    const auto& [count, seen] = counter;
    std::optional<absl::string_view> expected;
    if (seen.has_value()) expected = *seen;
    DQ_ASSIGN_OR_RETURN(bool claimed, store_->CompareAndSet(key, expected, absl::StrCat(count + 1)));
    if (claimed) return base + count + 1;
  }
  return absl::AbortedError(absl::StrCat(key, " changed concurrently too often; retry"));
}

absl::StatusOr<uint64_t> Cluster::IncarnationBase(const std::string& job_id) {
  const std::string key = BaseKey(job_id);
  for (int attempt = 0; attempt < 16; ++attempt) {
    DQ_ASSIGN_OR_RETURN(auto base, ReadCounter(*store_, key));
    if (base.second.has_value()) return base.first;
    // The first claim since the job's keys were deleted (or ever): its incarnations count on from
    // the floor, above every incarnation of it that ran before. Nodes claiming at once agree on
    // whichever base is set first.
    DQ_ASSIGN_OR_RETURN(auto floor_count, ReadCounter(*store_, kIncarnationFloorKey));
    DQ_ASSIGN_OR_RETURN(bool set, store_->CompareAndSet(key, std::nullopt, absl::StrCat(floor_count.first)));
    if (set) return floor_count.first;
  }
  return absl::AbortedError(absl::StrCat(key, " changed concurrently too often; retry"));
}

absl::Status Cluster::RaiseIncarnationFloor(uint64_t incarnation) {
  for (int attempt = 0; attempt < 16; ++attempt) {
    DQ_ASSIGN_OR_RETURN(auto floor_count, ReadCounter(*store_, kIncarnationFloorKey));
    const auto& [current, seen] = floor_count;
    if (current >= incarnation) return absl::OkStatus();
    std::optional<absl::string_view> expected;
    if (seen.has_value()) expected = *seen;
    DQ_ASSIGN_OR_RETURN(bool raised, store_->CompareAndSet(kIncarnationFloorKey, expected, absl::StrCat(incarnation)));
    if (raised) return absl::OkStatus();
  }
  return absl::AbortedError(absl::StrCat(kIncarnationFloorKey, " changed concurrently too often"));
}

void Cluster::RetireJob(const std::string& job_id, uint64_t incarnation) {
  {
    absl::MutexLock lock(&keys_mu_);
    const std::string job_key = JobKey(job_id, incarnation);
    if (incarnations_.erase(job_key) == 0) return;  // not claimed here, or retired already
    retired_.push_back(job_key);
    if (retired_.size() > kRememberedRetirements) retired_.pop_front();
  }
  ReleaseJob(job_id);
}

void Cluster::ReleaseJob(const std::string& job_id) {
  absl::MutexLock lock(&live_mu_);
  auto it = live_jobs_.find(job_id);
  if (it == live_jobs_.end() || --it->second.incarnations > 0) return;  // another incarnation of it runs here
  const uint64_t newest = it->second.newest;
  live_jobs_.erase(it);
  // Before this node lets the job's keys go (its count among them), the floor passes its newest
  // incarnation: a later run of the id numbers its incarnations above it, so messages recorded from
  // this run never fit the next (docs/security.md).
  if (absl::Status s = RaiseIncarnationFloor(newest); !s.ok()) {
    common::Log("job %s: keeping its keys in the coordinator's store: %s", job_id.c_str(),
                std::string(s.message()).c_str());
    return;
  }
  // This node's live key, and the job's keys with it if no other node holds one.
  engine::Store::Deletion deletion;
  deletion.keys.push_back(LiveKey(job_id, options_.node_rank));
  deletion.prefix = JobPrefix(job_id);
  deletion.unless_prefix = LivePrefix(job_id);
  DeleteKeys(deletion, absl::StrCat("job ", job_id, "'s keys"));
}

void Cluster::DeleteKeys(const engine::Store::Deletion& deletion, absl::string_view what) {
  absl::StatusOr<uint64_t> deleted = store_->Delete(deletion);
  // UNIMPLEMENTED: a coordinator that predates deletion keeps every key, as it always did.
  if (!deleted.ok() && !absl::IsUnimplemented(deleted.status())) {
    common::Log("cannot delete %s from the coordinator's store (they stay): %s", std::string(what).c_str(),
                std::string(deleted.status().message()).c_str());
  }
}

void Cluster::NoteWrite(absl::string_view key) {
  absl::string_view job_key;
  std::pair<uint64_t, uint64_t> connection;
  if (!ParseRendezvousKey(key, &job_key, &connection)) return;
  std::optional<std::pair<uint64_t, uint64_t>> done;
  {
    absl::MutexLock lock(&keys_mu_);
    auto it = incarnations_.find(job_key);
    if (it == incarnations_.end()) return;  // not an incarnation running here
    LiveIncarnation& live = it->second;
    if (live.connection.has_value() && connection <= *live.connection) return;
    // Every node has left the connection before the previous one: a node connects again only after
    // its connection failed (or its view changed), and a group forms only with all its members.
    done = live.older_connection;
    live.older_connection = live.connection;
    live.connection = connection;
  }
  if (!done.has_value()) return;
  engine::Store::Deletion deletion;
  deletion.prefix = absl::StrCat(job_key, "/view", done->first, "-from", done->second, "/");
  DeleteKeys(deletion, deletion.prefix);
}

void Cluster::CleanUpIfRetired(const std::string& job_id, uint64_t incarnation) {
  {
    absl::MutexLock lock(&keys_mu_);
    if (std::find(retired_.begin(), retired_.end(), JobKey(job_id, incarnation)) == retired_.end()) return;
  }
  engine::Store::Deletion deletion;
  deletion.prefix = JobPrefix(job_id);
  deletion.unless_prefix = LivePrefix(job_id);
  DeleteKeys(deletion, absl::StrCat("job ", job_id, "'s keys"));
}

std::string Cluster::IncarnationHint(const std::string& job_id, uint64_t incarnation) {
  std::vector<std::string> others, absent;
  uint64_t base = 0;  // none: the job's keys are gone, and no node has a count
  if (absl::StatusOr<std::string> value = store_->Get(BaseKey(job_id), absl::ZeroDuration()); value.ok()) {
    (void)absl::SimpleAtoi(*value, &base);
  }
  for (uint32_t r = 0; r < options_.num_nodes; ++r) {
    if (r == options_.node_rank) continue;
    absl::StatusOr<std::string> value = store_->Get(IncarnationsKey(job_id, r), absl::ZeroDuration());
    uint64_t count = 0;
    if (engine::IsKeyNotSet(value.status())) {
      absent.push_back(absl::StrCat(r));  // the coordinator answered: node r never created the job
      continue;
    }
    if (!value.ok() || !absl::SimpleAtoi(*value, &count)) continue;  // unknown: no hint rather than a wrong one
    count += base;
    if (count != incarnation) others.push_back(absl::StrCat("node ", r, " is at incarnation ", count));
  }
  if (!absent.empty()) {
    return absl::StrCat(" (", absent.size() == 1 ? "node " : "nodes ", absl::StrJoin(absent, ", "),
                        absent.size() == 1 ? " has" : " have", " no workers in job ", QuoteName(job_id),
                        ": every node's workers must register the same job id (DQ_JOB), and every node of the "
                        "cluster must have workers in it)");
  }
  if (others.empty()) return "";
  return absl::StrCat(" (", absl::StrJoin(others, ", "), " of job ", job_id, ", this node at ", incarnation,
                      ": a job id is reused by restarting all its workers on every node; use a new job id, or "
                      "restart all of them again)");
}

}  // namespace dynamiq::server

#include "server/job.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "common/log.h"
#include "common/safe_text.h"
#include "common/status_macros.h"
#include "server/contributions.h"
#include "server/host_data_path.h"

namespace dynamiq::server {
namespace {

// How far ahead of the job's next collective a worker may submit: far more than any training loop
// keeps outstanding (DDP has a few dozen buckets in flight), and a bound on the slots one worker can
// open. A request beyond it is refused rather than parked where no collective will ever reach it.
constexpr uint64_t kMaxCollectivesAhead = uint64_t{1} << 16;
// Collectives of at most this many elements on a one-node job run on the thread whose request
// completes them (Enqueue); bigger ones, and every cross-node one, on the reducer thread.
constexpr uint64_t kInlineMaxElements = uint64_t{1} << 18;

}  // namespace

Job::Job(Options options)
    : options_(std::move(options)),
      path_(options_.data_path != nullptr
                ? options_.data_path
                : std::make_shared<HostDataPath>(options_.id, options_.timeout, options_.codec_pool)),
      group_(options_.id, GroupView::Everyone(options_.num_nodes, options_.node_rank), options_.coordinator),
      error_feedback_(options_.error_feedback_bytes, options_.arc_topk_momentum) {
  {
    absl::MutexLock lock(&mu_);
    config_ = options_.config;
    joining_ = options_.rejoin_after_view.has_value() && options_.coordinator != nullptr;
  }
  if (options_.live_at_start.epoch > 0) {
    absl::MutexLock lock(&membership_mu_);
    generations_view_ = 0;  // the view every job starts in
    for (uint32_t node : options_.live_at_start.live) generations_[node] = options_.live_at_start.Generation(node);
  }
  absl::MutexLock lock(&close_mu_);
  reducer_ = std::thread([this] { ReducerLoop(); });
  // "dq-reducer" in top -H and /proc/<pid>/task/*/comm (at most 15 characters).
  pthread_setname_np(reducer_.native_handle(), "dq-reducer");
}

Job::~Job() { Close(); }

void Job::Close() {
  Stop();
  absl::MutexLock lock(&close_mu_);
  if (reducer_.joinable()) reducer_.join();
  // The reducer is gone: nothing uses the transport any more (Gloo closes its pairs here).
  group_.Close();
}

absl::Status Job::AddWorker(uint64_t worker_id, uint32_t local_rank, uint32_t local_world_size, int64_t pid) {
  if (local_world_size != options_.local_world_size) {
    return absl::InvalidArgumentError(absl::StrCat("job ", options_.id, " has ", options_.local_world_size,
                                                   " local workers, this worker says ", local_world_size));
  }
  if (local_rank >= local_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("local rank ", local_rank, " is not below the local world size ", local_world_size));
  }
  absl::MutexLock lock(&mu_);
  for (const auto& [id, rank] : workers_) {
    if (rank == local_rank) {
      return absl::AlreadyExistsError(
          absl::StrCat("local rank ", local_rank, " of job ", options_.id, " is already registered (worker ", id, ")"));
    }
  }
  workers_[worker_id] = local_rank;
  if (pid > 0) pids_[worker_id] = pid;
  // A (re-)registered worker joins at the collective the job runs next.
  next_submit_[worker_id] = next_run_;
  for (const auto& [seq, slot] : slots_) next_submit_[worker_id] = std::max(next_submit_[worker_id], seq);
  base_[worker_id] = next_submit_[worker_id];
  return absl::OkStatus();
}

void Job::RemoveWorker(uint64_t worker_id, const std::string& reason) {
  CrossNodeGroup::Break broken;
  uint32_t rank;
  Completions completions;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end()) return;
    rank = it->second;
    workers_.erase(it);
    pids_.erase(worker_id);
    next_submit_.erase(worker_id);
    base_.erase(worker_id);
    // Queued collectives either wait for this worker or hold its (soon unmapped) buffer: fail them
    // all and let the job continue after them (the other nodes fail them too: CrossNodeGroup::Decide).
    CrossNodeGroup::Failures failures;
    for (auto slot = slots_.begin(); slot != slots_.end();) {
      if (slot->second.running) {
        ++slot;
        continue;
      }
      const absl::Status failed = absl::AbortedError(absl::StrCat("collective ", slot->first, " of job ", options_.id,
                                                                  ": local rank ", rank, " left (", reason, ")"));
      if (!slot->second.entries.empty()) {
        CountFailure(slot->second.entries.begin()->second->request.num_elements,
                     {CollectiveResult::kAborted, FaultKind::kAbort});
      }
      TakeSlot(slot->second, failed, completions);
      failures.emplace_back(slot->first, failed);
      next_run_ = std::max(next_run_, slot->first + 1);
      slot = slots_.erase(slot);
    }
    for (auto& [id, next] : next_submit_) next = std::max(next, next_run_);
    if (!failures.empty()) broken = group_.Decide(std::move(failures));
  }
  Complete(std::move(completions));
  group_.Announce(broken);
  // A running collective may still read or write this worker's buffer: wait until it is done, so
  // the caller can release the worker's shared memory.
  absl::MutexLock lock(&mu_);
  auto idle = [this, rank]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [seq, slot] : slots_) {
      if (slot.running && slot.entries.count(rank)) return false;
    }
    return true;
  };
  mu_.Await(absl::Condition(&idle));
}

void Job::Stop(const std::string& reason) {
  // The collectives this call fails or aborts, for the other nodes (whose part of them it cuts short).
  CrossNodeGroup::Failures failures;
  Completions completions;
  {
    absl::MutexLock lock(&mu_);
    const bool first = !stopping_;
    if (first) stop_reason_ = reason.empty() ? absl::StrCat("job ", options_.id, " is shutting down") : reason;
    stopping_ = true;
    for (auto it = slots_.begin(); it != slots_.end();) {
      if (first) {
        failures.emplace_back(it->first, absl::UnavailableError(absl::StrCat("collective ", it->first, " of job ",
                                                                             options_.id, ": ", stop_reason_)));
      }
      if (it->second.running) {
        ++it;
        continue;
      }
      if (!it->second.entries.empty()) {
        CountFailure(it->second.entries.begin()->second->request.num_elements,
                     {CollectiveResult::kAborted, FaultKind::kAbort});
      }
      TakeSlot(it->second, absl::UnavailableError(stop_reason_), completions);
      it = slots_.erase(it);
    }
  }
  Complete(std::move(completions));
  group_.Report(failures);
  group_.Abort();  // a running collective fails promptly instead of at its timeout
  absl::MutexLock lock(&mu_);
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return outstanding_ == 0; };
  mu_.Await(absl::Condition(&drained));
}

void Job::TakeSlot(Slot& slot, const absl::StatusOr<Result>& result, Completions& out) {
  for (auto& [r, e] : slot.entries) {
    out.entries.push_back(std::move(e));
    out.results.push_back(result);
  }
  slot.entries.clear();
}

void Job::Complete(Completions completions) {
  if (completions.empty()) return;
  const size_t count = completions.entries.size();
  std::vector<Completion> calls;
  for (auto& e : completions.entries) calls.push_back(std::move(e->done));
  completions.entries.clear();  // the buffer holds go first
  for (size_t i = 0; i < count; ++i) calls[i](std::move(completions.results[i]));
  absl::MutexLock lock(&mu_);
  outstanding_ -= count;
}

void Job::Enqueue(Request submitted, Completion done) {
  // The request, and its hold on the worker's buffer, are the entry's alone: an answer must find no
  // hold left anywhere, for the worker may release the buffer as soon as it has it.
  auto entry = std::make_unique<Entry>();
  entry->request = std::move(submitted);
  const Request& request = entry->request;
  auto reject = [this, &done, &entry](absl::Status status) {
    entry.reset();
    if (options_.observer != nullptr) options_.observer->OnRejected(status.code());
    done(std::move(status));
  };
  if (request.weight.has_value() && !(*request.weight >= 0 && std::isfinite(*request.weight) &&
                                      *request.weight <= std::numeric_limits<float>::max())) {
    const absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
        "weight ", *request.weight, " of worker ", request.worker_id,
        "'s all-reduce: a weight is finite and >= 0 (a sample count; 0 when the worker contributes nothing)"));
    if (!request.submission.has_value()) return reject(bad);
    if (options_.observer != nullptr) options_.observer->OnRejected(bad.code());
    entry->request.refused = bad;
  }
  // A numbered request that was refused still takes its place (Request::refused): the worker hears
  // why at once, its collective fails for the others when it runs.
  if (!entry->request.refused.ok()) {
    entry->request.buffer_use.reset();  // never read: the worker, told, may release its buffer
    if (!request.submission.has_value()) {
      const absl::Status why = entry->request.refused;
      entry.reset();
      return done(why);
    }
    Completion told = std::move(done);
    told(entry->request.refused);
    done = [](absl::StatusOr<Result>) {};
  }
  Slot* inline_slot = nullptr;  // the collective this request completes, to run on this thread
  uint64_t inline_sequence = 0;
  // Accepts the request into its slot, or says why not (answered without mu_ held).
  const absl::Status accepted = [&]() -> absl::Status {
    uint64_t sequence;
    absl::MutexLock lock(&mu_);
    auto w = workers_.find(request.worker_id);
    if (w == workers_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", request.worker_id, " is not registered with job ", options_.id));
    }
    entry->local_rank = w->second;
    if (request.submission.has_value()) {
      // The worker's own numbering: asynchronous requests may arrive out of order.
      const uint64_t base = base_[request.worker_id];
      const uint64_t next = next_run_ - std::min(next_run_, base);  // the worker's submission that runs next
      if (*request.submission >= next + kMaxCollectivesAhead) {
        return absl::InvalidArgumentError(absl::StrCat(
            "submission ", *request.submission, " of worker ", request.worker_id, " is too far ahead: job ",
            options_.id, " runs its collective ", next, " of this worker next and accepts at most ",
            kMaxCollectivesAhead, " ahead of it (number a worker's all-reduces 0, 1, 2, ... from its registration)"));
      }
      sequence = base + *request.submission;
      if (sequence < next_run_) {
        return absl::InvalidArgumentError(absl::StrCat("submission ", *request.submission, " of worker ",
                                                       request.worker_id, " is out of order: its collective ", sequence,
                                                       " of job ", options_.id, " already ran"));
      }
    } else {
      sequence = next_submit_[request.worker_id];
      if (sequence >= next_run_ + kMaxCollectivesAhead) {
        return absl::ResourceExhaustedError(absl::StrCat("worker ", request.worker_id, " has ", sequence - next_run_,
                                                         " all-reduces of job ", options_.id, " waiting; at most ",
                                                         kMaxCollectivesAhead, " may be outstanding"));
      }
    }
    if (stopping_) return absl::UnavailableError(stop_reason_);
    auto existing = slots_.find(sequence);
    if (existing != slots_.end() && existing->second.entries.count(entry->local_rank)) {
      return absl::AlreadyExistsError(absl::StrCat("worker ", request.worker_id, " submitted collective ", sequence,
                                                   " twice (submission index reused)"));
    }
    next_submit_[request.worker_id] = std::max(next_submit_[request.worker_id], sequence + 1);
    entry->arrived = absl::Now();
    entry->stall_deadline = entry->arrived + options_.timeout;
    entry->done = std::move(done);
    const uint32_t rank = entry->local_rank;
    slots_[sequence].entries[rank] = std::move(entry);
    ++outstanding_;
    ++enqueued_;
    // A small single-node collective that this request completes runs here, sparing the hop to
    // the reducer thread (tens of microseconds) when nothing else runs.
    if (options_.num_nodes == 1 && request.num_elements <= kInlineMaxElements && !running_ && !joining_) {
      inline_slot = NextComplete();
      if (inline_slot != nullptr) {
        inline_sequence = next_run_;
        inline_slot->running = true;
        running_ = true;
      }
    }
    return absl::OkStatus();
  }();
  if (!accepted.ok()) return reject(accepted);
  if (inline_slot != nullptr) {
    RunCollective(inline_sequence, *inline_slot);
    absl::MutexLock lock(&mu_);
    running_ = false;
  }
}

absl::StatusOr<Job::Result> Job::Submit(const Request& request) {
  absl::Notification completed;
  absl::StatusOr<Result> result;
  Enqueue(request, [&](absl::StatusOr<Result> r) {
    result = std::move(r);
    completed.Notify();
  });
  completed.WaitForNotification();
  return result;
}

Job::Status Job::GetStatus() const {
  absl::MutexLock lock(&mu_);
  Status s;
  s.incarnation = options_.incarnation;
  s.workers = static_cast<uint32_t>(workers_.size());
  s.config_epoch = config_epoch_;
  s.config = config_;
  s.inflight = static_cast<uint32_t>(slots_.size());
  s.completed = completed_;
  s.failed = totals_.failed;
  s.payload_bytes = totals_.payload_bytes;
  s.bus_bytes = totals_.bus_bytes;
  s.wire_bytes = totals_.wire_bytes;
  s.duration_seconds = totals_.duration_seconds;
  s.error_samples = totals_.error_samples;
  s.last_vnmse = totals_.last_vnmse;
  s.config_polls = totals_.config_polls;
  s.local_wait_seconds = totals_.local_wait_seconds;
  s.node_wait_seconds = totals_.node_wait_seconds;
  s.lossy_expected = totals_.lossy_expected;
  s.lossy_arrived = totals_.lossy_arrived;
  s.lossy_drift_elements = totals_.lossy_drift_elements;
  const GroupView view = group_.view();
  s.view_epoch = view.epoch();
  s.view_members = view.members();
  return s;
}

std::vector<CollectiveRecord> Job::FlightRecorder(size_t limit) const {
  absl::MutexLock lock(&mu_);
  const size_t n = limit == 0 ? records_.size() : std::min(limit, records_.size());
  return std::vector<CollectiveRecord>(records_.end() - n, records_.end());
}

uint64_t Job::NextSequence() const {
  absl::MutexLock lock(&mu_);
  return next_run_;
}

uint64_t Job::ReserveConfigBoundary() {
  absl::MutexLock lock(&mu_);
  return ReserveConfigBoundaryLocked();
}

uint64_t Job::ReserveConfigBoundaryLocked() {
  // Under the lock that Finish advances next_run_ under: the collective after next_run_ has not
  // started, so its side lane carries the boundary to every node before the boundary runs.
  config_boundary_ = std::max(config_boundary_, next_run_ + 2);
  return next_run_ + 2;
}

void Job::Record(CollectiveRecord record) {
  // Errors may carry a peer's words: stored (and served as protobuf strings) only as safe text.
  record.error = common::SafeText(record.error);
  records_.push_back(std::move(record));
  while (records_.size() > options_.flight_recorder_size) records_.pop_front();
}

absl::Status Job::WithRemoteCause(uint64_t sequence, absl::Status error) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return error;  // this node's own doing: nothing to look up
  }
  return group_.WithRemoteCause(sequence, std::move(error));
}

bool Job::HeldForClaim() const { return !claim_boundaries_.empty() && next_run_ + 1 >= *claim_boundaries_.begin(); }

Job::Slot* Job::NextComplete() {
  auto it = slots_.find(next_run_);
  if (it == slots_.end() || it->second.running || it->second.entries.size() != options_.local_world_size) {
    return nullptr;
  }
  return &it->second;
}

void Job::ReducerLoop() {
  while (true) {
    uint64_t sequence = 0;
    Slot* slot = nullptr;
    bool joining = false;
    Completions expired;
    CrossNodeGroup::Failures failures;
    {
      absl::MutexLock lock(&mu_);
      while (slot == nullptr && expired.empty()) {
        // Wakes for the next collective, a stop, or a new request (which may bring the next stall
        // check forward from "never").
        const uint64_t seen = enqueued_;
        auto ready = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          if (stopping_ || enqueued_ != seen) return true;
          return !running_ && !HeldForClaim() && NextComplete() != nullptr;
        };
        mu_.AwaitWithDeadline(absl::Condition(&ready), NextStall());
        if (stopping_) return;
        if (Slot* next = running_ || HeldForClaim() ? nullptr : NextComplete(); next != nullptr) {
          sequence = next_run_;
          slot = next;
          slot->running = true;
          running_ = true;
          joining = joining_;
        } else {
          ExpireStalled(expired, failures);
        }
      }
    }
    if (!expired.empty()) {
      // Not under mu_: announcing talks to the coordinator.
      const CrossNodeGroup::Break broken = group_.Decide(std::move(failures));
      Complete(std::move(expired));
      group_.Announce(broken);
    }
    if (slot != nullptr && joining) sequence = AwaitAdmission(sequence);  // the slot stays where it is
    if (slot != nullptr) {
      RunCollective(sequence, *slot);
      absl::MutexLock lock(&mu_);
      running_ = false;
    }
  }
}

void Job::RunCollective(uint64_t sequence, Slot& slot) {
  // --timeout bounds the whole collective from here, the coordinator poll below included.
  deadline_ = absl::Now() + options_.timeout;
  // The entries are stable while the slot runs: RemoveWorker, Stop and the stall check leave it.
  std::vector<Entry*> entries;
  for (auto& [rank, e] : slot.entries) entries.push_back(e.get());
  JobConfig config;
  uint64_t epoch;
  AdoptBoundaryChanges(sequence, &config, &epoch);
  CollectiveRecord record;
  record.sequence = sequence;
  record.tensor_name = entries[0]->request.tensor_name;
  record.num_elements = entries[0]->request.num_elements;
  record.config = config;
  record.config_epoch = epoch;
  record.start = absl::Now();

  absl::Status status = CheckLocalAgreement(sequence, entries);
  const size_t n = entries[0]->request.num_elements;
  const std::string name = absl::StrCat("collective ", sequence, " of job ", options_.id);
  if (status.ok() && entries[0]->request.exact) {
    // Uncompressed whatever the job's compression (the other nodes' workers asked alike; a node
    // that did not sends another codec's headers and fails the header check).
    config.codec = kernels::CodecConfig{kernels::CodecId::kNone};
    record.config = config;
  }
  // The three steps of the data path: local reduce, across nodes, write-back.
  std::vector<DataPath::Region> inputs;
  std::vector<DataPath::Output> outputs;
  // What is summed and whom it waited for, over every member of the view after the cross-node step.
  const bool weighted = entries[0]->request.weight.has_value();
  bool connect_failed = false;
  if (status.ok()) {
    // The view and connection this collective runs in, before the view is read (a view claimed
    // when a member went silent may apply from here: server/membership.h). A failed connect is a
    // failed collective across nodes, as a failed exchange is.
    if (absl::Status settled = group_.Settle(sequence); !settled.ok()) {
      status = WithRemoteCause(sequence, settled);
      connect_failed = true;
    }
  }
  const GroupView view = group_.view();
  if (status.ok() && !view.is_member()) {
    // Its workers learn it at once; the members run on without this node (it publishes nothing).
    status = absl::FailedPreconditionError(absl::StrCat(name, ": node ", options_.node_rank,
                                                        " is not a member of the job's ", view.ToString(),
                                                        ", so its workers' collectives fail from there on"));
  }
  const uint32_t nodes = view.is_member() ? view.size() : 1;
  // The loss-tolerant all-reduce carries no side lane (datagrams stand alone); weighted and exact
  // all-reduces (sync_state's resync among them) stay on the reliable schedules.
  const bool lossy = config.lossy_phase > absl::ZeroDuration() && !entries[0]->request.exact && !weighted;
  Contributions contributions(weighted, nodes, view.is_member() ? view.my_index() : 0, path_->has_side_lane() && !lossy,
                              view.members());
  for (const Entry* e : entries) {
    const float weight = static_cast<float>(e->request.weight.value_or(1.0));
    contributions.AddWorker(e->local_rank, e->request.weight, e->arrived);
    const DataPath::Region region{e->request.region.data(), e->request.dtype, e->request.device_memory, weight};
    inputs.push_back(region);
    outputs.push_back(DataPath::Output{region, e->request.average});
  }
  contributions.SetPreviousEnd(previous_end_);
  uint64_t own_boundary;
  {
    absl::MutexLock lock(&mu_);
    own_boundary = config_boundary_;
  }
  contributions.SetConfigBoundary(own_boundary);
  if (status.ok()) {
    status = path_->LocalReduce(inputs, n);
    if (!status.ok()) {
      status = common::Annotate(status, path_->on_device() ? absl::StrCat(name, ": local reduce on the device") : name);
    }
  }
  // The local workers disagree, or the local reduce failed: this node skips the cross-node step.
  if (!status.ok() && !connect_failed) group_.Announce(group_.Decide({{sequence, status}}));
  DataPath::CrossNodeResult cross;
  // One budget per step: this bucket's share of the job's b̄ (0: the job's own).
  const kernels::CodecConfig codec = EffectiveCodec(config, n);
  const std::string bucket = absl::StrCat(entries[0]->request.tensor_name, "/", n);
  const bool plan = options_.step_budget && nodes > 1;
  if (plan && epoch != planner_epoch_) {
    planner_.Reset();
    planner_epoch_ = epoch;
  }
  const double bits = plan ? planner_.BitsFor(bucket, codec) : 0;
  if (status.ok() && nodes > 1) {
    absl::StatusOr<DataPath::CrossNodeResult> r =
        lossy ? CrossNodeLossy(sequence, config, entries[0]->request.tensor_name, entries[0]->request.dtype, n,
                               own_boundary)
              : CrossNode(sequence, config, epoch, entries[0]->request.tensor_name, entries[0]->request.dtype, n, bits,
                          weighted, contributions.SideLane());
    if (r.ok()) {
      cross = *std::move(r);
    } else {
      status = WithRemoteCause(sequence, r.status());
    }
  }
  const double weight_sum = contributions.weight_sum();
  if (status.ok() && !(weight_sum >= 0 && std::isfinite(weight_sum))) {
    // Every node checked its own workers' weights: only a broken peer gets here.
    status = absl::DataLossError(absl::StrCat(name, ": the nodes' weights sum to ", weight_sum));
  }
  if (plan && codec.id == kernels::CodecId::kDynamiq) {
    std::vector<double> energies;
    absl::StatusOr<kernels::Codec*> dq = codecs_.Get(codec);
    const kernels::WidthErrors* errors = dq.ok() ? (*dq)->MeasuredWidthErrors() : nullptr;
    if (status.ok() && errors != nullptr && path_->ResultEnergies(n, &energies)) {
      planner_.Record(bucket, n, std::move(energies), codec, *errors);
    } else {
      planner_.Reset();  // a failed collective (on every node), or a path that cannot plan
    }
  }
  if (status.ok()) {
    // The mean divides by what was summed: the weights, or the workers of every node (counted in
    // the side lane, so nodes with different numbers of workers divide alike; a collective whose
    // every weight is 0 has nothing to average: 0).
    const float scale = !weighted        ? 1.0f / static_cast<float>(contributions.contributors())
                        : weight_sum > 0 ? static_cast<float>(1.0 / weight_sum)
                                         : 0.0f;
    status = path_->WriteBack(outputs, n, scale);
    if (!status.ok()) {
      status = common::Annotate(
          status, path_->on_device() ? absl::StrCat(name, ": writing the result back on the device") : name);
    }
  }
  if (status.ok() && nodes > 1) ReportLossy(view, entries[0]->request.exact, cross);
  const uint64_t wire_bytes = cross.bytes_sent;
  record.seconds = absl::ToDoubleSeconds(absl::Now() - record.start);
  record.wire_bytes = wire_bytes;
  record.view_epoch = view.epoch();
  record.nodes = view.is_member() ? view.members() : std::vector<uint32_t>{options_.node_rank};
  if (status.ok()) record.contributors = contributions.contributors();
  const std::vector<uint32_t> ran_on = record.nodes;  // the result's too (record moves into Finish)
  record.state = status.ok() ? "ok" : "failed";
  record.error = std::string(status.message());
  if (status.ok() && !cross.probe_status.ok()) {
    record.error = absl::StrCat("error probe: ", cross.probe_status.message());
  }
  // Metrics count the collective, not the measurement on the side.
  const double seconds = std::max(0.0, record.seconds - cross.probe_seconds);
  previous_end_ = absl::Now();
  const StragglerWait waits = contributions.Waits();
  // The next collective skips the coordinator's round trip only when this one went through and
  // no node knows of a change that may apply at it: as the side lane says, or, in a loss-tolerant
  // one, as every other node's datagrams said (a node not heard from may have announced one).
  bool heard_every_node = contributions.has_node_slots();
  uint64_t boundary = contributions.ConfigBoundary();
  if (cross.lossy.has_value()) {
    heard_every_node = cross.lossy->ranks_heard + 1 == static_cast<int>(nodes);
    boundary = std::max(own_boundary, cross.lossy->highest_announcement);
  }
  poll_next_ = !status.ok() || nodes < 2 || !heard_every_node || boundary >= sequence + 1;
  // Advance the job before any worker sees its result: NextSequence() (which SetCompression's
  // boundary is computed from) is then current.
  Completions completions;
  {
    absl::MutexLock lock(&mu_);
    Finish(sequence, status,
           Result{sequence, epoch, config, wire_bytes, cross.vnmse, contributions.contributors(), weight_sum, ran_on},
           std::move(record), cross, seconds, waits, nodes, completions);
  }
  Complete(std::move(completions));
}

}  // namespace dynamiq::server

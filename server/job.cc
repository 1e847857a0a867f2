#include "server/job.h"

#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/log.h"
#include "common/safe_text.h"
#include "common/status_macros.h"
#include "engine/allreduce.h"
#include "engine/step_header.h"
#include "kernels/bf16_math.h"
#include "kernels/dynamiq_allocator.h"
#include "server/error_probe.h"
#include "server/host_data_path.h"

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
                      kernels::DType dtype) {
  const std::string nul(1, '\0');
  // Incarnation 1 is the plain job id.
  const std::string id = incarnation <= 1 ? std::string(job) : absl::StrCat(job, nul, "inc", incarnation);
  return JobHash(absl::StrCat(id, nul, tensor, nul, num_elements, nul, kernels::DTypeName(dtype)));
}

// How far ahead of the job's next collective a worker may submit: far more than any training loop
// keeps outstanding (DDP has a few dozen buckets in flight), and a bound on the slots one worker can
// open. A request beyond it is refused rather than parked where no collective will ever reach it.
constexpr uint64_t kMaxCollectivesAhead = uint64_t{1} << 16;

}  // namespace

Job::Job(Options options)
    : options_(std::move(options)),
      path_(options_.data_path != nullptr
                ? options_.data_path
                : std::make_shared<HostDataPath>(options_.id, options_.timeout, options_.codec_pool)),
      group_(options_.id, options_.num_nodes, options_.coordinator),
      error_feedback_(options_.error_feedback_bytes, options_.arc_topk_momentum) {
  {
    absl::MutexLock lock(&mu_);
    config_ = options_.config;
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
      for (auto& [r, e] : slot->second.entries) {
        e->status = failed;
        e->done = true;
      }
      if (!slot->second.entries.empty()) {
        CountFailure(slot->second.entries.begin()->second->request.num_elements,
                     {CollectiveResult::kAborted, FaultKind::kAbort});
      }
      failures.emplace_back(slot->first, failed);
      next_run_ = std::max(next_run_, slot->first + 1);
      slot = slots_.erase(slot);
    }
    for (auto& [id, next] : next_submit_) next = std::max(next, next_run_);
    if (!failures.empty()) broken = group_.Decide(std::move(failures));
  }
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
      for (auto& [r, e] : it->second.entries) {
        e->status = absl::UnavailableError(stop_reason_);
        e->done = true;
      }
      if (!it->second.entries.empty()) {
        CountFailure(it->second.entries.begin()->second->request.num_elements,
                     {CollectiveResult::kAborted, FaultKind::kAbort});
      }
      // The entries live in their submitters' frames, which return now: drop the slot so nothing
      // (a second Stop) touches them afterwards.
      it = slots_.erase(it);
    }
  }
  group_.Report(failures);
  group_.Abort();  // a running collective fails promptly instead of at its timeout
  absl::MutexLock lock(&mu_);
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_submitters_ == 0; };
  mu_.Await(absl::Condition(&drained));
}

absl::StatusOr<Job::Result> Job::Submit(const Request& request) {
  auto reject = [this](absl::Status status) {
    if (options_.observer != nullptr) options_.observer->OnRejected(status.code());
    return status;
  };
  Entry entry;
  entry.request = request;
  uint64_t sequence;
  {
    absl::MutexLock lock(&mu_);
    auto w = workers_.find(request.worker_id);
    if (w == workers_.end()) {
      return reject(absl::FailedPreconditionError(
          absl::StrCat("worker ", request.worker_id, " is not registered with job ", options_.id)));
    }
    entry.local_rank = w->second;
    if (request.submission.has_value()) {
      // The worker's own numbering: asynchronous requests may arrive out of order.
      const uint64_t base = base_[request.worker_id];
      const uint64_t next = next_run_ - std::min(next_run_, base);  // the worker's submission that runs next
      if (*request.submission >= next + kMaxCollectivesAhead) {
        return reject(absl::InvalidArgumentError(absl::StrCat(
            "submission ", *request.submission, " of worker ", request.worker_id, " is too far ahead: job ",
            options_.id, " runs its collective ", next, " of this worker next and accepts at most ",
            kMaxCollectivesAhead, " ahead of it (number a worker's all-reduces 0, 1, 2, ... from its registration)")));
      }
      sequence = base + *request.submission;
      if (sequence < next_run_) {
        return reject(absl::InvalidArgumentError(absl::StrCat("submission ", *request.submission, " of worker ",
                                                              request.worker_id, " is out of order: its collective ",
                                                              sequence, " of job ", options_.id, " already ran")));
      }
    } else {
      sequence = next_submit_[request.worker_id];
      if (sequence >= next_run_ + kMaxCollectivesAhead) {
        return reject(absl::ResourceExhaustedError(
            absl::StrCat("worker ", request.worker_id, " has ", sequence - next_run_, " all-reduces of job ",
                         options_.id, " waiting; at most ", kMaxCollectivesAhead, " may be outstanding")));
      }
    }
    if (stopping_) return reject(absl::UnavailableError(stop_reason_));
    auto existing = slots_.find(sequence);
    if (existing != slots_.end() && existing->second.entries.count(entry.local_rank)) {
      return reject(absl::AlreadyExistsError(absl::StrCat("worker ", request.worker_id, " submitted collective ",
                                                          sequence, " twice (submission index reused)")));
    }
    next_submit_[request.worker_id] = std::max(next_submit_[request.worker_id], sequence + 1);
    slots_[sequence].entries[entry.local_rank] = &entry;
    ++active_submitters_;
    struct Leave {
      Job* job;
      ~Leave() ABSL_NO_THREAD_SAFETY_ANALYSIS { --job->active_submitters_; }
    } leave{this};
    // Wait for the reducer (which completes every entry of the slot) or the watchdog deadline.
    auto done = [&entry]() { return entry.done; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), options_.timeout)) {
      Slot& slot = slots_[sequence];
      if (slot.running) {
        // The reducer is using this entry; the engine's own timeout bounds how long that takes.
        mu_.Await(absl::Condition(&done));
      } else {
        const std::string missing = MissingRanks(slot);  // the local workers that never submitted
        // Every local rank submitted: it waited behind an earlier collective that never ran.
        const std::string why = missing.empty()
                                    ? absl::StrCat("every local rank submitted it, but it waited behind collective ",
                                                   next_run_, ", which has not run")
                                    : absl::StrCat("local ranks that did not submit: ", missing);
        // The collective can no longer complete here: fail it for every local worker and let the
        // job continue after it (other nodes see the failure as a timeout of the same collective).
        const absl::Status failed = absl::DeadlineExceededError(
            absl::StrCat("collective ", sequence, " of job ", options_.id, " timed out after ",
                         absl::FormatDuration(options_.timeout), " (dynamiqd --timeout); ", why));
        for (auto& [r, e] : slot.entries) {
          e->status = failed;
          e->done = true;
        }
        // The flight recorder keeps it like a collective that ran and failed.
        CollectiveRecord record;
        record.sequence = sequence;
        record.tensor_name = request.tensor_name;
        record.num_elements = request.num_elements;
        record.config = config_;
        record.config_epoch = config_epoch_;
        record.state = "failed";
        record.error = std::string(failed.message());
        record.start = absl::Now() - options_.timeout;
        record.seconds = absl::ToDoubleSeconds(options_.timeout);
        Record(std::move(record));
        slots_.erase(sequence);
        if (sequence == next_run_) ++next_run_;
        CountFailure(request.num_elements, {CollectiveResult::kTimeout, FaultKind::kTimeout});
        const CrossNodeGroup::Break broken = group_.Decide({{sequence, failed}});
        // Not under mu_: announcing talks to the coordinator. This handler still counts as active,
        // so Stop and Close wait for it.
        mu_.Unlock();
        group_.Announce(broken);
        mu_.Lock();
        return failed;
      }
    }
  }
  if (!entry.status.ok()) return entry.status;
  return entry.result;
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

void Job::Record(CollectiveRecord record) {
  // Errors may carry a peer's words: stored (and served as protobuf strings) only as safe text.
  record.error = common::SafeText(record.error);
  records_.push_back(std::move(record));
  while (records_.size() > options_.flight_recorder_size) records_.pop_front();
}

std::string Job::MissingRanks(const Slot& slot) const {
  std::vector<std::string> missing;
  for (uint32_t r = 0; r < options_.local_world_size; ++r) {
    if (slot.entries.count(r)) continue;
    std::string who = "not registered";
    for (const auto& [id, rank] : workers_) {
      if (rank != r) continue;
      auto pid = pids_.find(id);
      who = pid != pids_.end() ? absl::StrCat("worker ", id, ", pid ", pid->second) : absl::StrCat("worker ", id);
    }
    missing.push_back(absl::StrCat(r, " (", who, ")"));
  }
  return absl::StrJoin(missing, ", ");
}

absl::Status Job::WithRemoteCause(uint64_t sequence, absl::Status error) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return error;  // this node's own doing: nothing to look up
  }
  return group_.WithRemoteCause(sequence, std::move(error));
}

void Job::ReducerLoop() {
  while (true) {
    uint64_t sequence;
    Slot* slot;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stopping_) return true;
        auto it = slots_.find(next_run_);
        return it != slots_.end() && it->second.entries.size() == options_.local_world_size;
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      sequence = next_run_;
      slot = &slots_[sequence];
      slot->running = true;
    }
    RunCollective(sequence, *slot);
  }
}

void Job::RunCollective(uint64_t sequence, Slot& slot) {
  // --timeout bounds the whole collective from here, the coordinator poll below included.
  deadline_ = absl::Now() + options_.timeout;
  // The entries are stable while the slot is complete: their submitters wait for `done`.
  std::vector<Entry*> entries;
  for (auto& [rank, e] : slot.entries) entries.push_back(e);
  // Adopt a published configuration change whose boundary is this collective (the poll talks to
  // the coordinator, so it runs without holding the lock).
  JobConfig config;
  uint64_t epoch;
  {
    absl::MutexLock lock(&mu_);
    config = config_;
    epoch = config_epoch_;
  }
  if (options_.coordinator != nullptr) {
    uint64_t new_epoch = epoch;
    JobConfig new_config;
    absl::StatusOr<bool> changed = options_.coordinator->PollConfig(sequence, &new_epoch, &new_config);
    if (changed.ok() && *changed && new_epoch > epoch) {
      absl::MutexLock lock(&mu_);
      config_epoch_ = epoch = new_epoch;
      config_ = config = new_config;
    }
  }
  CollectiveRecord record;
  record.sequence = sequence;
  record.tensor_name = entries[0]->request.tensor_name;
  record.num_elements = entries[0]->request.num_elements;
  record.config = config;
  record.config_epoch = epoch;
  record.start = absl::Now();

  absl::Status status;
  // Every local worker must submit the same collective.
  for (Entry* e : entries) {
    const Request& a = entries[0]->request;
    const Request& b = e->request;
    if (a.tensor_name != b.tensor_name || a.num_elements != b.num_elements || a.dtype != b.dtype) {
      status = absl::InvalidArgumentError(absl::StrFormat(
          "collective %d of job %s: local rank %d submitted '%s' (%d x %s), local rank %d submitted '%s' (%d x %s)",
          sequence, options_.id, entries[0]->local_rank, a.tensor_name, a.num_elements, kernels::DTypeName(a.dtype),
          e->local_rank, b.tensor_name, b.num_elements, kernels::DTypeName(b.dtype)));
      break;
    }
  }
  const size_t n = entries[0]->request.num_elements;
  const std::string name = absl::StrCat("collective ", sequence, " of job ", options_.id);
  // The three steps of the data path: local reduce, across nodes, write-back.
  std::vector<DataPath::Region> inputs;
  std::vector<DataPath::Output> outputs;
  for (const Entry* e : entries) {
    const DataPath::Region region{e->request.region.data(), e->request.dtype, e->request.device_memory};
    inputs.push_back(region);
    outputs.push_back(DataPath::Output{region, e->request.average});
  }
  if (status.ok()) {
    status = path_->LocalReduce(inputs, n);
    if (!status.ok()) {
      status = absl::Status(
          status.code(),
          absl::StrCat(name, path_->on_device() ? ": local reduce on the device: " : ": ", status.message()));
    }
  }
  // The local workers disagree, or the local reduce failed: this node skips the cross-node step.
  if (!status.ok()) group_.Announce(group_.Decide({{sequence, status}}));
  DataPath::CrossNodeResult cross;
  // One budget per step: this bucket's share of the job's b̄ (0: the job's own).
  const kernels::CodecConfig codec = EffectiveCodec(config, n);
  const std::string bucket = absl::StrCat(entries[0]->request.tensor_name, "/", n);
  const bool plan = options_.step_budget && options_.num_nodes > 1;
  if (plan && epoch != planner_epoch_) {
    planner_.Reset();
    planner_epoch_ = epoch;
  }
  const double bits = plan ? planner_.BitsFor(bucket, codec) : 0;
  if (status.ok() && options_.num_nodes > 1) {
    absl::StatusOr<DataPath::CrossNodeResult> r =
        CrossNode(sequence, config, epoch, entries[0]->request.tensor_name, entries[0]->request.dtype, n, bits);
    if (r.ok()) {
      cross = *std::move(r);
    } else {
      status = WithRemoteCause(sequence, r.status());
    }
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
    const float scale = 1.0f / static_cast<float>(options_.num_nodes * options_.local_world_size);
    status = path_->WriteBack(outputs, n, scale);
    if (!status.ok()) {
      status = absl::Status(status.code(),
                            absl::StrCat(name, path_->on_device() ? ": writing the result back on the device: " : ": ",
                                         status.message()));
    }
  }
  const uint64_t wire_bytes = cross.bytes_sent;
  record.seconds = absl::ToDoubleSeconds(absl::Now() - record.start);
  record.wire_bytes = wire_bytes;
  record.state = status.ok() ? "ok" : "failed";
  record.error = std::string(status.message());
  if (status.ok() && !cross.probe_status.ok()) {
    record.error = absl::StrCat("error probe: ", cross.probe_status.message());
  }
  // Metrics count the collective, not the measurement on the side.
  const double seconds = std::max(0.0, record.seconds - cross.probe_seconds);
  // Advance the job in the same critical section that releases the submitters: once any worker
  // sees its result, NextSequence() (which SetCompression's boundary is computed from) is current.
  absl::MutexLock lock(&mu_);
  for (Entry* e : entries) {
    e->status = status;
    e->result = Result{sequence, epoch, config, wire_bytes, cross.vnmse};
    e->done = true;
  }
  Record(std::move(record));
  slots_.erase(sequence);
  next_run_ = std::max(next_run_, sequence + 1);  // RemoveWorker may have skipped ahead meanwhile
  if (!status.ok()) {
    CountFailure(n, ClassifyFailure(status, stopping_));
    return;
  }
  ++completed_;
  CollectiveOutcome outcome;
  outcome.codec = EffectiveCodec(config, n);
  outcome.topology = cross.topology;  // the schedule that ran (what topology=auto resolved to)
  outcome.num_elements = n;
  outcome.seconds = seconds;
  outcome.wire_bytes = wire_bytes;
  totals_.payload_bytes += n * sizeof(float);
  totals_.bus_bytes += BusBytes(n * sizeof(float), options_.num_nodes);
  totals_.wire_bytes += wire_bytes;
  totals_.duration_seconds += seconds;
  if (cross.vnmse.has_value()) {
    ++totals_.error_samples;
    totals_.last_vnmse = *cross.vnmse;
  }
  if (options_.observer != nullptr) {
    options_.observer->OnCollective(options_.id, outcome);
    if (cross.vnmse.has_value()) {
      options_.observer->OnErrorSample(options_.id, SampledError{config, epoch, outcome.codec, *cross.vnmse});
    }
  }
}

kernels::CodecConfig Job::EffectiveCodec(const JobConfig& config, uint64_t num_elements) {
  return num_elements < config.min_compress_elements ? kernels::CodecConfig{kernels::CodecId::kNone} : config.codec;
}

void Job::CountFailure(uint64_t num_elements, Classification how) {
  ++totals_.failed;
  if (options_.observer == nullptr) return;
  CollectiveOutcome outcome;
  outcome.result = how.result;
  outcome.fault = how.fault;
  outcome.codec = EffectiveCodec(config_, num_elements);
  outcome.topology = config_.topology;
  outcome.num_elements = num_elements;
  options_.observer->OnCollective(options_.id, outcome);
}

absl::StatusOr<DataPath::CrossNodeResult> Job::CrossNode(uint64_t sequence, const JobConfig& config, uint64_t epoch,
                                                         absl::string_view tensor_name, kernels::DType dtype, size_t n,
                                                         double bits) {
  DQ_ASSIGN_OR_RETURN(engine::Transport * transport, group_.Connected(sequence));
  DQ_ASSIGN_OR_RETURN(kernels::Codec * codec, codecs_.Get(EffectiveCodec(config, n)));
  engine::AllReduceOptions o;
  o.topology = config.topology;
  o.job_id = CollectiveId(options_.id, options_.incarnation, tensor_name, n, dtype);
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
    return absl::Status(result.status().code(), absl::StrCat("collective ", sequence, " of job ", options_.id, ": ",
                                                             result.status().message(), hint));
  }
  if (result->regroup) group_.Drop(/*abort=*/false);  // the measurement on the side broke the group
  return result;
}

}  // namespace dynamiq::server

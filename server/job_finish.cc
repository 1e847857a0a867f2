// Job's bookkeeping of a finished collective (server/job.h): its workers' results, the flight
// recorder, the counters behind GetStatus and the metrics, and how a failure is classified.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/job.h"

namespace dynamiq::server {

void Job::Finish(uint64_t sequence, const absl::Status& status, const Result& result, CollectiveRecord record,
                 const DataPath::CrossNodeResult& cross, double seconds, const StragglerWait& waits, uint32_t nodes,
                 Completions& completions) {
  if (status.ok()) {
    TakeSlot(slots_[sequence], result, completions);
  } else {
    TakeSlot(slots_[sequence], status, completions);
  }
  const JobConfig& config = result.config;
  const uint64_t n = record.num_elements, wire_bytes = result.wire_bytes;
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
  outcome.nodes = nodes;
  totals_.payload_bytes += n * sizeof(float);
  totals_.bus_bytes += BusBytes(n * sizeof(float), nodes);
  totals_.wire_bytes += wire_bytes;
  totals_.duration_seconds += seconds;
  if (cross.vnmse.has_value()) {
    ++totals_.error_samples;
    totals_.last_vnmse = *cross.vnmse;
  }
  if (waits.local_rank.has_value()) totals_.local_wait_seconds[*waits.local_rank] += waits.local_seconds;
  if (waits.node.has_value()) totals_.node_wait_seconds[*waits.node] += waits.node_seconds;
  if (options_.observer != nullptr) {
    options_.observer->OnCollective(options_.id, outcome);
    if (cross.vnmse.has_value()) {
      options_.observer->OnErrorSample(options_.id,
                                       SampledError{config, result.config_epoch, outcome.codec, *cross.vnmse});
    }
    if (waits.local_rank.has_value() || waits.node.has_value()) options_.observer->OnStragglerWait(options_.id, waits);
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

}  // namespace dynamiq::server

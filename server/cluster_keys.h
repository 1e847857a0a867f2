// Where a Cluster keeps a job's records in the coordinator's store: the key helpers that
// server/cluster.cc (membership, incarnations) and server/cluster_job_records.cc (configuration
// epochs, failure reports, group views) share. Internal to Cluster.
#ifndef DQ_SERVER_CLUSTER_KEYS_H_
#define DQ_SERVER_CLUSTER_KEYS_H_

#include <stdint.h>

#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "engine/store.h"

namespace dynamiq::server::internal {

// Everything of a job lies under this prefix: the id escaped, so that no job's prefix holds another's
// keys (job "a" and job "a/inc1").
std::string JobPrefix(const std::string& job_id);

// Where incarnation `incarnation` of a job keeps its keys.
std::string JobKey(const std::string& job_id, uint64_t incarnation);

// Reads a counter key for a compare-and-set: its value (0 when unset) and the text to expect.
absl::StatusOr<std::pair<uint64_t, std::optional<std::string>>> ReadCounter(engine::Store& store,
                                                                            const std::string& key);

}  // namespace dynamiq::server::internal

#endif  // DQ_SERVER_CLUSTER_KEYS_H_

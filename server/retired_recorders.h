// RetiredRecorders: the flight recorders of the jobs a daemon retired most recently, so an operator
// can still read what a job's last collectives did after its workers left (dynamiqctl
// flight-recorder). Keeps the last `capacity` jobs; a job retired again replaces its entry.
// Thread-safe.
#ifndef DQ_SERVER_RETIRED_RECORDERS_H_
#define DQ_SERVER_RETIRED_RECORDERS_H_

#include <stddef.h>

#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/job.h"

namespace dynamiq::server {

class RetiredRecorders {
 public:
  explicit RetiredRecorders(size_t capacity = 8) : capacity_(capacity) {}

  void Keep(const std::string& job_id, std::vector<CollectiveRecord> records);
  // The job's last `limit` records (0: all) if it is kept.
  std::optional<std::vector<CollectiveRecord>> Find(const std::string& job_id, size_t limit) const;
  // The kept jobs, most recently retired first.
  std::vector<std::string> Jobs() const;

 private:
  struct Retired {
    std::string job_id;
    std::vector<CollectiveRecord> records;
  };
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<Retired> retired_ ABSL_GUARDED_BY(mu_);  // newest last
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_RETIRED_RECORDERS_H_

#include "server/retired_recorders.h"

#include <algorithm>
#include <utility>

namespace dynamiq::server {

void RetiredRecorders::Keep(const std::string& job_id, std::vector<CollectiveRecord> records) {
  absl::MutexLock lock(&mu_);
  std::erase_if(retired_, [&](const Retired& r) { return r.job_id == job_id; });
  retired_.push_back(Retired{job_id, std::move(records)});
  while (retired_.size() > capacity_) retired_.pop_front();
}

std::optional<std::vector<CollectiveRecord>> RetiredRecorders::Find(const std::string& job_id, size_t limit) const {
  absl::MutexLock lock(&mu_);
  for (const Retired& r : retired_) {
    if (r.job_id != job_id) continue;
    const size_t n = limit == 0 ? r.records.size() : std::min(limit, r.records.size());
    return std::vector<CollectiveRecord>(r.records.end() - static_cast<ptrdiff_t>(n), r.records.end());
  }
  return std::nullopt;
}

std::vector<std::string> RetiredRecorders::Jobs() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (auto r = retired_.rbegin(); r != retired_.rend(); ++r) ids.push_back(r->job_id);
  return ids;
}

}  // namespace dynamiq::server

#include "server/worker_rings.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dynamiq::server {
namespace {

// How long a ring's thread sleeps at most before it looks again (Stop wakes it at once).
constexpr absl::Duration kWaitSlice = absl::Seconds(1);

}  // namespace

WorkerRings::WorkerRings(Submit submit, Reject reject) : submit_(std::move(submit)), reject_(std::move(reject)) {}

WorkerRings::~WorkerRings() { CloseAll(absl::UnavailableError("dynamiqd is shutting down")); }

absl::Status WorkerRings::Start(uint64_t worker_id, std::unique_ptr<ipc::SubmissionRingServer> ring) {
  absl::MutexLock lock(&mu_);
  if (served_.count(worker_id)) {
    return absl::AlreadyExistsError(absl::StrCat("worker ", worker_id, " has a submission ring already"));
  }
  Served& s = served_[worker_id];
  s.ring = std::move(ring);
  s.thread = std::thread([this, worker_id, ring = s.ring] { Serve(worker_id, ring); });
  return absl::OkStatus();
}

void WorkerRings::Serve(uint64_t worker_id, std::shared_ptr<ipc::SubmissionRingServer> ring) {
  const std::string who = absl::StrCat("worker ", worker_id, " (submission ring)");
  while (true) {
    absl::StatusOr<std::vector<ipc::SubmissionRingServer::Submission>> got = ring->Wait(kWaitSlice);
    if (!got.ok()) {
      reject_(got.status(), who);
      return;
    }
    if (got->empty()) {
      if (ring->stopping()) return;
      continue;
    }
    for (ipc::SubmissionRingServer::Submission& s : *got) {
      if (!s.bad.ok()) {
        reject_(s.bad, who);
        ipc::ring::RingCompletion refused;
        refused.status = s.bad;
        ring->Complete(s.slot, refused);
        continue;
      }
      // The answer holds the ring: it may come after the worker's ring was closed.
      submit_(worker_id, s.request,
              [ring, slot = s.slot](const ipc::ring::RingCompletion& c) { ring->Complete(slot, c); });
    }
  }
}

void WorkerRings::Stop(Served& served, const absl::Status& why) {
  served.ring->Stop();
  if (served.thread.joinable()) served.thread.join();
  served.ring->Close(why);
}

void WorkerRings::Close(uint64_t worker_id, const absl::Status& why) {
  Served served;
  {
    absl::MutexLock lock(&mu_);
    auto it = served_.find(worker_id);
    if (it == served_.end()) return;
    served = std::move(it->second);
    served_.erase(it);
  }
  Stop(served, why);
}

void WorkerRings::CloseAll(const absl::Status& why) {
  std::map<uint64_t, Served> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(served_);
  }
  for (auto& [id, served] : all) Stop(served, why);
}

size_t WorkerRings::size() const {
  absl::MutexLock lock(&mu_);
  return served_.size();
}

}  // namespace dynamiq::server

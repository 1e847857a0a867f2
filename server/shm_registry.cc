#include "server/shm_registry.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dynamiq::server {
namespace {

// True if `bytes` more fit under `limit` when `used` are taken (no overflow).

absl::Status UnknownBuffer(uint64_t worker_id, uint64_t buffer_id) {
  return absl::NotFoundError(
      absl::StrCat("shared-memory buffer ", buffer_id, " is not allocated to worker ", worker_id));
}

}  // namespace

ShmRegistry::ShmRegistry(Options options) : options_(options) {}

ShmRegistry::~ShmRegistry() = default;

absl::StatusOr<ShmBufferInfo> ShmRegistry::Allocate(uint64_t worker_id, size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", worker_id, " asked for a 0-byte shared-memory buffer"));
  }
  if (bytes > kMaxShmRegionBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("worker %d asked for a %d-byte shared-memory buffer; the limit per buffer is %d bytes",
                        worker_id, bytes, kMaxShmRegionBytes));
  }

  // 1. Admit the request against the limits and reserve its bytes.
  uint64_t buffer_id;
  uint64_t generation;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = workers_.try_emplace(worker_id);
    WorkerState& worker = it->second;
    if (inserted) worker.generation = next_generation_++;
    const absl::Status refused = AdmitBuffer(
        options_, "shared-memory", "shared memory", worker_id, bytes, worker.buffers.size() + worker.reserved_buffers,
        worker.mapped_bytes + worker.reserved_bytes, mapped_total_ + reserved_total_);
    if (!refused.ok()) {
      if (inserted) workers_.erase(it);
      return refused;
    }
    worker.reserved_bytes += bytes;
    ++worker.reserved_buffers;
    reserved_total_ += bytes;
    buffer_id = next_buffer_id_++;
    generation = worker.generation;
  }

  // 2. Create the region without holding the lock (posix_fallocate touches every page).
  absl::StatusOr<ShmRegion> region = ShmRegion::Create(bytes, absl::StrCat("w", worker_id, "_b", buffer_id));

  // 3. Return the reservation; keep the region if the worker is still the one we admitted.
  //    A region we do not keep is destroyed (munmap + unlink) after the lock is released.
  ShmRegion discard;
  absl::StatusOr<ShmBufferInfo> result;
  {
    absl::MutexLock lock(&mu_);
    reserved_total_ -= bytes;
    auto it = workers_.find(worker_id);
    const bool same_worker = it != workers_.end() && it->second.generation == generation;
    if (same_worker) {
      WorkerState& worker = it->second;
      worker.reserved_bytes -= bytes;
      --worker.reserved_buffers;
      if (region.ok()) {
        result = ShmBufferInfo{buffer_id, region->name(), region->size()};
        worker.buffers.emplace(buffer_id, *std::move(region));
        worker.mapped_bytes += bytes;
        mapped_total_ += bytes;
        ++num_buffers_;
      } else {
        result = region.status();
        if (worker.buffers.empty() && worker.reserved_buffers == 0) workers_.erase(it);
      }
    } else {
      if (region.ok()) discard = *std::move(region);
      result = absl::AbortedError(absl::StrCat("worker ", worker_id, " was released while its shared-memory buffer ",
                                               buffer_id, " was being created"));
    }
  }
  return result;
}

absl::StatusOr<absl::Span<uint8_t>> ShmRegistry::Get(uint64_t worker_id, uint64_t buffer_id, size_t offset,
                                                     size_t length) const {
  absl::ReaderMutexLock lock(&mu_);
  auto worker = workers_.find(worker_id);
  if (worker == workers_.end()) return UnknownBuffer(worker_id, buffer_id);
  auto buffer = worker->second.buffers.find(buffer_id);
  if (buffer == worker->second.buffers.end()) return UnknownBuffer(worker_id, buffer_id);
  const ShmRegion& region = buffer->second;
  if (offset > region.size() || length > region.size() - offset) {
    return absl::OutOfRangeError(absl::StrFormat(
        "region at offset %d of length %d does not fit in shared-memory buffer %d of worker %d (%d bytes)", offset,
        length, buffer_id, worker_id, region.size()));
  }
  return absl::Span<uint8_t>(region.data() + offset, length);
}

absl::Status ShmRegistry::Unlink(uint64_t worker_id, uint64_t buffer_id) {
  absl::MutexLock lock(&mu_);
  auto worker = workers_.find(worker_id);
  if (worker == workers_.end()) return UnknownBuffer(worker_id, buffer_id);
  auto buffer = worker->second.buffers.find(buffer_id);
  if (buffer == worker->second.buffers.end()) return UnknownBuffer(worker_id, buffer_id);
  return buffer->second.Unlink();
}

absl::Status ShmRegistry::Release(uint64_t worker_id, uint64_t buffer_id) {
  ShmRegion released;  // Unmapped after the lock is released.
  absl::MutexLock lock(&mu_);
  auto worker = workers_.find(worker_id);
  if (worker == workers_.end()) return UnknownBuffer(worker_id, buffer_id);
  WorkerState& state = worker->second;
  auto buffer = state.buffers.find(buffer_id);
  if (buffer == state.buffers.end()) return UnknownBuffer(worker_id, buffer_id);
  released = std::move(buffer->second);
  state.buffers.erase(buffer);
  state.mapped_bytes -= released.size();
  mapped_total_ -= released.size();
  --num_buffers_;
  if (state.buffers.empty() && state.reserved_buffers == 0) workers_.erase(worker);
  return absl::OkStatus();
}

size_t ShmRegistry::ReleaseWorker(uint64_t worker_id) {
  absl::flat_hash_map<uint64_t, ShmRegion> released;  // Unmapped after the lock is released.
  {
    absl::MutexLock lock(&mu_);
    auto worker = workers_.find(worker_id);
    if (worker == workers_.end()) return 0;
    // Pending allocations stay counted in reserved_total_ until they finish; they then see a
    // missing (or newer) entry and discard their region.
    released = std::move(worker->second.buffers);
    mapped_total_ -= worker->second.mapped_bytes;
    num_buffers_ -= released.size();
    workers_.erase(worker);
  }
  return released.size();
}

size_t ShmRegistry::TotalMappedBytes() const {
  absl::ReaderMutexLock lock(&mu_);
  return mapped_total_;
}

size_t ShmRegistry::WorkerMappedBytes(uint64_t worker_id) const {
  absl::ReaderMutexLock lock(&mu_);
  auto worker = workers_.find(worker_id);
  return worker == workers_.end() ? 0 : worker->second.mapped_bytes;
}

size_t ShmRegistry::NumBuffers() const {
  absl::ReaderMutexLock lock(&mu_);
  return num_buffers_;
}

}  // namespace dynamiq::server

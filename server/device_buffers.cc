#include "server/device_buffers.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dynamiq::server {
namespace {

absl::Status UnknownBuffer(uint64_t worker_id, uint64_t buffer_id) {
  return absl::NotFoundError(absl::StrCat("device buffer ", buffer_id, " is not allocated to worker ", worker_id));
}

}  // namespace

DeviceBufferRegistry::DeviceBufferRegistry(std::unique_ptr<DeviceMemory> memory, Options options)
    : memory_(std::move(memory)), options_(options), uuid_(memory_->uuid()) {}

DeviceBufferRegistry::~DeviceBufferRegistry() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, worker] : workers_) {
    for (auto& [buffer_id, buffer] : worker.buffers) memory_->Free(buffer.data);
  }
  workers_.clear();
}

absl::StatusOr<DeviceBufferInfo> DeviceBufferRegistry::Allocate(uint64_t worker_id, size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", worker_id, " asked for a 0-byte device buffer"));
  }
  if (bytes > kMaxDeviceBufferBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("worker %d asked for a %d-byte device buffer; the limit per buffer is %d bytes", worker_id,
                        bytes, kMaxDeviceBufferBytes));
  }
  // 1. Admit the request against the limits and reserve its bytes.
  uint64_t buffer_id;
  uint64_t generation;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = workers_.try_emplace(worker_id);
    WorkerState& worker = it->second;
    if (inserted) worker.generation = next_generation_++;
    const absl::Status refused = AdmitBuffer(options_, "device", "device memory", worker_id, bytes,
                                             worker.buffers.size() + worker.reserved_buffers,
                                             worker.bytes + worker.reserved_bytes, total_ + reserved_total_);
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

  // 2. Allocate without holding the lock.
  absl::StatusOr<DeviceMemory::Allocation> allocation = memory_->Allocate(bytes);

  // 3. Return the reservation; keep the memory if the worker is still the one we admitted.
  void* discard = nullptr;
  absl::StatusOr<DeviceBufferInfo> result;
  {
    absl::MutexLock lock(&mu_);
    reserved_total_ -= bytes;
    auto it = workers_.find(worker_id);
    const bool same_worker = it != workers_.end() && it->second.generation == generation;
    if (same_worker) {
      WorkerState& worker = it->second;
      worker.reserved_bytes -= bytes;
      --worker.reserved_buffers;
      if (allocation.ok()) {
        result = DeviceBufferInfo{buffer_id, bytes, allocation->ipc_handle, memory_->device(), uuid_};
        worker.buffers.emplace(buffer_id, Buffer{allocation->data, bytes});
        worker.bytes += bytes;
        total_ += bytes;
        ++num_buffers_;
      } else {
        result = absl::Status(allocation.status().code(), absl::StrCat("device buffer of ", bytes, " bytes for worker ",
                                                                       worker_id, ": ", allocation.status().message()));
        if (worker.buffers.empty() && worker.reserved_buffers == 0) workers_.erase(it);
      }
    } else {
      if (allocation.ok()) discard = allocation->data;
      result = absl::AbortedError(absl::StrCat("worker ", worker_id, " was released while its device buffer ",
                                               buffer_id, " was being allocated"));
    }
  }
  if (discard != nullptr) memory_->Free(discard);
  return result;
}

absl::StatusOr<absl::Span<uint8_t>> DeviceBufferRegistry::Get(uint64_t worker_id, uint64_t buffer_id, size_t offset,
                                                              size_t length) const {
  absl::ReaderMutexLock lock(&mu_);
  auto worker = workers_.find(worker_id);
  if (worker == workers_.end()) return UnknownBuffer(worker_id, buffer_id);
  auto buffer = worker->second.buffers.find(buffer_id);
  if (buffer == worker->second.buffers.end()) return UnknownBuffer(worker_id, buffer_id);
  const Buffer& b = buffer->second;
  if (offset > b.size || length > b.size - offset) {
    return absl::OutOfRangeError(
        absl::StrFormat("region at offset %d of length %d does not fit in device buffer %d of worker %d (%d bytes)",
                        offset, length, buffer_id, worker_id, b.size));
  }
  return absl::Span<uint8_t>(static_cast<uint8_t*>(b.data) + offset, length);
}

absl::Status DeviceBufferRegistry::Find(uint64_t worker_id, uint64_t buffer_id) const {
  absl::ReaderMutexLock lock(&mu_);
  auto worker = workers_.find(worker_id);
  if (worker == workers_.end() || !worker->second.buffers.contains(buffer_id)) {
    return UnknownBuffer(worker_id, buffer_id);
  }
  return absl::OkStatus();
}

absl::Status DeviceBufferRegistry::Release(uint64_t worker_id, uint64_t buffer_id) {
  void* released = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto worker = workers_.find(worker_id);
    if (worker == workers_.end()) return UnknownBuffer(worker_id, buffer_id);
    WorkerState& state = worker->second;
    auto buffer = state.buffers.find(buffer_id);
    if (buffer == state.buffers.end()) return UnknownBuffer(worker_id, buffer_id);
    released = buffer->second.data;
    state.bytes -= buffer->second.size;
    total_ -= buffer->second.size;
    --num_buffers_;
    state.buffers.erase(buffer);
    if (state.buffers.empty() && state.reserved_buffers == 0) workers_.erase(worker);
  }
  memory_->Free(released);
  return absl::OkStatus();
}

size_t DeviceBufferRegistry::ReleaseWorker(uint64_t worker_id) {
  std::vector<void*> released;
  {
    absl::MutexLock lock(&mu_);
    auto worker = workers_.find(worker_id);
    if (worker == workers_.end()) return 0;
    // Pending allocations stay counted in reserved_total_ until they finish; they then see a
    // missing (or newer) entry and free their memory.
    for (const auto& [id, buffer] : worker->second.buffers) released.push_back(buffer.data);
    total_ -= worker->second.bytes;
    num_buffers_ -= released.size();
    workers_.erase(worker);
  }
  for (void* data : released) memory_->Free(data);
  return released.size();
}

size_t DeviceBufferRegistry::TotalBytes() const {
  absl::ReaderMutexLock lock(&mu_);
  return total_;
}

size_t DeviceBufferRegistry::NumBuffers() const {
  absl::ReaderMutexLock lock(&mu_);
  return num_buffers_;
}

}  // namespace dynamiq::server

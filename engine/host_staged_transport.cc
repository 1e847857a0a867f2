#include "engine/host_staged_transport.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda_check.h"
#include "common/status_macros.h"

namespace dynamiq::engine {

using ::dynamiq::common::ScopedDevice;

absl::StatusOr<std::unique_ptr<HostStagedTransport>> HostStagedTransport::Create(std::unique_ptr<Transport> inner,
                                                                                 int device) {
  ScopedDevice scoped(device);
  if (!scoped.ok()) return absl::FailedPreconditionError(absl::StrCat("cannot make CUDA device ", device, " current"));
  cudaStream_t stream = nullptr;
  DQ_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return std::unique_ptr<HostStagedTransport>(new HostStagedTransport(std::move(inner), device, stream));
}

HostStagedTransport::HostStagedTransport(std::unique_ptr<Transport> inner, int device, CUstream_st* stream)
    : inner_(std::move(inner)), device_(device), stream_(stream) {}

HostStagedTransport::~HostStagedTransport() {
  // Operations still posted belong to a failed collective: abort the inner transport before the
  // pinned buffers it may still write into are freed.
  if (!ops_.empty()) inner_->Abort();
  ScopedDevice scoped(device_);
  for (auto& [handle, op] : ops_) Give(op.staging);
  for (const Pinned& p : pool_) (void)cudaFreeHost(p.data);
  (void)cudaStreamDestroy(stream_);
}

absl::StatusOr<HostStagedTransport::Pinned> HostStagedTransport::Take(size_t bytes) {
  // The smallest free buffer that fits.
  auto best = pool_.end();
  for (auto it = pool_.begin(); it != pool_.end(); ++it) {
    if (it->capacity >= bytes && (best == pool_.end() || it->capacity < best->capacity)) best = it;
  }
  if (best != pool_.end()) {
    const Pinned p = *best;
    pool_.erase(best);
    return p;
  }
  Pinned p;
  p.capacity = std::max<size_t>(bytes, 4096);
  void* data = nullptr;
  DQ_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&data, p.capacity, cudaHostAllocDefault));
  p.data = static_cast<uint8_t*>(data);
  return p;
}

absl::StatusOr<Transport::Handle> HostStagedTransport::PostSend(int peer, uint64_t tag,
                                                                absl::Span<const uint8_t> data) {
  ScopedDevice scoped(device_);
  DQ_ASSIGN_OR_RETURN(Pinned staging, Take(data.size()));
  absl::Status copied = [&]() -> absl::Status {
    if (data.empty()) return absl::OkStatus();
    DQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.data, data.data(), data.size(), cudaMemcpyDeviceToHost, stream_));
    DQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }();
  if (!copied.ok()) {
    Give(staging);
    return copied;
  }
  absl::StatusOr<Handle> inner = inner_->PostSend(peer, tag, absl::MakeConstSpan(staging.data, data.size()));
  if (!inner.ok()) {
    Give(staging);
    return inner.status();
  }
  const Handle handle = next_handle_++;
  ops_[handle] = Op{*inner, staging, {}};
  return handle;
}

absl::StatusOr<Transport::Handle> HostStagedTransport::PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) {
  DQ_ASSIGN_OR_RETURN(Pinned staging, Take(buffer.size()));
  absl::StatusOr<Handle> inner = inner_->PostRecv(peer, tag, absl::MakeSpan(staging.data, buffer.size()));
  if (!inner.ok()) {
    Give(staging);
    return inner.status();
  }
  const Handle handle = next_handle_++;
  ops_[handle] = Op{*inner, staging, buffer};
  return handle;
}

absl::Status HostStagedTransport::Wait(Handle handle, absl::Time deadline) {
  auto it = ops_.find(handle);
  if (it == ops_.end()) return absl::InvalidArgumentError(absl::StrCat("unknown transport handle ", handle));
  // Once the inner operation is done (or failed) nothing writes into the staging buffer any more.
  absl::Status status = inner_->Wait(it->second.inner, deadline);
  const Op op = it->second;
  ops_.erase(it);
  if (status.ok() && !op.device_target.empty()) {
    ScopedDevice scoped(device_);
    status = [&]() -> absl::Status {
      DQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(op.device_target.data(), op.staging.data, op.device_target.size(),
                                              cudaMemcpyHostToDevice, stream_));
      DQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      return absl::OkStatus();
    }();
  }
  Give(op.staging);
  return status;
}

}  // namespace dynamiq::engine

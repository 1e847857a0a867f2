#include "server/cuda_device.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda_check.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/host_staged_transport.h"
#include "engine/nccl_allreduce.h"
#include "engine/nccl_transport.h"
#include "kernels/cuda/reduce_kernels.h"

namespace dynamiq::server {
namespace {

using kernels::AccumulateCuda;
using kernels::StoreSumCuda;

using common::ScopedDevice;

// Devices DeviceCollectiveMutex distinguishes (more than any node has).
constexpr int kMaxCudaDevices = 64;

// Held by a job's NCCL all-reduce on `device` for its whole duration, and by every allocation and
// free of workers' device buffers on it. cudaMalloc and cudaFree may wait for the device to go
// idle; in the middle of an NCCL collective that can mean waiting for a kernel that waits for a
// peer node, which may in turn wait for this node's next NCCL launch, blocked behind the free: a
// hang. With the lock, buffers are allocated and freed between collectives. (Multi-node NCCL
// clusters run one job at a time, CheckAnotherJob, so the lock never orders two jobs' collectives;
// the hybrid path's collectives never wait on peers inside a kernel and do not take it.)
absl::Mutex& DeviceCollectiveMutex(int device) {
  static absl::Mutex mutexes[kMaxCudaDevices];
  return mutexes[device >= 0 && device < kMaxCudaDevices ? device : 0];
}

absl::Status MakeCurrent(const ScopedDevice& scoped, int device) {
  if (scoped.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("cannot make CUDA device ", device, " current"));
}

// A kernel launcher's cudaError_t value as a status.
class CudaDeviceMemory final : public ipc::DeviceMemory {
 public:
  CudaDeviceMemory(int device, std::string uuid) : device_(device), uuid_(std::move(uuid)) {}

  absl::StatusOr<Allocation> Allocate(size_t bytes) override {
    absl::MutexLock between_collectives(&DeviceCollectiveMutex(device_));
    ScopedDevice scoped(device_);
    DQ_RETURN_IF_ERROR(MakeCurrent(scoped, device_));
    void* data = nullptr;
    const cudaError_t error = cudaMalloc(&data, bytes);
    if (error == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("CUDA device ", device_, " has no ", bytes, " bytes free (cudaMalloc: out of memory)"));
    }
    DQ_CUDA_RETURN_IF_ERROR(error);
    // Zeroed: the memory may have held another worker's data. A memset is asynchronous to the host;
    // wait for it (on a stream of its own, not the whole device, where collectives run) before the
    // worker gets the handle, so its first writes cannot land before the zeros.
    absl::Status status = [&]() -> absl::Status {
      cudaStream_t stream = nullptr;
      DQ_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      cudaError_t zeroed = cudaMemsetAsync(data, 0, bytes, stream);
      if (zeroed == cudaSuccess) zeroed = cudaStreamSynchronize(stream);
      (void)cudaStreamDestroy(stream);
      DQ_CUDA_RETURN_IF_ERROR(zeroed);
      return absl::OkStatus();
    }();
    cudaIpcMemHandle_t handle;
    if (status.ok()) {
      status = [&]() -> absl::Status {
        DQ_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, data));
        return absl::OkStatus();
      }();
    }
    if (!status.ok()) {
      (void)cudaFree(data);
      return status;
    }
    return Allocation{data, std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))};
  }

  void Free(void* data) override {
    if (data == nullptr) return;
    absl::MutexLock between_collectives(&DeviceCollectiveMutex(device_));
    ScopedDevice scoped(device_);
    const cudaError_t error = cudaFree(data);
    if (error != cudaSuccess) {
      common::Log("cudaFree of a device buffer on device %d failed: %s", device_, cudaGetErrorString(error));
    }
  }

  int device() const override { return device_; }
  std::string uuid() const override { return uuid_; }

 private:
  const int device_;
  const std::string uuid_;
};

// Device memory (of the device current when it is used) that grows to the largest size asked of
// it and is kept until Reset().
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer() { Reset(); }

  // Frees the memory (its device must be current).
  void Reset() {
    if (data_ != nullptr) (void)cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  // At least `bytes` of device memory; the old contents are not kept.
  absl::StatusOr<void*> Get(size_t bytes) {
    if (bytes <= bytes_) return data_;
    Reset();
    const cudaError_t error = cudaMalloc(&data_, bytes);
    if (error == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      data_ = nullptr;
      return absl::ResourceExhaustedError(absl::StrCat("no ", bytes, " bytes of device memory for the local sum"));
    }
    DQ_CUDA_RETURN_IF_ERROR(error);
    bytes_ = bytes;
    return data_;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class CudaDataPath final : public DataPath {
 public:
  CudaDataPath(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaDataPath() override {
    ScopedDevice scoped(device_);
    (void)cudaStreamSynchronize(stream_);
    sum_.Reset();
    staging_.Reset();
    workspace_.reset();  // its memory is this device's
    (void)cudaStreamDestroy(stream_);
  }

  absl::Status LocalReduce(absl::Span<const Region> inputs, size_t n) override {
    ScopedDevice scoped(device_);
    DQ_RETURN_IF_ERROR(MakeCurrent(scoped, device_));
    DQ_ASSIGN_OR_RETURN(void* sum, sum_.Get(n * sizeof(float)));
    sum_data_ = static_cast<float*>(sum);
    for (const Region& in : inputs) {
      if (in.weight != 1.0f) {
        sum_data_ = nullptr;
        return absl::UnimplementedError(
            "weighted all-reduces are not supported on GPU nodes yet (every weight must be 1); CPU nodes support them");
      }
    }
    for (size_t k = 0; k < inputs.size(); ++k) {
      const Region& in = inputs[k];
      const size_t element_bytes = kernels::DTypeSize(in.dtype);
      const void* source = in.data;
      if (!in.device) {
        DQ_ASSIGN_OR_RETURN(void* staged, staging_.Get(n * sizeof(float)));
        DQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staged, in.data, n * element_bytes, cudaMemcpyHostToDevice, stream_));
        source = staged;
      }
      DQ_CUDA_RETURN_IF_ERROR(
          AccumulateCuda(sum_data_, source, static_cast<int>(element_bytes), n, /*first=*/k == 0, stream_));
    }
    return absl::OkStatus();
  }

  bool on_device() const override { return true; }
  bool has_side_lane() const override { return false; }

  // No error probe on GPU nodes: error_sample_rate is not used.
  absl::StatusOr<CrossNodeResult> CrossNode(const kernels::Codec& codec, engine::Transport& transport,
                                            const engine::AllReduceOptions& options, size_t n,
                                            double /*error_sample_rate*/) override {
    // NCCL, or Gloo staged through pinned host memory (the hybrid path), on this device.
    auto* nccl = dynamic_cast<engine::NcclTransport*>(&transport);
    auto* staged = dynamic_cast<engine::HostStagedTransport*>(&transport);
    const int transport_device = nccl != nullptr ? nccl->device() : staged != nullptr ? staged->device() : -1;
    if (transport_device != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat("the device all-reduce needs an NCCL or staged transport on device ", device_, ", not a ",
                       transport.name(), " transport"));
    }
    if (sum_data_ == nullptr) return absl::FailedPreconditionError("CrossNode before LocalReduce");
    if (!options.side_sums.empty()) {
      return absl::UnimplementedError(
          "weighted all-reduces (a side lane of exact sums) are not supported on GPU nodes yet; CPU nodes support "
          "them");
    }
    std::optional<absl::MutexLock> no_allocation;
    if (nccl != nullptr) no_allocation.emplace(&DeviceCollectiveMutex(device_));
    // In place on the sum; the device all-reduce orders its work after the local reduce queued on stream_.
    DQ_ASSIGN_OR_RETURN(engine::AllReduceResult result,
                        engine::DeviceAllReduce(codec, transport, device_, options, sum_data_, sum_data_, n, stream_,
                                                workspace_.get()));
    CrossNodeResult out;
    out.bytes_sent = result.bytes_sent;
    out.topology = result.topology;
    return out;
  }

  absl::Status WriteBack(absl::Span<const Output> outputs, size_t n, float scale) override {
    ScopedDevice scoped(device_);
    DQ_RETURN_IF_ERROR(MakeCurrent(scoped, device_));
    if (sum_data_ == nullptr) return absl::FailedPreconditionError("WriteBack before LocalReduce");
    for (const Output& out : outputs) {
      const size_t element_bytes = kernels::DTypeSize(out.region.dtype);
      void* target = out.region.data;
      if (!out.region.device) {
        DQ_ASSIGN_OR_RETURN(target, staging_.Get(n * sizeof(float)));
      }
      DQ_CUDA_RETURN_IF_ERROR(
          StoreSumCuda(target, static_cast<int>(element_bytes), sum_data_, n, out.average, scale, stream_));
      if (!out.region.device) {
        DQ_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(out.region.data, target, n * element_bytes, cudaMemcpyDeviceToHost, stream_));
      }
    }
    // The workers read their buffers once their request completes: everything must have landed.
    DQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  const int device_;
  const cudaStream_t stream_;
  ScratchBuffer sum_;
  ScratchBuffer staging_;
  float* sum_data_ = nullptr;
  // The device all-reduce's buffers and events, kept across collectives (none allocated in a
  // steady stream of them).
  std::unique_ptr<engine::DeviceAllReduceWorkspace> workspace_ = std::make_unique<engine::DeviceAllReduceWorkspace>();
};

}  // namespace

absl::Status CheckCudaDevice(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("--device=cuda: no usable CUDA device (cudaGetDeviceCount: ", cudaGetErrorString(error),
                     "); run dynamiqd --device=cpu, or on a node with a GPU"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        "--device=cuda: no CUDA device is visible; run dynamiqd --device=cpu, or on a node with a GPU");
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat("--cuda_device=", device, " but ", count, " CUDA device",
                                                      count == 1 ? " is" : "s are", " visible (0..", count - 1, ")"));
  }
  int compute_mode = cudaComputeModeDefault;
  DQ_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&compute_mode, cudaDevAttrComputeMode, device));
  if (compute_mode != cudaComputeModeDefault) {
    // Workers' device buffers are this process's memory opened in theirs through CUDA IPC, and the
    // daemon and every worker hold a context on the GPU at once: only the DEFAULT mode allows that.
    return absl::FailedPreconditionError(absl::StrCat(
        "--device=cuda: CUDA device ", device, " is in compute mode ",
        compute_mode == cudaComputeModeExclusiveProcess ? "EXCLUSIVE_PROCESS"
        : compute_mode == cudaComputeModeProhibited     ? "PROHIBITED"
                                                        : absl::StrCat(compute_mode),
        ", but dynamiqd shares device buffers with its workers through CUDA IPC, which needs DEFAULT: set it with "
        "`nvidia-smi -i ",
        device, " -c DEFAULT`, or run --device=cpu"));
  }
  ScopedDevice scoped(device);
  DQ_RETURN_IF_ERROR(MakeCurrent(scoped, device));
  // Creates the context now, so a broken device fails at startup rather than at the first buffer.
  DQ_CUDA_RETURN_IF_ERROR(cudaFree(nullptr));
  return absl::OkStatus();
}

absl::StatusOr<std::string> CudaDeviceUuid(int device) {
  cudaDeviceProp properties;
  DQ_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, device));
  return std::string(properties.uuid.bytes, sizeof(properties.uuid.bytes));
}

absl::StatusOr<std::unique_ptr<ipc::DeviceMemory>> CreateCudaDeviceMemory(int device) {
  DQ_RETURN_IF_ERROR(CheckCudaDevice(device));
  DQ_ASSIGN_OR_RETURN(std::string uuid, CudaDeviceUuid(device));
  return std::unique_ptr<ipc::DeviceMemory>(std::make_unique<CudaDeviceMemory>(device, std::move(uuid)));
}

absl::StatusOr<std::unique_ptr<DataPath>> CreateCudaDataPath(int device) {
  ScopedDevice scoped(device);
  DQ_RETURN_IF_ERROR(MakeCurrent(scoped, device));
  cudaStream_t stream = nullptr;
  DQ_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return std::unique_ptr<DataPath>(std::make_unique<CudaDataPath>(device, stream));
}

}  // namespace dynamiq::server

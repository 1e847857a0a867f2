#include "client/cuda_ipc.h"

#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

#ifdef DQ_CLIENT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

namespace dynamiq::client::internal {

#ifdef DQ_CLIENT_HAVE_CUDA
namespace {

std::string CudaError(const char* call, cudaError_t error) {
  return absl::StrCat(call, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
}

// The ordinal (in this process) of the device with `uuid`.
absl::StatusOr<int> FindDevice(absl::string_view uuid, int device) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("dynamiqd handed out a CUDA device buffer but this process sees no CUDA device (",
                     CudaError("cudaGetDeviceCount", e), ")"));
  }
  if (uuid.empty()) {
    if (device < 0 || device >= count) {
      return absl::FailedPreconditionError(
          absl::StrCat("dynamiqd's CUDA device ", device, " is not visible here (", count, " devices)"));
    }
    return device;
  }
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp properties;
    if (cudaGetDeviceProperties(&properties, d) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    if (uuid.size() == sizeof(properties.uuid.bytes) &&
        std::memcmp(properties.uuid.bytes, uuid.data(), uuid.size()) == 0) {
      return d;
    }
  }
  return absl::FailedPreconditionError(absl::StrCat("dynamiqd's CUDA device (ordinal ", device, " in the daemon, UUID ",
                                                    absl::BytesToHexString(uuid), ") is not among the ", count,
                                                    " devices this process sees; check CUDA_VISIBLE_DEVICES"));
}

}  // namespace

bool CudaIpcSupported() { return true; }

absl::StatusOr<CudaIpcMapping> CudaIpcMapping::Open(absl::string_view handle, absl::string_view uuid, int device) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA IPC handle of ", handle.size(), " bytes (expected ", sizeof(h), ")"));
  }
  std::memcpy(&h, handle.data(), sizeof(h));
  absl::StatusOr<int> local = FindDevice(uuid, device);
  if (!local.ok()) return local.status();
  common::ScopedDevice current(*local);
  if (!current.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("cudaSetDevice(", *local,
                                                      ") failed: the worker cannot use the "
                                                      "CUDA device that holds dynamiqd's buffer"));
  }
  void* data = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&data, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot open dynamiqd's device buffer: ", CudaError("cudaIpcOpenMemHandle", e),
        " (a handle cannot be opened in the daemon's own process; the worker must run as a separate process "
        "on the same node)"));
  }
  return CudaIpcMapping(data, *local);
}

absl::Status CudaIpcMapping::Close() {
  if (data_ == nullptr) return absl::OkStatus();
  void* data = std::exchange(data_, nullptr);
  common::ScopedDevice current(device_);
  if (cudaError_t e = cudaIpcCloseMemHandle(data); e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(CudaError("cudaIpcCloseMemHandle", e));
  }
  return absl::OkStatus();
}

absl::Status CudaIpcMapping::WaitForWrites() const {
  if (data_ == nullptr) return absl::OkStatus();
  common::ScopedDevice current(device_);
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("waiting for this process's writes to a device buffer: ", CudaError("cudaDeviceSynchronize", e)));
  }
  return absl::OkStatus();
}

#else  // !DQ_CLIENT_HAVE_CUDA

bool CudaIpcSupported() { return false; }

absl::StatusOr<CudaIpcMapping> CudaIpcMapping::Open(absl::string_view, absl::string_view, int) {
  return absl::UnimplementedError(
      "this dynamiq_client was built without CUDA and cannot open device buffers; allocate MemoryKind::kHost, or "
      "rebuild with the CUDA toolkit");
}

absl::Status CudaIpcMapping::Close() {
  data_ = nullptr;
  return absl::OkStatus();
}

absl::Status CudaIpcMapping::WaitForWrites() const { return absl::OkStatus(); }

#endif  // DQ_CLIENT_HAVE_CUDA

CudaIpcMapping::CudaIpcMapping(CudaIpcMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), device_(std::exchange(other.device_, -1)) {}

CudaIpcMapping& CudaIpcMapping::operator=(CudaIpcMapping&& other) noexcept {
  if (this != &other) {
    (void)Close();
    data_ = std::exchange(other.data_, nullptr);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

CudaIpcMapping::~CudaIpcMapping() { (void)Close(); }

}  // namespace dynamiq::client::internal

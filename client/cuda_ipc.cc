#include "client/cuda_ipc.h"

#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

#ifdef DQ_CLIENT_HAVE_CUDA
#include <cuda_runtime_api.h>
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

// Makes `device` current and restores the previous device when destroyed.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    error_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
  }
  ~CurrentDevice() {
    if (previous_ >= 0 && error_ == cudaSuccess) (void)cudaSetDevice(previous_);
  }
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

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
  CurrentDevice current(*local);
  if (current.error() != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(CudaError("cudaSetDevice", current.error()));
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
  CurrentDevice current(device_);
  if (cudaError_t e = cudaIpcCloseMemHandle(data); e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InternalError(CudaError("cudaIpcCloseMemHandle", e));
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

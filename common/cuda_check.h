// DQ_CUDA_RETURN_IF_ERROR: the checker for CUDA runtime calls (one checker per error source, as
// NCCL's CUDACHECK), turning a failed call into an absl::Status that names the call, file:line and
// CUDA's own error name and text.
//
// Only for code that already includes the CUDA runtime (compiled by nvcc, or by g++ with
// CUDA::cudart's include directories); kernels/cuda/launch.h is the CUDA-free interface for the
// rest. Header-only; the caller links CUDA::cudart.
#ifndef DQ_COMMON_CUDA_CHECK_H_
#define DQ_COMMON_CUDA_CHECK_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dynamiq::common {

// The status for `error` returned by `expr` at file:line.
//   - No driver, no device, or an index past the last device: FAILED_PRECONDITION (the machine
//     cannot run this, retrying will not help).
//   - Anything else: INTERNAL.
inline absl::Status CudaErrorStatus(cudaError_t error, const char* expr, const char* file, int line) {
  std::string message = absl::StrCat(file, ":", line, ": ", expr, " failed: ", cudaGetErrorName(error), " (",
                                     cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(std::move(message));
    default:
      return absl::InternalError(std::move(message));
  }
}

// Makes `device` current for the calling thread and restores the previous device on exit, so
// code driven from threads that work on other devices leaves their device as it found it.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != device) {
      ok_ = cudaSetDevice(device) == cudaSuccess;
      if (!ok_) (void)cudaGetLastError();
    }
  }
  ~ScopedDevice() {
    if (previous_ >= 0 && ok_) (void)cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  // False if `device` could not be made current.
  bool ok() const { return ok_; }

 private:
  int previous_ = -1;
  bool ok_ = true;
};

}  // namespace dynamiq::common

// Returns from the enclosing function (which returns absl::Status or absl::StatusOr<T>) if `expr`
// does not return cudaSuccess: a CUDA runtime call, or a launcher of kernels/cuda that returns a
// cudaError_t as int. The error is also taken off the thread's last-error slot, so a later
// cudaGetLastError (a launch check) does not report it a second time. The one CUDA checker of
// dynamiq; NCCL's results have their own (engine/nccl_check.h).
#define DQ_CUDA_RETURN_IF_ERROR(expr)                                                       \
  do {                                                                                      \
    const cudaError_t dq_cuda_error_ = static_cast<cudaError_t>(expr);                      \
    if (dq_cuda_error_ != cudaSuccess) {                                                    \
      (void)cudaGetLastError();                                                             \
      return ::dynamiq::common::CudaErrorStatus(dq_cuda_error_, #expr, __FILE__, __LINE__); \
    }                                                                                       \
  } while (0)

#endif  // DQ_COMMON_CUDA_CHECK_H_

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

// The driver's cuCtxGetCurrent and cuCtxSetCurrent, looked up through the runtime (so nothing links
// libcuda); null where the driver does not provide them.
struct CudaContextCalls {
  int (*get_current)(void** context) = nullptr;
  int (*set_current)(void* context) = nullptr;
};
inline const CudaContextCalls& ContextCalls() {
  static const CudaContextCalls calls = [] {
    CudaContextCalls c;
    void* get = nullptr;
    void* set = nullptr;
    cudaDriverEntryPointQueryResult found_get, found_set;
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 12000, cudaEnableDefault, &found_get) ==
            cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 12000, cudaEnableDefault, &found_set) ==
            cudaSuccess &&
        found_get == cudaDriverEntryPointSuccess && found_set == cudaDriverEntryPointSuccess) {
      c.get_current = reinterpret_cast<int (*)(void**)>(get);
      c.set_current = reinterpret_cast<int (*)(void*)>(set);
    } else {
      (void)cudaGetLastError();
    }
    return c;
  }();
  return calls;
}

// Makes `device` current for the calling thread and, on exit, leaves the thread as it found it:
// back on its previous device, or without any current context when it had none. A thread that
// never chose a device reports device 0 from cudaGetDevice; switching "back" to it would create a
// context on GPU 0 (about 0.5 GB) in every process whose threads only ever use another GPU.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    const CudaContextCalls& calls = ContextCalls();
    void* context = nullptr;
    had_context_ = calls.get_current == nullptr || (calls.get_current(&context) == 0 && context != nullptr);
    if (had_context_ && cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    if (!had_context_ || previous_ != device) {
      ok_ = cudaSetDevice(device) == cudaSuccess;
      if (!ok_) (void)cudaGetLastError();
      changed_ = ok_;
    }
  }
  ~ScopedDevice() {
    if (!changed_) return;
    if (!had_context_) {
      (void)ContextCalls().set_current(nullptr);  // no context current, as before
    } else if (previous_ >= 0) {
      (void)cudaSetDevice(previous_);
    }
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  // False if `device` could not be made current.
  bool ok() const { return ok_; }

 private:
  bool had_context_ = true;
  int previous_ = -1;
  bool ok_ = true;
  bool changed_ = false;
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

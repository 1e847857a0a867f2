// CudaIpcMapping (internal, not installed): a device buffer of dynamiqd opened in this process with
// cudaIpcOpenMemHandle, closed (cudaIpcCloseMemHandle) when released or destroyed.
//
// The daemon names its device by UUID as well as by ordinal: ordinals depend on each process's
// CUDA_VISIBLE_DEVICES, so Open looks the UUID up among the devices this process sees.
//
// Built with the CUDA runtime only when dynamiq_client is built with CUDA (DQ_CLIENT_HAVE_CUDA);
// otherwise Open fails with UNIMPLEMENTED and there is nothing to close. This header includes no
// CUDA header.
//
// Thread-safety: a mapping is a value; Open may be called from any thread (it restores the
// calling thread's current device).
#ifndef DQ_CLIENT_CUDA_IPC_H_
#define DQ_CLIENT_CUDA_IPC_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dynamiq::client::internal {

// True if this build can open CUDA IPC handles.
bool CudaIpcSupported();

class CudaIpcMapping {
 public:
  // Opens `handle` (the bytes of a cudaIpcMemHandle_t) on the device whose 16-byte UUID is `uuid`;
  // an empty `uuid` means ordinal `device`. FAILED_PRECONDITION when no such device is visible
  // here or the handle cannot be opened (e.g. in the daemon's own process), INVALID_ARGUMENT for a
  // malformed handle, UNIMPLEMENTED without CUDA support.
  static absl::StatusOr<CudaIpcMapping> Open(absl::string_view handle, absl::string_view uuid, int device);

  CudaIpcMapping() = default;
  CudaIpcMapping(CudaIpcMapping&& other) noexcept;
  CudaIpcMapping& operator=(CudaIpcMapping&& other) noexcept;
  CudaIpcMapping(const CudaIpcMapping&) = delete;
  CudaIpcMapping& operator=(const CudaIpcMapping&) = delete;
  ~CudaIpcMapping();  // Close(), ignoring errors

  // Closes the mapping; idempotent.
  absl::Status Close();
  // Waits until every write this process issued on the mapping's device (any stream) has completed.
  // The daemon reads a device buffer as soon as the all-reduce request arrives, on its own stream,
  // and cannot order itself after a worker's kernels or copies; the client calls this before every
  // all-reduce of a device buffer. INTERNAL if the device reports an error.
  absl::Status WaitForWrites() const;
  // The device pointer in this process (nullptr when closed) and its device's ordinal here.
  void* data() const { return data_; }
  int device() const { return device_; }

 private:
  CudaIpcMapping(void* data, int device) : data_(data), device_(device) {}

  void* data_ = nullptr;
  int device_ = -1;
};

}  // namespace dynamiq::client::internal

#endif  // DQ_CLIENT_CUDA_IPC_H_

// The CUDA side of a GPU node (dynamiqd --device=cuda): checking the device at startup, the
// device memory workers' buffers live in (DeviceMemory over cudaMalloc + cudaIpcGetMemHandle), and
// jobs' CudaDataPath (local reduce kernels, engine::NcclAllReduce, write-back) on a stream of
// their own. Built (target dynamiq_server_cuda, compile definition DQ_HAVE_NCCL) only when CUDA
// and NCCL are found; this header includes no CUDA header.
//
// Every call makes the daemon's device current for its CUDA calls and restores the caller's device
// (common::ScopedDevice), so any thread (gRPC handlers, reducers) may call it.
#ifndef DQ_SERVER_CUDA_DEVICE_H_
#define DQ_SERVER_CUDA_DEVICE_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ipc/device_buffers.h"
#include "server/data_path.h"

namespace dynamiq::server {

// OK if CUDA device `device` exists and can be used; FAILED_PRECONDITION naming what is missing
// (no driver, no device, an ordinal past the last device) otherwise.
absl::Status CheckCudaDevice(int device);

// The 16-byte UUID of CUDA device `device` (cudaDeviceProp::uuid).
absl::StatusOr<std::string> CudaDeviceUuid(int device);

// Device memory of `device` for DeviceBufferRegistry: zeroed cudaMalloc allocations exported with
// cudaIpcGetMemHandle.
absl::StatusOr<std::unique_ptr<ipc::DeviceMemory>> CreateCudaDeviceMemory(int device);

// A job's CudaDataPath (server/data_path.h) on `device`: a non-blocking stream of its own, an fp32 sum buffer and a
// staging buffer for host regions (both grown as needed and kept across collectives, freed with
// it). CrossNode drives engine::NcclAllReduce and needs the transport to be an engine::NcclTransport
// on the same device.
absl::StatusOr<std::unique_ptr<DataPath>> CreateCudaDataPath(int device);

}  // namespace dynamiq::server

#endif  // DQ_SERVER_CUDA_DEVICE_H_

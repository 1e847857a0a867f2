#include "engine/nccl_transport.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cuda_check.h"
#include "common/status_macros.h"
#include "engine/nccl_check.h"

namespace dynamiq::engine {
namespace {

constexpr absl::string_view kIdPrefix = "id:";
constexpr absl::string_view kErrorPrefix = "error:";
// Operations listed in a DEADLINE_EXCEEDED message, at most.
constexpr size_t kMaxDescribedOps = 8;

#define DQ_NCCL_STATUS(result, comm, what) \
  ::dynamiq::engine::NcclErrorStatus((result), (comm), (what), __FILE__, __LINE__)

using ::dynamiq::common::ScopedDevice;

// Between two polls: yield for the first ones (an NCCL step on NVLink takes microseconds), then
// sleep 10 us doubling up to 40 us, never past `deadline`. Every (step, block) of a collective waits
// here once, so a longer sleep would add up to milliseconds per collective (it did, at 1 ms).
void PollBackoff(int iteration, absl::Time deadline) {
  constexpr int kYields = 64;
  if (iteration < kYields) {
    std::this_thread::yield();
    return;
  }
  const absl::Duration step = absl::Microseconds(10 << std::min(iteration - kYields, 2));
  const absl::Duration left = deadline - absl::Now();
  absl::SleepFor(std::max(absl::ZeroDuration(), std::min(step, left)));
}

// FAILED_PRECONDITION unless the CUDA runtime sees `device`.
absl::Status CheckDevice(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("the NCCL transport needs a CUDA device, but there is no usable CUDA device: "
                     "cudaGetDeviceCount failed: ",
                     cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError("the NCCL transport needs a CUDA device, but there is no usable CUDA device");
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " visible device(s))"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ncclUniqueId> ParseUniqueId(absl::string_view value) {
  if (absl::StartsWith(value, kErrorPrefix)) {
    return absl::UnavailableError(
        absl::StrCat("rank 0 could not create the NCCL unique id: ", value.substr(kErrorPrefix.size())));
  }
  ncclUniqueId id;
  const absl::string_view hex = absl::StartsWith(value, kIdPrefix) ? value.substr(kIdPrefix.size()) : "";
  const bool well_formed = hex.size() == 2 * sizeof(id.internal) &&
                           std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); });
  if (!well_formed) {
    return absl::InternalError(
        absl::StrCat("store key '", kNcclUniqueIdKey, "' does not hold an NCCL unique id (", value.size(), " bytes)"));
  }
  const std::string bytes = absl::HexStringToBytes(hex);
  std::copy(bytes.begin(), bytes.end(), id.internal);
  return id;
}

// Rank 0's half of the rendezvous: a new id, published. On failure publishes the error, so the
// other ranks fail at once.
absl::StatusOr<ncclUniqueId> CreateAndPublishId(Store& store, const absl::Status& device_status) {
  absl::Status status = device_status;
  ncclUniqueId id;
  if (status.ok()) {
    const ncclResult_t result = ncclGetUniqueId(&id);
    if (result != ncclSuccess) status = DQ_NCCL_STATUS(result, nullptr, "ncclGetUniqueId");
  }
  if (!status.ok()) {
    (void)store.Set(kNcclUniqueIdKey, absl::StrCat(kErrorPrefix, status.ToString()));
    return status;
  }
  const std::string hex = absl::BytesToHexString(absl::string_view(id.internal, sizeof(id.internal)));
  DQ_RETURN_IF_ERROR(store.Set(kNcclUniqueIdKey, absl::StrCat(kIdPrefix, hex)));
  return id;
}

// Polls a non-blocking communicator until its pending operation (init, group launch, finalize)
// leaves ncclInProgress. `*state` receives the final state and `*call` the result of
// ncclCommGetAsyncError itself; returns false on deadline. Only for communicators that Abort
// cannot reach (not yet, or no longer, owned by a transport).
bool PollComm(ncclComm_t comm, absl::Time deadline, ncclResult_t* state, ncclResult_t* call) {
  for (int i = 0;; ++i) {
    *call = ncclCommGetAsyncError(comm, state);
    if (*call != ncclSuccess || *state != ncclInProgress) return true;
    if (absl::Now() >= deadline) return false;
    PollBackoff(i, deadline);
  }
}

// Clean teardown: ncclCommFinalize, polled until quiescent (or `timeout`), then ncclCommDestroy.
// Falls back to ncclCommAbort. Returns whether the clean path succeeded.
bool FinalizeOrAbort(ncclComm_t comm, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  ncclResult_t result = ncclCommFinalize(comm);
  if (result == ncclSuccess || result == ncclInProgress) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t call = ncclSuccess;
    if (PollComm(comm, deadline, &state, &call) && call == ncclSuccess && state == ncclSuccess) {
      result = ncclCommDestroy(comm);
      if (result == ncclSuccess || result == ncclInProgress) return true;
      // ncclCommDestroy failed: the communicator's state is unknown; aborting is all that is left.
    }
  }
  (void)ncclCommAbort(comm);
  return false;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> ConnectNcclTransport(Store& store, int rank, int size, int device,
                                                                absl::Duration timeout) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL transport: rank ", rank, " of ", size, " is invalid"));
  }
  const std::string where = absl::StrCat("NCCL transport rank ", rank, " of ", size, " (device ", device, ")");
  const absl::Status device_status = CheckDevice(device);

  // Rendezvous on the unique id.
  ncclUniqueId id;
  if (rank == 0) {
    absl::StatusOr<ncclUniqueId> created = CreateAndPublishId(store, device_status);
    if (!created.ok()) {
      return common::Annotate(created.status(), where);
    }
    id = *created;
  } else {
    if (!device_status.ok()) {
      return common::Annotate(device_status, where);
    }
    absl::StatusOr<std::string> value =
        store.Get(kNcclUniqueIdKey, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!value.ok()) {
      return common::Annotate(value.status(), absl::StrCat(where, ": waiting for rank 0's NCCL unique id"));
    }
    absl::StatusOr<ncclUniqueId> parsed = ParseUniqueId(*value);
    if (!parsed.ok()) {
      return common::Annotate(parsed.status(), where);
    }
    id = *parsed;
  }

  // Non-blocking init, polled against the deadline. The device must be current during init.
  ScopedDevice scoped_device(device);
  DQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t result = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (result != ncclSuccess && result != ncclInProgress) {
    absl::Status status = DQ_NCCL_STATUS(result, comm, "ncclCommInitRankConfig");
    if (comm != nullptr) (void)ncclCommAbort(comm);
    return common::Annotate(status, where);
  }
  ncclResult_t state = ncclInProgress;
  ncclResult_t call = ncclSuccess;
  if (!PollComm(comm, deadline, &state, &call)) {
    (void)ncclCommAbort(comm);
    return absl::DeadlineExceededError(
        absl::StrCat(where, ": NCCL communicator init did not complete within ", absl::FormatDuration(timeout),
                     " (every rank of the group must connect with the same group/epoch store prefix)"));
  }
  if (call != ncclSuccess || state != ncclSuccess) {
    absl::Status status = call != ncclSuccess ? DQ_NCCL_STATUS(call, comm, "ncclCommGetAsyncError")
                                              : DQ_NCCL_STATUS(state, comm, "NCCL communicator init");
    (void)ncclCommAbort(comm);
    // An init that failed asynchronously is a failure to reach the group: UNAVAILABLE.
    return absl::UnavailableError(absl::StrCat(where, ": ", status.message()));
  }

  cudaStream_t stream = nullptr;
  const cudaError_t error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    (void)ncclCommAbort(comm);  // the peers may be running already: a finalize would wait for them
    const absl::Status status = common::CudaErrorStatus(error, "cudaStreamCreateWithFlags", __FILE__, __LINE__);
    return common::Annotate(status, where);
  }
  return std::unique_ptr<Transport>(new NcclTransport(rank, size, device, comm, stream));
}

NcclTransport::NcclTransport(int rank, int size, int device, ncclComm* comm, CUstream_st* stream)
    : rank_(rank), size_(size), device_(device), stream_(stream), comm_(comm) {}

NcclTransport::~NcclTransport() {
  ScopedDevice scoped_device(device_);
  {
    absl::MutexLock lock(&comm_mu_);
    if (comm_ != nullptr) {
      // Healthy: no failure and every launched group completed (ops never waited for may still
      // be in flight; NCCL would have to finish them, so they count as unhealthy).
      bool healthy = failure_.ok();
      for (auto& [id, launch] : launches_) {
        if (!healthy) break;
        if (!launch.done) healthy = cudaEventQuery(launch.event) == cudaSuccess;
      }
      (void)cudaGetLastError();
      if (healthy) {
        (void)FinalizeOrAbort(comm_, kNcclFinalizeTimeout);
      } else {
        (void)ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
  }
  // cudaEventDestroy of an event still pending returns at once and frees it when it completes.
  for (auto& [id, launch] : launches_) (void)cudaEventDestroy(launch.event);
  for (CUevent_st* event : free_events_) (void)cudaEventDestroy(event);
  (void)cudaStreamDestroy(stream_);
  (void)cudaGetLastError();
}

std::string NcclTransport::Where() const {
  return absl::StrCat("NCCL transport rank ", rank_, " of ", size_, " (device ", device_, ")");
}

std::string NcclTransport::Describe(const Op& op) const {
  return op.send ? absl::StrCat("send of ", op.bytes, " bytes to rank ", op.peer, " (tag ", op.tag, ")")
                 : absl::StrCat("receive of ", op.bytes, " bytes from rank ", op.peer, " (tag ", op.tag, ")");
}

std::string NcclTransport::DescribeGroup(const std::vector<Handle>& handles) const {
  std::vector<std::string> parts;
  for (Handle h : handles) {
    auto it = ops_.find(h);
    if (it == ops_.end()) continue;  // already waited for
    if (parts.size() == kMaxDescribedOps) {
      parts.push_back("...");
      break;
    }
    parts.push_back(Describe(it->second));
  }
  return absl::StrCat("group of ", handles.size(), " operation(s); not yet waited for: ", absl::StrJoin(parts, ", "));
}

absl::Status NcclTransport::DeadlineStatus(const Op& op, absl::Duration waited, absl::string_view stage,
                                           const std::vector<Handle>& group) const {
  return absl::DeadlineExceededError(
      absl::StrCat(Where(), ": ", Describe(op), " did not complete within ", absl::FormatDuration(waited), " (", stage,
                   ": ", DescribeGroup(group), "). NCCL matches sends and receives per peer in call order: rank ",
                   op.peer, " may be gone or stalled, or may have posted a different sequence of operations"));
}

absl::Status NcclTransport::AbortedStatus(const Op* op) const {
  std::string message = absl::StrCat(Where(), " was aborted");
  if (op != nullptr) absl::StrAppend(&message, "; ", Describe(*op), " did not complete");
  return absl::AbortedError(std::move(message));
}

absl::Status NcclTransport::Fail(absl::Status status) {
  if (failure_.ok()) failure_ = status;
  return status;
}

absl::StatusOr<Transport::Handle> NcclTransport::PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) {
  return Post(/*send=*/true, peer, tag, const_cast<uint8_t*>(data.data()), data.size());
}

absl::StatusOr<Transport::Handle> NcclTransport::PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) {
  return Post(/*send=*/false, peer, tag, buffer.data(), buffer.size());
}

absl::StatusOr<Transport::Handle> NcclTransport::Post(bool send, int peer, uint64_t tag, void* data, size_t bytes) {
  if (aborted_.load()) return AbortedStatus(nullptr);
  if (!failure_.ok()) {
    return common::Annotate(failure_,
                            absl::StrCat(Where(), " is unusable after an earlier failure (re-form the group)"));
  }
  const char* verb = send ? "send to" : "receive from";
  if (peer < 0 || peer >= size_ || peer == rank_) {
    return absl::InvalidArgumentError(absl::StrCat(Where(), ": cannot ", verb, " rank ", peer));
  }
  if (bytes > 0) {
    // NCCL needs device-resident (or managed) memory of this device; anything else would fail
    // inside the kernel, far from the cause.
    cudaPointerAttributes attributes;
    const cudaError_t error = cudaPointerGetAttributes(&attributes, data);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat(Where(), ": cannot ", verb, " rank ", peer,
                       ": cudaPointerGetAttributes failed on the buffer: ", cudaGetErrorName(error)));
    }
    if (attributes.type == cudaMemoryTypeHost || attributes.type == cudaMemoryTypeUnregistered) {
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": cannot ", verb, " rank ", peer,
                                                     ": the buffer is host memory; NCCL needs device memory"));
    }
    if (attributes.type == cudaMemoryTypeDevice && attributes.device != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(), ": cannot ", verb, " rank ", peer, ": the buffer is on device ", attributes.device));
    }
  }
  const Handle handle = next_handle_++;
  ops_[handle] = Op{send, peer, tag, data, bytes, /*launch=*/0};
  if (bytes > 0) pending_.push_back(handle);
  return handle;
}

absl::Status NcclTransport::Wait(Handle handle, absl::Time deadline) {
  const absl::Time start = absl::Now();
  if (ops_.find(handle) == ops_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(Where(), ": Wait on unknown handle ", handle));
  }
  ScopedDevice scoped_device(device_);
  const absl::Status status = WaitForOp(handle, start, deadline);
  Release(handle);
  return status;
}

absl::Status NcclTransport::WaitForOp(Handle handle, absl::Time start, absl::Time deadline) {
  Op& op = ops_.at(handle);
  if (aborted_.load()) return AbortedStatus(&op);
  if (!failure_.ok()) {
    return common::Annotate(failure_, absl::StrCat(Where(), ": ", Describe(op),
                                                   " cannot complete after an earlier failure (re-form the group)"));
  }
  if (op.bytes == 0) return absl::OkStatus();
  if (op.launch == 0) DQ_RETURN_IF_ERROR(LaunchPending(op, start, deadline));
  Launch& launch = launches_.at(op.launch);
  for (int i = 0;; ++i) {
    if (launch.done) return absl::OkStatus();
    {
      absl::MutexLock lock(&comm_mu_);
      if (comm_ == nullptr) return AbortedStatus(&op);
      const cudaError_t error = cudaEventQuery(launch.event);
      if (error == cudaSuccess) {
        launch.done = true;
        return absl::OkStatus();
      }
      if (error != cudaErrorNotReady) {
        (void)cudaGetLastError();
        const absl::Status status = common::CudaErrorStatus(error, "cudaEventQuery", __FILE__, __LINE__);
        return Fail(common::Annotate(status, absl::StrCat(Where(), ": ", Describe(op))));
      }
      ncclResult_t state = ncclSuccess;
      const ncclResult_t call = ncclCommGetAsyncError(comm_, &state);
      if (call != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
        const absl::Status status = call != ncclSuccess ? DQ_NCCL_STATUS(call, comm_, "ncclCommGetAsyncError")
                                                        : DQ_NCCL_STATUS(state, comm_, "NCCL communicator");
        return Fail(absl::UnavailableError(
            absl::StrCat(Where(), ": ", Describe(op), " failed asynchronously: ", status.message())));
      }
    }
    if (absl::Now() >= deadline) {
      return Fail(DeadlineStatus(op, std::max(absl::ZeroDuration(), deadline - start), "its group was launched",
                                 launch.handles));
    }
    PollBackoff(i, deadline);
  }
}

absl::Status NcclTransport::LaunchPending(const Op& waited, absl::Time start, absl::Time deadline) {
  CUevent_st* event = nullptr;
  if (!free_events_.empty()) {
    event = free_events_.back();
    free_events_.pop_back();
  } else {
    const cudaError_t error = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      const absl::Status status = common::CudaErrorStatus(error, "cudaEventCreateWithFlags", __FILE__, __LINE__);
      return Fail(common::Annotate(status, Where()));
    }
  }
  // On failure the event goes back to the pool (it has not been recorded).
  auto fail = [&](absl::Status status) {
    free_events_.push_back(event);
    return Fail(common::Annotate(status, absl::StrCat(Where(), ": launching the group with ", Describe(waited))));
  };

  // One group: the calls only queue work; ncclGroupEnd launches it (or, non-blocking, starts to).
  {
    absl::MutexLock lock(&comm_mu_);
    if (comm_ == nullptr) {
      free_events_.push_back(event);
      return AbortedStatus(&waited);
    }
    const ncclResult_t start_result = ncclGroupStart();
    if (start_result != ncclSuccess) return fail(DQ_NCCL_STATUS(start_result, comm_, "ncclGroupStart"));
    ncclResult_t first_error = ncclSuccess;
    const Op* failed = nullptr;
    for (Handle h : pending_) {
      const Op& p = ops_.at(h);
      const ncclResult_t result = p.send ? ncclSend(p.data, p.bytes, ncclUint8, p.peer, comm_, stream_)
                                         : ncclRecv(p.data, p.bytes, ncclUint8, p.peer, comm_, stream_);
      if (result != ncclSuccess && result != ncclInProgress) {
        first_error = result;
        failed = &p;
        break;
      }
    }
    // Always closes the group (the group depth is per thread), even after a failed call.
    const ncclResult_t end_result = ncclGroupEnd();
    if (failed != nullptr) {
      const absl::Status status = DQ_NCCL_STATUS(first_error, comm_, failed->send ? "ncclSend" : "ncclRecv");
      return fail(common::Annotate(status, absl::StrCat(Describe(*failed))));
    }
    if (end_result != ncclSuccess && end_result != ncclInProgress) {
      return fail(DQ_NCCL_STATUS(end_result, comm_, "ncclGroupEnd"));
    }
  }

  // Non-blocking: the group is enqueued on the stream once the communicator leaves
  // ncclInProgress; only then does an event recorded on the stream follow it.
  for (int i = 0;; ++i) {
    {
      absl::MutexLock lock(&comm_mu_);
      if (comm_ == nullptr) {
        free_events_.push_back(event);
        return AbortedStatus(&waited);
      }
      ncclResult_t state = ncclSuccess;
      const ncclResult_t call = ncclCommGetAsyncError(comm_, &state);
      if (call != ncclSuccess) return fail(DQ_NCCL_STATUS(call, comm_, "ncclCommGetAsyncError"));
      if (state == ncclSuccess) {
        const cudaError_t error = cudaEventRecord(event, stream_);
        if (error != cudaSuccess) {
          (void)cudaGetLastError();
          return fail(common::CudaErrorStatus(error, "cudaEventRecord", __FILE__, __LINE__));
        }
        break;
      }
      if (state != ncclInProgress) {
        const absl::Status status = DQ_NCCL_STATUS(state, comm_, "ncclGroupEnd (asynchronous)");
        return fail(absl::UnavailableError(status.message()));
      }
    }
    if (absl::Now() >= deadline) {
      free_events_.push_back(event);
      return Fail(DeadlineStatus(waited, std::max(absl::ZeroDuration(), deadline - start),
                                 "NCCL was still launching its group", pending_));
    }
    PollBackoff(i, deadline);
  }

  const uint64_t id = next_launch_++;
  Launch& launch = launches_[id];
  launch.event = event;
  launch.handles = std::move(pending_);
  pending_.clear();
  launch.outstanding = static_cast<int>(launch.handles.size());
  for (Handle h : launch.handles) ops_.at(h).launch = id;
  return absl::OkStatus();
}

void NcclTransport::Release(Handle handle) {
  auto it = ops_.find(handle);
  if (it == ops_.end()) return;
  const uint64_t launch_id = it->second.launch;
  ops_.erase(it);
  if (launch_id == 0) {
    pending_.erase(std::remove(pending_.begin(), pending_.end(), handle), pending_.end());
    return;
  }
  auto l = launches_.find(launch_id);
  if (l == launches_.end() || --l->second.outstanding > 0) return;
  if (l->second.done) {
    free_events_.push_back(l->second.event);
  } else {
    (void)cudaEventDestroy(l->second.event);  // freed once it completes
  }
  launches_.erase(l);
}

void NcclTransport::Abort() {
  absl::MutexLock lock(&comm_mu_);
  aborted_.store(true);
  if (comm_ == nullptr) return;
  ScopedDevice scoped_device(device_);
  (void)ncclCommAbort(comm_);
  comm_ = nullptr;
}

}  // namespace dynamiq::engine

#include "dynamiq/client.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/connection.h"
#include "common/env.h"
#include "common/status_macros.h"
#include "ipc/device_buffers.h"

namespace dynamiq {
namespace {

using client::internal::Connection;
using client::internal::FutureState;
using client::internal::kTeardownTimeout;

// One asynchronous AllReduce: gRPC reads the request and writes the response and the context
// until it runs the completion callback, which holds this object.
struct AllReduceCall {
  grpc::ClientContext context;
  dynamiq::v1::AllReduceRequest request;
  dynamiq::v1::AllReduceResponse response;
};

absl::Status CheckOptions(const ClientOptions& options) {
  if (options.socket_path.empty()) return absl::InvalidArgumentError("ClientOptions::socket_path is empty");
  if (options.job_id.empty()) return absl::InvalidArgumentError("ClientOptions::job_id is empty");
  if (options.local_world_size == 0) return absl::InvalidArgumentError("ClientOptions::local_world_size is 0");
  if (options.local_rank >= options.local_world_size) {
    return absl::InvalidArgumentError(absl::StrCat("ClientOptions::local_rank ", options.local_rank,
                                                   " is not below local_world_size ", options.local_world_size));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions::timeout must be positive, not ", absl::FormatDuration(options.timeout)));
  }
  return absl::OkStatus();
}

// gRPC's own message for a missing socket is generic; say which path and what to check.
absl::Status CheckSocketExists(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    // dynamiqd serves only its own user (the socket is 0600 and every connection's uid is checked):
    // say so, rather than let the dropped connection read as "Broken pipe". root may try anyway.
    if (st.st_uid != geteuid() && geteuid() != 0) {
      return absl::PermissionDeniedError(absl::StrCat(
          "dynamiqd's worker socket ", path, " belongs to uid ", st.st_uid, " and this process runs as uid ", geteuid(),
          ": dynamiqd serves only workers of its own user (run the worker as uid ", st.st_uid,
          ", or start a dynamiqd of your own)"));
    }
    return absl::OkStatus();
  }
  const int err = errno;
  if (err == EACCES) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot reach dynamiqd's worker socket ", path, ": ", ::strerror(err),
                     " (its folder belongs to another user? dynamiqd serves only workers of its own user)"));
  }
  if (err != ENOENT && err != ENOTDIR) return absl::OkStatus();  // let the connection attempt report it
  return absl::UnavailableError(absl::StrCat("no dynamiqd worker socket at ", path, ": ", ::strerror(err),
                                             " (is dynamiqd running with --worker_socket=", path,
                                             "? the client takes the path from DQ_SOCKET or its options)"));
}

// Call only after Client::CheckAllReduce() accepted the arguments.
dynamiq::v1::AllReduceRequest MakeAllReduceRequest(Connection& connection, const Buffer& buffer, size_t offset_bytes,
                                                   size_t num_elements, DType dtype, absl::string_view tensor_name,
                                                   const AllReduceOptions& options) {
  dynamiq::v1::AllReduceRequest request;
  request.set_worker_id(connection.worker_id);
  request.set_tensor_name(std::string(tensor_name));
  request.set_buffer_id(buffer.id());
  request.set_offset_bytes(offset_bytes);
  request.set_num_elements(num_elements);
  request.set_dtype(static_cast<dynamiq::v1::DType>(static_cast<int>(dtype)));
  request.set_average(options.average);
  if (options.weight.has_value()) request.set_weight(*options.weight);
  request.set_exact(options.exact);
  request.set_submission(connection.next_submission.fetch_add(1));
  return request;
}

// The same request for the submission ring (same numbering).
ipc::ring::RingRequest MakeRingRequest(Connection& connection, const Buffer& buffer, size_t offset_bytes,
                                       size_t num_elements, DType dtype, absl::string_view tensor_name,
                                       const AllReduceOptions& options) {
  ipc::ring::RingRequest request;
  request.tensor_name = std::string(tensor_name);
  request.buffer_id = buffer.id();
  request.offset_bytes = offset_bytes;
  request.num_elements = num_elements;
  request.dtype = static_cast<uint32_t>(dtype);
  request.average = options.average;
  request.weight = options.weight;
  request.exact = options.exact;
  request.submission = connection.next_submission.fetch_add(1);
  return request;
}

// The ring and a slot of it for an all-reduce of `tensor_name`, if it can take one: the daemon
// offered a ring, a slot is free, and the name fits a slot (longer ones go by gRPC, which refuses
// them in its own words).
std::optional<uint32_t> RingSlot(Connection& connection, absl::string_view tensor_name) {
  if (connection.ring == nullptr || tensor_name.size() > ipc::ring::kMaxNameBytes) return std::nullopt;
  return connection.ring->Acquire();
}

// The worker's submission ring, or null when the daemon offers none (an older daemon answers
// UNIMPLEMENTED) or it cannot be mapped: the client then calls AllReduce for every all-reduce.
std::unique_ptr<client::internal::RingSubmitter> OpenRing(Connection& connection) {
  const absl::Duration timeout = connection.options().timeout;
  grpc::ClientContext context;
  Connection::SetDeadline(context, timeout);
  dynamiq::v1::OpenSubmissionRingRequest request;
  request.set_worker_id(connection.worker_id);
  dynamiq::v1::OpenSubmissionRingResponse response;
  if (!connection.stub().OpenSubmissionRing(&context, request, &response).ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<ipc::SubmissionRingClient>> ring =
      ipc::SubmissionRingClient::Open(response.shm_name(), response.bytes());
  if (!ring.ok()) return nullptr;
  return std::make_unique<client::internal::RingSubmitter>(*std::move(ring), connection.options().socket_path, timeout);
}

void Teardown(std::shared_ptr<Connection>& connection) {
  if (connection == nullptr) return;
  connection->tracker()->WaitIdle();
  (void)connection->Unregister(std::min(connection->options().timeout, kTeardownTimeout));
  connection.reset();
}

// The AllocateBuffer call: `bytes` of `kind` memory for the connection's worker.
absl::StatusOr<dynamiq::v1::AllocateBufferResponse> RequestBuffer(Connection& connection, size_t bytes,
                                                                  dynamiq::v1::MemoryKind kind) {
  const absl::Duration timeout = connection.options().timeout;
  grpc::ClientContext context;
  Connection::SetDeadline(context, timeout);
  dynamiq::v1::AllocateBufferRequest request;
  request.set_worker_id(connection.worker_id);
  request.set_bytes(bytes);
  request.set_memory_kind(kind);
  dynamiq::v1::AllocateBufferResponse allocated;
  DQ_RETURN_IF_ERROR(connection.FromGrpc(connection.stub().AllocateBuffer(&context, request, &allocated),
                                         "AllocateBuffer", timeout, context));
  return allocated;
}

}  // namespace

namespace client::internal {

absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view rpc, absl::string_view socket_path,
                            absl::Duration timeout, absl::Time deadline) {
  if (status.ok()) return absl::OkStatus();
  return FromDaemonStatus(absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message()), rpc,
                          socket_path, timeout, deadline);
}

absl::Status FromDaemonStatus(const absl::Status& status, absl::string_view rpc, absl::string_view socket_path,
                              absl::Duration timeout, absl::Time deadline) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return status;
    case absl::StatusCode::kUnavailable:
      return common::Annotate(status, absl::StrCat(rpc, " to dynamiqd at ", socket_path));
    case absl::StatusCode::kDeadlineExceeded:
      // Before the call's deadline only the daemon can have answered (its --timeout fired, and its
      // message names what it waited for); from it on, gRPC's own deadline (DQ_TIMEOUT_SECONDS) fired.
      if (absl::Now() < deadline) {
        return common::Annotate(status, absl::StrCat(rpc, " to dynamiqd at ", socket_path));
      }
      return common::Annotate(status, absl::StrCat(rpc, " to dynamiqd at ", socket_path, " (deadline ",
                                                   absl::FormatDuration(timeout), ", DQ_TIMEOUT_SECONDS)"));
    default:
      return status;
  }
}

absl::Status Connection::ReleaseBuffer(uint64_t buffer_id, absl::Duration timeout) const {
  if (unregistered_.load()) return absl::OkStatus();
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  dynamiq::v1::ReleaseBufferRequest request;
  request.set_worker_id(worker_id);
  request.set_buffer_id(buffer_id);
  dynamiq::v1::ReleaseBufferResponse response;
  return FromGrpc(stub_->ReleaseBuffer(&context, request, &response), "ReleaseBuffer", timeout, context);
}

absl::Status Connection::Unregister(absl::Duration timeout) {
  if (unregistered_.exchange(true)) return absl::OkStatus();
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  dynamiq::v1::UnregisterRequest request;
  request.set_worker_id(worker_id);
  dynamiq::v1::UnregisterResponse response;
  return FromGrpc(stub_->Unregister(&context, request, &response), "Unregister", timeout, context);
}

}  // namespace client::internal

ClientOptions::ClientOptions() {
  const common::ClientEnv& env = common::ClientEnv::Get();
  socket_path = env.socket_path;
  job_id = env.job_id;
  local_rank = env.local_rank;
  local_world_size = env.local_world_size;
  timeout = env.timeout;
  submission_ring = env.submission_ring;
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
      return 2;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "invalid";
}

absl::StatusOr<Client> Client::Connect(const ClientOptions& options) {
  DQ_RETURN_IF_ERROR(common::ClientEnv::Get().status);
  DQ_RETURN_IF_ERROR(CheckOptions(options));
  DQ_RETURN_IF_ERROR(CheckSocketExists(options.socket_path));

  auto connection = std::make_shared<Connection>(
      options, grpc::CreateChannel("unix:" + options.socket_path, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  Connection::SetDeadline(context, options.timeout);
  dynamiq::v1::RegisterRequest request;
  request.set_job_id(options.job_id);
  request.set_local_rank(options.local_rank);
  request.set_local_world_size(options.local_world_size);
  dynamiq::v1::RegisterResponse response;
  DQ_RETURN_IF_ERROR(connection->FromGrpc(connection->stub().Register(&context, request, &response), "Register",
                                          options.timeout, context));
  if (response.worker_id().empty()) {
    return absl::InternalError(absl::StrCat("dynamiqd at ", options.socket_path, " registered job ", options.job_id,
                                            " local rank ", options.local_rank, " without a worker id"));
  }
  connection->worker_id = response.worker_id();
  connection->node_rank = response.node_rank();
  connection->num_nodes = response.num_nodes();
  connection->config_epoch = response.config_epoch();
  const dynamiq::v1::CompressionConfig& config = response.config();
  connection->config.codec = config.codec();
  connection->config.bits = config.bits();
  connection->config.topology = config.topology();
  connection->config.min_compress_elements = config.min_compress_elements();
  connection->config.allocator = config.allocator();
  connection->daemon_device = response.device() == dynamiq::v1::DEVICE_KIND_CUDA ? DeviceKind::kCuda : DeviceKind::kCpu;
  if (options.submission_ring) connection->ring = OpenRing(*connection);
  return Client(std::move(connection));
}

Client::Client(std::shared_ptr<Connection> connection) : connection_(std::move(connection)) {}
Client::Client(Client&& other) noexcept = default;
Client& Client::operator=(Client&& other) noexcept {
  if (this != &other) {
    Teardown(connection_);
    connection_ = std::move(other.connection_);
  }
  return *this;
}
Client::~Client() { Teardown(connection_); }

absl::StatusOr<Buffer> Client::Allocate(size_t bytes, MemoryKind kind) {
  if (connection_ == nullptr) return absl::FailedPreconditionError("Allocate on a moved-from dynamiq::Client");
  if (kind == MemoryKind::kCudaDevice) return AllocateDevice(bytes);
  if (kind != MemoryKind::kHost) {
    return absl::InvalidArgumentError(absl::StrCat("unknown memory kind ", static_cast<int>(kind)));
  }
  if (bytes == 0 || bytes > ipc::kMaxShmRegionBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate a buffer of ", bytes, " bytes (must be 1..", ipc::kMaxShmRegionBytes, ")"));
  }
  const absl::Duration timeout = connection_->options().timeout;
  DQ_ASSIGN_OR_RETURN(const dynamiq::v1::AllocateBufferResponse allocated,
                      RequestBuffer(*connection_, bytes, dynamiq::v1::MEMORY_KIND_HOST));
  const uint64_t id = allocated.buffer_id();
  // From here on a failure must give the buffer back, or the daemon keeps it until we unregister.
  auto fail = [&](absl::Status status) {
    (void)connection_->ReleaseBuffer(id, std::min(timeout, kTeardownTimeout));
    return status;
  };
  if (allocated.bytes() < bytes) {
    return fail(absl::InternalError(absl::StrCat("dynamiqd allocated buffer ", id, " of ", allocated.bytes(),
                                                 " bytes when ", bytes, " were asked for")));
  }
  absl::StatusOr<ipc::ShmRegion> region = ipc::ShmRegion::Open(allocated.shm_name(), allocated.bytes());
  if (!region.ok()) {
    return fail(common::Annotate(
        region.status(), absl::StrCat("mapping buffer ", id, " (", allocated.bytes(), " bytes) that dynamiqd at ",
                                      connection_->options().socket_path, " allocated")));
  }
  {
    grpc::ClientContext context;
    Connection::SetDeadline(context, timeout);
    dynamiq::v1::MappedRequest request;
    request.set_worker_id(connection_->worker_id);
    request.set_buffer_id(id);
    dynamiq::v1::MappedResponse response;
    absl::Status mapped =
        connection_->FromGrpc(connection_->stub().Mapped(&context, request, &response), "Mapped", timeout, context);
    if (!mapped.ok()) return fail(std::move(mapped));
  }
  auto impl = std::make_unique<client::internal::BufferImpl>();
  impl->connection = connection_;
  impl->region = *std::move(region);
  impl->id = id;
  impl->size = allocated.bytes();
  return Buffer(std::move(impl));
}

absl::StatusOr<Buffer> Client::AllocateDevice(size_t bytes) {
  const std::string& socket = connection_->options().socket_path;
  if (!client::internal::CudaIpcSupported()) {
    return absl::UnimplementedError(
        "cannot allocate a CUDA device buffer: this dynamiq_client was built without CUDA (rebuild with the CUDA "
        "toolkit, or allocate MemoryKind::kHost)");
  }
  if (connection_->daemon_device != DeviceKind::kCuda) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot allocate a CUDA device buffer: dynamiqd at ", socket,
                     " runs with --device=cpu and hands out host (shared-memory) buffers only; allocate "
                     "MemoryKind::kHost, or run dynamiqd --device=cuda on this GPU node"));
  }
  if (bytes == 0 || bytes > ipc::kMaxDeviceBufferBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cannot allocate a device buffer of ", bytes, " bytes (must be 1..",
                                                   ipc::kMaxDeviceBufferBytes, ")"));
  }
  const absl::Duration timeout = connection_->options().timeout;
  DQ_ASSIGN_OR_RETURN(const dynamiq::v1::AllocateBufferResponse allocated,
                      RequestBuffer(*connection_, bytes, dynamiq::v1::MEMORY_KIND_CUDA_DEVICE));
  const uint64_t id = allocated.buffer_id();
  auto fail = [&](absl::Status status) {
    (void)connection_->ReleaseBuffer(id, std::min(timeout, kTeardownTimeout));
    return status;
  };
  if (allocated.memory_kind() != dynamiq::v1::MEMORY_KIND_CUDA_DEVICE || allocated.bytes() < bytes) {
    return fail(absl::InternalError(absl::StrCat("dynamiqd at ", socket, " answered a request for a ", bytes,
                                                 "-byte device buffer with buffer ", id, " of ", allocated.bytes(),
                                                 " bytes of memory kind ", allocated.memory_kind())));
  }
  absl::StatusOr<client::internal::CudaIpcMapping> mapping = client::internal::CudaIpcMapping::Open(
      allocated.cuda_ipc_handle(), allocated.cuda_device_uuid(), allocated.cuda_device());
  if (!mapping.ok()) {
    return fail(common::Annotate(mapping.status(), absl::StrCat("opening device buffer ", id, " (", allocated.bytes(),
                                                                " bytes) that dynamiqd at ", socket, " allocated")));
  }
  auto impl = std::make_unique<client::internal::BufferImpl>();
  impl->connection = connection_;
  impl->device_mapping = *std::move(mapping);
  impl->id = id;
  impl->size = allocated.bytes();
  return Buffer(std::move(impl));
}

absl::Status Client::CheckAllReduce(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                                    absl::string_view tensor_name, const AllReduceOptions& options) const {
  if (connection_ == nullptr) return absl::FailedPreconditionError("AllReduce on a moved-from dynamiq::Client");
  if (tensor_name.empty()) return absl::InvalidArgumentError("all-reduce with an empty tensor name");
  if (options.weight.has_value() && !(*options.weight >= 0 && std::isfinite(*options.weight))) {
    return absl::InvalidArgumentError(absl::StrCat("all-reduce of '", tensor_name, "': weight ", *options.weight,
                                                   " is not finite and >= 0 (a sample count)"));
  }
  if (!buffer.valid()) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-reduce of '", tensor_name, "': the buffer is empty (released or moved from)"));
  }
  if (buffer.impl_->connection != connection_) {
    return absl::InvalidArgumentError(absl::StrCat("all-reduce of '", tensor_name, "': buffer ", buffer.id(),
                                                   " was allocated by another dynamiq::Client"));
  }
  const size_t element_bytes = DTypeSize(dtype);
  if (element_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-reduce of '", tensor_name, "': unknown dtype ", static_cast<int>(dtype)));
  }
  if (num_elements == 0) {
    return absl::InvalidArgumentError(absl::StrCat("all-reduce of '", tensor_name, "' with 0 elements"));
  }
  if (offset_bytes % element_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("all-reduce of '", tensor_name, "': offset ", offset_bytes,
                                                   " is not a multiple of the ", DTypeName(dtype), " size (",
                                                   element_bytes, " bytes)"));
  }
  if (offset_bytes > buffer.size() || num_elements > (buffer.size() - offset_bytes) / element_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-reduce of '", tensor_name, "': ", num_elements, " ", DTypeName(dtype), " elements at offset ",
                     offset_bytes, " do not fit in buffer ", buffer.id(), " of ", buffer.size(), " bytes"));
  }
  return absl::OkStatus();
}

absl::Status Client::AllReduce(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                               absl::string_view tensor_name, bool average, AllReduceResult* result) {
  return AllReduce(buffer, offset_bytes, num_elements, dtype, tensor_name, AllReduceOptions{average}, result);
}

Future Client::AllReduceAsync(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                              absl::string_view tensor_name, bool average) {
  return AllReduceAsync(buffer, offset_bytes, num_elements, dtype, tensor_name, AllReduceOptions{average});
}

absl::Status Client::AllReduce(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                               absl::string_view tensor_name, const AllReduceOptions& options,
                               AllReduceResult* result) {
  DQ_RETURN_IF_ERROR(CheckAllReduce(buffer, offset_bytes, num_elements, dtype, tensor_name, options));
  DQ_RETURN_IF_ERROR(buffer.impl_->device_mapping.WaitForWrites());
  if (std::optional<uint32_t> slot = RingSlot(*connection_, tensor_name)) {
    buffer.impl_->uses->Start();
    absl::StatusOr<AllReduceResult> r = connection_->ring->Run(
        *slot, MakeRingRequest(*connection_, buffer, offset_bytes, num_elements, dtype, tensor_name, options));
    buffer.impl_->uses->Done();
    DQ_RETURN_IF_ERROR(r.status());
    if (result != nullptr) *result = *std::move(r);
    return absl::OkStatus();
  }
  const dynamiq::v1::AllReduceRequest request =
      MakeAllReduceRequest(*connection_, buffer, offset_bytes, num_elements, dtype, tensor_name, options);
  const absl::Duration timeout = connection_->options().timeout;
  grpc::ClientContext context;
  Connection::SetDeadline(context, timeout);
  dynamiq::v1::AllReduceResponse response;
  buffer.impl_->uses->Start();
  const grpc::Status status = connection_->stub().AllReduce(&context, request, &response);
  buffer.impl_->uses->Done();
  DQ_RETURN_IF_ERROR(connection_->FromGrpc(status, "AllReduce", timeout, context));
  if (result != nullptr) *result = client::internal::ToResult(response);
  return absl::OkStatus();
}

Future Client::AllReduceAsync(const Buffer& buffer, size_t offset_bytes, size_t num_elements, DType dtype,
                              absl::string_view tensor_name, const AllReduceOptions& options) {
  auto state = std::make_shared<FutureState>();
  absl::Status ready = CheckAllReduce(buffer, offset_bytes, num_elements, dtype, tensor_name, options);
  if (ready.ok()) ready = buffer.impl_->device_mapping.WaitForWrites();
  if (!ready.ok()) {
    state->Complete(std::move(ready));
    return Future(std::move(state));
  }
  std::shared_ptr<client::internal::OpTracker> tracker = connection_->tracker();
  std::shared_ptr<client::internal::OpTracker> uses = buffer.impl_->uses;
  if (std::optional<uint32_t> slot = RingSlot(*connection_, tensor_name)) {
    tracker->Start();
    uses->Start();
    connection_->ring->Start(
        *slot, MakeRingRequest(*connection_, buffer, offset_bytes, num_elements, dtype, tensor_name, options),
        [state, tracker, uses](absl::Status status, AllReduceResult result) {
          state->Complete(std::move(status), std::move(result));
          uses->Done();  // after the future completes, as below
          tracker->Done();
        });
    return Future(std::move(state));
  }
  const absl::Duration timeout = connection_->options().timeout;
  auto call = std::make_shared<AllReduceCall>();
  call->request = MakeAllReduceRequest(*connection_, buffer, offset_bytes, num_elements, dtype, tensor_name, options);
  Connection::SetDeadline(call->context, timeout);
  tracker->Start();
  uses->Start();
  // The callback runs on a gRPC thread. It must not hold the Connection (see connection.h), so it
  // carries what the error message needs by value.
  connection_->stub().async()->AllReduce(
      &call->context, &call->request, &call->response,
      [call, state, tracker, uses, socket_path = connection_->options().socket_path, timeout](grpc::Status status) {
        absl::Status s = client::internal::FromGrpcStatus(status, "AllReduce", socket_path, timeout,
                                                          absl::FromChrono(call->context.deadline()));
        const bool ok = s.ok();
        state->Complete(std::move(s), ok ? client::internal::ToResult(call->response) : AllReduceResult());
        // After the future completes, so a release that waited for this call finds it complete; a
        // thread the future woke that releases the buffer waits for no more than this line.
        uses->Done();
        tracker->Done();
      });
  return Future(std::move(state));
}

const std::string& Client::worker_id() const { return connection_->worker_id; }
uint32_t Client::node_rank() const { return connection_->node_rank; }
uint32_t Client::num_nodes() const { return connection_->num_nodes; }
uint64_t Client::config_epoch() const { return connection_->config_epoch; }
const CompressionConfig& Client::config() const { return connection_->config; }
DeviceKind Client::daemon_device() const { return connection_->daemon_device; }
bool Client::uses_submission_ring() const { return connection_ != nullptr && connection_->ring != nullptr; }
const ClientOptions& Client::options() const { return connection_->options(); }

}  // namespace dynamiq

// Tests of the client library against a fake dynamiqd: a real gRPC server on a Unix socket in a
// temporary directory, implementing dynamiq.v1.Worker with real shared memory (ShmRegion::Create)
// and an "all-reduce" that doubles the values in place (as if a second worker had contributed the
// same data), plus a few tensor names that trigger errors, delays and a concurrency barrier.
#include "dynamiq/client.h"

#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/env.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "gtest/gtest.h"
#include "ipc/shm_region.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// AllReduce of this tensor fails with INVALID_ARGUMENT and kBadTensorMessage.
constexpr char kBadTensor[] = "bad";
constexpr char kBadTensorMessage[] =
    "tensor 'bad': worker 1 submitted 3 float32 elements, worker 0 submitted 4 (sizes must match)";
// AllReduce of this tensor never completes: only the client's deadline ends it.
constexpr char kHangTensor[] = "hang";
// AllReduce of this tensor takes 300 ms.
constexpr char kSlowTensor[] = "slow";
// AllReduce of this tensor gets the daemon's own DEADLINE_EXCEEDED (its --timeout fired).
constexpr char kDaemonTimeoutTensor[] = "daemon-timeout";
constexpr char kDaemonTimeoutMessage[] =
    "collective 3 of job j timed out after 5s (dynamiqd --timeout); local ranks that did not submit: 1";
// AllReduce of this tensor gets a DEADLINE_EXCEEDED from the daemon whose text is gRPC's own.
constexpr char kDaemonBareTimeoutTensor[] = "daemon-bare-timeout";
// AllReduce of tensors named "barrier.*" completes only once kBarrierSize of them are in the server
// at the same time (so the client must have them outstanding concurrently); ABORTED after 10 s.
constexpr char kBarrierPrefix[] = "barrier.";
constexpr int kBarrierSize = 4;

class FakeWorkerService final : public dynamiq::v1::Worker::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const dynamiq::v1::RegisterRequest* request,
                        dynamiq::v1::RegisterResponse* response) override {
    absl::MutexLock lock(&mu_);
    const std::string id = absl::StrCat("worker-", ++next_worker_);
    workers_.insert(id);
    registers_.push_back(*request);
    response->set_worker_id(id);
    response->set_node_rank(1);
    response->set_num_nodes(3);
    response->set_config_epoch(7);
    response->mutable_config()->set_codec("dynamiq");
    response->mutable_config()->set_bits(5);
    response->mutable_config()->set_topology("ring");
    response->mutable_config()->set_min_compress_elements(1024);
    response->mutable_config()->set_allocator("measured");
    return grpc::Status::OK;
  }

  grpc::Status AllocateBuffer(grpc::ServerContext*, const dynamiq::v1::AllocateBufferRequest* request,
                              dynamiq::v1::AllocateBufferResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (grpc::Status s = CheckWorker(request->worker_id()); !s.ok()) return s;
    absl::StatusOr<ipc::ShmRegion> region = ipc::ShmRegion::Create(request->bytes(), "client_test");
    if (!region.ok()) {
      return grpc::Status(static_cast<grpc::StatusCode>(region.status().code()),
                          std::string(region.status().message()));
    }
    const uint64_t id = ++next_buffer_;
    response->set_buffer_id(id);
    response->set_shm_name(region->name());
    response->set_bytes(region->size());
    buffers_[id] = std::make_unique<ipc::ShmRegion>(*std::move(region));
    return grpc::Status::OK;
  }

  grpc::Status Mapped(grpc::ServerContext*, const dynamiq::v1::MappedRequest* request,
                      dynamiq::v1::MappedResponse*) override {
    absl::MutexLock lock(&mu_);
    if (grpc::Status s = CheckWorker(request->worker_id()); !s.ok()) return s;
    auto it = buffers_.find(request->buffer_id());
    if (it == buffers_.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown buffer");
    const absl::Status unlinked = it->second->Unlink();
    if (!unlinked.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, std::string(unlinked.message()));
    mapped_.insert(request->buffer_id());
    return grpc::Status::OK;
  }

  grpc::Status ReleaseBuffer(grpc::ServerContext*, const dynamiq::v1::ReleaseBufferRequest* request,
                             dynamiq::v1::ReleaseBufferResponse*) override {
    absl::MutexLock lock(&mu_);
    if (grpc::Status s = CheckWorker(request->worker_id()); !s.ok()) return s;
    if (buffers_.erase(request->buffer_id()) == 0) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("unknown buffer ", request->buffer_id()));
    }
    released_.insert(request->buffer_id());
    return grpc::Status::OK;
  }

  grpc::Status AllReduce(grpc::ServerContext* context, const dynamiq::v1::AllReduceRequest* request,
                         dynamiq::v1::AllReduceResponse* response) override {
    uint8_t* base = nullptr;
    {
      absl::MutexLock lock(&mu_);
      all_reduces_.push_back(*request);
      if (grpc::Status s = CheckWorker(request->worker_id()); !s.ok()) return s;
      auto it = buffers_.find(request->buffer_id());
      if (it == buffers_.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown buffer");
      base = it->second->data() + request->offset_bytes();
    }
    const std::string& name = request->tensor_name();
    if (name == kBadTensor) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, kBadTensorMessage);
    if (name == kHangTensor) {
      while (!context->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    if (name == kSlowTensor) absl::SleepFor(absl::Milliseconds(300));
    if (name == kDaemonTimeoutTensor) return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, kDaemonTimeoutMessage);
    if (name == kDaemonBareTimeoutTensor) return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded");
    if (absl::StartsWith(name, kBarrierPrefix)) {
      absl::MutexLock lock(&mu_);
      ++barrier_arrived_;
      auto all_here = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return barrier_arrived_ >= kBarrierSize; };
      if (!mu_.AwaitWithTimeout(absl::Condition(&all_here), absl::Seconds(10))) {
        return grpc::Status(grpc::StatusCode::ABORTED,
                            absl::StrCat("only ", barrier_arrived_, " barrier all-reduces arrived concurrently"));
      }
    }
    // "Sum" with one more identical contribution; an average of the two leaves the values alone.
    const float factor = request->average() ? 1.0f : 2.0f;
    if (request->dtype() == dynamiq::v1::DTYPE_FLOAT32) {
      float* values = reinterpret_cast<float*>(base);
      for (uint64_t i = 0; i < request->num_elements(); ++i) values[i] *= factor;
    } else {
      uint16_t* values = reinterpret_cast<uint16_t*>(base);
      for (uint64_t i = 0; i < request->num_elements(); ++i) {
        uint32_t bits = uint32_t{values[i]} << 16;
        float f;
        memcpy(&f, &bits, 4);
        f *= factor;
        memcpy(&bits, &f, 4);
        values[i] = static_cast<uint16_t>(bits >> 16);
      }
    }
    response->set_sequence(request->num_elements());
    response->set_config_epoch(7);
    response->set_codec("dynamiq");
    response->set_bits(5);
    response->set_wire_bytes(3 * request->num_elements());
    return grpc::Status::OK;
  }

  grpc::Status Unregister(grpc::ServerContext*, const dynamiq::v1::UnregisterRequest* request,
                          dynamiq::v1::UnregisterResponse*) override {
    absl::MutexLock lock(&mu_);
    if (grpc::Status s = CheckWorker(request->worker_id()); !s.ok()) return s;
    workers_.erase(request->worker_id());
    unregistered_.insert(request->worker_id());
    return grpc::Status::OK;
  }

  // Accessors for the tests.
  std::vector<dynamiq::v1::RegisterRequest> registers() {
    absl::MutexLock lock(&mu_);
    return registers_;
  }
  std::vector<dynamiq::v1::AllReduceRequest> all_reduces() {
    absl::MutexLock lock(&mu_);
    return all_reduces_;
  }
  std::set<uint64_t> released() {
    absl::MutexLock lock(&mu_);
    return released_;
  }
  std::set<uint64_t> mapped() {
    absl::MutexLock lock(&mu_);
    return mapped_;
  }
  std::set<std::string> unregistered() {
    absl::MutexLock lock(&mu_);
    return unregistered_;
  }
  // The daemon's own mapping of a buffer, and its shm name (nullptr / "" if there is none).
  uint8_t* BufferData(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = buffers_.find(id);
    return it == buffers_.end() ? nullptr : it->second->data();
  }
  std::string BufferName(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = buffers_.find(id);
    return it == buffers_.end() ? "" : it->second->name();
  }

 private:
  grpc::Status CheckWorker(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (workers_.count(id) == 0) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker " + id);
    return grpc::Status::OK;
  }

  absl::Mutex mu_;
  int next_worker_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_buffer_ ABSL_GUARDED_BY(mu_) = 0;
  int barrier_arrived_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::string> workers_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::unique_ptr<ipc::ShmRegion>> buffers_ ABSL_GUARDED_BY(mu_);
  std::vector<dynamiq::v1::RegisterRequest> registers_ ABSL_GUARDED_BY(mu_);
  std::vector<dynamiq::v1::AllReduceRequest> all_reduces_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> mapped_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> released_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> unregistered_ ABSL_GUARDED_BY(mu_);
};

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/dq-client-test-XXXXXX";  // short: Unix socket paths are limited to 107 bytes
    ASSERT_NE(mkdtemp(dir), nullptr) << strerror(errno);
    dir_ = dir;
    socket_path_ = dir_ + "/dynamiqd.sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_path_, grpc::InsecureServerCredentials());
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    StopServer();
    std::filesystem::remove_all(dir_);
  }
  void StopServer() {
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_->Wait();
    server_.reset();
  }

  ClientOptions Options() const {
    ClientOptions options;
    options.socket_path = socket_path_;
    options.job_id = "job-a";
    options.local_rank = 1;
    options.local_world_size = 2;
    options.timeout = absl::Seconds(30);
    return options;
  }
  Client MustConnect(ClientOptions options) {
    absl::StatusOr<Client> client = Client::Connect(options);
    EXPECT_THAT(client, IsOk());
    if (!client.ok()) std::abort();
    return *std::move(client);
  }
  Client MustConnect() { return MustConnect(Options()); }
  static Buffer MustAllocate(Client& client, size_t bytes) {
    absl::StatusOr<Buffer> buffer = client.Allocate(bytes);
    EXPECT_THAT(buffer, IsOk());
    if (!buffer.ok()) std::abort();
    return *std::move(buffer);
  }
  static float* Floats(const Buffer& buffer) { return static_cast<float*>(buffer.data()); }

  std::string dir_;
  std::string socket_path_;
  FakeWorkerService service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(ClientTest, ConnectRegistersAndExposesTheRegistration) {
  Client client = MustConnect();
  EXPECT_EQ(client.worker_id(), "worker-1");
  EXPECT_EQ(client.node_rank(), 1u);
  EXPECT_EQ(client.num_nodes(), 3u);
  EXPECT_EQ(client.config_epoch(), 7u);
  EXPECT_EQ(client.config().codec, "dynamiq");
  EXPECT_EQ(client.config().bits, 5);
  EXPECT_EQ(client.config().topology, "ring");
  EXPECT_EQ(client.config().min_compress_elements, 1024u);
  EXPECT_EQ(client.config().allocator, "measured");
  EXPECT_EQ(client.options().socket_path, socket_path_);
  const std::vector<dynamiq::v1::RegisterRequest> registers = service_.registers();
  ASSERT_EQ(registers.size(), 1u);
  EXPECT_EQ(registers[0].job_id(), "job-a");
  EXPECT_EQ(registers[0].local_rank(), 1u);
  EXPECT_EQ(registers[0].local_world_size(), 2u);
  // This daemon offers no submission ring (OpenSubmissionRing is UNIMPLEMENTED): every all-reduce
  // is a call, as the tests below check.
  EXPECT_FALSE(client.uses_submission_ring());
}

TEST_F(ClientTest, AllocateMapsSharedMemoryBothSidesSee) {
  Client client = MustConnect();
  Buffer buffer = MustAllocate(client, 10000);
  ASSERT_TRUE(buffer.valid());
  EXPECT_GE(buffer.size(), 10000u);
  EXPECT_NE(buffer.id(), 0u);
  // The daemon was told the buffer is mapped, and unlinked its name.
  EXPECT_EQ(service_.mapped(), std::set<uint64_t>{buffer.id()});
  const std::string name = service_.BufferName(buffer.id());
  ASSERT_FALSE(name.empty());
  struct stat st;
  EXPECT_NE(stat(("/dev/shm" + name).c_str(), &st), 0) << name << " is still linked";

  // Bytes the worker writes are what the daemon reads, and the other way round.
  uint8_t* daemon_side = service_.BufferData(buffer.id());
  ASSERT_NE(daemon_side, nullptr);
  ASSERT_NE(daemon_side, static_cast<uint8_t*>(buffer.data()));  // two mappings of one object
  uint8_t* worker_side = static_cast<uint8_t*>(buffer.data());
  for (size_t i = 0; i < 10000; ++i) worker_side[i] = static_cast<uint8_t>(i * 7);
  for (size_t i = 0; i < 10000; ++i) ASSERT_EQ(daemon_side[i], static_cast<uint8_t>(i * 7)) << i;
  daemon_side[9999] = 42;
  EXPECT_EQ(worker_side[9999], 42);

  EXPECT_THAT(client.Allocate(0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 bytes")));
}

TEST_F(ClientTest, SyncAllReduceReducesTheRegionInPlace) {
  Client client = MustConnect();
  Buffer buffer = MustAllocate(client, 64 * sizeof(float));
  float* v = Floats(buffer);
  for (int i = 0; i < 64; ++i) v[i] = static_cast<float>(i);

  AllReduceResult result;
  ASSERT_THAT(client.AllReduce(buffer, 0, 64, DType::kFloat32, "all", /*average=*/false, &result), IsOk());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(v[i], 2.0f * i) << i;
  // The daemon's report of the collective reaches the caller.
  EXPECT_EQ(result.sequence, 64u);
  EXPECT_EQ(result.config_epoch, 7u);
  EXPECT_EQ(result.codec, "dynamiq");
  EXPECT_EQ(result.bits, 5);
  EXPECT_EQ(result.wire_bytes, 3u * 64);

  // Only the named region changes.
  ASSERT_THAT(client.AllReduce(buffer, 16 * sizeof(float), 8, DType::kFloat32, "part", /*average=*/false), IsOk());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(v[i], (i >= 16 && i < 24 ? 4.0f : 2.0f) * i) << i;

  const std::vector<dynamiq::v1::AllReduceRequest> requests = service_.all_reduces();
  ASSERT_EQ(requests.size(), 2u);
  EXPECT_EQ(requests[1].worker_id(), client.worker_id());
  EXPECT_EQ(requests[1].tensor_name(), "part");
  EXPECT_EQ(requests[1].buffer_id(), buffer.id());
  EXPECT_EQ(requests[1].offset_bytes(), 16 * sizeof(float));
  EXPECT_EQ(requests[1].num_elements(), 8u);
  EXPECT_EQ(requests[1].dtype(), dynamiq::v1::DTYPE_FLOAT32);
  EXPECT_FALSE(requests[1].average());

  // bfloat16 and average reach the daemon as such.
  uint16_t* h = static_cast<uint16_t*>(buffer.data());
  h[0] = 0x3f80;  // 1.0
  ASSERT_THAT(client.AllReduce(buffer, 0, 1, DType::kBFloat16, "bf16"), IsOk());
  EXPECT_EQ(h[0], 0x4000);  // 2.0
  ASSERT_THAT(client.AllReduce(buffer, 0, 1, DType::kBFloat16, "bf16.avg", /*average=*/true), IsOk());
  EXPECT_EQ(h[0], 0x4000);
  EXPECT_EQ(service_.all_reduces().back().dtype(), dynamiq::v1::DTYPE_BFLOAT16);
  EXPECT_TRUE(service_.all_reduces().back().average());
}

TEST_F(ClientTest, AsyncAllReducesAreOutstandingConcurrently) {
  Client client = MustConnect();
  Buffer buffer = MustAllocate(client, kBarrierSize * 256 * sizeof(float));
  float* v = Floats(buffer);
  for (int i = 0; i < kBarrierSize * 256; ++i) v[i] = 1.0f + i;
  // The fake completes none of these until all of them are in the server at once.
  std::vector<Future> futures;
  for (int b = 0; b < kBarrierSize; ++b) {
    futures.push_back(
        client.AllReduceAsync(buffer, b * 256 * sizeof(float), 256, DType::kFloat32, absl::StrCat(kBarrierPrefix, b)));
    EXPECT_TRUE(futures.back().valid());
  }
  for (Future& f : futures) EXPECT_THAT(f.Wait(), IsOk());
  for (Future& f : futures) {
    EXPECT_TRUE(f.Ready());
    EXPECT_THAT(f.Wait(), IsOk());  // again: same status
  }
  for (int i = 0; i < kBarrierSize * 256; ++i) ASSERT_EQ(v[i], 2.0f * (1.0f + i)) << i;
}

TEST_F(ClientTest, AsyncAllReduceBecomesReadyWhenTheDaemonCompletes) {
  Client client = MustConnect();
  Buffer buffer = MustAllocate(client, 4 * sizeof(float));
  Floats(buffer)[0] = 3;
  Future f = client.AllReduceAsync(buffer, 0, 1, DType::kFloat32, kSlowTensor);
  EXPECT_FALSE(f.Ready());  // the fake takes 300 ms
  EXPECT_THAT(f.Wait(), IsOk());
  EXPECT_TRUE(f.Ready());
  EXPECT_EQ(Floats(buffer)[0], 6);
  EXPECT_EQ(f.result().sequence, 1u);
  EXPECT_EQ(f.result().config_epoch, 7u);
  EXPECT_EQ(f.result().codec, "dynamiq");
  EXPECT_EQ(f.result().wire_bytes, 3u);

  Future moved = std::move(f);
  EXPECT_FALSE(f.valid());  // NOLINT(bugprone-use-after-move): testing the moved-from state
  EXPECT_THAT(f.Wait(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(moved.Wait(), IsOk());
}

TEST_F(ClientTest, DaemonErrorsKeepTheirCodeAndMessage) {
  Client client = MustConnect();
  Buffer buffer = MustAllocate(client, 16);
  const absl::Status sync = client.AllReduce(buffer, 0, 4, DType::kFloat32, kBadTensor);
  EXPECT_EQ(sync.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sync.message(), kBadTensorMessage);
  Future failed = client.AllReduceAsync(buffer, 0, 4, DType::kFloat32, kBadTensor);
  const absl::Status async = failed.Wait();
  EXPECT_EQ(async.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(async.message(), kBadTensorMessage);
  EXPECT_EQ(failed.result().codec, "");  // a failed collective reports nothing
  // The connection keeps working after an error.
  EXPECT_THAT(client.AllReduce(buffer, 0, 4, DType::kFloat32, "fine"), IsOk());
}

TEST_F(ClientTest, InvalidArgumentsAreRejectedWithoutAskingTheDaemon) {
  Client client = MustConnect();
  Buffer buffer = MustAllocate(client, 64);  // 16 floats
  const size_t size = buffer.size();
  ASSERT_EQ(size % sizeof(float), 0u);
  const size_t capacity = size / sizeof(float);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;

  EXPECT_THAT(client.AllReduce(buffer, 0, capacity, DType::kFloat32, "whole"), IsOk());
  EXPECT_THAT(client.AllReduce(buffer, 0, capacity + 1, DType::kFloat32, "t"),
              StatusIs(kInvalid, HasSubstr("do not fit in buffer")));
  EXPECT_THAT(client.AllReduce(buffer, 4, capacity, DType::kFloat32, "t"), StatusIs(kInvalid, HasSubstr("t")));
  EXPECT_THAT(client.AllReduce(buffer, size + 4, 1, DType::kFloat32, "t"), StatusIs(kInvalid));
  EXPECT_THAT(client.AllReduce(buffer, 4, SIZE_MAX / 2, DType::kFloat32, "t"), StatusIs(kInvalid));  // overflow
  EXPECT_THAT(client.AllReduce(buffer, 2, 1, DType::kFloat32, "t"), StatusIs(kInvalid, HasSubstr("multiple")));
  EXPECT_THAT(client.AllReduce(buffer, 2, 1, DType::kBFloat16, "t"), IsOk());  // bf16 needs 2-byte alignment
  EXPECT_THAT(client.AllReduce(buffer, 0, 0, DType::kFloat32, "t"), StatusIs(kInvalid, HasSubstr("0 elements")));
  EXPECT_THAT(client.AllReduce(buffer, 0, 1, static_cast<DType>(9), "t"),
              StatusIs(kInvalid, HasSubstr("unknown dtype 9")));
  EXPECT_THAT(client.AllReduce(buffer, 0, 1, DType::kFloat32, ""), StatusIs(kInvalid, HasSubstr("tensor name")));
  Buffer empty;
  EXPECT_THAT(client.AllReduce(empty, 0, 1, DType::kFloat32, "t"), StatusIs(kInvalid, HasSubstr("empty")));
  Client other = MustConnect();
  EXPECT_THAT(other.AllReduce(buffer, 0, 1, DType::kFloat32, "t"),
              StatusIs(kInvalid, HasSubstr("another dynamiq::Client")));

  // The asynchronous form reports the same errors through an already completed Future.
  Future f = client.AllReduceAsync(buffer, 0, capacity + 1, DType::kFloat32, "t");
  EXPECT_TRUE(f.Ready());
  EXPECT_THAT(f.Wait(), StatusIs(kInvalid, HasSubstr("do not fit in buffer")));

  // Only the two valid calls reached the daemon.
  EXPECT_EQ(service_.all_reduces().size(), 2u);
}

TEST_F(ClientTest, MissingSocketIsUnavailableAndNamesThePath) {
  ClientOptions options = Options();
  options.socket_path = dir_ + "/nobody-listens.sock";
  const absl::Time start = absl::Now();
  EXPECT_THAT(Client::Connect(options), StatusIs(absl::StatusCode::kUnavailable, HasSubstr(options.socket_path)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // fails fast, not at the 30 s deadline

  // A socket file nobody listens on (left behind by a dead daemon): gRPC's own UNAVAILABLE, with the
  // path added.
  const std::string stale = dir_ + "/stale.sock";
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  strncpy(addr.sun_path, stale.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << strerror(errno);
  close(fd);  // bound, never listened: connecting is refused
  options.socket_path = stale;
  EXPECT_THAT(Client::Connect(options), StatusIs(absl::StatusCode::kUnavailable, HasSubstr(stale)));
}

TEST_F(ClientTest, DaemonGoneMidSessionIsUnavailable) {
  Client client = MustConnect();
  Buffer buffer = MustAllocate(client, 16);
  StopServer();
  std::filesystem::remove(socket_path_);
  EXPECT_THAT(client.AllReduce(buffer, 0, 1, DType::kFloat32, "t"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr(socket_path_)));
  EXPECT_THAT(client.AllReduceAsync(buffer, 0, 1, DType::kFloat32, "t").Wait(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("AllReduce")));
  // Release still unmaps; the daemon is not there to hear about it.
  EXPECT_THAT(buffer.Release(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_FALSE(buffer.valid());
}

TEST_F(ClientTest, EveryCallHasADeadline) {
  ClientOptions options = Options();
  options.timeout = absl::Milliseconds(300);
  Client client = MustConnect(options);
  Buffer buffer = MustAllocate(client, 16);
  absl::Time start = absl::Now();
  EXPECT_THAT(client.AllReduce(buffer, 0, 1, DType::kFloat32, kHangTensor),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr(socket_path_)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  start = absl::Now();
  Future f = client.AllReduceAsync(buffer, 0, 1, DType::kFloat32, kHangTensor);
  EXPECT_THAT(f.Wait(), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("AllReduce")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(f.Wait(), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("DQ_TIMEOUT_SECONDS")));
}

// Issue 23.5: the daemon's DEADLINE_EXCEEDED (its --timeout fired) is not blamed on the client's
// deadline: no DQ_TIMEOUT_SECONDS hint, the daemon's message as it is.
TEST_F(ClientTest, TheDaemonsOwnTimeoutIsNotBlamedOnTheClientsDeadline) {
  Client client = MustConnect();
  Buffer buffer = MustAllocate(client, 16);
  const absl::Status s = client.AllReduce(buffer, 0, 1, DType::kFloat32, kDaemonTimeoutTensor);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded,
                          AllOf(HasSubstr(kDaemonTimeoutMessage), Not(HasSubstr("DQ_TIMEOUT_SECONDS")))));
  // Told apart by when the answer came (before the call's deadline), not by its text: the same
  // words gRPC uses for its own deadline are still the daemon's answer (issue 34).
  const absl::Status bare = client.AllReduce(buffer, 0, 1, DType::kFloat32, kDaemonBareTimeoutTensor);
  EXPECT_THAT(bare, StatusIs(absl::StatusCode::kDeadlineExceeded, Not(HasSubstr("DQ_TIMEOUT_SECONDS"))));
}

TEST_F(ClientTest, BuffersAreReleasedOnDestructionAndRelease) {
  Client client = MustConnect();
  uint64_t first = 0;
  {
    Buffer buffer = MustAllocate(client, 128);
    first = buffer.id();
    EXPECT_TRUE(service_.released().empty());
  }
  EXPECT_EQ(service_.released(), std::set<uint64_t>{first});
  EXPECT_EQ(service_.BufferData(first), nullptr);

  Buffer second = MustAllocate(client, 128);
  const uint64_t second_id = second.id();
  Buffer moved = std::move(second);
  EXPECT_FALSE(second.valid());  // NOLINT(bugprone-use-after-move): testing the moved-from state
  EXPECT_EQ(moved.id(), second_id);
  EXPECT_EQ(service_.released().count(second_id), 0u);  // moving does not release
  EXPECT_THAT(moved.Release(), IsOk());
  EXPECT_FALSE(moved.valid());
  EXPECT_EQ(moved.data(), nullptr);
  EXPECT_EQ(service_.released().count(second_id), 1u);
  EXPECT_THAT(moved.Release(), IsOk());  // idempotent

  // Move-assigning over a buffer releases the one it held.
  Buffer a = MustAllocate(client, 128), b = MustAllocate(client, 128);
  const uint64_t a_id = a.id(), b_id = b.id();
  a = std::move(b);
  EXPECT_EQ(service_.released().count(a_id), 1u);
  EXPECT_EQ(service_.released().count(b_id), 0u);
  EXPECT_EQ(a.id(), b_id);
}

// Issue 22: a release while an all-reduce on the buffer is in flight waits for its answer, so
// the daemon never sees ReleaseBuffer racing that AllReduce (which it would refuse).
TEST_F(ClientTest, ReleasingABufferWaitsForItsAllReducesInFlight) {
  Client client = MustConnect();
  Buffer buffer = MustAllocate(client, 4 * sizeof(float));
  const uint64_t id = buffer.id();
  Future f = client.AllReduceAsync(buffer, 0, 1, DType::kFloat32, kSlowTensor);  // the fake takes 300 ms
  EXPECT_FALSE(f.Ready());
  EXPECT_THAT(buffer.Release(), IsOk());
  EXPECT_TRUE(f.Ready());
  EXPECT_THAT(f.Wait(), IsOk());
  EXPECT_EQ(service_.released().count(id), 1u);

  // The destructor waits the same way.
  uint64_t second = 0;
  Future g;
  {
    Buffer other = MustAllocate(client, 4 * sizeof(float));
    second = other.id();
    g = client.AllReduceAsync(other, 0, 1, DType::kFloat32, kSlowTensor);
  }
  EXPECT_TRUE(g.Ready());
  EXPECT_THAT(g.Wait(), IsOk());
  EXPECT_EQ(service_.released().count(second), 1u);
}

TEST_F(ClientTest, DestroyingTheClientWaitsForInFlightWorkAndUnregisters) {
  std::optional<Client> client(MustConnect());
  const std::string worker_id = client->worker_id();
  Buffer buffer = MustAllocate(*client, 16);
  Floats(buffer)[0] = 5;
  Future f = client->AllReduceAsync(buffer, 0, 1, DType::kFloat32, kSlowTensor);
  client.reset();
  EXPECT_TRUE(f.Ready());  // the destructor waited for it
  EXPECT_THAT(f.Wait(), IsOk());
  EXPECT_EQ(Floats(buffer)[0], 10);
  EXPECT_EQ(service_.unregistered(), std::set<std::string>{worker_id});
  // The buffer outlives its client: still mapped, and releasing it does not bother the daemon.
  Floats(buffer)[1] = 1;
  EXPECT_THAT(buffer.Release(), IsOk());
}

TEST_F(ClientTest, MovedClientKeepsItsRegistration) {
  Client a = MustConnect();
  Buffer buffer = MustAllocate(a, 16);
  Client b = std::move(a);
  EXPECT_THAT(b.AllReduce(buffer, 0, 1, DType::kFloat32, "t"), IsOk());
  EXPECT_THAT(a.AllReduce(buffer, 0, 1, DType::kFloat32, "t"),  // NOLINT(bugprone-use-after-move)
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(a.Allocate(16), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(service_.unregistered().empty());
}

TEST_F(ClientTest, BadOptionsAreInvalidArguments) {
  ClientOptions options = Options();
  options.local_rank = 2;
  EXPECT_THAT(Client::Connect(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("local_rank 2")));
  options = Options();
  options.job_id = "";
  EXPECT_THAT(Client::Connect(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));
  options = Options();
  options.timeout = absl::ZeroDuration();
  EXPECT_THAT(Client::Connect(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
  EXPECT_TRUE(service_.registers().empty());
}

// ClientEnv parses DQ_* variables through a lookup, so these tests do not touch the environment.
common::ClientEnv ParseEnv(const std::map<std::string, std::string>& vars) {
  return common::ClientEnv::Parse([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

TEST(ClientEnvTest, DefaultsWhenUnset) {
  const common::ClientEnv env = ParseEnv({});
  EXPECT_THAT(env.status, IsOk());
  EXPECT_EQ(env.socket_path,
            geteuid() == 0 ? "/run/dynamiq/dynamiqd.sock" : absl::StrCat("/tmp/dynamiq-", geteuid(), "/dynamiqd.sock"));
  EXPECT_EQ(env.job_id, "default");
  EXPECT_EQ(env.local_rank, 0u);
  EXPECT_EQ(env.local_world_size, 1u);
  EXPECT_EQ(env.timeout, absl::Seconds(300));
  EXPECT_TRUE(env.submission_ring);
}

TEST(ClientEnvTest, ReadsEveryVariable) {
  const common::ClientEnv env = ParseEnv({{"DQ_SOCKET", "/run/dq.sock"},
                                          {"DQ_JOB", "bert"},
                                          {"DQ_LOCAL_RANK", "3"},
                                          {"DQ_LOCAL_WORLD_SIZE", "4"},
                                          {"DQ_TIMEOUT_SECONDS", "2.5"},
                                          {"DQ_SUBMISSION_RING", "0"}});
  EXPECT_THAT(env.status, IsOk());
  EXPECT_EQ(env.socket_path, "/run/dq.sock");
  EXPECT_EQ(env.job_id, "bert");
  EXPECT_EQ(env.local_rank, 3u);
  EXPECT_EQ(env.local_world_size, 4u);
  EXPECT_EQ(env.timeout, absl::Milliseconds(2500));
  EXPECT_FALSE(env.submission_ring);
}

TEST(ClientEnvTest, BadValuesNameTheVariable) {
  EXPECT_THAT(ParseEnv({{"DQ_LOCAL_RANK", "one"}}).status,
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DQ_LOCAL_RANK='one'")));
  EXPECT_THAT(ParseEnv({{"DQ_LOCAL_RANK", "2"}, {"DQ_LOCAL_WORLD_SIZE", "2"}}).status,
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("below DQ_LOCAL_WORLD_SIZE (2)")));
  EXPECT_THAT(ParseEnv({{"DQ_LOCAL_WORLD_SIZE", "0"}}).status,
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DQ_LOCAL_WORLD_SIZE")));
  EXPECT_THAT(ParseEnv({{"DQ_TIMEOUT_SECONDS", "-1"}}).status,
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DQ_TIMEOUT_SECONDS")));
  EXPECT_THAT(ParseEnv({{"DQ_SUBMISSION_RING", "maybe"}}).status,
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DQ_SUBMISSION_RING='maybe'")));
  const common::ClientEnv env = ParseEnv({{"DQ_TIMEOUT_SECONDS", "soon"}, {"DQ_JOB", "ok"}});
  EXPECT_EQ(env.timeout, absl::Seconds(300));  // the bad one keeps its default, the others are read
  EXPECT_EQ(env.job_id, "ok");
}

}  // namespace
}  // namespace dynamiq

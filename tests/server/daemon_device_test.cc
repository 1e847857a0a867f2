// GPU nodes (dynamiqd --device=cuda, docs/design.md "GPU nodes").
//
// Runs everywhere (no GPU needed):
//   - DeviceConfigTest: --device parsing and which configurations a GPU node accepts.
//   - JobDeviceTest: a Job with a device DataPath runs its collectives through it (a host-memory
//     implementation stands in for the CUDA one): local-rank order, dtypes, averaging, failures.
//   - DaemonDeviceTest: a --device=cuda daemon refuses to start without NCCL support or a GPU, or
//     with settings the device path lacks; a --device=cpu daemon reports its device kind and
//     refuses device buffers clearly (raw gRPC and dynamiq::Client), and keeps serving.
//   - DynamiqdDeviceFlagsTest: the dynamiqd binary's --device / --cuda_device validation.
// Needs a GPU (skips without one; label gpu):
//   - DaemonCudaGpuTest: workers (separate processes, tests/server/device_worker.cc) all-reduce
//     device buffers through a --device=cuda daemon; with 2 GPUs, across two GPU nodes.
#include <grpcpp/grpcpp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "dynamiq/client.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ipc/device_buffers.h"
#include "kernels/bf16_math.h"
#include "kernels/codec_info.h"
#include "server/daemon.h"
#include "server/data_path.h"
#include "server/job.h"
#include "server/job_config.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

#ifdef DQ_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

namespace dynamiq::server {
namespace {

// The built binaries, or (on a GPU machine running scripts/gpu-check from a bundle) where the
// environment says they are: DQ_DYNAMIQD, DQ_DEVICE_WORKER.
std::string BinaryPath(const char* variable, const char* built) {
  const char* overridden = std::getenv(variable);
  return overridden != nullptr && *overridden != '\0' ? overridden : built;
}

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::dynamiq::testing::TempDir;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

JobConfig Config(const char* codec, double bits = 0) {
  auto config = MakeJobConfig(codec, bits, "ring", 0, "measured");
  EXPECT_THAT(config, IsOk());
  return *config;
}

// ---------------------------------------------------------------------------------------------
// Configuration.

TEST(DeviceConfigTest, ParsesDeviceKinds) {
  EXPECT_THAT(ParseDeviceKind("cpu"), IsOk());
  EXPECT_EQ(*ParseDeviceKind("cuda"), DeviceKind::kCuda);
  EXPECT_THAT(ParseDeviceKind("gpu"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown device 'gpu' (cpu or cuda)")));
  EXPECT_THAT(ParseDeviceKind(""), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(DeviceKindName(DeviceKind::kCuda), "cuda");
}

// NCCL needs every node to launch the collectives of communicators sharing a GPU in one order;
// nodes run jobs as their workers arrive, so a multi-node NCCL cluster runs one job at a time.
TEST(DeviceConfigTest, MultiNodeNcclClustersRunOneJobAtATime) {
  DaemonOptions o;
  o.device = DeviceKind::kCuda;
  o.num_nodes = 2;
  o.max_jobs = 4;
  EXPECT_THAT(CheckAnotherJob(o, 0, "'a'"), IsOk());
  EXPECT_THAT(CheckAnotherJob(o, 1, "'b'"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("one job at a time"), HasSubstr("job 'b' can start"),
                             HasSubstr("--transport=gloo"), HasSubstr("one dynamiqd per job"))));
  o.transport = "nccl";
  EXPECT_THAT(CheckAnotherJob(o, 1, "'b'"), StatusIs(absl::StatusCode::kFailedPrecondition));
  // The hybrid path, one node, and CPU nodes: up to --max_jobs.
  for (auto change : std::vector<std::function<void(DaemonOptions&)>>{
           [](DaemonOptions& d) { d.transport = "gloo"; }, [](DaemonOptions& d) { d.num_nodes = 1; },
           [](DaemonOptions& d) { d.device = DeviceKind::kCpu; }}) {
    DaemonOptions other = o;
    change(other);
    EXPECT_THAT(CheckAnotherJob(other, 3, "'b'"), IsOk());
    EXPECT_THAT(CheckAnotherJob(other, 4, "'b'"),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max_jobs")));
  }
}

TEST(DeviceConfigTest, GpuNodesAcceptOnlyTheCodecsOfTheDeviceAllReduce) {
  for (const char* codec : {"none", "bf16", "dynamiq"}) {
    EXPECT_THAT(CheckConfigForDevice(Config(codec), DeviceKind::kCuda), IsOk()) << codec;
  }
  for (const char* codec : {"mxfp8", "mxfp6", "mxfp4", "thc", "uniform", "int8", "global_qsgd", "arc_topk"}) {
    EXPECT_THAT(CheckConfigForDevice(Config(codec), DeviceKind::kCuda),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("codec ", codec, " is not available on a --device=cuda node"))))
        << codec;
    EXPECT_THAT(CheckConfigForDevice(Config(codec), DeviceKind::kCpu), IsOk()) << codec;
  }
  JobConfig budget = Config("dynamiq", 5);
  ErrorBudgetPolicy policy;
  policy.target_vnmse = 1e-3;
  ASSERT_THAT(SetErrorBudget(policy, budget), IsOk());
  EXPECT_THAT(CheckConfigForDevice(budget, DeviceKind::kCuda),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("error budget")));
  EXPECT_THAT(CheckConfigForDevice(budget, DeviceKind::kCpu), IsOk());
}

// ---------------------------------------------------------------------------------------------
// Job: the device path's plumbing, with host memory standing in for the device.

// A device DataPath over host memory ("device" regions are host pointers here), with the CPU
// path's arithmetic. Records what it was asked to do.
class HostCollective final : public DataPath {
 public:
  bool on_device() const override { return true; }
  absl::Status LocalReduce(absl::Span<const Region> inputs, size_t n) override {
    absl::MutexLock lock(&mu_);
    ++local_reduces_;
    if (!fail_.ok()) return fail_;
    sum_.assign(n, 0.0f);
    for (size_t k = 0; k < inputs.size(); ++k) {
      for (size_t i = 0; i < n; ++i) {
        const float v = Load(inputs[k], i);
        sum_[i] = k == 0 ? v : sum_[i] + v;
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<CrossNodeResult> CrossNode(const kernels::Codec&, engine::Transport&, const engine::AllReduceOptions&,
                                            size_t, double) override {
    return absl::InternalError("a single-node job must not run a cross-node step");
  }
  absl::Status WriteBack(absl::Span<const Output> outputs, size_t n, float scale) override {
    absl::MutexLock lock(&mu_);
    ++write_backs_;
    for (const Output& out : outputs) {
      for (size_t i = 0; i < n; ++i) {
        const float v = out.average ? sum_[i] * scale : sum_[i];
        if (out.region.dtype == kernels::DType::kFloat32) {
          reinterpret_cast<float*>(out.region.data)[i] = v;
        } else {
          reinterpret_cast<uint16_t*>(out.region.data)[i] = kernels::FloatToBf16(v);
        }
      }
    }
    return absl::OkStatus();
  }

  void Fail(absl::Status status) {
    absl::MutexLock lock(&mu_);
    fail_ = std::move(status);
  }
  int local_reduces() {
    absl::MutexLock lock(&mu_);
    return local_reduces_;
  }
  int write_backs() {
    absl::MutexLock lock(&mu_);
    return write_backs_;
  }

 private:
  static float Load(const Region& r, size_t i) {
    if (r.dtype == kernels::DType::kFloat32) return reinterpret_cast<const float*>(r.data)[i];
    return kernels::Bf16ToFloat(reinterpret_cast<const uint16_t*>(r.data)[i]);
  }

  absl::Mutex mu_;
  absl::Status fail_;
  std::vector<float> sum_;
  int local_reduces_ = 0;
  int write_backs_ = 0;
};

Job::Options DeviceJobOptions(std::shared_ptr<DataPath> device) {
  Job::Options o;
  o.id = "gpu-job";
  o.local_world_size = 2;
  o.num_nodes = 1;
  o.config = Config("none");
  o.timeout = absl::Seconds(10);
  o.data_path = std::move(device);
  return o;
}

TEST(JobDeviceTest, LocalReduceAndWriteBackRunThroughTheDeviceDataPath) {
  auto device = std::make_shared<HostCollective>();
  Job job(DeviceJobOptions(device));
  ASSERT_THAT(job.AddWorker(1, 0, 2), IsOk());
  ASSERT_THAT(job.AddWorker(2, 1, 2), IsOk());
  const size_t n = 1000;
  auto request = [&](uint64_t worker, void* data, kernels::DType dtype, bool average) {
    Job::Request r;
    r.worker_id = worker;
    r.buffer_id = ipc::kDeviceBufferIdBase + worker;
    r.tensor_name = "grad";
    r.num_elements = n;
    r.dtype = dtype;
    r.average = average;
    r.region = absl::Span<uint8_t>(static_cast<uint8_t*>(data), n * kernels::DTypeSize(dtype));
    r.device_memory = true;
    return r;
  };
  auto run = [&](void* a, void* b, kernels::DType dtype) {
    absl::StatusOr<Job::Result> r1;
    // The second worker averages.
    std::thread t([&] { r1 = job.Submit(request(1, a, dtype, false)); });
    absl::StatusOr<Job::Result> r2 = job.Submit(request(2, b, dtype, true));
    t.join();
    EXPECT_THAT(r1, IsOk());
    EXPECT_THAT(r2, IsOk());
    return r1.ok() ? r1->sequence : ~uint64_t{0};
  };
  // fp32 regions.
  std::vector<float> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = 0.5f * static_cast<float>(i);
    b[i] = static_cast<float>(i % 13);
  }
  EXPECT_EQ(run(a.data(), b.data(), kernels::DType::kFloat32), 0u);
  for (size_t i = 0; i < n; ++i) {
    const float sum = 0.5f * static_cast<float>(i) + static_cast<float>(i % 13);
    ASSERT_EQ(a[i], sum) << i;
    ASSERT_EQ(b[i], sum * 0.5f) << i;
  }
  // bf16 regions: summed in fp32, rounded to bf16 on the way back.
  std::vector<uint16_t> c(n), d(n);
  for (size_t i = 0; i < n; ++i) {
    c[i] = kernels::FloatToBf16(1.0f + 0.01f * static_cast<float>(i));
    d[i] = kernels::FloatToBf16(static_cast<float>(i % 5));
  }
  EXPECT_EQ(run(c.data(), d.data(), kernels::DType::kBFloat16), 1u);
  for (size_t i = 0; i < n; ++i) {
    const float sum =
        kernels::Bf16ToFloat(kernels::FloatToBf16(1.0f + 0.01f * static_cast<float>(i))) + static_cast<float>(i % 5);
    ASSERT_EQ(c[i], kernels::FloatToBf16(sum)) << i;
    ASSERT_EQ(d[i], kernels::FloatToBf16(sum * 0.5f)) << i;
  }
  EXPECT_EQ(device->local_reduces(), 2);
  EXPECT_EQ(device->write_backs(), 2);
  const std::vector<CollectiveRecord> records = job.FlightRecorder(0);
  ASSERT_EQ(records.size(), 2u);
  for (const CollectiveRecord& r : records) EXPECT_EQ(r.state, "ok") << r.error;
}

TEST(JobDeviceTest, ADeviceFailureFailsTheCollectiveForEveryWorkerAndTheJobGoesOn) {
  auto device = std::make_shared<HostCollective>();
  Job job(DeviceJobOptions(device));
  ASSERT_THAT(job.AddWorker(1, 0, 2), IsOk());
  ASSERT_THAT(job.AddWorker(2, 1, 2), IsOk());
  std::vector<float> a(64, 1.0f), b(64, 2.0f);
  auto request = [&](uint64_t worker, std::vector<float>& data) {
    Job::Request r;
    r.worker_id = worker;
    r.tensor_name = "grad";
    r.num_elements = data.size();
    r.region = absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(data.data()), data.size() * 4);
    r.device_memory = true;
    return r;
  };
  device->Fail(absl::InternalError("cudaErrorIllegalAddress"));
  absl::StatusOr<Job::Result> r1;
  std::thread t([&] { r1 = job.Submit(request(1, a)); });
  absl::StatusOr<Job::Result> r2 = job.Submit(request(2, b));
  t.join();
  for (const auto& r : {r1, r2}) {
    EXPECT_THAT(
        r, StatusIs(absl::StatusCode::kInternal,
                    HasSubstr("collective 0 of job gpu-job: local reduce on the device: cudaErrorIllegalAddress")));
  }
  EXPECT_EQ(device->write_backs(), 0);
  device->Fail(absl::OkStatus());
  std::thread t2([&] { r1 = job.Submit(request(1, a)); });
  r2 = job.Submit(request(2, b));
  t2.join();
  ASSERT_THAT(r1, IsOk());
  ASSERT_THAT(r2, IsOk());
  EXPECT_EQ(r1->sequence, 1u);
  EXPECT_EQ(a[0], 3.0f);
  EXPECT_EQ(b[63], 3.0f);
}

// ---------------------------------------------------------------------------------------------
// Daemon.

int VisibleCudaDevices() {
#ifdef DQ_HAVE_NCCL
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

DaemonOptions CudaOptions(const std::string& dir, const JobConfig& config) {
  DaemonOptions o = ::dynamiq::testing::TestDaemonOptions(dir, 0, 1, config);
  o.device = DeviceKind::kCuda;
  return o;
}

TEST(DaemonDeviceTest, CudaDaemonRefusesToStartWithoutNcclSupportOrADevice) {
  if (VisibleCudaDevices() > 0) GTEST_SKIP() << "a CUDA device is visible: --device=cuda starts here";
  TempDir temp;
  Daemon daemon(CudaOptions(temp.path(), Config("dynamiq", 5)));
  if (DaemonHasCudaSupport()) {
    EXPECT_THAT(daemon.Start(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         AnyOf(HasSubstr("--device=cuda: no CUDA device is visible"),
                                               HasSubstr("--device=cuda: no usable CUDA device"))));
  } else {
    EXPECT_THAT(daemon.Start(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("this dynamiqd was built without CUDA and NCCL")));
  }
}

TEST(DaemonDeviceTest, CudaDaemonRefusesSettingsTheDevicePathLacksBeforeTouchingTheDevice) {
  if (!DaemonHasCudaSupport()) GTEST_SKIP() << "built without CUDA and NCCL: --device=cuda is refused before this";
  TempDir temp;
  {
    Daemon daemon(CudaOptions(temp.path(), Config("mxfp8")));
    EXPECT_THAT(daemon.Start(), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("default compression of new jobs: codec mxfp8 is not available")));
  }
  {
    DaemonOptions o = CudaOptions(temp.path(), Config("dynamiq", 5));
    o.security.cluster_secret_file = "/nonexistent/secret";
    Daemon daemon(o);
    EXPECT_THAT(daemon.Start(), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("--cluster_secret_file cannot be used with --device=cuda")));
  }
  {
    DaemonOptions o = CudaOptions(temp.path(), Config("dynamiq", 5));
    o.cuda_device = -1;
    Daemon daemon(o);
    EXPECT_THAT(daemon.Start(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--cuda_device must be 0 or more")));
  }
}

grpc::Status AllocateRaw(dynamiq::v1::Worker::Stub& stub, const std::string& worker, uint64_t bytes,
                         dynamiq::v1::MemoryKind kind, dynamiq::v1::AllocateBufferResponse* response) {
  dynamiq::v1::AllocateBufferRequest request;
  request.set_worker_id(worker);
  request.set_bytes(bytes);
  request.set_memory_kind(kind);
  grpc::ClientContext context;
  return stub.AllocateBuffer(&context, request, response);
}

TEST(DaemonDeviceTest, CpuDaemonReportsItsDeviceAndRefusesDeviceBuffersClearly) {
  TempDir temp;
  Daemon daemon(::dynamiq::testing::TestDaemonOptions(temp.path(), 0, 1, Config("dynamiq", 5)));
  ASSERT_THAT(daemon.Start(), IsOk());
  const std::string socket = absl::StrCat(temp.path(), "/node0.sock");
  auto stub = dynamiq::v1::Worker::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  dynamiq::v1::RegisterRequest reg;
  reg.set_job_id("j");
  reg.set_local_world_size(1);
  dynamiq::v1::RegisterResponse registered;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub->Register(&context, reg, &registered).ok());
  }
  EXPECT_EQ(registered.device(), dynamiq::v1::DEVICE_KIND_CPU);
  EXPECT_TRUE(registered.cuda_device_uuid().empty());

  dynamiq::v1::AllocateBufferResponse response;
  grpc::Status s = AllocateRaw(*stub, registered.worker_id(), 4096, dynamiq::v1::MEMORY_KIND_CUDA_DEVICE, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("runs with --device=cpu and hands out no CUDA device memory"));
  s = AllocateRaw(*stub, registered.worker_id(), 4096, static_cast<dynamiq::v1::MemoryKind>(7), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("unknown memory kind 7"));

  // Device buffer ids are unknown here, whatever the call.
  const uint64_t device_id = ipc::kDeviceBufferIdBase + 1;
  {
    dynamiq::v1::AllReduceRequest request;
    request.set_worker_id(registered.worker_id());
    request.set_tensor_name("g");
    request.set_buffer_id(device_id);
    request.set_num_elements(16);
    request.set_dtype(dynamiq::v1::DTYPE_FLOAT32);
    dynamiq::v1::AllReduceResponse r;
    grpc::ClientContext context;
    s = stub->AllReduce(&context, request, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(s.error_message(), HasSubstr("device buffer"));
  }
  {
    dynamiq::v1::ReleaseBufferRequest request;
    request.set_worker_id(registered.worker_id());
    request.set_buffer_id(device_id);
    dynamiq::v1::ReleaseBufferResponse r;
    grpc::ClientContext context;
    EXPECT_EQ(stub->ReleaseBuffer(&context, request, &r).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    dynamiq::v1::MappedRequest request;
    request.set_worker_id(registered.worker_id());
    request.set_buffer_id(device_id);
    dynamiq::v1::MappedResponse r;
    grpc::ClientContext context;
    EXPECT_EQ(stub->Mapped(&context, request, &r).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  // Still serving: host memory as before.
  s = AllocateRaw(*stub, registered.worker_id(), 4096, dynamiq::v1::MEMORY_KIND_HOST, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.memory_kind(), dynamiq::v1::MEMORY_KIND_HOST);
  EXPECT_FALSE(response.shm_name().empty());
  EXPECT_FALSE(ipc::IsDeviceBufferId(response.buffer_id()));
  daemon.Shutdown();
}

TEST(DaemonDeviceTest, ClientRefusesDeviceBuffersOfACpuDaemonAndStillAllocatesHostOnes) {
  TempDir temp;
  Daemon daemon(::dynamiq::testing::TestDaemonOptions(temp.path(), 0, 1, Config("dynamiq", 5)));
  ASSERT_THAT(daemon.Start(), IsOk());
  ClientOptions options;
  options.socket_path = absl::StrCat(temp.path(), "/node0.sock");
  options.job_id = "j";
  options.local_rank = 0;
  options.local_world_size = 1;
  options.timeout = absl::Seconds(20);
  absl::StatusOr<Client> client = Client::Connect(options);
  ASSERT_THAT(client, IsOk());
  EXPECT_EQ(client->daemon_device(), ::dynamiq::DeviceKind::kCpu);
  absl::StatusOr<Buffer> device = client->Allocate(4096, MemoryKind::kCudaDevice);
#ifdef DQ_HAVE_NCCL  // the client is built with CUDA whenever the daemon is
  EXPECT_THAT(device, StatusIs(absl::StatusCode::kFailedPrecondition,
                               AllOf(HasSubstr("runs with --device=cpu"), HasSubstr(options.socket_path))));
#else
  EXPECT_THAT(device, AnyOf(StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("built without CUDA")),
                            StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("runs with --device=cpu"))));
#endif
  EXPECT_THAT(client->Allocate(4096, static_cast<MemoryKind>(9)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown memory kind 9")));
  absl::StatusOr<Buffer> host = client->Allocate(4096);
  ASSERT_THAT(host, IsOk());
  EXPECT_EQ(host->memory_kind(), MemoryKind::kHost);
  EXPECT_NE(host->data(), nullptr);
  EXPECT_EQ(host->device_data(), nullptr);
  EXPECT_EQ(host->device(), -1);
  static_cast<float*>(host->data())[0] = 1.5f;
  EXPECT_THAT(client->AllReduce(*host, 0, 1, DType::kFloat32, "g"), IsOk());
  EXPECT_EQ(static_cast<float*>(host->data())[0], 1.5f);
  EXPECT_THAT(host->Release(), IsOk());
  EXPECT_FALSE(host->valid());
}

// ---------------------------------------------------------------------------------------------
// The dynamiqd binary.

// Runs `command`; returns its exit code and what it printed (stdout and stderr).
std::pair<int, std::string> RunCommand(const std::string& command) {
  std::string output;
  FILE* pipe = popen(absl::StrCat(command, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

// A dynamiqd that is expected to refuse its flags; `timeout` ends one that starts instead (status 124).
std::string Dynamiqd(const TempDir& temp, const std::string& flags) {
  return absl::StrCat("timeout 20 ", BinaryPath("DQ_DYNAMIQD", DQ_DYNAMIQD),
                      " --listen=127.0.0.1:0 --metrics_port=-1 --worker_socket=", temp.path(), "/d.sock ", flags);
}

// What dynamiqd --device=cuda says on a machine without a usable GPU (or a build without CUDA).
::testing::Matcher<std::string> RefusesCudaWithoutADevice() {
  return AnyOf(HasSubstr("--device=cuda: no CUDA device is visible"), HasSubstr("--device=cuda: no usable CUDA device"),
               HasSubstr("this dynamiqd was built without CUDA and NCCL"));
}

TEST(DynamiqdDeviceFlagsTest, BadDeviceValuesAreRejected) {
  TempDir temp;
  auto [code, output] = RunCommand(Dynamiqd(temp, "--device=gpu"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("dynamiqd: --device: unknown device 'gpu' (cpu or cuda)"));
  std::tie(code, output) = RunCommand(Dynamiqd(temp, "--device=cuda --cuda_device=-1"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("--cuda_device must be 0 or more, got -1"));
}

TEST(DynamiqdDeviceFlagsTest, CudaWithoutAGpuOrWithoutNcclFailsWithAClearMessage) {
  if (VisibleCudaDevices() > 0) GTEST_SKIP() << "a CUDA device is visible: --device=cuda starts here";
  TempDir temp;
  auto [code, output] = RunCommand(Dynamiqd(temp, "--device=cuda"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, RefusesCudaWithoutADevice());
  EXPECT_THAT(output, Not(HasSubstr("ready")));
}

TEST(DynamiqdDeviceFlagsTest, TransportIsGlooTcpUdpOrNcclAndNcclNeedsAGpuNode) {
  TempDir temp;
  auto [code, output] = RunCommand(Dynamiqd(temp, "--transport=quic"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("--transport must be gloo, tcp, udp or nccl, got 'quic'"));
  // The loss-tolerant all-reduce needs udp, and carries none, bf16 or int8.
  std::tie(code, output) = RunCommand(Dynamiqd(temp, "--lossy_phase_ms=100 --codec=none"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("needs datagrams between the nodes: dynamiqd --transport=udp"));
  std::tie(code, output) = RunCommand(Dynamiqd(temp, "--transport=udp --lossy_phase_ms=100"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("--lossy_phase_ms: the loss-tolerant all-reduce (lossy_phase_ms > 0) carries codec "
                                "none, bf16 or int8, not dynamiq"));
  std::tie(code, output) = RunCommand(Dynamiqd(temp, "--transport=nccl"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("--transport=nccl needs --device=cuda"));
  std::tie(code, output) = RunCommand(Dynamiqd(temp, "--device=cuda --transport=tcp"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("--transport=tcp is for CPU nodes"));
  if (VisibleCudaDevices() == 0) {
    // The hybrid path passes the flag checks and stops at the device, like --device=cuda alone.
    std::tie(code, output) = RunCommand(Dynamiqd(temp, "--device=cuda --transport=gloo"));
    EXPECT_EQ(code, 2) << output;
    EXPECT_THAT(output, RefusesCudaWithoutADevice());
  }
}

TEST(DynamiqdDeviceFlagsTest, HelpDocumentsTheDeviceFlags) {
  auto [code, output] = RunCommand(absl::StrCat(BinaryPath("DQ_DYNAMIQD", DQ_DYNAMIQD), " --help"));
  EXPECT_THAT(output, HasSubstr("--device"));
  EXPECT_THAT(output, HasSubstr("--cuda_device"));
  EXPECT_THAT(output, HasSubstr("--transport"));
  EXPECT_THAT(output, HasSubstr("CUDA IPC"));
}

// Issue 23.10: --version says which version, --help does not repeat the program name or show the
// build machine's path and exits 0, flag names may use dashes, stray words and a budget on one node are errors.
TEST(DynamiqdFlagsTest, VersionHelpDashesStrayWordsAndABudgetOnOneNode) {
  TempDir temp;
  auto [code, output] = RunCommand(absl::StrCat(BinaryPath("DQ_DYNAMIQD", DQ_DYNAMIQD), " --version"));
  EXPECT_EQ(code, 0) << output;
  EXPECT_THAT(output, HasSubstr("dynamiqd 0."));
  EXPECT_THAT(output, HasSubstr("(commit "));
  std::tie(code, output) = RunCommand(absl::StrCat(BinaryPath("DQ_DYNAMIQD", DQ_DYNAMIQD), " --help"));
  EXPECT_EQ(code, 0) << "--help is an answer, not an error (issue 18)";
  EXPECT_THAT(output, HasSubstr("dynamiqd: per-node daemon"));
  EXPECT_THAT(output, Not(HasSubstr("dynamiqd: dynamiqd:")));
  EXPECT_THAT(output, HasSubstr("Flags from server/main.cc:"));
  std::tie(code, output) = RunCommand(Dynamiqd(temp, "stray"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("unexpected argument 'stray'"));
  // Dashes: parsed (the bad --device value is what stops it, not an unknown flag).
  std::tie(code, output) = RunCommand(Dynamiqd(temp, "--metrics-port=-1 --error-sample-rate=0 --device=gpu"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("unknown device 'gpu'"));
  std::tie(code, output) = RunCommand(Dynamiqd(temp, "--target_vnmse=1e-3"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("--target_vnmse needs the compression error measured between nodes"));
}

// A dynamiqd that starts: stopped with SIGTERM after `seconds` (it then exits 0, "stopped").
std::string DynamiqdFor(const TempDir& temp, int seconds, const std::string& flags) {
  return absl::StrCat("timeout -s TERM ", seconds, " ", BinaryPath("DQ_DYNAMIQD", DQ_DYNAMIQD),
                      " --listen=127.0.0.1:0 --metrics_port=-1 --worker_socket=", temp.path(), "/d.sock ", flags);
}

// Issue 44.2: without --bits each codec starts at its own default, the one dynamiqctl set-compression
// and docs/compressors.md give (the global --bits=5 made --codec=arc_topk exit 2 and ran
// global_qsgd at 5 bits); --bits on a codec without a bit setting is refused. Issue 44.9: the log
// says which transport the node uses, and --help no longer says CPU nodes use Gloo TCP.
TEST(DynamiqdFlagsTest, EachCodecStartsWithItsOwnDefaultBitsAndTheLogNamesTheTransport) {
  TempDir temp;
  auto [code, output] = RunCommand(DynamiqdFor(temp, 3, "--codec=arc_topk"));
  EXPECT_THAT(output, HasSubstr(" ready; ")) << output;
  EXPECT_THAT(output, HasSubstr("dynamiqd: transport tcp between nodes; new jobs: arc_topk bits=0.1 ring"));
  std::tie(code, output) = RunCommand(DynamiqdFor(temp, 3, "--codec=global_qsgd"));
  EXPECT_THAT(output, HasSubstr("new jobs: global_qsgd bits=8 ring")) << output;
  std::tie(code, output) = RunCommand(DynamiqdFor(temp, 3, "--transport=gloo"));
  EXPECT_THAT(output, HasSubstr("dynamiqd: transport gloo between nodes; new jobs: dynamiq bits=5 ring")) << output;
  std::tie(code, output) = RunCommand(Dynamiqd(temp, "--codec=int8 --bits=3.7"));
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, HasSubstr("codec int8 has no bit setting"));
  std::tie(code, output) = RunCommand(absl::StrCat(BinaryPath("DQ_DYNAMIQD", DQ_DYNAMIQD), " --help"));
  // --help wraps its lines: compare with the line breaks and indentation folded to spaces.
  const std::string unwrapped = absl::StrJoin(absl::StrSplit(output, absl::ByAnyChar(" \n"), absl::SkipEmpty()), " ");
  EXPECT_THAT(unwrapped, HasSubstr(kernels::DefaultBitsSummary()));
  EXPECT_THAT(output, HasSubstr("tcp by default"));
  EXPECT_THAT(output, Not(HasSubstr("Gloo TCP between nodes")));
}

// ---------------------------------------------------------------------------------------------
// GPU: real device buffers through a --device=cuda daemon (skips without a GPU).

#ifdef DQ_DEVICE_WORKER
// Starts tests/server/device_worker.cc with `flags` (--name=value each); returns its pid. With
// `stdin_fd` / `stdout_fd` (>= 0) the worker's stdin and stdout are those descriptors.
pid_t SpawnWorkerProcess(const std::vector<std::string>& flags, int stdin_fd = -1, int stdout_fd = -1) {
  const std::string worker = BinaryPath("DQ_DEVICE_WORKER", DQ_DEVICE_WORKER);
  std::vector<char*> argv{const_cast<char*>(worker.c_str())};
  for (const std::string& f : flags) argv.push_back(const_cast<char*>(f.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    if (stdin_fd >= 0) dup2(stdin_fd, 0);
    if (stdout_fd >= 0) dup2(stdout_fd, 1);
    execv(worker.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

// A worker checking exact sums: local rank `rank` of `size` at `socket`, contributor `global` of
// `contributors`, `n` floats in a device buffer.
pid_t SpawnDeviceWorker(const std::string& socket, int rank, int size, int global, int contributors, size_t n) {
  return SpawnWorkerProcess({absl::StrCat("--socket=", socket), absl::StrCat("--rank=", rank),
                             absl::StrCat("--size=", size), absl::StrCat("--global=", global),
                             absl::StrCat("--contributors=", contributors), absl::StrCat("--n=", n)});
}

int WaitExit(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class DaemonCudaGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (VisibleCudaDevices() == 0) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount() == 0): GPU test skipped";
  }
};

TEST_F(DaemonCudaGpuTest, LocalWorkersAllReduceDeviceBuffersOnOneNode) {
  TempDir temp;
  Daemon daemon(CudaOptions(temp.path(), Config("none")));
  ASSERT_THAT(daemon.Start(), IsOk());
  const std::string socket = absl::StrCat(temp.path(), "/node0.sock");
  const size_t n = (size_t{1} << 20) + 123;
  std::vector<pid_t> workers;
  for (int r = 0; r < 2; ++r) workers.push_back(SpawnDeviceWorker(socket, r, 2, r, 2, n));
  for (pid_t pid : workers) EXPECT_EQ(WaitExit(pid), 0);
  auto records = daemon.FlightRecorder("device-job", 0);
  ASSERT_THAT(records, IsOk());
  ASSERT_FALSE(records->empty());
  for (const CollectiveRecord& r : *records) EXPECT_EQ(r.state, "ok") << r.error;
  daemon.Shutdown();
}

TEST_F(DaemonCudaGpuTest, TwoGpuNodesAllReduceDeviceBuffersOverNccl) {
  if (VisibleCudaDevices() < 2) GTEST_SKIP() << "needs 2 CUDA devices (one per node)";
  TempDir temp;
  DaemonOptions o0 = CudaOptions(temp.path(), Config("none"));
  o0.num_nodes = 2;
  o0.cuda_device = 0;
  Daemon node0(o0);
  absl::Status s0;
  std::thread t([&] { s0 = node0.Start(); });
  for (int i = 0; i < 1000 && node0.listen_address().empty(); ++i) absl::SleepFor(absl::Milliseconds(10));
  DaemonOptions o1 = ::dynamiq::testing::TestDaemonOptions(temp.path(), 1, 2, Config("none"));
  o1.device = DeviceKind::kCuda;
  o1.cuda_device = 1;
  o1.coordinator = node0.listen_address();
  Daemon node1(o1);
  ASSERT_THAT(node1.Start(), IsOk());
  t.join();
  ASSERT_THAT(s0, IsOk());
  const size_t n = 300000;
  std::vector<pid_t> workers;
  for (int node = 0; node < 2; ++node) {
    workers.push_back(SpawnDeviceWorker(absl::StrCat(temp.path(), "/node", node, ".sock"), 0, 1, node, 2, n));
  }
  for (pid_t pid : workers) EXPECT_EQ(WaitExit(pid), 0);
  node1.Shutdown();
  node0.Shutdown();
}

// The hybrid path (--transport=gloo) makes two daemons on ONE GPU a real two-node cluster (NCCL
// cannot place two ranks on one GPU): two workers per node in device buffers, the exact sum.
TEST_F(DaemonCudaGpuTest, TwoDaemonsOnOneGpuAllReduceOverTheHybridPath) {
  TempDir temp;
  DaemonOptions o0 = CudaOptions(temp.path(), Config("none"));
  o0.num_nodes = 2;
  o0.transport = "gloo";
  Daemon node0(o0);
  absl::Status s0;
  std::thread t([&] { s0 = node0.Start(); });
  for (int i = 0; i < 1000 && node0.listen_address().empty(); ++i) absl::SleepFor(absl::Milliseconds(10));
  DaemonOptions o1 = ::dynamiq::testing::TestDaemonOptions(temp.path(), 1, 2, Config("none"));
  o1.device = DeviceKind::kCuda;
  o1.transport = "gloo";
  o1.coordinator = node0.listen_address();
  Daemon node1(o1);
  ASSERT_THAT(node1.Start(), IsOk());
  t.join();
  ASSERT_THAT(s0, IsOk());
  const size_t n = 300001;  // not a multiple of 256: empty chunks off a super-group boundary too
  std::vector<pid_t> workers;
  for (int node = 0; node < 2; ++node) {
    for (int local = 0; local < 2; ++local) {
      workers.push_back(
          SpawnDeviceWorker(absl::StrCat(temp.path(), "/node", node, ".sock"), local, 2, node * 2 + local, 4, n));
    }
  }
  for (pid_t pid : workers) EXPECT_EQ(WaitExit(pid), 0);
  node1.Shutdown();
  node0.Shutdown();
}
// A stepwise worker (device_worker.cc --out): the test says "go" before each round but the first
// and waits for its "done <r>".
class StepwiseWorker {
 public:
  explicit StepwiseWorker(const std::vector<std::string>& flags) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return;
    pid_ = SpawnWorkerProcess(flags, in[0], out[1]);
    close(in[0]);
    close(out[1]);
    to_ = in[1];
    from_ = fdopen(out[0], "r");
  }
  ~StepwiseWorker() {
    if (to_ >= 0) close(to_);
    if (from_ != nullptr) fclose(from_);
    if (pid_ > 0) Exit();
  }
  void Go() { (void)!write(to_, "go\n", 3); }
  // True once the worker reported round `round` done; false if it ended first.
  bool Done(int round) {
    char line[64];
    return from_ != nullptr && fgets(line, sizeof line, from_) != nullptr &&
           std::string(line) == absl::StrCat("done ", round, "\n");
  }
  int Exit() {
    if (to_ >= 0) close(to_);
    to_ = -1;
    const int code = WaitExit(pid_);
    pid_ = -1;
    return code;
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1;
  FILE* from_ = nullptr;
};

std::vector<float> ReadFloats(const std::string& path, size_t n) {
  std::vector<float> v(n);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return {};
  const size_t read = std::fread(v.data(), sizeof(float), n, f);
  std::fclose(f);
  if (read != n) return {};
  return v;
}

// The demo's schedule: 8 rounds, a compression change after round 0 (to bf16) and after round 3
// (to none). A change made while the job is idle before collective s applies from s + 2 (Daemon::
// SetCompression), so rounds 0-2 run DynamiQ 5 bits, 3-5 bf16, 6-7 none (round 7 averaged).
constexpr int kDemoRounds = 8;
const char* DemoCodec(int round) { return round < 3 ? "dynamiq" : round < 6 ? "bf16" : "none"; }

// Runs the demo's 8 rounds on a two-node cluster of `per_node` workers per node (contributors
// 0..2 per_node - 1); `memory(node, local)` is the worker's buffer memory. Writes
// OUT.node<k>.local<j>.round<r>.
void RunDemoRounds(std::vector<std::unique_ptr<Daemon>>& nodes, const std::string& dir, const std::string& out,
                   size_t n, int per_node, bool reallocate, const std::function<std::string(int, int)>& memory) {
  std::vector<std::unique_ptr<StepwiseWorker>> workers;
  for (int node = 0; node < 2; ++node) {
    for (int local = 0; local < per_node; ++local) {
      workers.push_back(std::make_unique<StepwiseWorker>(std::vector<std::string>{
          absl::StrCat("--socket=", dir, "/node", node, ".sock"), absl::StrCat("--rank=", local),
          absl::StrCat("--size=", per_node), absl::StrCat("--global=", node * per_node + local),
          absl::StrCat("--contributors=", 2 * per_node), absl::StrCat("--n=", n),
          absl::StrCat("--memory=", memory(node, local)), absl::StrCat("--rounds=", kDemoRounds),
          absl::StrCat("--average_round=", kDemoRounds - 1), absl::StrCat("--reallocate=", reallocate),
          absl::StrCat("--out=", out, ".node", node, ".local", local)}));
    }
  }
  for (int round = 0; round < kDemoRounds; ++round) {
    if (round > 0) {
      for (auto& w : workers) w->Go();
    }
    for (size_t w = 0; w < workers.size(); ++w)
      ASSERT_TRUE(workers[w]->Done(round)) << "worker " << w << " round " << round;
    if (round == 0 || round == 3) {
      const char* next = round == 0 ? "bf16" : "none";
      auto changed = nodes[round == 0 ? 0 : 1]->SetCompression(
          "device-job",
          [next](const JobConfig&) -> absl::StatusOr<JobConfig> {
            return MakeJobConfig(next, 0, "ring", 0, "measured");
          },
          std::nullopt);
      ASSERT_THAT(changed, IsOk());
    }
  }
  for (auto& w : workers) EXPECT_EQ(w->Exit(), 0);
  for (auto& node : nodes) {
    auto records = node->FlightRecorder("device-job", 0);
    ASSERT_THAT(records, IsOk());
    ASSERT_EQ(records->size(), static_cast<size_t>(kDemoRounds));
    for (int r = 0; r < kDemoRounds; ++r) {
      EXPECT_EQ((*records)[r].state, "ok") << (*records)[r].error;
      EXPECT_EQ(kernels::CodecName((*records)[r].config.codec.id), DemoCodec(r)) << "round " << r;
    }
  }
}

// The demo's shape: workers per node and floats per buffer (not a multiple of 256).
struct DemoShape {
  int per_node = 2;
  size_t n = 300001;
  bool reallocate = false;  // a new buffer every round (device_worker.cc --reallocate)
};

// Runs the demo on a fresh two-node cluster in `dir` (GPU nodes over the hybrid path if `cuda`,
// workers' buffers alternating device and host memory there, device only with one worker per
// node; else CPU nodes, host buffers).
void RunDemo(const std::string& dir, bool cuda, DemoShape shape = {}) {
  auto nodes =
      ::dynamiq::testing::StartTestCluster(dir, 2, Config("dynamiq", 5), absl::Seconds(20), [cuda](DaemonOptions& o) {
        if (!cuda) return;
        o.device = DeviceKind::kCuda;
        o.transport = "gloo";
      });
  ASSERT_THAT(nodes, IsOk());
  RunDemoRounds(*nodes, dir, dir + "/r", shape.n, shape.per_node, shape.reallocate, [cuda, shape](int node, int local) {
    return cuda && (shape.per_node == 1 || node == local) ? "device" : "host";
  });
  for (auto& node : *nodes) node->Shutdown();
}

// Checks the demo's results in `dirs` (RunDemo's): in every round, every worker of every run holds
// the same bits as node 0's worker 0 of the last run; the error against the exact sum is 0 for
// none and small for the compressed codecs. Prints one line per round.
void CheckDemo(const std::vector<std::string>& dirs, DemoShape shape = {}) {
  const size_t n = shape.n;
  const int contributors = 2 * shape.per_node;
  for (int round = 0; round < kDemoRounds; ++round) {
    const std::string suffix = absl::StrCat(".round", round);
    const std::vector<float> reference = ReadFloats(dirs.back() + "/r.node0.local0" + suffix, n);
    ASSERT_EQ(reference.size(), n) << "round " << round;
    int identical = 0;
    for (const std::string& dir : dirs) {
      for (int node = 0; node < 2; ++node) {
        for (int local = 0; local < shape.per_node; ++local) {
          const std::vector<float> got = ReadFloats(absl::StrCat(dir, "/r.node", node, ".local", local, suffix), n);
          ASSERT_EQ(got.size(), n);
          const bool same = std::memcmp(got.data(), reference.data(), n * sizeof(float)) == 0;
          EXPECT_TRUE(same) << dir << " node " << node << " local " << local << " round " << round << " differs from "
                            << dirs.back() << "'s node 0 worker 0";
          identical += same;
        }
      }
    }
    double err = 0, norm = 0;
    const bool average = round == kDemoRounds - 1;
    for (size_t i = 0; i < n; ++i) {
      float sum = 0;
      for (int c = 0; c < contributors; ++c)
        sum += 0.5f * static_cast<float>(c + 1) + static_cast<float>((i + round) % 7) - 3.0f;
      const float exact = average ? sum * (1.0f / static_cast<float>(contributors)) : sum;
      err += (static_cast<double>(reference[i]) - exact) * (static_cast<double>(reference[i]) - exact);
      norm += static_cast<double>(exact) * exact;
    }
    const double vnmse = err / norm;
    const std::string codec = DemoCodec(round);
    const double bound = codec == "none" ? 0 : codec == "bf16" ? 1e-4 : 1e-2;
    EXPECT_LE(vnmse, bound) << "round " << round << " (" << codec << ")";
    std::printf("demo: round %d %-7s vNMSE vs exact sum %.3g; %d of %zu workers' results bit-identical\n", round,
                codec.c_str(), vnmse, identical, contributors * dirs.size());
  }
}

// The demo's harness on CPU nodes (no GPU needed): the compression changes land at the rounds
// DemoCodec says, and the results are identical on all workers and exact when uncompressed.
TEST(DaemonDemoTest, CpuClusterFollowsTheCompressionChangesAtTheAgreedRounds) {
  for (const DemoShape shape : {DemoShape{2, 300001, false}, DemoShape{1, 100003, true}}) {
    TempDir dir;
    ASSERT_NO_FATAL_FAILURE(RunDemo(dir.path(), false, shape));
    CheckDemo({dir.path()}, shape);
  }
}

// The GPU demo (scripts/gpu-check's gpu-demo step): two --device=cuda daemons on one GPU over the
// hybrid path, two workers each (device and host buffers mixed), DynamiQ 5 bits changed at run
// time to bf16 and then to none. Every round's result must be bit for bit that of a CPU cluster
// running the same rounds (and the same on every worker), exact in the uncompressed rounds.
TEST_F(DaemonCudaGpuTest, GpuDemoTwoDaemonsOnOneGpuMatchACpuClusterAcrossCompressionChanges) {
  TempDir gpu_dir, cpu_dir;
  ASSERT_NO_FATAL_FAILURE(RunDemo(gpu_dir.path(), true));
  ASSERT_NO_FATAL_FAILURE(RunDemo(cpu_dir.path(), false));
  CheckDemo({gpu_dir.path(), cpu_dir.path()});
}

// One worker per node (the local reduce is a copy), device buffers only, 100003 floats, a new
// buffer every round: the shape of dynamiq.torch's two-daemon CUDA tests
// (tests/python/test_torch_cuda.py).
TEST_F(DaemonCudaGpuTest, OneDeviceWorkerPerNodeMatchesACpuClusterAcrossCompressionChanges) {
  TempDir gpu_dir, cpu_dir;
  const DemoShape shape{1, 100003, true};
  ASSERT_NO_FATAL_FAILURE(RunDemo(gpu_dir.path(), true, shape));
  ASSERT_NO_FATAL_FAILURE(RunDemo(cpu_dir.path(), false, shape));
  CheckDemo({gpu_dir.path(), cpu_dir.path()}, shape);
}

#endif  // DQ_DEVICE_WORKER

}  // namespace
}  // namespace dynamiq::server

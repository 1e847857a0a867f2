// What a hostile or buggy local worker can send over the raw worker API (issue 22): requests that
// race each other, absurd indices and names. Each case asserts a clear status code and a daemon that
// keeps serving; the security suite (docs/security.md, docs/errors.md).
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "dynamiq/v1/control.grpc.pb.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/metrics.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::ConnectTestWorker;
using ::dynamiq::testing::DaemonTestWorker;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::RejectedRequests;
using ::dynamiq::testing::TempDir;
using ::dynamiq::testing::TestDaemonOptions;

JobConfig Config() { return *MakeJobConfig("dynamiq", 5, "ring", 1024, "measured"); }

uint64_t AllocateBuffer(DaemonTestWorker& w, size_t bytes) {
  dynamiq::v1::AllocateBufferRequest request;
  request.set_worker_id(w.id);
  request.set_bytes(bytes);
  dynamiq::v1::AllocateBufferResponse response;
  grpc::ClientContext context;
  const grpc::Status s = w.stub->AllocateBuffer(&context, request, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response.buffer_id();
}

grpc::Status ReleaseBuffer(DaemonTestWorker& w, uint64_t buffer_id) {
  dynamiq::v1::ReleaseBufferRequest request;
  request.set_worker_id(w.id);
  request.set_buffer_id(buffer_id);
  dynamiq::v1::ReleaseBufferResponse response;
  grpc::ClientContext context;
  return w.stub->ReleaseBuffer(&context, request, &response);
}

// The crash of issue 22, item 1: ReleaseBuffer in flight together with an AllReduce on the same
// buffer, thousands of times. Before use and release were one admission, the release unmapped the
// buffer under the reducer and dynamiqd died with SIGSEGV within seconds.
TEST(HostileWorkerTest, ReleaseRacingAnAllReduceOnTheSameBufferNeverCrashesTheDaemon) {
  TempDir temp;
  Daemon daemon(TestDaemonOptions(temp.path(), 0, 1, Config()));
  ASSERT_THAT(daemon.Start(), IsOk());
  absl::StatusOr<DaemonTestWorker> w = ConnectTestWorker(absl::StrCat(temp.path(), "/node0.sock"), "race", 0, 1, 1024);
  ASSERT_THAT(w, IsOk());
  constexpr int kRounds = 2000;
  constexpr size_t kFloats = 262144;  // 1 MiB: the reducer takes long enough to be overtaken
  int reduced_then_refused = 0, reduced_then_released = 0, released_first = 0;
  for (int round = 0; round < kRounds; ++round) {
    const uint64_t buffer = AllocateBuffer(*w, kFloats * 4);
    ASSERT_NE(buffer, 0u);
    // Both RPCs leave together on the asynchronous API.
    dynamiq::v1::AllReduceRequest reduce;
    reduce.set_worker_id(w->id);
    reduce.set_tensor_name("g");
    reduce.set_buffer_id(buffer);
    reduce.set_num_elements(kFloats);
    reduce.set_dtype(dynamiq::v1::DTYPE_FLOAT32);
    reduce.set_average(true);  // one local worker: only averaging makes the reducer touch the memory
    dynamiq::v1::ReleaseBufferRequest release;
    release.set_worker_id(w->id);
    release.set_buffer_id(buffer);
    dynamiq::v1::AllReduceResponse reduce_response;
    dynamiq::v1::ReleaseBufferResponse release_response;
    grpc::ClientContext reduce_context, release_context;
    const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(30);
    reduce_context.set_deadline(deadline);
    release_context.set_deadline(deadline);
    grpc::Status reduced, released;
    absl::Notification reduce_done, release_done;
    if (round % 2 == 0) {
      w->stub->async()->AllReduce(&reduce_context, &reduce, &reduce_response, [&](grpc::Status s) {
        reduced = s;
        reduce_done.Notify();
      });
    }
    w->stub->async()->ReleaseBuffer(&release_context, &release, &release_response, [&](grpc::Status s) {
      released = s;
      release_done.Notify();
    });
    if (round % 2 == 1) {
      w->stub->async()->AllReduce(&reduce_context, &reduce, &reduce_response, [&](grpc::Status s) {
        reduced = s;
        reduce_done.Notify();
      });
    }
    reduce_done.WaitForNotification();
    release_done.WaitForNotification();
    if (reduced.ok()) {
      if (released.ok()) {
        ++reduced_then_released;  // the release came after the all-reduce completed
      } else {
        ASSERT_EQ(released.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << released.error_message();
        ASSERT_TRUE(absl::StrContains(released.error_message(), "has not completed")) << released.error_message();
        ++reduced_then_refused;
        const grpc::Status again = ReleaseBuffer(*w, buffer);  // the all-reduce is done now
        ASSERT_TRUE(again.ok()) << again.error_message();
      }
    } else {
      // The release came first: the all-reduce finds no buffer.
      ASSERT_EQ(reduced.error_code(), grpc::StatusCode::NOT_FOUND) << round << ": " << reduced.error_message();
      ASSERT_TRUE(released.ok()) << released.error_message();
      ++released_first;
    }
  }
  std::printf("all-reduce first, release refused: %d; all-reduce first, then released: %d; released first: %d\n",
              reduced_then_refused, reduced_then_released, released_first);
  EXPECT_EQ(reduced_then_refused + reduced_then_released + released_first, kRounds);
  // Still serving, and every buffer of the loop is gone.
  for (size_t k = 0; k < 1024; ++k) w->data()[k] = 2.0f;
  const grpc::Status s = w->AllReduce("after", 1024);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(w->data()[5], 2.0f);
  daemon.Shutdown();
}

grpc::Status Register(dynamiq::v1::Worker::Stub& stub, const std::string& job, dynamiq::v1::RegisterResponse* out,
                      uint32_t rank = 0, uint32_t size = 1) {
  dynamiq::v1::RegisterRequest request;
  request.set_job_id(job);
  request.set_local_rank(rank);
  request.set_local_world_size(size);
  grpc::ClientContext context;
  return stub.Register(&context, request, out);
}

// Issue 22.6: one absurd submission index used to park a collective where the job never gets, and
// every later all-reduce of the worker timed out. Now it is refused, saying why, and the worker
// goes on.
TEST(HostileWorkerTest, ASubmissionIndexFarAheadIsRefusedAndTheWorkerGoesOn) {
  TempDir temp;
  DaemonOptions o = TestDaemonOptions(temp.path(), 0, 1, Config());
  o.timeout = absl::Seconds(5);
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  absl::StatusOr<DaemonTestWorker> w = ConnectTestWorker(o.worker_socket, "j", 0, 1, 256);
  ASSERT_THAT(w, IsOk());
  auto submit = [&](std::optional<uint64_t> submission) {
    return w->AllReduce("g", 256, /*average=*/false, /*response=*/nullptr, submission);
  };
  for (uint64_t bad : {uint64_t{1} << 39, uint64_t{1} << 16, std::numeric_limits<uint64_t>::max()}) {
    const grpc::Status s = submit(bad);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("too far ahead")) << bad;
  }
  // Unnumbered and numbered all-reduces still complete at once.
  const absl::Time start = absl::Now();
  EXPECT_TRUE(submit(std::nullopt).ok());
  const grpc::Status numbered = submit(1);
  EXPECT_TRUE(numbered.ok()) << numbered.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  const grpc::Status stale = submit(0);  // collective 0 already ran
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << stale.error_message();
  EXPECT_THAT(stale.error_message(), ::testing::HasSubstr("already ran"));
  daemon.Shutdown();
}

// Issue 22.7: names. Malformed ones are INVALID_ARGUMENT, counted, and quoted back only in part.
TEST(HostileWorkerTest, MalformedNamesAndWorkerIdsAreRefusedClearlyAndCounted) {
  TempDir temp;
  DaemonOptions o = TestDaemonOptions(temp.path(), 0, 1, Config());
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  auto stub =
      dynamiq::v1::Worker::NewStub(grpc::CreateChannel("unix:" + o.worker_socket, grpc::InsecureChannelCredentials()));
  const double before = RejectedRequests(daemon, "invalid_argument");
  struct Case {
    std::string job, expect;
  };
  const std::vector<Case> cases = {
      {std::string(1 << 20, 'j'), "longer than 256 bytes"},
      {"a\nb", "control character"},
      {std::string("bad\xff\xfe", 5), "not valid UTF-8"},
      {std::string("over\xc0\x80long", 10), "not valid UTF-8"},
      {"", "job id is empty"},
  };
  for (const Case& c : cases) {
    dynamiq::v1::RegisterResponse response;
    const grpc::Status s = Register(*stub, c.job, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr(c.expect));
    EXPECT_LT(s.error_message().size(), 300u);
  }
  // A valid UTF-8 job id is fine.
  dynamiq::v1::RegisterResponse registered;
  ASSERT_TRUE(Register(*stub, "j\xc3\xa9", &registered).ok());
  for (const std::string& id : std::vector<std::string>{" 1", "1 ", "+1", "0x1", "01a", std::string(30, '1'), ""}) {
    dynamiq::v1::UnregisterRequest request;
    request.set_worker_id(id);
    dynamiq::v1::UnregisterResponse response;
    grpc::ClientContext context;
    const grpc::Status s = stub->Unregister(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "'" << id << "': " << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("malformed worker id"));
  }
  {
    dynamiq::v1::AllReduceRequest request;
    request.set_worker_id(registered.worker_id());
    request.set_tensor_name(std::string("t\xff", 2));
    request.set_num_elements(1);
    request.set_dtype(dynamiq::v1::DTYPE_FLOAT32);
    dynamiq::v1::AllReduceResponse response;
    grpc::ClientContext context;
    const grpc::Status s = stub->AllReduce(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("tensor name"));
  }
  EXPECT_EQ(RejectedRequests(daemon, "invalid_argument"), before + cases.size() + 7 + 1);
  daemon.Shutdown();
}

// Issue 22.7: SetCompression refuses non-finite and out-of-range bits whatever the codec, and
// quotes a huge job id or codec name only in part (it used to exceed gRPC's metadata limit).
TEST(HostileWorkerTest, SetCompressionRefusesBadBitsAndHugeNamesWithTheRightCode) {
  TempDir temp;
  DaemonOptions o = TestDaemonOptions(temp.path(), 0, 1, Config());
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  absl::StatusOr<DaemonTestWorker> w = ConnectTestWorker(o.worker_socket, "j", 0, 1, 16);
  ASSERT_THAT(w, IsOk());
  auto control =
      dynamiq::v1::Control::NewStub(grpc::CreateChannel(daemon.listen_address(), grpc::InsecureChannelCredentials()));
  auto set = [&](const std::string& job, const std::string& codec, double bits) {
    dynamiq::v1::SetCompressionRequest request;
    request.set_job_id(job);
    request.mutable_config()->set_codec(codec);
    request.mutable_config()->set_bits(bits);
    dynamiq::v1::SetCompressionResponse response;
    grpc::ClientContext context;
    return control->SetCompression(&context, request, &response);
  };
  const double inf = std::numeric_limits<double>::infinity();
  for (const std::string codec : {"bf16", "none", "mxfp8", "dynamiq", "uniform"}) {
    for (double bits : {std::nan(""), -7.0, inf, -inf, 1e308}) {
      const grpc::Status s = set("j", codec, bits);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << codec << " " << bits;
      EXPECT_THAT(s.error_message(), ::testing::HasSubstr("bits")) << codec << " " << bits;
    }
  }
  // A codec without a bit setting refuses bits it would never use (issue 44.6), and takes 0.
  const grpc::Status unused = set("j", "bf16", 5);
  EXPECT_EQ(unused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << unused.error_message();
  EXPECT_THAT(unused.error_message(), ::testing::HasSubstr("codec bf16 has no bit setting"));
  ASSERT_TRUE(set("j", "bf16", 0).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(w->AllReduce("g", 16).ok());  // the change applies at a boundary
  auto statuses = daemon.JobStatuses();
  EXPECT_EQ(statuses["j"].config.codec.id, kernels::CodecId::kBf16);
  EXPECT_EQ(statuses["j"].config.codec.bits, 0);
  const grpc::Status huge_job = set(std::string(1 << 20, 'x'), "bf16", 0);
  EXPECT_EQ(huge_job.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << huge_job.error_message();
  EXPECT_LT(huge_job.error_message().size(), 300u);
  const grpc::Status huge_codec = set("j", std::string(1 << 20, 'c'), 0);
  EXPECT_EQ(huge_codec.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << huge_codec.error_message();
  EXPECT_LT(huge_codec.error_message().size(), 300u);
  const grpc::Status unknown = set("nope", "bf16", 0);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << unknown.error_message();
  daemon.Shutdown();
}

// Issue 22.7: daemon-wide caps on buffers (the kernel's map count) and jobs (threads).
TEST(HostileWorkerTest, BufferAndJobCapsAreResourceExhaustedAndFreeAgain) {
  TempDir temp;
  DaemonOptions o = TestDaemonOptions(temp.path(), 0, 1, Config());
  o.max_buffers = 3;
  o.max_jobs = 2;
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  absl::StatusOr<DaemonTestWorker> a = ConnectTestWorker(o.worker_socket, "a", 0, 1, 16);  // buffer 1
  absl::StatusOr<DaemonTestWorker> b = ConnectTestWorker(o.worker_socket, "b", 0, 1, 16);  // buffer 2
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  const uint64_t third = AllocateBuffer(*a, 64);
  ASSERT_NE(third, 0u);
  {
    dynamiq::v1::AllocateBufferRequest request;
    request.set_worker_id(b->id);
    request.set_bytes(64);
    dynamiq::v1::AllocateBufferResponse response;
    grpc::ClientContext context;
    const grpc::Status s = b->stub->AllocateBuffer(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("--max_buffers"));
  }
  ASSERT_TRUE(ReleaseBuffer(*a, third).ok());
  EXPECT_NE(AllocateBuffer(*b, 64), 0u);  // room again

  auto stub =
      dynamiq::v1::Worker::NewStub(grpc::CreateChannel("unix:" + o.worker_socket, grpc::InsecureChannelCredentials()));
  dynamiq::v1::RegisterResponse response;
  const grpc::Status third_job = Register(*stub, "c", &response);
  EXPECT_EQ(third_job.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << third_job.error_message();
  EXPECT_THAT(third_job.error_message(), ::testing::HasSubstr("--max_jobs"));
  {
    dynamiq::v1::UnregisterRequest request;
    request.set_worker_id(a->id);
    dynamiq::v1::UnregisterResponse r;
    grpc::ClientContext context;
    ASSERT_TRUE(a->stub->Unregister(&context, request, &r).ok());  // job a retires
  }
  EXPECT_TRUE(Register(*stub, "c", &response).ok());
  daemon.Shutdown();
}

}  // namespace
}  // namespace dynamiq::server

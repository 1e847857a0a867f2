// What a hostile or buggy local worker can send over the raw worker API (issue 22): requests that
// race each other, absurd indices and names. Each case asserts a clear status code and a daemon that
// keeps serving; the security suite (docs/security.md, docs/errors.md).
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::ConnectTestWorker;
using ::dynamiq::testing::DaemonTestWorker;
using ::dynamiq::testing::IsOk;
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

}  // namespace
}  // namespace dynamiq::server

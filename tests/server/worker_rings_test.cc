// Submission rings end to end (server/worker_rings.h, client/ring_submitter.h): a real dynamiqd
// (in process) and real clients, one worker through its ring and one through AllReduce calls in the
// same collectives, errors worded alike on both paths, deadlines, shutdown, and a worker that
// breaks its ring's protocol.
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "dynamiq/client.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ipc/shm_region.h"
#include "ipc/submission_ring_layout.h"
#include "server/daemon.h"
#include "server/metrics.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class RingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dqrings-XXXXXX";
    dir_ = mkdtemp(tmpl);
    DaemonOptions o;
    o.num_nodes = 1;
    o.listen = "127.0.0.1:0";
    o.worker_socket = dir_ + "/node0.sock";
    o.default_config = *MakeJobConfig("none", 0, "ring", 1024, "measured");
    o.timeout = absl::Seconds(20);
    daemon_ = std::make_unique<Daemon>(o);
    ASSERT_THAT(daemon_->Start(), IsOk());
  }
  void TearDown() override {
    daemon_.reset();
    std::filesystem::remove_all(dir_);
  }

  absl::StatusOr<Client> Connect(const std::string& job, uint32_t rank, uint32_t size, bool ring = true,
                                 absl::Duration timeout = absl::Seconds(30)) {
    ClientOptions o;
    o.socket_path = dir_ + "/node0.sock";
    o.job_id = job;
    o.local_rank = rank;
    o.local_world_size = size;
    o.submission_ring = ring;
    o.timeout = timeout;
    return Client::Connect(o);
  }
  std::unique_ptr<dynamiq::v1::Worker::Stub> Stub() {
    return dynamiq::v1::Worker::NewStub(
        grpc::CreateChannel("unix:" + dir_ + "/node0.sock", grpc::InsecureChannelCredentials()));
  }

  std::string dir_;
  std::unique_ptr<Daemon> daemon_;
};

float* Floats(Buffer& b) { return static_cast<float*>(b.data()); }

TEST_F(RingTest, ARingWorkerAndACallWorkerReduceTogetherExactly) {
  absl::StatusOr<Client> a = Connect("j", 0, 2, /*ring=*/true);
  absl::StatusOr<Client> b = Connect("j", 1, 2, /*ring=*/false);
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(b.status(), IsOk());
  EXPECT_TRUE(a->uses_submission_ring());
  EXPECT_FALSE(b->uses_submission_ring());
  EXPECT_THAT(daemon_->metrics().Render(), HasSubstr("\ndynamiq_submission_rings 1\n"));
  constexpr size_t n = 1000;
  absl::StatusOr<Buffer> ba = a->Allocate(n * 4);
  absl::StatusOr<Buffer> bb = b->Allocate(n * 4);
  ASSERT_THAT(ba.status(), IsOk());
  ASSERT_THAT(bb.status(), IsOk());
  for (int step = 0; step < 20; ++step) {
    for (size_t k = 0; k < n; ++k) {
      Floats(*ba)[k] = static_cast<float>(k + step);
      Floats(*bb)[k] = 2.0f * static_cast<float>(k);
    }
    AllReduceResult ra, rb;
    absl::Status sb;
    std::thread tb([&] { sb = b->AllReduce(*bb, 0, n, DType::kFloat32, "grad", /*average=*/true, &rb); });
    const absl::Status sa = a->AllReduce(*ba, 0, n, DType::kFloat32, "grad", /*average=*/true, &ra);
    tb.join();
    ASSERT_THAT(sa, IsOk());
    ASSERT_THAT(sb, IsOk());
    for (size_t k = 0; k < n; ++k) {
      const float mean = (static_cast<float>(k + step) + 2.0f * static_cast<float>(k)) / 2;
      ASSERT_EQ(Floats(*ba)[k], mean) << k;
      ASSERT_EQ(Floats(*bb)[k], mean) << k;
    }
    EXPECT_EQ(ra.sequence, static_cast<uint64_t>(step));
    EXPECT_EQ(ra.sequence, rb.sequence);
    EXPECT_EQ(ra.codec, rb.codec);
    EXPECT_EQ(ra.contributors, 2u);
    EXPECT_EQ(ra.weight_sum, rb.weight_sum);
    EXPECT_THAT(ra.nodes, ElementsAre(0));
  }
}

TEST_F(RingTest, MoreAsyncAllReducesThanSlotsCompleteInOrderOverBothPaths) {
  absl::StatusOr<Client> a = Connect("j", 0, 2);
  absl::StatusOr<Client> b = Connect("j", 1, 2);
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(b.status(), IsOk());
  constexpr size_t kTensors = Daemon::kDefaultRingSlots * 2 + 5;  // the rest go by gRPC
  constexpr size_t n = 64;
  absl::StatusOr<Buffer> ba = a->Allocate(kTensors * n * 4);
  absl::StatusOr<Buffer> bb = b->Allocate(kTensors * n * 4);
  ASSERT_THAT(ba.status(), IsOk());
  ASSERT_THAT(bb.status(), IsOk());
  for (size_t k = 0; k < kTensors * n; ++k) {
    Floats(*ba)[k] = static_cast<float>(k);
    Floats(*bb)[k] = 1.0f;
  }
  std::vector<Future> fa, fb;
  for (size_t t = 0; t < kTensors; ++t) {
    const std::string name = absl::StrCat("t", t);
    fa.push_back(a->AllReduceAsync(*ba, t * n * 4, n, DType::kFloat32, name));
    fb.push_back(b->AllReduceAsync(*bb, t * n * 4, n, DType::kFloat32, name));
  }
  for (size_t t = 0; t < kTensors; ++t) {
    ASSERT_THAT(fa[t].Wait(), IsOk()) << t;
    ASSERT_THAT(fb[t].Wait(), IsOk()) << t;
    EXPECT_EQ(fa[t].result().sequence, t);
    EXPECT_EQ(fb[t].result().sequence, t);
  }
  for (size_t k = 0; k < kTensors * n; ++k) {
    ASSERT_EQ(Floats(*ba)[k], static_cast<float>(k) + 1.0f) << k;
    ASSERT_EQ(Floats(*bb)[k], static_cast<float>(k) + 1.0f) << k;
  }
}

TEST_F(RingTest, TheDaemonsErrorsReadTheSameThroughTheRingAndThroughCalls) {
  std::vector<absl::Status> errors;
  for (bool ring : {true, false}) {
    absl::StatusOr<Client> c = Connect(ring ? "r" : "c", 0, 1, ring);
    ASSERT_THAT(c.status(), IsOk());
    ASSERT_EQ(c->uses_submission_ring(), ring);
    absl::StatusOr<Buffer> buf = c->Allocate(4096);
    ASSERT_THAT(buf.status(), IsOk());
    errors.push_back(c->AllReduce(*buf, 0, 16, DType::kFloat32, "bad\nname"));
    // The worker goes on at once after a refused request.
    EXPECT_THAT(c->AllReduce(*buf, 0, 16, DType::kFloat32, "good"), IsOk());
  }
  EXPECT_THAT(errors[0], StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor name")));
  EXPECT_EQ(errors[0], errors[1]);
}

// A refused all-reduce keeps its place in the worker's numbering: its collective fails for the
// other local workers at once (naming the refusal), and both go on with the next one, on both
// paths (before, the worker's next all-reduce waited behind it until --timeout).
TEST_F(RingTest, ARefusedAllReduceFailsItsCollectiveForEveryWorkerAndTheNextOneRuns) {
  for (bool ring : {true, false}) {
    SCOPED_TRACE(ring ? "ring" : "calls");
    const std::string job = ring ? "r" : "c";
    absl::StatusOr<Client> a = Connect(job, 0, 2, ring);
    absl::StatusOr<Client> b = Connect(job, 1, 2, ring);
    ASSERT_THAT(a.status(), IsOk());
    ASSERT_THAT(b.status(), IsOk());
    absl::StatusOr<Buffer> ba = a->Allocate(4096);
    absl::StatusOr<Buffer> bb = b->Allocate(4096);
    const absl::Time start = absl::Now();
    EXPECT_THAT(a->AllReduce(*ba, 0, 16, DType::kFloat32, "bad\nname"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("control character")));
    EXPECT_THAT(b->AllReduce(*bb, 0, 16, DType::kFloat32, "x"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("local rank 0's all-reduce of it was refused (tensor name")));
    for (int i = 0; i < 2; ++i) {
      Floats(*ba)[0] = 1.0f;
      Floats(*bb)[0] = 2.0f;
      absl::Status sb;
      std::thread tb([&] { sb = b->AllReduce(*bb, 0, 16, DType::kFloat32, "y"); });
      AllReduceResult r;
      EXPECT_THAT(a->AllReduce(*ba, 0, 16, DType::kFloat32, "y", false, &r), IsOk());
      tb.join();
      EXPECT_THAT(sb, IsOk());
      EXPECT_EQ(r.sequence, static_cast<uint64_t>(i + 1));
      EXPECT_EQ(Floats(*ba)[0], 3.0f);
    }
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // nobody waited for --timeout (20 s)
  }
}

TEST_F(RingTest, LocalWorkersThatDisagreeAreToldAlikeOnBothPaths) {
  absl::StatusOr<Client> a = Connect("j", 0, 2, /*ring=*/true);
  absl::StatusOr<Client> b = Connect("j", 1, 2, /*ring=*/false);
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(b.status(), IsOk());
  absl::StatusOr<Buffer> ba = a->Allocate(4096);
  absl::StatusOr<Buffer> bb = b->Allocate(4096);
  absl::Status sb;
  std::thread tb([&] { sb = b->AllReduce(*bb, 0, 99, DType::kFloat32, "x"); });
  const absl::Status sa = a->AllReduce(*ba, 0, 100, DType::kFloat32, "x");
  tb.join();
  EXPECT_THAT(sa, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("local rank 1 submitted 'x' (99")));
  EXPECT_EQ(sa, sb);
}

TEST_F(RingTest, AnAllReducePastTheClientsDeadlineSaysSoAndTheRingGoesOn) {
  absl::StatusOr<Client> a = Connect("j", 0, 2, /*ring=*/true, absl::Milliseconds(300));
  absl::StatusOr<Client> b = Connect("j", 1, 2, /*ring=*/false);
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(b.status(), IsOk());
  absl::StatusOr<Buffer> ba = a->Allocate(4096);
  absl::StatusOr<Buffer> bb = b->Allocate(4096);
  const absl::Time start = absl::Now();
  EXPECT_THAT(a->AllReduce(*ba, 0, 16, DType::kFloat32, "x"),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("DQ_TIMEOUT_SECONDS")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The daemon still holds collective 0 for a; b completes it, then both run the next one.
  ASSERT_THAT(b->AllReduce(*bb, 0, 16, DType::kFloat32, "x"), IsOk());
  absl::Status sb;
  std::thread tb([&] { sb = b->AllReduce(*bb, 0, 16, DType::kFloat32, "y"); });
  AllReduceResult r;
  EXPECT_THAT(a->AllReduce(*ba, 0, 16, DType::kFloat32, "y", AllReduceOptions{}, &r), IsOk());
  tb.join();
  EXPECT_THAT(sb, IsOk());
  EXPECT_EQ(r.sequence, 1u);
}

TEST_F(RingTest, ShutdownAnswersAWaitingWorkerPromptly) {
  absl::StatusOr<Client> a = Connect("j", 0, 2);
  absl::StatusOr<Client> b = Connect("j", 1, 2);  // never submits
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(b.status(), IsOk());
  absl::StatusOr<Buffer> ba = a->Allocate(4096);
  std::thread stop([&] {
    absl::SleepFor(absl::Milliseconds(200));
    daemon_->Shutdown();
  });
  const absl::Time start = absl::Now();
  const absl::Status s = a->AllReduce(*ba, 0, 16, DType::kFloat32, "x");
  stop.join();
  EXPECT_FALSE(s.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // The ring is closed now: the next all-reduce is told why.
  EXPECT_THAT(a->AllReduce(*ba, 0, 16, DType::kFloat32, "x"), StatusIs(absl::StatusCode::kUnavailable));
}

// A worker that registers and takes a ring through raw calls, then writes into it.
struct RawWorker {
  std::unique_ptr<dynamiq::v1::Worker::Stub> stub;
  std::string id;
  ipc::ShmRegion ring;
  ipc::ring::Header& header() { return *reinterpret_cast<ipc::ring::Header*>(ring.data()); }
};

TEST_F(RingTest, AWorkerThatBreaksItsRingLosesItAndNothingElse) {
  RawWorker w;
  w.stub = Stub();
  {
    dynamiq::v1::RegisterRequest req;
    req.set_job_id("hostile");
    req.set_local_world_size(1);
    dynamiq::v1::RegisterResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(w.stub->Register(&ctx, req, &resp).ok());
    w.id = resp.worker_id();
  }
  dynamiq::v1::OpenSubmissionRingResponse opened;
  {
    dynamiq::v1::OpenSubmissionRingRequest req;
    req.set_worker_id(w.id);
    grpc::ClientContext ctx;
    ASSERT_TRUE(w.stub->OpenSubmissionRing(&ctx, req, &opened).ok());
    EXPECT_EQ(opened.slots(), Daemon::kDefaultRingSlots);
  }
  {
    dynamiq::v1::OpenSubmissionRingRequest req;
    req.set_worker_id(w.id);
    dynamiq::v1::OpenSubmissionRingResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(w.stub->OpenSubmissionRing(&ctx, req, &resp).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  }
  absl::StatusOr<ipc::ShmRegion> ring = ipc::ShmRegion::Open(opened.shm_name(), opened.bytes());
  ASSERT_THAT(ring.status(), IsOk());
  w.ring = *std::move(ring);
  ipc::ring::Atomic(w.header().sq_head).store(100000);
  ipc::ring::FutexWakeAll(w.header().sq_head);
  const absl::Time start = absl::Now();
  while (ipc::ring::Atomic(w.header().closed).load() == 0 && absl::Now() - start < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(ipc::ring::Atomic(w.header().closed).load(), 1u);
  EXPECT_THAT(std::string(w.header().reason, w.header().reason_bytes), HasSubstr("100000 submissions"));
  // Another job's worker goes on through its ring.
  absl::StatusOr<Client> good = Connect("good", 0, 1);
  ASSERT_THAT(good.status(), IsOk());
  ASSERT_TRUE(good->uses_submission_ring());
  absl::StatusOr<Buffer> buf = good->Allocate(4096);
  for (int i = 0; i < 3; ++i) EXPECT_THAT(good->AllReduce(*buf, 0, 16, DType::kFloat32, "x"), IsOk());
}

TEST_F(RingTest, OpenSubmissionRingChecksItsCaller) {
  auto stub = Stub();
  auto open = [&](const std::string& worker, uint32_t slots) {
    dynamiq::v1::OpenSubmissionRingRequest req;
    req.set_worker_id(worker);
    req.set_slots(slots);
    dynamiq::v1::OpenSubmissionRingResponse resp;
    grpc::ClientContext ctx;
    return stub->OpenSubmissionRing(&ctx, req, &resp).error_code();
  };
  EXPECT_EQ(open("777", 0), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(open("x", 0), grpc::StatusCode::INVALID_ARGUMENT);
  absl::StatusOr<Client> c = Connect("j", 0, 1, /*ring=*/false);
  ASSERT_THAT(c.status(), IsOk());
  EXPECT_EQ(open(c->worker_id(), ipc::ring::kMaxSlots + 1), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(open(c->worker_id(), 8), grpc::StatusCode::OK);
}

TEST_F(RingTest, ARingIsClosedWhenItsWorkerLeavesAndLeavesNoNameBehind) {
  absl::StatusOr<Client> c = Connect("j", 0, 1);
  ASSERT_THAT(c.status(), IsOk());
  ASSERT_TRUE(c->uses_submission_ring());
  absl::StatusOr<Buffer> buf = c->Allocate(4096);
  EXPECT_THAT(c->AllReduce(*buf, 0, 16, DType::kFloat32, "x"), IsOk());
  int names = 0;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      names += std::string(e->d_name).find(absl::StrCat("dynamiq-", getpid(), "-ring")) != std::string::npos;
    }
    closedir(d);
  }
  EXPECT_EQ(names, 0);  // unlinked by the worker once mapped
  buf->Release().IgnoreError();
  c = absl::CancelledError("gone");  // ~Client unregisters
  // A worker of the same rank registers again and gets a ring of its own.
  absl::StatusOr<Client> again = Connect("j", 0, 1);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_TRUE(again->uses_submission_ring());
}

}  // namespace
}  // namespace dynamiq::server

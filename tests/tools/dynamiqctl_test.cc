// dynamiqctl against a real in-process dynamiqd: the ctl library (commands, formatting, Run's exit
// codes) and the binary itself (flag parsing, --help, exit codes).
#include "tools/dynamiqctl/ctl.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ipc/shm_region.h"
#include "kernels/codec_info.h"
#include "server/daemon.h"
#include "server/metrics.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::ctl {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using grpc::health::v1::HealthCheckResponse;
using ::testing::ContainsRegex;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr size_t kFloats = 2048;

std::string TempDir() {
  char tmpl[] = "/tmp/dqctl-XXXXXX";
  return std::string(mkdtemp(tmpl));
}

// One local worker of job "job", driven through the raw Worker stub, with a mapped buffer.
class TestWorker {
 public:
  explicit TestWorker(const std::string& socket) {
    stub_ = dynamiq::v1::Worker::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  }

  void Connect(const std::string& job) {
    dynamiq::v1::RegisterRequest reg;
    reg.set_job_id(job);
    reg.set_local_rank(0);
    reg.set_local_world_size(1);
    dynamiq::v1::RegisterResponse reg_resp;
    grpc::ClientContext c1;
    ASSERT_TRUE(stub_->Register(&c1, reg, &reg_resp).ok());
    id_ = reg_resp.worker_id();
    dynamiq::v1::AllocateBufferRequest alloc;
    alloc.set_worker_id(id_);
    alloc.set_bytes(kFloats * 4);
    dynamiq::v1::AllocateBufferResponse alloc_resp;
    grpc::ClientContext c2;
    ASSERT_TRUE(stub_->AllocateBuffer(&c2, alloc, &alloc_resp).ok());
    buffer_id_ = alloc_resp.buffer_id();
    auto region = ipc::ShmRegion::Open(alloc_resp.shm_name(), kFloats * 4);
    ASSERT_THAT(region, IsOk());
    region_ = std::make_unique<ipc::ShmRegion>(std::move(region).value());
    dynamiq::v1::MappedRequest mapped;
    mapped.set_worker_id(id_);
    mapped.set_buffer_id(buffer_id_);
    dynamiq::v1::MappedResponse mapped_resp;
    grpc::ClientContext c3;
    ASSERT_TRUE(stub_->Mapped(&c3, mapped, &mapped_resp).ok());
  }

  // Runs one collective named `tensor` over the whole buffer.
  void AllReduce(const std::string& tensor) {
    dynamiq::v1::AllReduceRequest req;
    req.set_worker_id(id_);
    req.set_tensor_name(tensor);
    req.set_buffer_id(buffer_id_);
    req.set_num_elements(kFloats);
    req.set_dtype(dynamiq::v1::DTYPE_FLOAT32);
    dynamiq::v1::AllReduceResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    grpc::Status s = stub_->AllReduce(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

 private:
  std::unique_ptr<dynamiq::v1::Worker::Stub> stub_;
  std::string id_;
  uint64_t buffer_id_ = 0;
  std::unique_ptr<ipc::ShmRegion> region_;
};

// Parses one line of JSON into a protobuf Struct (a generic JSON object).
bool ParsesAsObject(const std::string& line) {
  google::protobuf::Struct s;
  return google::protobuf::util::JsonStringToMessage(line, &s).ok();
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n');
  EXPECT_EQ(lines.back(), "") << "output must end with a newline";
  lines.pop_back();
  return lines;
}

class DynamiqctlTest : public ::testing::Test {
 protected:
  // Nodes in the cluster under test; one unless a fixture needs what only a cluster has.
  virtual uint32_t Nodes() const { return 1; }

  void SetUp() override {
    dir_ = TempDir();
    const server::JobConfig config = *server::MakeJobConfig("dynamiq", 5, "ring", 1024, "measured");
    if (Nodes() == 1) {
      server::DaemonOptions o;
      o.listen = "127.0.0.1:0";
      o.worker_socket = dir_ + "/dynamiqd.sock";
      o.default_config = config;
      o.timeout = absl::Seconds(20);
      daemon_ = std::make_unique<server::Daemon>(o);
      ASSERT_THAT(daemon_->Start(), IsOk());
    } else {
      auto daemons = testing::StartTestCluster(dir_, Nodes(), config);
      ASSERT_THAT(daemons, IsOk());
      daemon_ = std::move((*daemons)[0]);
      for (size_t r = 1; r < daemons->size(); ++r) peer_daemons_.push_back(std::move((*daemons)[r]));
    }
    connect_.daemon = daemon_->listen_address();
    connect_.timeout = absl::Seconds(10);
    client_ = std::make_unique<ControlClient>(connect_);
    // TestDaemonOptions' socket names.
    worker_ = std::make_unique<TestWorker>(Nodes() == 1 ? dir_ + "/dynamiqd.sock" : dir_ + "/node0.sock");
    worker_->Connect("job");
    for (uint32_t r = 1; r < Nodes(); ++r) {
      peer_workers_.push_back(std::make_unique<TestWorker>(absl::StrCat(dir_, "/node", r, ".sock")));
      peer_workers_.back()->Connect("job");
    }
  }

  void TearDown() override {
    worker_.reset();
    peer_workers_.clear();
    for (auto& peer : peer_daemons_) peer->Shutdown();
    peer_daemons_.clear();
    if (daemon_) daemon_->Shutdown();
    daemon_.reset();
    std::filesystem::remove_all(dir_);
  }

  // One collective named `tensor` by job "job"'s worker on every node.
  void AllReduce(const std::string& tensor) {
    std::vector<std::thread> peers;
    for (auto& w : peer_workers_) peers.emplace_back([&w, &tensor] { w->AllReduce(tensor); });
    worker_->AllReduce(tensor);
    for (auto& t : peers) t.join();
  }

  Invocation Command(const std::string& command) {
    Invocation in;
    in.args = {command};
    in.connect = connect_;
    return in;
  }

  // Runs `in` through Run(); returns the exit code, output in out_, errors in err_.
  int RunIt(const Invocation& in) {
    std::ostringstream out, err;
    const int code = ctl::Run(in, out, err);
    out_ = out.str();
    err_ = err.str();
    return code;
  }

  dynamiq::v1::JobStatus JobStatus() {
    auto status = client_->GetStatus();
    EXPECT_THAT(status, IsOk());
    if (!status.ok() || status->jobs_size() != 1) return {};
    return status->jobs(0);
  }

  std::string dir_;
  std::unique_ptr<server::Daemon> daemon_;  // node 0
  std::vector<std::unique_ptr<server::Daemon>> peer_daemons_;
  ConnectOptions connect_;
  std::unique_ptr<ControlClient> client_;
  std::unique_ptr<TestWorker> worker_;  // on node 0
  std::vector<std::unique_ptr<TestWorker>> peer_workers_;
  std::string out_, err_;
};

TEST_F(DynamiqctlTest, StatusListsTheJob) {
  auto status = client_->GetStatus();
  ASSERT_THAT(status, IsOk());
  EXPECT_EQ(status->node_rank(), 0u);
  EXPECT_EQ(status->num_nodes(), 1u);
  EXPECT_THAT(status->members(), ElementsAre(daemon_->listen_address()));
  EXPECT_EQ(status->transport(), "tcp");  // issue 44.9: which transport this node uses
  EXPECT_EQ(status->device(), "cpu");
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).job_id(), "job");
  EXPECT_EQ(status->jobs(0).workers(), 1u);
  EXPECT_EQ(status->jobs(0).incarnation(), 1u);

  ASSERT_EQ(RunIt(Command("status")), kExitOk) << err_;
  EXPECT_EQ(err_, "");
  EXPECT_THAT(out_, HasSubstr("node     0 of 1\n"));
  EXPECT_THAT(out_, HasSubstr(absl::StrCat("members  0=", daemon_->listen_address(), "\n")));
  EXPECT_THAT(out_, HasSubstr("JOB  INCARNATION  WORKERS  EPOCH  CODEC    BITS  TOPOLOGY  "
                              "MIN COMPRESS  INFLIGHT  COMPLETED  TARGET VNMSE\n"
                              "job            1        1      0  dynamiq     5  local     "
                              "        1024         0          0             -\n"));
  // Issue 23.10: one node has no topology (the metrics say "local" too), and a codec without a bit
  // setting shows "-", not "0".
  CompressionChange change;
  change.job_id = "job";
  change.codec = "mxfp8";
  ASSERT_THAT(ChangeCompression(*client_, change), IsOk());
  for (int i = 0; i < 3; ++i) worker_->AllReduce("t");  // the change applies at a boundary
  ASSERT_EQ(RunIt(Command("status")), kExitOk) << err_;
  EXPECT_THAT(out_, HasSubstr("  mxfp8     -  local  "));
}

TEST_F(DynamiqctlTest, SetCompressionChangesTheEpochAndKeepsUnsetFields) {
  CompressionChange change;
  change.job_id = "job";
  change.bits = 4;
  auto result = ChangeCompression(*client_, change);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->epoch, 1u);
  EXPECT_EQ(result->config.codec(), "dynamiq");
  EXPECT_EQ(result->config.bits(), 4);
  EXPECT_EQ(result->config.topology(), "ring");
  EXPECT_EQ(result->config.min_compress_elements(), 1024u);
  EXPECT_EQ(result->config.allocator(), "measured");

  // Staged: it applies two collectives after the next one to run, on every node.
  worker_->AllReduce("a");
  worker_->AllReduce("b");
  worker_->AllReduce("c");
  dynamiq::v1::JobStatus job = JobStatus();
  EXPECT_EQ(job.config_epoch(), 1u);
  EXPECT_EQ(job.config().codec(), "dynamiq");
  EXPECT_EQ(job.config().bits(), 4);
  EXPECT_EQ(job.config().min_compress_elements(), 1024u);

  // Through Run: only --min_compress_elements; bits stay 4 (read back at epoch 1).
  Invocation in = Command("set-compression");
  in.job = "job";
  in.compression.min_compress_elements = 64;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  EXPECT_EQ(err_, "");
  EXPECT_EQ(out_,
            "job job: codec=dynamiq bits=4 topology=ring min_compress_elements=64 allocator=measured\n"
            "applies at config epoch 2 (every node switches at the same collective boundary)\n");
  worker_->AllReduce("d");
  worker_->AllReduce("e");
  worker_->AllReduce("f");
  job = JobStatus();
  EXPECT_EQ(job.config_epoch(), 2u);
  EXPECT_EQ(job.config().bits(), 4);
  EXPECT_EQ(job.config().min_compress_elements(), 64u);

  // The flight recorder shows where each epoch took effect.
  auto records = client_->GetFlightRecorder("job", 0);
  ASSERT_THAT(records, IsOk());
  ASSERT_EQ(records->records_size(), 6);
  std::vector<uint64_t> epochs;
  for (const auto& r : records->records()) epochs.push_back(r.config_epoch());
  // Each change applies at (next sequence + 2): epoch 1 at c (sequence 2), epoch 2 at f (5).
  EXPECT_THAT(epochs, ElementsAre(0, 0, 1, 1, 1, 2));
  EXPECT_EQ(records->records(0).config().bits(), 5);
  EXPECT_EQ(records->records(2).config().bits(), 4);
}

TEST_F(DynamiqctlTest, NewCodecWithoutBitsGetsThatCodecsDefault) {
  CompressionChange change;
  change.job_id = "job";
  change.codec = "uniform";  // dynamiq's 5 bits kept would still be valid, thc's would not
  auto result = ChangeCompression(*client_, change);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->config.bits(), 4);  // the daemon answers with the configuration that applies
  change.codec = "thc";
  ASSERT_THAT(ChangeCompression(*client_, change), IsOk());
  worker_->AllReduce("a");
  worker_->AllReduce("b");
  worker_->AllReduce("c");
  dynamiq::v1::JobStatus job = JobStatus();
  EXPECT_EQ(job.config().codec(), "thc");
  EXPECT_EQ(job.config().bits(), 4);
}

TEST_F(DynamiqctlTest, SelectsTheCompressorsOfTheLiterature) {
  CompressionChange change;
  change.job_id = "job";
  change.codec = "global_qsgd";
  auto result = ChangeCompression(*client_, change);
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->config.bits(), 8);  // its default: 127 levels per sign
  change.bits = 4;
  ASSERT_THAT(ChangeCompression(*client_, change), IsOk());
  worker_->AllReduce("a");
  worker_->AllReduce("b");
  worker_->AllReduce("c");
  dynamiq::v1::JobStatus job = JobStatus();
  EXPECT_EQ(job.config().codec(), "global_qsgd");
  EXPECT_EQ(job.config().bits(), 4);
  change.bits = 4.5;
  EXPECT_THAT(ChangeCompression(*client_, change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("global_qsgd bits must be an integer 2..8")));
  // ARC-Top-K: "bits" is its density.
  change.codec = "arc_topk";
  change.bits.reset();
  result = ChangeCompression(*client_, change);
  ASSERT_THAT(result, IsOk());
  EXPECT_DOUBLE_EQ(result->config.bits(), 0.1);
  change.bits = 0.05;
  ASSERT_THAT(ChangeCompression(*client_, change), IsOk());
  change.bits = 2;
  EXPECT_THAT(ChangeCompression(*client_, change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("arc_topk bits must be between 0.001 and 1")));
}

TEST_F(DynamiqctlTest, InvalidBitsAreInvalidArgument) {
  CompressionChange change;
  change.job_id = "job";
  change.bits = 42;
  EXPECT_THAT(ChangeCompression(*client_, change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dynamiq bits must be between 3 and 8")));

  Invocation in = Command("set-compression");
  in.job = "job";
  in.compression.bits = 42;
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_EQ(out_, "");
  EXPECT_THAT(err_, HasSubstr("dynamiqctl: INVALID_ARGUMENT: dynamiq bits must be between 3 and 8"));
  in.compression.bits.reset();
  in.compression.topology = "hypercube";
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("dynamiqctl: INVALID_ARGUMENT: "));
  EXPECT_EQ(JobStatus().config_epoch(), 0u);
}

// Issue 44.6: --bits with a codec that has no bit setting was accepted and shown (int8/3.7, bf16/4)
// while the wire stayed 8 and 16 bits; it is a usage error, and the job keeps its configuration.
TEST_F(DynamiqctlTest, BitsForACodecWithoutABitSettingAreRefused) {
  Invocation in = Command("set-compression");
  in.job = "job";
  in.compression.codec = "int8";
  in.compression.bits = 3.7;
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_EQ(out_, "");
  EXPECT_THAT(err_, HasSubstr("--bits: codec int8 has no bit setting"));
  in.compression.codec = "bf16";
  in.compression.bits = 4;
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_THAT(err_, HasSubstr("--bits: codec bf16 has no bit setting"));
  EXPECT_EQ(JobStatus().config_epoch(), 0u);
  // 0 is "the codec's default" and stays accepted; bits alone on a bf16 job are refused by the daemon.
  in.compression.bits = 0;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  EXPECT_THAT(out_, HasSubstr("codec=bf16 bits=default"));
  in.compression.codec.reset();
  in.compression.bits = 4;
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("INVALID_ARGUMENT: codec bf16 has no bit setting"));
}

TEST_F(DynamiqctlTest, UnknownJobIsNotFound) {
  CompressionChange change;
  change.job_id = "nope";
  change.bits = 4;
  EXPECT_THAT(ChangeCompression(*client_, change), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope'")));
  // Every field given: no GetStatus, so this is the daemon's own answer.
  change.codec = "dynamiq";
  change.topology = "ring";
  change.min_compress_elements = 0;
  change.allocator = "measured";
  EXPECT_THAT(ChangeCompression(*client_, change),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no job 'nope' on this node")));
  EXPECT_THAT(client_->GetFlightRecorder("nope", 0), StatusIs(absl::StatusCode::kNotFound));

  Invocation in = Command("set-compression");
  in.job = "nope";
  in.compression.bits = 4;
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("dynamiqctl: NOT_FOUND: no job 'nope'"));
  in = Command("flight-recorder");
  in.job = "nope";
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_EQ(err_, "dynamiqctl: NOT_FOUND: no job 'nope' on this node\n");
}

// Issue 23.8: pointed at the worker socket instead of --listen, dynamiqctl said only
// "UNIMPLEMENTED: ". It says what --daemon must be.
TEST_F(DynamiqctlTest, AWorkerSocketGivenAsTheDaemonIsExplained) {
  ctl::ConnectOptions c = connect_;
  c.daemon = "unix:" + dir_ + "/dynamiqd.sock";
  ControlClient wrong(c);
  EXPECT_THAT(wrong.GetStatus(), StatusIs(absl::StatusCode::kUnimplemented,
                                          AllOf(HasSubstr("does not serve dynamiq.v1.Control"),
                                                HasSubstr("--listen address, host:port, not its worker socket"))));
}

// Issue 23.9: on an unknown job, set-compression still checks the settings (INVALID_ARGUMENT before
// NOT_FOUND), says that a job exists only while its workers are registered, and the refusal counts.
TEST_F(DynamiqctlTest, SetCompressionOnAnUnknownJobChecksTheSettingsAndSaysWhatAJobIs) {
  CompressionChange change;
  change.job_id = "nope";
  change.bits = 99;
  change.codec = "zstd";
  EXPECT_THAT(ChangeCompression(*client_, change), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("zstd")));
  change.codec.reset();
  EXPECT_THAT(ChangeCompression(*client_, change),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bits must be between 3 and 8")));
  change.bits = 4;
  EXPECT_THAT(ChangeCompression(*client_, change),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("no job 'nope'"), HasSubstr("only while its workers are registered"),
                             HasSubstr("--codec"))));
  Invocation in = Command("set-compression");
  in.job = "nope";
  in.compression.bits = 4;
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("only while its workers are registered"));
  EXPECT_EQ(::dynamiq::testing::RejectedRequests(*daemon_, "not_found"), 2);
}

TEST_F(DynamiqctlTest, StaleEpochsAreAbortedNotSilentlyUndone) {
  CompressionChange change;
  change.job_id = "job";
  change.bits = 4;
  change.expected_epoch = 7;
  EXPECT_THAT(ChangeCompression(*client_, change),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("is at config epoch 0, not 7")));
  // "Expect epoch 0" is expressible (the field has presence).
  change.expected_epoch = 0;
  ASSERT_THAT(ChangeCompression(*client_, change), IsOk());  // epoch 1, staged
  EXPECT_THAT(ChangeCompression(*client_, change),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("is at config epoch 1, not 0")));

  // A change on top of a staged one builds on it: the staged bits stay, not the applied ones.
  CompressionChange threshold;
  threshold.job_id = "job";
  threshold.min_compress_elements = 10;
  auto merged = ChangeCompression(*client_, threshold);
  ASSERT_THAT(merged, IsOk());
  EXPECT_EQ(merged->epoch, 2u);
  EXPECT_EQ(merged->config.bits(), 4);
  EXPECT_EQ(merged->config.min_compress_elements(), 10u);
  for (const char* t : {"a", "b", "c"}) worker_->AllReduce(t);
  dynamiq::v1::JobStatus job = JobStatus();
  ASSERT_EQ(job.config_epoch(), 2u);
  EXPECT_EQ(job.config().bits(), 4);
  EXPECT_EQ(job.config().min_compress_elements(), 10u);

  // Through the CLI: a stale --expected_epoch is refused, with the epoch the job is at.
  Invocation in = Command("set-compression");
  in.job = "job";
  in.compression.topology = "ring";
  in.compression.expected_epoch = 1;
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("dynamiqctl: ABORTED: job job is at config epoch 2, not 1"));
}

// Partial changes merge on the daemon onto the newest configuration, staged or applied: nothing is
// read first, so nothing staged is undone and no warning is needed.
TEST_F(DynamiqctlTest, ChangesMergeOntoTheStagedConfiguration) {
  Invocation in = Command("set-compression");
  in.job = "job";
  in.compression.bits = 4;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  in.compression.bits.reset();
  in.compression.allocator = "paper";
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  EXPECT_EQ(err_, "");
  EXPECT_THAT(out_, HasSubstr("codec=dynamiq bits=4 topology=ring min_compress_elements=1024 allocator=paper\n"));
  EXPECT_THAT(out_, HasSubstr("applies at config epoch 2"));
}

TEST_F(DynamiqctlTest, FlightRecorderTable) {
  worker_->AllReduce("layer1.weight");
  worker_->AllReduce("layer1.bias");
  Invocation in = Command("flight-recorder");
  in.limit = 1;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  std::vector<std::string> lines = Lines(out_);
  ASSERT_EQ(lines.size(), 2u) << out_;
  EXPECT_THAT(lines[0], HasSubstr("SEQ  JOB  TENSOR       ELEMENTS  CODEC/BITS  EPOCH  STATE"));
  EXPECT_THAT(lines[0], HasSubstr("WIRE BYTES  ERROR"));
  EXPECT_THAT(lines[1], HasSubstr("  1  job  layer1.bias      2048  dynamiq/5       0  ok"));
  EXPECT_THAT(lines[1], ::testing::EndsWith("  -"));

  in.job = "job";
  in.limit.reset();
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  EXPECT_EQ(Lines(out_).size(), 3u);
}

TEST(DynamiqctlFormatTest, TablesKeepOneLinePerRecordAndAlign) {
  dynamiq::v1::GetFlightRecorderResponse records;
  EXPECT_EQ(FormatFlightRecorder(records, false), "no collectives recorded\n");
  EXPECT_EQ(FormatFlightRecorder(records, true), "");
  auto* r = records.add_records();
  r->set_sequence(12);
  r->set_job_id("j");
  r->set_tensor_name("t");
  r->set_num_elements(100);
  r->mutable_config()->set_codec("uniform");
  r->mutable_config()->set_bits(3);
  r->set_state("failed");
  r->set_error("node 1 did not arrive\nwithin 20s");
  r->set_seconds(20.5);
  EXPECT_EQ(
      FormatFlightRecorder(records, false),
      "SEQ  JOB  TENSOR  ELEMENTS  CODEC/BITS  EPOCH  STATE     SECONDS  WIRE BYTES  ERROR\n"
      " 12  j    t            100  uniform/3       0  failed  20.500000           0  node 1 did not arrive within "
      "20s\n");

  dynamiq::v1::GetStatusResponse status;
  status.set_num_nodes(2);
  status.set_node_rank(1);
  status.add_members("10.0.0.1:7070");
  status.add_members("10.0.0.2:7070");
  status.set_version("0.1.0");
  EXPECT_EQ(FormatStatus(status, false),
            "node     1 of 2\nversion  0.1.0\nmembers  0=10.0.0.1:7070 1=10.0.0.2:7070\n\nno jobs\n");
  // Issue 44.8/44.9: before the cluster forms only the node's own place is known (not its address
  // as rank 0), and the transport is shown.
  status.set_members(0, "");
  status.set_transport("tcp");
  status.set_device("cpu");
  EXPECT_EQ(FormatStatus(status, false),
            "node     1 of 2\nversion  0.1.0\nmembers  0=- 1=10.0.0.2:7070 (the cluster has not formed yet: - has "
            "not joined)\ndevice   cpu, transport tcp between nodes\n\nno jobs\n");
  // Issue 37.4: silent nodes, and a job that runs on fewer than every node.
  status.set_members(0, "10.0.0.1:7070");
  status.set_num_nodes(3);
  status.add_members("10.0.0.3:7070");
  status.add_live_nodes(0);
  status.add_live_nodes(1);
  dynamiq::v1::JobStatus* job = status.add_jobs();
  job->set_job_id("a");
  job->set_view_epoch(1);
  job->add_view_nodes(0);
  job->add_view_nodes(1);
  const std::string shrunk = FormatStatus(status, false);
  EXPECT_THAT(shrunk, HasSubstr("live     nodes 0, 1; silent (no heartbeat): 2\n"));
  EXPECT_THAT(shrunk, HasSubstr("job a: view 1, runs on nodes 0, 1 (2 of 3)\n"));
}

TEST(DynamiqctlFormatTest, JsonEscapesStrings) {
  CompressionChangeResult result;
  result.job_id = "a\"b\\c\n";
  result.epoch = 3;
  const std::string json = FormatCompressionChange(result, true);
  google::protobuf::Struct s;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &s).ok()) << json;
  EXPECT_EQ(s.fields().at("job_id").string_value(), "a\"b\\c\n");
  EXPECT_EQ(s.fields().at("epoch").string_value(), "3");
  EXPECT_EQ(FormatError(absl::NotFoundError("gone")), "NOT_FOUND: gone");
}

TEST_F(DynamiqctlTest, HealthIsServing) {
  for (const char* service : {"", "dynamiq.v1.Control"}) {
    auto health = client_->CheckHealth(service);
    ASSERT_THAT(health, IsOk());
    EXPECT_EQ(*health, HealthCheckResponse::SERVING) << service;
  }
  EXPECT_THAT(client_->CheckHealth("no.such.Service"), StatusIs(absl::StatusCode::kNotFound));

  Invocation in = Command("health");
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  EXPECT_EQ(out_, "SERVING\n");
  in.service = "no.such.Service";
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("dynamiqctl: NOT_FOUND: "));
}

TEST_F(DynamiqctlTest, JsonIsOneObjectPerLine) {
  worker_->AllReduce("a");
  worker_->AllReduce("b");
  Invocation in = Command("status");
  in.json = true;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  std::vector<std::string> lines = Lines(out_);
  ASSERT_EQ(lines.size(), 1u) << out_;
  dynamiq::v1::GetStatusResponse status;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(lines[0], &status).ok()) << lines[0];
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).job_id(), "job");
  // Not exactly 2: the daemon counts a collective complete just after releasing its workers.
  EXPECT_GE(status.jobs(0).completed(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("\"config_epoch\":\"0\""));  // .proto names, every field present

  in = Command("flight-recorder");
  in.json = true;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  lines = Lines(out_);
  ASSERT_EQ(lines.size(), 2u) << out_;
  for (size_t i = 0; i < lines.size(); ++i) {
    dynamiq::v1::CollectiveRecord record;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(lines[i], &record).ok()) << lines[i];
    EXPECT_EQ(record.sequence(), i);
    EXPECT_EQ(record.state(), "ok");
    EXPECT_EQ(record.num_elements(), kFloats);
  }

  in = Command("set-compression");
  in.json = true;
  in.job = "job";
  in.compression.bits = 4;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  lines = Lines(out_);
  ASSERT_EQ(lines.size(), 1u) << out_;
  google::protobuf::Struct change;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(lines[0], &change).ok()) << lines[0];
  EXPECT_EQ(change.fields().at("job_id").string_value(), "job");
  EXPECT_EQ(change.fields().at("epoch").string_value(), "1");
  EXPECT_EQ(change.fields().at("config").struct_value().fields().at("bits").number_value(), 4);

  in = Command("health");
  in.json = true;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  EXPECT_EQ(out_, "{\"service\":\"\",\"status\":\"SERVING\"}\n");
  EXPECT_TRUE(ParsesAsObject(Lines(out_)[0]));
}

TEST_F(DynamiqctlTest, UsageErrors) {
  Invocation in = Command("status");
  in.args.clear();
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_THAT(err_, HasSubstr("no command given"));
  in.args = {"stats"};
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_THAT(err_, HasSubstr("unknown command 'stats'"));
  in.args = {"status", "extra"};
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_THAT(err_, HasSubstr("unexpected argument 'extra'"));
  in = Command("status");
  in.compression.codec = "none";
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_THAT(err_, HasSubstr("--codec does not apply to 'status' (it is for set-compression)"));
  in = Command("health");
  in.job = "job";
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_THAT(err_, HasSubstr("(it is for set-compression, flight-recorder)"));
  in = Command("set-compression");
  in.compression.bits = 4;
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_THAT(err_, HasSubstr("set-compression needs --job"));
  in = Command("status");
  in.connect.timeout = absl::ZeroDuration();
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_EQ(out_, "");
  // Nothing was changed by any of these.
  EXPECT_EQ(JobStatus().config_epoch(), 0u);
}

// A loopback port nothing listens on.
int ClosedPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(DynamiqctlNoDaemonTest, UnreachableDaemonIsUnavailableAndNamed) {
  Invocation in;
  in.args = {"status"};
  in.connect.daemon = absl::StrCat("127.0.0.1:", ClosedPort());
  in.connect.timeout = absl::Seconds(5);
  std::ostringstream out, err;
  EXPECT_EQ(ctl::Run(in, out, err), kExitFailure);
  EXPECT_THAT(err.str(), HasSubstr("dynamiqctl: UNAVAILABLE: "));
  EXPECT_THAT(err.str(), HasSubstr(absl::StrCat("(dynamiqd at ", in.connect.daemon,
                                                "; if it runs with --tls_cert, give its CA with --tls_ca)")));
  in.args = {"health"};
  std::ostringstream out2, err2;
  EXPECT_EQ(ctl::Run(in, out2, err2), kExitFailure);
  EXPECT_EQ(out2.str(), "");
}

// The binary: flag parsing, --help and exit codes.
struct Process {
  int code = -1;
  std::string out, err;
};

Process RunBinary(const std::string& args) {
  char tmpl[] = "/tmp/dqctl-err-XXXXXX";
  const int fd = mkstemp(tmpl);
  close(fd);
  Process p;
  FILE* pipe = popen(absl::StrCat(DQ_DYNAMIQCTL, " ", args, " 2>", tmpl).c_str(), "r");
  if (pipe == nullptr) return p;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) p.out.append(buffer, n);
  const int status = pclose(pipe);
  p.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(tmpl);
  p.err.assign(std::istreambuf_iterator<char>(err), std::istreambuf_iterator<char>());
  unlink(tmpl);
  return p;
}

TEST(DynamiqctlBinaryTest, HelpDocumentsEveryCommandAndFlag) {
  Process p = RunBinary("--help");
  EXPECT_EQ(p.code, 0) << p.err;
  for (const char* word : {"status",      "set-compression",  "flight-recorder", "health",
                           "--daemon",    "--timeout",        "--json",          "--job",
                           "--codec",     "--bits",           "--topology",      "--min_compress_elements",
                           "--allocator", "--expected_epoch", "--limit",         "--service",
                           "top",         "--interval",       "--iterations",    "Default: 127.0.0.1:7070",
                           "Exit status"}) {
    EXPECT_THAT(p.out, HasSubstr(word));
  }
  EXPECT_EQ(RunBinary("help").out, p.out);
  // Issue 44.2: every codec's default, from the codec table that dynamiqd's --help also lists.
  EXPECT_THAT(p.out, HasSubstr(kernels::DefaultBitsSummary()));
  EXPECT_THAT(kernels::DefaultBitsSummary(), HasSubstr("global_qsgd 8, arc_topk 0.1"));
}

TEST(DynamiqctlBinaryTest, BadFlagsAreUsageErrors) {
  Process p = RunBinary("--no_such_flag status");
  EXPECT_EQ(p.code, 2);
  EXPECT_THAT(p.err, HasSubstr("no_such_flag"));
  p = RunBinary("flight-recorder --limit=many");
  EXPECT_EQ(p.code, 2);
  EXPECT_THAT(p.err, HasSubstr("limit"));
  p = RunBinary("");
  EXPECT_EQ(p.code, 2);
  EXPECT_THAT(p.err, HasSubstr("no command given"));
  p = RunBinary("--timeout=-1 status");
  EXPECT_EQ(p.code, 2);
}

TEST(DynamiqctlTopTest, RatesBetweenTwoAnswers) {
  dynamiq::v1::GetStatusResponse before, after;
  after.set_num_nodes(2);
  dynamiq::v1::JobStatus* a0 = before.add_jobs();
  a0->set_job_id("a");
  a0->set_completed(10);
  a0->set_payload_bytes(1000);
  a0->set_bus_bytes(1000);
  a0->set_wire_bytes(200);
  a0->set_duration_seconds_sum(1.0);
  a0->set_lossy_datagrams_expected(1000);
  a0->set_lossy_datagrams_arrived(990);
  dynamiq::v1::JobStatus* a1 = after.add_jobs();
  *a1 = *a0;
  a1->set_completed(30);                  // 20 more in 2 s
  a1->set_payload_bytes(1000 + 8000000);  // 8 MB in 0.5 s of collectives
  a1->set_bus_bytes(1000 + 8000000);
  a1->set_wire_bytes(200 + 1000000);
  a1->set_duration_seconds_sum(1.5);
  a1->set_failed(1);
  a1->set_error_samples(3);
  a1->set_last_vnmse(6.3e-4);
  a1->mutable_config()->set_codec("dynamiq");
  a1->mutable_config()->set_bits(5);
  a1->set_config_epoch(2);
  a1->set_workers(4);
  a1->set_inflight(1);
  // The straggler view: node 1 was waited for 2.5 s in the interval, local rank 0 0.2 s.
  (*before.mutable_jobs(0)->mutable_node_wait_seconds())[1] = 1.0;
  (*a1->mutable_node_wait_seconds())[1] = 3.5;
  (*a1->mutable_node_wait_seconds())[0] = 0.0;
  (*a1->mutable_local_wait_seconds())[0] = 0.2;
  a1->set_lossy_datagrams_expected(3000);  // 2,000 more expected in the interval, 1,900 arrived: 5 % lost
  a1->set_lossy_datagrams_arrived(2890);
  a1->set_lossy_drift_elements(1234);
  dynamiq::v1::JobStatus* b = after.add_jobs();  // new since the previous answer: counts from zero
  b->set_job_id("b");
  b->set_completed(4);
  (*b->mutable_local_wait_seconds())[3] = 0.5;  // one node's view: a local rank
  std::vector<TopRow> rows = TopRows(before, after, 2.0);
  ASSERT_EQ(rows.size(), 2u);
  const TopRow& r = rows[0];
  EXPECT_EQ(r.job_id, "a");
  EXPECT_EQ(r.collectives, 20u);
  EXPECT_EQ(r.failed, 1u);
  EXPECT_DOUBLE_EQ(r.collectives_per_second, 10);
  ASSERT_TRUE(r.algbw.has_value());
  EXPECT_DOUBLE_EQ(*r.algbw, 16e6);
  ASSERT_TRUE(r.busbw.has_value());
  EXPECT_DOUBLE_EQ(*r.busbw, 16e6);
  EXPECT_DOUBLE_EQ(r.wire_bytes_per_second, 0.5e6);
  ASSERT_TRUE(r.compression_ratio.has_value());
  EXPECT_DOUBLE_EQ(*r.compression_ratio, 8);
  ASSERT_TRUE(r.last_vnmse.has_value());
  EXPECT_DOUBLE_EQ(*r.last_vnmse, 6.3e-4);
  EXPECT_EQ(r.slowest, "node 1");
  EXPECT_DOUBLE_EQ(r.slowest_wait_seconds, 2.5);
  ASSERT_TRUE(r.loss.has_value());
  EXPECT_NEAR(*r.loss, 0.05, 1e-12);
  EXPECT_EQ(r.drift_elements, 1234u);
  EXPECT_FALSE(rows[1].loss.has_value()) << "a reliable job has no loss";
  EXPECT_EQ(rows[1].slowest, "rank 3");
  EXPECT_EQ(rows[1].collectives, 4u);
  EXPECT_FALSE(rows[1].algbw.has_value()) << "no time spent in collectives: no bandwidth";
  EXPECT_FALSE(rows[1].compression_ratio.has_value());
  EXPECT_FALSE(rows[1].last_vnmse.has_value());
  // A restarted daemon (counters went down) counts from zero instead of going negative.
  rows = TopRows(after, before, 1.0);
  EXPECT_EQ(rows[0].collectives, 10u);
  // A job retired and registered again (a new incarnation) counts from zero, even past the old counts.
  dynamiq::v1::GetStatusResponse restarted = after;
  restarted.mutable_jobs(0)->set_incarnation(2);
  restarted.mutable_jobs(0)->set_completed(35);
  rows = TopRows(after, restarted, 1.0);
  EXPECT_EQ(rows[0].collectives, 35u);

  const absl::Time now = absl::FromUnixSeconds(1700000000);
  // Issue 44.7: wire MB/s, the config epoch and the workers are in the table, as --help promises.
  EXPECT_EQ(FormatTop(after, TopRows(before, after, 2.0), false, false, now),
            "dynamiqctl top  node 0 of 2  2023-11-14T22:13:20.000Z  (2.0 s, MB/s)\n"
            "JOB  CODEC      EPOCH  WORKERS  INFL  COLL/S  FAIL  LOSS\n"
            "a    dynamiq/5      2        4     1    10.0     1  5.0%\n"
            "b    -              0        0     0     2.0     0     -\n"
            "JOB  ALGBW  BUSBW  WIRE  RATIO     VNMSE  WAITED FOR\n"
            "a     16.0   16.0   0.5  8.00x  6.30e-04  node 1 2.50s\n"
            "b        -      -   0.0      -         -  rank 3 0.50s\n");
  // Issue 23.10: an 80-column terminal holds it, long job ids and big figures included.
  dynamiq::v1::GetStatusResponse wide = after;
  wide.mutable_jobs(0)->set_job_id("a-very-long-job-identifier-2026-11-25");
  wide.mutable_jobs(0)->set_payload_bytes(1000 + uint64_t{99000} * 1000 * 1000);  // 99 GB/s
  wide.mutable_jobs(0)->set_bus_bytes(1000 + uint64_t{99000} * 1000 * 1000);
  wide.mutable_jobs(0)->set_wire_bytes(200 + uint64_t{99000} * 1000 * 1000 / 7);  // 7x
  for (const std::string& line : Lines(FormatTop(wide, TopRows(before, wide, 2.0), false, false, now))) {
    EXPECT_LE(line.size(), 80u) << line;
  }
  EXPECT_TRUE(absl::StartsWith(FormatTop(after, {}, false, true, now), "\x1b[H\x1b[2J")) << "redraws in a terminal";
  std::vector<std::string> lines = Lines(FormatTop(after, TopRows(before, after, 2.0), true, true, now));
  ASSERT_EQ(lines.size(), 2u);
  google::protobuf::Struct s;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(lines[0], &s).ok()) << lines[0];
  EXPECT_EQ(s.fields().at("job_id").string_value(), "a");
  EXPECT_EQ(s.fields().at("algbw_bytes_per_second").number_value(), 16e6);
  EXPECT_EQ(s.fields().at("compression_ratio").number_value(), 8);
  EXPECT_EQ(s.fields().at("config_epoch").string_value(), "2");
  EXPECT_NEAR(s.fields().at("loss").number_value(), 0.05, 1e-9);
  EXPECT_EQ(s.fields().at("drift_elements").string_value(), "1234");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(lines[1], &s).ok()) << lines[1];
  EXPECT_TRUE(s.fields().at("algbw_bytes_per_second").has_null_value());
}

TEST_F(DynamiqctlTest, TopPollsTheLiveDaemon) {
  // Keep the job busy while top samples it (bounded: at most 2000 collectives or 30 s).
  std::atomic<bool> stop{false};
  std::atomic<int> done{0};
  std::thread load([&] {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    for (int i = 0; i < 2000 && !stop.load() && absl::Now() < deadline; ++i) {
      worker_->AllReduce("t");
      done.fetch_add(1);
    }
  });
  Invocation in = Command("top");
  in.json = true;
  in.interval = 0.3;
  in.iterations = 2;
  const int code = RunIt(in);
  const std::string json_out = out_;
  in.json = false;
  const int table_code = RunIt(in);
  stop = true;
  load.join();
  ASSERT_EQ(code, kExitOk) << err_;
  ASSERT_EQ(table_code, kExitOk) << err_;
  // --json: one object per job per refresh.
  std::vector<std::string> lines = Lines(json_out);
  ASSERT_EQ(lines.size(), 2u) << json_out;
  double collectives = 0;
  for (const std::string& line : lines) {
    google::protobuf::Struct s;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(line, &s).ok()) << line;
    EXPECT_EQ(s.fields().at("job_id").string_value(), "job");
    EXPECT_EQ(s.fields().at("codec").string_value(), "dynamiq");
    EXPECT_EQ(s.fields().at("workers").number_value(), 1);
    EXPECT_NEAR(s.fields().at("interval_seconds").number_value(), 0.3, 0.25);
    collectives += s.fields().at("collectives_per_second").number_value();
    // One node: no bus bytes, nothing on the wire.
    EXPECT_TRUE(s.fields().at("busbw_bytes_per_second").has_null_value());
    EXPECT_TRUE(s.fields().at("compression_ratio").has_null_value());
  }
  EXPECT_GT(collectives, 0) << "the load ran " << done.load() << " collectives";
  // Tables: two refreshes, each a header line and two tables of a header and a row for the job.
  EXPECT_EQ(std::count(out_.begin(), out_.end(), '\n'), 11) << out_;
  // Columns widen to their values (a loaded machine's thousands of MB/s): match the order only.
  EXPECT_THAT(out_, ContainsRegex("JOB +CODEC +EPOCH +WORKERS +INFL +COLL/S +FAIL"));
  EXPECT_THAT(out_, ContainsRegex("\njob +dynamiq/5 +0 +1 "));
  EXPECT_THAT(out_, ContainsRegex("JOB +ALGBW +BUSBW +WIRE +RATIO +VNMSE"));

  in.interval = 0;
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_THAT(err_, HasSubstr("--interval"));
  in = Command("status");
  in.iterations = 1;
  EXPECT_EQ(RunIt(in), kExitUsage);
  EXPECT_THAT(err_, HasSubstr("--iterations does not apply to 'status' (it is for top)"));
}

// An error budget needs errors measured between nodes, so its tests run on a two-node cluster.
class DynamiqctlClusterTest : public DynamiqctlTest {
 protected:
  uint32_t Nodes() const override { return 2; }
};

TEST_F(DynamiqctlTest, AnErrorBudgetOnOneNodeIsRefused) {
  Invocation in = Command("set-compression");
  in.job = "job";
  in.compression.target_vnmse = 1e-3;
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("FAILED_PRECONDITION: an error budget (target_vnmse) needs the compression error "
                              "measured between nodes"));
  EXPECT_FALSE(JobStatus().config().has_error_budget());
}

TEST_F(DynamiqctlClusterTest, SetCompressionPutsTheJobUnderAnErrorBudgetAndBack) {
  // Budget fields without a budget or a target: refused before anything changes.
  Invocation in = Command("set-compression");
  in.job = "job";
  in.compression.max_bits = 7;
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("INVALID_ARGUMENT: job job has no error budget"));
  in.compression.target_vnmse = 0;
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("--target_vnmse=0 (fixed bits) takes no"));
  // The daemon validates the policy.
  in = Command("set-compression");
  in.job = "job";
  in.compression.target_vnmse = 1e-3;
  in.compression.min_bits = 7;
  in.compression.max_bits = 4;
  EXPECT_EQ(RunIt(in), kExitFailure);
  EXPECT_THAT(err_, HasSubstr("INVALID_ARGUMENT: min_bits (7) must not exceed max_bits (4)"));
  // A budget on an mxfp8 job switches it to DynamiQ; the starting bits are clamped to the range.
  CompressionChange to_mx;
  to_mx.job_id = "job";
  to_mx.codec = "mxfp8";
  ASSERT_THAT(ChangeCompression(*client_, to_mx), IsOk());
  for (const char* t : {"a", "b", "c"}) AllReduce(t);
  in.compression.min_bits = 4;
  in.compression.max_bits = 7;
  in.compression.sample_rate = 0.5;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  // DynamiQ's default bits, 5: the daemon answers with the configuration that applies.
  EXPECT_THAT(out_, HasSubstr("codec=dynamiq bits=5 topology=ring min_compress_elements=1024 allocator=measured "
                              "target_vnmse=0.001 bits_range=[4,7] sample_rate=0.5\n"));
  for (const char* t : {"d", "e", "f"}) AllReduce(t);
  dynamiq::v1::JobStatus job = JobStatus();
  EXPECT_EQ(job.config().codec(), "dynamiq");
  EXPECT_EQ(job.config().error_budget().target_vnmse(), 1e-3);
  EXPECT_EQ(job.config().error_budget().min_bits(), 4);
  EXPECT_EQ(job.config().bits(), 5);
  ASSERT_EQ(RunIt(Command("status")), kExitOk) << err_;
  EXPECT_THAT(out_, HasSubstr("TARGET VNMSE\n"));
  EXPECT_THAT(out_, HasSubstr(" 0.001\n"));
  // Another field alone keeps the budget; one budget field changes only that field.
  in = Command("set-compression");
  in.job = "job";
  in.compression.min_compress_elements = 2048;
  in.compression.max_bits = 8;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  EXPECT_THAT(out_, HasSubstr("min_compress_elements=2048 allocator=measured target_vnmse=0.001 bits_range=[4,8] "
                              "sample_rate=0.5\n"));
  for (const char* t : {"g", "h", "i"}) AllReduce(t);
  // --bits alone returns to fixed bits.
  in = Command("set-compression");
  in.job = "job";
  in.compression.bits = 6;
  ASSERT_EQ(RunIt(in), kExitOk) << err_;
  EXPECT_THAT(out_, HasSubstr("codec=dynamiq bits=6 topology=ring min_compress_elements=2048 allocator=measured\n"));
  for (const char* t : {"j", "k", "l"}) AllReduce(t);
  job = JobStatus();
  EXPECT_FALSE(job.config().has_error_budget());
  EXPECT_EQ(job.config().bits(), 6);
  // The binary takes the dash spelling of the flags.
  const std::string daemon = absl::StrCat("--daemon=", daemon_->listen_address(), " ");
  Process p = RunBinary(daemon + "set-compression --job=job --target-vnmse=2e-3 --max-bits=7");
  EXPECT_EQ(p.code, 0) << p.err;
  EXPECT_THAT(p.out, HasSubstr("bits=6 topology=ring min_compress_elements=2048 allocator=measured target_vnmse=0.002 "
                               "bits_range=[3,7]\n"));
  p = RunBinary(daemon + "set-compression --job=job --target-vnmse=2");
  EXPECT_EQ(p.code, 1);
  EXPECT_THAT(p.err, HasSubstr("INVALID_ARGUMENT: target_vnmse must be between 0 and 1"));
}

TEST_F(DynamiqctlTest, BinaryAgainstTheDaemon) {
  const std::string daemon = absl::StrCat("--daemon=", daemon_->listen_address(), " ");
  Process p = RunBinary(daemon + "status");
  EXPECT_EQ(p.code, 0) << p.err;
  EXPECT_THAT(p.out, HasSubstr("\njob            1        1      0  dynamiq"));
  p = RunBinary(daemon + "set-compression --job=job --bits=4 --json");
  EXPECT_EQ(p.code, 0) << p.err;
  EXPECT_THAT(p.out, HasSubstr("\"epoch\":\"1\""));
  p = RunBinary(daemon + "set-compression --job=nope --bits=4");
  EXPECT_EQ(p.code, 1);
  EXPECT_THAT(p.err, HasSubstr("dynamiqctl: NOT_FOUND: no job 'nope'"));
  p = RunBinary(daemon + "health --service=dynamiq.v1.Control");
  EXPECT_EQ(p.code, 0) << p.err;
  EXPECT_EQ(p.out, "SERVING\n");
  p = RunBinary(daemon + "flight-recorder --bits=4");
  EXPECT_EQ(p.code, 2);
  p = RunBinary(daemon + "top --interval=0.1 --iterations=1");
  EXPECT_EQ(p.code, 0) << p.err;
  EXPECT_THAT(p.out, HasSubstr("dynamiqctl top  node 0 of 1"));
  EXPECT_THAT(p.out, Not(HasSubstr("\x1b[2J"))) << "not a terminal: no screen clearing";
  p = RunBinary(daemon + "top --iterations=many");
  EXPECT_EQ(p.code, 2);
}

}  // namespace
}  // namespace dynamiq::ctl

// Fault suite, malformed wire traffic: a real dynamiqd (node 0 of two) and, as node 1, a rogue
// peer in this process that joins the coordinator's rendezvous and the job's Gloo group like a
// daemon would (engine transport, same rendezvous keys) and then sends hand-made step headers and
// payloads: bad magic, unknown version and flags, another config epoch or codec, a huge announced
// size, a truncated payload, a wrong checksum, an illegal chunk with a valid checksum, a claimed
// authentication tag. The engine's own tests feed such bytes to the parser and the executor in
// one process (tests/engine/step_header_test.cc, allreduce_test.cc); here the daemon receives
// them from the network: its worker gets a clear error naming rank 1 within the timeout, the
// daemon keeps serving without leaking, and the next well-formed collective from the same peer
// (a real engine::AllReduce) succeeds with the exact sum.
#include <signal.h>

#include <array>
#include <cmath>
#include <functional>
#include <iostream>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/control_client.h"
#include "common/tcp_socket.h"
#include "engine/allreduce.h"
#include "engine/host_transport.h"
#include "engine/step_header.h"
#include "engine/store.h"
#include "engine/tcp_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "server/cluster.h"
#include "server/daemon_options.h"
#include "server/grpc_store.h"
#include "server/job_config.h"
#include "tests/faults/fault_harness.h"
#include "tests/testing/raw_tcp_peer.h"

namespace dynamiq::faults {
namespace {

using ::testing::HasSubstr;
using std::string_literals::operator""s;

constexpr double kTimeoutSeconds = 4;
constexpr uint64_t kElements = 4096;

// What dynamiqd puts in the step headers' job field (server/job.cc: FNV-1a of job, tensor, size, dtype).
uint64_t CollectiveId(const std::string& job, const std::string& tensor, uint64_t n) {
  const std::string nul(1, '\0');
  const std::string s = absl::StrCat(job, nul, tensor, nul, n, nul, "float32");
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

// The engine's transport tags (engine/allreduce.cc).
enum Part { kHeader = 0, kPayload = 1 };
uint64_t Tag(uint64_t sequence, engine::Phase phase, uint32_t step, uint32_t block, Part part) {
  return ((sequence & 0xffffff) << 40) | (static_cast<uint64_t>(phase) << 38) |
         (static_cast<uint64_t>(step & 0xffff) << 22) | (static_cast<uint64_t>(block & 0xfffff) << 2) |
         static_cast<uint64_t>(part);
}

// How one rogue message deviates from what the daemon expects.
struct Variant {
  std::string name;
  std::function<void(std::array<uint8_t, 64>&)> edit_header;  // raw bytes, after encoding
  std::function<void(engine::StepHeader&)> edit_fields;       // before encoding
  enum { kHeaderOnly, kPayload } stage = kHeaderOnly;
  // Payload variants: what is announced and what is sent.
  std::function<void(std::vector<uint8_t>& payload, engine::StepHeader& h)> make_payload;
  size_t send_bytes = 0;  // bytes actually sent (0: the whole payload)
  std::string code;
  std::vector<std::string> message;
};

class RogueNode {
 public:
  // `transport`: the daemon's --transport (gloo or tcp), which the rogue node speaks too.
  RogueNode(const std::string& coordinator, std::string transport)
      : store_(coordinator), transport_name_(std::move(transport)) {}

  // Joins as node 1 with the settings a dynamiqd started like the daemon would send (--codec=none,
  // the other flags' defaults): the coordinator refuses a join whose settings differ.
  absl::Status Join() {
    server::DaemonOptions o;
    o.transport = transport_name_;
    absl::StatusOr<server::JobConfig> config = server::MakeJobConfig("none", 0, "ring", 4096, "measured");
    if (!config.ok()) return config.status();
    o.default_config = *config;
    auto members = store_.Join(1, 2, "127.0.0.1:1", absl::Seconds(20), server::ClusterSettings(o));
    return members.status();
  }

  // The group's current transport, connected for collective `sequence` when there is none (as a
  // node does after a failure: server/cross_node_group.h).
  absl::StatusOr<engine::Transport*> Transport(uint64_t sequence) {
    if (!transport_) {
      // Job j's first incarnation on the daemon, view 0 (server/cluster.h: "job/<id>/inc<k>/view<E>-from<s>").
      engine::PrefixStore scoped(server::Cluster::RendezvousPrefix("j", 1, 0, sequence), store_);
      auto t = engine::ConnectHostTransport(transport_name_, scoped, 1, 2, "127.0.0.1", absl::Seconds(kTimeoutSeconds));
      if (!t.ok()) return t.status();
      transport_ = *std::move(t);
    }
    return transport_.get();
  }
  // The daemon failed the collective: it connects again for the next one, so do we.
  void Broken() {
    if (transport_) transport_->Abort();
    transport_.reset();
  }

  // Plays rank 1 of collective `sequence` sending the malformed message of `v` at the first
  // reduce-scatter step (ring of 2, codec none).
  void SendMalformed(uint64_t sequence, const Variant& v) {
    auto t = Transport(sequence);
    ASSERT_TRUE(t.ok()) << t.status();
    engine::Transport& tr = **t;
    const absl::Time deadline = absl::Now() + absl::Seconds(kTimeoutSeconds);
    const auto phase = engine::Phase::kReduceScatter;
    std::array<uint8_t, 64> theirs{};
    auto h0 = tr.PostRecv(0, Tag(sequence, phase, 0, 0, kHeader), absl::MakeSpan(theirs));
    ASSERT_TRUE(h0.ok());
    engine::StepHeader h;
    h.phase = phase;
    h.codec = static_cast<uint8_t>(kernels::CodecId::kNone);
    h.bits_x1000 = 0;  // as dynamiqd's none: a codec without a bit setting runs at bits 0
    h.sender = 1;
    h.job_id = CollectiveId("j", "grad", kElements);
    h.config_epoch = 0;
    h.sequence = sequence;
    h.step = 0;
    h.block = 0;
    std::vector<uint8_t> payload(kElements / 2 * 4 + 32, 0x3f);
    if (v.make_payload) v.make_payload(payload, h);
    h.payload_bytes = static_cast<uint32_t>(payload.size());
    if (h.checksum == 0) h.checksum = engine::PayloadChecksum(payload);
    if (v.edit_fields) v.edit_fields(h);
    std::array<uint8_t, 64> mine = engine::EncodeStepHeader(h);
    if (v.edit_header) v.edit_header(mine);
    auto s0 = tr.PostSend(0, Tag(sequence, phase, 0, 0, kHeader), mine);
    ASSERT_TRUE(s0.ok());
    // A node sends its payload right behind the header.
    std::vector<uint8_t> sent(payload);
    std::optional<engine::Transport::Handle> p;
    if (v.stage == Variant::kPayload) {
      sent.resize(v.send_bytes == 0 ? payload.size() : v.send_bytes, 0x3f);
      auto posted = tr.PostSend(0, Tag(sequence, phase, 0, 0, kPayload), sent);
      if (posted.ok()) p = *posted;
    }
    // The daemon's header and payload arrive whatever ours say; take them like a node would.
    std::vector<uint8_t> their_payload;
    if (tr.Wait(*h0, deadline).ok()) {
      auto decoded = engine::DecodeStepHeader(theirs);
      if (decoded.ok()) {
        their_payload.resize(decoded->payload_bytes);
        (void)tr.PostRecv(0, Tag(sequence, phase, 0, 0, kPayload), absl::MakeSpan(their_payload));
      }
    }
    if (p) (void)tr.Wait(*p, deadline);
    // The daemon fails the collective and closes the group; wait for that, bounded.
    (void)tr.Wait(*s0, absl::Now() + absl::Seconds(1));
    Broken();
  }

  // A well-formed collective: rank 1's share of the fault worker's data (global rank 1 of 2).
  absl::Status AllReduce(uint64_t sequence) {
    auto t = Transport(sequence);
    if (!t.ok()) return t.status();
    std::vector<float> data(kElements);
    for (size_t i = 0; i < kElements; ++i) data[i] = 2.0f * static_cast<float>(1 + i % 7);
    kernels::CodecConfig none{kernels::CodecId::kNone};
    none.bits = 0;  // as dynamiqd's
    auto codec = kernels::CreateCodec(none);
    if (!codec.ok()) return codec.status();
    engine::AllReduceOptions o;
    o.job_id = CollectiveId("j", "grad", kElements);
    o.sequence = sequence;
    o.timeout = absl::Seconds(kTimeoutSeconds);
    // The side lane a node of a 2-node cluster sends with every collective (server/contributions.h):
    // its sum of weights and workers (1 and 1, unweighted), each node's lateness (its own 0) and the
    // last collective it knows a configuration change may apply at (none: 0).
    std::vector<double> side = {1, 1, 0, 0, 0, 0};
    o.side_sums = absl::MakeSpan(side);
    auto r = engine::AllReduce(**codec, **t, o, {data.data(), kernels::DType::kFloat32, 0, nullptr},
                               {data.data(), kernels::DType::kFloat32, 0, nullptr}, kElements);
    if (!r.ok()) {
      Broken();
      return r.status();
    }
    return absl::OkStatus();
  }

 private:
  server::GrpcStore store_;
  const std::string transport_name_;
  std::unique_ptr<engine::Transport> transport_;
};

// The daemon (node 0) with one worker of job j, and the rogue as node 1.
struct RogueSetup {
  std::string transport;  // the daemon's --transport and the rogue node's
  ScratchDir dir;
  std::unique_ptr<DaemonProcess> daemon;
  std::unique_ptr<RogueNode> rogue;
  std::unique_ptr<Worker> worker;
  uint64_t sequence = 0;

  void Start() {
    DaemonSpec s;
    s.num_nodes = 2;
    s.listen = absl::StrCat("127.0.0.1:", FreePort());
    s.socket = dir.path() + "/node0.sock";
    s.timeout_seconds = kTimeoutSeconds;
    s.flags.push_back("--transport=" + transport);
    daemon = std::make_unique<DaemonProcess>(DQ_DYNAMIQD, s, dir.path() + "/node0.log");
    ASSERT_TRUE(daemon->Spawn().ok());
    rogue = std::make_unique<RogueNode>(s.listen, transport);
    ASSERT_TRUE(rogue->Join().ok());
    ASSERT_TRUE(daemon->WaitReady().ok());
    WorkerSpec w;
    w.socket = s.socket;
    w.job = "j";
    w.world = 2;
    w.elements = kElements;
    auto started = Worker::Start(DQ_FAULT_WORKER, w, dir.path() + "/worker.log");
    ASSERT_TRUE(started.ok()) << started.status();
    worker = *std::move(started);
  }

  // One well-formed collective; the worker must get the exact sum.
  void Good() {
    worker->Submit();
    absl::Status s = rogue->AllReduce(sequence++);
    const std::string reply = worker->Result();
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_THAT(reply, ::testing::StartsWith("ok ")) << Tail(daemon->log());
  }
};

// Over both CPU transports (GetParam: --transport).
class WireFaultTest : public ::testing::TestWithParam<std::string> {};

TEST_P(WireFaultTest, MalformedMessagesFromAPeerFailTheCollectiveClearlyAndTheDaemonKeepsServing) {
  RogueSetup setup{GetParam()};
  ASSERT_NO_FATAL_FAILURE(setup.Start());
  ASSERT_NO_FATAL_FAILURE(setup.Good());
  const Resources before = setup.daemon->resources();
  auto set32 = [](std::array<uint8_t, 64>& b, size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
  };
  std::vector<Variant> variants;
  {
    Variant v{"bad magic"};
    v.edit_header = [&](std::array<uint8_t, 64>& b) { set32(b, 0, 0xdeadbeef); };
    v.code = "INVALID_ARGUMENT";
    v.message = {"from rank 1", "bad magic"};
    variants.push_back(v);
  }
  {
    Variant v{"unknown version"};
    v.edit_header = [](std::array<uint8_t, 64>& b) { b[4] = 9; };
    v.code = "INVALID_ARGUMENT";
    v.message = {"from rank 1", "step header version 9"};
    variants.push_back(v);
  }
  {
    Variant v{"unknown flags"};
    v.edit_header = [](std::array<uint8_t, 64>& b) { b[7] = 0x80; };
    v.code = "INVALID_ARGUMENT";
    v.message = {"from rank 1", "unknown flags"};
    variants.push_back(v);
  }
  {
    Variant v{"illegal phase"};
    v.edit_header = [](std::array<uint8_t, 64>& b) { b[5] = 7; };
    v.code = "INVALID_ARGUMENT";
    v.message = {"from rank 1", "unknown phase 7"};
    variants.push_back(v);
  }
  {
    Variant v{"another config epoch"};
    v.edit_fields = [](engine::StepHeader& h) { h.config_epoch = 7; };
    v.code = "FAILED_PRECONDITION";
    v.message = {"rank 1 runs a different collective: config epoch 7 (expected 0)"};
    variants.push_back(v);
  }
  {
    Variant v{"another codec"};
    v.edit_fields = [](engine::StepHeader& h) {
      h.codec = static_cast<uint8_t>(kernels::CodecId::kDynamiq);
      h.bits_x1000 = 5000;
    };
    v.code = "FAILED_PRECONDITION";
    v.message = {"rank 1 runs a different collective", "codec dynamiq (expected none)"};
    variants.push_back(v);
  }
  {
    Variant v{"another sequence"};
    v.edit_fields = [](engine::StepHeader& h) { h.sequence += 1000; };
    v.code = "FAILED_PRECONDITION";
    v.message = {"rank 1 runs a different collective", "collective"};
    variants.push_back(v);
  }
  {
    Variant v{"huge announced size"};
    v.edit_fields = [](engine::StepHeader& h) { h.payload_bytes = 0xfffffff0u; };
    v.code = "INVALID_ARGUMENT";
    v.message = {"rank 1 announced 4294967280 payload bytes", "at most"};
    variants.push_back(v);
  }
  {
    Variant v{"claims an authentication tag"};
    v.edit_fields = [](engine::StepHeader& h) { h.authenticated = true; };
    v.code = "UNAUTHENTICATED";
    v.message = {"rank 1 authenticates its messages", "this rank has none"};
    variants.push_back(v);
  }
  {
    Variant v{"wrong checksum"};
    v.stage = Variant::kPayload;
    v.make_payload = [](std::vector<uint8_t>& p, engine::StepHeader& h) {
      h.checksum = engine::PayloadChecksum(p) ^ 1;
    };
    v.code = "DATA_LOSS";
    v.message = {"from rank 1", "failed its checksum"};
    variants.push_back(v);
  }
  {
    Variant v{"truncated payload"};
    v.stage = Variant::kPayload;
    v.send_bytes = 1000;  // of 8224 announced
    // The rest of the receive is whatever its buffer held: the checksum fails (DATA_LOSS), unless
    // it held this peer's previous payload (over tcp: the buffer pool's), when the chunk does.
    v.code = "";
    v.message = {"from rank 1"};
    variants.push_back(v);
  }
  {
    Variant v{"illegal chunk, valid checksum"};
    v.stage = Variant::kPayload;  // 8224 bytes of 0x3f: no chunk header, no valid codes
    v.code = "INVALID_ARGUMENT";
    v.message = {"rank 1"};
    variants.push_back(v);
  }
  {
    Variant v{"short chunk, valid checksum"};
    v.stage = Variant::kPayload;
    v.make_payload = [](std::vector<uint8_t>& p, engine::StepHeader&) { p.resize(40); };
    v.code = "";  // INVALID_ARGUMENT or DATA_LOSS, as the codec classifies it
    v.message = {"rank 1"};
    variants.push_back(v);
  }

  for (const Variant& v : variants) {
    setup.worker->Submit();
    const absl::Time start = absl::Now();
    setup.rogue->SendMalformed(setup.sequence++, v);
    const std::string reply = setup.worker->Result(absl::Seconds(3 * kTimeoutSeconds));
    const absl::Duration took = absl::Now() - start;
    std::cout << v.name << ": " << absl::FormatDuration(took) << ": " << reply << std::endl;
    SCOPED_TRACE(absl::StrCat(v.name, ": ", reply));
    if (v.code.empty()) {
      EXPECT_TRUE(ReplyCode(reply) == "INVALID_ARGUMENT" || ReplyCode(reply) == "DATA_LOSS");
    } else {
      EXPECT_EQ(ReplyCode(reply), v.code);
    }
    for (const std::string& m : v.message) EXPECT_THAT(reply, HasSubstr(m));
    EXPECT_THAT(reply, HasSubstr("job j"));
    EXPECT_LT(took, absl::Seconds(kTimeoutSeconds)) << "the daemon waited for its timeout";
    ASSERT_TRUE(setup.daemon->Alive()) << Tail(setup.daemon->log());
  }
  // The same peer, well-formed again: the group re-forms and the sum is exact.
  ASSERT_NO_FATAL_FAILURE(setup.Good());
  ASSERT_NO_FATAL_FAILURE(setup.Good());
  const Resources after = WaitForResources(setup.daemon->pid(), before, before.shm_mappings);
  std::cout << "before: " << before.ToString() << "\nafter:  " << after.ToString() << std::endl;
  EXPECT_LE(after.fds, before.fds + 2);
  EXPECT_LE(after.threads, before.threads + 3);
  setup.worker->Quit();
  EXPECT_TRUE(setup.daemon->Stop()) << Tail(setup.daemon->log());
}

INSTANTIATE_TEST_SUITE_P(Transports, WireFaultTest, ::testing::Values("tcp", "gloo"),
                         [](const auto& info) { return info.param; });

// Sends a payload longer than its header announced (the daemon posts its receive with the
// announced size) after one good collective; returns the worker's reply.
std::string SendOversizedPayload(RogueSetup& setup) {
  setup.Good();
  Variant v{"oversized payload"};
  v.stage = Variant::kPayload;
  v.send_bytes = 2 * (kElements / 2 * 4 + 32);
  setup.worker->Submit();
  setup.rogue->SendMalformed(setup.sequence++, v);
  return setup.worker->Result(absl::Seconds(3 * kTimeoutSeconds));
}

// dynamiq's own transport (--transport=tcp, the default) reads the frame's size first and fails
// the collective with INVALID_ARGUMENT; the daemon keeps serving.
TEST(WireFaultTcpTest, OversizedPayloadIsRejectedWithoutCrashingTheDaemon) {
  RogueSetup setup{"tcp"};
  ASSERT_NO_FATAL_FAILURE(setup.Start());
  const std::string reply = SendOversizedPayload(setup);
  EXPECT_EQ(ReplyCode(reply), "INVALID_ARGUMENT") << reply;
  EXPECT_THAT(reply, HasSubstr("from rank 1")) << reply;
  ASSERT_TRUE(setup.daemon->Alive()) << Tail(setup.daemon->log());
  ASSERT_NO_FATAL_FAILURE(setup.Good());
  setup.worker->Quit();
  EXPECT_TRUE(setup.daemon->Stop()) << Tail(setup.daemon->log());
}

// Without a cluster secret anyone who reaches the group's port can claim a rank (docs/security.md);
// what such a peer says when it "gives up" (escape codes, CR/LF, NUL, invalid UTF-8) reaches the
// worker's error, the daemon's log and the flight recorder only as safe text, and the flight
// recorder still decodes (a protobuf string must be valid UTF-8).
TEST(WireFaultTcpTest, APeersGaveUpTextReachesErrorsLogsAndTheFlightRecorderAsSafeText) {
  RogueSetup setup{"tcp"};
  ASSERT_NO_FATAL_FAILURE(setup.Start());
  setup.worker->Submit();
  server::GrpcStore store(setup.daemon->spec().listen);
  engine::PrefixStore group(server::Cluster::RendezvousPrefix("j", 1, 0, 0), store);  // as RogueNode::Transport
  const int fd = testing::ConnectToRank(group, 0);
  ASSERT_TRUE(testing::SendRaw(fd, testing::Cat(testing::kPlainHelloMagic, testing::LittleEndian(1, 4))));
  const std::string forged = "bye\r\nE1127 dynamiqd: forged\x1b[31m\0\xff\xfe"s;
  ASSERT_TRUE(testing::SendRaw(fd, testing::Frame(~uint64_t{0}, forged)));
  const std::string reply = setup.worker->Result();
  common::CloseFd(fd);
  EXPECT_EQ(ReplyCode(reply), "UNAVAILABLE") << reply;
  const std::string safe = "rank 1 gave up: bye\\x0d\\x0aE1127 dynamiqd: forged\\x1b[31m\\x00\\xff\\xfe";
  EXPECT_THAT(reply, HasSubstr(safe));
  ctl::ConnectOptions c;
  c.daemon = setup.daemon->spec().listen;
  c.timeout = absl::Seconds(10);
  auto recorded = ctl::ControlClient(c).GetFlightRecorder("j", 10);
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  bool found = false;
  for (const auto& r : recorded->records()) found |= absl::StrContains(r.error(), safe);
  EXPECT_TRUE(found) << recorded->DebugString();
  const std::string log = setup.daemon->log();
  EXPECT_EQ(log.find("forged\x1b"), std::string::npos);
  EXPECT_EQ(log.find("\r\nE1127"), std::string::npos);
  // The group re-forms for the next collective; a real peer there is served as before.
  setup.rogue->Broken();
  setup.sequence = 1;  // collective 0 was the one that failed
  ASSERT_NO_FATAL_FAILURE(setup.Good());
  setup.worker->Quit();
  EXPECT_TRUE(setup.daemon->Stop()) << Tail(setup.daemon->log());
}

// Gloo (libgloo 0.0~git20220518) enforces `preamble.length <= nbytes` on its event-loop thread:
// the exception terminates the daemon ("enforce fail at gloo/transport/tcp/pair.cc:510"). dynamiq
// cannot intercept it (engine/gloo_transport.h); only a peer inside the job's Gloo group can send
// it (with --cluster_secret_file, a node holding the secret). Use --transport=tcp (the default)
// where that matters; run with --gtest_also_run_disabled_tests to reproduce.
TEST(WireFaultGlooTest, DISABLED_OversizedPayloadIsRejectedWithoutCrashingTheDaemon) {
  RogueSetup setup{"gloo"};
  ASSERT_NO_FATAL_FAILURE(setup.Start());
  const std::string reply = SendOversizedPayload(setup);
  EXPECT_NE(ReplyCode(reply), "UNAVAILABLE") << reply;
  EXPECT_TRUE(setup.daemon->Alive()) << Tail(setup.daemon->log());
}

}  // namespace
}  // namespace dynamiq::faults

// NCCL all-reduce tests.
//
// NcclAllReduceProtocolTest runs on the CPU. It checks the host half of the device all-reduce
// (engine/nccl_allreduce_program.h): every rank's sends to a peer match, in order, size and NCCL
// group, that peer's receives; and the driver, run with a host backend (the CPU codecs doing the
// device's arithmetic) over in-memory transports whose tags are erased (so messages match per
// pair in posting order, as NCCL matches them, and a size mismatch is an error), produces exactly
// engine::AllReduce's result.
//
// NcclAllReduceGpuTest needs CUDA devices (2 for the multi-rank tests; ranks are threads, rank r
// on device r) and skips without them: NcclAllReduce must equal engine::AllReduce bit for bit.
#include "engine/nccl_allreduce.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bench/synthetic_gradients.h"
#include "engine/allreduce.h"
#include "engine/gloo_transport.h"
#include "engine/host_staged_transport.h"
#include "engine/memory_transport.h"
#include "engine/nccl_allreduce_program.h"
#include "engine/nccl_transport.h"
#include "engine/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "kernels/cpu/buffer_io.h"
#include "kernels/dynamiq_math.h"
#include "kernels/wire_format.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/transport_test_util.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using kernels::BucketPlan;
using kernels::ChunkRef;
using kernels::Codec;
using kernels::CodecConfig;
using kernels::CodecId;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::unique_ptr<Codec> Make(CodecId id, double bits = 5) {
  CodecConfig c;
  c.id = id;
  c.bits = bits;
  auto codec = kernels::CreateCodec(c);
  EXPECT_THAT(codec, IsOk());
  return std::move(codec).value();
}

// Synthetic gradients, with one all-zero and one constant super-group when they fit (width 0,
// pure mean).
std::vector<std::vector<float>> Inputs(int n, size_t d, uint64_t seed = 7) {
  std::vector<std::vector<float>> inputs(n, std::vector<float>(d));
  if (d == 0) return inputs;
  bench::SyntheticOptions o;
  o.workers = n;
  o.elements = d;
  o.seed = seed;
  inputs = bench::SyntheticGradients(o);
  for (int r = 0; r < n; ++r) {
    for (size_t i = 256; i < std::min<size_t>(d, 512); ++i) inputs[r][i] = 0.0f;
    for (size_t i = 512; i < std::min<size_t>(d, 768); ++i) inputs[r][i] = 0.25f * (r + 1);
  }
  return inputs;
}

AllReduceOptions Options(Topology topology, size_t block_elements, absl::Duration timeout = absl::Seconds(60)) {
  AllReduceOptions o;
  o.topology = topology;
  o.job_id = 42;
  o.config_epoch = 1;
  o.sequence = 5;
  o.block_elements = block_elements;
  o.timeout = timeout;
  return o;
}

void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The CPU engine's result on every rank.
std::vector<std::vector<float>> CpuEngine(const Codec& codec, const std::vector<std::vector<float>>& inputs,
                                          const AllReduceOptions& options) {
  const int n = static_cast<int>(inputs.size());
  const size_t d = inputs[0].size();
  auto transports = MakeMemoryTransports(n);
  std::vector<std::vector<float>> out(n, std::vector<float>(d, NAN));
  OnRanks(n, [&](int r) {
    kernels::Source src{inputs[r].data(), kernels::DType::kFloat32, 0, nullptr};
    kernels::Dest dst{out[r].data(), kernels::DType::kFloat32, 0, nullptr};
    EXPECT_THAT(AllReduce(codec, *transports[r], options, src, dst, d), IsOk()) << "rank " << r;
  });
  return out;
}

// ---- CPU: the protocol.

// Erases tags, so an in-memory transport matches messages between a pair of ranks purely in
// posting order (as NCCL does); the in-memory transport fails a receive whose size differs.
// Abort is local, as ncclCommAbort is: the other ranks go on until they fail themselves (at the
// latest at their deadline). Optionally corrupts one byte of the k-th message this rank sends.
class NcclOrderTransport final : public testing::WrappedTransport {
 public:
  explicit NcclOrderTransport(std::unique_ptr<Transport> inner) : WrappedTransport(std::move(inner)) {}
  std::string name() const override { return "nccl-order(" + inner().name() + ")"; }
  absl::StatusOr<Handle> PostSend(int peer, uint64_t, absl::Span<const uint8_t> data) override {
    if (aborted_) return absl::AbortedError("transport aborted");
    if (sends_++ == corrupt_send_ && corrupt_offset_ < data.size()) {
      std::vector<uint8_t> copy(data.begin(), data.end());
      copy[corrupt_offset_] ^= 0x5a;
      return inner().PostSend(peer, 0, copy);  // the in-memory transport copies at once
    }
    return inner().PostSend(peer, 0, data);
  }
  absl::StatusOr<Handle> PostRecv(int peer, uint64_t, absl::Span<uint8_t> buffer) override {
    if (aborted_) return absl::AbortedError("transport aborted");
    return inner().PostRecv(peer, 0, buffer);
  }
  absl::Status Wait(Handle handle, absl::Time deadline) override {
    if (aborted_) return absl::AbortedError("transport aborted");
    return inner().Wait(handle, deadline);
  }
  void Abort() override { aborted_ = true; }

  void CorruptSend(int index, size_t offset) {
    corrupt_send_ = index;
    corrupt_offset_ = offset;
  }

 private:
  bool aborted_ = false;
  int sends_ = 0;
  int corrupt_send_ = -1;
  size_t corrupt_offset_ = 0;
};

// The CPU codecs playing the device's part, one host buffer per chunk and block (what the
// device backend keeps in device memory).
class HostBackend final : public NcclAllReduceBackend {
 public:
  HostBackend(const Codec& codec, const float* in, float* out, size_t d) : codec_(codec), in_(in), out_(out), d_(d) {}

  absl::Status LocalStats(absl::Span<float> stats) override {
    codec_.ComputeStats(kernels::Source{in_, kernels::DType::kFloat32, 0, nullptr}, d_, stats.data());
    return absl::OkStatus();
  }
  absl::StatusOr<absl::Span<const uint8_t>> StageSend(absl::Span<const uint8_t> host) override {
    stage_send_.assign(host.begin(), host.end());
    return absl::Span<const uint8_t>(stage_send_);
  }
  absl::StatusOr<absl::Span<uint8_t>> StageRecv(size_t bytes) override {
    stage_recv_.assign(bytes, 0);
    return absl::MakeSpan(stage_recv_);
  }
  absl::Status Unstage(absl::Span<const uint8_t> wire, absl::Span<uint8_t> host) override {
    if (wire.size() != host.size()) return absl::InternalError("staged size mismatch");
    std::memcpy(host.data(), wire.data(), wire.size());
    return absl::OkStatus();
  }

  absl::Status Setup(const BucketPlan&, const std::vector<NcclBlock>& blocks, const NcclRankProgram& program,
                     const std::vector<std::vector<size_t>>& bytes) override {
    blocks_ = &blocks;
    program_ = &program;
    buffers_.clear();
    for (const auto& row : bytes) {
      buffers_.emplace_back();
      for (size_t b : row) buffers_.back().emplace_back(b, 0xee);
    }
    accumulators_.assign(blocks.size(), std::vector<std::vector<float>>(program.world_size));
    return absl::OkStatus();
  }
  absl::Span<uint8_t> ChunkBuffer(int block, int chunk) override { return absl::MakeSpan(buffers_[block][chunk]); }

  absl::Status Encode(int block, int chunk) override {
    std::vector<uint8_t>& buffer = buffers_[block][chunk];
    absl::StatusOr<size_t> size = codec_.Compress(Plan(block), Ref(block, chunk), Local(block), absl::MakeSpan(buffer));
    if (!size.ok()) return size.status();
    if (*size != buffer.size()) return absl::InternalError("compressed size differs from the planned size");
    return absl::OkStatus();
  }

  absl::Status OnReceive(int block, const NcclStep& step, bool all_gather, int step_index) override {
    const int c = step.recv_chunk;
    std::vector<uint8_t>& buffer = buffers_[block][c];
    const ChunkRef ref = Ref(block, c);
    absl::Status status = [&]() -> absl::Status {
      absl::StatusOr<std::vector<uint8_t>> expected = NcclChunkPrefix(codec_, Plan(block), ref, step.recv_summands);
      if (!expected.ok()) return expected.status();
      if (expected->size() > buffer.size()) return absl::InternalError("prefix longer than the chunk");
      absl::Status prefix = NcclCheckChunkPrefix(absl::MakeConstSpan(buffer.data(), expected->size()), *expected);
      if (!prefix.ok()) return prefix;
      std::vector<float>& acc = accumulators_[block][c];
      switch (step.action) {
        case NcclReceiveAction::kAccumulate:
          if (step.init_accumulator) {
            acc.resize(ref.count);
            kernels::LoadSource(Local(block), ref.begin, ref.count, acc.data());
          }
          return codec_.DecompressAccumulate(Plan(block), ref, buffer, acc.data());
        case NcclReceiveAction::kDar: {
          const std::vector<uint8_t> in = buffer;
          kernels::Source source = Local(block);
          if (step.from_accumulator) source = kernels::Source{acc.data(), kernels::DType::kFloat32, ref.begin, nullptr};
          absl::StatusOr<size_t> size =
              codec_.DecompressAccumulateRecompress(Plan(block), ref, in, source, absl::MakeSpan(buffer));
          if (!size.ok()) return size.status();
          if (*size != buffer.size()) return absl::InternalError("DAR size differs from the planned size");
          return absl::OkStatus();
        }
        case NcclReceiveAction::kDecode:
          return codec_.Decompress(Plan(block), ref, buffer, Out(block));
        case NcclReceiveAction::kNone:
          break;
      }
      return absl::InternalError("receive without an action");
    }();
    if (status.ok()) return status;
    return absl::Status(status.code(),
                        absl::StrCat(all_gather ? "all-gather" : "reduce-scatter", " step ", step_index, ": chunk ", c,
                                     " of block ", block, " from rank ", step.recv_peer, ": ", status.message()));
  }

  absl::Status FinishReduceScatter(int block) override {
    const int c = program_->owned_chunk;
    if (program_->leaf[c]) {
      absl::Status s = Encode(block, c);
      if (!s.ok()) return s;
    }
    return codec_.Decompress(Plan(block), Ref(block, c), buffers_[block][c], Out(block));
  }
  absl::Status Ready(int) override { return absl::OkStatus(); }

 private:
  const BucketPlan& Plan(int block) const { return (*blocks_)[block].plan; }
  ChunkRef Ref(int block, int chunk) const { return NcclChunkRef(*program_, Plan(block).num_elements, chunk); }
  kernels::Source Local(int block) const {
    const BucketPlan& p = Plan(block);
    return kernels::Source{in_ + (*blocks_)[block].begin, kernels::DType::kFloat32, 0,
                           p.local_means.empty() ? nullptr : p.local_means.data()};
  }
  kernels::Dest Out(int block) const {
    const BucketPlan& p = Plan(block);
    return kernels::Dest{out_ + (*blocks_)[block].begin, kernels::DType::kFloat32, 0,
                         p.mean_sums.empty() ? nullptr : p.mean_sums.data()};
  }

  const Codec& codec_;
  const float* in_;
  float* out_;
  size_t d_;
  const std::vector<NcclBlock>* blocks_ = nullptr;
  const NcclRankProgram* program_ = nullptr;
  std::vector<std::vector<std::vector<uint8_t>>> buffers_;
  std::vector<std::vector<std::vector<float>>> accumulators_;
  std::vector<uint8_t> stage_send_, stage_recv_;
};

struct ProtocolRun {
  std::vector<std::vector<float>> outputs;
  std::vector<absl::StatusOr<AllReduceResult>> results;
};

// The protocol with host backends over tag-erasing in-memory transports. `configure(rank,
// transport)` may corrupt a rank's sends; `codec_for(rank)` may differ per rank.
ProtocolRun RunProtocol(const std::function<const Codec&(int)>& codec_for,
                        const std::vector<std::vector<float>>& inputs, const AllReduceOptions& options,
                        const std::function<void(int, NcclOrderTransport&)>& configure = nullptr) {
  const int n = static_cast<int>(inputs.size());
  const size_t d = inputs[0].size();
  auto memory = MakeMemoryTransports(n);
  std::vector<std::unique_ptr<NcclOrderTransport>> transports;
  for (auto& t : memory) transports.push_back(std::make_unique<NcclOrderTransport>(std::move(t)));
  if (configure) {
    for (int r = 0; r < n; ++r) configure(r, *transports[r]);
  }
  ProtocolRun run;
  run.outputs.assign(n, std::vector<float>(d, NAN));
  run.results.assign(n, absl::UnknownError("not run"));
  OnRanks(n, [&](int r) {
    HostBackend backend(codec_for(r), inputs[r].data(), run.outputs[r].data(), d);
    run.results[r] = RunNcclAllReduce(codec_for(r), *transports[r], options, d, backend);
  });
  return run;
}

TEST(NcclAllReduceProtocolTest, SendsMatchReceivesInOrderSizeAndGroup) {
  const auto codec = Make(CodecId::kDynamiq);
  for (Topology topology : {Topology::kRing, Topology::kButterfly}) {
    for (int n = 2; n <= 8; ++n) {
      if (topology == Topology::kButterfly && (n & (n - 1)) != 0) continue;
      absl::StatusOr<Schedule> schedule = MakeSchedule(topology, n);
      ASSERT_THAT(schedule, IsOk());
      for (size_t d : {size_t{0}, size_t{1}, size_t{300}, size_t{4097}, size_t{70000}}) {
        for (size_t block : {size_t{0}, size_t{2048}}) {
          SCOPED_TRACE(absl::StrCat(TopologyName(topology), " n=", n, " d=", d, " block=", block));
          const auto inputs = Inputs(n, d);
          // Every rank plans from the same reduced statistics (here: the plain sum).
          std::vector<std::vector<float>> local(n, std::vector<float>(codec->StatsLength(d)));
          std::vector<float> reduced(codec->StatsLength(d), 0.0f);
          for (int r = 0; r < n; ++r) {
            codec->ComputeStats(kernels::Source{inputs[r].data(), kernels::DType::kFloat32, 0, nullptr}, d,
                                local[r].data());
            for (size_t i = 0; i < reduced.size(); ++i) reduced[i] += local[r][i];
          }
          std::vector<std::vector<NcclWireOp>> ops(n);
          std::vector<std::vector<std::vector<size_t>>> bytes(n);
          for (int r = 0; r < n; ++r) {
            const kernels::RoundInfo round{5, static_cast<uint32_t>(r), static_cast<uint32_t>(n)};
            absl::StatusOr<BucketPlan> plan = codec->MakePlan(round, d, local[r], reduced);
            ASSERT_THAT(plan, IsOk());
            absl::StatusOr<std::vector<NcclBlock>> blocks = MakeNcclBlocks(*plan, 5, block);
            ASSERT_THAT(blocks, IsOk());
            absl::StatusOr<NcclRankProgram> program = MakeNcclRankProgram(*schedule, r);
            ASSERT_THAT(program, IsOk());
            absl::StatusOr<std::vector<std::vector<size_t>>> b = NcclChunkBytes(*codec, *blocks, n);
            ASSERT_THAT(b, IsOk());
            bytes[r] = *b;
            ops[r] = NcclWireOps(*program, bytes[r]);
            // At most one send and one receive per group.
            std::map<std::pair<int, bool>, int> per_group;
            for (const NcclWireOp& op : ops[r]) {
              const int posted = ++per_group[std::make_pair(op.group, op.send)];
              EXPECT_EQ(posted, 1);
            }
          }
          for (int r = 1; r < n; ++r) EXPECT_EQ(bytes[r], bytes[0]) << "rank " << r << " plans other sizes";
          for (int a = 0; a < n; ++a) {
            for (int b = 0; b < n; ++b) {
              if (a == b) continue;
              std::vector<std::tuple<int, int, int, size_t>> sent, received;
              for (const NcclWireOp& op : ops[a]) {
                if (op.send && op.peer == b) sent.emplace_back(op.group, op.block, op.chunk, op.bytes);
              }
              for (const NcclWireOp& op : ops[b]) {
                if (!op.send && op.peer == a) received.emplace_back(op.group, op.block, op.chunk, op.bytes);
              }
              EXPECT_EQ(sent, received) << "rank " << a << " -> rank " << b;
            }
          }
        }
      }
    }
  }
}

TEST(NcclAllReduceProtocolTest, ProgramsFollowTheRankExecutor) {
  // Ring: one child per hop, no accumulator; the summands grow by one per hop.
  absl::StatusOr<Schedule> ring = MakeSchedule(Topology::kRing, 4);
  ASSERT_THAT(ring, IsOk());
  absl::StatusOr<NcclRankProgram> p = MakeNcclRankProgram(*ring, 1);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->owned_chunk, 2);  // owner(c) = c - 1
  EXPECT_EQ(p->reduce_scatter[0].send_chunk, 1);
  EXPECT_TRUE(p->leaf[1]);
  const int received[] = {0, 3, 2};
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(p->reduce_scatter[s].recv_peer, 0);
    EXPECT_EQ(p->reduce_scatter[s].recv_chunk, received[s]);
    EXPECT_EQ(p->reduce_scatter[s].action, NcclReceiveAction::kDar);
    EXPECT_FALSE(p->reduce_scatter[s].from_accumulator);
    EXPECT_EQ(p->reduce_scatter[s].recv_summands, s + 1);
  }
  EXPECT_EQ(p->summands[1], 1);  // leaf
  EXPECT_EQ(p->summands[0], 2);  // rank 0's leaf + this rank
  EXPECT_EQ(p->summands[2], 4);  // the owner's final bytes sum all 4 ranks
  for (const NcclStep& st : p->all_gather) EXPECT_EQ(st.recv_summands, 4);
  // Butterfly: a chunk with several children accumulates all but the last.
  absl::StatusOr<Schedule> butterfly = MakeSchedule(Topology::kButterfly, 8);
  ASSERT_THAT(butterfly, IsOk());
  int accumulates = 0, dars_from_accumulator = 0;
  for (int r = 0; r < 8; ++r) {
    absl::StatusOr<NcclRankProgram> q = MakeNcclRankProgram(*butterfly, r);
    ASSERT_THAT(q, IsOk());
    for (const NcclStep& st : q->reduce_scatter) {
      accumulates += st.action == NcclReceiveAction::kAccumulate;
      dars_from_accumulator += st.action == NcclReceiveAction::kDar && st.from_accumulator;
    }
  }
  EXPECT_GT(accumulates, 0);
  EXPECT_GT(dars_from_accumulator, 0);
}

// The host-backend protocol equals the CPU engine bit for bit. The sizes include buckets (and
// last pipelining blocks) below 256 x (n - 1) elements that are not a multiple of 256: their
// trailing chunks are empty and start off a super-group boundary, which DynamiQ lays out like the
// CPU engine does (an earlier version refused them and tore the communicator down every step).
TEST(NcclAllReduceProtocolTest, MatchesCpuEngineBitForBit) {
  for (CodecId id : {CodecId::kDynamiq, CodecId::kNone, CodecId::kBf16}) {
    const auto codec = Make(id, id == CodecId::kDynamiq ? 4.5 : 5);
    for (Topology topology : {Topology::kRing, Topology::kButterfly}) {
      for (int n : {1, 2, 3, 4, 5, 8}) {
        if (topology == Topology::kButterfly && (n & (n - 1)) != 0) continue;
        for (size_t d : {size_t{0}, size_t{1}, size_t{100}, size_t{255}, size_t{256}, size_t{257}, size_t{777},
                         size_t{20000}, (size_t{1} << 21) + 100}) {
          for (size_t block : {size_t{0}, size_t{3000}}) {
            if (d > 20000 && (block != 0 || n < 4)) continue;  // the large bucket once per n, in blocks of default size
            SCOPED_TRACE(absl::StrCat(kernels::CodecName(id), " ", TopologyName(topology), " n=", n, " d=", d,
                                      " block=", block));
            const auto inputs = Inputs(n, d, 11 + n);
            const AllReduceOptions options = Options(topology, block);
            const auto expected = CpuEngine(*codec, inputs, options);
            ProtocolRun run = RunProtocol([&](int) -> const Codec& { return *codec; }, inputs, options);
            for (int r = 0; r < n; ++r) {
              ASSERT_THAT(run.results[r], IsOk()) << "rank " << r;
              EXPECT_TRUE(BitEqual(run.outputs[r], expected[r])) << "rank " << r;
              const size_t block_elements = NcclBlockElements(d, block);
              EXPECT_EQ(run.results[r]->blocks,
                        d == 0 ? 1 : static_cast<int>((d + block_elements - 1) / block_elements));
            }
          }
        }
      }
    }
  }
}

// The hybrid data path (dynamiqd --device=cuda --transport=gloo) runs the same protocol over Gloo
// TCP, whose messages match by peer and tag rather than NCCL's posting order: the host backends
// over real Gloo transports on loopback (what HostStagedTransport carries, minus the device copies)
// equal the CPU engine bit for bit, collective after collective on the same group.
TEST(NcclAllReduceProtocolTest, RunsOverGlooTcpBitForBit) {
  for (int n : {2, 3, 4}) {
    InMemoryStore store;
    std::vector<std::unique_ptr<Transport>> gloo(n);
    std::vector<absl::Status> connected(n);
    OnRanks(n, [&](int r) {
      absl::StatusOr<std::unique_ptr<Transport>> t = ConnectGlooTransport(store, r, n, GlooTransportOptions{});
      connected[r] = t.status();
      if (t.ok()) gloo[r] = *std::move(t);
    });
    for (int r = 0; r < n; ++r) ASSERT_THAT(connected[r], IsOk());
    uint64_t sequence = 0;
    for (CodecId id : {CodecId::kDynamiq, CodecId::kNone, CodecId::kBf16}) {
      const auto codec = Make(id, id == CodecId::kDynamiq ? 4.5 : 5);
      for (Topology topology : {Topology::kRing, Topology::kButterfly}) {
        if (topology == Topology::kButterfly && (n & (n - 1)) != 0) continue;
        for (size_t d : {size_t{100}, size_t{257}, size_t{20000}}) {
          for (size_t block : {size_t{0}, size_t{3000}}) {
            SCOPED_TRACE(absl::StrCat(kernels::CodecName(id), " ", TopologyName(topology), " n=", n, " d=", d,
                                      " block=", block));
            const auto inputs = Inputs(n, d, 3 + n);
            AllReduceOptions options = Options(topology, block);
            options.sequence = ++sequence;
            const auto expected = CpuEngine(*codec, inputs, options);
            std::vector<std::vector<float>> outputs(n, std::vector<float>(d, NAN));
            std::vector<absl::StatusOr<AllReduceResult>> results(n, absl::UnknownError("not run"));
            OnRanks(n, [&](int r) {
              HostBackend backend(*codec, inputs[r].data(), outputs[r].data(), d);
              results[r] = RunNcclAllReduce(*codec, *gloo[r], options, d, backend);
            });
            for (int r = 0; r < n; ++r) {
              ASSERT_THAT(results[r], IsOk()) << "rank " << r;
              EXPECT_TRUE(BitEqual(outputs[r], expected[r])) << "rank " << r;
            }
          }
        }
      }
    }
  }
}

TEST(NcclAllReduceProtocolTest, ConfigurationMismatchFailsAtTheHandshakeNamingThePeer) {
  const auto five = Make(CodecId::kDynamiq, 5), four = Make(CodecId::kDynamiq, 4);
  const auto inputs = Inputs(3, 5000);
  ProtocolRun run = RunProtocol([&](int r) -> const Codec& { return r == 1 ? *four : *five; }, inputs,
                                Options(Topology::kRing, 0, absl::Seconds(3)));
  // Rank 2 hears from rank 1, rank 1 from rank 0: both see the other's bits.
  EXPECT_THAT(run.results[2], StatusIs(absl::StatusCode::kFailedPrecondition,
                                       AllOf(HasSubstr("rank 2: "), HasSubstr("rank 1 runs a different collective"),
                                             HasSubstr("bits 4 (expected 5)"))));
  EXPECT_THAT(run.results[1],
              StatusIs(absl::StatusCode::kFailedPrecondition, AllOf(HasSubstr("rank 0 runs a different collective"))));
}

TEST(NcclAllReduceProtocolTest, BucketSizeMismatchFailsAtTheHandshake) {
  const auto codec = Make(CodecId::kNone);
  const auto inputs = Inputs(2, 1000);
  auto memory = MakeMemoryTransports(2);
  std::vector<std::unique_ptr<NcclOrderTransport>> transports;
  for (auto& t : memory) transports.push_back(std::make_unique<NcclOrderTransport>(std::move(t)));
  std::vector<absl::StatusOr<AllReduceResult>> results(2, absl::UnknownError("not run"));
  std::vector<std::vector<float>> out(2, std::vector<float>(1000));
  OnRanks(2, [&](int r) {
    const size_t d = r == 0 ? 1000 : 999;
    HostBackend backend(*codec, inputs[r].data(), out[r].data(), d);
    results[r] = RunNcclAllReduce(*codec, *transports[r], Options(Topology::kRing, 0, absl::Seconds(10)), d, backend);
  });
  EXPECT_THAT(results[0], StatusIs(absl::StatusCode::kFailedPrecondition,
                                   AllOf(HasSubstr("rank 1 runs the same collective with a different bucket"),
                                         HasSubstr("999 elements"))));
}

TEST(NcclAllReduceProtocolTest, CorruptedChunkHeaderIsReportedWithThePeer) {
  const auto codec = Make(CodecId::kDynamiq);
  const auto inputs = Inputs(3, 3000);
  // Rank 0's sends: handshake, 4 statistics messages (2 RS + 2 AG), then its leaf chunk. Corrupt
  // the chunk id of the leaf (header offset 12).
  ProtocolRun run =
      RunProtocol([&](int) -> const Codec& { return *codec; }, inputs, Options(Topology::kRing, 0, absl::Seconds(3)),
                  [](int r, NcclOrderTransport& t) {
                    if (r == 0) t.CorruptSend(5, 12);
                  });
  EXPECT_THAT(run.results[1], StatusIs(absl::StatusCode::kInvalidArgument,
                                       AllOf(HasSubstr("rank 1: reduce-scatter step 0: chunk 0 of block 0 from rank 0"),
                                             HasSubstr("chunk id"))));
}

TEST(NcclAllReduceProtocolTest, CheckChunkPrefixNamesTheDifference) {
  const auto codec = Make(CodecId::kDynamiq);
  const auto inputs = Inputs(1, 2000);
  std::vector<float> stats(codec->StatsLength(2000));
  codec->ComputeStats(kernels::Source{inputs[0].data(), kernels::DType::kFloat32, 0, nullptr}, 2000, stats.data());
  absl::StatusOr<BucketPlan> plan = codec->MakePlan(kernels::RoundInfo{3, 0, 1}, 2000, stats, stats);
  ASSERT_THAT(plan, IsOk());
  const ChunkRef chunk{0, 0, 2000};
  absl::StatusOr<std::vector<uint8_t>> a = NcclChunkPrefix(*codec, *plan, chunk, 2);
  absl::StatusOr<std::vector<uint8_t>> b = NcclChunkPrefix(*codec, *plan, chunk, 3);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_THAT(NcclCheckChunkPrefix(*a, *a), IsOk());
  EXPECT_THAT(NcclCheckChunkPrefix(*b, *a),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("summands 3 (expected 2)")));
  std::vector<uint8_t> map = *a;
  map[kernels::kChunkHeaderBytes + 1] ^= 0x30;  // super-group 3's nibble
  EXPECT_THAT(NcclCheckChunkPrefix(map, *a),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("super-group 3 of the chunk arrived with")));
  // The prefix is what the codec writes.
  std::vector<uint8_t> compressed(codec->MaxEncodedBytes(*plan, chunk));
  kernels::Source src{inputs[0].data(), kernels::DType::kFloat32, 0, plan->local_means.data()};
  ASSERT_THAT(codec->Compress(*plan, chunk, src, absl::MakeSpan(compressed)), IsOk());
  absl::StatusOr<std::vector<uint8_t>> leaf = NcclChunkPrefix(*codec, *plan, chunk, 1);
  ASSERT_THAT(leaf, IsOk());
  EXPECT_THAT(NcclCheckChunkPrefix(absl::MakeConstSpan(compressed.data(), leaf->size()), *leaf), IsOk());
}

TEST(NcclAllReduceProtocolTest, RejectsUnsupportedCodecs) {
  const auto mx = Make(CodecId::kMxfp8);
  const auto inputs = Inputs(2, 512);
  ProtocolRun run = RunProtocol([&](int) -> const Codec& { return *mx; }, inputs, Options(Topology::kRing, 0));
  EXPECT_THAT(run.results[0], StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("mxfp8")));
}

// The protocol posts one send and one receive per rank and step: the two-shot's n - 1 of each are
// refused before anything moves, naming the schedule (engine/schedule.h kNcclStepLimits); with two
// ranks the two-shot is the ring's one transfer per step, and runs.
TEST(NcclAllReduceProtocolTest, RefusesTheTwoShotNamingIt) {
  for (int n : {3, 4}) {
    absl::StatusOr<Schedule> two_shot = MakeSchedule(Topology::kTwoShot, n);
    ASSERT_THAT(two_shot, IsOk());
    EXPECT_THAT(MakeNcclRankProgram(*two_shot, 0),
                StatusIs(absl::StatusCode::kUnimplemented, AllOf(HasSubstr("two_shot"), HasSubstr("one send"))));
    const auto codec = Make(CodecId::kDynamiq);
    const auto inputs = Inputs(n, 4096);
    ProtocolRun run = RunProtocol([&](int) -> const Codec& { return *codec; }, inputs, Options(Topology::kTwoShot, 0));
    for (int r = 0; r < n; ++r) {
      EXPECT_THAT(run.results[r], StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("two_shot"))) << r;
    }
  }
  absl::StatusOr<Schedule> pair = MakeSchedule(Topology::kTwoShot, 2);
  ASSERT_THAT(pair, IsOk());
  EXPECT_THAT(MakeNcclRankProgram(*pair, 1), IsOk());
}

// ---- GPU.

int VisibleDevices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

class NcclAllReduceGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (VisibleDevices() == 0) GTEST_SKIP() << "no CUDA device: the NCCL all-reduce GPU tests need GPUs";
  }

  // Connects `n` ranks, rank r on device r.
  std::vector<std::unique_ptr<Transport>> ConnectAll(int n, const std::string& prefix) {
    PrefixStore store(prefix, store_);
    std::vector<absl::StatusOr<std::unique_ptr<Transport>>> results(n);
    OnRanks(n, [&](int r) { results[r] = ConnectNcclTransport(store, r, n, /*device=*/r, absl::Seconds(120)); });
    std::vector<std::unique_ptr<Transport>> out;
    for (auto& result : results) {
      EXPECT_THAT(result, IsOk());
      if (result.ok()) out.push_back(std::move(*result));
    }
    return out;
  }

  // Runs the device all-reduce on every rank (its own stream; rank r on device_of(r), default r)
  // and returns the downloaded outputs.
  static std::vector<std::vector<float>> RunDevice(const Codec& codec, std::vector<std::unique_ptr<Transport>>& ts,
                                                   const std::vector<std::vector<float>>& inputs,
                                                   const AllReduceOptions& options, bool in_place,
                                                   const std::function<int(int)>& device_of = nullptr,
                                                   std::vector<DeviceAllReduceWorkspace>* workspaces = nullptr) {
    const int n = static_cast<int>(inputs.size());
    const size_t d = inputs[0].size();
    std::vector<std::vector<float>> out(n, std::vector<float>(d, NAN));
    OnRanks(n, [&](int r) {
      const int device = device_of ? device_of(r) : r;
      ASSERT_EQ(cudaSetDevice(device), cudaSuccess);
      cudaStream_t stream = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      void* in_bytes = nullptr;
      void* res_bytes = nullptr;
      const size_t bytes = std::max<size_t>(1, d * sizeof(float));
      ASSERT_EQ(cudaMalloc(&in_bytes, bytes), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&res_bytes, bytes), cudaSuccess);
      float* in = static_cast<float*>(in_bytes);
      float* res = static_cast<float*>(res_bytes);
      ASSERT_EQ(cudaMemset(res, 0xff, bytes), cudaSuccess);
      if (d > 0) {
        ASSERT_EQ(cudaMemcpy(in, inputs[r].data(), d * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      float* target = in_place ? in : res;
      auto result = DeviceAllReduce(codec, *ts[r], device, options, in, target, d, stream,
                                    workspaces != nullptr ? &(*workspaces)[r] : nullptr);
      EXPECT_THAT(result, IsOk()) << "rank " << r;
      if (d > 0) {
        EXPECT_EQ(cudaMemcpy(out[r].data(), target, d * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      }
      (void)cudaFree(in);
      (void)cudaFree(res);
      (void)cudaStreamDestroy(stream);
    });
    return out;
  }

  static void DestroyAll(std::vector<std::unique_ptr<Transport>>& transports) {
    OnRanks(static_cast<int>(transports.size()), [&](int r) { transports[r].reset(); });
  }

  InMemoryStore store_;
};

TEST_F(NcclAllReduceGpuTest, OneRankMatchesCpuEngineBitForBit) {
  auto transports = ConnectAll(1, "one/epoch0");
  ASSERT_EQ(transports.size(), 1u);
  for (CodecId id : {CodecId::kDynamiq, CodecId::kNone, CodecId::kBf16}) {
    const auto codec = Make(id);
    for (size_t d : {size_t{0}, size_t{1}, size_t{1000}, size_t{300000}}) {
      SCOPED_TRACE(absl::StrCat(kernels::CodecName(id), " d=", d));
      const auto inputs = Inputs(1, d);
      const AllReduceOptions options = Options(Topology::kRing, 65536);
      const auto expected = CpuEngine(*codec, inputs, options);
      const auto got = RunDevice(*codec, transports, inputs, options, /*in_place=*/false);
      EXPECT_TRUE(BitEqual(got[0], expected[0]));
    }
  }
  DestroyAll(transports);
}

TEST_F(NcclAllReduceGpuTest, TwoRanksMatchCpuEngineBitForBit) {
  const int devices = VisibleDevices();
  if (devices < 2) GTEST_SKIP() << "needs 2 CUDA devices (one per rank), " << devices << " visible";
  auto transports = ConnectAll(2, "two/epoch0");
  ASSERT_EQ(transports.size(), 2u);
  for (CodecId id : {CodecId::kDynamiq, CodecId::kNone, CodecId::kBf16}) {
    const auto codec = Make(id);
    for (Topology topology : {Topology::kRing, Topology::kButterfly}) {
      for (size_t d : {size_t{1}, size_t{1000}, size_t{300000}}) {
        for (size_t block : {size_t{0}, size_t{65536}}) {
          for (bool in_place : {false, true}) {
            SCOPED_TRACE(absl::StrCat(kernels::CodecName(id), " ", TopologyName(topology), " d=", d, " block=", block,
                                      in_place ? " in place" : ""));
            const auto inputs = Inputs(2, d, 3);
            const AllReduceOptions options = Options(topology, block);
            const auto expected = CpuEngine(*codec, inputs, options);
            const auto got = RunDevice(*codec, transports, inputs, options, in_place);
            for (int r = 0; r < 2; ++r) EXPECT_TRUE(BitEqual(got[r], expected[r])) << "rank " << r;
            EXPECT_TRUE(BitEqual(got[0], got[1]));
          }
        }
      }
    }
  }
  DestroyAll(transports);
}

// The single-GPU loopback harness: n ranks as threads on device 0, each over an in-process
// transport staged through pinned host memory (HostStagedTransport, as the hybrid path stages
// Gloo), running the device program and CUDA backend; equal to the CPU engine bit for bit. One GPU
// is enough, so every lent machine runs the multi-rank device path.
TEST_F(NcclAllReduceGpuTest, LoopbackRanksOnOneGpuMatchCpuEngineBitForBit) {
  for (int n = 2; n <= 8; ++n) {
    std::vector<std::unique_ptr<Transport>> transports;
    for (auto& memory : MakeMemoryTransports(n)) {
      absl::StatusOr<std::unique_ptr<HostStagedTransport>> staged = HostStagedTransport::Create(std::move(memory), 0);
      ASSERT_THAT(staged, IsOk());
      transports.push_back(*std::move(staged));
    }
    // Each rank's workspace lives across its collectives, as a job's data path keeps it: buffers
    // grow with the sizes below and are reused.
    std::vector<DeviceAllReduceWorkspace> workspaces(n);
    uint64_t sequence = 0;
    for (CodecId id : {CodecId::kDynamiq, CodecId::kNone, CodecId::kBf16}) {
      const auto codec = Make(id);
      for (Topology topology : {Topology::kRing, Topology::kButterfly}) {
        if (topology == Topology::kButterfly && (n & (n - 1)) != 0) continue;
        std::vector<size_t> sizes = {1, 100, 255, 256, 257, 20000, (size_t{1} << 21) + 100};
        // 64 MiB per rank once per codec.
        if (n == 4 && topology == Topology::kRing) sizes.push_back(size_t{16} << 20);
        for (size_t d : sizes) {
          SCOPED_TRACE(absl::StrCat(kernels::CodecName(id), " ", TopologyName(topology), " n=", n, " d=", d));
          const auto inputs = Inputs(n, d, 5 + n);
          AllReduceOptions options = Options(topology, 0);
          options.sequence = ++sequence;
          const auto expected = CpuEngine(*codec, inputs, options);
          const auto got = RunDevice(
              *codec, transports, inputs, options, /*in_place=*/d % 2 == 0, [](int) { return 0; }, &workspaces);
          for (int r = 0; r < n; ++r) EXPECT_TRUE(BitEqual(got[r], expected[r])) << "rank " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace dynamiq::engine

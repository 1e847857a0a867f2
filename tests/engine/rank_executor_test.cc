#include "engine/rank_executor.h"

#include <cstring>
#include <memory>
#include <vector>

#include "engine/schedule.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "kernels/payload_checksum.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;

std::unique_ptr<kernels::Codec> Make(kernels::CodecId id) {
  absl::StatusOr<std::unique_ptr<kernels::Codec>> codec = kernels::CreateCodec(kernels::CodecConfig{id});
  EXPECT_THAT(codec, IsOk());
  return std::move(*codec);
}

float Value(int rank, size_t k) { return static_cast<float>((rank + 1) * 0.25 + static_cast<double>(k % 97) / 8); }

// Every rank's executor over one schedule, its inputs and outputs, with the messages moved by hand.
struct Ranks {
  Ranks(const kernels::Codec& codec, Topology topology, int n, size_t d) : d(d) {
    absl::StatusOr<Schedule> made = MakeSchedule(topology, n);
    EXPECT_THAT(made, IsOk());
    schedule = *made;
    in.assign(n, std::vector<float>(d));
    out.assign(n, std::vector<float>(d, -1.0f));
    for (int r = 0; r < n; ++r) {
      for (size_t k = 0; k < d; ++k) in[r][k] = Value(r, k);
      kernels::RoundInfo round{1, static_cast<uint32_t>(r), static_cast<uint32_t>(n)};
      plans.push_back(*codec.MakePlan(round, d, {}, {}));
    }
    for (int r = 0; r < n; ++r) {
      executors.push_back(std::make_unique<RankExecutor>(
          codec, schedule, plans[r], kernels::Source{in[r].data(), kernels::DType::kFloat32, 0, nullptr},
          kernels::Dest{out[r].data(), kernels::DType::kFloat32, 0, nullptr}));
    }
  }
  size_t d;
  Schedule schedule;
  std::vector<std::vector<float>> in, out;
  std::vector<kernels::BucketPlan> plans;
  std::vector<std::unique_ptr<RankExecutor>> executors;
};

TEST(RankExecutorTest, PeersAndChunksAreTheSchedulesTransfersOfThisRank) {
  auto codec = Make(kernels::CodecId::kNone);
  for (Topology t : {Topology::kRing, Topology::kButterfly}) {
    Ranks ranks(*codec, t, 4, 4096);
    for (int r = 0; r < 4; ++r) {
      const RankExecutor& x = *ranks.executors[r];
      EXPECT_EQ(x.rank(), r);
      for (size_t s = 0; s < ranks.schedule.reduce_scatter.size(); ++s) {
        int send = -1, recv = -1, recv_chunk = -1;
        for (const Transfer& tr : ranks.schedule.reduce_scatter[s]) {
          if (tr.from == r) send = tr.to;
          if (tr.to == r) recv = tr.from, recv_chunk = tr.chunk;
        }
        EXPECT_EQ(x.ReduceScatterSendPeer(s), send);
        EXPECT_EQ(x.ReduceScatterRecvPeer(s), recv);
        EXPECT_EQ(x.ReduceScatterRecvChunk(s), recv_chunk);
      }
      for (size_t s = 0; s < ranks.schedule.all_gather.size(); ++s) {
        int send = -1, recv = -1;
        for (const Transfer& tr : ranks.schedule.all_gather[s]) {
          if (tr.from == r) send = tr.to;
          if (tr.to == r) recv = tr.from;
        }
        EXPECT_EQ(x.AllGatherSendPeer(s), send);
        EXPECT_EQ(x.AllGatherRecvPeer(s), recv);
      }
    }
  }
}

// Drives every rank step by step: leaves compress their own values, the last child's arrival
// re-encodes the partial sum, the owner decodes its chunk, the all-gather forwards the same bytes.
TEST(RankExecutorTest, RunsTheScheduleToTheExactSumAndForwardsAllGatherBytesUnchanged) {
  auto codec = Make(kernels::CodecId::kNone);
  for (Topology t : {Topology::kRing, Topology::kButterfly}) {
    const int n = 4;
    const size_t d = 3000;  // chunks of 768, the last one shorter
    Ranks ranks(*codec, t, n, d);
    auto& x = ranks.executors;
    // A send compresses local values exactly when nothing was received for that chunk before.
    for (size_t s = 0; s < ranks.schedule.reduce_scatter.size(); ++s) {
      std::vector<std::vector<uint8_t>> inbox(n);
      for (int r = 0; r < n; ++r) {
        const int to = x[r]->ReduceScatterSendPeer(s);
        if (to < 0) continue;
        absl::StatusOr<absl::Span<const uint8_t>> bytes = x[r]->ReduceScatterSend(s);
        ASSERT_THAT(bytes, IsOk());
        inbox[to].assign(bytes->begin(), bytes->end());
      }
      for (int r = 0; r < n; ++r) {
        if (x[r]->ReduceScatterRecvPeer(s) < 0) continue;
        const int chunk = x[r]->ReduceScatterRecvChunk(s);
        EXPECT_LE(inbox[r].size(), x[r]->MaxMessageBytes(chunk));
        ASSERT_THAT(x[r]->ReduceScatterReceive(s, inbox[r]), IsOk()) << TopologyName(t) << " step " << s;
      }
    }
    for (int r = 0; r < n; ++r) {
      ASSERT_THAT(x[r]->FinishReduceScatter(), IsOk());
      EXPECT_GT(x[r]->owned_bytes(), 0u);
    }
    std::vector<std::vector<uint8_t>> last_received(n);
    for (size_t s = 0; s < ranks.schedule.all_gather.size(); ++s) {
      std::vector<std::vector<uint8_t>> inbox(n);
      for (int r = 0; r < n; ++r) {
        const int to = x[r]->AllGatherSendPeer(s);
        if (to < 0) continue;
        absl::StatusOr<absl::Span<const uint8_t>> bytes = x[r]->AllGatherSend(s);
        ASSERT_THAT(bytes, IsOk());
        inbox[to].assign(bytes->begin(), bytes->end());
        // From the second step on, a rank forwards exactly the bytes it received the step before.
        if (s > 0) EXPECT_EQ(inbox[to], last_received[r]) << "rank " << r << " step " << s;
      }
      for (int r = 0; r < n; ++r) {
        if (x[r]->AllGatherRecvPeer(s) < 0) continue;
        ASSERT_THAT(x[r]->AllGatherReceive(s, inbox[r]), IsOk());
        last_received[r] = inbox[r];
      }
    }
    // Codec none: every rank holds the exact sum (the order of a chunk's additions is its tree's,
    // and these values are exact in fp32 whatever the order).
    for (int r = 0; r < n; ++r) {
      for (size_t k = 0; k < d; ++k) {
        float sum = 0;
        for (int q = 0; q < n; ++q) sum += Value(q, k);
        ASSERT_EQ(ranks.out[r][k], sum) << TopologyName(t) << " rank " << r << " element " << k;
      }
    }
  }
}

TEST(RankExecutorTest, AMessageThatFailsItsHeadersChecksumIsDataLossBeforeItIsUsed) {
  auto codec = Make(kernels::CodecId::kNone);
  Ranks ranks(*codec, Topology::kRing, 2, 1024);
  auto& x = ranks.executors;
  absl::StatusOr<absl::Span<const uint8_t>> sent = x[0]->ReduceScatterSend(0);
  ASSERT_THAT(sent, IsOk());
  std::vector<uint8_t> message(sent->begin(), sent->end());
  const uint64_t checksum = kernels::PayloadChecksum(message);
  message[message.size() / 2] ^= 0x40;  // corrupted in transit
  EXPECT_THAT(x[1]->ReduceScatterReceive(0, message, checksum), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(RankExecutorTest, LossyCodecsGiveEveryRankBitIdenticalResults) {
  for (kernels::CodecId id : {kernels::CodecId::kBf16, kernels::CodecId::kMxfp8}) {
    auto codec = Make(id);
    const int n = 4;
    const size_t d = 5000;
    Ranks ranks(*codec, Topology::kButterfly, n, d);
    auto& x = ranks.executors;
    auto exchange = [&](bool rs, size_t s) {
      std::vector<std::vector<uint8_t>> inbox(n);
      for (int r = 0; r < n; ++r) {
        const int to = rs ? x[r]->ReduceScatterSendPeer(s) : x[r]->AllGatherSendPeer(s);
        if (to < 0) continue;
        absl::StatusOr<absl::Span<const uint8_t>> bytes = rs ? x[r]->ReduceScatterSend(s) : x[r]->AllGatherSend(s);
        ASSERT_THAT(bytes, IsOk());
        inbox[to].assign(bytes->begin(), bytes->end());
      }
      for (int r = 0; r < n; ++r) {
        const int from = rs ? x[r]->ReduceScatterRecvPeer(s) : x[r]->AllGatherRecvPeer(s);
        if (from < 0) continue;
        ASSERT_THAT(rs ? x[r]->ReduceScatterReceive(s, inbox[r]) : x[r]->AllGatherReceive(s, inbox[r]), IsOk());
      }
    };
    for (size_t s = 0; s < ranks.schedule.reduce_scatter.size(); ++s) exchange(true, s);
    for (int r = 0; r < n; ++r) ASSERT_THAT(x[r]->FinishReduceScatter(), IsOk());
    for (size_t s = 0; s < ranks.schedule.all_gather.size(); ++s) exchange(false, s);
    for (int r = 1; r < n; ++r) {
      EXPECT_EQ(0, std::memcmp(ranks.out[r].data(), ranks.out[0].data(), d * sizeof(float)))
          << kernels::CodecName(id) << " rank " << r;
    }
    // And close to the sum.
    for (size_t k = 0; k < d; k += 37) {
      float sum = 0;
      for (int q = 0; q < n; ++q) sum += Value(q, k);
      EXPECT_NEAR(ranks.out[0][k], sum, 0.1f * std::max(1.0f, sum)) << k;
    }
  }
}

}  // namespace
}  // namespace dynamiq::engine

#include "engine/step_messenger.h"

#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "engine/memory_transport.h"
#include "engine/schedule.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "kernels/payload_checksum.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/transport_test_util.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::Pattern;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Flips one payload byte of every message longer than a header it sends.
class CorruptingTransport final : public testing::WrappedTransport {
 public:
  using WrappedTransport::WrappedTransport;
  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override {
    if (data.size() <= kStepHeaderBytes) return inner().PostSend(peer, tag, data);
    copies_.emplace_back(data.begin(), data.end());
    copies_.back()[copies_.back().size() / 2] ^= 0x01;
    return inner().PostSend(peer, tag, copies_.back());
  }

 private:
  std::deque<std::vector<uint8_t>> copies_;
};

class StepMessengerTest : public ::testing::Test {
 protected:
  StepMessengerTest() : codec_(std::move(*kernels::CreateCodec(kernels::CodecConfig{kernels::CodecId::kNone}))) {
    transports_ = MakeMemoryTransports(2);
    for (AllReduceOptions& o : options_) {
      o.job_id = 11;
      o.config_epoch = 3;
      o.sequence = 5;
    }
  }

  // Rank 0 sends `payload` as (reduce-scatter, step 0, block 0) to rank 1, which posts a receive of
  // at most `max_bytes` and receives it. Returns what rank 1's Receive returned, as bytes.
  absl::StatusOr<std::vector<uint8_t>> SendAndReceive(const std::vector<uint8_t>& payload, size_t max_bytes,
                                                      Transport* sender = nullptr,
                                                      std::optional<uint64_t>* deferred = nullptr) {
    Transport& from = sender != nullptr ? *sender : *transports_[0];
    StepMessenger send(from, options_[0], pools_[0], Deadline(), results_[0]);
    StepMessenger recv(*transports_[1], options_[1], pools_[1], Deadline(), results_[1]);
    DQ_RETURN_IF_ERROR(recv.PostReceive(Phase::kReduceScatter, 0, 0, 0, max_bytes));
    DQ_RETURN_IF_ERROR(send.Send(Phase::kReduceScatter, 0, 0, 1, *codec_, payload));
    absl::Status announced = recv.Announce(Phase::kReduceScatter, 0, 0, 0, *codec_);
    if (!announced.ok()) {
      transports_[1]->Abort();  // the payload's receive may be posted; nothing may write into it later
      return announced;
    }
    absl::StatusOr<absl::Span<const uint8_t>> got = recv.Receive(Phase::kReduceScatter, 0, 0, 0, *codec_, deferred);
    if (!got.ok()) {
      transports_[1]->Abort();
      return got.status();
    }
    std::vector<uint8_t> bytes(got->begin(), got->end());
    recv.Release(Phase::kReduceScatter, 0, 0, 0);
    DQ_RETURN_IF_ERROR(send.WaitSent(Phase::kReduceScatter, 0, 0, 1));
    return bytes;
  }

  static absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

  std::unique_ptr<kernels::Codec> codec_;
  std::vector<std::unique_ptr<Transport>> transports_;
  AllReduceOptions options_[2];
  BufferPool pools_[2];
  AllReduceResult results_[2];
};

TEST_F(StepMessengerTest, DeliversThePayloadAndCountsTheBytes) {
  const std::vector<uint8_t> payload = Pattern(0, 1, 5000);
  absl::StatusOr<std::vector<uint8_t>> got = SendAndReceive(payload, 8192);
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(*got, payload);
  EXPECT_EQ(results_[0].bytes_sent, payload.size() + kStepHeaderBytes);
  EXPECT_EQ(results_[1].bytes_received, payload.size() + kStepHeaderBytes);
}

TEST_F(StepMessengerTest, APeerOfAnotherCollectiveIsRefusedNamingBothValues) {
  options_[0].config_epoch = 4;
  options_[0].topology = Topology::kButterfly;
  EXPECT_THAT(SendAndReceive(Pattern(0, 1, 100), 1024),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("rank 0 runs a different collective"), HasSubstr("config epoch 4 (expected 3)"),
                             HasSubstr("schedule butterfly (expected ring)"))));
}

TEST_F(StepMessengerTest, AnAnnouncedPayloadAboveThePlansBoundIsRefusedBeforeItsReceiveIsPosted) {
  EXPECT_THAT(SendAndReceive(Pattern(0, 1, 2000), 1000),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 1000 are possible")));
}

TEST_F(StepMessengerTest, ACorruptedPayloadIsDataLossOrItsChecksumIsHandedToTheDecoder) {
  CorruptingTransport corrupting(std::move(transports_[0]));
  EXPECT_THAT(SendAndReceive(Pattern(0, 1, 3000), 4096, &corrupting), StatusIs(absl::StatusCode::kDataLoss));

  // Deferred: Receive returns the header's checksum for the decoder to verify in its own pass.
  transports_ = MakeMemoryTransports(2);
  const std::vector<uint8_t> payload = Pattern(0, 2, 3000);
  std::optional<uint64_t> deferred;
  absl::StatusOr<std::vector<uint8_t>> got = SendAndReceive(payload, 4096, nullptr, &deferred);
  ASSERT_THAT(got, IsOk());
  ASSERT_TRUE(deferred.has_value());
  EXPECT_EQ(*deferred, kernels::PayloadChecksum(payload));
}

// A step with several transfers per rank (the two-shot's): the messages of one (phase, step, block)
// to and from different peers are told apart by the peer, each with its own payload and checksum.
TEST(StepMessengerPeersTest, OneStepCarriesAMessageOnEveryLink) {
  constexpr int kRanks = 3;
  auto codec = std::move(*kernels::CreateCodec(kernels::CodecConfig{kernels::CodecId::kNone}));
  auto transports = MakeMemoryTransports(kRanks);
  AllReduceOptions options;
  options.job_id = 11;
  options.sequence = 5;
  BufferPool pools[kRanks];
  AllReduceResult results[kRanks];
  std::vector<absl::Status> status(kRanks);
  std::vector<std::vector<std::vector<uint8_t>>> got(kRanks, std::vector<std::vector<uint8_t>>(kRanks));
  // Rank r's message to q: 100 * (r + 1) + q bytes of a pattern of its own.
  auto payload = [](int r, int q) { return Pattern(r, q, 100 * (r + 1) + q); };
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> absl::Status {
        StepMessenger m(*transports[r], options, pools[r], absl::Now() + absl::Seconds(10), results[r]);
        std::vector<std::vector<uint8_t>> mine(kRanks);
        for (int q = 0; q < kRanks; ++q) {
          if (q != r) DQ_RETURN_IF_ERROR(m.PostReceive(Phase::kReduceScatter, 0, 0, q, 4096));
        }
        for (int q = 0; q < kRanks; ++q) {
          if (q == r) continue;
          mine[q] = payload(r, q);
          DQ_RETURN_IF_ERROR(m.Send(Phase::kReduceScatter, 0, 0, q, *codec, mine[q]));
        }
        // A second message on one link at the same step is a caller's bug, named.
        const int other = (r + 1) % kRanks;
        const absl::Status twice = m.Send(Phase::kReduceScatter, 0, 0, other, *codec, mine[other]);
        if (twice.code() != absl::StatusCode::kInternal) return absl::UnknownError("a second message was accepted");
        for (int q = kRanks - 1; q >= 0; --q) {  // in another order than they were sent
          if (q == r) continue;
          DQ_ASSIGN_OR_RETURN(absl::Span<const uint8_t> bytes, m.Receive(Phase::kReduceScatter, 0, 0, q, *codec));
          got[r][q].assign(bytes.begin(), bytes.end());
          m.Release(Phase::kReduceScatter, 0, 0, q);
        }
        for (int q = 0; q < kRanks; ++q) {
          if (q != r) DQ_RETURN_IF_ERROR(m.WaitSent(Phase::kReduceScatter, 0, 0, q));
        }
        return absl::OkStatus();
      }();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_THAT(status[r], IsOk()) << r;
    for (int q = 0; q < kRanks; ++q) {
      if (q == r) continue;
      EXPECT_EQ(got[r][q], payload(q, r)) << "rank " << r << " from " << q;
    }
  }
}

}  // namespace
}  // namespace dynamiq::engine

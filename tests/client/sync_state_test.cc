// SyncState (client/include/dynamiq/sync_state.h) against real daemons: two nodes of two workers
// each, under a lossy codec (DynamiQ 4 bits, every tensor compressed), so only the exact
// (uncompressed) all-reduces can carry a state bit for bit.
#include "dynamiq/sync_state.h"

#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dynamiq/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

class SyncStateTest : public ::testing::Test {
 protected:
  // `nodes` daemons, `local` workers each, every one with a buffer of `bytes`.
  void Start(uint32_t nodes, uint32_t local, size_t bytes) {
    absl::StatusOr<server::JobConfig> config = server::MakeJobConfig("dynamiq", 4, "ring", 1, "measured");
    ASSERT_THAT(config, IsOk());
    auto cluster = testing::StartTestCluster(dir_.path(), nodes, *config);
    ASSERT_THAT(cluster, IsOk());
    daemons_ = *std::move(cluster);
    std::vector<std::thread> threads;
    clients_.resize(nodes * local);
    for (uint32_t node = 0; node < nodes; ++node) {
      for (uint32_t rank = 0; rank < local; ++rank) {
        threads.emplace_back([&, node, rank] {
          ClientOptions o;
          o.socket_path = daemons_[node]->options().worker_socket;
          o.job_id = "j";
          o.local_rank = rank;
          o.local_world_size = local;
          o.timeout = absl::Seconds(30);
          absl::StatusOr<Client> c = Client::Connect(o);
          ASSERT_THAT(c, IsOk());
          clients_[node * local + rank] = std::make_unique<Client>(*std::move(c));
        });
      }
    }
    for (auto& t : threads) t.join();
    for (auto& c : clients_) {
      ASSERT_NE(c, nullptr);
      absl::StatusOr<Buffer> b = c->Allocate(bytes);
      ASSERT_THAT(b, IsOk());
      buffers_.push_back(std::make_unique<Buffer>(*std::move(b)));
    }
  }
  void TearDown() override {
    buffers_.clear();
    clients_.clear();
    for (auto& d : daemons_) d->Shutdown();
  }

  uint8_t* bytes(size_t w) { return static_cast<uint8_t*>(buffers_[w]->data()); }

  // Every worker w syncs `sizes[w]` bytes at once, `window_bytes` per all-reduce of the copy.
  std::vector<absl::StatusOr<SyncStateResult>> SyncAll(const std::vector<size_t>& sizes,
                                                       size_t window_bytes = SyncStateOptions().window_bytes) {
    std::vector<absl::StatusOr<SyncStateResult>> out(clients_.size(), absl::UnknownError(""));
    std::vector<std::thread> threads;
    for (size_t w = 0; w < clients_.size(); ++w) {
      threads.emplace_back([&, w] {
        SyncStateOptions o;
        o.rank = w;
        o.world = clients_.size();
        o.window_bytes = window_bytes;
        out[w] = SyncState(*clients_[w], *buffers_[w], 0, sizes[w], o);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  testing::TempDir dir_;
  std::vector<std::unique_ptr<server::Daemon>> daemons_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
};

TEST_F(SyncStateTest, TheMajoritysStateIsCopiedBitForBitWhateverTheCodecAndASecondSyncSendsNothing) {
  constexpr size_t kBytes = 10001;  // odd: the last 16-bit chunk is half a chunk
  Start(2, 2, kBytes);
  std::mt19937 rng(7);
  std::vector<uint8_t> members(kBytes), joiner(kBytes);
  for (auto& b : members) b = static_cast<uint8_t>(rng());
  for (auto& b : joiner) b = static_cast<uint8_t>(rng());
  // Rank 0 (the joiner, say) holds another state than ranks 1-3.
  std::copy(joiner.begin(), joiner.end(), bytes(0));
  for (size_t w = 1; w < 4; ++w) std::copy(members.begin(), members.end(), bytes(w));
  const std::vector<size_t> sizes(4, kBytes);
  std::vector<absl::StatusOr<SyncStateResult>> first = SyncAll(sizes);
  for (size_t w = 0; w < 4; ++w) {
    ASSERT_THAT(first[w], IsOk()) << w;
    EXPECT_EQ(first[w]->copied, w == 0) << w;
    EXPECT_EQ(first[w]->source, 1u);
    EXPECT_EQ(first[w]->agreeing, 3u);
    EXPECT_EQ(first[w]->hash, StateHash(members));
    EXPECT_TRUE(std::equal(members.begin(), members.end(), bytes(w))) << "worker " << w;
  }
  std::vector<absl::StatusOr<SyncStateResult>> again = SyncAll(sizes);
  for (size_t w = 0; w < 4; ++w) {
    ASSERT_THAT(again[w], IsOk()) << w;
    EXPECT_FALSE(again[w]->copied);
    EXPECT_EQ(again[w]->agreeing, 4u);
  }
}

// A state larger than the window goes over in windows (10 of 1,000 bytes and one of 1 here), and
// arrives whole and bit for bit.
TEST_F(SyncStateTest, AStateLargerThanTheWindowIsCopiedInWindows) {
  constexpr size_t kBytes = 10001;
  Start(2, 1, kBytes);
  std::mt19937 rng(11);
  for (size_t i = 0; i < kBytes; ++i) {
    bytes(0)[i] = static_cast<uint8_t>(rng());
    bytes(1)[i] = static_cast<uint8_t>(rng());
  }
  const std::vector<uint8_t> chosen(bytes(0), bytes(0) + kBytes);  // a tie: rank 0's
  std::vector<absl::StatusOr<SyncStateResult>> synced = SyncAll({kBytes, kBytes}, 1000);
  for (size_t w = 0; w < 2; ++w) {
    ASSERT_THAT(synced[w], IsOk()) << w;
    EXPECT_EQ(synced[w]->copied, w == 1);
    EXPECT_EQ(synced[w]->hash, StateHash(chosen));
    EXPECT_TRUE(std::equal(chosen.begin(), chosen.end(), bytes(w))) << "worker " << w;
  }
}

TEST_F(SyncStateTest, ATieGoesToTheLowestRankAndDifferentSizesAreRefusedOnEveryWorker) {
  Start(1, 2, 64);
  for (size_t i = 0; i < 64; ++i) {
    bytes(0)[i] = static_cast<uint8_t>(i);
    bytes(1)[i] = static_cast<uint8_t>(255 - i);
  }
  std::vector<absl::StatusOr<SyncStateResult>> tie = SyncAll({64, 64});
  for (size_t w = 0; w < 2; ++w) {
    ASSERT_THAT(tie[w], IsOk());
    EXPECT_EQ(tie[w]->source, 0u);
    EXPECT_EQ(tie[w]->agreeing, 1u);
    EXPECT_EQ(bytes(w)[5], 5);
  }
  std::vector<absl::StatusOr<SyncStateResult>> mismatched = SyncAll({64, 32});
  for (size_t w = 0; w < 2; ++w) {
    EXPECT_THAT(mismatched[w], StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds"))) << w;
  }
  // Bad arguments never reach the daemon.
  SyncStateOptions o;
  o.rank = 2;
  o.world = 2;
  EXPECT_THAT(SyncState(*clients_[0], *buffers_[0], 0, 64, o), StatusIs(absl::StatusCode::kInvalidArgument));
  o.rank = 0;
  EXPECT_THAT(SyncState(*clients_[0], *buffers_[0], 0, 65, o), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dynamiq

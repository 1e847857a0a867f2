#include "engine/step_auth.h"

#include <cstring>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "bench/synthetic_gradients.h"
#include "engine/allreduce.h"
#include "engine/memory_transport.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/transport_test_util.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr absl::string_view kSecret = "0123456789abcdef0123456789abcdef";

StepHeader Sample() {
  StepHeader h;
  h.phase = Phase::kReduceScatter;
  h.codec = 2;
  h.bits_x1000 = 5000;
  h.sender = 1;
  h.job_id = 77;
  h.config_epoch = 2;
  h.sequence = 9;
  h.step = 3;
  h.block = 1;
  h.payload_bytes = 100;
  return h;
}

TEST(StepAuthenticatorTest, SealedHeadersVerifyAndAnyChangeFails) {
  auto auth = StepAuthenticator::ForJob(kSecret, "job-a");
  std::vector<uint8_t> payload(100);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 13);
  const auto sealed = auth->Seal(Sample(), /*receiver=*/2, payload);
  absl::StatusOr<StepHeader> decoded = DecodeStepHeader(sealed);
  ASSERT_THAT(decoded, IsOk());
  EXPECT_TRUE(decoded->authenticated);
  EXPECT_THAT(MatchStepHeader(*decoded, Sample()), IsOk());
  EXPECT_TRUE(auth->Verify(sealed, 2, payload));

  // Every header byte (fields, flags and tag alike), the receiver and every payload byte count.
  for (size_t i = 0; i < kStepHeaderBytes; ++i) {
    auto bad = sealed;
    bad[i] ^= 0x01;
    EXPECT_FALSE(auth->Verify(bad, 2, payload)) << "header byte " << i;
  }
  EXPECT_FALSE(auth->Verify(sealed, 3, payload));
  for (size_t i = 0; i < payload.size(); i += 7) {
    payload[i] ^= 0x80;
    EXPECT_FALSE(auth->Verify(sealed, 2, payload)) << "payload byte " << i;
    payload[i] ^= 0x80;
  }
  EXPECT_FALSE(auth->Verify(sealed, 2, absl::MakeConstSpan(payload.data(), 99)));
  EXPECT_FALSE(auth->Verify(absl::MakeConstSpan(sealed.data(), 63), 2, payload));
  // Other jobs and other secrets have other keys.
  EXPECT_FALSE(StepAuthenticator::ForJob(kSecret, "job-b")->Verify(sealed, 2, payload));
  EXPECT_FALSE(StepAuthenticator::ForJob("another secret of enough length", "job-a")->Verify(sealed, 2, payload));
  EXPECT_TRUE(StepAuthenticator::ForJob(kSecret, "job-a")->Verify(sealed, 2, payload));
}

TEST(StepAuthenticatorTest, JobKeyIsTheDocumentedDerivation) {
  // HMAC-SHA256(secret, "dynamiq step key v1" 0x00 job_id), as docs/security.md states.
  const std::string message = std::string("dynamiq step key v1") + '\0' + "job-a";
  EXPECT_EQ(StepAuthenticator::KeyForJob(kSecret, "job-a"), common::HmacSha256(kSecret).Mac(message));
  EXPECT_NE(StepAuthenticator::KeyForJob(kSecret, "job-a"), StepAuthenticator::KeyForJob(kSecret, "job-a2"));
}

// Replaces every payload that rank `from` sends to rank `to` (messages longer than a header) with
// 0xff bytes of the same length: a man in the middle altering gradients.
class TamperingTransport final : public testing::WrappedTransport {
 public:
  TamperingTransport(std::unique_ptr<Transport> inner, int to) : WrappedTransport(std::move(inner)), to_(to) {}
  std::string name() const override { return "tampering"; }
  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override {
    if (peer == to_ && data.size() > kStepHeaderBytes) {
      tampered_.emplace_back(data.size(), 0xff);
      ++count_;
      return inner().PostSend(peer, tag, tampered_.back());
    }
    return inner().PostSend(peer, tag, data);
  }
  int count() const { return count_; }

 private:
  const int to_;
  std::deque<std::vector<uint8_t>> tampered_;
  int count_ = 0;
};

struct RankRun {
  std::vector<std::vector<float>> outputs;
  std::vector<absl::StatusOr<AllReduceResult>> results;
};

// Every rank on its own thread; `auth_for(rank)` is that rank's authenticator (may be null).
template <typename AuthFor>
RankRun RunRanks(std::vector<std::unique_ptr<Transport>>& transports, const kernels::Codec& codec,
                 const std::vector<std::vector<float>>& inputs, Topology topology, AuthFor auth_for) {
  const int n = static_cast<int>(transports.size());
  const size_t d = inputs[0].size();
  RankRun run;
  run.outputs.assign(n, std::vector<float>(d, 0));
  run.results.assign(n, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      AllReduceOptions o;
      o.topology = topology;
      o.job_id = 5;
      o.sequence = 11;
      o.block_elements = 4096;
      o.timeout = absl::Seconds(10);
      o.authenticator = auth_for(r);
      run.results[r] = AllReduce(codec, *transports[r], o, {inputs[r].data(), kernels::DType::kFloat32, 0, nullptr},
                                 {run.outputs[r].data(), kernels::DType::kFloat32, 0, nullptr}, d);
    });
  }
  for (auto& t : threads) t.join();
  return run;
}

std::unique_ptr<kernels::Codec> Codec(kernels::CodecId id) {
  kernels::CodecConfig c;
  c.id = id;
  c.bits = 5;
  return *kernels::CreateCodec(c);
}

std::vector<std::vector<float>> Inputs(int n, size_t d) {
  bench::SyntheticOptions o;
  o.workers = n;
  o.elements = d;
  o.seed = 3;
  return bench::SyntheticGradients(o);
}

TEST(AuthenticatedAllReduceTest, SameResultAndWireBytesAsUnauthenticated) {
  const int n = 4;
  const auto inputs = Inputs(n, 20000);
  for (kernels::CodecId id : {kernels::CodecId::kDynamiq, kernels::CodecId::kNone}) {
    auto codec = Codec(id);
    for (Topology topology : {Topology::kRing, Topology::kButterfly}) {
      auto auth = StepAuthenticator::ForJob(kSecret, "job");
      auto plain_transports = MakeMemoryTransports(n);
      RankRun plain = RunRanks(plain_transports, *codec, inputs, topology, [](int) { return nullptr; });
      auto auth_transports = MakeMemoryTransports(n);
      RankRun authenticated = RunRanks(auth_transports, *codec, inputs, topology, [&](int) { return auth.get(); });
      for (int r = 0; r < n; ++r) {
        ASSERT_THAT(plain.results[r], IsOk());
        ASSERT_THAT(authenticated.results[r], IsOk());
        EXPECT_EQ(authenticated.outputs[r], plain.outputs[r]) << "rank " << r;
        EXPECT_EQ(authenticated.results[r]->bytes_sent, plain.results[r]->bytes_sent);
      }
    }
  }
}

TEST(AuthenticatedAllReduceTest, ARankWithAnotherSecretFailsTheCollectiveNamingIt) {
  const int n = 4;
  const auto inputs = Inputs(n, 20000);
  auto codec = Codec(kernels::CodecId::kDynamiq);
  auto good = StepAuthenticator::ForJob(kSecret, "job");
  auto stray = StepAuthenticator::ForJob("a different cluster secret", "job");
  auto transports = MakeMemoryTransports(n);
  const absl::Time start = absl::Now();
  RankRun run =
      RunRanks(transports, *codec, inputs, Topology::kRing, [&](int r) { return r == 2 ? stray.get() : good.get(); });
  EXPECT_LT(absl::Now() - start, absl::Seconds(9)) << "a failure must abort the group, not wait for the timeout";
  for (int r = 0; r < n; ++r) EXPECT_FALSE(run.results[r].ok()) << "rank " << r;
  // Every rank exchanges statistics with rank 2: whoever checks first names the other side (rank
  // 2 names its peer, a peer names rank 2); the rest see the aborted group.
  int named = 0;
  for (int r = 0; r < n; ++r) {
    const absl::Status& s = run.results[r].status();
    const bool names_the_other_side =
        r == 2 ? absl::StrContains(s.message(), "from rank ") : absl::StrContains(s.message(), "from rank 2");
    named += s.code() == absl::StatusCode::kUnauthenticated &&
             absl::StrContains(s.message(), "authentication failed") && names_the_other_side;
  }
  EXPECT_GE(named, 1) << run.results[0].status() << " / " << run.results[2].status();
}

TEST(AuthenticatedAllReduceTest, AlteredPayloadIsRejectedBeforeItIsDecoded) {
  const int n = 3;
  const auto inputs = Inputs(n, 20000);
  auto codec = Codec(kernels::CodecId::kDynamiq);
  auto auth = StepAuthenticator::ForJob(kSecret, "job");
  for (bool authenticate : {true, false}) {
    auto transports = MakeMemoryTransports(n);
    auto* tamper = new TamperingTransport(std::move(transports[1]), /*to=*/2);
    transports[1].reset(tamper);
    RankRun run =
        RunRanks(transports, *codec, inputs, Topology::kRing, [&](int) { return authenticate ? auth.get() : nullptr; });
    ASSERT_GT(tamper->count(), 0);
    // All-0xff codes are illegal for the dynamiq decoder (INVALID_ARGUMENT had it run): the MAC
    // check comes first and names the sender; without a secret the checksum catches this (unkeyed)
    // alteration, though an attacker could recompute it.
    if (authenticate) {
      EXPECT_THAT(run.results[2], StatusIs(absl::StatusCode::kUnauthenticated,
                                           AllOf(HasSubstr("rank 2: authentication failed"), HasSubstr("from rank 1"),
                                                 HasSubstr("not decoded"))));
    } else {
      EXPECT_THAT(run.results[2], StatusIs(absl::StatusCode::kDataLoss, HasSubstr("from rank 1")));
    }
    for (int r = 0; r < n; ++r) EXPECT_FALSE(run.results[r].ok()) << "rank " << r;
  }
}

TEST(AuthenticatedAllReduceTest, EveryRankMustAuthenticate) {
  const int n = 3;
  const auto inputs = Inputs(n, 5000);
  auto codec = Codec(kernels::CodecId::kDynamiq);
  auto auth = StepAuthenticator::ForJob(kSecret, "job");
  auto transports = MakeMemoryTransports(n);
  RankRun run =
      RunRanks(transports, *codec, inputs, Topology::kRing, [&](int r) { return r == 1 ? nullptr : auth.get(); });
  for (int r = 0; r < n; ++r) EXPECT_FALSE(run.results[r].ok()) << "rank " << r;
  // Ranks 0 and 2 get rank 1's unauthenticated messages; rank 1 gets their authenticated ones.
  // Whoever checks first says which side lacks the secret; the rest see the aborted group.
  int named = 0;
  for (int r = 0; r < n; ++r) {
    const absl::Status& s = run.results[r].status();
    named += s.code() == absl::StatusCode::kUnauthenticated &&
             (r == 1 ? absl::StrContains(s.message(), "authenticates its messages")
                     : absl::StrContains(s.message(), "rank 1 sent an unauthenticated message"));
  }
  EXPECT_GE(named, 1) << run.results[0].status() << " / " << run.results[1].status() << " / "
                      << run.results[2].status();
}

}  // namespace
}  // namespace dynamiq::engine

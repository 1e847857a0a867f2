#include "server/rendezvous_service.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/allreduce.h"
#include "engine/gloo_transport.h"
#include "engine/store.h"
#include "gtest/gtest.h"
#include "kernels/codec_registry.h"
#include "server/grpc_store.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::IsOkAndHolds;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;

// `service` on a free loopback port (`*port`); null if it cannot start.
std::unique_ptr<grpc::Server> Serve(RendezvousService& service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(&service);
  return builder.BuildAndStart();
}

class RendezvousServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = Serve(service_, &port_);
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
    address_ = "127.0.0.1:" + std::to_string(port_);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1)); }

  RendezvousService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
};

TEST_F(RendezvousServiceTest, SetGetAndWait) {
  GrpcStore a(address_), b(address_);
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_THAT(a.Set("k1", std::string("v\0x", 3)), IsOk());
  });
  auto v = b.Get("k1", absl::Seconds(5));  // waits server-side for the late Set
  setter.join();
  ASSERT_THAT(v, IsOk());
  EXPECT_EQ(*v, std::string("v\0x", 3));
  EXPECT_THAT(b.Wait({"k1"}, absl::Seconds(1)), IsOk());
}

TEST_F(RendezvousServiceTest, CompareAndSetSwapsOnlyFromTheExpectedValue) {
  GrpcStore a(address_), b(address_);
  EXPECT_THAT(a.CompareAndSet("epoch", std::nullopt, "1"), IsOkAndHolds(true));   // absent -> 1
  EXPECT_THAT(b.CompareAndSet("epoch", std::nullopt, "1"), IsOkAndHolds(false));  // no longer absent
  EXPECT_THAT(b.CompareAndSet("epoch", "0", "2"), IsOkAndHolds(false));
  EXPECT_THAT(b.CompareAndSet("epoch", "1", "2"), IsOkAndHolds(true));
  EXPECT_THAT(a.Get("epoch", absl::Seconds(1)), IsOkAndHolds("2"));
  // Many clients racing from the same value: exactly one wins.
  std::atomic<int> wins{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      GrpcStore c(address_);
      auto swapped = c.CompareAndSet("epoch", "2", absl::StrCat("3-", i));
      if (swapped.ok() && *swapped) ++wins;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wins.load(), 1);
  EXPECT_THAT(a.CompareAndSet("", "x", "y"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(RendezvousServiceTest, TimeoutsAndBadInputHaveClearCodes) {
  GrpcStore s(address_);
  const absl::Time start = absl::Now();
  EXPECT_THAT(s.Get("missing", absl::Milliseconds(200)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("missing")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(s.Set("", "x"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("store key")));
  EXPECT_THAT(s.Set(std::string(5000, 'k'), "x"), StatusIs(absl::StatusCode::kInvalidArgument));
  GrpcStore nowhere("127.0.0.1:1");
  EXPECT_THAT(nowhere.Set("k", "v"), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("127.0.0.1:1")));
}

// A coordinator from before GetMany: the store answers only Get (everything else UNIMPLEMENTED),
// and counts the calls it gets.
class OldCoordinator final : public dynamiq::v1::Rendezvous::Service {
 public:
  explicit OldCoordinator(RendezvousService& real) : real_(real) {}
  grpc::Status Get(grpc::ServerContext* context, const dynamiq::v1::StoreGetRequest* request,
                   dynamiq::v1::StoreGetResponse* response) override {
    ++gets;
    return real_.Get(context, request, response);
  }
  std::atomic<int> gets{0};

 private:
  RendezvousService& real_;
};

// Several keys' current values in one call; a bad key or too many are INVALID_ARGUMENT; against
// a coordinator without GetMany, GrpcStore reads them one by one and gives the same answer.
TEST_F(RendezvousServiceTest, GetManyReadsSeveralKeysAtOnce) {
  GrpcStore s(address_);
  ASSERT_THAT(s.Set("k1", std::string("v\0x", 3)), IsOk());
  ASSERT_THAT(s.Set("k3", ""), IsOk());
  const std::vector<std::string> keys = {"k1", "k2", "k3", "k1"};
  const std::vector<std::optional<std::string>> want = {std::string("v\0x", 3), std::nullopt, std::string(),
                                                        std::string("v\0x", 3)};
  EXPECT_THAT(s.GetMany(keys), IsOkAndHolds(want));
  EXPECT_THAT(s.GetMany({}), IsOkAndHolds(std::vector<std::optional<std::string>>{}));
  EXPECT_THAT(s.GetMany({"k1", ""}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("store key")));
  EXPECT_THAT(s.GetMany(std::vector<std::string>(kMaxGetManyKeys + 1, "k1")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 64 keys")));
  // An answer holds at most one value's bound of bytes, however many big values it names (3 MiB
  // values: under gRPC's default 4 MiB message).
  ASSERT_THAT(s.Set("big", std::string(size_t{3} << 20, 'x')), IsOk());
  EXPECT_THAT(s.GetMany({"big", "k2"}), IsOk());
  EXPECT_THAT(s.GetMany(std::vector<std::string>(kMaxStoreValueBytes / (size_t{3} << 20) + 1, "big")),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("ask for fewer keys")));

  OldCoordinator old(service_);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&old);
  std::unique_ptr<grpc::Server> old_server = builder.BuildAndStart();
  ASSERT_NE(old_server, nullptr);
  GrpcStore o("127.0.0.1:" + std::to_string(port));
  EXPECT_THAT(o.GetMany(keys), IsOkAndHolds(want));
  EXPECT_EQ(old.gets.load(), 4);
  EXPECT_THAT(o.GetMany(keys), IsOkAndHolds(want));  // knows by now: no GetMany tried
  EXPECT_EQ(old.gets.load(), 8);
  old_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

TEST_F(RendezvousServiceTest, DeleteRemovesKeysAtomicallyWithItsConditionButNeverMembership) {
  GrpcStore s(address_);
  const size_t empty = service_.KeyCount();
  for (const char* key : {"job/a/live/0", "job/a/live/1", "job/a/inc1/gen0/tcp/0", "job/ab/x"}) {
    ASSERT_THAT(s.Set(key, "1"), IsOk());
  }
  EXPECT_EQ(service_.KeyCount(), empty + 4);
  EXPECT_GT(service_.KeyBytes(), 0u);
  engine::Store::Deletion retire;
  retire.keys = {"job/a/live/0"};
  retire.prefix = "job/a/";
  retire.unless_prefix = "job/a/live/";
  EXPECT_THAT(s.Delete(retire), IsOkAndHolds(1u)) << "node 1 still holds job a";
  retire.keys = {"job/a/live/1"};
  EXPECT_THAT(s.Delete(retire), IsOkAndHolds(2u));
  EXPECT_EQ(service_.KeyCount(), empty + 1) << "job/ab/x is not under job/a/";
  EXPECT_THAT(s.Get("job/a/inc1/gen0/tcp/0", absl::Milliseconds(10)), StatusIs(absl::StatusCode::kDeadlineExceeded));

  // Membership is Join's: never deleted (a node whose key went would look forgotten).
  ASSERT_THAT(s.Set("member/0", "x"), IsOk());
  engine::Store::Deletion bad;
  bad.keys = {"member/0"};
  EXPECT_THAT(s.Delete(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("membership")));
  bad.keys.clear();
  bad.prefix = "mem";
  EXPECT_THAT(s.Delete(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("membership")));
  bad.prefix = "member/0/";
  EXPECT_THAT(s.Delete(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  bad.prefix.clear();
  bad.keys.assign(kMaxDeleteKeys + 1, "k");
  EXPECT_THAT(s.Delete(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most")));
  EXPECT_THAT(s.Get("member/0", absl::ZeroDuration()), IsOkAndHolds("x"));
}

TEST(RendezvousServiceLimitsTest, TheStoreRefusesToGrowPastItsLimits) {
  RendezvousService service(nullptr, nullptr, engine::InMemoryStore::Limits{8, 1 << 20});
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(service, &port);
  ASSERT_NE(server, nullptr);
  GrpcStore s("127.0.0.1:" + std::to_string(port));
  for (int i = 0; i < 8; ++i) ASSERT_THAT(s.Set(absl::StrCat("k", i), "v"), IsOk());
  EXPECT_THAT(s.Set("k8", "v"), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("8 keys")));
  engine::Store::Deletion d;
  d.prefix = "k";
  EXPECT_THAT(s.Delete(d), IsOkAndHolds(8u));
  EXPECT_THAT(s.Set("k8", "v"), IsOk());
  EXPECT_EQ(service.KeyCount(), 1u);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

TEST_F(RendezvousServiceTest, EveryNodeLearnsTheSameMembership) {
  const int n = 3;
  std::vector<absl::StatusOr<std::vector<std::string>>> members(n, absl::UnknownError(""));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      GrpcStore s(address_);
      members[r] = s.Join(r, n, "10.0.0." + std::to_string(r + 1) + ":7000", absl::Seconds(10));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_THAT(members[r], IsOk());
    EXPECT_EQ(*members[r], (std::vector<std::string>{"10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"}));
  }
  GrpcStore s(address_);
  EXPECT_THAT(s.Join(1, 3, "10.9.9.9:1", absl::Seconds(1)),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("already joined from 10.0.0.2:7000")));
  EXPECT_THAT(s.Join(0, 4, "10.0.0.1:7000", absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("earlier nodes said 3")));
  EXPECT_THAT(s.Join(5, 3, "x:1", absl::Seconds(1)), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(RendezvousServiceTest, HeartbeatsTellWhichMembersAreLive) {
  GrpcStore s(address_);
  const absl::Time soon = absl::Now() + absl::Seconds(5);
  // Without EnableHeartbeats (a coordinator of a fixed group): the nodes keep every member.
  EXPECT_THAT(s.Heartbeat(0, "10.0.0.1:7000", soon), StatusIs(absl::StatusCode::kUnimplemented));

  RendezvousService service;
  service.EnableHeartbeats(absl::Milliseconds(600), 2);
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(service, &port);
  ASSERT_NE(server, nullptr);
  GrpcStore c("127.0.0.1:" + std::to_string(port));
  std::vector<std::thread> joins;
  for (uint32_t r = 0; r < 3; ++r) {
    joins.emplace_back([&, r] {
      GrpcStore j("127.0.0.1:" + std::to_string(port));
      EXPECT_THAT(j.Join(r, 3, "10.0.0." + std::to_string(r + 1) + ":7000", absl::Seconds(10)), IsOk());
    });
  }
  for (auto& t : joins) t.join();
  absl::StatusOr<LiveSet> first = c.Heartbeat(1, "10.0.0.2:7000", absl::Now() + absl::Seconds(5));
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->live, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(first->min_nodes, 2u);
  // Only a member at the address it joined with keeps its place alive.
  EXPECT_THAT(c.Heartbeat(2, "10.6.6.6:1", absl::Now() + absl::Seconds(5)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a member")));
  EXPECT_THAT(c.Heartbeat(7, "10.0.0.2:7000", absl::Now() + absl::Seconds(5)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // Nodes 1 heartbeats on; node 2 stops: it is silent after the timeout, in a new epoch.
  absl::StatusOr<LiveSet> later;
  for (int i = 0; i < 10; ++i) {
    absl::SleepFor(absl::Milliseconds(150));
    later = c.Heartbeat(1, "10.0.0.2:7000", absl::Now() + absl::Seconds(5));
    ASSERT_THAT(later, IsOk());
  }
  EXPECT_EQ(later->live, (std::vector<uint32_t>{0, 1}));
  ASSERT_EQ(later->silent.size(), 1u);
  EXPECT_EQ(later->silent[0].first, 2u);
  EXPECT_GT(later->silent[0].second, 0.6);
  EXPECT_GT(later->epoch, first->epoch);
  // It heartbeats again: live.
  absl::StatusOr<LiveSet> back = c.Heartbeat(2, "10.0.0.3:7000", absl::Now() + absl::Seconds(5));
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(back->live, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_GT(back->epoch, later->epoch);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

TEST_F(RendezvousServiceTest, JoinTimesOutNamingTheMissingNodes) {
  GrpcStore s(address_);
  EXPECT_THAT(s.Join(0, 2, "a:1", absl::Milliseconds(300)), StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST_F(RendezvousServiceTest, GlooRendezvousAndAllReduceThroughTheCoordinator) {
  const int n = 3;
  const size_t d = 10000;
  kernels::CodecConfig config;
  auto codec = kernels::CreateCodec(config);
  ASSERT_THAT(codec, IsOk());
  std::vector<std::vector<float>> in(n, std::vector<float>(d)), out(n, std::vector<float>(d));
  for (int r = 0; r < n; ++r) {
    for (size_t k = 0; k < d; ++k) in[r][k] = static_cast<float>((k % 97) * 0.01 + r);
  }
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      GrpcStore store(address_);
      engine::PrefixStore scoped("job/epoch0", store);
      auto transport = engine::ConnectGlooTransport(scoped, r, n, engine::GlooTransportOptions{});
      if (!transport.ok()) {
        status[r] = transport.status();
        return;
      }
      status[r] = engine::AllReduce(**codec, **transport, engine::AllReduceOptions{},
                                    {in[r].data(), kernels::DType::kFloat32, 0, nullptr},
                                    {out[r].data(), kernels::DType::kFloat32, 0, nullptr}, d)
                      .status();
    });
  }
  for (auto& t : threads) t.join();
  double err = 0, norm = 0;
  for (int r = 0; r < n; ++r) ASSERT_THAT(status[r], IsOk());
  for (size_t k = 0; k < d; ++k) {
    const double exact = 3 * ((k % 97) * 0.01) + 3;
    err += (out[0][k] - exact) * (out[0][k] - exact);
    norm += exact * exact;
  }
  EXPECT_LT(err / norm, 1e-3);
  EXPECT_EQ(out[1], out[0]);
  EXPECT_EQ(out[2], out[0]);
}

}  // namespace
}  // namespace dynamiq::server

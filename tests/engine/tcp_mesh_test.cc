#include "engine/tcp_mesh.h"

#include <stdint.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "engine/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/raw_tcp_peer.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/transport_test_util.h"

namespace dynamiq::engine {
namespace {

using ::dynamiq::testing::Deadline;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::Pattern;
using ::dynamiq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TcpTransportOptions TestOptions() {
  TcpTransportOptions o;
  o.hostname = "127.0.0.1";
  o.timeout = absl::Seconds(10);
  return o;
}

// Every member sends Pattern(rank, tag) to every other and checks what it receives.
absl::Status ExchangeAll(Transport& t, uint64_t tag, size_t bytes) {
  const int n = t.size();
  std::vector<std::vector<uint8_t>> out(n), in(n);
  std::vector<Transport::Handle> handles;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == t.rank()) continue;
    out[peer] = Pattern(t.rank(), tag, bytes);
    in[peer].resize(bytes);
    DQ_ASSIGN_OR_RETURN(Transport::Handle r, t.PostRecv(peer, tag, absl::MakeSpan(in[peer])));
    DQ_ASSIGN_OR_RETURN(Transport::Handle s, t.PostSend(peer, tag, out[peer]));
    handles.push_back(r);
    handles.push_back(s);
  }
  for (Transport::Handle h : handles) DQ_RETURN_IF_ERROR(t.Wait(h, Deadline()));
  for (int peer = 0; peer < n; ++peer) {
    if (peer != t.rank() && in[peer] != Pattern(peer, tag, bytes)) {
      return absl::DataLossError(absl::StrCat("rank ", t.rank(), ": wrong bytes from rank ", peer));
    }
  }
  return absl::OkStatus();
}

// Runs `nodes` nodes as threads, each with its own mesh, through one store; `fn` runs the node's
// phases (a barrier between them keeps the nodes in step). Returns each node's status.
using NodeFn = std::function<absl::Status(int node, TcpMesh& mesh, Store& store, absl::Barrier* const* barriers)>;
std::vector<absl::Status> RunNodes(int nodes, int phases, const NodeFn& fn) {
  InMemoryStore store;
  std::vector<absl::Barrier*> barriers;
  for (int p = 0; p < phases; ++p) barriers.push_back(new absl::Barrier(nodes));  // freed by Sync
  std::vector<absl::Status> results(nodes);
  std::vector<std::thread> threads;
  for (int node = 0; node < nodes; ++node) {
    threads.emplace_back([&, node] {
      TcpMesh mesh(node, nodes, TestOptions());
      results[node] = fn(node, mesh, store, barriers.data());
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// Waits for every node at `barrier` (the last one out frees it).
void Sync(absl::Barrier* barrier) {
  if (barrier->Block()) delete barrier;
}

// Connects `members` for `session` under rendezvous keys of that session.
absl::StatusOr<std::unique_ptr<Transport>> ConnectView(TcpMesh& mesh, Store& store, std::vector<int> members,
                                                       TcpMeshSession session) {
  PrefixStore scoped(absl::StrCat("view", session.epoch, "-", session.sequence, "/"), store);
  return mesh.Connect(scoped, members, session);
}

TEST(TcpMeshTest, AViewThatDropsAMemberKeepsTheSurvivorsConnections) {
  std::vector<TcpMesh::Counts> counts(3);
  auto results = RunNodes(3, 2, [&](int node, TcpMesh& mesh, Store& store, absl::Barrier* const* barriers) {
    DQ_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, ConnectView(mesh, store, {0, 1, 2}, {0, 0}));
    DQ_RETURN_IF_ERROR(ExchangeAll(*t, 5, 100000));
    t.reset();
    Sync(barriers[0]);
    if (node != 1) {
      // Node 1 is gone from the view; 0 and 2 go on, with the same tags as before.
      DQ_ASSIGN_OR_RETURN(t, ConnectView(mesh, store, {0, 2}, {1, 7}));
      EXPECT_EQ(t->rank(), node == 0 ? 0 : 1);
      EXPECT_EQ(t->size(), 2);
      DQ_RETURN_IF_ERROR(ExchangeAll(*t, 5, 100000));
      DQ_RETURN_IF_ERROR(ExchangeAll(*t, 6, 3));
      t.reset();
    }
    counts[node] = mesh.counts();
    Sync(barriers[1]);
    return absl::OkStatus();
  });
  testing::ExpectAllOk(results);
  EXPECT_EQ(counts[0].made, 2u);
  EXPECT_EQ(counts[0].kept, 1u);
  EXPECT_EQ(counts[2].made, 2u);
  EXPECT_EQ(counts[2].kept, 1u);
  EXPECT_EQ(counts[1].kept, 0u);
}

// What an aborted exchange left on a kept connection (a message kept before its receive, and one
// that arrives after the abort) never reaches the next view, which uses the same tags.
TEST(TcpMeshTest, AnAbortedExchangesMessagesNeverReachTheNextView) {
  auto results = RunNodes(2, 3, [&](int node, TcpMesh& mesh, Store& store, absl::Barrier* const* barriers) {
    DQ_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, ConnectView(mesh, store, {0, 1}, {0, 0}));
    const std::vector<uint8_t> old_bytes(5000, 0xaa);
    if (node == 1) {
      DQ_ASSIGN_OR_RETURN(Transport::Handle s, t->PostSend(0, 7, old_bytes));
      DQ_RETURN_IF_ERROR(t->Wait(s, Deadline()));
    }
    Sync(barriers[0]);
    if (node == 0) {
      t->Abort();  // node 0 never posted the receive: the message was kept, and goes with the view
    } else {
      std::vector<uint8_t> buf(8);
      DQ_ASSIGN_OR_RETURN(Transport::Handle r, t->PostRecv(0, 9, absl::MakeSpan(buf)));
      EXPECT_THAT(t->Wait(r, Deadline()), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 0 gave up")));
      // Still sent after node 0 gave up: it arrives at a connection that serves no view.
      DQ_ASSIGN_OR_RETURN(Transport::Handle s, t->PostSend(0, 7, old_bytes));
      (void)t->Wait(s, Deadline());
    }
    Sync(barriers[1]);
    t.reset();
    DQ_ASSIGN_OR_RETURN(t, ConnectView(mesh, store, {0, 1}, {1, 1}));
    EXPECT_EQ(mesh.counts().kept, 1u);
    if (node == 0) {
      std::vector<uint8_t> got(5000);
      DQ_ASSIGN_OR_RETURN(Transport::Handle r, t->PostRecv(1, 7, absl::MakeSpan(got)));
      DQ_RETURN_IF_ERROR(t->Wait(r, Deadline()));
      EXPECT_EQ(got, Pattern(1, 7, 5000));
    } else {
      const std::vector<uint8_t> fresh = Pattern(1, 7, 5000);
      DQ_ASSIGN_OR_RETURN(Transport::Handle s, t->PostSend(0, 7, fresh));
      DQ_RETURN_IF_ERROR(t->Wait(s, Deadline()));
    }
    DQ_RETURN_IF_ERROR(ExchangeAll(*t, 8, 64));
    Sync(barriers[2]);
    return absl::OkStatus();
  });
  testing::ExpectAllOk(results);
}

// A view that failed on its own (a peer's message longer than its receive) still tells its other
// peers why when it is aborted, as the daemon does with a failed collective: they fail at once,
// not at their deadline, though the connections stay.
TEST(TcpMeshTest, AViewThatFailedOnItsOwnTellsItsOtherPeersWhyAtItsAbort) {
  auto results = RunNodes(3, 1, [&](int node, TcpMesh& mesh, Store& store, absl::Barrier* const* barriers) {
    DQ_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, ConnectView(mesh, store, {0, 1, 2}, {0, 0}));
    if (node == 1) {
      const std::vector<uint8_t> big(100, 1);
      DQ_ASSIGN_OR_RETURN(Transport::Handle s, t->PostSend(0, 4, big));
      (void)t->Wait(s, Deadline());
    } else if (node == 0) {
      std::vector<uint8_t> small(10);
      DQ_ASSIGN_OR_RETURN(Transport::Handle r, t->PostRecv(1, 4, absl::MakeSpan(small)));
      EXPECT_THAT(t->Wait(r, Deadline()),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a message of 100 bytes")));
      t->Abort();
    } else {
      std::vector<uint8_t> buf(8);
      DQ_ASSIGN_OR_RETURN(Transport::Handle r, t->PostRecv(0, 9, absl::MakeSpan(buf)));
      const absl::Time start = absl::Now();
      EXPECT_THAT(t->Wait(r, absl::Now() + absl::Seconds(20)),
                  StatusIs(absl::StatusCode::kUnavailable,
                           AllOf(HasSubstr("rank 0 gave up"), HasSubstr("a message of 100 bytes"))));
      EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    }
    Sync(barriers[0]);
    return absl::OkStatus();
  });
  testing::ExpectAllOk(results);
}

// A node that restarted (a new mesh: it holds no connections) is connected again; the survivor
// replaces the connection it still held.
TEST(TcpMeshTest, ANodeThatLostItsConnectionsIsConnectedAgain) {
  InMemoryStore store;
  TcpMesh survivor(0, 2, TestOptions());
  auto restarted = std::make_unique<TcpMesh>(1, 2, TestOptions());
  for (int round = 0; round < 2; ++round) {
    if (round == 1) restarted = std::make_unique<TcpMesh>(1, 2, TestOptions());
    absl::Status other;
    std::thread node1([&] {
      auto t = ConnectView(*restarted, store, {0, 1}, {0, static_cast<uint64_t>(round)});
      other = t.ok() ? ExchangeAll(**t, 3, 1000) : t.status();
    });
    auto t = ConnectView(survivor, store, {0, 1}, {0, static_cast<uint64_t>(round)});
    ASSERT_THAT(t, IsOk());
    EXPECT_THAT(ExchangeAll(**t, 3, 1000), IsOk());
    node1.join();
    EXPECT_THAT(other, IsOk());
  }
  EXPECT_EQ(survivor.counts().made, 2u);
  EXPECT_EQ(survivor.counts().kept, 0u);
}

TEST(TcpMeshTest, ConnectRefusesBadMembersAndASecondViewAtOnce) {
  InMemoryStore store;
  TcpMesh mesh(0, 3, TestOptions());
  EXPECT_THAT(mesh.Connect(store, {1, 2}, {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a member")));
  EXPECT_THAT(mesh.Connect(store, {2, 0}, {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ascending")));
  EXPECT_THAT(mesh.Connect(store, {0, 3}, {}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ascending")));
  auto alone = mesh.Connect(store, {0}, {});
  ASSERT_THAT(alone, IsOk());
  EXPECT_THAT(mesh.Connect(store, {0}, {0, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is still there")));
  alone->reset();
  EXPECT_THAT(mesh.Connect(store, {0}, {0, 2}), IsOk());
}

// A raw peer as rank 1: fences name what its messages belong to. A message of a later session
// waits for that session's view; a fence of the wrong size, or back to an earlier session, closes
// the connection.
class TcpMeshFenceTest : public ::testing::Test {
 protected:
  void Connect(TcpMeshSession session = {2, 10}) {
    PrefixStore scoped(absl::StrCat("s", session.epoch, ".", session.sequence, "/"), store_);
    std::thread node0([&] { view_ = mesh_.Connect(scoped, {0, 1}, session); });
    fd_ = testing::ConnectToRank(scoped, 0);
    ASSERT_TRUE(testing::SendRaw(fd_, testing::Cat(testing::kPlainHelloMagic, testing::LittleEndian(1, 4))));
    node0.join();
    ASSERT_THAT(view_, IsOk());
  }
  void TearDown() override { common::CloseFd(fd_); }
  static std::vector<uint8_t> Fence(uint64_t epoch, uint64_t sequence) {
    return testing::Cat(testing::Cat(testing::LittleEndian(~uint64_t{1}, 8), testing::LittleEndian(16, 8)),
                        testing::Cat(testing::LittleEndian(epoch, 8), testing::LittleEndian(sequence, 8)));
  }
  absl::Status Receive(uint64_t tag, absl::Duration within, std::string* got) {
    std::vector<uint8_t> buf(16);
    DQ_ASSIGN_OR_RETURN(Transport::Handle h, (*view_)->PostRecv(1, tag, absl::MakeSpan(buf)));
    DQ_RETURN_IF_ERROR((*view_)->Wait(h, absl::Now() + within));
    got->assign(buf.begin(), buf.end());
    return absl::OkStatus();
  }

  static TcpTransportOptions SmallEarlyBudget() {
    TcpTransportOptions o = TestOptions();
    o.max_early_bytes = 8 << 10;
    return o;
  }

  InMemoryStore store_;
  TcpMesh mesh_{0, 2, SmallEarlyBudget()};
  absl::StatusOr<std::unique_ptr<Transport>> view_;
  int fd_ = -1;
};

TEST_F(TcpMeshFenceTest, MessagesBelongToTheLastFencesSession) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  std::string got;
  // A new connection's messages belong to the session it was made for.
  ASSERT_TRUE(testing::SendRaw(fd_, testing::Frame(3, "now")));
  ASSERT_THAT(Receive(3, absl::Seconds(10), &got), IsOk());
  EXPECT_EQ(got.substr(0, 3), "now");
  // After a fence to a later session they wait for that session's view.
  ASSERT_TRUE(testing::SendRaw(fd_, testing::Cat(Fence(3, 0), testing::Frame(3, "later"))));
  EXPECT_THAT(Receive(3, absl::Milliseconds(300), &got), StatusIs(absl::StatusCode::kDeadlineExceeded));
}

// What a connection kept for a later session is given back when the connection is replaced: the
// next connection has the whole early budget (8 KiB here) for its own messages.
TEST_F(TcpMeshFenceTest, AReplacedConnectionGivesBackWhatItKeptForLater) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  ASSERT_TRUE(testing::SendRaw(fd_, testing::Cat(Fence(5, 0), testing::Frame(3, std::string(4000, 'a')))));
  common::CloseFd(fd_);
  fd_ = -1;
  std::string got;
  EXPECT_THAT(Receive(3, absl::Seconds(10), &got), StatusIs(absl::StatusCode::kUnavailable));
  view_->reset();
  ASSERT_NO_FATAL_FAILURE(Connect({3, 0}));  // the peer (a new process) holds no connection: made again
  EXPECT_EQ(mesh_.counts().made, 2u);
  // The message of tag 4 is kept (4000 + 1024 bytes of the budget) so that the one of tag 3 behind
  // it can be read; without room for it, the connection would wait for a receive of tag 4.
  ASSERT_TRUE(testing::SendRaw(fd_, testing::Cat(testing::Frame(4, std::string(4000, 'b')), testing::Frame(3, "c"))));
  ASSERT_THAT(Receive(3, absl::Seconds(3), &got), IsOk());
  EXPECT_EQ(got[0], 'c');
}

TEST_F(TcpMeshFenceTest, AFenceOfTheWrongSizeClosesTheConnection) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  ASSERT_TRUE(testing::SendRaw(fd_, testing::Frame(~uint64_t{1}, "abc")));
  std::string got;
  EXPECT_THAT(Receive(3, absl::Seconds(10), &got),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("a fence frame of 3 bytes")));
  EXPECT_TRUE(testing::ClosedByPeer(fd_));
}

TEST_F(TcpMeshFenceTest, AFenceBackToAnEarlierSessionClosesTheConnection) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  ASSERT_TRUE(testing::SendRaw(fd_, Fence(2, 9)));
  std::string got;
  EXPECT_THAT(Receive(3, absl::Seconds(10), &got),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("a fence back to an earlier session")));
  EXPECT_TRUE(testing::ClosedByPeer(fd_));
}

}  // namespace
}  // namespace dynamiq::engine

// The submission ring's two ends (ipc/submission_ring_server.h, ipc/submission_ring_client.h) in one
// process: requests and answers carried field for field, sleepers woken from another thread,
// deadlines, a daemon that goes away or closes the ring, and a worker that writes what it likes
// into its ring (which must cost it its ring, and nothing else).
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ipc/shm_region.h"
#include "ipc/submission_ring_client.h"
#include "ipc/submission_ring_server.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::ipc {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

constexpr absl::Duration kLong = absl::Seconds(20);

struct Pair {
  std::unique_ptr<SubmissionRingServer> server;
  std::unique_ptr<SubmissionRingClient> client;
  // The ring's bytes as anyone could write them (mapped before the client unlinked the name).
  ShmRegion raw;
};

Pair MakePair(uint32_t slots = 4, uint32_t num_nodes = 8) {
  Pair p;
  SubmissionRingServer::Options o;
  o.slots = slots;
  o.num_nodes = num_nodes;
  o.name_hint = "ringtest";
  auto server = SubmissionRingServer::Create(o);
  EXPECT_THAT(server.status(), IsOk());
  p.server = *std::move(server);
  auto raw = ShmRegion::Open(p.server->shm_name(), p.server->bytes());
  EXPECT_THAT(raw.status(), IsOk());
  p.raw = *std::move(raw);
  auto client = SubmissionRingClient::Open(p.server->shm_name(), p.server->bytes());
  EXPECT_THAT(client.status(), IsOk());
  p.client = *std::move(client);
  return p;
}

ring::RingRequest Request(uint64_t submission, std::string name = "layer.weight") {
  ring::RingRequest r;
  r.submission = submission;
  r.buffer_id = 7;
  r.offset_bytes = 64;
  r.num_elements = 1024;
  r.dtype = 1;
  r.average = true;
  r.weight = 2.5;
  r.tensor_name = std::move(name);
  return r;
}

// Waits (bounded) until the server has something, and returns it.
std::vector<SubmissionRingServer::Submission> TakeSome(SubmissionRingServer& server) {
  auto got = server.Wait(kLong);
  EXPECT_THAT(got.status(), IsOk());
  return got.ok() ? *std::move(got) : std::vector<SubmissionRingServer::Submission>();
}

TEST(SubmissionRingTest, CarriesARequestAndItsAnswerFieldForField) {
  Pair p = MakePair();
  const std::optional<uint32_t> slot = p.client->Acquire();
  ASSERT_TRUE(slot.has_value());
  p.client->Submit(*slot, Request(41));
  std::vector<SubmissionRingServer::Submission> got = TakeSome(*p.server);
  ASSERT_THAT(got, SizeIs(1));
  EXPECT_THAT(got[0].bad, IsOk());
  EXPECT_EQ(got[0].slot, *slot);
  const ring::RingRequest& r = got[0].request;
  EXPECT_EQ(r.submission, 41u);
  EXPECT_EQ(r.buffer_id, 7u);
  EXPECT_EQ(r.offset_bytes, 64u);
  EXPECT_EQ(r.num_elements, 1024u);
  EXPECT_EQ(r.dtype, 1u);
  EXPECT_TRUE(r.average);
  EXPECT_FALSE(r.exact);
  EXPECT_FALSE(r.async);
  EXPECT_EQ(r.weight, 2.5);
  EXPECT_EQ(r.tensor_name, "layer.weight");
  EXPECT_EQ(p.server->InFlight(), 1u);
  EXPECT_FALSE(p.client->IsDone(*slot));

  ring::RingCompletion c;
  c.sequence = 9;
  c.config_epoch = 3;
  c.codec = "dynamiq";
  c.bits = 4.875;
  c.wire_bytes = 123456;
  c.measured_vnmse = 0.01;
  c.contributors = 6;
  c.weight_sum = 14.5;
  c.nodes = {0, 2, 7};
  p.server->Complete(got[0].slot, c);
  EXPECT_EQ(p.server->InFlight(), 0u);
  ASSERT_THAT(p.client->WaitDone(*slot, absl::Now() + kLong), IsOk());
  const ring::RingCompletion back = p.client->Take(*slot);
  EXPECT_THAT(back.status, IsOk());
  EXPECT_EQ(back.sequence, 9u);
  EXPECT_EQ(back.config_epoch, 3u);
  EXPECT_EQ(back.codec, "dynamiq");
  EXPECT_EQ(back.bits, 4.875);
  EXPECT_EQ(back.wire_bytes, 123456u);
  EXPECT_EQ(back.measured_vnmse, 0.01);
  EXPECT_EQ(back.contributors, 6u);
  EXPECT_EQ(back.weight_sum, 14.5);
  EXPECT_THAT(back.nodes, ElementsAre(0, 2, 7));
}

TEST(SubmissionRingTest, AnErrorAndALongMessageComeBackCut) {
  Pair p = MakePair();
  const uint32_t slot = *p.client->Acquire();
  p.client->Submit(slot, Request(0));
  ASSERT_THAT(TakeSome(*p.server), SizeIs(1));
  ring::RingCompletion c;
  c.status = absl::NotFoundError(std::string(10000, 'x'));
  p.server->Complete(slot, c);
  ASSERT_THAT(p.client->WaitDone(slot, absl::Now() + kLong), IsOk());
  const ring::RingCompletion back = p.client->Take(slot);
  EXPECT_THAT(back.status, StatusIs(absl::StatusCode::kNotFound, HasSubstr("... (cut)")));
  EXPECT_EQ(back.status.message().size(), ring::kMaxMessageBytes);
  EXPECT_FALSE(back.measured_vnmse.has_value());
}

TEST(SubmissionRingTest, EverySlotInFlightMeansNoSlotAndATakenSlotIsFreeAgain) {
  Pair p = MakePair(/*slots=*/2);
  const uint32_t a = *p.client->Acquire();
  const uint32_t b = *p.client->Acquire();
  EXPECT_NE(a, b);
  EXPECT_FALSE(p.client->Acquire().has_value());
  p.client->Submit(a, Request(0));
  p.client->Submit(b, Request(1, "second"));
  std::vector<SubmissionRingServer::Submission> got = TakeSome(*p.server);
  ASSERT_THAT(got, SizeIs(2));  // in submission order
  EXPECT_EQ(got[0].request.submission, 0u);
  EXPECT_EQ(got[1].request.tensor_name, "second");
  p.server->Complete(b, ring::RingCompletion{});
  ASSERT_THAT(p.client->WaitDone(b, absl::Now() + kLong), IsOk());
  p.client->Take(b);
  EXPECT_EQ(p.client->Acquire(), b);
}

TEST(SubmissionRingTest, SleepersOnBothEndsAreWokenFromAnotherThread) {
  Pair p = MakePair();
  // The daemon sleeps until the worker submits; the worker sleeps until the daemon answers.
  std::thread daemon([&] {
    for (int i = 0; i < 50; ++i) {
      std::vector<SubmissionRingServer::Submission> got = TakeSome(*p.server);
      for (const auto& s : got) {
        ring::RingCompletion c;
        c.sequence = s.request.submission;
        p.server->Complete(s.slot, c);
      }
      if (!got.empty() && got.back().request.submission == 49) return;
    }
  });
  const absl::Time start = absl::Now();
  for (uint64_t i = 0; i < 50; ++i) {
    const uint32_t slot = *p.client->Acquire();
    if (i % 10 == 0) absl::SleepFor(absl::Milliseconds(5));  // let the daemon fall asleep
    p.client->Submit(slot, Request(i));
    ASSERT_THAT(p.client->WaitDone(slot, absl::Now() + kLong), IsOk());
    EXPECT_EQ(p.client->Take(slot).sequence, i);
  }
  daemon.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(SubmissionRingTest, AsyncAnswersRingTheReapersDoorbellSyncOnesDoNot) {
  Pair p = MakePair();
  const uint32_t sync_slot = *p.client->Acquire();
  const uint32_t async_slot = *p.client->Acquire();
  p.client->Submit(sync_slot, Request(0));
  ring::RingRequest async = Request(1);
  async.async = true;
  p.client->Submit(async_slot, async);
  ASSERT_THAT(TakeSome(*p.server), SizeIs(2));
  const uint32_t before = p.client->AsyncDone();
  p.server->Complete(sync_slot, ring::RingCompletion{});
  EXPECT_EQ(p.client->AsyncDone(), before);
  std::thread answer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    p.server->Complete(async_slot, ring::RingCompletion{});
  });
  const absl::Time start = absl::Now();
  while (p.client->AsyncDone() == before && absl::Now() - start < kLong) p.client->WaitAsync(before, kLong);
  answer.join();
  EXPECT_EQ(p.client->AsyncDone(), before + 1);
  EXPECT_TRUE(p.client->IsDone(async_slot));
}

TEST(SubmissionRingTest, AWaitPastItsDeadlineSaysSo) {
  Pair p = MakePair();
  const uint32_t slot = *p.client->Acquire();
  p.client->Submit(slot, Request(0));
  const absl::Time start = absl::Now();
  EXPECT_THAT(p.client->WaitDone(slot, absl::Now() + absl::Milliseconds(100), absl::Milliseconds(1)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(SubmissionRingTest, AWaiterLearnsPromptlyThatTheDaemonWentAway) {
  Pair p = MakePair();
  const uint32_t slot = *p.client->Acquire();
  p.client->Submit(slot, Request(0));
  EXPECT_THAT(p.client->Health(), IsOk());
  std::thread gone([&] {
    absl::SleepFor(absl::Milliseconds(50));
    p.server.reset();  // its lock goes with it, as when the daemon dies
  });
  const absl::Time start = absl::Now();
  EXPECT_THAT(p.client->WaitDone(slot, absl::Now() + kLong),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("dynamiqd exited")));
  gone.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(SubmissionRingTest, ADaemonThatDiesHoldsNoLockAnyMore) {
  // The lock is the kernel's to release: a child process creates the ring and is killed.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pipe_fds[0]);
    SubmissionRingServer::Options o;
    auto server = SubmissionRingServer::Create(o);
    if (!server.ok()) _exit(1);
    const std::string line = absl::StrCat((*server)->shm_name(), " ", (*server)->bytes(), "\n");
    if (write(pipe_fds[1], line.data(), line.size()) != static_cast<ssize_t>(line.size())) _exit(1);
    pause();
    _exit(0);
  }
  close(pipe_fds[1]);
  char buf[256] = {};
  ssize_t n = 0;
  for (ssize_t got; n < static_cast<ssize_t>(sizeof(buf)) - 1 && (got = read(pipe_fds[0], buf + n, 1)) == 1;) {
    if (buf[n++] == '\n') break;
  }
  close(pipe_fds[0]);
  const std::string line(buf, n);
  const size_t space = line.find(' ');
  ASSERT_NE(space, std::string::npos) << line;
  auto client = SubmissionRingClient::Open(line.substr(0, space), std::stoul(line.substr(space + 1)));
  ASSERT_THAT(client.status(), IsOk());
  EXPECT_THAT((*client)->Health(), IsOk());
  kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_THAT((*client)->Health(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(SubmissionRingTest, ClosingFailsWhatWasNotTakenAndTellsTheWorkerWhy) {
  Pair p = MakePair();
  const uint32_t taken = *p.client->Acquire();
  p.client->Submit(taken, Request(0));
  ASSERT_THAT(TakeSome(*p.server), SizeIs(1));
  const uint32_t left = *p.client->Acquire();
  p.client->Submit(left, Request(1));
  p.server->Stop();
  EXPECT_THAT(p.server->Wait(kLong), ::dynamiq::testing::IsOkAndHolds(IsEmpty()));
  p.server->Close(absl::FailedPreconditionError("worker 3 unregistered"));
  ASSERT_TRUE(p.client->IsDone(left));
  EXPECT_THAT(p.client->Take(left).status, StatusIs(absl::StatusCode::kFailedPrecondition, "worker 3 unregistered"));
  EXPECT_THAT(p.client->Health(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("worker 3 unregistered")));
  // The collective already taken still answers into its slot.
  p.server->Complete(taken, ring::RingCompletion{});
  EXPECT_TRUE(p.client->IsDone(taken));
}

// A worker writing into its ring directly.
ring::Header& HeaderOf(Pair& p) { return *reinterpret_cast<ring::Header*>(p.raw.data()); }
uint32_t* SqOf(Pair& p, uint32_t slots, uint32_t num_nodes) {
  return reinterpret_cast<uint32_t*>(p.raw.data() + ring::Geometry::Of(slots, num_nodes).sq_offset);
}
ring::Slot& SlotOf(Pair& p, uint32_t slots, uint32_t num_nodes, uint32_t i) {
  const ring::Geometry g = ring::Geometry::Of(slots, num_nodes);
  return *reinterpret_cast<ring::Slot*>(p.raw.data() + g.slot_offset + g.slot_bytes * i);
}

TEST(SubmissionRingTest, MalformedRequestsAreAnsweredWithTheirErrors) {
  Pair p = MakePair(4, 8);
  SlotOf(p, 4, 8, 0).request.name_bytes = 5000;
  SlotOf(p, 4, 8, 1).request.flags = 0x80;
  SqOf(p, 4, 8)[0] = 0;
  SqOf(p, 4, 8)[1] = 1;
  ring::Atomic(HeaderOf(p).sq_head).store(2);
  std::vector<SubmissionRingServer::Submission> got = TakeSome(*p.server);
  ASSERT_THAT(got, SizeIs(2));
  EXPECT_THAT(got[0].bad, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("5000 bytes")));
  EXPECT_THAT(got[1].bad, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("flags 0x80")));
  EXPECT_THAT(p.client->Health(), IsOk());  // the ring goes on
}

TEST(SubmissionRingTest, ABrokenProtocolClosesTheRingAndOnlyIt) {
  struct Case {
    const char* what;
    std::function<void(Pair&)> write;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"too many", [](Pair& p) { ring::Atomic(HeaderOf(p).sq_head).store(100); }, "100 submissions"},
      {"index out of range",
       [](Pair& p) {
         SqOf(p, 4, 8)[0] = 9;
         ring::Atomic(HeaderOf(p).sq_head).store(1);
       },
       "slot index 9"},
      {"a slot twice",
       [](Pair& p) {
         SqOf(p, 4, 8)[0] = 2;
         SqOf(p, 4, 8)[1] = 2;
         ring::Atomic(HeaderOf(p).sq_head).store(2);
       },
       "slot 2 submitted again"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Pair p = MakePair(4, 8);
    Pair other = MakePair(4, 8);
    c.write(p);
    EXPECT_THAT(p.server->Wait(kLong), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(c.says)));
    EXPECT_THAT(p.server->Wait(kLong), StatusIs(absl::StatusCode::kFailedPrecondition));  // for good
    EXPECT_THAT(p.client->Health(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(c.says)));
    // Another worker's ring is untouched.
    const uint32_t slot = *other.client->Acquire();
    other.client->Submit(slot, Request(0));
    EXPECT_THAT(TakeSome(*other.server), SizeIs(1));
    EXPECT_THAT(other.client->Health(), IsOk());
  }
}

TEST(SubmissionRingTest, OpenRefusesWhatIsNotARing) {
  auto plain = ShmRegion::Create(1 << 20, "notaring");
  ASSERT_THAT(plain.status(), IsOk());
  EXPECT_THAT(SubmissionRingClient::Open(plain->name(), plain->size()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("magic")));
  // A header whose geometry does not fit the object.
  Pair p = MakePair(4, 8);
  auto again = ShmRegion::Create(p.server->bytes(), "badgeometry");
  ASSERT_THAT(again.status(), IsOk());
  std::memcpy(again->data(), p.raw.data(), p.server->bytes());
  reinterpret_cast<ring::Header*>(again->data())->slots = 1000;
  EXPECT_THAT(SubmissionRingClient::Open(again->name(), again->size()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("slots")));
}

TEST(SubmissionRingTest, CreateChecksItsOptions) {
  SubmissionRingServer::Options o;
  o.slots = 0;
  EXPECT_THAT(SubmissionRingServer::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o.slots = ring::kMaxSlots + 1;
  EXPECT_THAT(SubmissionRingServer::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o.slots = 4;
  o.num_nodes = 0;
  EXPECT_THAT(SubmissionRingServer::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dynamiq::ipc

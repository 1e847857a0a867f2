// Job (server/job.h) on its own, with a fake DataPath that records its calls: when a collective
// runs, what it runs through, what the workers get back, and how configuration changes apply.
#include "server/job.h"

#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "engine/memory_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/data_path.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Sums in a vector of its own, writes it back; records the calls. Single node: no cross-node step.
class FakeDataPath final : public DataPath {
 public:
  absl::Status LocalReduce(absl::Span<const Region> inputs, size_t n) override {
    absl::MutexLock lock(&mu_);
    calls_.push_back(absl::StrCat("reduce ", inputs.size(), "x", n));
    if (!fail_reduce_.ok()) return fail_reduce_;
    sum_.assign(n, 0.0f);
    for (const Region& r : inputs) {
      for (size_t i = 0; i < n; ++i) sum_[i] += r.weight * reinterpret_cast<const float*>(r.data)[i];
    }
    return absl::OkStatus();
  }
  // The cross-node step: a no-op when the test has given the job other nodes (cross_node_ok).
  bool has_side_lane() const override { return false; }
  absl::StatusOr<CrossNodeResult> CrossNode(const kernels::Codec&, engine::Transport&, const engine::AllReduceOptions&,
                                            size_t, double) override {
    absl::MutexLock lock(&mu_);
    if (!cross_node_ok_) return absl::InternalError("a single-node job has no cross-node step");
    calls_.push_back("cross");
    return CrossNodeResult{};
  }
  void AllowCrossNode() {
    absl::MutexLock lock(&mu_);
    cross_node_ok_ = true;
  }
  absl::Status WriteBack(absl::Span<const Output> outputs, size_t n, float scale) override {
    absl::MutexLock lock(&mu_);
    calls_.push_back(absl::StrCat("write ", outputs.size(), " scale ", scale));
    for (const Output& out : outputs) {
      for (size_t i = 0; i < n; ++i) {
        reinterpret_cast<float*>(out.region.data)[i] = out.average ? sum_[i] * scale : sum_[i];
      }
    }
    return absl::OkStatus();
  }
  void FailReduce(absl::Status s) {
    absl::MutexLock lock(&mu_);
    fail_reduce_ = std::move(s);
  }
  std::vector<std::string> calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  absl::Mutex mu_;
  std::vector<float> sum_;
  std::vector<std::string> calls_;
  absl::Status fail_reduce_;
  bool cross_node_ok_ = false;
};

// One node's coordinator: publishes a change to bf16 (epoch 1) that applies at collective 2.
class ChangeAtTwo final : public JobCoordinator {
 public:
  absl::StatusOr<std::unique_ptr<engine::Transport>> Connect(const GroupView&, uint64_t) override {
    return absl::InternalError("a single-node job has no transport");
  }
  absl::StatusOr<bool> PollConfig(uint64_t sequence, uint64_t* epoch, JobConfig* config) override {
    if (sequence < 2 || *epoch >= 1) return false;
    *epoch = 1;
    *config = *MakeJobConfig("bf16", 0, "ring", 0, "measured");
    return true;
  }
  absl::Status ReportFailure(uint64_t, const absl::Status&, absl::Time) override { return absl::OkStatus(); }
  std::optional<FailureCause> LookupFailure(uint64_t, absl::Time) override { return std::nullopt; }
};

// Node 0 of two: connects in memory, and its view claims wait in the store until Release (a
// coordinator round trip that takes its time).
class SlowViewClaims final : public JobCoordinator {
 public:
  absl::StatusOr<std::unique_ptr<engine::Transport>> Connect(const GroupView&, uint64_t) override {
    return std::move(engine::MakeMemoryTransports(2)[0]);
  }
  absl::StatusOr<GroupView> ClaimView(const GroupView& current, std::vector<uint32_t> members,
                                      uint64_t first_sequence) override {
    claiming_.Notify();
    released_.WaitForNotification();
    absl::StatusOr<GroupView> view = GroupView::Make(current.epoch() + 1, std::move(members), first_sequence, 2, 0);
    absl::MutexLock lock(&mu_);
    if (view.ok()) claimed_ = *view;
    return view;
  }
  absl::StatusOr<GroupView> NewestView(const GroupView& current) override {
    absl::MutexLock lock(&mu_);
    return claimed_.has_value() && claimed_->epoch() > current.epoch() ? *claimed_ : current;
  }
  absl::StatusOr<bool> PollConfig(uint64_t, uint64_t*, JobConfig*) override { return false; }
  absl::Status ReportFailure(uint64_t, const absl::Status&, absl::Time) override { return absl::OkStatus(); }
  std::optional<FailureCause> LookupFailure(uint64_t, absl::Time) override { return std::nullopt; }
  void WaitUntilClaiming() { claiming_.WaitForNotification(); }
  void Release() { released_.Notify(); }

 private:
  absl::Notification claiming_, released_;
  absl::Mutex mu_;
  std::optional<GroupView> claimed_ ABSL_GUARDED_BY(mu_);
};

JobConfig NoneConfig() { return *MakeJobConfig("none", 0, "ring", 0, "measured"); }

class JobTest : public ::testing::Test {
 protected:
  Job::Options Options(int workers) {
    Job::Options o;
    o.id = "j";
    o.local_world_size = workers;
    o.config = NoneConfig();
    o.timeout = absl::Seconds(10);
    o.data_path = path_;
    return o;
  }

  Job::Request Request(uint64_t worker, std::vector<float>& data, const std::string& name, bool average = false) {
    Job::Request r;
    r.worker_id = worker;
    r.buffer_id = worker;
    r.tensor_name = name;
    r.num_elements = data.size();
    r.average = average;
    r.region = absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(data.data()), data.size() * sizeof(float));
    return r;
  }

  // One collective of two workers: `a` submitted on another thread, `b` on this one.
  static std::pair<absl::StatusOr<Job::Result>, absl::StatusOr<Job::Result>> SubmitBoth(Job& job, const Job::Request& a,
                                                                                        const Job::Request& b) {
    absl::StatusOr<Job::Result> first;
    std::thread t([&] { first = job.Submit(a); });
    absl::StatusOr<Job::Result> second = job.Submit(b);
    t.join();
    return {std::move(first), std::move(second)};
  }

  std::shared_ptr<FakeDataPath> path_ = std::make_shared<FakeDataPath>();
};

TEST_F(JobTest, AllLocalWorkersSubmittedRunsOneCollectiveThroughTheDataPath) {
  Job job(Options(2));
  ASSERT_THAT(job.AddWorker(1, 0, 2), IsOk());
  ASSERT_THAT(job.AddWorker(2, 1, 2), IsOk());
  std::vector<float> a = {1, 2, 3}, b = {10, 20, 30};
  absl::StatusOr<Job::Result> first;
  std::thread t([&] { first = job.Submit(Request(1, a, "w")); });
  absl::StatusOr<Job::Result> second = job.Submit(Request(2, b, "w", /*average=*/true));
  t.join();
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(first->sequence, 0u);
  EXPECT_EQ(second->sequence, 0u);
  EXPECT_THAT(a, ElementsAre(11, 22, 33));
  EXPECT_THAT(b, ElementsAre(5.5, 11, 16.5));  // averaged over 1 node x 2 workers
  EXPECT_THAT(path_->calls(), ElementsAre("reduce 2x3", "write 2 scale 0.5"));
  EXPECT_EQ(job.GetStatus().completed, 1u);
}

// Whatever the answer, the job has let go of the request's buffer hold before it gives it: the
// worker may release the buffer as soon as it has the answer (it was refused now and then).
TEST_F(JobTest, TheBufferHoldIsGoneBeforeTheAnswer) {
  Job job(Options(1));
  ASSERT_THAT(job.AddWorker(1, 0, 1), IsOk());
  std::vector<float> a = {1, 2, 3};
  for (const bool refused : {false, true}) {
    SCOPED_TRACE(refused ? "refused (a negative weight)" : "run (inline, on this thread)");
    Job::Request r = Request(1, a, "g");
    if (refused) r.weight = -1;
    auto hold = std::make_shared<int>(0);
    const std::weak_ptr<int> watch = hold;
    r.buffer_use = std::move(hold);
    bool answered = false, held = true;
    job.Enqueue(std::move(r), [&](absl::StatusOr<Job::Result> result) {
      EXPECT_EQ(result.ok(), !refused) << result.status();
      held = !watch.expired();
      answered = true;
    });
    ASSERT_TRUE(answered);
    EXPECT_FALSE(held);
  }
}

TEST_F(JobTest, AWeightedMeanDividesByTheWeightsAndReportsWhatWasSummed) {
  Job job(Options(2));
  ASSERT_THAT(job.AddWorker(1, 0, 2), IsOk());
  ASSERT_THAT(job.AddWorker(2, 1, 2), IsOk());
  std::vector<float> a = {1, 2, 3}, b = {5, 6, 7};
  Job::Request ra = Request(1, a, "w", /*average=*/true), rb = Request(2, b, "w", /*average=*/true);
  ra.weight = 3;
  rb.weight = 1;
  absl::StatusOr<Job::Result> first, second;
  std::tie(first, second) = SubmitBoth(job, ra, rb);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_THAT(a, ElementsAre(2, 3, 4));  // (3a + b) / 4
  EXPECT_EQ(first->weight_sum, 4.0);
  EXPECT_EQ(first->contributors, 2u);
  EXPECT_THAT(path_->calls(), ElementsAre("reduce 2x3", "write 2 scale 0.25"));
  // Unweighted: the mean over the workers, which the result reports as their number.
  std::tie(first, second) = SubmitBoth(job, Request(1, a, "w", true), Request(2, b, "w", true));
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(second->weight_sum, 2.0);
  EXPECT_EQ(second->contributors, 2u);
  // A weight that is no sample count is refused for its worker, before it joins a collective.
  Job::Request bad = Request(1, a, "w");
  bad.weight = -2;
  EXPECT_THAT(job.Submit(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("finite and >= 0")));
  EXPECT_EQ(job.NextSequence(), 2u);
}

// Asynchronous submission: Enqueue returns at once, one thread can keep many collectives
// outstanding, and each completion runs exactly once, in sequence order per worker.
TEST_F(JobTest, EnqueueReturnsAtOnceAndCompletesEveryRequestOnce) {
  Job job(Options(2));
  ASSERT_THAT(job.AddWorker(1, 0, 2), IsOk());
  ASSERT_THAT(job.AddWorker(2, 1, 2), IsOk());
  constexpr int kCollectives = 5;
  std::vector<std::vector<float>> a(kCollectives, std::vector<float>{1, 2}), b(kCollectives, std::vector<float>{3, 4});
  absl::Mutex mu;
  std::vector<std::pair<uint64_t, uint64_t>> done;  // (worker, sequence)
  auto record = [&](uint64_t worker) {
    return [&, worker](absl::StatusOr<Job::Result> r) {
      ASSERT_THAT(r, IsOk());
      absl::MutexLock lock(&mu);
      done.emplace_back(worker, r->sequence);
    };
  };
  // One thread, every request of both workers: the old blocking Submit needed a thread each.
  for (int k = 0; k < kCollectives; ++k) job.Enqueue(Request(1, a[k], "w"), record(1));
  for (int k = 0; k < kCollectives; ++k) job.Enqueue(Request(2, b[k], "w"), record(2));
  auto all_done = [&]() { return done.size() == 2 * kCollectives; };
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all_done), absl::Seconds(10)));
  }
  for (int k = 0; k < kCollectives; ++k) EXPECT_THAT(a[k], ElementsAre(4, 6)) << k;
  std::vector<uint64_t> worker1;
  for (const auto& [worker, sequence] : done) {
    if (worker == 1) worker1.push_back(sequence);
  }
  EXPECT_THAT(worker1, ElementsAre(0, 1, 2, 3, 4));
  // A refused request completes at once, on the caller's thread.
  std::vector<float> c = {1};
  bool refused = false;
  job.Enqueue(Request(9, c, "w"), [&](absl::StatusOr<Job::Result> r) {
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition));
    refused = true;
  });
  EXPECT_TRUE(refused);
}

// A numbered request the daemon refused keeps its place: the worker hears why at once, the
// collective fails for the other worker naming it, and the next collective runs.
TEST_F(JobTest, ARefusedNumberedRequestFailsItsCollectiveAndTheNextOneRuns) {
  Job job(Options(2));
  ASSERT_THAT(job.AddWorker(1, 0, 2), IsOk());
  ASSERT_THAT(job.AddWorker(2, 1, 2), IsOk());
  std::vector<float> a = {1, 2}, b = {3, 4};
  Job::Request refused = Request(1, a, "w");
  refused.submission = 0;
  refused.refused = absl::NotFoundError("buffer 7 of worker 1 is not registered");
  bool told = false;
  job.Enqueue(refused, [&](absl::StatusOr<Job::Result> r) {
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kNotFound, "buffer 7 of worker 1 is not registered"));
    told = true;
  });
  EXPECT_TRUE(told);  // at once
  // A weight out of range is such a refusal too.
  Job::Request weightless = Request(2, b, "w");
  weightless.submission = 0;
  weightless.weight = -1;
  EXPECT_THAT(job.Submit(weightless), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight -1")));
  // Collective 0 failed for both (no data touched); collective 1 runs.
  Job::Request ra = Request(1, a, "v"), rb = Request(2, b, "v");
  ra.submission = 1;
  rb.submission = 1;
  const auto [first, second] = SubmitBoth(job, ra, rb);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(first->sequence, 1u);
  EXPECT_THAT(a, ElementsAre(4, 6));
  const std::vector<CollectiveRecord> records = job.FlightRecorder(10);
  ASSERT_GE(records.size(), 2u);
  bool named = false;
  for (const CollectiveRecord& r : records) {
    if (r.sequence == 0) named = r.state == "failed" && absl::StrContains(r.error, "local rank 0's all-reduce");
  }
  EXPECT_TRUE(named);
}

// A small one-node collective runs on the thread whose request completes it (no hand-over to the
// reducer); a big one on the reducer thread. Either way every worker gets the same result.
TEST_F(JobTest, ASmallCollectiveRunsOnTheThreadThatCompletesItABigOneOnTheReducer) {
  Job job(Options(2));
  ASSERT_THAT(job.AddWorker(1, 0, 2), IsOk());
  ASSERT_THAT(job.AddWorker(2, 1, 2), IsOk());
  for (size_t n : {size_t{1024}, size_t{1} << 19}) {
    SCOPED_TRACE(n);
    std::vector<float> a(n, 1.0f), b(n, 2.0f);
    absl::Mutex mu;
    std::vector<std::thread::id> completed_on;
    auto record = [&](absl::StatusOr<Job::Result> r) {
      EXPECT_THAT(r, IsOk());
      absl::MutexLock lock(&mu);
      completed_on.push_back(std::this_thread::get_id());
    };
    job.Enqueue(Request(1, a, absl::StrCat("t", n)), record);
    job.Enqueue(Request(2, b, absl::StrCat("t", n)), record);  // completes the collective
    auto both = [&]() { return completed_on.size() == 2; };
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&both), absl::Seconds(10)));
    EXPECT_EQ(completed_on[0], completed_on[1]);
    if (n <= 1024) {
      EXPECT_EQ(completed_on[0], std::this_thread::get_id());
    } else {
      EXPECT_NE(completed_on[0], std::this_thread::get_id());
    }
    EXPECT_EQ(a[n - 1], 3.0f);
    EXPECT_EQ(b[0], 3.0f);
  }
}

// The stall check is the reducer's: a collective still incomplete --timeout after its first
// request fails for the workers that did submit, naming the one that did not, and the job goes on.
TEST_F(JobTest, TheReducerFailsAStalledCollectiveNamingTheRankThatNeverSubmitted) {
  Job::Options o = Options(2);
  o.timeout = absl::Milliseconds(300);
  Job job(o);
  ASSERT_THAT(job.AddWorker(1, 0, 2, /*pid=*/4242), IsOk());
  ASSERT_THAT(job.AddWorker(2, 1, 2), IsOk());
  std::vector<float> a = {1}, b = {2};
  const absl::Time start = absl::Now();
  absl::StatusOr<Job::Result> alone = job.Submit(Request(2, b, "w"));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_THAT(alone, StatusIs(absl::StatusCode::kDeadlineExceeded,
                              HasSubstr("local ranks that did not submit: 0 (worker 1, pid 4242)")));
  EXPECT_GE(waited, absl::Milliseconds(290));
  EXPECT_LT(waited, absl::Seconds(5));
  EXPECT_EQ(job.GetStatus().failed, 1u);
  ASSERT_EQ(job.FlightRecorder(0).size(), 1u);
  EXPECT_EQ(job.FlightRecorder(0)[0].state, "failed");
  // The late worker's own collective 0 meets nobody: it fails the same way (the job does not
  // renumber a worker's requests), and then both run collective 1.
  EXPECT_THAT(job.Submit(Request(1, a, "w")),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("local ranks that did not submit: 1")));
  absl::StatusOr<Job::Result> first;
  std::thread t([&] { first = job.Submit(Request(1, a, "w")); });
  absl::StatusOr<Job::Result> second = job.Submit(Request(2, b, "w"));
  t.join();
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->sequence, 1u);
  EXPECT_THAT(a, ElementsAre(3));
}

TEST_F(JobTest, WorkersThatDisagreeFailTheCollectiveBeforeTheDataPath) {
  Job job(Options(2));
  ASSERT_THAT(job.AddWorker(1, 0, 2), IsOk());
  ASSERT_THAT(job.AddWorker(2, 1, 2), IsOk());
  std::vector<float> a = {1, 2, 3}, b = {1, 2, 3};
  absl::StatusOr<Job::Result> first;
  std::thread t([&] { first = job.Submit(Request(1, a, "w")); });
  absl::StatusOr<Job::Result> second = job.Submit(Request(2, b, "bias"));
  t.join();
  EXPECT_THAT(first, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("collective 0 of job j: local rank 0 "
                                                                            "submitted 'w'")));
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(path_->calls().empty());
  EXPECT_THAT(a, ElementsAre(1, 2, 3));  // untouched
  EXPECT_EQ(job.GetStatus().failed, 1u);
}

TEST_F(JobTest, ALocalReduceFailureIsNamedAndNothingIsWrittenBack) {
  Job job(Options(1));
  ASSERT_THAT(job.AddWorker(1, 0, 1), IsOk());
  path_->FailReduce(absl::ResourceExhaustedError("no memory for a 3-element sum"));
  std::vector<float> a = {1, 2, 3};
  EXPECT_THAT(job.Submit(Request(1, a, "w")),
              StatusIs(absl::StatusCode::kResourceExhausted, "collective 0 of job j: no memory for a 3-element sum"));
  EXPECT_THAT(path_->calls(), ElementsAre("reduce 1x3"));
  // The job goes on.
  path_->FailReduce(absl::OkStatus());
  absl::StatusOr<Job::Result> next = job.Submit(Request(1, a, "w"));
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->sequence, 1u);
}

TEST_F(JobTest, AConfigurationChangeAppliesAtItsBoundary) {
  Job::Options o = Options(1);
  // A change to bf16 published for collective 2 (what the Cluster's PollConfig answers).
  o.coordinator = std::make_shared<ChangeAtTwo>();
  Job job(std::move(o));
  ASSERT_THAT(job.AddWorker(1, 0, 1), IsOk());
  std::vector<uint64_t> epochs;
  std::vector<kernels::CodecId> codecs;
  for (int k = 0; k < 4; ++k) {
    std::vector<float> a = {1};
    absl::StatusOr<Job::Result> r = job.Submit(Request(1, a, "w"));
    ASSERT_THAT(r, IsOk());
    epochs.push_back(r->config_epoch);
    codecs.push_back(r->config.codec.id);
  }
  EXPECT_THAT(epochs, ElementsAre(0, 0, 1, 1));
  EXPECT_EQ(codecs[1], kernels::CodecId::kNone);
  EXPECT_EQ(codecs[2], kernels::CodecId::kBf16);
  EXPECT_EQ(job.GetStatus().config_epoch, 1u);
}

// A view claim reserves its boundary (collective 3 when collective 1 runs next) and holds the
// collective before it until the claim is in the store: the other nodes cannot finish collective
// 2 without this one, so none looks for the view at 3 before it can be read (and keeps the old one).
TEST_F(JobTest, AViewClaimHoldsTheCollectiveBeforeItsBoundaryUntilTheClaimIsStored) {
  path_->AllowCrossNode();
  auto coordinator = std::make_shared<SlowViewClaims>();
  Job::Options o = Options(1);
  o.num_nodes = 2;
  o.coordinator = coordinator;
  Job job(std::move(o));
  ASSERT_THAT(job.AddWorker(1, 0, 1), IsOk());
  std::vector<float> a = {1};
  ASSERT_THAT(job.Submit(Request(1, a, "w")), IsOk());  // collective 0
  absl::StatusOr<GroupView> claimed;
  std::thread operator_thread([&] { claimed = job.ChangeView({0, 1}); });
  coordinator->WaitUntilClaiming();
  ASSERT_THAT(job.Submit(Request(1, a, "w")), IsOk());  // collective 1 runs: the boundary is two on
  absl::Notification second_done;
  job.Enqueue(Request(1, a, "w"), [&](absl::StatusOr<Job::Result> r) {
    EXPECT_THAT(r, IsOk());
    second_done.Notify();
  });
  EXPECT_FALSE(second_done.WaitForNotificationWithTimeout(absl::Milliseconds(300)))
      << "collective 2 ran while the view claimed from 3 was not in the store";
  coordinator->Release();
  operator_thread.join();
  ASSERT_THAT(claimed, IsOk());
  EXPECT_EQ(claimed->first_sequence(), 3u);
  EXPECT_TRUE(second_done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_THAT(job.Submit(Request(1, a, "w")), IsOk());  // collective 3: the new view
  EXPECT_EQ(job.GetStatus().view_epoch, 1u);
}

}  // namespace
}  // namespace dynamiq::server

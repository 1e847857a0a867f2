// Metrics: the unit behaviour of server/metrics.h, and a live exposition of two in-process daemons
// scraped over HTTP, linted by `promtool check metrics` and checked against the metric contract
// (docs/metrics.md), including the measured compression error of sampled collectives.
#include "server/metrics.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "dynamiq/v1/control.grpc.pb.h"
#include "dynamiq/v1/worker.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ipc/shm_region.h"
#include "server/daemon.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

// One sample line of the text exposition: name{labels} value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Exposition {
  std::map<std::string, std::string> types;  // family -> counter|gauge|histogram|summary
  std::vector<Sample> samples;

  // The sum of the samples named `name` whose labels include `match`; -1 when none matches.
  double Sum(const std::string& name, const std::map<std::string, std::string>& match = {}) const {
    double total = 0;
    bool found = false;
    for (const Sample& s : samples) {
      if (s.name != name) continue;
      bool ok = true;
      for (const auto& [k, v] : match) {
        auto it = s.labels.find(k);
        ok &= it != s.labels.end() && it->second == v;
      }
      if (!ok) continue;
      total += s.value;
      found = true;
    }
    return found ? total : -1;
  }
};

// Parses what prometheus-cpp writes (label values here never contain '"', ',' or '}').
Exposition Parse(const std::string& text) {
  Exposition e;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> f = absl::StrSplit(line, ' ');
      if (f.size() == 2) e.types[f[0]] = f[1];
      continue;
    }
    if (absl::StartsWith(line, "#")) continue;
    Sample s;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    if (brace != absl::string_view::npos && brace < space) {
      s.name = std::string(line.substr(0, brace));
      const size_t close = line.find('}', brace);
      for (absl::string_view kv : absl::StrSplit(line.substr(brace + 1, close - brace - 1), ',', absl::SkipEmpty())) {
        const size_t eq = kv.find('=');
        s.labels[std::string(kv.substr(0, eq))] =
            std::string(absl::StripSuffix(absl::StripPrefix(kv.substr(eq + 1), "\""), "\""));
      }
    } else {
      s.name = std::string(line.substr(0, space));
    }
    std::string value(line.substr(space + 1));
    if (value == "Nan" || value == "NaN") {
      s.value = std::nan("");
    } else if (!absl::SimpleAtod(value, &s.value)) {
      continue;
    }
    e.samples.push_back(std::move(s));
  }
  return e;
}

// GET http://address/metrics with a plain socket (HTTP/1.0: the server closes when done).
absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path = "/metrics") {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(absl::StrCat("bad address ", address));
  }
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to ", address));
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", address, "\r\n\r\n");
  if (send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("short send");
  }
  std::string response;
  char buffer[65536];
  for (int i = 0; i < 100000; ++i) {  // bounded; a body of 6.5 GB would be absurd
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    response.append(buffer, n);
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (!absl::StartsWith(response, "HTTP/1.1 200") && !absl::StartsWith(response, "HTTP/1.0 200")) {
    return absl::InternalError(absl::StrCat("GET ", path, ": ", response.substr(0, response.find("\r\n"))));
  }
  if (body == std::string::npos) return absl::InternalError("no end of headers");
  return response.substr(body + 4);
}

// Runs `command` with `input` on stdin; returns its exit code and everything it printed.
std::pair<int, std::string> RunWithInput(const std::string& command, const std::string& input) {
  char tmpl[] = "/tmp/dqmetrics-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return {-1, "mkstemp failed"};
  (void)!write(fd, input.data(), input.size());
  close(fd);
  std::string output;
  FILE* pipe = popen(absl::StrCat(command, " < ", tmpl, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  const int status = pclose(pipe);
  unlink(tmpl);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

bool HavePromtool() { return system("command -v promtool >/dev/null 2>&1") == 0; }

// ---------------------------------------------------------------------------------------------
// Unit behaviour.

TEST(MetricsTest, ClassifiesFailures) {
  EXPECT_EQ(ClassifyFailure(absl::DeadlineExceededError("x"), false).fault, FaultKind::kTimeout);
  EXPECT_EQ(ClassifyFailure(absl::DeadlineExceededError("x"), false).result, CollectiveResult::kTimeout);
  EXPECT_EQ(ClassifyFailure(absl::AbortedError("x"), false).fault, FaultKind::kAbort);
  EXPECT_EQ(ClassifyFailure(absl::AbortedError("x"), false).result, CollectiveResult::kAborted);
  EXPECT_EQ(ClassifyFailure(absl::FailedPreconditionError("epoch"), false).fault, FaultKind::kMismatch);
  EXPECT_EQ(ClassifyFailure(absl::InvalidArgumentError("size"), false).fault, FaultKind::kMismatch);
  EXPECT_EQ(ClassifyFailure(absl::UnavailableError("reset"), false).fault, FaultKind::kPeerFailure);
  EXPECT_EQ(ClassifyFailure(absl::DataLossError("checksum"), false).result, CollectiveResult::kError);
  EXPECT_EQ(ClassifyFailure(absl::UnavailableError("reset"), true).fault, FaultKind::kAbort);
  EXPECT_EQ(ClassifyFailure(absl::OkStatus(), false).result, CollectiveResult::kOk);
}

TEST(MetricsTest, BusBytesAreTheNcclTestsDefinition) {
  EXPECT_EQ(BusBytes(1000, 1), 0u);
  EXPECT_EQ(BusBytes(1000, 2), 1000u);
  EXPECT_EQ(BusBytes(1000, 4), 1500u);
  EXPECT_EQ(BusBytes(uint64_t{1} << 62, 8), (uint64_t{1} << 62) / 8 * 14);
}

TEST(MetricsTest, CollectivesCountIntoTheirLabelSets) {
  Metrics m(/*node_rank=*/1, /*num_nodes=*/4, /*transport=*/"gloo");
  CollectiveOutcome ok;
  ok.codec.id = kernels::CodecId::kDynamiq;
  ok.codec.bits = 5;
  ok.topology = engine::Topology::kRing;
  ok.num_elements = 1000;
  ok.seconds = 0.002;
  ok.wire_bytes = 700;
  ok.nodes = 4;  // the group view it ran over
  m.OnCollective("j", ok);
  m.OnCollective("j", ok);
  CollectiveOutcome failed = ok;
  failed.result = CollectiveResult::kTimeout;
  failed.fault = FaultKind::kTimeout;
  m.OnCollective("j", failed);
  JobConfig sampled_config;
  sampled_config.codec = ok.codec;
  m.OnErrorSample("j", SampledError{sampled_config, 1, ok.codec, 1e-3});
  m.OnRejected(absl::StatusCode::kNotFound);
  m.AddPeerBytes(2, true, 100);
  m.AddPeerBytes(2, true, 50);
  m.AddPeerBytes(0, false, 10);
  m.AddPeerBytes(9, false, 10);  // not a node of this cluster: ignored
  const Exposition e = Parse(m.Render());
  const std::map<std::string, std::string> dq{{"job", "j"}, {"codec", "dynamiq"}, {"topology", "ring"}};
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"job", "j"}, {"result", "ok"}, {"transport", "gloo"}}), 2);
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"result", "timeout"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"result", "aborted"}}), 0) << "created at zero";
  EXPECT_EQ(e.Sum("dynamiq_faults_total", {{"job", "j"}, {"kind", "timeout"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_faults_total", {{"job", "j"}, {"kind", "mismatch"}}), 0);
  EXPECT_EQ(e.Sum("dynamiq_payload_bytes_total", dq), 8000);
  EXPECT_EQ(e.Sum("dynamiq_bus_bytes_total", dq), 12000);  // 2 x 4000 x 2 x 3/4
  EXPECT_EQ(e.Sum("dynamiq_wire_bytes_total", dq), 1400);
  EXPECT_EQ(e.Sum("dynamiq_collective_duration_seconds_count", dq), 2);
  EXPECT_NEAR(e.Sum("dynamiq_collective_duration_seconds_sum", dq), 0.004, 1e-12);
  EXPECT_EQ(e.Sum("dynamiq_collective_duration_seconds_bucket", {{"job", "j"}, {"le", "0.001"}}), 0);
  EXPECT_EQ(e.Sum("dynamiq_collective_duration_seconds_bucket", {{"job", "j"}, {"le", "+Inf"}}), 2);
  EXPECT_EQ(e.Sum("dynamiq_compression_error_vnmse_count", {{"job", "j"}, {"codec", "dynamiq"}, {"bits", "5"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_compression_error_samples_total", {{"job", "j"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_rejected_requests_total", {{"reason", "not_found"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_rejected_requests_total", {{"reason", "invalid_argument"}}), 0);
  EXPECT_EQ(e.Sum("dynamiq_peer_bytes_total", {{"peer", "2"}, {"direction", "sent"}}), 150);
  EXPECT_EQ(e.Sum("dynamiq_peer_bytes_total", {{"peer", "0"}, {"direction", "received"}}), 10);
  EXPECT_EQ(e.Sum("dynamiq_peer_bytes_total", {{"peer", "9"}}), -1);
  EXPECT_EQ(e.Sum("dynamiq_nodes"), 4);
  EXPECT_EQ(e.Sum("dynamiq_node_rank"), 1);
  EXPECT_EQ(e.Sum("dynamiq_build_info"), 1);
}

TEST(MetricsTest, EveryCodecOfTheTableIsItsOwnLabel) {
  // Every codec of kernels/codec_info.h (the newer ones included), named as the table names it.
  Metrics m(/*node_rank=*/0, /*num_nodes=*/2);
  for (const kernels::CodecInfo& info : kernels::AllCodecs()) {
    CollectiveOutcome ok;
    ok.codec.id = info.id;
    ok.codec.bits = info.default_bits;
    ok.topology = engine::Topology::kRing;
    ok.num_elements = 1000;
    ok.seconds = 0.001;
    ok.wire_bytes = 100;
    m.OnCollective("j", ok);
  }
  const Exposition e = Parse(m.Render());
  for (const kernels::CodecInfo& info : kernels::AllCodecs()) {
    EXPECT_EQ(e.Sum("dynamiq_collective_duration_seconds_count", {{"job", "j"}, {"codec", std::string(info.name)}}), 1)
        << info.name;
  }
}

TEST(MetricsTest, StateGaugesFollowTheSourceAndDropOldLabelSets) {
  Metrics m(0, 1);
  Metrics::Snapshot snapshot;
  Metrics::JobGauges j;
  j.job = "a";
  j.workers = 2;
  j.inflight = 1;
  j.config_epoch = 3;
  j.config = *MakeJobConfig("dynamiq", 5, "ring", 0, "measured");
  snapshot.jobs.push_back(j);
  snapshot.shm_mapped_bytes = 4096;
  snapshot.submission_rings = 3;
  absl::Mutex mu;
  Metrics::Snapshot current = snapshot;
  m.SetGaugeSource([&] {
    absl::MutexLock lock(&mu);
    return current;
  });
  Exposition e = Parse(m.Render());
  EXPECT_EQ(e.Sum("dynamiq_connected_workers", {{"job", "a"}}), 2);
  EXPECT_EQ(e.Sum("dynamiq_inflight_collectives", {{"job", "a"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_config_epoch", {{"job", "a"}}), 3);
  EXPECT_EQ(e.Sum("dynamiq_shm_mapped_bytes"), 4096);
  EXPECT_EQ(e.Sum("dynamiq_submission_rings"), 3);
  // One node: topology "local", transport "local".
  EXPECT_EQ(
      e.Sum("dynamiq_job_compression_info", {{"job", "a"}, {"codec", "dynamiq"}, {"bits", "5"}, {"topology", "local"}}),
      1);
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"job", "a"}, {"transport", "local"}, {"result", "ok"}}), 0);

  {
    absl::MutexLock lock(&mu);
    current.jobs[0].config = *MakeJobConfig("uniform", 4, "ring", 0, "measured");
    current.jobs[0].config_epoch = 4;
  }
  e = Parse(m.Render());
  EXPECT_EQ(e.Sum("dynamiq_job_compression_info", {{"job", "a"}}), 1) << "the old label set is gone";
  EXPECT_EQ(e.Sum("dynamiq_job_compression_info", {{"job", "a"}, {"codec", "uniform"}, {"bits", "4"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_config_epoch", {{"job", "a"}}), 4);

  {
    absl::MutexLock lock(&mu);
    current.jobs.clear();
  }
  e = Parse(m.Render());
  EXPECT_EQ(e.Sum("dynamiq_connected_workers", {{"job", "a"}}), -1) << "a vanished job's gauges go";
  EXPECT_EQ(e.Sum("dynamiq_job_compression_info", {{"job", "a"}}), -1);
  EXPECT_EQ(e.Sum("dynamiq_faults_total", {{"job", "a"}, {"kind", "abort"}}), 0) << "its counters stay";
  m.SetGaugeSource(nullptr);
}

// A retired job's series (counters and histograms too) are exported by one more collection, then
// removed, so the job label takes only the values of the jobs a node runs; unless the job is live
// again by then. Without an endpoint they go at once.
TEST(MetricsTest, RetiredJobsSeriesGoAfterOneMoreCollection) {
  CollectiveOutcome ok;
  ok.codec.id = kernels::CodecId::kDynamiq;
  ok.codec.bits = 5;
  ok.num_elements = 1000;
  ok.seconds = 0.002;
  JobConfig config;
  config.codec = ok.codec;
  {
    Metrics m(0, 2);
    m.OnCollective("a", ok);
    m.OnErrorSample("a", SampledError{config, 1, ok.codec, 1e-3});
    m.OnErrorBudgetEvent("a", "raise");
    m.OnCollective("b", ok);
    m.RetireJob("a");  // not served: at once
    const Exposition e = Parse(m.Render());
    for (const char* name : {"dynamiq_collectives_total", "dynamiq_faults_total", "dynamiq_payload_bytes_total",
                             "dynamiq_collective_duration_seconds_count", "dynamiq_compression_error_vnmse_count",
                             "dynamiq_compression_error_samples_total", "dynamiq_error_budget_events_total"}) {
      EXPECT_EQ(e.Sum(name, {{"job", "a"}}), -1) << name;
    }
    EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"job", "b"}, {"result", "ok"}}), 1) << "other jobs stay";
    // The id used again starts from zero, with its zero-valued label sets.
    m.OnCollective("a", ok);
    const Exposition again = Parse(m.Render());
    EXPECT_EQ(again.Sum("dynamiq_collectives_total", {{"job", "a"}, {"result", "ok"}}), 1);
    EXPECT_EQ(again.Sum("dynamiq_faults_total", {{"job", "a"}, {"kind", "abort"}}), 0);
  }
  Metrics m(0, 2);
  ASSERT_THAT(m.Serve("127.0.0.1", 0), IsOk());
  Metrics::Snapshot snapshot;  // what the daemon reports live
  absl::Mutex mu;
  m.SetGaugeSource([&] {
    absl::MutexLock lock(&mu);
    return snapshot;
  });
  m.OnCollective("a", ok);
  m.OnCollective("c", ok);
  m.RetireJob("a");
  m.RetireJob("c");
  {
    absl::MutexLock lock(&mu);
    Metrics::JobGauges live;  // c is live again (its next incarnation) before its series expire
    live.job = "c";
    live.config = config;
    snapshot.jobs.push_back(live);
  }
  Exposition e = Parse(m.Render());
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"job", "a"}, {"result", "ok"}}), 1) << "final values exported";
  m.OnCollective("c", ok);
  e = Parse(m.Render());
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"job", "a"}}), -1);
  EXPECT_EQ(e.Sum("dynamiq_collective_duration_seconds_count", {{"job", "a"}}), -1);
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"job", "c"}, {"result", "ok"}}), 2) << "live again: goes on";
  m.SetGaugeSource(nullptr);
}

TEST(MetricsTest, ServesOverHttpAndReportsBindFailures) {
  Metrics m(0, 1);
  auto address = m.Serve("127.0.0.1", 0);
  ASSERT_THAT(address, IsOk());
  EXPECT_TRUE(absl::StartsWith(*address, "127.0.0.1:")) << *address;
  EXPECT_THAT(m.Serve("127.0.0.1", 0), StatusIs(absl::StatusCode::kFailedPrecondition));
  auto body = HttpGet(*address);
  ASSERT_THAT(body, IsOk());
  EXPECT_THAT(*body, HasSubstr("dynamiq_build_info{"));
  // The same port again: taken.
  Metrics other(0, 1);
  const std::string port = address->substr(address->rfind(':') + 1);
  int p = 0;
  ASSERT_TRUE(absl::SimpleAtoi(port, &p));
  EXPECT_THAT(other.Serve("127.0.0.1", p), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot serve")));
  EXPECT_THAT(other.Serve("127.0.0.1", 70000), StatusIs(absl::StatusCode::kInvalidArgument));
  m.StopServing();
  EXPECT_FALSE(HttpGet(*address).ok());
}

// Issue 22.4: connections that trickle their request headers, or send nothing, used to hold both of
// the exposer's threads, and /metrics answered nothing while they stayed open. Scrapes are now
// served meanwhile, and such connections are closed after kScrapeRequestTimeout.
TEST(MetricsTest, SlowAndIdleConnectionsNeitherBlockScrapesNorStayForever) {
  Metrics m(0, 1);
  auto address = m.Serve("127.0.0.1", 0);
  ASSERT_THAT(address, IsOk());
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(address->substr(address->rfind(':') + 1), &port));
  auto open = [&]() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  };
  std::vector<int> idle = {open(), open()};
  std::vector<int> slow = {open(), open(), open()};
  for (int fd : slow) ASSERT_EQ(send(fd, "GET /metrics HTTP/1.1\r\n", 23, MSG_NOSIGNAL), 23);
  const absl::Time start = absl::Now();
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    for (int i = 0; i < 200 && !stop.load(); ++i) {  // one header byte per 50 ms each, bounded
      for (int fd : slow) (void)send(fd, "X", 1, MSG_NOSIGNAL);
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  for (int i = 0; i < 3; ++i) {
    const absl::Time t = absl::Now();
    auto body = HttpGet(*address);
    ASSERT_THAT(body, IsOk());
    EXPECT_THAT(*body, HasSubstr("dynamiq_build_info{"));
    EXPECT_LT(absl::Now() - t, absl::Seconds(2)) << "scrape " << i << " waited for the slow connections";
  }
  // The server closes every one of them once its request took too long (read returns 0 or an error).
  auto closed_by_server = [&](int fd) {
    timeval tv{static_cast<time_t>(absl::ToInt64Seconds(kScrapeRequestTimeout)) + 5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buffer[4096];
    for (int i = 0; i < 1000; ++i) {
      const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return true;
      if (n < 0) return false;  // the receive timeout passed: still open
    }
    return false;
  };
  for (int fd : idle) EXPECT_TRUE(closed_by_server(fd));
  for (int fd : slow) EXPECT_TRUE(closed_by_server(fd));
  EXPECT_LT(absl::Now() - start, kScrapeRequestTimeout + absl::Seconds(5));
  stop = true;
  trickle.join();
  for (int fd : idle) close(fd);
  for (int fd : slow) close(fd);
}

// ---------------------------------------------------------------------------------------------
// Two in-process daemons (as tests/server/daemon_test.cc starts them).

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/dqmetrics-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// One local worker driven through the raw Worker stub, with a mapped buffer of `floats` floats.
struct TestWorker {
  std::unique_ptr<dynamiq::v1::Worker::Stub> stub;
  std::string id;
  uint64_t buffer_id = 0;
  std::unique_ptr<ipc::ShmRegion> region;
  size_t floats = 0;

  float* data() { return reinterpret_cast<float*>(region->data()); }

  grpc::Status AllReduce(const std::string& name, uint64_t n) {
    dynamiq::v1::AllReduceRequest req;
    req.set_worker_id(id);
    req.set_tensor_name(name);
    req.set_buffer_id(buffer_id);
    req.set_num_elements(n);
    req.set_dtype(dynamiq::v1::DTYPE_FLOAT32);
    dynamiq::v1::AllReduceResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub->AllReduce(&ctx, req, &resp);
  }
};

TestWorker Connect(const std::string& socket, const std::string& job, size_t floats) {
  TestWorker w;
  w.floats = floats;
  w.stub = dynamiq::v1::Worker::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  dynamiq::v1::RegisterRequest reg;
  reg.set_job_id(job);
  reg.set_local_rank(0);
  reg.set_local_world_size(1);
  dynamiq::v1::RegisterResponse reg_resp;
  grpc::ClientContext c1;
  EXPECT_TRUE(w.stub->Register(&c1, reg, &reg_resp).ok());
  w.id = reg_resp.worker_id();
  dynamiq::v1::AllocateBufferRequest alloc;
  alloc.set_worker_id(w.id);
  alloc.set_bytes(floats * 4);
  dynamiq::v1::AllocateBufferResponse alloc_resp;
  grpc::ClientContext c2;
  EXPECT_TRUE(w.stub->AllocateBuffer(&c2, alloc, &alloc_resp).ok());
  w.buffer_id = alloc_resp.buffer_id();
  auto region = ipc::ShmRegion::Open(alloc_resp.shm_name(), floats * 4);
  EXPECT_THAT(region, IsOk());
  if (region.ok()) w.region = std::make_unique<ipc::ShmRegion>(std::move(region).value());
  dynamiq::v1::MappedRequest mapped;
  mapped.set_worker_id(w.id);
  mapped.set_buffer_id(w.buffer_id);
  dynamiq::v1::MappedResponse mapped_resp;
  grpc::ClientContext c3;
  EXPECT_TRUE(w.stub->Mapped(&c3, mapped, &mapped_resp).ok());
  return w;
}

class TwoNodeMetricsTest : public ::testing::Test {
 protected:
  // Starts two nodes; node 0 serves metrics on a free port; `rate0`/`rate1` are their
  // --error_sample_rate (node 0's applies to both).
  void StartNodes(double rate0, double rate1, const std::string& codec = "dynamiq") {
    auto options = [&](uint32_t rank, double rate, const std::string& coordinator) {
      DaemonOptions o;
      o.node_rank = rank;
      o.num_nodes = 2;
      o.coordinator = coordinator;
      o.listen = "127.0.0.1:0";
      o.worker_socket = absl::StrCat(dir_.path(), "/node", rank, ".sock");
      o.default_config = *MakeJobConfig(codec, codec == "dynamiq" ? 5 : 0, "ring", 1024, "measured");
      o.timeout = absl::Seconds(20);
      o.metrics_port = 0;
      o.error_sample_rate = rate;
      return o;
    };
    node0_ = std::make_unique<Daemon>(options(0, rate0, ""));
    absl::Status s0, s1;
    std::thread start0([&] { s0 = node0_->Start(); });
    for (int i = 0; i < 500 && node0_->listen_address().empty(); ++i) absl::SleepFor(absl::Milliseconds(10));
    ASSERT_FALSE(node0_->listen_address().empty());
    node1_ = std::make_unique<Daemon>(options(1, rate1, node0_->listen_address()));
    s1 = node1_->Start();
    start0.join();
    ASSERT_THAT(s0, IsOk());
    ASSERT_THAT(s1, IsOk());
    for (uint32_t node = 0; node < 2; ++node) {
      workers_.push_back(Connect(absl::StrCat(dir_.path(), "/node", node, ".sock"), "job", kFloats));
    }
  }

  void TearDown() override {
    workers_.clear();
    if (node1_) node1_->Shutdown();
    if (node0_) node0_->Shutdown();
  }

  // One collective of n elements on both nodes; returns the vNMSE of the result against the exact sum.
  double Run(const std::string& name, size_t n = kFloats) {
    for (size_t w = 0; w < 2; ++w) {
      for (size_t k = 0; k < n; ++k) workers_[w].data()[k] = std::sin(0.001f * k * (w + 1)) + 0.1f * w;
    }
    std::vector<grpc::Status> st(2);
    std::vector<std::thread> threads;
    for (size_t w = 0; w < 2; ++w) threads.emplace_back([&, w] { st[w] = workers_[w].AllReduce(name, n); });
    for (auto& t : threads) t.join();
    double err = 0, norm = 0;
    for (size_t k = 0; k < n; ++k) {
      double exact = 0;
      for (size_t w = 0; w < 2; ++w) exact += std::sin(0.001f * k * (w + 1)) + 0.1f * w;
      err += (workers_[0].data()[k] - exact) * (workers_[0].data()[k] - exact);
      norm += exact * exact;
    }
    for (size_t w = 0; w < 2; ++w) EXPECT_TRUE(st[w].ok()) << st[w].error_message();
    return err / norm;
  }

  Exposition Scrape(Daemon& node) {
    auto body = HttpGet(node.metrics_address());
    EXPECT_THAT(body, IsOk());
    return Parse(body.ok() ? *body : "");
  }

  static constexpr size_t kFloats = 20000;
  TempDir dir_;
  std::unique_ptr<Daemon> node0_, node1_;
  std::vector<TestWorker> workers_;
};

// Every family of the metric contract, with its type.
const std::map<std::string, std::string>& SpecFamilies() {
  static const auto* families = new std::map<std::string, std::string>{
      {"dynamiq_build_info", "gauge"},
      {"dynamiq_nodes", "gauge"},
      {"dynamiq_node_rank", "gauge"},
      {"dynamiq_collectives_total", "counter"},
      {"dynamiq_collective_duration_seconds", "histogram"},
      {"dynamiq_payload_bytes_total", "counter"},
      {"dynamiq_bus_bytes_total", "counter"},
      {"dynamiq_wire_bytes_total", "counter"},
      {"dynamiq_compression_error_vnmse", "histogram"},
      {"dynamiq_compression_error_samples_total", "counter"},
      {"dynamiq_peer_bytes_total", "counter"},
      {"dynamiq_faults_total", "counter"},
      {"dynamiq_rejected_requests_total", "counter"},
      {"dynamiq_inflight_collectives", "gauge"},
      {"dynamiq_connected_workers", "gauge"},
      {"dynamiq_shm_mapped_bytes", "gauge"},
      {"dynamiq_submission_rings", "gauge"},
      {"dynamiq_peer_connections_total", "counter"},
      {"dynamiq_config_epoch", "gauge"},
      {"dynamiq_job_compression_info", "gauge"},
  };
  return *families;
}

TEST_F(TwoNodeMetricsTest, LiveExpositionPassesPromtoolAndHasEveryFamily) {
  ASSERT_NO_FATAL_FAILURE(StartNodes(1.0, 1.0));
  for (int i = 0; i < 3; ++i) EXPECT_LT(Run("g"), 5e-3);
  Run("small", 100);  // below min_compress_elements: uncompressed
  {
    // A refused request: an unknown worker.
    dynamiq::v1::AllReduceRequest req;
    req.set_worker_id("424242");
    req.set_num_elements(10);
    req.set_dtype(dynamiq::v1::DTYPE_FLOAT32);
    dynamiq::v1::AllReduceResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(workers_[0].stub->AllReduce(&ctx, req, &resp).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  auto body = HttpGet(node0_->metrics_address());
  ASSERT_THAT(body, IsOk());
  const Exposition e = Parse(*body);
  for (const auto& [family, type] : SpecFamilies()) {
    auto it = e.types.find(family);
    ASSERT_NE(it, e.types.end()) << family << " missing from\n" << *body;
    EXPECT_EQ(it->second, type) << family;
    EXPECT_THAT(*body, HasSubstr(absl::StrCat("# HELP ", family, " "))) << family;
  }
  // Values of this run.
  const std::map<std::string, std::string> dq{{"job", "job"}, {"codec", "dynamiq"}, {"topology", "ring"}};
  // The label names the transport that moved the bytes: tcp, the CPU default (it said "gloo").
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"job", "job"}, {"result", "ok"}, {"transport", "tcp"}}), 4);
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"codec", "none"}, {"result", "ok"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_payload_bytes_total", dq), 3 * kFloats * 4);
  EXPECT_EQ(e.Sum("dynamiq_bus_bytes_total", dq), 3 * kFloats * 4);  // 2 nodes: factor 1
  const double wire = e.Sum("dynamiq_wire_bytes_total", dq);
  EXPECT_GT(wire, 0);
  EXPECT_GT(3 * kFloats * 4 / wire, 4) << "dynamiq 5-bit compresses fp32 more than 4x incl. headers";
  EXPECT_GT(e.Sum("dynamiq_peer_bytes_total", {{"peer", "1"}, {"direction", "sent"}}), wire)
      << "the peer also got the error probes' exact all-reduces";
  EXPECT_GT(e.Sum("dynamiq_peer_bytes_total", {{"peer", "1"}, {"direction", "received"}}), 0);
  EXPECT_EQ(e.Sum("dynamiq_peer_bytes_total", {{"peer", "0"}}), -1) << "no series for itself";
  EXPECT_EQ(e.Sum("dynamiq_collective_duration_seconds_count", dq), 3);
  EXPECT_EQ(e.Sum("dynamiq_connected_workers", {{"job", "job"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_shm_mapped_bytes"), kFloats * 4);
  EXPECT_EQ(e.Sum("dynamiq_submission_rings"), 0);  // these workers make raw calls
  // One view, one connection to node 1, made for its first collective and used by every one since.
  EXPECT_EQ(e.Sum("dynamiq_peer_connections_total", {{"outcome", "made"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_peer_connections_total", {{"outcome", "kept"}}), 0);
  EXPECT_EQ(e.Sum("dynamiq_nodes"), 2);
  EXPECT_EQ(e.Sum("dynamiq_job_compression_info", {{"job", "job"}, {"codec", "dynamiq"}, {"bits", "5"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_rejected_requests_total", {{"reason", "failed_precondition"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_faults_total", {{"job", "job"}}), 0);
  // Node 1 exposes its own view.
  const Exposition e1 = Scrape(*node1_);
  EXPECT_EQ(e1.Sum("dynamiq_node_rank"), 1);
  EXPECT_GT(e1.Sum("dynamiq_peer_bytes_total", {{"peer", "0"}, {"direction", "received"}}), 0);

  if (!HavePromtool()) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  auto [code, output] = RunWithInput("promtool check metrics", *body);
  EXPECT_EQ(code, 0) << output;
  EXPECT_EQ(output, "") << "promtool lint findings";
}

TEST_F(TwoNodeMetricsTest, SampledCollectivesRecordTheirMeasuredError) {
  ASSERT_NO_FATAL_FAILURE(StartNodes(1.0, 0.0));
  // Node 0's rate applies to both.
  EXPECT_EQ(node1_->error_sample_rate(), 1.0);
  std::vector<double> measured;
  for (int i = 0; i < 4; ++i) measured.push_back(Run("g"));
  for (Daemon* node : {node0_.get(), node1_.get()}) {
    const Exposition e = Scrape(*node);
    const std::map<std::string, std::string> labels{{"job", "job"}, {"codec", "dynamiq"}, {"bits", "5"}};
    EXPECT_EQ(e.Sum("dynamiq_compression_error_vnmse_count", labels), 4);
    EXPECT_EQ(e.Sum("dynamiq_compression_error_samples_total", {{"job", "job"}}), 4);
    // The daemon's measurement is the error the workers see (the same vectors, the same sum).
    const double mean = e.Sum("dynamiq_compression_error_vnmse_sum", labels) / 4;
    double expected = 0;
    for (double v : measured) expected += v / 4;
    EXPECT_GT(mean, 0);
    EXPECT_NEAR(mean, expected, 0.05 * expected);
    EXPECT_EQ(e.Sum("dynamiq_compression_error_vnmse_bucket", {{"job", "job"}, {"le", "1e-09"}}), 0);
  }
  // GetStatus carries the same numbers.
  auto status = node0_->JobStatuses();
  ASSERT_EQ(status.count("job"), 1u);
  EXPECT_EQ(status["job"].error_samples, 4u);
  EXPECT_NEAR(status["job"].last_vnmse, measured.back(), 0.05 * measured.back());
  EXPECT_EQ(status["job"].completed, 4u);
  EXPECT_EQ(status["job"].payload_bytes, 4 * kFloats * 4);
  EXPECT_GT(status["job"].wire_bytes, 0u);
  EXPECT_GT(status["job"].duration_seconds, 0);

  // Uncompressed collectives are never sampled: tensors below min_compress_elements, then codec none.
  Run("small", 100);
  EXPECT_EQ(Scrape(*node0_).Sum("dynamiq_compression_error_samples_total", {{"job", "job"}}), 4);
  auto control =
      dynamiq::v1::Control::NewStub(grpc::CreateChannel(node0_->listen_address(), grpc::InsecureChannelCredentials()));
  dynamiq::v1::SetCompressionRequest set;
  set.set_job_id("job");
  set.mutable_config()->set_codec("none");
  dynamiq::v1::SetCompressionResponse set_resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(control->SetCompression(&ctx, set, &set_resp).ok());
  // The change applies from the collective after the next one (Daemon::SetCompression): two more
  // compressed (and sampled) collectives, then uncompressed ones.
  for (int i = 0; i < 2; ++i) Run("g");
  EXPECT_EQ(Scrape(*node0_).Sum("dynamiq_compression_error_samples_total", {{"job", "job"}}), 6);
  for (int i = 0; i < 4; ++i) EXPECT_LT(Run("g"), 1e-12);
  const Exposition e = Scrape(*node0_);
  EXPECT_EQ(e.Sum("dynamiq_compression_error_samples_total", {{"job", "job"}}), 6);
  EXPECT_EQ(e.Sum("dynamiq_compression_error_vnmse_count", {{"codec", "none"}}), -1);
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"codec", "none"}, {"result", "ok"}}), 5);
  EXPECT_EQ(e.Sum("dynamiq_job_compression_info", {{"job", "job"}, {"codec", "none"}}), 1);
  EXPECT_EQ(e.Sum("dynamiq_config_epoch", {{"job", "job"}}), 1);

  // GetStatus reports where the metrics are.
  dynamiq::v1::GetStatusResponse response;
  grpc::ClientContext c2;
  ASSERT_TRUE(control->GetStatus(&c2, dynamiq::v1::GetStatusRequest(), &response).ok());
  EXPECT_EQ(response.metrics_address(), node0_->metrics_address());
  EXPECT_EQ(response.error_sample_rate(), 1.0);
  ASSERT_EQ(response.jobs_size(), 1);
  EXPECT_EQ(response.jobs(0).error_samples(), 6u);
  EXPECT_EQ(response.jobs(0).completed(), 11u);
  EXPECT_EQ(response.jobs(0).failed(), 0u);
}

TEST_F(TwoNodeMetricsTest, NoneCodecIsNeverSampled) {
  ASSERT_NO_FATAL_FAILURE(StartNodes(1.0, 1.0, "none"));
  for (int i = 0; i < 3; ++i) EXPECT_LT(Run("g"), 1e-12);
  const Exposition e = Scrape(*node0_);
  EXPECT_EQ(e.Sum("dynamiq_compression_error_samples_total", {{"job", "job"}}), 0);
  EXPECT_EQ(e.Sum("dynamiq_compression_error_vnmse_count"), -1);
  EXPECT_EQ(e.Sum("dynamiq_collectives_total", {{"codec", "none"}, {"result", "ok"}}), 3);
}

TEST(DaemonMetricsOptionsTest, BadValuesAreRefused) {
  TempDir dir;
  DaemonOptions o;
  o.listen = "127.0.0.1:0";
  o.worker_socket = dir.path() + "/d.sock";
  o.metrics_port = -2;
  EXPECT_THAT(Daemon(o).Start(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--metrics_port")));
  o.metrics_port = 0;
  o.error_sample_rate = 1.5;
  EXPECT_THAT(Daemon(o).Start(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--error_sample_rate")));
  o.error_sample_rate = 0.01;
  o.error_feedback_mib = size_t{1} << 40;  // would overflow as bytes
  EXPECT_THAT(Daemon(o).Start(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--error_feedback_mib")));
  o.error_feedback_mib = 1024;
  // Off: no address.
  o.metrics_port = -1;
  Daemon off(o);
  ASSERT_THAT(off.Start(), IsOk());
  EXPECT_EQ(off.metrics_address(), "");
  off.Shutdown();
  // A taken port fails Start with a clear error.
  Metrics holder(0, 1);
  auto taken = holder.Serve("127.0.0.1", 0);
  ASSERT_THAT(taken, IsOk());
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(taken->substr(taken->rfind(':') + 1), &port));
  o.metrics_port = port;
  EXPECT_THAT(Daemon(o).Start(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot serve metrics")));
}

}  // namespace
}  // namespace dynamiq::server

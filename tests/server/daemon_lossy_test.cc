// The loss-tolerant all-reduce through dynamiqd (--transport=udp, a job's lossy_phase_ms): two
// in-process daemons on loopback, where nothing is lost, so every result is exact; the settings
// it needs are refused clearly elsewhere. Loss itself: tests/faults/network_faults_test.cc (a
// link that drops packets) and tests/engine/lossy_all_reduce_test.cc (the unbiasedness test).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine/udp_datagram.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::ConnectTestWorkers;
using ::dynamiq::testing::DaemonTestWorker;
using ::dynamiq::testing::StartTestCluster;
using ::dynamiq::testing::StatusIs;
using ::dynamiq::testing::TempDir;
using ::testing::HasSubstr;

constexpr size_t kElements = 5000;  // several datagrams per chunk

// Worker w's element k: small integers, so every sum and mean is exact in fp32.
float Value(size_t w, size_t k) { return static_cast<float>((w + 1) * (1 + k % 7)); }

JobConfig LossyConfig(absl::string_view codec, double phase_ms) {
  JobConfig c = *MakeJobConfig(codec, 0, "ring", 0, "measured");
  EXPECT_TRUE(SetLossyPhase(phase_ms, c).ok());
  return c;
}

// Every worker all-reduces (averaging) its first kElements floats, after filling them.
std::vector<grpc::Status> AverageTogether(std::vector<DaemonTestWorker>& workers,
                                          std::vector<dynamiq::v1::AllReduceResponse>& responses) {
  std::vector<grpc::Status> status(workers.size());
  responses.assign(workers.size(), {});
  std::vector<std::thread> threads;
  for (size_t w = 0; w < workers.size(); ++w) {
    for (size_t k = 0; k < kElements; ++k) workers[w].data()[k] = Value(w, k);
    threads.emplace_back([&, w] { status[w] = workers[w].AllReduce("g", kElements, true, &responses[w]); });
  }
  for (auto& t : threads) t.join();
  return status;
}

// Successful collectives of job "job" (codec none) that ran `topology` on `daemon`.
double Collectives(Daemon& daemon, absl::string_view topology) {
  const std::string series =
      absl::StrCat("dynamiq_collectives_total{codec=\"none\",job=\"job\",result=\"ok\",topology=\"", topology,
                   "\",transport=\"udp\"} ");
  const std::string metrics = daemon.metrics().Render();
  const size_t at = metrics.find(series);
  return at == std::string::npos ? 0 : std::stod(metrics.substr(at + series.size()));
}

absl::StatusOr<std::vector<std::unique_ptr<Daemon>>> StartUdpCluster(const std::string& dir, const JobConfig& config) {
  return StartTestCluster(dir, 2, config, absl::Seconds(20), [](DaemonOptions& o) { o.transport = "udp"; });
}

// Nothing lost on loopback: every worker of both nodes gets the exact mean, over all four workers,
// through a two-shot exchange of datagrams whose arrivals the metrics count per peer node.
TEST(DaemonLossyTest, TwoNodesOverUdpGetTheExactMeanAndCountWhatArrived) {
  TempDir dir;
  auto cluster = StartUdpCluster(dir.path(), LossyConfig("none", 500));
  ASSERT_THAT(cluster, ::dynamiq::testing::IsOk());
  auto workers = ConnectTestWorkers(dir.path(), 2, 2, kElements);
  ASSERT_THAT(workers, ::dynamiq::testing::IsOk());
  for (int round = 0; round < 3; ++round) {
    std::vector<dynamiq::v1::AllReduceResponse> responses;
    std::vector<grpc::Status> status = AverageTogether(*workers, responses);
    for (size_t w = 0; w < workers->size(); ++w) {
      ASSERT_TRUE(status[w].ok()) << w << ": " << status[w].error_message();
      EXPECT_EQ(responses[w].contributors(), 4u);
      for (size_t k : {size_t{0}, size_t{1}, size_t{2499}, size_t{2500}, kElements - 1}) {
        const float want = (Value(0, k) + Value(1, k) + Value(2, k) + Value(3, k)) / 4;
        ASSERT_EQ((*workers)[w].data()[k], want) << "worker " << w << " element " << k;
      }
    }
  }
  for (uint32_t node = 0; node < 2; ++node) {
    // Each node heard the other's datagrams, which say whether a configuration change is coming:
    // only the first collective asked the coordinator.
    EXPECT_EQ((*cluster)[node]->JobStatuses().at("job").config_polls, 1u) << node;
    const std::string metrics = (*cluster)[node]->metrics().Render();
    const std::string peer = absl::StrCat(1 - node);
    EXPECT_THAT(metrics, HasSubstr(absl::StrCat("dynamiq_lossy_datagrams_total{job=\"job\",outcome=\"missed\",peer=\"",
                                                peer, "\"} 0")))
        << node;
    EXPECT_THAT(metrics, HasSubstr("dynamiq_lossy_coverage_count{job=\"job\"} 3")) << node;
    EXPECT_THAT(metrics, HasSubstr("dynamiq_lossy_kept_own_elements_total{job=\"job\"} 0")) << node;
    EXPECT_THAT(metrics, HasSubstr("topology=\"two_shot\",transport=\"udp\"")) << node;
  }
}

// bf16 on the wire: both nodes' workers get the same bits, the mean to bf16's precision.
TEST(DaemonLossyTest, Bf16DatagramsGiveEveryNodeTheSameMean) {
  TempDir dir;
  auto cluster = StartUdpCluster(dir.path(), LossyConfig("bf16", 500));
  ASSERT_THAT(cluster, ::dynamiq::testing::IsOk());
  auto workers = ConnectTestWorkers(dir.path(), 2, 1, kElements);
  ASSERT_THAT(workers, ::dynamiq::testing::IsOk());
  std::vector<dynamiq::v1::AllReduceResponse> responses;
  std::vector<grpc::Status> status = AverageTogether(*workers, responses);
  for (size_t w = 0; w < 2; ++w) ASSERT_TRUE(status[w].ok()) << status[w].error_message();
  for (size_t k = 0; k < kElements; ++k) {
    ASSERT_EQ((*workers)[0].data()[k], (*workers)[1].data()[k]) << k;
    ASSERT_NEAR((*workers)[0].data()[k], (Value(0, k) + Value(1, k)) / 2, 0.01 * Value(1, k)) << k;
  }
}

// A job switches to the loss-tolerant all-reduce and back at run time (set-compression's
// lossy_phase_ms); what it needs is refused with the reason.
TEST(DaemonLossyTest, AJobSwitchesAtRunTimeAndWhatItNeedsIsRefusedClearly) {
  TempDir dir;
  auto cluster = StartUdpCluster(dir.path(), *MakeJobConfig("none", 0, "ring", 0, "measured"));
  ASSERT_THAT(cluster, ::dynamiq::testing::IsOk());
  auto workers = ConnectTestWorkers(dir.path(), 2, 1, kElements);
  ASSERT_THAT(workers, ::dynamiq::testing::IsOk());
  std::vector<dynamiq::v1::AllReduceResponse> responses;
  auto change = [](double phase_ms, absl::string_view codec) {
    return [phase_ms, codec = std::string(codec)](const JobConfig& newest) -> absl::StatusOr<JobConfig> {
      dynamiq::v1::CompressionConfig c;
      c.set_codec(codec);
      c.set_lossy_phase_ms(phase_ms);
      return ApplyCompressionChange(newest, c, "job");
    };
  };
  // Codecs whose datagrams would not decode on their own: refused, naming what works.
  EXPECT_THAT((*cluster)[1]->SetCompression("job", change(50, "dynamiq"), std::nullopt),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("carries codec none, bf16 or int8, not dynamiq")));
  ASSERT_THAT((*cluster)[1]->SetCompression("job", change(300, "none"), std::nullopt), ::dynamiq::testing::IsOk());
  // Reliable (ring) until the change's boundary (two collectives on), two-shot datagrams from there;
  // exact throughout.
  for (int round = 0; round < 4; ++round) {
    std::vector<grpc::Status> status = AverageTogether(*workers, responses);
    for (size_t w = 0; w < 2; ++w) ASSERT_TRUE(status[w].ok()) << status[w].error_message();
    EXPECT_EQ((*workers)[0].data()[6], (Value(0, 6) + Value(1, 6)) / 2);
  }
  EXPECT_THAT((*cluster)[0]->metrics().Render(), HasSubstr("topology=\"two_shot\",transport=\"udp\""));
  const double two_shot = Collectives(*(*cluster)[0], "two_shot");
  EXPECT_EQ(two_shot, 2);
  ASSERT_THAT((*cluster)[0]->SetCompression("job", change(0, "none"), std::nullopt), ::dynamiq::testing::IsOk());
  for (int round = 0; round < 4; ++round) {
    std::vector<grpc::Status> status = AverageTogether(*workers, responses);
    for (size_t w = 0; w < 2; ++w) ASSERT_TRUE(status[w].ok()) << status[w].error_message();
  }
  EXPECT_EQ(responses[0].config_epoch(), 2u);
  EXPECT_EQ(Collectives(*(*cluster)[0], "two_shot"), two_shot + 2) << "reliable again from epoch 2's boundary";
}

// The UDP ports this process's sockets are bound to on 127.0.0.1 (its in-process daemons'):
// /proc/net/udp's sockets whose inodes are among this process's descriptors.
std::vector<uint16_t> OwnUdpPorts() {
  std::set<std::string> inodes;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const std::string target = std::filesystem::read_symlink(fd.path(), error).string();
    if (!error && absl::StartsWith(target, "socket:[")) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<uint16_t> ports;
  std::ifstream udp("/proc/self/net/udp");
  std::string line;
  std::getline(udp, line);  // the header
  while (std::getline(udp, line)) {
    const std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 10 || !inodes.count(fields[9])) continue;
    const std::vector<std::string> local = absl::StrSplit(fields[1], ':');
    uint32_t port = 0;
    if (local.size() == 2 && local[0] == "0100007F" && absl::SimpleHexAtoi(local[1], &port)) {
      ports.push_back(static_cast<uint16_t>(port));
    }
  }
  return ports;
}

// A stranger floods the nodes' UDP sockets with datagrams while the job runs: random bytes,
// truncated headers, and well-formed ones of another connection. The transport drops and counts
// them; every collective completes with the exact mean.
TEST(DaemonLossyTest, AStrangersDatagramsAreDroppedAndCountedAndResultsStayExact) {
  TempDir dir;
  auto cluster = StartUdpCluster(dir.path(), LossyConfig("none", 300));
  ASSERT_THAT(cluster, ::dynamiq::testing::IsOk());
  auto workers = ConnectTestWorkers(dir.path(), 2, 1, kElements);
  ASSERT_THAT(workers, ::dynamiq::testing::IsOk());
  std::vector<dynamiq::v1::AllReduceResponse> responses;
  std::vector<grpc::Status> status = AverageTogether(*workers, responses);  // connects the view
  for (const grpc::Status& s : status) ASSERT_TRUE(s.ok()) << s.error_message();
  const std::vector<uint16_t> ports = OwnUdpPorts();
  ASSERT_GE(ports.size(), 2u) << "one UDP socket per node";
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::thread stranger([&] {
    const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    std::mt19937 random(7);
    for (int i = 0; i < 20000 && !stop; ++i) {
      std::vector<uint8_t> junk(1 + random() % 1400);
      for (uint8_t& b : junk) b = static_cast<uint8_t>(random());
      if (i % 3 == 1) junk.resize(std::min<size_t>(junk.size(), 20));  // a truncated header
      if (i % 3 == 2 && junk.size() >= engine::kDatagramOverheadBytes) {
        // Magic and version right, payload length consistent: another connection's, or forged.
        const uint32_t magic = engine::kDatagramMagic;
        memcpy(junk.data(), &magic, 4);
        junk[4] = engine::kDatagramVersion;
        junk[5] = 0;
        const uint32_t payload = static_cast<uint32_t>(junk.size() - engine::kDatagramOverheadBytes);
        memcpy(junk.data() + 40, &payload, 4);
      }
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_port = htons(ports[i % ports.size()]);
      to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (sendto(fd, junk.data(), junk.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof(to)) > 0) ++sent;
      if (i % 64 == 0) absl::SleepFor(absl::Microseconds(200));  // leave the sockets room for the job
    }
    close(fd);
  });
  for (int round = 0; round < 5; ++round) {
    status = AverageTogether(*workers, responses);
    for (size_t w = 0; w < 2; ++w) {
      ASSERT_TRUE(status[w].ok()) << status[w].error_message();
      EXPECT_EQ((*workers)[w].data()[3], (Value(0, 3) + Value(1, 3)) / 2);
    }
  }
  stop = true;
  stranger.join();
  double dropped = 0;
  for (uint32_t node = 0; node < 2; ++node) {
    const std::string metrics = (*cluster)[node]->metrics().Render();
    const std::string series = "dynamiq_lossy_dropped_total{job=\"job\"} ";
    const size_t at = metrics.find(series);
    ASSERT_NE(at, std::string::npos) << metrics;
    dropped += std::stod(metrics.substr(at + series.size()));
  }
  std::cout << sent << " stranger's datagrams sent, " << dropped << " dropped during collectives" << std::endl;
  EXPECT_GT(dropped, 0);
}

TEST(DaemonLossyTest, TheLossTolerantAllReduceNeedsUdpBetweenTheNodes) {
  TempDir dir;
  auto cluster = StartTestCluster(dir.path(), 2, *MakeJobConfig("none", 0, "ring", 0, "measured"));
  ASSERT_THAT(cluster, ::dynamiq::testing::IsOk());
  auto workers = ConnectTestWorkers(dir.path(), 2, 1, kElements);
  ASSERT_THAT(workers, ::dynamiq::testing::IsOk());
  auto lossy = [](const JobConfig& newest) -> absl::StatusOr<JobConfig> {
    dynamiq::v1::CompressionConfig c;
    c.set_lossy_phase_ms(100);
    return ApplyCompressionChange(newest, c, "job");
  };
  EXPECT_THAT((*cluster)[0]->SetCompression("job", lossy, std::nullopt),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("needs datagrams between the nodes: dynamiqd --transport=udp on every node (this "
                                 "cluster runs --transport=tcp)")));
  // A daemon started with a lossy default on tcp is refused too.
  DaemonOptions o = ::dynamiq::testing::TestDaemonOptions(dir.path(), 0, 1, LossyConfig("none", 100));
  EXPECT_THAT(ValidateDaemonOptions(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--transport=udp")));
}

}  // namespace
}  // namespace dynamiq::server

// End-to-end: every codec through real daemons (1 and 2 nodes, 1-4 local workers each): the result
// every worker gets is bit-identical everywhere and within the codec's error of the exact sum.
#include <cmath>
#include <cstring>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "server/job.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::testing::AllReduceTogether;
using ::dynamiq::testing::ConnectTestWorkers;
using ::dynamiq::testing::DaemonTestWorker;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::StartTestCluster;
using ::dynamiq::testing::StatusIs;
using ::dynamiq::testing::TempDir;
using ::testing::HasSubstr;

struct CodecCase {
  const char* codec;
  double bits;
  const char* topology;
  double max_vnmse;  // across nodes
};

void PrintTo(const CodecCase& c, std::ostream* os) { *os << c.codec << " " << c.bits << " bits, " << c.topology; }

// Gradient-like data: a smooth part plus per-worker noise, magnitudes over several decades.
float Value(size_t k, size_t worker, int round) {
  const double x = static_cast<double>(k);
  return static_cast<float>(std::sin(0.0013 * x * (worker + 1) + round) * std::exp(-1e-4 * x) +
                            0.01 * std::cos(0.7 * x + worker));
}

class DaemonCodecTest : public ::testing::TestWithParam<std::tuple<CodecCase, uint32_t, uint32_t>> {};

TEST_P(DaemonCodecTest, EveryWorkerGetsTheSameSumWithinTheCodecsError) {
  const auto [c, nodes, local] = GetParam();
  TempDir temp;
  auto config = MakeJobConfig(c.codec, c.bits, c.topology, /*min_compress_elements=*/1024, "measured");
  ASSERT_THAT(config, IsOk());
  auto daemons = StartTestCluster(temp.path(), nodes, *config);
  ASSERT_THAT(daemons, IsOk());
  const size_t n = 50000;
  auto connected = ConnectTestWorkers(temp.path(), nodes, local, n);
  ASSERT_THAT(connected, IsOk());
  std::vector<DaemonTestWorker>& workers = *connected;
  for (int round = 0; round < 2; ++round) {
    for (size_t w = 0; w < workers.size(); ++w) {
      for (size_t k = 0; k < n; ++k) workers[w].data()[k] = Value(k, w, round);
    }
    const std::vector<grpc::Status> status = AllReduceTogether(workers, "grad", n);
    for (size_t w = 0; w < workers.size(); ++w) {
      ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w].error_message();
      ASSERT_EQ(0, std::memcmp(workers[w].data(), workers[0].data(), n * 4)) << "worker " << w << " differs";
    }
    double err = 0, norm = 0;
    for (size_t k = 0; k < n; ++k) {
      double exact = 0;
      for (size_t w = 0; w < workers.size(); ++w) exact += Value(k, w, round);
      const double d = workers[0].data()[k] - exact;
      err += d * d;
      norm += exact * exact;
    }
    // One node: the local fp32 sum only (nothing crosses a network, nothing is compressed).
    const double bound = nodes == 1 ? 1e-12 : c.max_vnmse;
    EXPECT_LE(err / norm, bound) << c.codec << " round " << round;
    RecordProperty(absl::StrCat("vnmse_round", round), absl::StrCat(err / norm));
  }
  for (auto& d : *daemons) d->Shutdown();
}

// arc_topk with dynamiqd's error feedback (--arc_topk_error_feedback): the first collective of a
// tensor is the dense exact step; later ones send C(x - g_i), and every worker of every node gets
// the same estimate G. A step whose gradient does not change keeps G exact; a new gradient is
// delivered over ceil(1 / density) steps, rows at a time.
TEST(DaemonErrorFeedbackTest, ArcTopKDeliversWhatItLeftBehindOverTheNextSteps) {
  TempDir temp;
  auto config = MakeJobConfig("arc_topk", 0.25, "ring", /*min_compress_elements=*/1024, "measured");
  ASSERT_THAT(config, IsOk());
  auto daemons = StartTestCluster(temp.path(), 2, *config, absl::Seconds(20),
                                  [](server::DaemonOptions& o) { o.arc_topk_error_feedback = true; });
  ASSERT_THAT(daemons, IsOk());
  const size_t n = 8 * 256;
  auto connected = ConnectTestWorkers(temp.path(), 2, 1, n);
  ASSERT_THAT(connected, IsOk());
  std::vector<DaemonTestWorker>& workers = *connected;
  // Step 0: round 0's values; steps 1..5: round 1's, unchanged.
  std::vector<double> errors;
  for (int step = 0; step < 6; ++step) {
    const int round = step == 0 ? 0 : 1;
    for (size_t w = 0; w < workers.size(); ++w) {
      for (size_t k = 0; k < n; ++k) workers[w].data()[k] = Value(k, w, round);
    }
    const std::vector<grpc::Status> status = AllReduceTogether(workers, "grad", n);
    double err = 0, norm = 0;
    for (size_t w = 0; w < workers.size(); ++w) {
      ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w].error_message();
      ASSERT_EQ(0, std::memcmp(workers[w].data(), workers[0].data(), n * 4)) << "worker " << w << " differs";
    }
    for (size_t k = 0; k < n; ++k) {
      const double exact = Value(k, 0, round) + Value(k, 1, round);
      err += (workers[0].data()[k] - exact) * (workers[0].data()[k] - exact);
      norm += exact * exact;
    }
    errors.push_back(err / norm);
  }
  EXPECT_LT(errors[0], 1e-12) << "the dense first step";
  EXPECT_GT(errors[1], 1e-4) << "a quarter of the rows of the change";
  EXPECT_LT(errors[2], errors[1]);
  EXPECT_LT(errors[4], 1e-10) << "after 4 steps at density 0.25 every row of the change has been sent";
  EXPECT_LT(errors[5], 1e-10);
  for (auto& d : *daemons) d->Shutdown();
}

constexpr CodecCase kCodecs[] = {
    // Bounds are about 3x what each codec measures here with 2 nodes (e.g. dynamiq 5-bit 2.5e-4,
    // mxfp8 1.5e-3..2.7e-3, thc 1.0e-2 with its whole-bucket rotation; 0.11 with the per-block one
    // before issue 41), so a regression of a few x fails.
    {"none", 0, "ring", 1e-12},
    {"bf16", 0, "ring", 1.5e-5},
    {"dynamiq", 5, "ring", 1e-3},
    {"dynamiq", 4, "butterfly", 4e-3},
    {"mxfp8", 0, "ring", 8e-3},
    {"mxfp6", 0, "ring", 1.5e-2},
    {"mxfp4", 0, "ring", 8e-2},
    {"thc", 4, "ring", 3e-2},
    {"uniform", 8, "ring", 6e-5},
    {"int8", 0, "ring", 1e-2},             // 5.6e-4 and 3.4e-3 here: one scale per chunk, outliers clipped at 6 sigma
    {"global_qsgd", 8, "ring", 1e-3},      // 1.1e-4 and 3.3e-4 here
    {"arc_topk", 0.25, "butterfly", 0.1},  // 2.8e-2 .. 3.1e-2 here (no error feedback: the default)
};

// --transport=tcp (engine/tcp_transport.h) between CPU nodes: the same bytes as Gloo's transport,
// collective after collective; a node on the other transport cannot join.
TEST(DaemonTransportTest, NodesOverTheTcpTransportGetGloosResultsBitForBit) {
  auto config = MakeJobConfig("dynamiq", 5, "ring", /*min_compress_elements=*/1024, "measured");
  ASSERT_THAT(config, IsOk());
  const size_t n = 50000;
  auto run = [&](const std::string& transport) {
    TempDir temp;
    auto daemons = StartTestCluster(temp.path(), 3, *config, absl::Seconds(20),
                                    [&](server::DaemonOptions& o) { o.transport = transport; });
    EXPECT_THAT(daemons, IsOk());
    std::vector<std::vector<float>> results;
    if (!daemons.ok()) return results;
    auto connected = ConnectTestWorkers(temp.path(), 3, 1, n);
    EXPECT_THAT(connected, IsOk());
    if (!connected.ok()) return results;
    std::vector<DaemonTestWorker>& workers = *connected;
    for (int round = 0; round < 3; ++round) {
      for (size_t w = 0; w < workers.size(); ++w) {
        for (size_t k = 0; k < n; ++k) workers[w].data()[k] = Value(k, w, round);
      }
      for (const grpc::Status& s : AllReduceTogether(workers, "grad", n)) EXPECT_TRUE(s.ok()) << s.error_message();
      results.emplace_back(workers[0].data(), workers[0].data() + n);
      for (size_t w = 1; w < workers.size(); ++w)
        EXPECT_EQ(0, std::memcmp(workers[w].data(), workers[0].data(), n * 4));
    }
    for (auto& d : *daemons) d->Shutdown();
    return results;
  };
  const auto tcp = run("tcp");
  const auto gloo = run("gloo");
  ASSERT_EQ(tcp.size(), 3u);
  ASSERT_EQ(gloo.size(), 3u);
  for (int round = 0; round < 3; ++round) EXPECT_EQ(tcp[round], gloo[round]) << "round " << round;

  TempDir temp;
  auto mixed = StartTestCluster(temp.path(), 2, *config, absl::Seconds(5), [](server::DaemonOptions& o) {
    if (o.node_rank == 1) o.transport = "gloo";
  });
  EXPECT_THAT(mixed, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--transport=gloo")));
}

std::string CaseName(const ::testing::TestParamInfo<DaemonCodecTest::ParamType>& info) {
  const auto& [c, nodes, local] = info.param;
  // arc_topk's density 0.25 -> "0p25".
  return absl::StrCat(c.codec, absl::StrReplaceAll(absl::StrCat(c.bits), {{".", "p"}}), c.topology, "_", nodes,
                      "nodes_", local, "workers");
}

INSTANTIATE_TEST_SUITE_P(TwoNodes, DaemonCodecTest,
                         ::testing::Combine(::testing::ValuesIn(kCodecs), ::testing::Values(2u),
                                            ::testing::Values(1u, 3u)),
                         CaseName);
INSTANTIATE_TEST_SUITE_P(OneNode, DaemonCodecTest,
                         ::testing::Combine(::testing::Values(kCodecs[2]), ::testing::Values(1u),
                                            ::testing::Values(1u, 2u, 4u)),
                         CaseName);
INSTANTIATE_TEST_SUITE_P(TwoNodesFourWorkers, DaemonCodecTest,
                         ::testing::Combine(::testing::Values(kCodecs[0], kCodecs[2]), ::testing::Values(2u),
                                            ::testing::Values(2u, 4u)),
                         CaseName);

}  // namespace
}  // namespace dynamiq::server

// Helpers of the CrossNodeAllReduce tests (cross_node_all_reduce_test, error_feedback_all_reduce_test,
// error_probe_all_reduce_test): a codec by id, and every node of a group as a thread.
#ifndef DQ_TESTS_SERVER_ALL_REDUCE_TEST_UTIL_H_
#define DQ_TESTS_SERVER_ALL_REDUCE_TEST_UTIL_H_

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/codec_registry.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::testing {

// The codec `id`; ARC-Top-K at density `density` (its bits per element), the others as configured
// by default. Fails the test when it cannot be made.
inline std::unique_ptr<kernels::Codec> TestCodec(kernels::CodecId id, double density = 0.25) {
  kernels::CodecConfig config{id};
  if (id == kernels::CodecId::kArcTopK) config.bits = density;
  auto codec = kernels::CreateCodec(config);
  EXPECT_THAT(codec, IsOk());
  return *std::move(codec);
}

// Runs `node(r)` for every r in [0, nodes), each on its own thread (a collective needs every node at
// once), and returns when all have.
inline void OnEveryNode(int nodes, const std::function<void(int)>& node) {
  std::vector<std::thread> threads;
  for (int r = 0; r < nodes; ++r) threads.emplace_back(node, r);
  for (std::thread& t : threads) t.join();
}

}  // namespace dynamiq::testing

#endif  // DQ_TESTS_SERVER_ALL_REDUCE_TEST_UTIL_H_

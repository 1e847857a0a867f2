// Helpers of the transport tests (gloo_transport_test, tcp_transport_test, ...): each rank of a group as
// a thread, deterministic message bytes, deadlines; and a base for test transports that wrap another.
#ifndef DQ_TESTS_TESTING_TRANSPORT_TEST_UTIL_H_
#define DQ_TESTS_TESTING_TRANSPORT_TEST_UTIL_H_

#include <stddef.h>
#include <stdint.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/store.h"
#include "engine/transport.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace dynamiq::testing {

using TransportRankFn = std::function<absl::Status(int rank, std::unique_ptr<engine::Transport>& transport)>;
using TransportConnectFn =
    std::function<absl::StatusOr<std::unique_ptr<engine::Transport>>(engine::Store& store, int rank, int size)>;

// Runs `size` ranks as threads: each connects through `store` with `connect` and runs `fn`.
// Returns each rank's status (the connect error, or what `fn` returned).
inline std::vector<absl::Status> RunTransportRanks(int size, engine::Store& store, const TransportConnectFn& connect,
                                                   const TransportRankFn& fn) {
  std::vector<absl::Status> results(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<engine::Transport>> t = connect(store, r, size);
      results[r] = t.ok() ? fn(r, *t) : t.status();
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

inline void ExpectAllOk(const std::vector<absl::Status>& results) {
  for (size_t r = 0; r < results.size(); ++r) EXPECT_THAT(results[r], IsOk()) << "rank " << r;
}

// Deterministic bytes for (sender, tag).
inline std::vector<uint8_t> Pattern(int sender, uint64_t tag, size_t n) {
  std::vector<uint8_t> v(n);
  uint32_t x = static_cast<uint32_t>(sender * 7919 + tag * 104729 + 1);
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

inline absl::Time Deadline(absl::Duration d = absl::Seconds(10)) { return absl::Now() + d; }

// What every transport refuses with INVALID_ARGUMENT: a send to itself, a peer outside the group,
// a Wait on a handle it never gave out.
inline absl::Status ExpectBadPeersAndHandlesRejected(int rank, engine::Transport& t) {
  std::vector<uint8_t> buf(4);
  EXPECT_THAT(t.PostSend(rank, 1, buf), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(t.PostRecv(5, 1, absl::MakeSpan(buf)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(t.Wait(12345, Deadline()), StatusIs(absl::StatusCode::kInvalidArgument));
  return absl::OkStatus();
}

// A transport that forwards every call to `inner`: test doubles derive from it and override what
// they change (tamper with a send, erase tags, ...). Scatter/gather is Transport's default (one
// buffer per message, as Gloo); a wrapper that offers it overrides those calls too.
class WrappedTransport : public engine::Transport {
 public:
  explicit WrappedTransport(std::unique_ptr<engine::Transport> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  engine::TransportCapabilities capabilities() const override {
    engine::TransportCapabilities c = inner_->capabilities();
    c.scatter_gather = SupportsParts();  // a wrapper that does not forward parts does not offer them
    return c;
  }
  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override {
    return inner_->PostSend(peer, tag, data);
  }
  absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override {
    return inner_->PostRecv(peer, tag, buffer);
  }
  absl::Status Wait(Handle handle, absl::Time deadline) override { return inner_->Wait(handle, deadline); }
  void Abort() override { inner_->Abort(); }

 protected:
  engine::Transport& inner() { return *inner_; }
  const engine::Transport& inner() const { return *inner_; }

 private:
  std::unique_ptr<engine::Transport> inner_;
};

}  // namespace dynamiq::testing

#endif  // DQ_TESTS_TESTING_TRANSPORT_TEST_UTIL_H_

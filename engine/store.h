// Store: the small key-value store ranks rendezvous through (Gloo's connection setup, NCCL unique
// ids, anything a group must agree on before it can talk). Keys are written once and read by
// everyone; Get waits until the key exists or the timeout passes. Whoever knows a key is no longer
// needed deletes it (Delete), so a long-running store does not grow with every job and retry.
//
// Implementations: InMemoryStore (threads of one process, tests), GrpcStore (dynamiqd: the
// coordinator's store over gRPC, server/grpc_store.h), TcpStoreServer/TcpStoreClient
// (dynamiq-bench's processes, bench/tcp_store.h). Thread-safe: every method may be called from any thread.
#ifndef DQ_ENGINE_STORE_H_
#define DQ_ENGINE_STORE_H_

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace dynamiq::engine {

class Store {
 public:
  virtual ~Store() = default;
  // Sets (or overwrites) `key`.
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;
  // The value of `key`, waiting up to `timeout` for it to be set; DEADLINE_EXCEEDED names the key.
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) = 0;
  // Waits until every key is set; DEADLINE_EXCEEDED names the keys still missing.
  virtual absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) = 0;
  // Atomically sets `key` to `desired` if its value is `expected` (nullopt: if it is not set) and
  // returns true; otherwise leaves it and returns false. What nodes use to claim a value
  // (e.g. the next configuration epoch) when several may try at once. UNIMPLEMENTED by stores that
  // cannot do it atomically.
  virtual absl::StatusOr<bool> CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                             absl::string_view desired) {
    return absl::UnimplementedError("this store has no compare-and-set");
  }
  // The current values of `keys` in order (nullopt: not set), without waiting for any: one round
  // trip for a remote store (what a node reads at a collective boundary). By default one Get each.
  virtual absl::StatusOr<std::vector<std::optional<std::string>>> GetMany(absl::Span<const std::string> keys);

  // Get and Set whose call ends by `deadline` whatever happens (Get waits for the key for
  // `timeout`), for best-effort calls that must not hold their caller when the store is out of reach
  // (a remote store on a cut link). A store whose calls cannot hang (in-process) just calls Get/Set.
  virtual absl::StatusOr<std::string> GetBefore(absl::string_view key, absl::Duration timeout, absl::Time deadline) {
    return Get(key, std::min(timeout, std::max(absl::ZeroDuration(), deadline - absl::Now())));
  }
  virtual absl::Status SetBefore(absl::string_view key, absl::string_view value, absl::Time /*deadline*/) {
    return Set(key, value);
  }

  // Whether a wait that is not a store call (a rank waiting for its peers to connect) should stop
  // early, as this store's own waits would: non-OK says why. A plain store never interrupts.
  virtual absl::Status Interrupted() { return absl::OkStatus(); }

  // What Delete removes, in one atomic step: `keys` (those not set are skipped), then every key that
  // starts with `prefix` (empty: none), unless a key that starts with `unless_prefix` is still set
  // after `keys` are gone (empty: no condition). The condition is how several nodes free what they
  // shared once the last of them is done with it: each holds a key under `unless_prefix` while it
  // needs the keys under `prefix`, and whoever deletes its own key last takes the rest with it
  // (server/cluster.h).
  struct Deletion {
    std::vector<std::string> keys;
    std::string prefix;
    std::string unless_prefix;
  };
  // Deletes what `deletion` names; returns how many keys it deleted. UNIMPLEMENTED by stores that
  // cannot delete: callers treat deletion as best effort.
  virtual absl::StatusOr<uint64_t> Delete(const Deletion& deletion) {
    return absl::UnimplementedError("this store cannot delete keys");
  }
};

// Whether `status` is a store's own answer that a key is not set (yet): the DEADLINE_EXCEEDED of a
// Get or Wait, which says "store key '<key>' was not set within <timeout>" (InMemoryStore,
// TcpStoreServer, and the coordinator's store behind GrpcStore). A store that cannot be reached
// (UNAVAILABLE, or an RPC's own deadline) is not.
bool IsKeyNotSet(const absl::Status& status);

// Store for ranks that are threads of one process, and the coordinator's store behind
// server/rendezvous_service.h. Optional limits on the number of keys and on their bytes (keys and
// values together) make a Set or CompareAndSet that would add past them fail with
// RESOURCE_EXHAUSTED, so a client that never deletes (or a hostile one) cannot grow it without bound.
class InMemoryStore final : public Store {
 public:
  struct Limits {
    size_t max_keys = std::numeric_limits<size_t>::max();
    size_t max_bytes = std::numeric_limits<size_t>::max();
  };
  InMemoryStore() = default;
  explicit InMemoryStore(Limits limits) : limits_(limits) {}

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<bool> CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                     absl::string_view desired) override;
  absl::StatusOr<uint64_t> Delete(const Deletion& deletion) override;

  // How many keys it holds, and their bytes (keys and values).
  size_t size() const;
  size_t bytes() const;

 private:
  // Stores `value` under `key`, within the limits.
  absl::Status Put(absl::string_view key, absl::string_view value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Limits limits_{};
  mutable absl::Mutex mu_;
  std::map<std::string, std::string, std::less<>> values_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Prepends "<prefix>/" to every key, so groups, jobs and epochs never read each other's keys.
class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, Store& base) : prefix_(std::move(prefix)), base_(base) {}
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<bool> CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                     absl::string_view desired) override;
  absl::StatusOr<std::vector<std::optional<std::string>>> GetMany(absl::Span<const std::string> keys) override;
  // Keys and prefixes are under the prefix too; an empty prefix or condition stays empty.
  absl::StatusOr<uint64_t> Delete(const Deletion& deletion) override;
  absl::Status Interrupted() override { return base_.Interrupted(); }

 private:
  std::string Key(absl::string_view key) const;
  std::string prefix_;
  Store& base_;
};

// A store whose waits stop early when `interrupted` says so: Get and Wait wait on `base` in slices
// of at most `poll` and ask `interrupted()` between slices; a non-OK status from it is returned at
// once instead of waiting on. So a rank waiting in a rendezvous for a peer that will never come
// (the peer failed the collective and published why) stops as soon as the reason is known, not
// at its timeout. Interrupted() asks `interrupted()` too, for waits that are not store calls (a TCP
// rank accepting its peers). Set and CompareAndSet go straight to `base`.
class InterruptibleStore final : public Store {
 public:
  InterruptibleStore(Store& base, std::function<absl::Status()> interrupted, absl::Duration poll)
      : base_(base), interrupted_(std::move(interrupted)), poll_(poll) {}
  absl::Status Set(absl::string_view key, absl::string_view value) override { return base_.Set(key, value); }
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<bool> CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                     absl::string_view desired) override {
    return base_.CompareAndSet(key, expected, desired);
  }
  absl::StatusOr<std::vector<std::optional<std::string>>> GetMany(absl::Span<const std::string> keys) override {
    return base_.GetMany(keys);
  }
  absl::StatusOr<uint64_t> Delete(const Deletion& deletion) override { return base_.Delete(deletion); }
  absl::Status Interrupted() override { return interrupted_(); }

 private:
  Store& base_;
  const std::function<absl::Status()> interrupted_;
  const absl::Duration poll_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_STORE_H_

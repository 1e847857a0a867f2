// RendezvousService: the coordinator's gRPC service (dynamiq.v1.Rendezvous). Daemons Join to learn
// the cluster's membership (every node gets the same list, by node rank, once all have joined)
// and use Set/Get as the key-value store Gloo's and NCCL's rendezvous need (GrpcStore is the
// client side). Backed by an engine::InMemoryStore; Get and Join wait server-side, bounded by
// the request's timeout and the call's deadline.
//
// Keys live until a node deletes them (Delete; server/cluster.h says which keys go when); the store
// refuses to grow past kMaxStoreKeys keys or kMaxStoreBytes bytes (RESOURCE_EXHAUSTED), a ceiling
// for a runaway or hostile client, far above what a cluster needs (a few keys per node and job).
//
// With RequireSettings (dynamiqd's node 0 calls it with its own settings), a Join whose settings
// (JoinRequest.settings: those that change what goes between nodes) differ from node 0's is refused
// with FAILED_PRECONDITION naming each differing setting and both values, before the node takes its
// place: the coordinator never lists a refused node among the members, and a node with the right
// settings may still join in its place.
//
// Bad input gets INVALID_ARGUMENT (empty or oversized key/value, node rank out of range, a
// node count that disagrees with earlier joiners); a rank that joins twice with a different
// address gets ALREADY_EXISTS. With an authenticator (a cluster secret is configured), every call
// must first present the cluster's rendezvous token (server/security.h), else UNAUTHENTICATED: a
// stray process can neither join nor read or write keys. Thread-safe: gRPC calls handlers
// concurrently.
#ifndef DQ_SERVER_RENDEZVOUS_SERVICE_H_
#define DQ_SERVER_RENDEZVOUS_SERVICE_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "dynamiq/v1/rendezvous.grpc.pb.h"
#include "engine/store.h"
#include "server/bearer_auth.h"
#include "server/grpc_store.h"
#include "server/membership.h"

namespace dynamiq::server {

inline constexpr size_t kMaxStoreKeyBytes = 4096;
inline constexpr size_t kMaxStoreValueBytes = size_t{16} << 20;
inline constexpr size_t kMaxStoreKeys = size_t{1} << 20;
inline constexpr size_t kMaxStoreBytes = size_t{256} << 20;
inline constexpr size_t kMaxDeleteKeys = 1024;  // keys named in one Delete
inline constexpr size_t kMaxGetManyKeys = 64;   // keys named in one GetMany

// OK if `joiner`'s settings (node `rank`'s) are node 0's; FAILED_PRECONDITION otherwise, e.g. "node 0
// runs --transport=tcp but node 1 runs --transport=gloo: every node of a cluster must run the same
// --transport". A setting only one side has is shown as "(unset)" on the other.
absl::Status CompareNodeSettings(const NodeSettings& node0, const NodeSettings& joiner, uint32_t rank);

class RendezvousService final : public dynamiq::v1::Rendezvous::Service {
 public:
  using RejectFn = std::function<void(const absl::Status&)>;
  // `auth` (may be null: open, for trusted networks) must outlive the service; `on_reject` hears
  // of every call refused for want of authentication.
  explicit RendezvousService(const BearerAuthenticator* auth = nullptr, RejectFn on_reject = nullptr,
                             engine::InMemoryStore::Limits limits = {kMaxStoreKeys, kMaxStoreBytes})
      : auth_(auth), on_reject_(std::move(on_reject)), store_(limits) {}

  grpc::Status Set(grpc::ServerContext* context, const dynamiq::v1::StoreSetRequest* request,
                   dynamiq::v1::StoreSetResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const dynamiq::v1::StoreGetRequest* request,
                   dynamiq::v1::StoreGetResponse* response) override;
  // The keys' current values (none waited for); INVALID_ARGUMENT for a bad key or more than
  // kMaxGetManyKeys, RESOURCE_EXHAUSTED past kMaxStoreValueBytes of values in one answer.
  grpc::Status GetMany(grpc::ServerContext* context, const dynamiq::v1::StoreGetManyRequest* request,
                       dynamiq::v1::StoreGetManyResponse* response) override;
  grpc::Status CompareAndSet(grpc::ServerContext* context, const dynamiq::v1::StoreCompareAndSetRequest* request,
                             dynamiq::v1::StoreCompareAndSetResponse* response) override;
  grpc::Status Delete(grpc::ServerContext* context, const dynamiq::v1::StoreDeleteRequest* request,
                      dynamiq::v1::StoreDeleteResponse* response) override;
  grpc::Status Join(grpc::ServerContext* context, const dynamiq::v1::JoinRequest* request,
                    dynamiq::v1::JoinResponse* response) override;
  // A member's heartbeat (server/membership.h): FAILED_PRECONDITION from a node that has not joined
  // from that address, UNIMPLEMENTED unless EnableHeartbeats was called.
  grpc::Status Heartbeat(grpc::ServerContext* context, const dynamiq::v1::HeartbeatRequest* request,
                         dynamiq::v1::HeartbeatResponse* response) override;

  // Tracks the members' heartbeats: silent after `timeout`; every live set reports `min_nodes`.
  // Call before the server starts.
  void EnableHeartbeats(absl::Duration timeout, uint32_t min_nodes) {
    absl::MutexLock lock(&mu_);
    membership_ = std::make_unique<MembershipTracker>(timeout, min_nodes);
  }

  // Joins must present these settings (node 0's; see above). Call before the server starts.
  void RequireSettings(NodeSettings settings) {
    absl::MutexLock lock(&mu_);
    required_settings_ = std::move(settings);
  }

  // How many keys the store holds, and their bytes (keys and values): what tests and the
  // dynamiq_coordinator_store_* gauges watch.
  size_t KeyCount() const { return store_.size(); }
  size_t KeyBytes() const { return store_.bytes(); }

 private:
  absl::Status Authorize(const grpc::ServerContext& context) const;

  const BearerAuthenticator* const auth_;
  const RejectFn on_reject_;
  engine::InMemoryStore store_;
  absl::Mutex mu_;
  uint32_t num_nodes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> members_ ABSL_GUARDED_BY(mu_);
  std::optional<NodeSettings> required_settings_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<MembershipTracker> membership_ ABSL_GUARDED_BY(mu_);  // set once, before the server starts
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_RENDEZVOUS_SERVICE_H_

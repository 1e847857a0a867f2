// GrpcStore: the engine::Store that daemons use, served by the coordinator's RendezvousService.
// Every call carries a deadline; transport errors come back as UNAVAILABLE with the address.
// Thread-safe (gRPC stubs are).
#ifndef DQ_SERVER_GRPC_STORE_H_
#define DQ_SERVER_GRPC_STORE_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dynamiq/v1/rendezvous.grpc.pb.h"
#include "engine/store.h"
#include "server/membership.h"

namespace dynamiq::server {

// A node's settings that every node of a cluster must share, in the order messages list them: flag
// name (without "--") and value as the flag would be given ({"transport", "tcp"}).
using NodeSettings = std::vector<std::pair<std::string, std::string>>;

class GrpcStore final : public engine::Store {
 public:
  // `address` is "host:port" of the coordinator. `credentials`: the channel's (null: insecure; TLS
  // when the coordinator serves TLS, server/security.h). `token`: the cluster's rendezvous token,
  // sent as "authorization: Bearer <token>" on every call (empty: none).
  explicit GrpcStore(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
                     std::string token = "");

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<bool> CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                     absl::string_view desired) override;
  // One GetMany call; against a coordinator that predates it (UNIMPLEMENTED), one Get per key from
  // then on.
  absl::StatusOr<std::vector<std::optional<std::string>>> GetMany(absl::Span<const std::string> keys) override;
  // Ends within kDeleteRpcDeadline whatever happens (deletion is best effort: a node must not be held
  // when the coordinator is out of reach); UNIMPLEMENTED from a coordinator that predates Delete.
  absl::StatusOr<uint64_t> Delete(const Deletion& deletion) override;
  static constexpr absl::Duration kDeleteRpcDeadline = absl::Seconds(2);

  // Get and Set whose call ends by `deadline` whatever happens (Get waits for the key for `timeout`),
  // with none of the usual slack: for best-effort calls that must not hold their caller when the
  // coordinator is out of reach without a reset (a cut link).
  absl::StatusOr<std::string> GetBefore(absl::string_view key, absl::Duration timeout, absl::Time deadline) override;
  absl::Status SetBefore(absl::string_view key, absl::string_view value, absl::Time deadline) override;

  // Joins the cluster as `node_rank` of `num_nodes` at `address` with `settings` (the coordinator
  // compares them with node 0's: FAILED_PRECONDITION naming those that differ); returns every
  // member's address by node rank once all have joined (or DEADLINE_EXCEEDED after `timeout`).
  absl::StatusOr<std::vector<std::string>> Join(uint32_t node_rank, uint32_t num_nodes, const std::string& address,
                                                absl::Duration timeout, const NodeSettings& settings = {});
  // Says that member `node_rank` (joined from `address`) is alive; the live set the coordinator
  // answers with (server/membership.h). The call ends by `deadline`. UNIMPLEMENTED from a
  // coordinator without heartbeats.
  absl::StatusOr<LiveSet> Heartbeat(uint32_t node_rank, const std::string& address, absl::Time deadline);

 private:
  // A context with the deadline and the token.
  void Prepare(grpc::ClientContext& context, absl::Time deadline) const;

  std::string address_;
  std::string token_;
  bool tls_ = false;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<dynamiq::v1::Rendezvous::Stub> stub_;
  std::atomic<bool> get_many_unimplemented_{false};
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_GRPC_STORE_H_

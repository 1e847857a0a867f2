#include "server/grpc_store.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace dynamiq::server {
namespace {

// Slack on top of a server-side wait for the round trip.
constexpr absl::Duration kRpcSlack = absl::Seconds(5);

// The RPC's status with the coordinator's address (and what was being done) in front.
absl::Status Annotate(const grpc::Status& s, absl::string_view what) {
  absl::Status status = common::FromGrpcStatus(s);
  if (status.ok()) return status;
  return common::Annotate(status, what);
}

absl::Time Deadline(absl::Duration timeout) { return absl::Now() + timeout + kRpcSlack; }

// How long a call waits for a channel that is not connected before it is made (Prepare): a little
// more than the longest reconnect backoff.
constexpr absl::Duration kReconnectWait = absl::Milliseconds(1500);

// A Get that does not wait (a poll, e.g. for configuration changes before every collective) must
// not hold its caller for the full slack when the coordinator is unreachable without a reset (a
// cut link): the server answers it at once, so a round trip is all it needs.
constexpr absl::Duration kPollRpcDeadline = absl::Seconds(1);

}  // namespace

GrpcStore::GrpcStore(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials,
                     std::string token)
    : address_(address), token_(std::move(token)), tls_(credentials != nullptr) {
  if (!credentials) credentials = grpc::InsecureChannelCredentials();
  // A cut link must not outlast itself. A connection that carried calls while the link was down
  // waits in TCP's retransmission backoff (doubling from 200 ms), so after the link comes back the
  // node would reach the coordinator only seconds later and miss the next collective's rendezvous:
  // pings while a call is open find such a connection dead within ~3 s, a new one is tried at
  // least every second (gRPC's default reconnect backoff grows by 1.6x per attempt to 2 min), and
  // a call waits for it first (Prepare).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  channel_ = grpc::CreateCustomChannel(address, credentials, args);
  stub_ = dynamiq::v1::Rendezvous::NewStub(channel_);
}

void GrpcStore::Prepare(grpc::ClientContext& context, absl::Time deadline) const {
  context.set_deadline(absl::ToChronoTime(deadline));
  // A channel that lost its connection (a link that just came back) fails calls at once with the
  // last connection error until its next attempt: give it that attempt first, within the call's
  // deadline. A coordinator that is really gone still fails the call, kReconnectWait later.
  if (channel_->GetState(/*try_to_connect=*/true) != GRPC_CHANNEL_READY) {
    channel_->WaitForConnected(absl::ToChronoTime(std::min(deadline, absl::Now() + kReconnectWait)));
  }
  if (!token_.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
}

absl::Status GrpcStore::Set(absl::string_view key, absl::string_view value) {
  return SetBefore(key, value, Deadline(absl::ZeroDuration()));
}

absl::Status GrpcStore::SetBefore(absl::string_view key, absl::string_view value, absl::Time deadline) {
  dynamiq::v1::StoreSetRequest request;
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  dynamiq::v1::StoreSetResponse response;
  grpc::ClientContext context;
  Prepare(context, deadline);
  return Annotate(stub_->Set(&context, request, &response), absl::StrCat("rendezvous at ", address_));
}

absl::StatusOr<std::string> GrpcStore::Get(absl::string_view key, absl::Duration timeout) {
  return GetBefore(key, timeout, timeout <= absl::ZeroDuration() ? absl::Now() + kPollRpcDeadline : Deadline(timeout));
}

absl::StatusOr<std::string> GrpcStore::GetBefore(absl::string_view key, absl::Duration timeout, absl::Time deadline) {
  dynamiq::v1::StoreGetRequest request;
  request.set_key(std::string(key));
  request.set_timeout_ms(static_cast<uint32_t>(std::clamp<int64_t>(absl::ToInt64Milliseconds(timeout), 0, 1 << 30)));
  dynamiq::v1::StoreGetResponse response;
  grpc::ClientContext context;
  Prepare(context, deadline);
  absl::Status s = Annotate(stub_->Get(&context, request, &response), absl::StrCat("rendezvous at ", address_));
  if (!s.ok()) return s;
  return std::move(*response.mutable_value());
}

absl::StatusOr<std::vector<std::optional<std::string>>> GrpcStore::GetMany(absl::Span<const std::string> keys) {
  if (get_many_unimplemented_.load(std::memory_order_relaxed)) return Store::GetMany(keys);
  dynamiq::v1::StoreGetManyRequest request;
  for (const std::string& key : keys) request.add_keys(key);
  dynamiq::v1::StoreGetManyResponse response;
  grpc::ClientContext context;
  Prepare(context, absl::Now() + kPollRpcDeadline);
  absl::Status s = Annotate(stub_->GetMany(&context, request, &response), absl::StrCat("rendezvous at ", address_));
  if (absl::IsUnimplemented(s)) {
    get_many_unimplemented_.store(true, std::memory_order_relaxed);
    return Store::GetMany(keys);
  }
  if (!s.ok()) return s;
  if (response.values_size() != static_cast<int>(keys.size())) {
    return absl::DataLossError(absl::StrCat("rendezvous at ", address_, " answered ", response.values_size(),
                                            " values for ", keys.size(), " keys"));
  }
  std::vector<std::optional<std::string>> values;
  values.reserve(keys.size());
  for (dynamiq::v1::StoreValue& v : *response.mutable_values()) {
    if (v.set()) {
      values.emplace_back(std::move(*v.mutable_value()));
    } else {
      values.emplace_back(std::nullopt);
    }
  }
  return values;
}

absl::StatusOr<bool> GrpcStore::CompareAndSet(absl::string_view key, std::optional<absl::string_view> expected,
                                              absl::string_view desired) {
  dynamiq::v1::StoreCompareAndSetRequest request;
  request.set_key(std::string(key));
  if (expected.has_value()) request.set_expected(std::string(*expected));
  request.set_desired(std::string(desired));
  dynamiq::v1::StoreCompareAndSetResponse response;
  grpc::ClientContext context;
  Prepare(context, Deadline(absl::ZeroDuration()));
  absl::Status s =
      Annotate(stub_->CompareAndSet(&context, request, &response), absl::StrCat("rendezvous at ", address_));
  if (!s.ok()) return s;
  return response.swapped();
}

absl::StatusOr<uint64_t> GrpcStore::Delete(const Deletion& deletion) {
  dynamiq::v1::StoreDeleteRequest request;
  for (const std::string& key : deletion.keys) request.add_keys(key);
  request.set_prefix(deletion.prefix);
  request.set_unless_prefix(deletion.unless_prefix);
  dynamiq::v1::StoreDeleteResponse response;
  grpc::ClientContext context;
  Prepare(context, absl::Now() + kDeleteRpcDeadline);
  absl::Status s = Annotate(stub_->Delete(&context, request, &response), absl::StrCat("rendezvous at ", address_));
  if (!s.ok()) return s;
  return response.deleted();
}

absl::Status GrpcStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (const std::string& key : keys) {
    absl::StatusOr<std::string> value = Get(key, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!value.ok()) return value.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> GrpcStore::Join(uint32_t node_rank, uint32_t num_nodes,
                                                         const std::string& address, absl::Duration timeout,
                                                         const NodeSettings& settings) {
  dynamiq::v1::JoinRequest request;
  request.set_node_rank(node_rank);
  request.set_num_nodes(num_nodes);
  request.set_address(address);
  for (const auto& [name, value] : settings) {
    dynamiq::v1::NodeSetting* s = request.add_settings();
    s->set_name(name);
    s->set_value(value);
  }
  dynamiq::v1::JoinResponse response;
  grpc::ClientContext context;
  Prepare(context, absl::Now() + timeout);
  // Nodes may start before the coordinator listens: wait for it (up to the deadline) instead of
  // failing at the first refused connection.
  context.set_wait_for_ready(true);
  absl::Status s =
      Annotate(stub_->Join(&context, request, &response), absl::StrCat("joining the cluster at ", address_));
  if (absl::IsUnimplemented(s)) {
    // A dynamiqd answers there, but it does not serve the rendezvous: it is not node 0.
    return absl::FailedPreconditionError(
        absl::StrCat(address_,
                     " answers but is not the coordinator: --coordinator must be node 0's --listen address "
                     "(node 0 serves the rendezvous)"));
  }
  if (absl::IsDeadlineExceeded(s) && tls_) {
    // A failed TLS handshake looks like a coordinator that is not up yet to wait_for_ready.
    return absl::DeadlineExceededError(
        absl::StrCat(s.message(),
                     " (TLS: does --tls_ca verify the coordinator's certificate, and does the "
                     "certificate name the address ",
                     address_, "?)"));
  }
  if (!s.ok()) return s;
  return std::vector<std::string>(response.members().begin(), response.members().end());
}

absl::StatusOr<LiveSet> GrpcStore::Heartbeat(uint32_t node_rank, const std::string& address, absl::Time deadline) {
  dynamiq::v1::HeartbeatRequest request;
  request.set_node_rank(node_rank);
  request.set_address(address);
  dynamiq::v1::HeartbeatResponse response;
  grpc::ClientContext context;
  Prepare(context, deadline);
  DQ_RETURN_IF_ERROR(Annotate(stub_->Heartbeat(&context, request, &response), absl::StrCat("heartbeat to ", address_)));
  LiveSet set;
  set.epoch = response.epoch();
  set.live.assign(response.live().begin(), response.live().end());
  set.generations.assign(response.generations().begin(), response.generations().end());
  if (!std::is_sorted(set.live.begin(), set.live.end()) || set.generations.size() != set.live.size()) {
    return absl::DataLossError(absl::StrCat("heartbeat to ", address_, ": a malformed live set"));
  }
  set.min_nodes = response.min_nodes();
  for (const auto& s : response.silent()) set.silent.emplace_back(s.node_rank(), s.seconds());
  return set;
}

}  // namespace dynamiq::server

#include "server/rendezvous_service.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/safe_text.h"
#include "common/status_macros.h"

namespace dynamiq::server {
namespace {

// Bounds a server-side wait by the request's timeout and the call's deadline.
absl::Duration WaitFor(grpc::ServerContext* context, uint32_t timeout_ms) {
  absl::Duration d = absl::Milliseconds(timeout_ms);
  const absl::Duration left = absl::FromChrono(context->deadline()) - absl::Now();
  return std::max(absl::ZeroDuration(), std::min(d, left));
}

absl::Status CheckKey(const std::string& key) {
  if (key.empty() || key.size() > kMaxStoreKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("store key must be 1..", kMaxStoreKeyBytes, " bytes, got ", key.size()));
  }
  return absl::OkStatus();
}

// Membership keys (Join's) are not for deleting: a node that lost its key would look forgotten.
constexpr absl::string_view kMemberPrefix = "member/";

absl::Status CheckDeletion(const dynamiq::v1::StoreDeleteRequest& request) {
  if (static_cast<size_t>(request.keys_size()) > kMaxDeleteKeys) {
    return absl::InvalidArgumentError(
        absl::StrCat("a deletion names at most ", kMaxDeleteKeys, " keys, got ", request.keys_size()));
  }
  for (const std::string& key : request.keys()) {
    DQ_RETURN_IF_ERROR(CheckKey(key));
    if (absl::StartsWith(key, kMemberPrefix)) {
      return absl::InvalidArgumentError(absl::StrCat("membership key '", key, "' cannot be deleted"));
    }
  }
  for (const std::string* prefix : {&request.prefix(), &request.unless_prefix()}) {
    if (prefix->size() > kMaxStoreKeyBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("store key prefix must be at most ", kMaxStoreKeyBytes, " bytes, got ", prefix->size()));
    }
  }
  const std::string& prefix = request.prefix();
  if (!prefix.empty() && (absl::StartsWith(prefix, kMemberPrefix) || absl::StartsWith(kMemberPrefix, prefix))) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix '", prefix, "' would delete membership keys, which cannot be deleted"));
  }
  return absl::OkStatus();
}

}  // namespace

// Bounds of a join's settings (a few dozen short flags in practice).
constexpr int kMaxJoinSettings = 64;
constexpr size_t kMaxSettingBytes = 256;

absl::Status CompareNodeSettings(const NodeSettings& node0, const NodeSettings& joiner, uint32_t rank) {
  auto find = [](const NodeSettings& settings, const std::string& name) -> std::string {
    for (const auto& [n, v] : settings) {
      if (n == name) return v;
    }
    return "(unset)";
  };
  std::vector<std::string> names;
  for (const auto& [name, value] : node0) names.push_back(name);
  for (const auto& [name, value] : joiner) {
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  std::vector<std::string> theirs, mine, flags;
  for (const std::string& name : names) {
    const std::string a = find(node0, name), b = find(joiner, name);
    if (a == b) continue;
    theirs.push_back(absl::StrCat("--", name, "=", a));
    mine.push_back(absl::StrCat("--", name, "=", b));
    flags.push_back(absl::StrCat("--", name));
  }
  if (flags.empty()) return absl::OkStatus();
  const std::string last = flags.back();
  flags.pop_back();
  const std::string which = flags.empty() ? last : absl::StrCat(absl::StrJoin(flags, ", "), " and ", last);
  return absl::FailedPreconditionError(absl::StrCat(
      "node 0 runs ", absl::StrJoin(theirs, " "), " but node ", rank, " runs ", absl::StrJoin(mine, " "),
      ": every node of a cluster must run the same ", which, " (settings that change what goes between nodes)"));
}

absl::Status RendezvousService::Authorize(const grpc::ServerContext& context) const {
  if (auth_ == nullptr) return absl::OkStatus();
  absl::Status s = auth_->Check(context);
  if (!s.ok() && on_reject_) on_reject_(s);
  return s;
}

grpc::Status RendezvousService::Set(grpc::ServerContext* context, const dynamiq::v1::StoreSetRequest* request,
                                    dynamiq::v1::StoreSetResponse*) {
  if (absl::Status s = Authorize(*context); !s.ok()) return common::ToGrpcStatus(s);
  if (absl::Status s = CheckKey(request->key()); !s.ok()) return common::ToGrpcStatus(s);
  if (request->value().size() > kMaxStoreValueBytes) {
    return common::ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("store value of ", request->value().size(), " bytes exceeds ", kMaxStoreValueBytes)));
  }
  return common::ToGrpcStatus(store_.Set(request->key(), request->value()));
}

grpc::Status RendezvousService::CompareAndSet(grpc::ServerContext* context,
                                              const dynamiq::v1::StoreCompareAndSetRequest* request,
                                              dynamiq::v1::StoreCompareAndSetResponse* response) {
  if (absl::Status s = Authorize(*context); !s.ok()) return common::ToGrpcStatus(s);
  if (absl::Status s = CheckKey(request->key()); !s.ok()) return common::ToGrpcStatus(s);
  if (request->desired().size() > kMaxStoreValueBytes) {
    return common::ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("store value of ", request->desired().size(), " bytes exceeds ", kMaxStoreValueBytes)));
  }
  std::optional<absl::string_view> expected;
  if (request->has_expected()) expected = request->expected();
  absl::StatusOr<bool> swapped = store_.CompareAndSet(request->key(), expected, request->desired());
  if (!swapped.ok()) return common::ToGrpcStatus(swapped.status());
  response->set_swapped(*swapped);
  return grpc::Status::OK;
}

grpc::Status RendezvousService::Get(grpc::ServerContext* context, const dynamiq::v1::StoreGetRequest* request,
                                    dynamiq::v1::StoreGetResponse* response) {
  if (absl::Status s = Authorize(*context); !s.ok()) return common::ToGrpcStatus(s);
  if (absl::Status s = CheckKey(request->key()); !s.ok()) return common::ToGrpcStatus(s);
  absl::StatusOr<std::string> value = store_.Get(request->key(), WaitFor(context, request->timeout_ms()));
  if (!value.ok()) return common::ToGrpcStatus(value.status());
  response->set_value(*std::move(value));
  return grpc::Status::OK;
}

grpc::Status RendezvousService::GetMany(grpc::ServerContext* context, const dynamiq::v1::StoreGetManyRequest* request,
                                        dynamiq::v1::StoreGetManyResponse* response) {
  if (absl::Status s = Authorize(*context); !s.ok()) return common::ToGrpcStatus(s);
  if (static_cast<size_t>(request->keys_size()) > kMaxGetManyKeys) {
    return common::ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("a GetMany names at most ", kMaxGetManyKeys, " keys, got ", request->keys_size())));
  }
  for (const std::string& key : request->keys()) {
    if (absl::Status s = CheckKey(key); !s.ok()) return common::ToGrpcStatus(s);
  }
  // Key by key, so that an answer never holds more than one value's worth past the bound.
  size_t bytes = 0;
  for (const std::string& key : request->keys()) {
    absl::StatusOr<std::string> value = store_.Get(key, absl::ZeroDuration());
    dynamiq::v1::StoreValue* v = response->add_values();
    if (engine::IsKeyNotSet(value.status())) continue;  // set = false
    if (!value.ok()) return common::ToGrpcStatus(value.status());
    bytes += value->size();
    if (bytes > kMaxStoreValueBytes) {
      return common::ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
          "a GetMany answers at most ", kMaxStoreValueBytes, " bytes of values; ask for fewer keys at once")));
    }
    v->set_set(true);
    v->set_value(*std::move(value));
  }
  return grpc::Status::OK;
}

grpc::Status RendezvousService::Delete(grpc::ServerContext* context, const dynamiq::v1::StoreDeleteRequest* request,
                                       dynamiq::v1::StoreDeleteResponse* response) {
  if (absl::Status s = Authorize(*context); !s.ok()) return common::ToGrpcStatus(s);
  if (absl::Status s = CheckDeletion(*request); !s.ok()) return common::ToGrpcStatus(s);
  engine::Store::Deletion deletion;
  deletion.keys.assign(request->keys().begin(), request->keys().end());
  deletion.prefix = request->prefix();
  deletion.unless_prefix = request->unless_prefix();
  absl::StatusOr<uint64_t> deleted = store_.Delete(deletion);
  if (!deleted.ok()) return common::ToGrpcStatus(deleted.status());
  response->set_deleted(*deleted);
  return grpc::Status::OK;
}

grpc::Status RendezvousService::Join(grpc::ServerContext* context, const dynamiq::v1::JoinRequest* request,
                                     dynamiq::v1::JoinResponse* response) {
  if (absl::Status s = Authorize(*context); !s.ok()) return common::ToGrpcStatus(s);
  const uint32_t n = request->num_nodes();
  if (n == 0 || n > 65535 || request->node_rank() >= n) {
    return common::ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("node rank ", request->node_rank(), " is not in a cluster of ", n, " nodes")));
  }
  if (request->address().empty()) return common::ToGrpcStatus(absl::InvalidArgumentError("join without an address"));
  {
    absl::MutexLock lock(&mu_);
    if (required_settings_.has_value()) {
      // Before the node takes its place: a refused node is never a member.
      // A joiner's words end up in node 0's log and the joiner's error: bounded and made safe.
      if (request->settings_size() > kMaxJoinSettings) {
        return common::ToGrpcStatus(absl::InvalidArgumentError(
            absl::StrCat("join with ", request->settings_size(), " settings, at most ", kMaxJoinSettings)));
      }
      NodeSettings settings;
      for (const dynamiq::v1::NodeSetting& s : request->settings()) {
        settings.emplace_back(common::SafeText(s.name(), kMaxSettingBytes),
                              common::SafeText(s.value(), kMaxSettingBytes));
      }
      absl::Status same = CompareNodeSettings(*required_settings_, settings, request->node_rank());
      if (!same.ok() && settings.empty()) {
        same = absl::FailedPreconditionError(
            absl::StrCat("node ", request->node_rank(),
                         " sent none of its settings (a dynamiqd older than node 0's?): ", same.message()));
      }
      if (!same.ok()) {
        if (on_reject_) on_reject_(same);
        return common::ToGrpcStatus(same);
      }
    }
    if (num_nodes_ == 0) {
      num_nodes_ = n;
      members_.assign(n, "");
    } else if (num_nodes_ != n) {
      return common::ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "node ", request->node_rank(), " says the cluster has ", n, " nodes, earlier nodes said ", num_nodes_)));
    }
    std::string& slot = members_[request->node_rank()];
    if (!slot.empty() && slot != request->address()) {
      return common::ToGrpcStatus(absl::AlreadyExistsError(absl::StrCat(
          "node rank ", request->node_rank(), " already joined from ", slot, ", not ", request->address())));
    }
    slot = request->address();
    if (membership_) membership_->Joined(request->node_rank(), absl::Now());
  }
  if (absl::Status s = store_.Set(absl::StrCat("member/", request->node_rank()), request->address()); !s.ok()) {
    return common::ToGrpcStatus(s);
  }
  std::vector<std::string> keys;
  for (uint32_t r = 0; r < n; ++r) keys.push_back(absl::StrCat("member/", r));
  const absl::Duration wait = absl::FromChrono(context->deadline()) - absl::Now();
  if (absl::Status s = store_.Wait(keys, std::max(absl::ZeroDuration(), wait)); !s.ok()) {
    return common::ToGrpcStatus(
        absl::DeadlineExceededError(absl::StrCat("not every node joined in time: ", s.message())));
  }
  absl::MutexLock lock(&mu_);
  for (const std::string& m : members_) response->add_members(m);
  return grpc::Status::OK;
}

grpc::Status RendezvousService::Heartbeat(grpc::ServerContext* context, const dynamiq::v1::HeartbeatRequest* request,
                                          dynamiq::v1::HeartbeatResponse* response) {
  if (absl::Status s = Authorize(*context); !s.ok()) return common::ToGrpcStatus(s);
  absl::MutexLock lock(&mu_);
  if (!membership_) return common::ToGrpcStatus(absl::UnimplementedError("this coordinator takes no heartbeats"));
  const uint32_t node = request->node_rank();
  if (node >= members_.size() || members_[node].empty() || members_[node] != request->address()) {
    // Only a member keeps its place alive: a stray caller must not hide a dead node.
    return common::ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("node rank ", node, " at ", common::SafeText(request->address(), kMaxSettingBytes),
                     " is not a member of this cluster")));
  }
  const absl::Time now = absl::Now();
  membership_->Heard(node, now);
  const LiveSet set = membership_->Snapshot(num_nodes_, now);
  response->set_epoch(set.epoch);
  for (uint32_t m : set.live) response->add_live(m);
  for (uint64_t g : set.generations) response->add_generations(g);
  response->set_min_nodes(set.min_nodes);
  for (const auto& [silent, seconds] : set.silent) {
    dynamiq::v1::HeartbeatResponse::Silent* s = response->add_silent();
    s->set_node_rank(silent);
    s->set_seconds(seconds);
  }
  return grpc::Status::OK;
}

}  // namespace dynamiq::server

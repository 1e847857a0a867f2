// ConnectHostTransport: the transports that move host memory, by the name dynamiqd's and
// dynamiq-bench's --transport give them: "tcp" (engine/tcp_transport.h) or "gloo"
// (engine/gloo_transport.h), each listening on `hostname` and rendezvousing through `store`
// within `timeout`. `key` (the job's, when the cluster has a secret) authenticates the TCP
// transport's hellos; Gloo's connections carry none (the step headers' MACs protect its messages).
#ifndef DQ_ENGINE_HOST_TRANSPORT_H_
#define DQ_ENGINE_HOST_TRANSPORT_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/hmac.h"
#include "engine/store.h"
#include "engine/transport.h"

namespace dynamiq::engine {

// INVALID_ARGUMENT for another name; otherwise what the transport's Connect returns.
absl::StatusOr<std::unique_ptr<Transport>> ConnectHostTransport(absl::string_view name, Store& store, int rank,
                                                                int size, const std::string& hostname,
                                                                absl::Duration timeout,
                                                                std::optional<common::HmacSha256::Digest> key = {});

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_HOST_TRANSPORT_H_

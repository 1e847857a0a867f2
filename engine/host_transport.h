// ConnectHostTransport: the transports that move host memory, by the name dynamiqd's and
// dynamiq-bench's --transport give them: "tcp" (engine/tcp_transport.h) or "gloo"
// (engine/gloo_transport.h), each listening on `hostname` and rendezvousing through `store`
// within `timeout`.
#ifndef DQ_ENGINE_HOST_TRANSPORT_H_
#define DQ_ENGINE_HOST_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/store.h"
#include "engine/transport.h"

namespace dynamiq::engine {

// INVALID_ARGUMENT for another name; otherwise what the transport's Connect returns.
absl::StatusOr<std::unique_ptr<Transport>> ConnectHostTransport(absl::string_view name, Store& store, int rank,
                                                                int size, const std::string& hostname,
                                                                absl::Duration timeout);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_HOST_TRANSPORT_H_

#include "engine/host_transport.h"

#include "absl/strings/str_cat.h"
#include "engine/gloo_transport.h"
#include "engine/tcp_transport.h"
#include "engine/transport_registry.h"

namespace dynamiq::engine {

absl::StatusOr<std::unique_ptr<Transport>> ConnectHostTransport(absl::string_view name, Store& store, int rank,
                                                                int size, const std::string& hostname,
                                                                absl::Duration timeout,
                                                                std::optional<common::HmacSha256::Digest> key) {
  if (name == "tcp") {
    TcpTransportOptions o;
    o.hostname = hostname;
    o.timeout = timeout;
    o.key = key;
    return ConnectTcpTransport(store, rank, size, o);
  }
  if (name == "gloo") {
    GlooTransportOptions o;
    o.hostname = hostname;
    o.timeout = timeout;
    return ConnectGlooTransport(store, rank, size, o);
  }
  absl::StatusOr<TransportKind> kind = FindTransportKind(name);
  if (!kind.ok())
    return absl::InvalidArgumentError(absl::StrCat("transport must be ", HostTransportNames(), ", got '", name, "'"));
  if (kind->datagram) {
    return absl::InvalidArgumentError(absl::StrCat("transport ", name,
                                                   " carries datagrams, neither reliable nor ordered as the "
                                                   "collective engines need; --transport takes ",
                                                   HostTransportNames()));
  }
  return absl::InvalidArgumentError(absl::StrCat("transport ", name, " does not move host memory between CPU nodes (",
                                                 kind->summary, "); --transport takes ", HostTransportNames()));
}

}  // namespace dynamiq::engine

// The transport registry: every kind of transport dynamiq has, with what it promises
// (TransportCapabilities), like the codec registry (kernels/codec_info.h) for codecs. Flags,
// configuration checks, metrics labels and the algorithm selector read it instead of comparing
// transport names in several places. A new transport adds its row here and passes the conformance
// suite (tests/engine/transport_conformance_test.cc) before any engine may use it; a datagram
// kind passes the datagram suite (tests/engine/udp_transport_test.cc) instead.
#ifndef DQ_ENGINE_TRANSPORT_REGISTRY_H_
#define DQ_ENGINE_TRANSPORT_REGISTRY_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/transport.h"

namespace dynamiq::engine {

struct TransportKind {
  TransportCapabilities capabilities;  // capabilities.kind is the registry's name
  // Selectable with dynamiqd's and dynamiq-bench's --transport between CPU nodes
  // (engine/host_transport.h connects it); the others are chosen by the device (nccl) or exist
  // for tests and wrappers (memory).
  bool host_selectable = false;
  // Made as an engine::DatagramTransport (engine/datagram_transport.h), not an engine::Transport:
  // neither reliable nor ordered, so no engine that needs those may run on it, and
  // ConnectHostTransport does not make it.
  bool datagram = false;
  // One line for --help and docs.
  absl::string_view summary;
};

// Every registered kind, in a fixed order.
absl::Span<const TransportKind> TransportKinds();

// The kind named `name`; INVALID_ARGUMENT listing the registered names otherwise.
absl::StatusOr<TransportKind> FindTransportKind(absl::string_view name);

// "tcp or gloo": the names --transport accepts, for messages and --help.
std::string HostTransportNames();

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_TRANSPORT_REGISTRY_H_

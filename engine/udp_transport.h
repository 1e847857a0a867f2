// UdpTransport: engine::DatagramTransport over one UDP socket per rank (IPv4 or IPv6), the datagrams
// of engine/udp_datagram.h: MTU-sized, sent once, each authenticated with the job's key (or
// checksummed without one) and decodable on its own.
//
// Rendezvous through an engine::Store, like the TCP transport: each rank binds its socket, then
// publishes "<host:port> <nonce>" under "udp/<rank>" (a fresh random nonce per incarnation) and
// reads every rank's. Every rank derives the same connection id from all the published values
// (UdpConnectionId), so datagrams of another job, connection or incarnation, even on a reused
// port, are foreign. The socket is bound before it is published: a peer may send as soon as it
// has read the address, and what arrives waits in the socket's buffer until Receive.
//
// What this transport adds to the DatagramTransport contract:
//   - Send is one non-blocking sendmsg (header, payload and trailer gathered, no copy). A full
//     socket buffer (EAGAIN, ENOBUFS) is RESOURCE_EXHAUSTED and counted in send_dropped.
//   - Receive takes what is queued in batches (recvmmsg) and checks each datagram with
//     ParseDatagram, then the source's ReplayWindow, then the accepted tags. A datagram longer than
//     max_datagram_bytes (cut by the kernel) is malformed. A flood of undeliverable datagrams
//     cannot hold Receive past its deadline: it looks at the clock and at Abort between batches.
//   - Sequence numbers count per (source, destination) from 1; the replay window keeps the last
//     4096 of each source, so a datagram delayed behind 4096 later ones from its source is dropped
//     as replayed.
//   - Every rank must use the same max_datagram_bytes and key; a rank whose store value changes
//     after others read it (a restart) is foreign to them until the group re-forms.
#ifndef DQ_ENGINE_UDP_TRANSPORT_H_
#define DQ_ENGINE_UDP_TRANSPORT_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/hmac.h"
#include "engine/datagram_transport.h"
#include "engine/store.h"

namespace dynamiq::engine {

struct UdpTransportOptions {
  // Address this rank binds and advertises (an IP address or a name that resolves to one).
  std::string hostname = "127.0.0.1";
  // Bounds the rendezvous (store waits).
  absl::Duration timeout = absl::Seconds(30);
  // The job's key (engine/step_auth.h StepAuthenticator::KeyForJob): every datagram then carries
  // an HMAC under it. Without one, a checksum.
  std::optional<common::HmacSha256::Digest> key;
  // UDP payload bytes per datagram at most: header, payload and trailer. 0 picks what fits one
  // 1500-byte Ethernet frame unfragmented: 1472 over IPv4, 1452 over IPv6. At most 65507.
  size_t max_datagram_bytes = 0;
  // Socket receive and send buffers asked for. The kernel grants what it allows (SO_RCVBUFFORCE
  // where the process may, else up to net.core.rmem_max / wmem_max); UdpTransport tells what it got.
  // 16 MiB holds what a 1 Gbit/s link delivers in 130 ms (a collective's step on a long link)
  // without the kernel dropping datagrams that Receive has not taken yet.
  int socket_buffer_bytes = 16 << 20;
};

class UdpTransport : public DatagramTransport {
 public:
  // The connection id all ranks derived (engine/udp_datagram.h).
  virtual uint64_t connection_id() const = 0;
  // "host:port" of this rank's socket, as published.
  virtual std::string local_address() const = 0;
  // The socket buffers the kernel granted (getsockopt: Linux reports twice what is usable).
  virtual int receive_buffer_bytes() const = 0;
  virtual int send_buffer_bytes() const = 0;
};

// Binds, publishes and reads the group's addresses as above. Every rank must call it with the same
// store (give every group and epoch its own PrefixStore), size and options but its own rank.
// INVALID_ARGUMENT for a bad rank, size or max_datagram_bytes, or a peer's published value that
// does not parse or is of another address family; DEADLINE_EXCEEDED when a rank did not publish
// within the timeout; UNAVAILABLE for socket errors.
absl::StatusOr<std::unique_ptr<UdpTransport>> ConnectUdpTransport(Store& store, int rank, int size,
                                                                  const UdpTransportOptions& options);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_UDP_TRANSPORT_H_

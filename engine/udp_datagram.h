// The UDP transport's datagram (engine/udp_transport.h) without any socket: its wire format, how it
// is sealed and parsed, the replay window and the connection id, so that tests and the fuzz harness
// (tests/fuzz/udp_datagram_fuzzer.cc) drive exactly what the transport runs.
//
// A datagram, every one decodable on its own (little-endian):
//    0  magic "DQDG"                     u32
//    4  version (1)                      u8
//    5  flags: bit 0 keyed, others 0     u8
//    6  reserved (0)                     u16
//    8  connection id                    u64   this rendezvous's (UdpConnectionId)
//   16  source rank                      u32
//   20  destination rank                 u32
//   24  tag                              u64
//   32  sequence (from 1)                u64   per source and destination, for the replay window
//   40  payload bytes                    u32
//   44  payload
//   44 + payload: trailer, 16 bytes over everything before it. When the job has a key (flags bit
//       0): HMAC-SHA256 truncated to 128 bits under the connection's key, HMAC(job key, "dynamiq
//       udp datagram v1" 0x00 connection id). Without: the 64-bit PayloadChecksum
//       (kernels/payload_checksum.h) of header and payload, then 8 zero bytes: it catches
//       corruption, not forgery. The same size either way, so the payload limit does not depend on
//       the key.
// The MAC covers the connection id, both ranks and the sequence, so a datagram captured on one
// link cannot be replayed onto another link, connection or job, and the replay window refuses it
// on its own link.
//
// Thread-safe: DatagramKey is immutable after construction; a ReplayWindow belongs to one thread.
#ifndef DQ_ENGINE_UDP_DATAGRAM_H_
#define DQ_ENGINE_UDP_DATAGRAM_H_

#include <stddef.h>
#include <stdint.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "common/hmac.h"

namespace dynamiq::engine {

inline constexpr uint32_t kDatagramMagic = 0x47445144;  // "DQDG"
inline constexpr uint8_t kDatagramVersion = 1;
inline constexpr uint8_t kDatagramFlagKeyed = 1;
inline constexpr size_t kDatagramHeaderBytes = 44;
inline constexpr size_t kDatagramTrailerBytes = 16;
inline constexpr size_t kDatagramOverheadBytes = kDatagramHeaderBytes + kDatagramTrailerBytes;

using DatagramHeaderBytes = std::array<uint8_t, kDatagramHeaderBytes>;
using DatagramTrailer = std::array<uint8_t, kDatagramTrailerBytes>;

struct DatagramHeader {
  bool keyed = false;
  uint64_t connection = 0;
  uint32_t source = 0;
  uint32_t destination = 0;
  uint64_t tag = 0;
  uint64_t sequence = 0;
  uint32_t payload_bytes = 0;
};

DatagramHeaderBytes EncodeDatagramHeader(const DatagramHeader& header);

// The key of one connection, from the job's key (engine/step_auth.h KeyForJob) or, without one,
// the public checksum key.
class DatagramKey {
 public:
  DatagramKey(uint64_t connection, const std::optional<common::HmacSha256::Digest>& job_key);
  DatagramKey(const DatagramKey&) = delete;
  DatagramKey& operator=(const DatagramKey&) = delete;

  uint64_t connection() const { return connection_; }
  bool keyed() const { return hmac_ != nullptr; }
  // The trailer of a datagram whose header and payload are these.
  DatagramTrailer Trailer(absl::Span<const uint8_t> header, absl::Span<const uint8_t> payload) const;

 private:
  const uint64_t connection_;
  const std::unique_ptr<const common::HmacSha256> hmac_;  // null without a key: the checksum
};

// The whole datagram from `source` to `destination` (header, payload, trailer); the header's
// connection and keyed flag are the key's.
std::vector<uint8_t> SealDatagram(const DatagramKey& key, uint32_t source, uint32_t destination, uint64_t tag,
                                  uint64_t sequence, absl::Span<const uint8_t> payload);

// Why a datagram is not delivered (DatagramCounters' reasons), or kAccepted. Replays are the
// ReplayWindow's to tell, after the datagram is authentic.
enum class DatagramVerdict { kAccepted, kMalformed, kUnauthenticated, kForeign, kStray };

struct ParsedDatagram {
  DatagramVerdict verdict = DatagramVerdict::kMalformed;
  DatagramHeader header;              // meaningful when accepted
  absl::Span<const uint8_t> payload;  // within the parsed bytes, when accepted
};

// Checks `datagram` as rank `receiver` of a group of `size` expecting `key`'s connection and payloads
// of at most `max_payload` bytes, in this order: malformed (shorter than a header and trailer,
// bad magic, version, flags, reserved bits or sequence 0, a payload length that disagrees with the
// datagram's or exceeds max_payload), foreign (another connection id), stray (a source outside the
// group or the receiver itself, or another destination), unauthenticated (a keyed flag that is not
// the key's, or a wrong trailer; compared in constant time). Never reads outside `datagram`.
ParsedDatagram ParseDatagram(absl::Span<const uint8_t> datagram, const DatagramKey& key, uint32_t receiver,
                             uint32_t size, size_t max_payload);

// The sequence numbers of one sender already delivered: the highest and the kWindow - 1 below it.
class ReplayWindow {
 public:
  static constexpr uint64_t kWindow = 4096;
  // True, and remembered, when `sequence` (>= 1) was not delivered before and is not too old to
  // tell (at least highest - kWindow + 1); false otherwise.
  bool Accept(uint64_t sequence);
  uint64_t highest() const { return highest_; }

 private:
  bool Test(uint64_t s) const { return (bits_[(s % kWindow) / 64] >> (s % 64)) & 1; }
  void Set(uint64_t s) { bits_[(s % kWindow) / 64] |= uint64_t{1} << (s % 64); }
  void Clear(uint64_t s) { bits_[(s % kWindow) / 64] &= ~(uint64_t{1} << (s % 64)); }

  uint64_t highest_ = 0;
  std::array<uint64_t, kWindow / 64> bits_{};
};

// The connection id every rank derives from what all ranks published at the rendezvous (by rank):
// the first 8 bytes of a hash over them, so another rendezvous (job, connection, or a rank's new
// incarnation, which publishes a fresh nonce) gives another id.
uint64_t UdpConnectionId(absl::Span<const std::string> published);

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_UDP_DATAGRAM_H_

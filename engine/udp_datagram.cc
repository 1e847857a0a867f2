#include "engine/udp_datagram.h"

#include <openssl/crypto.h>

#include <cstring>

#include "common/little_endian.h"
#include "kernels/payload_checksum.h"

namespace dynamiq::engine {
namespace {

std::array<uint8_t, 8> U64(uint64_t v) {
  std::array<uint8_t, 8> b;
  common::PutLe(b.data(), v);
  return b;
}

std::unique_ptr<common::HmacSha256> ConnectionKey(uint64_t connection,
                                                  const std::optional<common::HmacSha256::Digest>& job_key) {
  if (!job_key) return nullptr;
  static constexpr char kLabel[] = "dynamiq udp datagram v1";  // with its terminating 0x00
  const auto id = U64(connection);
  return std::make_unique<common::HmacSha256>(
      common::HmacSha256(*job_key).Mac({common::AsBytes(absl::string_view(kLabel, sizeof(kLabel))), id}));
}

}  // namespace

DatagramHeaderBytes EncodeDatagramHeader(const DatagramHeader& h) {
  DatagramHeaderBytes b{};
  common::PutLe<uint32_t>(&b[0], kDatagramMagic);
  b[4] = kDatagramVersion;
  b[5] = h.keyed ? kDatagramFlagKeyed : 0;
  common::PutLe<uint16_t>(&b[6], 0);
  common::PutLe<uint64_t>(&b[8], h.connection);
  common::PutLe<uint32_t>(&b[16], h.source);
  common::PutLe<uint32_t>(&b[20], h.destination);
  common::PutLe<uint64_t>(&b[24], h.tag);
  common::PutLe<uint64_t>(&b[32], h.sequence);
  common::PutLe<uint32_t>(&b[40], h.payload_bytes);
  return b;
}

DatagramKey::DatagramKey(uint64_t connection, const std::optional<common::HmacSha256::Digest>& job_key)
    : connection_(connection), hmac_(ConnectionKey(connection, job_key)) {}

DatagramTrailer DatagramKey::Trailer(absl::Span<const uint8_t> header, absl::Span<const uint8_t> payload) const {
  DatagramTrailer t{};
  if (hmac_ == nullptr) {
    common::PutLe<uint64_t>(t.data(), kernels::PayloadChecksum(header, payload));
    return t;
  }
  const common::HmacSha256::Digest mac = hmac_->Mac({header, payload});
  std::memcpy(t.data(), mac.data(), t.size());
  return t;
}

std::vector<uint8_t> SealDatagram(const DatagramKey& key, uint32_t source, uint32_t destination, uint64_t tag,
                                  uint64_t sequence, absl::Span<const uint8_t> payload) {
  DatagramHeader h;
  h.keyed = key.keyed();
  h.connection = key.connection();
  h.source = source;
  h.destination = destination;
  h.tag = tag;
  h.sequence = sequence;
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  const DatagramHeaderBytes header = EncodeDatagramHeader(h);
  const DatagramTrailer trailer = key.Trailer(header, payload);
  std::vector<uint8_t> out;
  out.reserve(kDatagramOverheadBytes + payload.size());
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), payload.begin(), payload.end());
  out.insert(out.end(), trailer.begin(), trailer.end());
  return out;
}

ParsedDatagram ParseDatagram(absl::Span<const uint8_t> datagram, const DatagramKey& key, uint32_t receiver,
                             uint32_t size, size_t max_payload) {
  ParsedDatagram out;
  out.verdict = DatagramVerdict::kMalformed;
  if (datagram.size() < kDatagramOverheadBytes) return out;
  const uint8_t* p = datagram.data();
  const uint8_t flags = p[5];
  if (common::GetLe<uint32_t>(p) != kDatagramMagic || p[4] != kDatagramVersion || (flags & ~kDatagramFlagKeyed) != 0 ||
      common::GetLe<uint16_t>(p + 6) != 0) {
    return out;
  }
  DatagramHeader h;
  h.keyed = (flags & kDatagramFlagKeyed) != 0;
  h.connection = common::GetLe<uint64_t>(p + 8);
  h.source = common::GetLe<uint32_t>(p + 16);
  h.destination = common::GetLe<uint32_t>(p + 20);
  h.tag = common::GetLe<uint64_t>(p + 24);
  h.sequence = common::GetLe<uint64_t>(p + 32);
  h.payload_bytes = common::GetLe<uint32_t>(p + 40);
  const size_t payload_bytes = datagram.size() - kDatagramOverheadBytes;
  if (h.sequence == 0 || h.payload_bytes != payload_bytes || payload_bytes > max_payload) return out;
  if (h.connection != key.connection()) {
    out.verdict = DatagramVerdict::kForeign;
    return out;
  }
  if (h.source >= size || h.source == receiver || h.destination != receiver) {
    out.verdict = DatagramVerdict::kStray;
    return out;
  }
  const absl::Span<const uint8_t> payload = datagram.subspan(kDatagramHeaderBytes, payload_bytes);
  const DatagramTrailer expected = key.Trailer(datagram.subspan(0, kDatagramHeaderBytes), payload);
  if (h.keyed != key.keyed() ||
      CRYPTO_memcmp(expected.data(), p + kDatagramHeaderBytes + payload_bytes, kDatagramTrailerBytes) != 0) {
    out.verdict = DatagramVerdict::kUnauthenticated;
    return out;
  }
  out.verdict = DatagramVerdict::kAccepted;
  out.header = h;
  out.payload = payload;
  return out;
}

bool ReplayWindow::Accept(uint64_t sequence) {
  if (sequence == 0) return false;
  if (sequence > highest_) {
    // Forget what slides out: the slots the new highest and those below it reuse.
    if (sequence - highest_ >= kWindow) {
      bits_.fill(0);
    } else {
      for (uint64_t s = highest_ + 1; s < sequence; ++s) Clear(s);
    }
    highest_ = sequence;
    Clear(sequence);
  } else if (highest_ - sequence >= kWindow) {
    return false;  // too old to tell
  }
  if (Test(sequence)) return false;
  Set(sequence);
  return true;
}

uint64_t UdpConnectionId(absl::Span<const std::string> published) {
  const common::HmacSha256 hash("dynamiq udp connection id v1");
  // Length-prefixed, so no two lists hash the same concatenation.
  std::vector<uint8_t> all;
  for (const std::string& value : published) {
    const auto n = U64(value.size());
    all.insert(all.end(), n.begin(), n.end());
    all.insert(all.end(), value.begin(), value.end());
  }
  const common::HmacSha256::Digest d = hash.Mac({all});
  return common::GetLe<uint64_t>(d.data());
}

}  // namespace dynamiq::engine

#include "engine/udp_transport.h"

#include <errno.h>
#include <netdb.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "engine/transport_registry.h"
#include "engine/udp_datagram.h"

namespace dynamiq::engine {
namespace {

constexpr size_t kIpv4Datagram = 1472;  // 1500 - 20 (IPv4) - 8 (UDP)
constexpr size_t kIpv6Datagram = 1452;  // 1500 - 40 (IPv6) - 8 (UDP)
constexpr size_t kMaxDatagram = 65507;  // the most UDP over IPv4 carries
constexpr int kBatch = 32;              // datagrams per recvmmsg

struct Peer {
  sockaddr_storage address{};
  socklen_t length = 0;
};

// The largest buffer the kernel grants: forced past net.core.*mem_max where the process may
// (CAP_NET_ADMIN), else the plain option, which the kernel caps there.
int GrowBuffer(int fd, int force_option, int option, int bytes) {
  if (setsockopt(fd, SOL_SOCKET, force_option, &bytes, sizeof(bytes)) != 0) {
    setsockopt(fd, SOL_SOCKET, option, &bytes, sizeof(bytes));
  }
  int got = 0;
  socklen_t len = sizeof(got);
  getsockopt(fd, SOL_SOCKET, option, &got, &len);
  return got;
}

// Resolves `host`:`port` for a datagram socket; numeric only for peers' published addresses.
absl::StatusOr<common::AddrInfoPtr> ResolveDatagram(const std::string& host, const std::string& port, bool numeric) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV | (numeric ? AI_NUMERICHOST : 0);
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &result);
  if (rc != 0 || result == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("udp transport: cannot resolve ", host, ":", port, ": ", gai_strerror(rc)));
  }
  return common::AddrInfoPtr(result);
}

std::string RandomNonce() {
  uint8_t n[8];
  // OpenSSL's generator never fails once seeded from the kernel; never proceed without one.
  if (RAND_bytes(n, sizeof(n)) != 1) std::abort();
  return common::HexEncode(n);
}

class UdpTransportImpl final : public UdpTransport {
 public:
  UdpTransportImpl(int rank, int size, int socket, int wake, std::vector<Peer> peers, uint64_t connection,
                   const std::optional<common::HmacSha256::Digest>& key, size_t max_datagram, std::string local)
      : rank_(rank),
        size_(size),
        socket_(socket),
        wake_(wake),
        peers_(std::move(peers)),
        key_(connection, key),
        max_datagram_(max_datagram),
        max_payload_(max_datagram - kDatagramOverheadBytes),
        local_(std::move(local)),
        capabilities_{FindTransportKind("udp")->capabilities, max_payload_},
        next_sequence_(new std::atomic<uint64_t>[size]),
        windows_(size),
        storage_(kBatch * max_datagram) {
    for (int q = 0; q < size; ++q) next_sequence_[q].store(1, std::memory_order_relaxed);
    for (int i = 0; i < kBatch; ++i) {
      iov_[i] = {storage_.data() + i * max_datagram_, max_datagram_};
      std::memset(&messages_[i], 0, sizeof(messages_[i]));
      messages_[i].msg_hdr.msg_iov = &iov_[i];
      messages_[i].msg_hdr.msg_iovlen = 1;
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  DatagramCapabilities capabilities() const override { return capabilities_; }
  uint64_t connection_id() const override { return key_.connection(); }
  std::string local_address() const override { return local_; }
  int receive_buffer_bytes() const override { return BufferBytes(SO_RCVBUF); }
  int send_buffer_bytes() const override { return BufferBytes(SO_SNDBUF); }

  absl::Status Send(int peer, uint64_t tag, absl::Span<const uint8_t> payload) override {
    if (peer < 0 || peer >= size_ || peer == rank_) {
      return absl::InvalidArgumentError(absl::StrCat("udp transport rank ", rank_, ": cannot send to rank ", peer,
                                                     peer == rank_ ? " (itself)" : absl::StrCat(" of ", size_)));
    }
    if (payload.size() > max_payload_) {
      return absl::InvalidArgumentError(absl::StrCat("udp transport: a payload of ", payload.size(),
                                                     " bytes exceeds the ", max_payload_, " a datagram carries"));
    }
    if (aborted_.load(std::memory_order_acquire)) return Aborted();
    DatagramHeader h;
    h.keyed = key_.keyed();
    h.connection = key_.connection();
    h.source = static_cast<uint32_t>(rank_);
    h.destination = static_cast<uint32_t>(peer);
    h.tag = tag;
    h.sequence = next_sequence_[peer].fetch_add(1, std::memory_order_relaxed);
    h.payload_bytes = static_cast<uint32_t>(payload.size());
    DatagramHeaderBytes header = EncodeDatagramHeader(h);
    DatagramTrailer trailer = key_.Trailer(header, payload);
    iovec parts[3] = {{header.data(), header.size()},
                      {const_cast<uint8_t*>(payload.data()), payload.size()},
                      {trailer.data(), trailer.size()}};
    msghdr m = {};
    m.msg_name = const_cast<sockaddr_storage*>(&peers_[peer].address);
    m.msg_namelen = peers_[peer].length;
    m.msg_iov = parts;
    m.msg_iovlen = 3;
    ssize_t n;
    do {
      n = sendmsg(socket_.fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n >= 0) {
      sent_.fetch_add(1, std::memory_order_relaxed);
      return absl::OkStatus();
    }
    const int err = errno;
    send_dropped_.fetch_add(1, std::memory_order_relaxed);
    const std::string what = absl::StrCat("udp transport: a datagram to rank ", peer, " was not sent");
    if (err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS) {
      return common::ErrnoStatus(absl::StatusCode::kResourceExhausted, what, err);
    }
    return common::ErrnoStatus(absl::StatusCode::kUnavailable, what, err);
  }

  absl::StatusOr<ReceivedDatagram> Receive(absl::Span<uint8_t> buffer, absl::Time deadline) override {
    if (buffer.size() < max_payload_) {
      return absl::InvalidArgumentError(absl::StrCat("udp transport: a receive buffer of ", buffer.size(),
                                                     " bytes, less than the ", max_payload_, " a datagram carries"));
    }
    for (bool first = true;; first = false) {
      if (aborted_.load(std::memory_order_acquire)) return Aborted();
      while (next_ < count_) {
        const int i = next_++;
        std::optional<ReceivedDatagram> got = Deliver(messages_[i], buffer);
        if (got) return *got;
      }
      // Between batches: a flood of undeliverable datagrams must not hold us past the deadline.
      if (!first && absl::Now() >= deadline) return Timeout(deadline);
      const int n = recvmmsg(socket_.fd, messages_, kBatch, MSG_DONTWAIT, nullptr);
      if (n > 0) {
        next_ = 0;
        count_ = n;
        continue;
      }
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        // Pending socket errors (ICMP from an earlier send) are consumed by the failed call; go on.
        if (errno != ECONNREFUSED && errno != EHOSTUNREACH && errno != ENETUNREACH) {
          return common::ErrnoStatus(absl::StatusCode::kUnavailable, "udp transport: recvmmsg", errno);
        }
        continue;
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return Timeout(deadline);
      pollfd fds[2] = {{socket_.fd, POLLIN, 0}, {wake_.fd, POLLIN, 0}};
      const int ms = static_cast<int>(
          std::min<int64_t>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), 1 << 30));
      if (poll(fds, 2, ms) < 0 && errno != EINTR) {
        return common::ErrnoStatus(absl::StatusCode::kUnavailable, "udp transport: poll", errno);
      }
    }
  }

  void AcceptTags(uint64_t lowest, uint64_t highest) override {
    lowest_tag_ = lowest;
    highest_tag_ = highest;
  }

  void Abort() override {
    if (aborted_.exchange(true, std::memory_order_acq_rel)) return;
    const uint64_t one = 1;
    // The eventfd only wakes a poll; a failed write (its counter full) still leaves it readable.
    [[maybe_unused]] ssize_t n = write(wake_.fd, &one, sizeof(one));
  }

  DatagramCounters counters() const override {
    DatagramCounters c;
    c.sent = sent_.load(std::memory_order_relaxed);
    c.send_dropped = send_dropped_.load(std::memory_order_relaxed);
    c.received = received_.load(std::memory_order_relaxed);
    c.malformed = malformed_.load(std::memory_order_relaxed);
    c.unauthenticated = unauthenticated_.load(std::memory_order_relaxed);
    c.foreign = foreign_.load(std::memory_order_relaxed);
    c.replayed = replayed_.load(std::memory_order_relaxed);
    c.stray = stray_.load(std::memory_order_relaxed);
    return c;
  }

 private:
  static void Count(std::atomic<uint64_t>& counter) { counter.fetch_add(1, std::memory_order_relaxed); }

  absl::Status Aborted() const { return absl::AbortedError(absl::StrCat("udp transport rank ", rank_, ": aborted")); }
  absl::Status Timeout(absl::Time deadline) const {
    return absl::DeadlineExceededError(
        absl::StrCat("udp transport rank ", rank_, ": no datagram by the deadline (", absl::FormatTime(deadline), ")"));
  }

  int BufferBytes(int option) const {
    int got = 0;
    socklen_t len = sizeof(got);
    getsockopt(socket_.fd, SOL_SOCKET, option, &got, &len);
    return got;
  }

  // The received datagram `m` delivered into `buffer`, or nothing (dropped and counted).
  std::optional<ReceivedDatagram> Deliver(const mmsghdr& m, absl::Span<uint8_t> buffer) {
    if (m.msg_hdr.msg_flags & MSG_TRUNC) {  // longer than any datagram of ours
      Count(malformed_);
      return std::nullopt;
    }
    const absl::Span<const uint8_t> bytes(static_cast<const uint8_t*>(m.msg_hdr.msg_iov->iov_base), m.msg_len);
    const ParsedDatagram parsed =
        ParseDatagram(bytes, key_, static_cast<uint32_t>(rank_), static_cast<uint32_t>(size_), max_payload_);
    switch (parsed.verdict) {
      case DatagramVerdict::kAccepted:
        break;
      case DatagramVerdict::kMalformed:
        Count(malformed_);
        return std::nullopt;
      case DatagramVerdict::kUnauthenticated:
        Count(unauthenticated_);
        return std::nullopt;
      case DatagramVerdict::kForeign:
        Count(foreign_);
        return std::nullopt;
      case DatagramVerdict::kStray:
        Count(stray_);
        return std::nullopt;
    }
    const DatagramHeader& h = parsed.header;
    if (!windows_[h.source].Accept(h.sequence)) {
      Count(replayed_);
      return std::nullopt;
    }
    if (h.tag < lowest_tag_ || h.tag > highest_tag_) {
      Count(stray_);
      return std::nullopt;
    }
    std::memcpy(buffer.data(), parsed.payload.data(), parsed.payload.size());
    Count(received_);
    return ReceivedDatagram{static_cast<int>(h.source), h.tag, parsed.payload.size()};
  }

  const int rank_, size_;
  common::UniqueFd socket_;
  common::UniqueFd wake_;  // an eventfd Abort writes, to wake a pending poll
  const std::vector<Peer> peers_;
  const DatagramKey key_;
  const size_t max_datagram_, max_payload_;
  const std::string local_;
  const DatagramCapabilities capabilities_;
  std::atomic<bool> aborted_{false};
  std::unique_ptr<std::atomic<uint64_t>[]> next_sequence_;  // by destination
  std::atomic<uint64_t> sent_{0}, send_dropped_{0}, received_{0}, malformed_{0}, unauthenticated_{0}, foreign_{0},
      replayed_{0}, stray_{0};

  // The receiving thread's: replay windows by source, accepted tags, the batch being delivered.
  std::vector<ReplayWindow> windows_;
  uint64_t lowest_tag_ = 0, highest_tag_ = ~uint64_t{0};
  std::vector<uint8_t> storage_;
  iovec iov_[kBatch];
  mmsghdr messages_[kBatch];
  int next_ = 0, count_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<UdpTransport>> ConnectUdpTransport(Store& store, int rank, int size,
                                                                  const UdpTransportOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("udp transport: rank ", rank, " of a group of ", size));
  }
  if (options.hostname.empty()) return absl::InvalidArgumentError("udp transport: no hostname to bind");
  const size_t configured = options.max_datagram_bytes;
  if (configured != 0 && (configured <= kDatagramOverheadBytes || configured > kMaxDatagram)) {
    return absl::InvalidArgumentError(absl::StrCat("udp transport: max_datagram_bytes ", configured, " is not in (",
                                                   kDatagramOverheadBytes, ", ", kMaxDatagram, "]"));
  }
  const absl::Time deadline = absl::Now() + options.timeout;

  DQ_ASSIGN_OR_RETURN(const common::AddrInfoPtr local, ResolveDatagram(options.hostname, "0", false));
  common::UniqueFd socket_fd;
  int family = AF_UNSPEC;
  int last_error = 0;
  for (const addrinfo* ai = local.get(); ai != nullptr; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = errno;
      continue;
    }
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      socket_fd.fd = fd;
      family = ai->ai_family;
      break;
    }
    last_error = errno;
    common::CloseFd(fd);
  }
  if (socket_fd.fd < 0) {
    return common::ErrnoStatus(absl::StatusCode::kUnavailable,
                               absl::StrCat("udp transport: cannot bind ", options.hostname), last_error);
  }
  GrowBuffer(socket_fd.fd, SO_RCVBUFFORCE, SO_RCVBUF, options.socket_buffer_bytes);
  GrowBuffer(socket_fd.fd, SO_SNDBUFFORCE, SO_SNDBUF, options.socket_buffer_bytes);
  common::UniqueFd wake(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake.fd < 0) return common::ErrnoStatus(absl::StatusCode::kUnavailable, "udp transport: eventfd", errno);
  const size_t max_datagram = configured != 0 ? configured : (family == AF_INET6 ? kIpv6Datagram : kIpv4Datagram);

  sockaddr_storage bound{};
  socklen_t bound_length = sizeof(bound);
  if (getsockname(socket_fd.fd, reinterpret_cast<sockaddr*>(&bound), &bound_length) != 0) {
    return common::ErrnoStatus(absl::StatusCode::kUnavailable, "udp transport: getsockname", errno);
  }
  const std::string address = common::SockaddrString(bound);
  DQ_RETURN_IF_ERROR(store.Set(absl::StrCat("udp/", rank), absl::StrCat(address, " ", RandomNonce())));

  std::vector<std::string> published(size);
  std::vector<Peer> peers(size);
  for (int q = 0; q < size; ++q) {
    DQ_ASSIGN_OR_RETURN(published[q],
                        store.Get(absl::StrCat("udp/", q), std::max(absl::ZeroDuration(), deadline - absl::Now())));
    const std::vector<std::string> fields = absl::StrSplit(published[q], ' ');
    absl::StatusOr<std::pair<std::string, std::string>> host_port =
        fields.size() == 2 && fields[1].size() == 16 ? common::SplitHostPort(fields[0])
                                                     : absl::InvalidArgumentError("not '<host:port> <nonce>'");
    if (!host_port.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("udp transport: rank ", q, " published '", published[q], "': ", host_port.status().message()));
    }
    DQ_ASSIGN_OR_RETURN(const common::AddrInfoPtr resolved,
                        ResolveDatagram(host_port->first, host_port->second, /*numeric=*/true));
    if (resolved->ai_family != family) {
      return absl::InvalidArgumentError(absl::StrCat("udp transport: rank ", q, "'s address ", fields[0],
                                                     " is of another address family than this rank's ", address));
    }
    std::memcpy(&peers[q].address, resolved->ai_addr, resolved->ai_addrlen);
    peers[q].length = resolved->ai_addrlen;
  }
  const uint64_t connection = UdpConnectionId(published);
  return std::unique_ptr<UdpTransport>(new UdpTransportImpl(rank, size, std::exchange(socket_fd.fd, -1),
                                                            std::exchange(wake.fd, -1), std::move(peers), connection,
                                                            options.key, max_datagram, address));
}

}  // namespace dynamiq::engine

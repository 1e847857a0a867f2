#include "tools/linkem/delay_line.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"

namespace dynamiq::linkem {
namespace {

// The largest frame a device hands over with its virtio-net header (a 64 KiB GSO frame and then
// some); longer ones are dropped and counted as send errors.
constexpr size_t kMaxFrame = 256 << 10;
// Frames taken from one socket before the others get their turn.
constexpr int kReceiveBatch = 64;
constexpr size_t kEntryHeader = 16;  // release time (ns), length, padding

int64_t NowNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

size_t Round8(size_t n) { return (n + 7) & ~size_t{7}; }

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat("delay line: ", what, ": ", std::strerror(errno)));
}

}  // namespace

// One direction: its settings, its FIFO (a ring of [release ns, length, frame] entries) and counters.
struct DelayLine::Direction {
  int in = -1, out = -1;  // sockets (owned by DelayLine::fds_)
  DirectionSettings settings;
  std::mt19937_64 random;
  std::normal_distribution<double> jitter{0.0, 1.0};
  std::vector<uint8_t> ring;
  size_t head = 0, tail = 0, used = 0;  // bytes, wrap waste included
  int64_t last_release = 0;
  DirectionStats stats;

  bool empty() const { return used == 0; }

  // The next release time of a frame that arrived at `now`: never before the previous one.
  int64_t ReleaseAt(int64_t now) {
    double ns = absl::ToDoubleNanoseconds(settings.delay);
    if (settings.jitter > absl::ZeroDuration()) ns += jitter(random) * absl::ToDoubleNanoseconds(settings.jitter);
    last_release = std::max(last_release, now + static_cast<int64_t>(std::max(0.0, ns)));
    return last_release;
  }

  // Copies a frame in; false when it does not fit.
  bool Push(const uint8_t* frame, size_t len, int64_t release) {
    const size_t need = kEntryHeader + Round8(len);
    if (used + need > ring.size()) return false;
    if (tail >= head || empty()) {
      if (ring.size() - tail < need) {  // wrap: the end of the ring stays unused until head passes it
        if (head < need && !empty()) return false;
        if (used + (ring.size() - tail) + need > ring.size()) return false;
        if (empty()) head = 0;
        MarkWrap(tail);
        used += ring.size() - tail;
        tail = 0;
      }
    } else if (head - tail < need) {
      return false;
    }
    uint8_t* at = ring.data() + tail;
    const uint32_t length = static_cast<uint32_t>(len);
    std::memcpy(at, &release, 8);
    std::memcpy(at + 8, &length, 4);
    std::memcpy(at + kEntryHeader, frame, len);
    tail += need;
    if (tail == ring.size()) tail = 0;
    used += need;
    stats.max_queued_bytes = std::max(stats.max_queued_bytes, used);
    return true;
  }

  // The oldest frame: its release time, bytes and length (call only when not empty).
  void Front(int64_t* release, const uint8_t** frame, size_t* len) {
    SkipWrap();
    const uint8_t* at = ring.data() + head;
    uint32_t length;
    std::memcpy(release, at, 8);
    std::memcpy(&length, at + 8, 4);
    *frame = at + kEntryHeader;
    *len = length;
  }
  void Pop() {
    SkipWrap();
    uint32_t length;
    std::memcpy(&length, ring.data() + head + 8, 4);
    const size_t size = kEntryHeader + Round8(length);
    head += size;
    used -= size;
    if (head == ring.size()) head = 0;
    if (used == 0) head = tail = 0;
  }

 private:
  static constexpr uint32_t kWrap = 0xffffffffu;
  void MarkWrap(size_t at) {
    if (ring.size() - at >= kEntryHeader) std::memcpy(ring.data() + at + 8, &kWrap, 4);
  }
  void SkipWrap() {
    uint32_t length = 0;
    if (ring.size() - head >= kEntryHeader) std::memcpy(&length, ring.data() + head + 8, 4);
    if (ring.size() - head < kEntryHeader || length == kWrap) {
      used -= ring.size() - head;
      head = 0;
    }
  }
};

absl::StatusOr<std::unique_ptr<DelayLine>> DelayLine::Open(const DelayLineOptions& options) {
  if (options.pairs.empty()) return absl::InvalidArgumentError("delay line: no device pairs");
  std::unique_ptr<DelayLine> line(new DelayLine());
  std::set<std::string> seen;
  auto open = [&](const std::string& device) -> absl::StatusOr<int> {
    if (!seen.insert(device).second) {
      return absl::InvalidArgumentError(absl::StrCat("delay line: device ", device, " named twice"));
    }
    const int ifindex = static_cast<int>(if_nametoindex(device.c_str()));
    if (ifindex == 0) return absl::InvalidArgumentError(absl::StrCat("delay line: no device '", device, "' here"));
    const int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL));
    if (fd < 0) return Errno("socket(AF_PACKET) (needs root)");
    line->fds_.push_back(fd);
    const int one = 1, buffer = 16 << 20;
    // Frames keep their offload state (GSO, checksum) across the line; our own sends are not
    // received back; a large buffer absorbs bursts while the thread sends.
    if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof(one)) != 0) return Errno("PACKET_VNET_HDR");
    if (setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof(one)) != 0) {
      return Errno("PACKET_IGNORE_OUTGOING");
    }
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buffer, sizeof(buffer)) != 0) {
      setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
    }
    sockaddr_ll address{};
    address.sll_family = AF_PACKET;
    address.sll_protocol = htons(ETH_P_ALL);
    address.sll_ifindex = ifindex;
    if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      return Errno(absl::StrCat("bind to ", device));
    }
    packet_mreq promiscuous{};
    promiscuous.mr_ifindex = ifindex;
    promiscuous.mr_type = PACKET_MR_PROMISC;
    if (setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &promiscuous, sizeof(promiscuous)) != 0) {
      return Errno(absl::StrCat("promiscuous mode on ", device));
    }
    return fd;
  };
  std::mt19937_64 seeds(options.seed);
  auto direction = [&](int in, int out, const std::string& from, const std::string& to, DirectionSettings s) {
    auto d = std::make_unique<Direction>();
    d->in = in;
    d->out = out;
    d->settings = s;
    d->random.seed(seeds());
    d->ring.resize(std::max<size_t>(Round8(options.queue_bytes), 2 * (kEntryHeader + kMaxFrame)));
    d->stats.from = from;
    d->stats.to = to;
    line->directions_.push_back(std::move(d));
  };
  for (const DevicePair& p : options.pairs) {
    if (p.a_to_b.delay < absl::ZeroDuration() || p.b_to_a.delay < absl::ZeroDuration() ||
        p.a_to_b.jitter < absl::ZeroDuration() || p.b_to_a.jitter < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("delay line: a negative delay or jitter between ", p.a, " and ", p.b));
    }
    absl::StatusOr<int> a = open(p.a);
    if (!a.ok()) return a.status();
    absl::StatusOr<int> b = open(p.b);
    if (!b.ok()) return b.status();
    direction(*a, *b, p.a, p.b, p.a_to_b);
    direction(*b, *a, p.b, p.a, p.b_to_a);
  }
  return line;
}

DelayLine::~DelayLine() {
  for (int fd : fds_) close(fd);
}

absl::Status DelayLine::Run(const std::atomic<bool>& stop) {
  std::vector<uint8_t> staging(kMaxFrame);
  // Direction by receiving socket (pairs give each device exactly one outgoing direction).
  std::vector<Direction*> by_fd_index(fds_.size());
  for (auto& d : directions_) {
    for (size_t i = 0; i < fds_.size(); ++i) {
      if (fds_[i] == d->in) by_fd_index[i] = d.get();
    }
  }
  std::vector<pollfd> polls(fds_.size());
  for (size_t i = 0; i < fds_.size(); ++i) polls[i] = {fds_[i], POLLIN, 0};
  while (!stop.load(std::memory_order_relaxed)) {
    // 1. Send what is due; find when the next frame is.
    int64_t now = NowNs();
    int64_t next = now + 100'000'000;  // wake at least every 100 ms to see `stop`
    for (auto& d : directions_) {
      while (!d->empty()) {
        int64_t release;
        const uint8_t* frame;
        size_t len;
        d->Front(&release, &frame, &len);
        if (release > now) {
          next = std::min(next, release);
          break;
        }
        if (send(d->out, frame, len, MSG_DONTWAIT) < 0) {
          if (errno == EAGAIN || errno == ENOBUFS) {  // the device is busy: again shortly
            next = std::min(next, now + 20'000);
            break;
          }
          ++d->stats.send_errors;
        } else {
          ++d->stats.frames;
          d->stats.bytes += len;
        }
        d->Pop();
      }
    }
    // 2. Wait for frames or the next release.
    const int64_t wait = std::max<int64_t>(0, next - NowNs());
    const timespec timeout{static_cast<time_t>(wait / 1000000000), static_cast<long>(wait % 1000000000)};
    const int ready = ppoll(polls.data(), polls.size(), &timeout, nullptr);
    if (ready < 0) {
      if (errno == EINTR) continue;
      return Errno("ppoll");
    }
    if (ready == 0) continue;
    // 3. Take what arrived, stamped with its release time.
    now = NowNs();
    for (size_t i = 0; i < polls.size(); ++i) {
      if (polls[i].revents == 0) continue;
      Direction& d = *by_fd_index[i];
      for (int k = 0; k < kReceiveBatch; ++k) {
        const ssize_t n = recv(polls[i].fd, staging.data(), staging.size(), MSG_DONTWAIT | MSG_TRUNC);
        if (n < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
          return Errno(absl::StrCat("receiving from ", d.stats.from));
        }
        if (static_cast<size_t>(n) > staging.size()) {
          ++d.stats.send_errors;
          continue;
        }
        if (!d.Push(staging.data(), static_cast<size_t>(n), d.ReleaseAt(now))) ++d.stats.dropped_full;
      }
    }
  }
  return absl::OkStatus();
}

std::vector<DelayLine::DirectionStats> DelayLine::stats() const {
  std::vector<DirectionStats> out;
  for (const auto& d : directions_) out.push_back(d->stats);
  return out;
}

}  // namespace dynamiq::linkem

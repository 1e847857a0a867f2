#include "engine/tcp_hello.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/little_endian.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"

namespace dynamiq::engine {
namespace {

constexpr uint32_t kPlainMagic = 0x31544344;  // "DCT1"
constexpr uint32_t kKeyedMagic = 0x32544344;  // "DCT2"
constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = common::HmacSha256::kBytes;
constexpr size_t kPrefixBytes = 8;                               // magic, rank
constexpr size_t kKeyedHelloBytes = kPrefixBytes + kNonceBytes;  // ... and the connector's nonce
constexpr size_t kChallengeBytes = kNonceBytes + kMacBytes;      // acceptor's nonce and proof

using Nonce = std::array<uint8_t, kNonceBytes>;
using Digest = common::HmacSha256::Digest;

std::array<uint8_t, 4> U32(uint32_t v) {
  std::array<uint8_t, 4> b;
  common::PutLe<uint32_t>(b.data(), v);
  return b;
}

std::unique_ptr<common::HmacSha256> HelloKey(const Digest& job_key) {
  const Digest h = common::HmacSha256(job_key).Mac("dynamiq tcp hello v1");
  return std::make_unique<common::HmacSha256>(h);
}

// What `role` ("acceptor", "connector", "session") proves or derives for the connection between
// lower rank r and higher rank q.
Digest HelloMac(const common::HmacSha256& h, absl::string_view role, int first, int second, const Nonce& nonce_q,
                const Nonce& nonce_r) {
  const auto a = U32(static_cast<uint32_t>(first)), b = U32(static_cast<uint32_t>(second));
  return h.Mac({common::AsBytes(role), a, b, nonce_q, nonce_r});
}

std::shared_ptr<const common::HmacSha256> SessionKey(const common::HmacSha256& h, int r, int q, const Nonce& nonce_q,
                                                     const Nonce& nonce_r) {
  return std::make_shared<const common::HmacSha256>(HelloMac(h, "session", r, q, nonce_q, nonce_r));
}

bool SameMac(const uint8_t* a, const Digest& b) { return CRYPTO_memcmp(a, b.data(), kMacBytes) == 0; }

Nonce RandomNonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    // OpenSSL's generator never fails once seeded from the kernel; never proceed without one.
    std::abort();
  }
  return n;
}

absl::string_view AsView(const uint8_t* p, size_t n) { return {reinterpret_cast<const char*>(p), n}; }

}  // namespace

Digest GaveUpMac(const common::HmacSha256& session, int sender, int receiver, absl::string_view reason) {
  const auto s = U32(static_cast<uint32_t>(sender)), r = U32(static_cast<uint32_t>(receiver));
  return session.Mac({common::AsBytes("gave up"), s, r, common::AsBytes(reason)});
}

absl::StatusOr<TcpLink> DialPeer(const std::string& host, const std::string& port, int rank, int peer,
                                 const std::optional<Digest>& key, absl::Time deadline) {
  DQ_ASSIGN_OR_RETURN(const int connected, common::ConnectWithRetry(host, port, deadline, absl::StrCat("rank ", peer)));
  TcpLink link{peer, connected, nullptr};
  auto close_on_error = [&link](absl::Status s) {
    common::CloseFd(link.fd);
    return s;
  };
  const std::string who = absl::StrCat("tcp transport: hello to rank ", peer, " at ", host, ":", port);
  uint8_t hello[kKeyedHelloBytes];
  common::PutLe<uint32_t>(hello, key ? kKeyedMagic : kPlainMagic);
  common::PutLe<uint32_t>(hello + 4, static_cast<uint32_t>(rank));
  if (!key) {
    absl::Status sent = common::WriteFull(link.fd, AsView(hello, kPrefixBytes), deadline, who);
    if (!sent.ok()) return close_on_error(sent);
    return link;
  }
  const Nonce mine = RandomNonce();
  std::memcpy(hello + kPrefixBytes, mine.data(), kNonceBytes);
  absl::Status sent = common::WriteFull(link.fd, AsView(hello, kKeyedHelloBytes), deadline, who);
  if (!sent.ok()) return close_on_error(sent);
  uint8_t challenge[kChallengeBytes];
  absl::Status read = common::ReadFull(link.fd, reinterpret_cast<char*>(challenge), kChallengeBytes, deadline, who);
  if (!read.ok()) {
    if (absl::IsDeadlineExceeded(read)) return close_on_error(read);
    return close_on_error(absl::UnavailableError(
        absl::StrCat(who,
                     ": closed during the hello (does it run with the same --cluster_secret_file? or another "
                     "process already holds rank ",
                     rank, "'s place): ", read.message())));
  }
  Nonce theirs;
  std::memcpy(theirs.data(), challenge, kNonceBytes);
  const auto h = HelloKey(*key);
  if (!SameMac(challenge + kNonceBytes, HelloMac(*h, "acceptor", peer, rank, mine, theirs))) {
    return close_on_error(absl::UnauthenticatedError(
        absl::StrCat(who,
                     ": its proof of the job's key is wrong (a different --cluster_secret_file, or not a "
                     "dynamiqd of this cluster)")));
  }
  const Digest proof = HelloMac(*h, "connector", rank, peer, mine, theirs);
  sent = common::WriteFull(link.fd, AsView(proof.data(), kMacBytes), deadline, who);
  if (!sent.ok()) return close_on_error(sent);
  link.session = SessionKey(*h, peer, rank, mine, theirs);
  return link;
}

// One connection in its hello.
struct HelloAcceptor::Pending {
  int fd = -1;
  std::string from;
  absl::Time deadline;
  uint8_t buffer[std::max(kKeyedHelloBytes, kMacBytes)];  // the hello, then the proof
  size_t have = 0;
  size_t need = kPrefixBytes;
  bool challenged = false;  // keyed: the challenge went out; `buffer` now collects the proof
  int rank = -1;
  Nonce nonce_q{}, nonce_r{};
};

HelloAcceptor::HelloAcceptor(int listener, int rank, int size, std::optional<Digest> key, absl::Duration hello_timeout,
                             std::vector<bool> wanted)
    : listener_(listener),
      rank_(rank),
      size_(size),
      hello_(key ? HelloKey(*key) : nullptr),
      hello_timeout_(hello_timeout),
      wanted_(std::move(wanted)),
      links_(size),
      missing_(0) {
  if (wanted_.size() != static_cast<size_t>(size)) wanted_.assign(size, true);
  for (int q = rank + 1; q < size; ++q) missing_ += wanted_[q] ? 1 : 0;
}

HelloAcceptor::~HelloAcceptor() {
  for (auto& p : pending_) common::CloseFd(p->fd);
  for (TcpLink& link : links_) common::CloseFd(link.fd);
}

void HelloAcceptor::TurnAway(Pending& p, const std::string& why) {
  ++turned_away_;
  last_turned_away_ = absl::StrCat(p.from, ": ", why);
  common::CloseFd(p.fd);
  p.fd = -1;
}

void HelloAcceptor::AcceptNew() {
  // Everything queued now, but never more than a full table per round.
  for (size_t i = 0; i < kMaxPendingHellos; ++i) {
    const int fd = accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    if (pending_.size() >= kMaxPendingHellos) {
      TurnAway(*pending_.front(), "dropped for a newer connection (too many hellos at once)");
      pending_.erase(pending_.begin());
    }
    auto p = std::make_unique<Pending>();
    p->fd = fd;
    p->from = common::PeerName(fd);
    p->deadline = absl::Now() + hello_timeout_;
    pending_.push_back(std::move(p));
  }
}

void HelloAcceptor::Advance(Pending& p) {
  while (true) {
    const ssize_t n = recv(p.fd, p.buffer + p.have, p.need - p.have, 0);
    if (n == 0) {
      TurnAway(p, "closed during its hello");
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      TurnAway(p, absl::StrCat("hello failed: ", std::strerror(errno)));
      return;
    }
    p.have += static_cast<size_t>(n);
    if (p.have < p.need) continue;
    if (p.challenged) {  // the connector's proof
      if (!SameMac(p.buffer, HelloMac(*hello_, "connector", p.rank, rank_, p.nonce_q, p.nonce_r))) {
        TurnAway(p, absl::StrCat("claimed rank ", p.rank, " without proof of the job's key"));
        return;
      }
      break;
    }
    if (p.need == kPrefixBytes) {
      const uint32_t magic = common::GetLe<uint32_t>(p.buffer);
      const int64_t q = common::GetLe<uint32_t>(p.buffer + 4);
      if (magic != (hello_ ? kKeyedMagic : kPlainMagic)) {
        TurnAway(p, magic == kKeyedMagic || magic == kPlainMagic
                        ? (hello_ ? "an unauthenticated hello (it has no cluster secret)"
                                  : "an authenticated hello (it has a cluster secret, this node none)")
                        : "not a dynamiq hello");
        return;
      }
      if (q <= rank_ || q >= size_ || !wanted_[q] || links_[q].fd >= 0) {
        TurnAway(p, absl::StrCat("claimed rank ", q, ", which is not a free higher rank of ", size_));
        return;
      }
      p.rank = static_cast<int>(q);
      if (!hello_) break;
      p.need = kKeyedHelloBytes;
      continue;
    }
    // The keyed hello's nonce: answer with ours and our proof, then wait for theirs.
    std::memcpy(p.nonce_q.data(), p.buffer + kPrefixBytes, kNonceBytes);
    p.nonce_r = RandomNonce();
    uint8_t challenge[kChallengeBytes];
    std::memcpy(challenge, p.nonce_r.data(), kNonceBytes);
    const Digest proof = HelloMac(*hello_, "acceptor", rank_, p.rank, p.nonce_q, p.nonce_r);
    std::memcpy(challenge + kNonceBytes, proof.data(), kMacBytes);
    // A fresh connection's send buffer takes 48 bytes at once.
    if (send(p.fd, challenge, kChallengeBytes, MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(kChallengeBytes)) {
      TurnAway(p, "could not send the challenge");
      return;
    }
    p.challenged = true;
    p.have = 0;
    p.need = kMacBytes;
  }
  // Introduced. The first to complete holds the rank.
  if (links_[p.rank].fd >= 0) {
    TurnAway(p, absl::StrCat("claimed rank ", p.rank, ", which another connection holds"));
    return;
  }
  links_[p.rank] = TcpLink{p.rank, p.fd, hello_ ? SessionKey(*hello_, rank_, p.rank, p.nonce_q, p.nonce_r) : nullptr};
  p.fd = -1;
  --missing_;
}

absl::StatusOr<std::vector<TcpLink>> HelloAcceptor::AcceptAll(absl::Time deadline, absl::Duration timeout_for_message,
                                                              const std::function<absl::Status()>& interrupted) {
  absl::Time next_check = absl::Now() + kInterruptPoll;
  while (missing_ > 0) {
    const absl::Time now = absl::Now();
    if (interrupted && now >= next_check) {
      DQ_RETURN_IF_ERROR(interrupted());
      next_check = now + kInterruptPoll;
    }
    // Hellos past their own deadline go.
    for (auto& p : pending_) {
      if (p->deadline <= now) TurnAway(*p, "said too little within the hello's deadline");
    }
    std::erase_if(pending_, [](const auto& p) { return p->fd < 0; });
    if (now >= deadline) {
      std::string away;
      if (turned_away_ > 0) {
        away = absl::StrCat(" (", turned_away_, " connection(s) turned away; the last: ", last_turned_away_, ")");
      }
      return absl::DeadlineExceededError(absl::StrCat("tcp transport rank ", rank_, ": ", missing_,
                                                      " higher rank(s) did not connect within ",
                                                      absl::FormatDuration(timeout_for_message), away));
    }
    absl::Time wake = interrupted ? std::min(deadline, next_check) : deadline;
    std::vector<pollfd> fds = {{listener_, POLLIN, 0}};
    for (const auto& p : pending_) {
      fds.push_back({p->fd, POLLIN, 0});
      wake = std::min(wake, p->deadline);
    }
    const int ms = static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - now) + 1, 0, 1000));
    const int ready = poll(fds.data(), fds.size(), ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      return common::ErrnoStatus(absl::StatusCode::kUnavailable, "tcp transport: poll", errno);
    }
    // Pending hellos first (their fds match fds[1..] only until AcceptNew adds more).
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0 && pending_[i - 1]->fd >= 0) Advance(*pending_[i - 1]);
    }
    std::erase_if(pending_, [](const auto& p) { return p->fd < 0; });
    if (fds[0].revents & POLLIN) AcceptNew();
  }
  std::vector<TcpLink> links = std::move(links_);
  links_.assign(size_, TcpLink{});
  return links;
}

}  // namespace dynamiq::engine

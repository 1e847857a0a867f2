// A connection's reader and writer, and what they do to the view it serves (engine/tcp_mesh.h,
// tcp_mesh_impl.h).
#include "engine/tcp_mesh_impl.h"

#include <openssl/crypto.h>
#include <sys/socket.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/little_endian.h"
#include "common/safe_text.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "engine/tcp_hello.h"

namespace dynamiq::engine {

using tcp_frame::Parts;
using tcp_mesh_internal::Early;
using tcp_mesh_internal::EarlyPtr;
using tcp_mesh_internal::kEarlyMessageCost;
using tcp_mesh_internal::kGaveUpMacBytes;
using tcp_mesh_internal::kMaxGaveUpReason;
using tcp_mesh_internal::kMaxGaveUpsAhead;
using tcp_mesh_internal::Link;
using tcp_mesh_internal::Op;
using tcp_mesh_internal::Outgoing;
using tcp_mesh_internal::Session;
using tcp_mesh_internal::View;

namespace {

absl::Status ReadExactly(int fd, uint8_t* out, size_t size, int node) {
  return common::ReadFull(fd, reinterpret_cast<char*>(out), size, absl::InfiniteFuture(),
                          absl::StrCat("reading from node ", node));
}

}  // namespace

void TcpMesh::Impl::BreakLink(Link& l, const absl::Status& why) {
  if (!l.status.ok()) return;
  l.status = absl::UnavailableError(absl::StrCat("connection to node ", l.node, " lost: ", why.message()));
  shutdown(l.fd, SHUT_RDWR);
  if (l.view != nullptr) {
    LostPeer(*l.view, l.index,
             absl::UnavailableError(
                 absl::StrCat(l.view->Who(), ": connection to rank ", l.index, " lost: ", why.message())));
  }
}

void TcpMesh::Impl::FailView(View& v, absl::Status status, Link& culprit) {
  if (v.failed.ok()) v.failed = status;
  BreakLink(culprit, status);
  if (!keep_) {
    for (Link* l : v.links) {
      if (l != nullptr) BreakLink(*l, status);
    }
  }
}

bool TcpMesh::Impl::Fits(const Link& l, size_t size) const {
  const size_t left = options_.max_early_bytes - early_bytes_;
  return size <= left && left - size >= kEarlyMessageCost && l.early_messages < options_.max_early_messages;
}

tcp_mesh_internal::EarlyPtr TcpMesh::Impl::Charge(Link& l, size_t size) {
  early_bytes_ += size + kEarlyMessageCost;
  ++l.early_messages;
  return std::make_shared<Early>(size);
}

void TcpMesh::Impl::Refund(Link& l, size_t size) {
  early_bytes_ -= size + kEarlyMessageCost;
  --l.early_messages;
}

void TcpMesh::Impl::DeliverEarly(Link& l, uint64_t tag) {
  if (l.view == nullptr) return;
  auto e = l.early.find(tag);
  auto r = l.recvs.find(tag);
  while (e != l.early.end() && !e->second.empty() && e->second.front()->complete && r != l.recvs.end() &&
         !r->second.empty()) {
    const EarlyPtr m = e->second.front();
    Op* op = r->second.front();
    if (m->bytes.size() > op->size) {
      return FailView(*l.view,
                      absl::InvalidArgumentError(absl::StrCat(l.view->Who(), ": a message of ", m->bytes.size(),
                                                              " bytes from rank ", l.index, " (tag ", tag,
                                                              ") for a receive of ", op->size, " bytes")),
                      l);
    }
    tcp_frame::Scatter(m->bytes, op->parts);
    Refund(l, m->bytes.size());
    op->done = true;
    e->second.pop_front();
    r->second.pop_front();
  }
  if (e != l.early.end() && e->second.empty()) l.early.erase(e);
  if (r != l.recvs.end() && r->second.empty()) l.recvs.erase(r);
}

tcp_frame::Parts TcpMesh::Impl::FenceParts(Session s, uint8_t (&bytes)[tcp_frame::kFenceBytes]) {
  common::PutLe<uint64_t>(bytes, s.epoch);
  common::PutLe<uint64_t>(bytes + 8, s.sequence);
  return {absl::MakeSpan(bytes)};
}

void TcpMesh::Impl::ReadLoop(Link& l) {
  uint8_t frame[tcp_frame::kFrameBytes];
  std::vector<uint8_t> scratch;
  while (true) {
    if (absl::Status read = ReadExactly(l.fd, frame, sizeof(frame), l.node); !read.ok()) {
      absl::MutexLock lock(&mu_);
      return BreakLink(l, read);
    }
    const uint64_t tag = common::GetLe<uint64_t>(frame), size = common::GetLe<uint64_t>(frame + 8);
    if (tag == tcp_frame::kGaveUpTag) {
      absl::StatusOr<std::string> why = ReadGaveUp(l, size);
      absl::MutexLock lock(&mu_);
      if (!why.ok()) return BreakLink(l, why.status());
      if (!keep_) return BreakLink(l, absl::UnavailableError(absl::StrCat("rank ", l.index, " gave up: ", *why)));
      const Session f = l.peer_session;
      if (l.view != nullptr && f == l.view->session()) {
        LostPeer(*l.view, l.index,
                 absl::UnavailableError(absl::StrCat(l.view->Who(), ": rank ", l.index, " gave up: ", *why)));
      } else if (f > l.floor) {
        l.gave_up_ahead[f] = *std::move(why);
        if (l.gave_up_ahead.size() > kMaxGaveUpsAhead) l.gave_up_ahead.erase(l.gave_up_ahead.begin());
      }
      continue;
    }
    if (tag == tcp_frame::kFenceTag) {
      uint8_t bytes[tcp_frame::kFenceBytes];
      absl::Status read = size == sizeof(bytes)
                              ? ReadExactly(l.fd, bytes, sizeof(bytes), l.node)
                              : absl::InvalidArgumentError(absl::StrCat("a fence frame of ", size, " bytes"));
      absl::MutexLock lock(&mu_);
      if (!read.ok()) return BreakLink(l, read);
      const Session s{common::GetLe<uint64_t>(bytes), common::GetLe<uint64_t>(bytes + 8)};
      if (s < l.peer_session) return BreakLink(l, absl::InvalidArgumentError("a fence back to an earlier session"));
      l.peer_session = s;
      continue;
    }
    enum class Where { kPosted, kEarly, kAhead, kDrop };
    Op* op = nullptr;
    EarlyPtr early;
    {
      absl::MutexLock lock(&mu_);
      // Straight into a posted receive of the view when nothing of this tag is waiting before it;
      // otherwise kept, as long as the early bytes fit (else the peer waits for the receive to be
      // posted); a later session's message kept for its view; an earlier session's dropped.
      auto where = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (l.view != nullptr && l.peer_session == l.view->session()) {
          if (!l.view->failed.ok()) return Where::kDrop;
          auto r = l.recvs.find(tag);
          return r != l.recvs.end() && !r->second.empty() && l.early.count(tag) == 0 ? Where::kPosted : Where::kEarly;
        }
        return l.peer_session > l.floor ? Where::kAhead : Where::kDrop;
      };
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (closing_ || !l.status.ok()) return true;
        const Where w = where();
        return w == Where::kPosted || w == Where::kDrop || Fits(l, size);
      };
      mu_.Await(absl::Condition(&ready));
      if (closing_ || !l.status.ok()) return;
      switch (where()) {
        case Where::kPosted: {
          auto r = l.recvs.find(tag);
          op = r->second.front();
          if (size > op->size) {
            return FailView(*l.view,
                            absl::InvalidArgumentError(absl::StrCat(l.view->Who(), ": a message of ", size,
                                                                    " bytes from rank ", l.index, " (tag ", tag,
                                                                    ") for a receive of ", op->size, " bytes")),
                            l);
          }
          r->second.pop_front();
          if (r->second.empty()) l.recvs.erase(r);
          l.reading_op = op;
          break;
        }
        case Where::kEarly:
          early = Charge(l, size);
          l.early[tag].push_back(early);
          break;
        case Where::kAhead:
          early = Charge(l, size);
          l.ahead[l.peer_session].emplace_back(tag, early);
          break;
        case Where::kDrop:
          break;
      }
    }
    absl::Status read;
    if (op != nullptr) {
      size_t left = size;
      for (absl::Span<uint8_t> part : op->parts) {
        const size_t n = std::min(part.size(), left);
        if (n > 0 && !(read = ReadExactly(l.fd, part.data(), n, l.node)).ok()) break;
        left -= n;
      }
    } else if (early != nullptr) {
      read = ReadExactly(l.fd, early->bytes.data(), size, l.node);
    } else {
      scratch.resize(std::min<size_t>(size, size_t{64} << 10));
      for (uint64_t left = size; left > 0 && read.ok();) {
        const size_t n = std::min<uint64_t>(left, scratch.size());
        read = ReadExactly(l.fd, scratch.data(), n, l.node);
        left -= n;
      }
    }
    absl::MutexLock lock(&mu_);
    l.reading_op = nullptr;
    if (!read.ok()) return BreakLink(l, read);
    if (op != nullptr) {
      op->done = true;
    } else if (early != nullptr) {
      early->complete = true;
      DeliverEarly(l, tag);
    }
  }
}

void TcpMesh::Impl::WriteLoop(Link& l) {
  while (true) {
    Outgoing out;
    {
      absl::MutexLock lock(&mu_);
      // A send of a view that is aborting or failed waits (Abort flushes or drops it).
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (closing_ || !l.status.ok()) return true;
        if (l.sends.empty()) return false;
        const Op* op = l.sends.front().op;
        return op == nullptr || (!op->view->aborting && op->view->failed.ok());
      };
      mu_.Await(absl::Condition(&ready));
      if (closing_ || !l.status.ok()) return;
      out = l.sends.front();
      l.writing = true;
      l.writing_op = out.op;
    }
    uint8_t fence[tcp_frame::kFenceBytes];
    const bool ok = out.op != nullptr ? tcp_frame::Write(l.fd, out.op->tag, out.op->parts)
                                      : tcp_frame::Write(l.fd, tcp_frame::kFenceTag, FenceParts(out.fence, fence));
    const int error = errno;
    absl::MutexLock lock(&mu_);
    l.writing = false;
    l.writing_op = nullptr;
    if (!ok) {
      return BreakLink(
          l, common::ErrnoStatus(absl::StatusCode::kUnavailable, absl::StrCat("writing to node ", l.node), error));
    }
    l.sends.pop_front();
    if (out.op != nullptr) out.op->done = true;
  }
}

// Reads the rest of a "gave up" frame of `size` bytes: why the peer gave up, made safe to log and
// store (common/safe_text.h). On a keyed connection a frame without its sender's MAC is refused.
absl::StatusOr<std::string> TcpMesh::Impl::ReadGaveUp(Link& l, uint64_t size) {
  const size_t mac_bytes = l.session_key != nullptr ? kGaveUpMacBytes : 0;
  if (size > kMaxGaveUpReason + mac_bytes || size < mac_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a \"gave up\" frame of ", size, " bytes"));
  }
  std::string frame(size, '\0');
  DQ_RETURN_IF_ERROR(ReadExactly(l.fd, reinterpret_cast<uint8_t*>(frame.data()), frame.size(), l.node));
  const absl::string_view reason = absl::string_view(frame).substr(0, size - mac_bytes);
  if (l.session_key != nullptr) {
    const common::HmacSha256::Digest mac = GaveUpMac(*l.session_key, l.node, node_, reason);
    if (CRYPTO_memcmp(mac.data(), frame.data() + reason.size(), mac.size()) != 0) {
      return absl::UnauthenticatedError("a \"gave up\" frame without its sender's MAC");
    }
  }
  return common::SafeText(reason);
}

}  // namespace dynamiq::engine

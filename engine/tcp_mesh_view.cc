// A view's operations, its abort and detach (engine/tcp_mesh.h, tcp_mesh_impl.h).
#include "engine/tcp_mesh_impl.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "engine/tcp_hello.h"

namespace dynamiq::engine {

using tcp_frame::Parts;
using tcp_mesh_internal::EarlyPtr;
using tcp_mesh_internal::kAbortFlushBytes;
using tcp_mesh_internal::kAbortWait;
using tcp_mesh_internal::kMaxGaveUpReason;
using tcp_mesh_internal::Link;
using tcp_mesh_internal::Op;
using tcp_mesh_internal::Outgoing;
using tcp_mesh_internal::View;

namespace tcp_mesh_internal {

View::~View() { mesh_->Abort(*this); }

absl::StatusOr<Transport::Handle> View::PostSendParts(int peer, uint64_t tag,
                                                      absl::Span<const absl::Span<const uint8_t>> parts) {
  Parts writable;  // never written: sends only read their parts
  for (absl::Span<const uint8_t> part : parts) writable.emplace_back(const_cast<uint8_t*>(part.data()), part.size());
  return mesh_->Post(*this, true, peer, tag, std::move(writable));
}

absl::StatusOr<Transport::Handle> View::PostRecvParts(int peer, uint64_t tag,
                                                      absl::Span<const absl::Span<uint8_t>> parts) {
  return mesh_->Post(*this, false, peer, tag, Parts(parts.begin(), parts.end()));
}

absl::Status View::Wait(Handle handle, absl::Time deadline) { return mesh_->Wait(*this, handle, deadline); }

void View::Abort() { mesh_->Abort(*this); }

}  // namespace tcp_mesh_internal

absl::StatusOr<Transport::Handle> TcpMesh::Impl::Post(View& v, bool send, int peer, uint64_t tag, Parts parts) {
  if (peer < 0 || peer >= v.size() || peer == v.rank()) {
    return absl::InvalidArgumentError(absl::StrCat(v.Who(), ": no peer ", peer, " in a group of ", v.size()));
  }
  if (send && (tag == tcp_frame::kGaveUpTag || tag == tcp_frame::kFenceTag)) {
    return absl::InvalidArgumentError(absl::StrCat(v.Who(), ": tag ", tag, " is reserved"));
  }
  absl::MutexLock lock(&mu_);
  DQ_RETURN_IF_ERROR(v.failed);
  // A peer already lost fails the operation at its Wait, not here: what the peer sent before it
  // left (a bad header, say: the first error) is still delivered, and the caller that waits for
  // it first reports that, whatever order it posted in.
  const Transport::Handle h = v.next++;
  Op& op = *(v.ops[h] = std::make_unique<Op>(Op{&v, send, peer, tag, std::move(parts)}));
  Link& l = *v.links[peer];
  if (send) {
    l.sends.push_back({&op, {}});
  } else {
    l.recvs[tag].push_back(&op);
    DeliverEarly(l, tag);
  }
  return h;
}

absl::Status TcpMesh::Impl::Wait(View& v, Transport::Handle handle, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto it = v.ops.find(handle);
  if (it == v.ops.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(v.Who(), ": Wait on unknown handle ", handle, " (never posted or already waited)"));
  }
  Op* op = it->second.get();
  // A send the writer is still inside completes, or fails, there: the peer may have read it,
  // finished its part of the collective and left in the moment before the writer marks it done.
  auto finished = [&v, op]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (op->done || !v.failed.ok()) return true;
    const Link* l = v.links[op->peer];
    return !v.peer_status[op->peer].ok() && !(op->send && l != nullptr && l->writing_op == op);
  };
  mu_.AwaitWithDeadline(absl::Condition(&finished), deadline);
  if (op->done) {
    v.ops.erase(it);
    return absl::OkStatus();
  }
  if (!v.failed.ok()) return v.failed;
  if (!v.peer_status[op->peer].ok()) return v.peer_status[op->peer];
  return absl::DeadlineExceededError(absl::StrCat(v.Who(), ": ", op->send ? "send to" : "receive from", " rank ",
                                                  op->peer, " (tag ", op->tag, ") did not complete in time"));
}

void TcpMesh::Impl::Abort(View& v) {
  absl::MutexLock lock(&mu_);
  if (v.detached) return;
  const absl::Time until = absl::Now() + kAbortWait;
  if (!v.told) {
    // Writers finish the message they are writing (briefly: a peer that reads nothing must not
    // hold Abort up) and start none of this view's. A second Abort meanwhile waits too; whichever
    // wakes first flushes and fails the view.
    v.aborting = true;
    auto quiet = [&v]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const Link* l : v.links) {
        if (l != nullptr && l->writing) return false;
      }
      return true;
    };
    mu_.AwaitWithDeadline(absl::Condition(&quiet), until);
  }
  if (!v.told) {
    // Also when the view failed on its own (a peer's message that did not fit its receive): the
    // other peers learn it from here, as they would from closed connections.
    v.told = true;
    const absl::Status cause = !v.first_loss.ok() ? v.first_loss
                               : !v.failed.ok()   ? v.failed
                                                  : absl::AbortedError(absl::StrCat(v.Who(), ": transport aborted"));
    const std::string why = std::string(cause.message().substr(0, kMaxGaveUpReason));
    for (Link* l : v.links) {
      if (l != nullptr && l->status.ok()) Flush(*l, v, why);
    }
    if (v.failed.ok()) v.failed = absl::AbortedError(absl::StrCat(v.Who(), ": transport aborted"));
  }
  if (!keep_) {
    for (Link* l : v.links) {
      if (l != nullptr) BreakLink(*l, v.failed);
    }
  }
  // Until every thread is out of the buffers the callers posted (they may free them next): one
  // still inside when the wait is over has its connection closed, which frees it.
  auto out = [&v]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Link* l : v.links) {
      if (l == nullptr) continue;
      if ((l->reading_op != nullptr && l->reading_op->view == &v) ||
          (l->writing_op != nullptr && l->writing_op->view == &v)) {
        return false;
      }
    }
    return true;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&out), until)) {
    for (Link* l : v.links) {
      if (l != nullptr && ((l->reading_op != nullptr && l->reading_op->view == &v) ||
                           (l->writing_op != nullptr && l->writing_op->view == &v))) {
        BreakLink(*l, absl::AbortedError("a message of an aborted exchange was still on the wire"));
      }
    }
    mu_.Await(absl::Condition(&out));
  }
  Detach(v);
}

void TcpMesh::Impl::Flush(Link& l, View& v, const std::string& why) {
  if (l.writing) return BreakLink(l, absl::AbortedError("aborted while writing"));
  size_t budget = kAbortFlushBytes;
  while (!l.sends.empty()) {
    const Outgoing out = l.sends.front();
    const size_t size = out.op != nullptr ? out.op->size : tcp_frame::kFenceBytes;
    if (size > budget) break;
    uint8_t fence[tcp_frame::kFenceBytes];
    const tcp_frame::WriteNowResult written =
        out.op != nullptr ? tcp_frame::WriteNow(l.fd, out.op->tag, out.op->parts)
                          : tcp_frame::WriteNow(l.fd, tcp_frame::kFenceTag, FenceParts(out.fence, fence));
    if (written != tcp_frame::WriteNowResult::kAll) {
      if (written == tcp_frame::WriteNowResult::kPart) return BreakLink(l, absl::AbortedError("aborted mid-message"));
      break;
    }
    budget -= size;
    l.sends.pop_front();
  }
  // What did not go is dropped (none of it started: the connection is still framed); a fence
  // still queued would have to go before the frame that says why.
  std::erase_if(l.sends, [&v](const Outgoing& o) { return o.op != nullptr && o.op->view == &v; });
  const bool fenced = std::none_of(l.sends.begin(), l.sends.end(), [](const Outgoing& o) { return o.op == nullptr; });
  std::string reason = why;
  if (l.session_key != nullptr) {
    const common::HmacSha256::Digest mac = GaveUpMac(*l.session_key, node_, l.node, why);
    reason.append(reinterpret_cast<const char*>(mac.data()), mac.size());
  }
  if (!fenced || tcp_frame::WriteNow(l.fd, tcp_frame::kGaveUpTag,
                                     {absl::MakeSpan(reinterpret_cast<uint8_t*>(reason.data()), reason.size())}) !=
                     tcp_frame::WriteNowResult::kAll) {
    BreakLink(l, absl::AbortedError("could not say why this rank gave up"));
  }
}

void TcpMesh::Impl::Detach(View& v) {
  if (v.detached) return;
  v.detached = true;
  for (Link*& l : v.links) {
    if (l != nullptr && l->view == &v) {
      std::erase_if(l->sends, [&v](const Outgoing& o) { return o.op != nullptr && o.op->view == &v; });
      l->recvs.clear();
      for (auto& [tag, kept] : l->early) {
        for (const EarlyPtr& e : kept) Refund(*l, e->bytes.size());
      }
      l->early.clear();
      l->view = nullptr;
    }
    l = nullptr;
  }
  if (attached_ == &v) attached_ = nullptr;
}

void TcpMesh::Impl::LostPeer(View& v, int q, absl::Status status) {
  if (!v.peer_status[q].ok()) return;
  if (v.first_loss.ok()) v.first_loss = status;
  v.peer_status[q] = std::move(status);
}

}  // namespace dynamiq::engine

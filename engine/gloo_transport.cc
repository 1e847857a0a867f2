#include "engine/gloo_transport.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <utility>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace dynamiq::engine {
namespace {

// Longest wait handed to Gloo (an InfiniteFuture deadline would overflow its clock arithmetic).
constexpr absl::Duration kMaxGlooWait = absl::Hours(24 * 30);

std::chrono::milliseconds ToGlooMillis(absl::Duration d) {
  d = std::clamp(d, absl::ZeroDuration(), kMaxGlooWait);
  // Round up: a wait must never end before the deadline it was given.
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(absl::Ceil(d, absl::Milliseconds(1))));
}

// Gloo writes to its sockets with writev(2), which raises SIGPIPE (killing the process by default)
// when the peer has gone. Rather than changing the process-wide disposition, SIGPIPE is blocked in
// every thread that may write through Gloo: Gloo's event-loop thread inherits the mask of the
// thread that creates the device, and user threads block it around each Gloo call. A SIGPIPE
// raised meanwhile is consumed before the mask is restored (the EPIPE itself surfaces as a Gloo
// exception).
class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&sigpipe_);
    sigaddset(&sigpipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &sigpipe_, &old_);
  }
  ~ScopedSigpipeBlock() {
    if (sigismember(&old_, SIGPIPE) == 1) return;  // Already blocked by the caller: leave it alone.
    sigset_t pending;
    sigemptyset(&pending);
    if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
      const timespec zero = {0, 0};
      while (sigtimedwait(&sigpipe_, nullptr, &zero) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t sigpipe_;
  sigset_t old_;
};

// Maps an exception Gloo threw to a Status: IoException is UNAVAILABLE, or DEADLINE_EXCEEDED when
// it reports a timeout; anything else (EnforceNotMet, InvalidOperationException, std::...) is
// INTERNAL.
absl::Status FromGlooException(const std::exception& e, absl::string_view context) {
  const std::string what = e.what();
  if (dynamic_cast<const gloo::IoException*>(&e) != nullptr) {
    if (absl::StrContains(what, "Timed out") || absl::StrContains(what, "timeout")) {
      return absl::DeadlineExceededError(absl::StrCat(context, ": ", what));
    }
    return absl::UnavailableError(absl::StrCat(context, ": ", what));
  }
  return absl::InternalError(absl::StrCat(context, ": ", what));
}

// gloo::rendezvous::Store over our Store. Gloo's rendezvous API reports errors by throwing, so a
// failing call throws gloo::IoException and remembers the Status for ConnectGlooTransport.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(engine::Store& store, absl::Duration timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_.Set(Key(key), absl::string_view(data.data(), data.size())));
  }

  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value = store_.Get(Key(key), timeout_);
    Check(value.status());
    return std::vector<char>(value->begin(), value->end());
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, std::chrono::milliseconds(0)); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> prefixed;
    prefixed.reserve(keys.size());
    for (const std::string& k : keys) prefixed.push_back(Key(k));
    // Gloo passes its context timeout (or nothing); never wait longer than ours.
    absl::Duration t = timeout > std::chrono::milliseconds(0) ? absl::FromChrono(timeout) : timeout_;
    Check(store_.Wait(prefixed, std::min(t, timeout_)));
  }

  const absl::Status& first_error() const { return first_error_; }

 private:
  static std::string Key(const std::string& key) { return absl::StrCat("gloo/", key); }

  void Check(const absl::Status& s) {
    if (s.ok()) return;
    if (first_error_.ok()) first_error_ = s;
    throw gloo::IoException(std::string(s.message()));
  }

  engine::Store& store_;
  const absl::Duration timeout_;
  absl::Status first_error_;
};

class GlooTransport final : public Transport {
 public:
  GlooTransport(int rank, int size, std::shared_ptr<gloo::rendezvous::Context> context)
      : rank_(rank), size_(size), context_(std::move(context)) {}

  ~GlooTransport() override {
    std::map<Handle, std::shared_ptr<Op>> ops;
    {
      absl::MutexLock lock(&mu_);
      aborted_ = true;
      ops.swap(ops_);
    }
    // Destroying an unbound buffer invalidates Gloo's references to it and waits until Gloo's
    // event loop no longer uses it, so no caller buffer is touched after this.
    ops.clear();
    // Soft close (the Pair destructors): bytes already handed to the kernel still reach the peers,
    // unless Abort or a failure closed the connections hard already.
    context_.reset();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "gloo_tcp"; }
  TransportCapabilities capabilities() const override {
    TransportCapabilities c;
    c.kind = "gloo";
    return c;
  }

  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override {
    return Post(/*send=*/true, peer, tag, const_cast<uint8_t*>(data.data()), data.size());
  }

  absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override {
    return Post(/*send=*/false, peer, tag, buffer.data(), buffer.size());
  }

  absl::Status Wait(Handle handle, absl::Time deadline) override {
    std::shared_ptr<Op> op;
    absl::Status early;
    {
      absl::MutexLock lock(&mu_);
      auto it = ops_.find(handle);
      if (it == ops_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(Who(), ": Wait on unknown handle ", handle, " (never posted or already waited)"));
      }
      op = it->second;
      if (aborted_) {
        early = absl::AbortedError(absl::StrCat(Who(), ": ", Describe(*op), " aborted"));
      } else if (!failure_.ok()) {
        early = Unusable(*op);
      }
      if (!early.ok()) ops_.erase(it);
    }
    if (!early.ok()) return early;  // `op` is destroyed here, outside the mutex.

    // Blocks without holding mu_, so Abort can reach the buffer meanwhile.
    const std::chrono::milliseconds timeout = ToGlooMillis(deadline - absl::Now());
    absl::Status status;
    try {
      bool completed = op->send ? op->buffer->waitSend(nullptr, timeout) : op->buffer->waitRecv(nullptr, timeout);
      if (!completed) status = absl::AbortedError(absl::StrCat(Who(), ": ", Describe(*op), " aborted"));
    } catch (const std::exception& e) {
      status = FromGlooException(e, absl::StrCat(Who(), ": ", Describe(*op)));
      if (absl::IsDeadlineExceeded(status)) {
        status = absl::DeadlineExceededError(
            absl::StrCat(Who(), ": ", Describe(*op), " did not complete within ", timeout.count(), "ms (peer ",
                         op->peer, " stalled or never posted the matching operation): ", e.what()));
      } else if (absl::IsUnavailable(status)) {
        status = absl::UnavailableError(
            absl::StrCat(Who(), ": ", Describe(*op), " failed, connection to peer ", op->peer, " lost: ", e.what()));
      }
    }
    bool failed_now = false;
    {
      absl::MutexLock lock(&mu_);
      ops_.erase(handle);
      if (!status.ok() && failure_.ok() && !aborted_) {
        failure_ = status;
        failed_now = true;
      }
    }
    if (failed_now) CloseConnections();
    return status;
  }

  void Abort() override {
    {
      absl::MutexLock lock(&mu_);
      aborted_ = true;
      // The abort flag of a Gloo buffer persists until a wait consumes it, so a Wait that is just
      // about to block returns at once too.
      for (auto& [handle, op] : ops_) {
        if (op->send) {
          op->buffer->abortWaitSend();
        } else {
          op->buffer->abortWaitRecv();
        }
      }
    }
    CloseConnections();
  }

 private:
  struct Op {
    bool send = false;
    int peer = -1;
    uint64_t tag = 0;
    size_t nbytes = 0;
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  };

  std::string Who() const { return absl::StrCat("gloo_tcp rank ", rank_); }

  static std::string Describe(const Op& op) {
    return absl::StrCat(op.send ? "send to" : "recv from", " peer ", op.peer, " (tag ", op.tag, ", ", op.nbytes,
                        " bytes)");
  }

  absl::Status Unusable(const Op& op) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return common::Annotate(failure_,
                            absl::StrCat(Who(), ": ", Describe(op), " not attempted, the transport already failed"));
  }

  absl::StatusOr<Handle> Post(bool send, int peer, uint64_t tag, uint8_t* data, size_t nbytes) {
    if (peer < 0 || peer >= size_ || peer == rank_) {
      return absl::InvalidArgumentError(
          absl::StrCat(Who(), ": invalid peer ", peer, " (group of ", size_, ", a rank cannot message itself)"));
    }
    auto op = std::make_shared<Op>();
    op->send = send;
    op->peer = peer;
    op->tag = tag;
    op->nbytes = nbytes;
    {
      absl::MutexLock lock(&mu_);
      if (aborted_) return absl::AbortedError(absl::StrCat(Who(), ": ", Describe(*op), " posted after Abort"));
      if (!failure_.ok()) return Unusable(*op);
    }
    // Gloo never dereferences the pointer of an empty transfer, but give it a valid one.
    void* ptr = nbytes > 0 ? static_cast<void*>(data) : static_cast<void*>(&zero_byte_);
    absl::Status status;
    try {
      ScopedSigpipeBlock no_sigpipe;
      op->buffer = context_->createUnboundBuffer(ptr, nbytes);
      if (send) {
        op->buffer->send(peer, tag, /*offset=*/0, nbytes);
      } else {
        op->buffer->recv(peer, tag, /*offset=*/0, nbytes);
      }
    } catch (const std::exception& e) {
      status = FromGlooException(e, absl::StrCat(Who(), ": posting ", Describe(*op)));
    }
    bool failed_now = false;
    Handle handle = 0;
    {
      absl::MutexLock lock(&mu_);
      if (!status.ok()) {
        if (failure_.ok() && !aborted_) {
          failure_ = status;
          failed_now = true;
        }
      } else {
        handle = next_handle_++;
        ops_.emplace(handle, op);
      }
    }
    if (failed_now) CloseConnections();
    if (!status.ok()) return status;
    return handle;
  }

  // Hard-closes every connection (RST), once: peers fail fast, and Gloo's event loop stops
  // touching posted buffers (a pair's close waits for the loop to leave that pair).
  void CloseConnections() {
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return;
      closed_ = true;
    }
    try {
      context_->closeConnections();
    } catch (const std::exception& e) {
      // Nothing to recover; the transport is unusable either way.
    }
  }

  const int rank_;
  const int size_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  uint8_t zero_byte_ = 0;

  absl::Mutex mu_;
  std::map<Handle, std::shared_ptr<Op>> ops_ ABSL_GUARDED_BY(mu_);
  Handle next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> ConnectGlooTransport(Store& store, int rank, int size,
                                                                const GlooTransportOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("gloo transport: invalid rank ", rank, " of ", size));
  }
  if (options.hostname.empty()) {
    return absl::InvalidArgumentError("gloo transport: options.hostname must be set (Gloo's default is unreliable)");
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("gloo transport: options.timeout must be positive");
  }
  const std::string who = absl::StrCat("gloo_tcp rank ", rank, " of ", size, " (", options.hostname, ")");
  StoreAdapter adapter(store, options.timeout);
  try {
    ScopedSigpipeBlock no_sigpipe;  // Also blocks SIGPIPE for good in Gloo's event-loop thread.
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(ToGlooMillis(options.timeout));
    context->connectFullMesh(adapter, device);
    // Gloo's connectFullMesh returns once this rank's pairs are up, while peers may still be
    // completing theirs; a rank that tore down right away would break them ("Connection closed by
    // peer" inside their connect). Return only when every rank is connected.
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(absl::StrCat("connected/", r));
    adapter.set(keys[rank], {'1'});
    adapter.wait(keys);
    return std::unique_ptr<Transport>(new GlooTransport(rank, size, std::move(context)));
  } catch (const std::exception& e) {
    if (!adapter.first_error().ok()) {
      const absl::Status& s = adapter.first_error();
      return common::Annotate(s, absl::StrCat(who, ": rendezvous failed"));
    }
    return FromGlooException(e, absl::StrCat(who, ": connecting the full mesh"));
  }
}

}  // namespace dynamiq::engine

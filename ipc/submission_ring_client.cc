#include "ipc/submission_ring_client.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/spin.h"
#include "common/status_macros.h"

namespace dynamiq::ipc {
namespace {

using ring::Atomic;

// How often a sleeping waiter wakes to check that the daemon still lives.
constexpr absl::Duration kHealthInterval = absl::Milliseconds(50);

}  // namespace

absl::StatusOr<std::unique_ptr<SubmissionRingClient>> SubmissionRingClient::Open(const std::string& shm_name,
                                                                                 size_t bytes) {
  DQ_ASSIGN_OR_RETURN(ShmRegion region, ShmRegion::Open(shm_name, bytes));
  auto bad = [&](std::string what) {
    return absl::FailedPreconditionError(absl::StrCat("submission ring ", shm_name, ": ", what));
  };
  if (region.size() < sizeof(ring::Header)) return bad(absl::StrCat(region.size(), " bytes hold no header"));
  const ring::Header& h = *reinterpret_cast<const ring::Header*>(region.data());
  const uint64_t magic = std::atomic_ref<uint64_t>(const_cast<uint64_t&>(h.magic)).load(std::memory_order_acquire);
  if (magic != ring::kMagic || h.version != ring::kVersion) {
    return bad(absl::StrCat("magic 0x", absl::Hex(magic), " version ", h.version, ", expected 0x",
                            absl::Hex(ring::kMagic), " version ", ring::kVersion,
                            " (a dynamiqd of another version? the client falls back to gRPC only when the "
                            "daemon does not offer a ring)"));
  }
  if (h.slots == 0 || h.slots > ring::kMaxSlots || h.num_nodes == 0 || h.num_nodes > ring::kMaxNodes) {
    return bad(absl::StrCat(h.slots, " slots for ", h.num_nodes, " nodes"));
  }
  const ring::Geometry geometry = ring::Geometry::Of(h.slots, h.num_nodes);
  if (h.slot_bytes != geometry.slot_bytes || geometry.total_bytes > region.size()) {
    return bad(absl::StrCat("slots of ", h.slot_bytes, " bytes (expected ", geometry.slot_bytes, "), ",
                            geometry.total_bytes, " bytes in all in an object of ", region.size()));
  }
  const int fd = shm_open(shm_name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("shm_open(", shm_name, ") for its lock"));
  // Mapped and locked: the name is no longer needed (and would outlive a crash of either side).
  (void)region.Unlink();
  return std::unique_ptr<SubmissionRingClient>(new SubmissionRingClient(std::move(region), fd, geometry));
}

SubmissionRingClient::SubmissionRingClient(ShmRegion region, int lock_fd, ring::Geometry geometry)
    : region_(std::move(region)), lock_fd_(lock_fd), geometry_(geometry) {
  for (uint32_t i = geometry_.slots; i > 0; --i) free_.push_back(i - 1);
  head_ = Atomic(header().sq_head).load(std::memory_order_relaxed);
}

SubmissionRingClient::~SubmissionRingClient() { close(lock_fd_); }

std::optional<uint32_t> SubmissionRingClient::Acquire() {
  absl::MutexLock lock(&mu_);
  if (free_.empty()) return std::nullopt;
  const uint32_t s = free_.back();
  free_.pop_back();
  return s;
}

void SubmissionRingClient::Submit(uint32_t index, const ring::RingRequest& r) {
  ring::Slot& s = slot(index);
  ring::SlotRequest& q = s.request;
  q.submission = r.submission;
  q.buffer_id = r.buffer_id;
  q.offset_bytes = r.offset_bytes;
  q.num_elements = r.num_elements;
  q.weight = r.weight.value_or(0);
  q.dtype = r.dtype;
  q.flags = (r.average ? ring::kAverage : 0) | (r.exact ? ring::kExact : 0) |
            (r.weight.has_value() ? ring::kHasWeight : 0) | (r.async ? ring::kAsync : 0);
  // Longer names are the caller's to route elsewhere; a cut one is refused by the daemon.
  const size_t n = std::min(r.tensor_name.size(), ring::kMaxNameBytes);
  std::memcpy(q.name, r.tensor_name.data(), n);
  q.name_bytes = static_cast<uint32_t>(r.tensor_name.size());
  Atomic(s.state).store(ring::kSubmitted, std::memory_order_release);
  ring::Header& h = header();
  {
    absl::MutexLock lock(&mu_);
    Atomic(sq(head_)).store(index, std::memory_order_relaxed);
    ++head_;
    Atomic(h.sq_head).store(head_, std::memory_order_seq_cst);
  }
  if (Atomic(h.daemon_sleeping).load(std::memory_order_seq_cst) != 0) ring::FutexWakeAll(h.sq_head);
}

bool SubmissionRingClient::IsDone(uint32_t index) const {
  return (Atomic(slot(index).state).load(std::memory_order_acquire) & ring::kStateMask) == ring::kDone;
}

absl::Status SubmissionRingClient::WaitDone(uint32_t index, absl::Time deadline, absl::Duration spin) {
  uint32_t& state = slot(index).state;
  common::SpinUntil([&] { return IsDone(index); }, spin);
  while (true) {
    uint32_t s = Atomic(state).load(std::memory_order_acquire);
    if ((s & ring::kStateMask) == ring::kDone) return absl::OkStatus();
    DQ_RETURN_IF_ERROR(Health());
    const absl::Time now = absl::Now();
    if (now >= deadline) return absl::DeadlineExceededError("the all-reduce did not complete before its deadline");
    if (!(s & ring::kWaiter)) {
      if (!Atomic(state).compare_exchange_strong(s, s | ring::kWaiter, std::memory_order_seq_cst)) continue;
      s |= ring::kWaiter;
    }
    ring::FutexWait(state, s, std::min(deadline - now, kHealthInterval));
  }
}

ring::RingCompletion SubmissionRingClient::Take(uint32_t index) {
  ring::Slot& s = slot(index);
  ring::SlotCompletion c;
  std::memcpy(&c, &s.completion, sizeof(c));
  ring::RingCompletion out;
  out.status = absl::Status(static_cast<absl::StatusCode>(c.code),
                            absl::string_view(c.message, std::min<size_t>(c.message_bytes, sizeof(c.message))));
  out.sequence = c.sequence;
  out.config_epoch = c.config_epoch;
  out.wire_bytes = c.wire_bytes;
  out.contributors = c.contributors;
  out.bits = c.bits;
  out.weight_sum = c.weight_sum;
  if (c.has_vnmse) out.measured_vnmse = c.measured_vnmse;
  out.codec.assign(c.codec, std::min<size_t>(c.codec_bytes, sizeof(c.codec)));
  const uint8_t* bitmap = reinterpret_cast<const uint8_t*>(&s) + sizeof(ring::Slot);
  out.nodes.reserve(std::min(c.node_count, geometry_.num_nodes));
  for (uint32_t node = 0; node < geometry_.num_nodes; ++node) {
    if (bitmap[node / 8] & (1u << (node % 8))) out.nodes.push_back(node);
  }
  Atomic(s.state).store(ring::kFree, std::memory_order_release);
  absl::MutexLock lock(&mu_);
  free_.push_back(index);
  return out;
}

absl::Status SubmissionRingClient::Health() const {
  ring::Header& h = header();
  if (Atomic(h.closed).load(std::memory_order_acquire) != 0) {
    const int code = h.reason_code;
    const absl::StatusCode status_code = code > 0 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated)
                                             ? static_cast<absl::StatusCode>(code)
                                             : absl::StatusCode::kUnavailable;
    return absl::Status(status_code,
                        absl::StrCat("dynamiqd closed the submission ring: ",
                                     absl::string_view(h.reason, std::min<size_t>(h.reason_bytes, sizeof(h.reason)))));
  }
  if (flock(lock_fd_, LOCK_SH | LOCK_NB) == 0) {
    flock(lock_fd_, LOCK_UN);
    return absl::UnavailableError("dynamiqd exited (the lock it holds on the submission ring is gone)");
  }
  if (errno != EWOULDBLOCK && errno != EINTR) {
    return absl::ErrnoToStatus(errno, "flock on the submission ring (the daemon's liveness check)");
  }
  return absl::OkStatus();
}

uint32_t SubmissionRingClient::AsyncDone() const { return Atomic(header().async_done).load(std::memory_order_acquire); }

void SubmissionRingClient::WaitAsync(uint32_t seen, absl::Duration timeout) {
  ring::Header& h = header();
  Atomic(h.reaper_sleeping).store(1, std::memory_order_seq_cst);
  if (Atomic(h.async_done).load(std::memory_order_seq_cst) == seen) ring::FutexWait(h.async_done, seen, timeout);
  Atomic(h.reaper_sleeping).store(0, std::memory_order_relaxed);
}

}  // namespace dynamiq::ipc

#include "ipc/submission_ring_server.h"

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

// Copies `text` into `out` (capacity `capacity`), cut with a marker when it does not fit; returns
// the bytes written.
uint32_t CopyCut(absl::string_view text, char* out, size_t capacity) {
  if (text.size() <= capacity) {
    if (!text.empty()) std::memcpy(out, text.data(), text.size());  // an empty view may be null
    return static_cast<uint32_t>(text.size());
  }
  constexpr absl::string_view kCut = " ... (cut)";
  const size_t keep = capacity - kCut.size();
  std::memcpy(out, text.data(), keep);
  std::memcpy(out + keep, kCut.data(), kCut.size());
  return static_cast<uint32_t>(capacity);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SubmissionRingServer>> SubmissionRingServer::Create(const Options& options) {
  if (options.slots == 0 || options.slots > ring::kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("a submission ring has 1..", ring::kMaxSlots, " slots, not ", options.slots));
  }
  if (options.num_nodes == 0 || options.num_nodes > ring::kMaxNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a submission ring serves 1..", ring::kMaxNodes, " nodes, not ", options.num_nodes));
  }
  const ring::Geometry geometry = ring::Geometry::Of(options.slots, options.num_nodes);
  DQ_ASSIGN_OR_RETURN(ShmRegion region, ShmRegion::Create(geometry.total_bytes, options.name_hint));
  // The liveness lock: held on an open file description of the object for as long as the ring lives.
  const int fd = shm_open(region.name().c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("shm_open(", region.name(), ") for its lock"));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("flock(", region.name(), ")"));
  }
  ring::Header& h = *reinterpret_cast<ring::Header*>(region.data());
  h.version = ring::kVersion;
  h.slots = options.slots;
  h.slot_bytes = geometry.slot_bytes;
  h.num_nodes = options.num_nodes;
  // The magic last, released: a ring with the magic is initialised.
  std::atomic_ref<uint64_t>(h.magic).store(ring::kMagic, std::memory_order_release);
  return std::unique_ptr<SubmissionRingServer>(new SubmissionRingServer(std::move(region), fd, geometry, options.spin));
}

SubmissionRingServer::SubmissionRingServer(ShmRegion region, int lock_fd, ring::Geometry geometry, absl::Duration spin)
    : region_(std::move(region)),
      lock_fd_(lock_fd),
      geometry_(geometry),
      spin_(spin),
      in_flight_(geometry.slots, false),
      async_(geometry.slots, false) {}

SubmissionRingServer::~SubmissionRingServer() { close(lock_fd_); }

absl::StatusOr<std::vector<SubmissionRingServer::Submission>> SubmissionRingServer::Wait(absl::Duration timeout) {
  if (!broken_.ok()) return broken_;
  ring::Header& h = header();
  const absl::Time deadline = absl::Now() + timeout;
  // A moment's look first (common/spin.h), then sleep on the doorbell.
  common::SpinUntil([&] { return Atomic(h.sq_head).load(std::memory_order_acquire) != tail_ || stopping(); },
                    std::min(timeout, spin_));
  while (!stopping_.load(std::memory_order_acquire)) {
    uint32_t head = Atomic(h.sq_head).load(std::memory_order_acquire);
    if (head != tail_) return Take(head);
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    // Announce the sleep, then look again: a worker that pushed in between either sees the flag
    // (and wakes us) or its push is seen here (both sides are sequentially consistent).
    Atomic(h.daemon_sleeping).store(1, std::memory_order_seq_cst);
    head = Atomic(h.sq_head).load(std::memory_order_seq_cst);
    if (head == tail_ && !stopping_.load(std::memory_order_acquire)) ring::FutexWait(h.sq_head, head, left);
    Atomic(h.daemon_sleeping).store(0, std::memory_order_relaxed);
  }
  return std::vector<Submission>();
}

absl::StatusOr<std::vector<SubmissionRingServer::Submission>> SubmissionRingServer::Take(uint32_t head) {
  const uint32_t count = head - tail_;
  auto broken = [&](std::string what) {
    broken_ = absl::FailedPreconditionError(
        absl::StrCat("the worker broke its submission ring's protocol: ", what, "; the ring is closed"));
    MarkClosed(broken_);
    return broken_;
  };
  if (count > geometry_.slots) {
    return broken(absl::StrCat(count, " submissions announced at once in a ring of ", geometry_.slots, " slots"));
  }
  std::vector<Submission> out;
  out.reserve(count);
  for (uint32_t k = 0; k < count; ++k) {
    const uint32_t index = Atomic(sq(tail_)).load(std::memory_order_relaxed);
    if (index >= geometry_.slots) {
      return broken(absl::StrCat("slot index ", index, " in a ring of ", geometry_.slots, " slots"));
    }
    ring::SlotRequest copy;
    std::memcpy(&copy, &slot(index).request, sizeof(copy));  // once: the worker may write on
    {
      absl::MutexLock lock(&mu_);
      if (in_flight_[index]) return broken(absl::StrCat("slot ", index, " submitted again before its completion"));
      in_flight_[index] = true;
      async_[index] = (copy.flags & ring::kAsync) != 0;
    }
    ++tail_;
    Submission s;
    s.slot = index;
    ring::RingRequest& r = s.request;
    r.submission = copy.submission;
    r.buffer_id = copy.buffer_id;
    r.offset_bytes = copy.offset_bytes;
    r.num_elements = copy.num_elements;
    r.dtype = copy.dtype;
    r.average = (copy.flags & ring::kAverage) != 0;
    r.exact = (copy.flags & ring::kExact) != 0;
    r.async = (copy.flags & ring::kAsync) != 0;
    if (copy.flags & ring::kHasWeight) r.weight = copy.weight;
    constexpr uint32_t kKnown = ring::kAverage | ring::kExact | ring::kHasWeight | ring::kAsync;
    if (copy.flags & ~kKnown) {
      s.bad = absl::InvalidArgumentError(absl::StrCat("unknown all-reduce flags 0x", absl::Hex(copy.flags & ~kKnown),
                                                      " in submission ring slot ", index));
    } else if (copy.name_bytes > ring::kMaxNameBytes) {
      s.bad = absl::InvalidArgumentError(absl::StrCat("tensor name of ", copy.name_bytes, " bytes: longer than the ",
                                                      ring::kMaxNameBytes, " bytes a submission ring slot holds"));
    } else {
      r.tensor_name.assign(copy.name, copy.name_bytes);
    }
    out.push_back(std::move(s));
  }
  return out;
}

void SubmissionRingServer::Complete(uint32_t index, const ring::RingCompletion& c) {
  if (index >= geometry_.slots) return;
  bool async = false;
  {
    absl::MutexLock lock(&mu_);
    if (!in_flight_[index]) return;
    async = async_[index];
  }
  ring::Slot& s = slot(index);
  ring::SlotCompletion out{};
  out.code = static_cast<int32_t>(c.status.code());
  out.message_bytes = CopyCut(c.status.message(), out.message, sizeof(out.message));
  out.sequence = c.sequence;
  out.config_epoch = c.config_epoch;
  out.wire_bytes = c.wire_bytes;
  out.contributors = c.contributors;
  out.bits = c.bits;
  out.weight_sum = c.weight_sum;
  out.has_vnmse = c.measured_vnmse.has_value();
  out.measured_vnmse = c.measured_vnmse.value_or(0);
  out.codec_bytes = CopyCut(c.codec, out.codec, sizeof(out.codec));
  uint8_t* bitmap = reinterpret_cast<uint8_t*>(&s) + sizeof(ring::Slot);
  std::memset(bitmap, 0, (size_t{geometry_.num_nodes} + 7) / 8);
  for (uint32_t node : c.nodes) {
    if (node >= geometry_.num_nodes) continue;
    bitmap[node / 8] |= static_cast<uint8_t>(1u << (node % 8));
    ++out.node_count;
  }
  std::memcpy(&s.completion, &out, sizeof(out));
  {
    // Out of flight before the worker can see the slot done (and submit it again).
    absl::MutexLock lock(&mu_);
    in_flight_[index] = false;
  }
  const uint32_t before = Atomic(s.state).exchange(ring::kDone, std::memory_order_seq_cst);
  if (before & ring::kWaiter) ring::FutexWakeAll(s.state);
  if (async) {
    ring::Header& h = header();
    Atomic(h.async_done).fetch_add(1, std::memory_order_seq_cst);
    if (Atomic(h.reaper_sleeping).load(std::memory_order_seq_cst) != 0) ring::FutexWakeAll(h.async_done);
  }
}

void SubmissionRingServer::Stop() {
  stopping_.store(true, std::memory_order_release);
  ring::FutexWakeAll(header().sq_head);
}

void SubmissionRingServer::Close(const absl::Status& why) {
  stopping_.store(true, std::memory_order_release);
  if (!broken_.ok()) return;  // closed already, and nothing the worker wrote is to be trusted
  const absl::Status reason = why.ok() ? absl::UnavailableError("the submission ring was closed") : why;
  MarkClosed(reason);
  // What the worker pushed before it could see the ring closed (later pushes it checks itself).
  absl::StatusOr<std::vector<Submission>> left = Take(Atomic(header().sq_head).load(std::memory_order_acquire));
  if (!left.ok()) return;
  ring::RingCompletion failed;
  failed.status = reason;
  for (const Submission& s : *left) Complete(s.slot, failed);
}

void SubmissionRingServer::MarkClosed(const absl::Status& why) {
  ring::Header& h = header();
  h.reason_code = static_cast<int32_t>(why.code());
  h.reason_bytes = CopyCut(why.message(), h.reason, sizeof(h.reason));
  Atomic(h.closed).store(1, std::memory_order_seq_cst);
  ring::FutexWakeAll(h.async_done);
  for (uint32_t i = 0; i < geometry_.slots; ++i) ring::FutexWakeAll(slot(i).state);
}

uint32_t SubmissionRingServer::InFlight() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(std::count(in_flight_.begin(), in_flight_.end(), true));
}

}  // namespace dynamiq::ipc

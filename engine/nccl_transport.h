// NcclTransport: the Transport for device-resident buffers, over an NCCL communicator with
// point-to-point ncclSend/ncclRecv. Built only when CUDA is enabled and both nccl.h and libnccl are
// found (target dynamiq_engine_nccl); this header itself includes no CUDA or NCCL header.
//
// Setup (ConnectNcclTransport): rank 0 creates a fresh ncclUniqueId and publishes it in the store
// under kNcclUniqueIdKey; the others read it. The caller passes a PrefixStore scoped to the group
// and epoch, so every (re)creation of a communicator gets a new id (reusing an id is an NCCL
// error). The communicator is non-blocking (ncclConfig_t::blocking = 0): init, group launches and
// finalize return ncclInProgress and are polled with ncclCommGetAsyncError, always against a
// deadline, so no NCCL call can hang the caller.
//
// Operations:
//   - PostSend/PostRecv only record the operation (device pointer, bytes as ncclUint8, peer).
//   - The first Wait on an operation not yet launched launches every recorded operation as ONE
//     NCCL group (ncclGroupStart; the ncclSend/ncclRecv calls in posting order; ncclGroupEnd) on
//     the transport's own CUDA stream, then records a CUDA event after it. Wait polls that event
//     and ncclCommGetAsyncError until done, error or deadline, sleeping briefly between polls.
//   - Zero-byte operations complete at once and never reach NCCL.
//   - The transport's stream does not wait for any other stream: a send buffer must hold its
//     final bytes (its producer's stream synchronized) when the group launches, i.e. by the first
//     Wait after the posts. Once Wait returns OK the data has landed (the event completed), so
//     anything issued afterwards, on any stream, sees it.
//
// Matching differs from the tag-matched transports, and constrains the engine:
//   - NCCL has no tags. A send and a receive between a pair of ranks match by call order: the k-th
//     send from A to B meets the k-th receive by B from A, whatever their tags (kept only for
//     error messages). The engine must post, per peer, its sends in exactly the order the peer
//     posts the matching receives; with the same tag sequence on both sides this is the Transport
//     contract's "same tag, posting order".
//   - Each ncclSend/ncclRecv blocks the GPU until its peer's matching call runs, and a group's
//     event completes only when all of its operations have. So the send and receive of one step
//     must be in the same group (all posts before a Wait are: two ranks that both send first do
//     not deadlock), and a group must not contain a send whose matching receive the peer posts
//     only after that group completes. With step headers: post the header sends and receives,
//     wait for the headers, then post the payload sends and receives and wait. Posting a payload
//     send in the header's group deadlocks once the payload exceeds NCCL's internal buffering.
//   - A size mismatch between a send and its receive is undefined in NCCL: receives must be
//     posted with the exact size, which the engine learns from the step header it receives first.
//
// Failures (the Transport contract):
//   - Wait past its deadline: DEADLINE_EXCEEDED naming this rank, the operation, peer, tag, how
//     long it waited and the group it was launched in.
//   - An asynchronous NCCL error: UNAVAILABLE with ncclGetErrorString and ncclGetLastError.
//   - After Abort: ABORTED.
//   - After any failure the transport is unusable: every later Post/Wait fails with the same code.
//     The owner destroys it and re-forms the group with a new epoch, hence a new unique id.
//   - Abort (any thread, idempotent) calls ncclCommAbort once, under the lock every other NCCL call
//     of this transport holds, so it never runs concurrently with another call on the
//     communicator. Aborting one rank alone can leave its peers' kernels waiting: the owner
//     aborts every local rank's transport (peers elsewhere fail at their deadline).
//   - The destructor finalizes cleanly (ncclCommFinalize polled for up to kNcclFinalizeTimeout,
//     then ncclCommDestroy) when the transport is healthy and nothing is in flight, and calls
//     ncclCommAbort otherwise (after a failure, with operations in flight, or if finalize fails or
//     times out). Finalize waits for global quiescence, so all ranks should destroy their
//     transports at about the same time.
//
// Every call makes this transport's device current for its NCCL/CUDA calls and restores the
// caller's device afterwards, so any thread may drive it. Thread-safety: as Transport (one
// collective drives it; Abort from any thread).
#ifndef DQ_ENGINE_NCCL_TRANSPORT_H_
#define DQ_ENGINE_NCCL_TRANSPORT_H_

#include <stddef.h>
#include <stdint.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/store.h"
#include "engine/transport.h"

// Opaque handle types of NCCL (ncclComm_t) and the CUDA runtime (cudaStream_t, cudaEvent_t), so
// this header needs neither nccl.h nor cuda_runtime.h.
struct ncclComm;
struct CUstream_st;
struct CUevent_st;

namespace dynamiq::engine {

// Store key (under the caller's PrefixStore) of the NCCL unique id. Its value is "id:" followed by
// the 128-byte ncclUniqueId in hex, or "error:<message>" when rank 0 could not create one, so the
// other ranks fail at once instead of at their timeout.
inline constexpr char kNcclUniqueIdKey[] = "nccl_unique_id";

// How long the destructor waits for ncclCommFinalize before it aborts instead.
inline constexpr absl::Duration kNcclFinalizeTimeout = absl::Seconds(10);

// Joins the communicator of `size` ranks as `rank`, on CUDA device `device`. Every rank must call
// it (concurrently) with a store scoped to the same group and epoch. `timeout` bounds the whole
// call: waiting for the id and the non-blocking init (aborted on timeout).
// Errors: INVALID_ARGUMENT (rank/size); FAILED_PRECONDITION (no CUDA driver or device, or `device`
// does not exist); DEADLINE_EXCEEDED (id or init not done in time, naming the step); UNAVAILABLE
// (NCCL init failed, or rank 0 published an error); INTERNAL (other CUDA/NCCL errors).
absl::StatusOr<std::unique_ptr<Transport>> ConnectNcclTransport(Store& store, int rank, int size, int device,
                                                                absl::Duration timeout);

class NcclTransport final : public Transport {
 public:
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;
  ~NcclTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }
  TransportCapabilities capabilities() const override {
    TransportCapabilities c;
    c.kind = "nccl";
    c.device_memory = true;
    return c;
  }
  int device() const { return device_; }

  // `data` / `buffer` must be device memory of this transport's device (or managed memory);
  // host memory is INVALID_ARGUMENT. The peer must be another rank of the group.
  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override;
  absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override;
  // Launches the pending group if `handle` is in it, then waits for the group's event. An unknown
  // handle (never posted, or already waited for) is INVALID_ARGUMENT.
  absl::Status Wait(Handle handle, absl::Time deadline) override;
  void Abort() override;

 private:
  friend absl::StatusOr<std::unique_ptr<Transport>> ConnectNcclTransport(Store& store, int rank, int size, int device,
                                                                         absl::Duration timeout);

  struct Op {
    bool send = false;
    int peer = -1;
    uint64_t tag = 0;
    void* data = nullptr;
    size_t bytes = 0;
    uint64_t launch = 0;  // id of the group it was launched in; 0 while pending (or zero bytes)
  };
  // One ncclGroupStart..ncclGroupEnd launch and the event recorded after it.
  struct Launch {
    CUevent_st* event = nullptr;
    std::vector<Handle> handles;  // in posting order; for error messages
    int outstanding = 0;          // handles not yet waited for
    bool done = false;            // the event has completed
  };

  NcclTransport(int rank, int size, int device, ncclComm* comm, CUstream_st* stream);

  absl::StatusOr<Handle> Post(bool send, int peer, uint64_t tag, void* data, size_t bytes);
  absl::Status WaitForOp(Handle handle, absl::Time start, absl::Time deadline);
  // Launches every pending operation as one group and records its event.
  absl::Status LaunchPending(const Op& waited, absl::Time start, absl::Time deadline);
  // Forgets `handle` after its Wait; recycles its launch's event once every handle is waited for.
  void Release(Handle handle);
  // Records `status` as the sticky failure and returns it.
  absl::Status Fail(absl::Status status);
  absl::Status AbortedStatus(const Op* op) const;
  std::string Describe(const Op& op) const;
  std::string DescribeGroup(const std::vector<Handle>& handles) const;
  // DEADLINE_EXCEEDED for `op` after `waited`, with the stage it was in and its group.
  absl::Status DeadlineStatus(const Op& op, absl::Duration waited, absl::string_view stage,
                              const std::vector<Handle>& group) const;
  std::string Where() const;  // "NCCL transport rank r of n (device d)"

  const int rank_;
  const int size_;
  const int device_;
  CUstream_st* const stream_;

  // Every NCCL call on comm_ holds comm_mu_, so Abort (any thread) never overlaps another call;
  // the calls made under it are all non-blocking. comm_ is null once aborted or destroyed.
  absl::Mutex comm_mu_;
  ncclComm* comm_ ABSL_GUARDED_BY(comm_mu_);
  std::atomic<bool> aborted_{false};

  // Driven by the one thread that runs the collective.
  absl::Status failure_;  // sticky: the first failure
  Handle next_handle_ = 1;
  uint64_t next_launch_ = 1;
  std::map<Handle, Op> ops_;     // posted, not yet waited for
  std::vector<Handle> pending_;  // posted, not yet launched, in posting order
  std::map<uint64_t, Launch> launches_;
  std::vector<CUevent_st*> free_events_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_NCCL_TRANSPORT_H_

// HostStagedTransport: a transport of device memory over a host transport (Gloo TCP), for GPU nodes
// whose network is ordinary Ethernet (the hybrid data path, dynamiqd --device=cuda
// --transport=gloo). Each message's device bytes are copied into pinned host memory and sent by the
// inner transport; a received message lands in pinned memory and is copied into the device buffer
// before Wait returns. Only what the caller sends crosses PCIe and the wire: with the device
// all-reduce (engine/nccl_allreduce.h) that is the compressed chunks, about 6x fewer bytes than
// fp32 at 5 bits.
//
// Contract: the device bytes of a PostSend are complete when it is called (the device all-reduce
// waits for each block's work first), and a received buffer is complete when Wait returns. Pinned
// buffers are pooled per transport (a job's group), so steady collectives allocate nothing.
// Copies run on a non-blocking stream of the transport's own and are synchronized, so they never
// wait for other streams' work (another job's collective) on the device.
//
// One collective at a time (like every Transport); Abort may be called from any thread. Built only
// with CUDA (dynamiq_engine_staged); this header includes no CUDA header.
#ifndef DQ_ENGINE_HOST_STAGED_TRANSPORT_H_
#define DQ_ENGINE_HOST_STAGED_TRANSPORT_H_

#include <stddef.h>
#include <stdint.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/transport.h"

struct CUstream_st;

namespace dynamiq::engine {

class HostStagedTransport final : public Transport {
 public:
  // Takes `inner` (a host-memory transport); `device` is the CUDA device whose memory the messages
  // come from and go to. FAILED_PRECONDITION when the device cannot be used.
  static absl::StatusOr<std::unique_ptr<HostStagedTransport>> Create(std::unique_ptr<Transport> inner, int device);
  ~HostStagedTransport() override;
  HostStagedTransport(const HostStagedTransport&) = delete;
  HostStagedTransport& operator=(const HostStagedTransport&) = delete;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return "staged-" + inner_->name(); }
  // The inner transport's kind (what crosses the network), moving device memory.
  TransportCapabilities capabilities() const override {
    TransportCapabilities c = inner_->capabilities();
    c.device_memory = true;
    c.scatter_gather = false;
    return c;
  }
  int device() const { return device_; }

  // `data` / `buffer`: device memory of device().
  absl::StatusOr<Handle> PostSend(int peer, uint64_t tag, absl::Span<const uint8_t> data) override;
  absl::StatusOr<Handle> PostRecv(int peer, uint64_t tag, absl::Span<uint8_t> buffer) override;
  absl::Status Wait(Handle handle, absl::Time deadline) override;
  void MessageReceived(int peer, size_t bytes) override { inner_->MessageReceived(peer, bytes); }
  void Abort() override { inner_->Abort(); }

 private:
  struct Pinned {
    uint8_t* data = nullptr;
    size_t capacity = 0;
  };
  struct Op {
    Transport::Handle inner = 0;
    Pinned staging;
    absl::Span<uint8_t> device_target;  // receives: where the bytes go once they arrived
  };

  HostStagedTransport(std::unique_ptr<Transport> inner, int device, CUstream_st* stream);
  // A pinned buffer of at least `bytes` from the pool (allocated when none fits).
  absl::StatusOr<Pinned> Take(size_t bytes);
  void Give(Pinned pinned) { pool_.push_back(pinned); }

  const std::unique_ptr<Transport> inner_;
  const int device_;
  CUstream_st* const stream_;
  std::vector<Pinned> pool_;  // free pinned buffers, reused across collectives
  std::map<Handle, Op> ops_;  // posted, not yet waited for
  Handle next_handle_ = 1;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_HOST_STAGED_TRANSPORT_H_

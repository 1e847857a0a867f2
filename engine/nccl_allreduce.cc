#include "engine/nccl_allreduce.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda_check.h"
#include "common/status_macros.h"
#include "engine/nccl_allreduce_program.h"
#include "kernels/cpu/dynamiq_codec.h"
#include "kernels/cuda/allreduce_kernels.h"
#include "kernels/cuda/dynamiq_cuda_host.h"
#include "kernels/cuda/launch.h"
#include "kernels/wire_format.h"

namespace dynamiq::engine {
namespace {

using kernels::AddMeansCuda;
using kernels::BucketPlan;
using kernels::CentreCuda;
using kernels::ChunkRef;
using kernels::Codec;
using kernels::CodecId;
using kernels::DynamiqCodec;
using kernels::DynamiqStatsCuda;
using kernels::kChunkHeaderBytes;
using kernels::kSuperGroupSize;
using kernels::SimpleDarCuda;
using kernels::SimpleDecodeCuda;
using kernels::SimpleEncodeCuda;

// Chunk buffers start at multiples of this, so payloads (after the 32-byte header) are aligned for
// the fp32/bf16 kernels and NCCL's copies.
constexpr size_t kAlign = 256;
size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

// Grow-only memory of one kind (device or pinned host). A call takes its buffers from one block;
// what does not fit is allocated on the side for this call, and the next call starts with one block
// as large as the last call needed, so steady collectives allocate nothing.
class DeviceAllReduceWorkspace::Arena {
 public:
  explicit Arena(bool pinned) : pinned_(pinned) {}
  ~Arena() {
    for (void* p : extra_) Free(p);
    if (base_ != nullptr) Free(base_);
  }

  // Starts a call: no earlier call's work may still use the memory.
  absl::Status Begin() {
    used_ = 0;
    if (extra_.empty()) return absl::OkStatus();
    for (void* p : extra_) Free(p);
    extra_.clear();
    if (base_ != nullptr) Free(base_);
    base_ = nullptr;
    capacity_ = 0;
    void* p = nullptr;
    DQ_CUDA_RETURN_IF_ERROR(pinned_ ? cudaMallocHost(&p, wanted_) : cudaMalloc(&p, wanted_));
    base_ = static_cast<uint8_t*>(p);
    capacity_ = wanted_;
    return absl::OkStatus();
  }

  absl::StatusOr<void*> Take(size_t bytes) {
    const size_t aligned = AlignUp(std::max<size_t>(bytes, 1));
    if (used_ + aligned <= capacity_) {
      void* p = base_ + used_;
      used_ += aligned;
      return p;
    }
    used_ += aligned;
    wanted_ = std::max(wanted_, used_);
    void* p = nullptr;
    DQ_CUDA_RETURN_IF_ERROR(pinned_ ? cudaMallocHost(&p, aligned) : cudaMalloc(&p, aligned));
    extra_.push_back(p);
    return p;
  }

 private:
  void Free(void* p) { (void)(pinned_ ? cudaFreeHost(p) : cudaFree(p)); }

  const bool pinned_;
  uint8_t* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;           // by the current call
  size_t wanted_ = 0;         // the most any call needed
  std::vector<void*> extra_;  // this call's overflow, folded into base_ at the next Begin
};

DeviceAllReduceWorkspace::DeviceAllReduceWorkspace()
    : device_(std::make_unique<Arena>(false)), host_(std::make_unique<Arena>(true)) {}

DeviceAllReduceWorkspace::~DeviceAllReduceWorkspace() {
  for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  (void)cudaGetLastError();
}

absl::Status DeviceAllReduceWorkspace::Begin() {
  DQ_RETURN_IF_ERROR(device_->Begin());
  return host_->Begin();
}

absl::StatusOr<void*> DeviceAllReduceWorkspace::Device(size_t bytes) { return device_->Take(bytes); }
absl::StatusOr<void*> DeviceAllReduceWorkspace::Pinned(size_t bytes) { return host_->Take(bytes); }

absl::StatusOr<std::vector<CUevent_st*>> DeviceAllReduceWorkspace::Events(size_t count) {
  while (events_.size() < count) {
    cudaEvent_t e = nullptr;
    DQ_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events_.push_back(e);
  }
  return std::vector<CUevent_st*>(events_.begin(), events_.begin() + static_cast<ptrdiff_t>(count));
}

namespace {

using ::dynamiq::common::ScopedDevice;

// The device backend: buffers in device memory, kernels on the caller's stream, one event per
// block marking the end of its queued work.
class CudaBackend final : public NcclAllReduceBackend {
 public:
  // `workspace` (Begin already called) outlives the backend.
  CudaBackend(const Codec& codec, const DynamiqCodec* dynamiq, cudaStream_t stream, const float* in, float* out,
              size_t d, DeviceAllReduceWorkspace& workspace)
      : codec_(codec),
        dynamiq_(dynamiq),
        element_bytes_(codec.id() == CodecId::kNone ? 4 : 2),
        stream_(stream),
        in_(in),
        out_(out),
        d_(d),
        workspace_(workspace) {}

  ~CudaBackend() override {
    // Everything queued must finish before the workspace's memory serves the next call; the driver
    // has either waited for every transfer or aborted the transport.
    (void)cudaStreamSynchronize(stream_);
    (void)cudaGetLastError();
  }

  absl::Status LocalStats(absl::Span<float> stats) override {
    DQ_ASSIGN_OR_RETURN(float* device_stats, DeviceArray<float>(stats.size()));
    DQ_CUDA_RETURN_IF_ERROR(DynamiqStatsCuda(in_, d_, device_stats, stream_));
    DQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(stats.data(), device_stats, stats.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    DQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::StatusOr<absl::Span<const uint8_t>> StageSend(absl::Span<const uint8_t> host) override {
    DQ_RETURN_IF_ERROR(Reserve(stage_send_, stage_send_capacity_, host.size()));
    if (!host.empty()) {
      DQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(stage_send_, host.data(), host.size(), cudaMemcpyHostToDevice, stream_));
    }
    // The transport's stream does not wait for ours.
    DQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::Span<const uint8_t>(stage_send_, host.size());
  }

  absl::StatusOr<absl::Span<uint8_t>> StageRecv(size_t bytes) override {
    DQ_RETURN_IF_ERROR(Reserve(stage_recv_, stage_recv_capacity_, bytes));
    return absl::Span<uint8_t>(stage_recv_, bytes);
  }

  absl::Status Unstage(absl::Span<const uint8_t> wire, absl::Span<uint8_t> host) override {
    if (wire.size() != host.size()) return absl::InternalError("staged message size mismatch");
    if (!host.empty()) {
      DQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.data(), wire.data(), host.size(), cudaMemcpyDeviceToHost, stream_));
    }
    DQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status Setup(const BucketPlan& plan, const std::vector<NcclBlock>& blocks, const NcclRankProgram& program,
                     const std::vector<std::vector<size_t>>& bytes) override;

  absl::Span<uint8_t> ChunkBuffer(int block, int chunk) override {
    return absl::Span<uint8_t>(Wire(block, chunk), (*bytes_)[block][chunk]);
  }

  absl::Status Encode(int block, int chunk) override {
    DQ_RETURN_IF_ERROR(EncodeLocal(block, chunk));
    return Record(block);
  }

  absl::Status OnReceive(int block, const NcclStep& step, bool all_gather, int step_index) override;

  absl::Status FinishReduceScatter(int block) override {
    const int c = program_->owned_chunk;
    if (c < 0) return absl::OkStatus();
    if (program_->leaf[c]) DQ_RETURN_IF_ERROR(EncodeLocal(block, c));
    DQ_RETURN_IF_ERROR(DecodeToOutput(block, c));
    return Record(block);
  }

  absl::Status Ready(int block) override;

 private:
  // Validation of a received chunk, checked at the block's next Ready.
  struct Pending {
    bool active = false;
    int peer = -1;
    int chunk = -1;
    bool all_gather = false;
    int step = 0;
    std::vector<uint8_t> expected;  // the prefix a correct sender wrote
  };

  // From the workspace: kept from one call to the next, so steady collectives allocate nothing
  // (an allocation may wait for other work on the device, another job's NCCL kernel included).
  template <typename T>
  absl::StatusOr<T*> DeviceArray(size_t count) {
    DQ_ASSIGN_OR_RETURN(void* p, workspace_.Device(count * sizeof(T)));
    return static_cast<T*>(p);
  }
  template <typename T>
  absl::StatusOr<T*> PinnedArray(size_t count) {
    DQ_ASSIGN_OR_RETURN(void* p, workspace_.Pinned(count * sizeof(T)));
    return static_cast<T*>(p);
  }
  absl::Status Reserve(uint8_t*& buffer, size_t& capacity, size_t bytes) {
    if (bytes <= capacity && buffer != nullptr) return absl::OkStatus();
    capacity = std::max<size_t>(bytes, 4096);
    DQ_ASSIGN_OR_RETURN(buffer, DeviceArray<uint8_t>(capacity));
    return absl::OkStatus();
  }

  uint8_t* Wire(int block, int chunk) const { return wire_ + wire_offset_[block][chunk]; }
  uint8_t* Payload(int block, int chunk) const { return Wire(block, chunk) + prefix_bytes_[block][chunk]; }
  ChunkRef Range(int block, int chunk) const {
    return ChunkOf((*blocks_)[block].plan.num_elements, program_->world_size, chunk);
  }
  // Bucket-level index of the chunk's first super-group.
  uint64_t FirstSg(int block, int chunk) const {
    return ((*blocks_)[block].begin + Range(block, chunk).begin) / kSuperGroupSize;
  }
  const float* Local(int block, int chunk) const { return in_ + (*blocks_)[block].begin + Range(block, chunk).begin; }

  absl::StatusOr<std::vector<uint8_t>> Prefix(int block, int chunk, uint16_t summands) const {
    const BucketPlan& plan = (*blocks_)[block].plan;
    const ChunkRef ref = NcclChunkRef(*program_, plan.num_elements, chunk);
    if (dynamiq_ == nullptr) return NcclChunkPrefix(codec_, plan, ref, summands);
    std::vector<uint8_t> out(prefix_bytes_[block][chunk]);
    DQ_RETURN_IF_ERROR(
        kernels::WriteDynamiqChunkPrefix(*dynamiq_, plan, ref, layouts_[block][chunk], summands, absl::MakeSpan(out)));
    return out;
  }

  // Writes this rank's header (+ width map) of the chunk in front of its payload.
  absl::Status WriteOwnPrefix(int block, int chunk) {
    const size_t at = own_prefix_offset_[block][chunk];
    if (at == SIZE_MAX) return absl::InternalError(absl::StrCat("rank produces no bytes for chunk ", chunk));
    DQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(Wire(block, chunk), own_prefixes_ + at, prefix_bytes_[block][chunk],
                                            cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }

  // The centred local values of the chunk in scratch_ (DynamiQ).
  absl::StatusOr<const float*> Centred(int block, int chunk) {
    DQ_CUDA_RETURN_IF_ERROR(
        CentreCuda(Local(block, chunk), means_, FirstSg(block, chunk), Range(block, chunk).count, scratch_, stream_));
    return scratch_;
  }

  absl::Status EncodeLocal(int block, int chunk) {
    DQ_RETURN_IF_ERROR(WriteOwnPrefix(block, chunk));
    if (dynamiq_ != nullptr) {
      DQ_ASSIGN_OR_RETURN(const float* values, Centred(block, chunk));
      DQ_CUDA_RETURN_IF_ERROR(kernels::DynamiqEncodeCuda(args_[block][chunk], values, Payload(block, chunk), stream_));
    } else {
      DQ_CUDA_RETURN_IF_ERROR(SimpleEncodeCuda(element_bytes_, Local(block, chunk), Range(block, chunk).count,
                                               Payload(block, chunk), stream_));
    }
    return absl::OkStatus();
  }

  absl::Status DecodeToOutput(int block, int chunk) {
    float* out = out_ + (*blocks_)[block].begin + Range(block, chunk).begin;
    const size_t count = Range(block, chunk).count;
    if (dynamiq_ != nullptr) {
      DQ_CUDA_RETURN_IF_ERROR(
          kernels::DynamiqDecodeCuda(args_[block][chunk], Payload(block, chunk), out, /*accumulate=*/false, stream_));
      DQ_CUDA_RETURN_IF_ERROR(AddMeansCuda(out, sums_, FirstSg(block, chunk), count, stream_));
    } else {
      DQ_CUDA_RETURN_IF_ERROR(
          SimpleDecodeCuda(element_bytes_, Payload(block, chunk), count, out, /*accumulate=*/false, stream_));
    }
    return absl::OkStatus();
  }

  absl::Status Record(int block) {
    DQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[block], stream_));
    recorded_[block] = 1;
    return absl::OkStatus();
  }

  const Codec& codec_;
  const DynamiqCodec* dynamiq_;  // null for none and bf16
  const int element_bytes_;      // none and bf16
  cudaStream_t stream_;
  const float* in_;
  float* out_;
  size_t d_;
  DeviceAllReduceWorkspace& workspace_;
  std::vector<cudaEvent_t> events_;  // the workspace's, one per block
  uint8_t* stage_send_ = nullptr;
  size_t stage_send_capacity_ = 0;
  uint8_t* stage_recv_ = nullptr;
  size_t stage_recv_capacity_ = 0;

  // Set by Setup.
  const std::vector<NcclBlock>* blocks_ = nullptr;
  const NcclRankProgram* program_ = nullptr;
  const std::vector<std::vector<size_t>>* bytes_ = nullptr;
  uint8_t* wire_ = nullptr;
  std::vector<std::vector<size_t>> wire_offset_;                 // [block][chunk]
  std::vector<std::vector<size_t>> prefix_bytes_;                // [block][chunk]: header (+ width map)
  std::vector<std::vector<kernels::DynamiqCudaChunk>> layouts_;  // [block][chunk] (DynamiQ)
  std::vector<std::vector<kernels::DynamiqDeviceArgs>> args_;    // [block][chunk] (DynamiQ)
  std::vector<std::vector<float*>> accumulators_;                // [block][chunk], null if none
  float* scratch_ = nullptr;                                     // one chunk (DynamiQ)
  float* means_ = nullptr;                                       // plan.local_means (DynamiQ)
  float* sums_ = nullptr;                                        // plan.mean_sums (DynamiQ)
  uint8_t* own_prefixes_ = nullptr;                              // pinned: this rank's chunk prefixes
  std::vector<std::vector<size_t>> own_prefix_offset_;           // [block][chunk], SIZE_MAX if none
  size_t max_prefix_ = 0;
  uint8_t* received_prefixes_ = nullptr;  // pinned: per block, the last received chunk's prefix
  int* bad_device_ = nullptr;             // per block: DynamiqValidateCuda's result
  int* bad_host_ = nullptr;               // pinned copy
  std::vector<Pending> pending_;
  std::vector<uint8_t> recorded_;
};

absl::Status CudaBackend::Setup(const BucketPlan& plan, const std::vector<NcclBlock>& blocks,
                                const NcclRankProgram& program, const std::vector<std::vector<size_t>>& bytes) {
  blocks_ = &blocks;
  program_ = &program;
  bytes_ = &bytes;
  const int num_blocks = static_cast<int>(blocks.size());
  const int n = program.world_size;

  // Layouts and header sizes.
  prefix_bytes_.assign(num_blocks, std::vector<size_t>(n, kChunkHeaderBytes));
  size_t max_chunk = 0;
  std::vector<kernels::LevelTable> tables;
  std::vector<uint64_t> sg_offsets;
  std::vector<uint8_t> sg_widths;
  std::vector<std::vector<size_t>> sg_index(num_blocks, std::vector<size_t>(n, 0));
  if (dynamiq_ != nullptr) layouts_.assign(num_blocks, std::vector<kernels::DynamiqCudaChunk>(n));
  for (int k = 0; k < num_blocks; ++k) {
    for (int c = 0; c < n; ++c) {
      max_chunk = std::max(max_chunk, Range(k, c).count);
      if (dynamiq_ == nullptr) continue;
      // Keys (rounding siblings) as this rank compresses the chunk; sizes as every rank sees them.
      const ChunkRef ref = NcclChunkRef(program, blocks[k].plan.num_elements, c);
      DQ_ASSIGN_OR_RETURN(layouts_[k][c], kernels::PrepareDynamiqCudaChunk(*dynamiq_, blocks[k].plan, ref));
      const kernels::DynamiqCudaChunk& layout = layouts_[k][c];
      if (layout.total_bytes() != bytes[k][c]) {
        return absl::InternalError(absl::StrCat("chunk ", c, " of block ", k, ": device layout of ",
                                                layout.total_bytes(), " bytes, the codec says ", bytes[k][c]));
      }
      prefix_bytes_[k][c] = kChunkHeaderBytes + layout.width_map.size();
      sg_index[k][c] = sg_widths.size();
      sg_widths.insert(sg_widths.end(), layout.widths.begin(), layout.widths.end());
      sg_offsets.insert(sg_offsets.end(), layout.offsets.begin(), layout.offsets.end());
    }
  }
  for (const auto& row : prefix_bytes_) {
    for (size_t p : row) max_prefix_ = std::max(max_prefix_, p);
  }

  // Chunk buffers.
  wire_offset_.assign(num_blocks, std::vector<size_t>(n, 0));
  size_t total = 0;
  for (int k = 0; k < num_blocks; ++k) {
    for (int c = 0; c < n; ++c) {
      wire_offset_[k][c] = total;
      total += AlignUp(bytes[k][c]);
    }
  }
  DQ_ASSIGN_OR_RETURN(wire_, DeviceArray<uint8_t>(total));

  // DynamiQ: tables, widths and offsets, means, scratch.
  if (dynamiq_ != nullptr) {
    tables.resize(kernels::kMaxWidth + 1);
    kernels::CopyDynamiqLevelTables(*dynamiq_, tables.data());
    DQ_ASSIGN_OR_RETURN(kernels::LevelTable * device_tables, DeviceArray<kernels::LevelTable>(tables.size()));
    DQ_ASSIGN_OR_RETURN(uint64_t * device_offsets, DeviceArray<uint64_t>(sg_offsets.size()));
    DQ_ASSIGN_OR_RETURN(uint8_t * device_widths, DeviceArray<uint8_t>(sg_widths.size()));
    DQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_tables, tables.data(), tables.size() * sizeof(kernels::LevelTable),
                                            cudaMemcpyHostToDevice, stream_));
    if (!sg_offsets.empty()) {
      DQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_offsets, sg_offsets.data(), sg_offsets.size() * sizeof(uint64_t),
                                              cudaMemcpyHostToDevice, stream_));
      DQ_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(device_widths, sg_widths.data(), sg_widths.size(), cudaMemcpyHostToDevice, stream_));
    }
    args_.assign(num_blocks, std::vector<kernels::DynamiqDeviceArgs>(n));
    for (int k = 0; k < num_blocks; ++k) {
      for (int c = 0; c < n; ++c) {
        kernels::DynamiqDeviceArgs& a = args_[k][c];
        a = layouts_[k][c].args;
        a.tables = device_tables;
        a.widths = device_widths + sg_index[k][c];
        a.offsets = device_offsets + sg_index[k][c];
      }
    }
    const size_t m = plan.local_means.size();
    if (plan.mean_sums.size() != m) return absl::InternalError("plan means and mean sums differ in length");
    DQ_ASSIGN_OR_RETURN(means_, DeviceArray<float>(m));
    DQ_ASSIGN_OR_RETURN(sums_, DeviceArray<float>(m));
    if (m > 0) {
      DQ_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(means_, plan.local_means.data(), m * sizeof(float), cudaMemcpyHostToDevice, stream_));
      DQ_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(sums_, plan.mean_sums.data(), m * sizeof(float), cudaMemcpyHostToDevice, stream_));
    }
    DQ_ASSIGN_OR_RETURN(scratch_, DeviceArray<float>(max_chunk));
  }

  // Accumulators for chunks with several children.
  accumulators_.assign(num_blocks, std::vector<float*>(n, nullptr));
  for (int k = 0; k < num_blocks; ++k) {
    for (int c = 0; c < n; ++c) {
      if (program.accumulator[c]) {
        DQ_ASSIGN_OR_RETURN(accumulators_[k][c], DeviceArray<float>(Range(k, c).count));
      }
    }
  }

  // This rank's prefixes (pinned: copied asynchronously whenever a chunk is (re)encoded).
  own_prefix_offset_.assign(num_blocks, std::vector<size_t>(n, SIZE_MAX));
  std::vector<uint8_t> own;
  for (int k = 0; k < num_blocks; ++k) {
    for (int c = 0; c < n; ++c) {
      if (program.summands[c] == 0) continue;
      DQ_ASSIGN_OR_RETURN(std::vector<uint8_t> prefix, Prefix(k, c, program.summands[c]));
      own_prefix_offset_[k][c] = own.size();
      own.insert(own.end(), prefix.begin(), prefix.end());
    }
  }
  DQ_ASSIGN_OR_RETURN(own_prefixes_, PinnedArray<uint8_t>(own.size()));
  if (!own.empty()) std::memcpy(own_prefixes_, own.data(), own.size());

  // Validation results, per block.
  DQ_ASSIGN_OR_RETURN(received_prefixes_, PinnedArray<uint8_t>(num_blocks * max_prefix_));
  DQ_ASSIGN_OR_RETURN(bad_device_, DeviceArray<int>(num_blocks));
  DQ_ASSIGN_OR_RETURN(bad_host_, PinnedArray<int>(num_blocks));
  pending_.assign(num_blocks, Pending{});
  recorded_.assign(num_blocks, 0);
  DQ_ASSIGN_OR_RETURN(events_, workspace_.Events(num_blocks));
  // The pageable uploads above read host vectors that go out of scope here.
  DQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::OnReceive(int block, const NcclStep& step, bool all_gather, int step_index) {
  const int c = step.recv_chunk;
  Pending& p = pending_[block];
  p.active = true;
  p.peer = step.recv_peer;
  p.chunk = c;
  p.all_gather = all_gather;
  p.step = step_index;
  DQ_ASSIGN_OR_RETURN(p.expected, Prefix(block, c, step.recv_summands));
  // Validation: the prefix comes back to the host, the super-groups are checked on the device.
  DQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(received_prefixes_ + block * max_prefix_, Wire(block, c),
                                          prefix_bytes_[block][c], cudaMemcpyDeviceToHost, stream_));
  bad_host_[block] = -1;  // the block's earlier copies completed at its last Ready
  if (dynamiq_ != nullptr) {
    DQ_CUDA_RETURN_IF_ERROR(
        kernels::DynamiqValidateCuda(args_[block][c], Payload(block, c), bad_device_ + block, stream_));
    DQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(bad_host_ + block, bad_device_ + block, sizeof(int), cudaMemcpyDeviceToHost, stream_));
  }
  // The action. Invalid input produces garbage but never an out-of-bounds access (the widths and
  // offsets come from the plan), and Ready reports it before the bytes go anywhere.
  const size_t count = Range(block, c).count;
  switch (step.action) {
    case NcclReceiveAction::kAccumulate: {
      float* acc = accumulators_[block][c];
      if (acc == nullptr) return absl::InternalError(absl::StrCat("no accumulator for chunk ", c));
      if (step.init_accumulator) {
        if (dynamiq_ != nullptr) {
          DQ_CUDA_RETURN_IF_ERROR(CentreCuda(Local(block, c), means_, FirstSg(block, c), count, acc, stream_));
        } else if (count > 0) {
          DQ_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(acc, Local(block, c), count * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
        }
      }
      if (dynamiq_ != nullptr) {
        DQ_CUDA_RETURN_IF_ERROR(
            kernels::DynamiqDecodeCuda(args_[block][c], Payload(block, c), acc, /*accumulate=*/true, stream_));
      } else {
        DQ_CUDA_RETURN_IF_ERROR(
            SimpleDecodeCuda(element_bytes_, Payload(block, c), count, acc, /*accumulate=*/true, stream_));
      }
      break;
    }
    case NcclReceiveAction::kDar: {
      const float* source = nullptr;
      if (step.from_accumulator) {
        source = accumulators_[block][c];
        if (source == nullptr) return absl::InternalError(absl::StrCat("no accumulator for chunk ", c));
      } else if (dynamiq_ != nullptr) {
        DQ_ASSIGN_OR_RETURN(source, Centred(block, c));
      } else {
        source = Local(block, c);
      }
      if (dynamiq_ != nullptr) {
        DQ_CUDA_RETURN_IF_ERROR(
            kernels::DynamiqDarCuda(args_[block][c], Payload(block, c), source, Payload(block, c), stream_));
      } else {
        DQ_CUDA_RETURN_IF_ERROR(SimpleDarCuda(element_bytes_, Payload(block, c), source, count, stream_));
      }
      // After the received prefix was copied back (same stream): this rank's header.
      DQ_RETURN_IF_ERROR(WriteOwnPrefix(block, c));
      break;
    }
    case NcclReceiveAction::kDecode:
      DQ_RETURN_IF_ERROR(DecodeToOutput(block, c));
      break;
    case NcclReceiveAction::kNone:
      return absl::InternalError("receive without an action");
  }
  return Record(block);
}

absl::Status CudaBackend::Ready(int block) {
  if (recorded_[block]) {
    DQ_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(events_[block]));
    recorded_[block] = 0;
  }
  Pending& p = pending_[block];
  if (!p.active) return absl::OkStatus();
  p.active = false;
  const size_t prefix = prefix_bytes_[block][p.chunk];
  absl::Status status =
      NcclCheckChunkPrefix(absl::Span<const uint8_t>(received_prefixes_ + block * max_prefix_, prefix), p.expected);
  if (status.ok() && bad_host_[block] >= 0) {
    const uint64_t sg = FirstSg(block, p.chunk) + static_cast<uint64_t>(bad_host_[block]);
    status = absl::InvalidArgumentError(absl::StrCat(
        "super-group ", sg, " of the bucket is malformed (illegal code, zero group scale or bad super unit)"));
  }
  if (status.ok()) return status;
  return absl::Status(
      status.code(), absl::StrCat(p.all_gather ? "all-gather" : "reduce-scatter", " step ", p.step, ": chunk ", p.chunk,
                                  " of block ", block, " from rank ", p.peer, ": ", status.message()));
}

}  // namespace

absl::StatusOr<AllReduceResult> NcclAllReduce(const Codec& codec, NcclTransport& transport,
                                              const AllReduceOptions& options, const float* device_in,
                                              float* device_out, size_t num_elements, void* stream) {
  return DeviceAllReduce(codec, transport, transport.device(), options, device_in, device_out, num_elements, stream);
}

absl::StatusOr<AllReduceResult> DeviceAllReduce(const Codec& codec, Transport& transport, int device,
                                                const AllReduceOptions& options, const float* device_in,
                                                float* device_out, size_t num_elements, void* stream,
                                                DeviceAllReduceWorkspace* workspace) {
  const DynamiqCodec* dynamiq = nullptr;
  switch (codec.id()) {
    case CodecId::kNone:
    case CodecId::kBf16:
      break;
    case CodecId::kDynamiq:
      dynamiq = dynamic_cast<const DynamiqCodec*>(&codec);
      if (dynamiq == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", transport.rank(), ": a dynamiq codec must be a kernels::DynamiqCodec"));
      }
      break;
    default:
      return absl::UnimplementedError(absl::StrCat("rank ", transport.rank(), ": the NCCL all-reduce supports the ",
                                                   kernels::CudaCodecNames(), " codecs, not ",
                                                   kernels::CodecName(codec.id())));
  }
  if (num_elements > 0 && (device_in == nullptr || device_out == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", transport.rank(), ": null device buffer"));
  }
  ScopedDevice scoped_device(device);
  if (!scoped_device.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", transport.rank(), ": cannot make device ", device, " current"));
  }
  // Without a workspace of the caller's, one for this call alone.
  std::unique_ptr<DeviceAllReduceWorkspace> own;
  if (workspace == nullptr) {
    own = std::make_unique<DeviceAllReduceWorkspace>();
    workspace = own.get();
  }
  absl::Status begun = workspace->Begin();
  if (!begun.ok()) return common::Annotate(begun, absl::StrCat("rank ", transport.rank()));
  CudaBackend backend(codec, dynamiq, static_cast<cudaStream_t>(stream), device_in, device_out, num_elements,
                      *workspace);
  return RunNcclAllReduce(codec, transport, options, num_elements, backend);
}

}  // namespace dynamiq::engine

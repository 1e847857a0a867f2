// CudaBlockEmulator: runs the block- and warp-level kernel bodies of kernels/cuda/*_kernels.cuh on
// the CPU, one fiber (ucontext) per CUDA thread, so their indexing, barriers, lane exchanges and
// results can be tested on machines without a GPU. A warp is a block of 32 threads.
//
// Threads run one at a time until they reach a barrier (Block::Sync) or finish; a round resumes
// every live thread once, so a round is one barrier phase. The order in which threads run within
// a phase is ascending, descending or a fresh random permutation per phase: code that reads
// shared memory written by another thread in the same phase (a missing __syncthreads) then gives
// order-dependent results, which the tests catch by comparing against the CPU codec.
// __shfl_xor_sync and __shfl_sync are emulated through a block-wide exchange between two barriers;
// that is stronger than the warp-level hardware operation, so kernels must not rely on shuffles to
// order shared memory (ours do not). RunBlock reports divergence: threads that did not all pass the
// same number of barriers and shuffles (a __syncthreads or full-mask shuffle not reached by every
// thread).
//
// Not thread-safe: one RunBlock at a time per emulator (fibers switch through member state).
#ifndef DQ_TESTS_KERNELS_CUDA_BLOCK_EMULATOR_H_
#define DQ_TESTS_KERNELS_CUDA_BLOCK_EMULATOR_H_

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

namespace dynamiq::testing {

class CudaBlockEmulator {
 public:
  enum class Order { kAscending, kDescending, kRandom };

  // The Block (thread, block, Sync, ShflXor) and Warp (lane, ShflXor, Shfl) interfaces of the
  // kernel bodies.
  class Block {
   public:
    int thread() const { return tid_; }
    int lane() const { return tid_ % 32; }
    uint32_t block() const { return emu_->block_; }
    void Sync() { emu_->Yield(tid_); }
    float ShflXor(float v, int lane_mask) {
      uint32_t bits;
      memcpy(&bits, &v, 4);
      bits = emu_->Exchange(tid_, bits, lane_mask);
      memcpy(&v, &bits, 4);
      return v;
    }
    int ShflXor(int v, int lane_mask) {
      return static_cast<int>(emu_->Exchange(tid_, static_cast<uint32_t>(v), lane_mask));
    }
    uint32_t ShflXor(uint32_t v, int lane_mask) { return emu_->Exchange(tid_, v, lane_mask); }
    // __shfl_sync(full mask, v, src_lane): lane src_lane of this thread's warp.
    uint32_t Shfl(uint32_t v, int src_lane) { return emu_->Read(tid_, v, (tid_ & ~31) | src_lane); }

   private:
    friend class CudaBlockEmulator;
    CudaBlockEmulator* emu_ = nullptr;
    int tid_ = 0;
  };

  CudaBlockEmulator(int threads, Order order, uint32_t seed = 1)
      : threads_(threads),
        order_(order),
        rng_(seed),
        stacks_(static_cast<size_t>(threads) * kStackBytes),
        contexts_(threads),
        blocks_(threads),
        done_(threads),
        barriers_(threads),
        slots_(threads),
        schedule_(threads) {
    for (int t = 0; t < threads; ++t) {
      blocks_[t].emu_ = this;
      blocks_[t].tid_ = t;
    }
  }
  CudaBlockEmulator(const CudaBlockEmulator&) = delete;
  CudaBlockEmulator& operator=(const CudaBlockEmulator&) = delete;

  // Runs fn(block) on every thread of block `block_index` to completion. Returns false if the
  // threads diverged (passed different numbers of barriers).
  bool RunBlock(uint32_t block_index, const std::function<void(Block&)>& fn) {
    block_ = block_index;
    fn_ = &fn;
    for (int t = 0; t < threads_; ++t) {
      getcontext(&contexts_[t]);
      contexts_[t].uc_stack.ss_sp = stacks_.data() + static_cast<size_t>(t) * kStackBytes;
      contexts_[t].uc_stack.ss_size = kStackBytes;
      contexts_[t].uc_link = &scheduler_;
      makecontext(&contexts_[t], &CudaBlockEmulator::Entry, 0);
      done_[t] = false;
      barriers_[t] = 0;
    }
    int live = threads_;
    std::iota(schedule_.begin(), schedule_.end(), 0);
    if (order_ == Order::kDescending) std::reverse(schedule_.begin(), schedule_.end());
    while (live > 0) {
      if (order_ == Order::kRandom) std::shuffle(schedule_.begin(), schedule_.end(), rng_);
      for (int t : schedule_) {
        if (done_[t]) continue;
        running_ = t;
        current_ = this;
        swapcontext(&scheduler_, &contexts_[t]);
        if (done_[t]) --live;
      }
    }
    fn_ = nullptr;
    return std::all_of(barriers_.begin(), barriers_.end(), [&](int b) { return b == barriers_[0]; });
  }

 private:
  static constexpr size_t kStackBytes = 128 * 1024;

  static void Entry() {
    CudaBlockEmulator* self = current_;
    const int t = self->running_;
    (*self->fn_)(self->blocks_[t]);
    self->done_[t] = true;
    // Returning resumes uc_link, the scheduler.
  }

  void Yield(int t) {
    ++barriers_[t];
    swapcontext(&contexts_[t], &scheduler_);
  }

  uint32_t Exchange(int t, uint32_t v, int lane_mask) {
    if (lane_mask <= 0 || lane_mask >= 32) abort();  // shuffles stay inside a warp
    return Read(t, v, t ^ lane_mask);
  }

  // Publishes thread t's v and returns thread `source`'s.
  uint32_t Read(int t, uint32_t v, int source) {
    if (source < 0 || source >= threads_ || (source & ~31) != (t & ~31)) abort();  // inside the warp
    slots_[t] = v;
    Yield(t);
    const uint32_t result = slots_[source];
    Yield(t);  // nobody overwrites a slot before every thread has read it
    return result;
  }

  static inline thread_local CudaBlockEmulator* current_ = nullptr;

  const int threads_;
  const Order order_;
  std::mt19937 rng_;
  std::vector<char> stacks_;
  std::vector<ucontext_t> contexts_;
  std::vector<Block> blocks_;
  std::vector<bool> done_;
  std::vector<int> barriers_;
  std::vector<uint32_t> slots_;
  std::vector<int> schedule_;
  ucontext_t scheduler_;
  uint32_t block_ = 0;
  int running_ = 0;
  const std::function<void(Block&)>* fn_ = nullptr;
};

}  // namespace dynamiq::testing

#endif  // DQ_TESTS_KERNELS_CUDA_BLOCK_EMULATOR_H_

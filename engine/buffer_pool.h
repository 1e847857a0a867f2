// BufferPool: byte buffers kept across collectives, so a steady stream of all-reduces reuses the
// same memory instead of mapping (and page-faulting, and zeroing) fresh megabytes every time.
// The allocator returns large freed blocks to the kernel, and a collective allocates its payload
// buffers anew: at 64 MiB buckets that cost 5-10% of a CPU-bound all-reduce.
//
// Buffers are `Bytes`: vectors whose resize leaves new bytes uninitialized (the users overwrite
// what they use), so reuse costs no memset either. Take hands out a buffer whose capacity is at
// least the size asked (its contents and size are whatever they were); Give takes it back. The pool keeps at most
// `max_buffers` buffers (the largest), so its memory is bounded by what one collective had in use at once. Not
// thread-safe: one pool per thread of collectives (e.g. per transport).
#ifndef DQ_ENGINE_BUFFER_POOL_H_
#define DQ_ENGINE_BUFFER_POOL_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace dynamiq::engine {

// std::allocator, except that value-less construction (resize) default-initializes: for bytes,
// leaves them as they are.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  using std::allocator<T>::allocator;
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

using Bytes = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;

class BufferPool {
 public:
  explicit BufferPool(size_t max_buffers = 256) : max_buffers_(max_buffers) {}

  // A buffer with capacity >= `min_capacity`: the smallest such free one, else the largest free one
  // (grown by the caller's resize), else a new one.
  Bytes Take(size_t min_capacity);
  void Give(Bytes buffer);

  size_t free_buffers() const { return free_.size(); }
  size_t free_bytes() const;

 private:
  size_t max_buffers_;
  std::vector<Bytes> free_;
};

}  // namespace dynamiq::engine

#endif  // DQ_ENGINE_BUFFER_POOL_H_

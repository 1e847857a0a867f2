#include "engine/buffer_pool.h"

#include <algorithm>

namespace dynamiq::engine {

Bytes BufferPool::Take(size_t min_capacity) {
  if (free_.empty()) {
    Bytes fresh;
    fresh.reserve(min_capacity);
    return fresh;
  }
  // Smallest free buffer that fits; else the largest one, to be grown.
  size_t pick = 0;
  bool fits = false;
  for (size_t i = 0; i < free_.size(); ++i) {
    const size_t c = free_[i].capacity();
    if (c >= min_capacity) {
      if (!fits || c < free_[pick].capacity()) pick = i, fits = true;
    } else if (!fits && c > free_[pick].capacity()) {
      pick = i;
    }
  }
  Bytes out = std::move(free_[pick]);
  free_[pick] = std::move(free_.back());
  free_.pop_back();
  if (out.capacity() < min_capacity) {
    out.clear();  // nothing to keep: grow without copying
    out.reserve(min_capacity);
  }
  return out;
}

void BufferPool::Give(Bytes buffer) {
  if (buffer.capacity() == 0 || max_buffers_ == 0) return;
  if (free_.size() >= max_buffers_) {
    // Full: keep the larger of this one and the smallest kept.
    auto smallest = std::min_element(free_.begin(), free_.end(),
                                     [](const Bytes& a, const Bytes& b) { return a.capacity() < b.capacity(); });
    if (smallest->capacity() >= buffer.capacity()) return;
    *smallest = std::move(buffer);
    return;
  }
  free_.push_back(std::move(buffer));
}

size_t BufferPool::free_bytes() const {
  size_t total = 0;
  for (const Bytes& b : free_) total += b.capacity();
  return total;
}

}  // namespace dynamiq::engine

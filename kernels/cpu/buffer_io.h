// Reading Source and writing Dest ranges on the CPU: dtype conversion plus the optional
// per-super-group offsets (see kernels/codec.h). Every CPU codec loads and stores through these.
#ifndef DQ_KERNELS_CPU_BUFFER_IO_H_
#define DQ_KERNELS_CPU_BUFFER_IO_H_

#include <stddef.h>

#include "kernels/codec.h"

namespace dynamiq::kernels {

// out[i] = local element (begin + i) minus its super-group offset, for i < count. With count 0
// nothing is read or written, and `out` and src.data may be null (empty chunks).
void LoadSource(const Source& src, size_t begin, size_t count, float* out);

// Destination element (begin + i) = in[i] plus its super-group offset, rounded to dest's dtype.
// With count 0 nothing is touched and the pointers may be null.
void StoreDest(const Dest& dst, size_t begin, size_t count, const float* in);

// Element `begin` of plain fp32 memory (no dtype conversion, no per-group offset), which fast
// paths read and write directly; null when the Source/Dest is not plain fp32 or has no data.
const float* PlainFloats(const Source& src, size_t begin);
float* PlainFloats(const Dest& dst, size_t begin);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_BUFFER_IO_H_

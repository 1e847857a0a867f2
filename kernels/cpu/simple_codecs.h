// The uncompressed baselines: "none" (fp32, lossless: the exact ring sum in schedule order) and
// "bf16" (round to nearest even at every hop, what a bf16 NCCL all-reduce does). Payloads are
// the raw little-endian values: 32 and 16 bits/coord plus the 32-byte header.
#ifndef DQ_KERNELS_CPU_SIMPLE_CODECS_H_
#define DQ_KERNELS_CPU_SIMPLE_CODECS_H_

#include <memory>

#include "kernels/codec.h"

namespace dynamiq::kernels {

// config.id must be kNone or kBf16.
std::unique_ptr<Codec> NewSimpleCodec(const CodecConfig& config);

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_SIMPLE_CODECS_H_

// BucketTransform: runs a codec's whole-bucket transform (Codec::NeedsBucketTransform, THC's
// rotation) around an all-reduce. Forward loads a rank's d values into a buffer of
// codec.TransformedLength(d) floats (zero-padded) and transforms it; the all-reduce then runs on
// that buffer in place (source() and dest() are the same fp32 memory, size() elements); InverseInto
// transforms the summed buffer back and stores its first d values into the caller's output.
//
// The engines (engine/allreduce.h, engine/simulator.h) make one per collective and rank; the
// round passed to Forward must be the one the codec's plans get (its `round` keys the transform).
//
// Thread safety: one object per rank and collective; not shared.
#ifndef DQ_KERNELS_CPU_BUCKET_TRANSFORM_H_
#define DQ_KERNELS_CPU_BUCKET_TRANSFORM_H_

#include <stddef.h>

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec.h"

namespace dynamiq::kernels {

class BucketTransform {
 public:
  // Reads local[0, d) (any dtype; Source::subtract_per_group must be unset) and transforms it.
  // Fails if the codec needs no transform or refuses the length.
  static absl::StatusOr<BucketTransform> Forward(const Codec& codec, const RoundInfo& round, const Source& local,
                                                 size_t d);

  // The transformed bucket as the all-reduce's input and output (in place).
  Source source() const { return Source{values_.data(), DType::kFloat32, 0, nullptr}; }
  Dest dest() { return Dest{values_.data(), DType::kFloat32, 0, nullptr}; }
  size_t size() const { return values_.size(); }

  // Inverse transform of the buffer (by now the all-reduced sum), then out[0, d) = its first d
  // values (Dest::add_per_group must be unset). Call once.
  absl::Status InverseInto(const Dest& out);

 private:
  BucketTransform(const Codec& codec, const RoundInfo& round, size_t d, size_t length)
      : codec_(&codec), round_(round), d_(d), values_(length, 0.0f) {}

  const Codec* codec_;
  RoundInfo round_;
  size_t d_;
  std::vector<float> values_;
};

}  // namespace dynamiq::kernels

#endif  // DQ_KERNELS_CPU_BUCKET_TRANSFORM_H_

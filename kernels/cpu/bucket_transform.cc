#include "kernels/cpu/bucket_transform.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/codec_info.h"
#include "kernels/cpu/buffer_io.h"

namespace dynamiq::kernels {

absl::StatusOr<BucketTransform> BucketTransform::Forward(const Codec& codec, const RoundInfo& round,
                                                         const Source& local, size_t d) {
  if (!codec.NeedsBucketTransform()) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", CodecName(codec.id()), " has no bucket transform"));
  }
  if (local.subtract_per_group != nullptr) {
    return absl::InvalidArgumentError("a transformed bucket cannot subtract per-group offsets");
  }
  DQ_ASSIGN_OR_RETURN(const size_t length, codec.TransformedLength(d));
  if (length < d) {
    return absl::InternalError(absl::StrCat("transformed length ", length, " is below the bucket's ", d));
  }
  BucketTransform t(codec, round, d, length);
  LoadSource(local, 0, d, t.values_.data());
  DQ_RETURN_IF_ERROR(codec.ForwardTransform(round, absl::MakeSpan(t.values_)));
  return t;
}

absl::Status BucketTransform::InverseInto(const Dest& out) {
  if (out.add_per_group != nullptr) {
    return absl::InvalidArgumentError("a transformed bucket cannot add per-group offsets");
  }
  DQ_RETURN_IF_ERROR(codec_->InverseTransform(round_, absl::MakeSpan(values_)));
  StoreDest(out, 0, d_, values_.data());
  return absl::OkStatus();
}

}  // namespace dynamiq::kernels

#include "kernels/codec_cache.h"

#include "common/status_macros.h"
#include "kernels/codec_registry.h"

namespace dynamiq::kernels {
namespace {

bool SameCodec(const CodecConfig& a, const CodecConfig& b) {
  return a.id == b.id && a.bits == b.bits && a.allocator == b.allocator && a.levels == b.levels &&
         a.correlated_rounding == b.correlated_rounding && a.seed == b.seed;
}

}  // namespace

absl::StatusOr<Codec*> CodecCache::Get(const CodecConfig& config) {
  for (const auto& [cached, codec] : codecs_) {
    if (SameCodec(cached, config)) return codec.get();
  }
  DQ_ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, CreateCodec(config));
  if (codecs_.size() >= capacity_) codecs_.erase(codecs_.begin());
  codecs_.emplace_back(config, std::move(codec));
  return codecs_.back().second.get();
}

}  // namespace dynamiq::kernels

#include "common/grpc_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace dynamiq::common {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  constexpr size_t kMaxMessageBytes = 2048;
  const absl::string_view message = s.message();
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      message.size() <= kMaxMessageBytes
                          ? std::string(message)
                          : absl::StrCat(message.substr(0, kMaxMessageBytes), "... (", message.size(), " bytes)"));
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace dynamiq::common

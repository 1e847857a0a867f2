// Conversions between absl::Status and grpc::Status: the one place a status crosses gRPC, for the
// daemon's services and stores and for the clients. The codes are the same canonical set in both;
// a message going out is cut to 2 KiB (it travels as grpc-message metadata, which gRPC limits to
// 8 KiB in all), naming its full length.
#ifndef DQ_COMMON_GRPC_STATUS_H_
#define DQ_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace dynamiq::common {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace dynamiq::common

#endif  // DQ_COMMON_GRPC_STATUS_H_

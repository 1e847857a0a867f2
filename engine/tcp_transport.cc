#include "engine/tcp_transport.h"

#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/tcp_mesh.h"

namespace dynamiq::engine {

absl::StatusOr<std::unique_ptr<Transport>> ConnectTcpTransport(Store& store, int rank, int size,
                                                               const TcpTransportOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("tcp transport: rank ", rank, " of a group of ", size));
  }
  // A mesh for one transport: its connections close with the transport's abort.
  TcpMesh mesh(rank, size, options, /*keep_connections=*/false);
  std::vector<int> everyone(size);
  std::iota(everyone.begin(), everyone.end(), 0);
  return mesh.Connect(store, everyone, TcpMeshSession{});
}

}  // namespace dynamiq::engine

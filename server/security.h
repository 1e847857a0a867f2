// Security of dynamiqd's TCP port and of the traffic between daemons (docs/security.md):
//   - operator token: every dynamiq.v1.Control call must carry "authorization: Bearer <token>"
//     with a token from --operator_token_file (BearerAuthenticator, reloaded when the file changes);
//   - cluster secret (--cluster_secret_file, the same on every node): the Rendezvous service only
//     serves callers presenting a bearer token derived from it (RendezvousToken), and every engine
//     message between daemons carries an HMAC tag under a per-job key derived from it
//     (engine/step_auth.h);
//   - TLS (--tls_cert/--tls_key): the operator/peer gRPC port speaks TLS; clients (dynamiqctl,
//     other daemons' rendezvous calls) verify it against --tls_ca.
// grpc.health.v1 and reflection stay open (probes). Every mechanism is off when its flag is unset.
//
// LoadServerSecurity reads and validates every file once at startup, so a daemon with a bad file
// refuses to start with a message naming the flag, the path and the fix.
#ifndef DQ_SERVER_SECURITY_H_
#define DQ_SERVER_SECURITY_H_

#include <stdint.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/store.h"
#include "server/bearer_auth.h"

namespace grpc {
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace dynamiq::server {

struct SecurityOptions {
  std::string operator_token_file;  // --operator_token_file
  std::string cluster_secret_file;  // --cluster_secret_file
  std::string tls_cert_file;        // --tls_cert (PEM certificate chain)
  std::string tls_key_file;         // --tls_key (PEM private key, owner-only mode)
  std::string tls_ca_file;          // --tls_ca (PEM CA certificates that sign the coordinator's)
};

struct ServerSecurity {
  // Null when the flag is unset.
  std::unique_ptr<BearerAuthenticator> operator_auth;
  std::unique_ptr<BearerAuthenticator> rendezvous_auth;  // coordinator side
  // Empty without a cluster secret.
  std::string cluster_secret;
  std::string rendezvous_token;  // what this node presents to the coordinator
  // The TCP server's credentials (TLS or insecure).
  std::shared_ptr<grpc::ServerCredentials> server_credentials;
  // TLS credentials of this node's calls to the coordinator; null without --tls_ca (insecure).
  std::shared_ptr<grpc::ChannelCredentials> channel_credentials;
};

// Reads and checks every file named in `options`. `num_nodes` > 1 with --tls_cert requires
// --tls_ca (every node, the coordinator included, calls the coordinator's TLS port).
absl::StatusOr<ServerSecurity> LoadServerSecurity(const SecurityOptions& options, uint32_t num_nodes);

// The Rendezvous bearer token of a cluster secret: hex HMAC-SHA256(secret, "dynamiq rendezvous v1").
// Not the secret itself, which never leaves the node.
std::string RendezvousToken(const std::string& cluster_secret);

// Multi-node: node 0 publishes whether the cluster authenticates its engine messages, and every
// other node checks that it agrees (a node with a secret would otherwise join a coordinator without
// one, since that coordinator checks nothing). FAILED_PRECONDITION naming both sides if not.
absl::Status AgreeOnClusterAuthentication(engine::Store& store, uint32_t node_rank, bool has_secret,
                                          absl::Duration timeout);

}  // namespace dynamiq::server

#endif  // DQ_SERVER_SECURITY_H_

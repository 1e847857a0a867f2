#include "server/security.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "absl/strings/str_cat.h"
#include "common/hmac.h"
#include "common/secret_file.h"
#include "common/status_macros.h"

namespace dynamiq::server {
namespace {

constexpr absl::string_view kAuthenticationKey = "cluster/authentication";

// RAII for the OpenSSL objects used to check PEM files.
struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioDeleter> MemoryBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioDeleter>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of a PEM bundle; INVALID_ARGUMENT if there is none.
absl::StatusOr<std::unique_ptr<X509, X509Deleter>> ParseCertificate(const std::string& pem, absl::string_view flag,
                                                                    const std::string& path) {
  auto bio = MemoryBio(pem);
  std::unique_ptr<X509, X509Deleter> cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
  ERR_clear_error();
  if (!cert) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " holds no PEM certificate"));
  }
  return cert;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsServerCredentials(const SecurityOptions& o) {
  DQ_ASSIGN_OR_RETURN(std::string cert_pem, common::ReadPublicFile(o.tls_cert_file, "--tls_cert"));
  DQ_ASSIGN_OR_RETURN(std::string key_pem, common::ReadSecretFile(o.tls_key_file, "--tls_key"));
  // Checked here so that a bad file is named, instead of the gRPC server failing to start.
  DQ_ASSIGN_OR_RETURN(auto cert, ParseCertificate(cert_pem, "--tls_cert", o.tls_cert_file));
  auto bio = MemoryBio(key_pem);
  std::unique_ptr<EVP_PKEY, KeyDeleter> key(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr)
                                                : nullptr);
  ERR_clear_error();
  if (!key) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key: ", o.tls_key_file, " holds no (unencrypted) PEM private key"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key: ", o.tls_key_file, " is not the private key of the certificate in ", o.tls_cert_file));
  }
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({std::move(key_pem), std::move(cert_pem)});
  // Clients authenticate with bearer tokens, not certificates.
  ssl.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

std::string RendezvousToken(const std::string& cluster_secret) {
  return common::HexEncode(common::HmacSha256(cluster_secret).Mac("dynamiq rendezvous v1"));
}

absl::StatusOr<ServerSecurity> LoadServerSecurity(const SecurityOptions& o, uint32_t num_nodes) {
  ServerSecurity s;
  if (!o.operator_token_file.empty()) {
    DQ_ASSIGN_OR_RETURN(
        s.operator_auth,
        BearerAuthenticator::FromFile(
            o.operator_token_file, "--operator_token_file",
            {"dynamiq.v1.Control requires an operator token: send the metadata 'authorization: Bearer <token>' "
             "(dynamiqctl --token_file, or DQ_TOKEN_FILE)",
             "the operator token presented is not accepted by this dynamiqd (see its --operator_token_file)"}));
  }
  if (!o.cluster_secret_file.empty()) {
    DQ_ASSIGN_OR_RETURN(s.cluster_secret, common::ReadSecret(o.cluster_secret_file, "--cluster_secret_file"));
    s.rendezvous_token = RendezvousToken(s.cluster_secret);
    s.rendezvous_auth = std::make_unique<BearerAuthenticator>(
        std::vector<std::string>{s.rendezvous_token},
        BearerAuthenticator::Messages{
            "dynamiq.v1.Rendezvous requires the cluster secret: start every node with the same --cluster_secret_file",
            "the caller's cluster secret does not match the coordinator's (--cluster_secret_file must be the same "
            "on every node)"});
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  if (!o.tls_cert_file.empty()) {
    if (num_nodes > 1 && o.tls_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_cert on a multi-node cluster needs --tls_ca: every node calls the coordinator's TLS port and "
          "verifies its certificate against --tls_ca");
    }
    DQ_ASSIGN_OR_RETURN(s.server_credentials, TlsServerCredentials(o));
  } else {
    s.server_credentials = grpc::InsecureServerCredentials();
  }
  if (!o.tls_ca_file.empty()) {
    DQ_ASSIGN_OR_RETURN(std::string ca, common::ReadPublicFile(o.tls_ca_file, "--tls_ca"));
    DQ_RETURN_IF_ERROR(ParseCertificate(ca, "--tls_ca", o.tls_ca_file).status());
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = std::move(ca);
    s.channel_credentials = grpc::SslCredentials(ssl);
  }
  return s;
}

absl::Status AgreeOnClusterAuthentication(engine::Store& store, uint32_t node_rank, bool has_secret,
                                          absl::Duration timeout) {
  const std::string mine = has_secret ? "hmac-sha256" : "none";
  if (node_rank == 0) return store.Set(kAuthenticationKey, mine);
  DQ_ASSIGN_OR_RETURN(std::string theirs, store.Get(kAuthenticationKey, timeout));
  if (theirs == mine) return absl::OkStatus();
  if (has_secret) {
    return absl::FailedPreconditionError(
        "this node has --cluster_secret_file but node 0 (the coordinator) runs without one: every node needs the "
        "same secret");
  }
  return absl::FailedPreconditionError(absl::StrCat("node 0 authenticates the cluster's traffic (", theirs,
                                                    ") but this node has no --cluster_secret_file"));
}

}  // namespace dynamiq::server

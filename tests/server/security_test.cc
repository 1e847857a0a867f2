// dynamiqd's security end to end (docs/security.md): the operator token on every Control method,
// its rotation, TLS with the dynamiqctl binary, the cluster secret at rendezvous and on the
// engine's messages between two daemons, the worker socket against another uid, and the
// shared-memory segments' mode and lifetime.
#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "dynamiq/client.h"
#include "dynamiq/v1/control.grpc.pb.h"
#include "engine/memory_transport.h"
#include "engine/step_auth.h"
#include "engine/store.h"
#include "gtest/gtest.h"
#include "ipc/shm_region.h"
#include "server/cluster.h"
#include "server/daemon.h"
#include "server/grpc_store.h"
#include "server/job.h"
#include "server/metrics.h"
#include "server/rendezvous_service.h"
#include "server/security.h"
#include "tests/testing/daemon_harness.h"
#include "tests/testing/raw_tcp_peer.h"
#include "tests/testing/status_matchers.h"
#include "tools/dynamiqctl/ctl.h"

namespace dynamiq::server {
namespace {

using ::dynamiq::Client;
using ::dynamiq::ClientOptions;
using ::dynamiq::testing::IsOk;
using ::dynamiq::testing::RejectedRequests;
using ::dynamiq::testing::StatusIs;
using ::dynamiq::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "operator-token-0123456789abcdef";
constexpr char kSecret[] = "cluster-secret-0123456789abcdef0123456789";

std::string WriteFile(const std::string& path, const std::string& contents, mode_t mode = 0600) {
  std::ofstream(path, std::ios::trunc) << contents;
  chmod(path.c_str(), mode);
  return path;
}

DaemonOptions Options(const std::string& dir, uint32_t rank = 0, uint32_t nodes = 1) {
  DaemonOptions o;
  o.node_rank = rank;
  o.num_nodes = nodes;
  o.listen = "127.0.0.1:0";
  o.worker_socket = absl::StrCat(dir, "/node", rank, ".sock");
  o.default_config = *MakeJobConfig("dynamiq", 5, "ring", 1024, "measured");
  o.timeout = absl::Seconds(20);
  return o;
}

ctl::ConnectOptions Connect(const Daemon& daemon, const std::string& token = "") {
  ctl::ConnectOptions c;
  c.daemon = daemon.listen_address();
  c.timeout = absl::Seconds(10);
  c.token = token;
  return c;
}

// Calls every method of dynamiq.v1.Control (from its descriptor, so a method added later is
// covered too) with an empty request and the given authorization metadata (empty: none).
std::vector<std::pair<std::string, grpc::Status>> CallEveryControlMethod(const std::string& address,
                                                                         const std::string& authorization) {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName("dynamiq.v1.Control");
  if (service == nullptr) return {};
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  std::vector<std::pair<std::string, grpc::Status>> out;
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string method = absl::StrCat("/", service->full_name(), "/", service->method(i)->name());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!authorization.empty()) context.AddMetadata("authorization", authorization);
    grpc::Slice empty(std::string{});  // zero bytes: a valid encoding of every request message
    grpc::ByteBuffer request(&empty, 1), response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                   [&](grpc::Status s) { done.set_value(std::move(s)); });
    out.emplace_back(method, done.get_future().get());
  }
  return out;
}

TEST(OperatorTokenTest, EveryControlMethodNeedsTheTokenAndRefusalsAreCounted) {
  TempDir temp;
  const std::string dir = temp.path();
  DaemonOptions o = Options(dir);
  o.security.operator_token_file = WriteFile(dir + "/token", absl::StrCat(kToken, "\n"));
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  EXPECT_EQ(RejectedRequests(daemon, "unauthenticated"), 0);

  auto missing = CallEveryControlMethod(daemon.listen_address(), "");
  ASSERT_GE(missing.size(), 3u);
  for (const auto& [method, s] : missing) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << method << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("requires an operator token")) << method;
  }
  auto wrong = CallEveryControlMethod(daemon.listen_address(), "Bearer operator-token-0123456789abcdeX");
  for (const auto& [method, s] : wrong) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << method;
    EXPECT_THAT(s.error_message(), AllOf(HasSubstr("not accepted"), Not(HasSubstr("0123456789")))) << method;
  }
  auto not_bearer = CallEveryControlMethod(daemon.listen_address(), absl::StrCat("Basic ", kToken));
  for (const auto& [method, s] : not_bearer) EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << method;
  EXPECT_EQ(RejectedRequests(daemon, "unauthenticated"), 3.0 * missing.size());

  // The right token (any case of the scheme): the handlers run (and judge the empty requests).
  for (const auto& [method, s] : CallEveryControlMethod(daemon.listen_address(), absl::StrCat("bearer ", kToken))) {
    EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << method << ": " << s.error_message();
  }
  ctl::ControlClient client(Connect(daemon, kToken));
  EXPECT_THAT(client.GetStatus(), IsOk());
  EXPECT_THAT(ctl::ControlClient(Connect(daemon)).GetStatus(), StatusIs(absl::StatusCode::kUnauthenticated));
  // Probes stay open.
  EXPECT_THAT(ctl::ControlClient(Connect(daemon)).CheckHealth(""), IsOk());
  EXPECT_EQ(*ctl::ControlClient(Connect(daemon)).CheckHealth("dynamiq.v1.Control"),
            grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(RejectedRequests(daemon, "unauthenticated"), 3.0 * missing.size() + 1);
}

TEST(OperatorTokenTest, WithoutAFileControlStaysOpen) {
  TempDir temp;
  Daemon daemon(Options(temp.path()));
  ASSERT_THAT(daemon.Start(), IsOk());
  EXPECT_THAT(ctl::ControlClient(Connect(daemon)).GetStatus(), IsOk());
}

TEST(OperatorTokenTest, RotatesWithoutARestart) {
  TempDir temp;
  const std::string dir = temp.path();
  DaemonOptions o = Options(dir);
  const std::string file = WriteFile(dir + "/token", "old-token-0123456789abcdef\n");
  o.security.operator_token_file = file;
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  auto status_with = [&](const std::string& token) { return ctl::ControlClient(Connect(daemon, token)).GetStatus(); };
  EXPECT_THAT(status_with("old-token-0123456789abcdef"), IsOk());
  EXPECT_THAT(status_with("new-token-0123456789abcdef"), StatusIs(absl::StatusCode::kUnauthenticated));
  // Both accepted during the change-over (the file is checked at most once a second).
  WriteFile(file, "old-token-0123456789abcdef\nnew-token-0123456789abcdef\n");
  bool accepted = false;
  for (int i = 0; i < 50 && !accepted; ++i) {
    accepted = status_with("new-token-0123456789abcdef").ok();
    if (!accepted) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(accepted);
  EXPECT_THAT(status_with("old-token-0123456789abcdef"), IsOk());
  // A broken file (mode 0644) keeps the tokens in force; fixing its mode (nothing else) applies it.
  WriteFile(file, "new-token-0123456789abcdef\n", 0644);
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_THAT(status_with("old-token-0123456789abcdef"), IsOk());
  ASSERT_EQ(chmod(file.c_str(), 0600), 0);
  bool refused = false;
  for (int i = 0; i < 50 && !refused; ++i) {
    refused = absl::IsUnauthenticated(status_with("old-token-0123456789abcdef").status());
    if (!refused) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(refused);
  EXPECT_THAT(status_with("new-token-0123456789abcdef"), IsOk());
}

TEST(SecurityFilesTest, BadFilesStopTheDaemonWithAClearMessage) {
  TempDir temp;
  const std::string dir = temp.path();
  struct Case {
    std::string name;
    std::function<void(SecurityOptions&)> set;
    absl::StatusCode code;
    std::string message;
  };
  const std::string loose = WriteFile(dir + "/loose", absl::StrCat(kToken, "\n"), 0640);
  const std::string good = WriteFile(dir + "/good", absl::StrCat(kToken, "\n"));
  const std::string short_secret = WriteFile(dir + "/short", "tiny\n");
  const std::vector<Case> cases = {
      {"world-readable token", [&](SecurityOptions& s) { s.operator_token_file = loose; },
       absl::StatusCode::kFailedPrecondition, absl::StrCat("--operator_token_file: ", loose, " has mode 0640")},
      {"missing token", [&](SecurityOptions& s) { s.operator_token_file = dir + "/nope"; }, absl::StatusCode::kNotFound,
       "--operator_token_file: cannot open"},
      {"group-readable secret", [&](SecurityOptions& s) { s.cluster_secret_file = loose; },
       absl::StatusCode::kFailedPrecondition, "--cluster_secret_file"},
      {"short secret", [&](SecurityOptions& s) { s.cluster_secret_file = short_secret; },
       absl::StatusCode::kInvalidArgument, "openssl rand -hex 32"},
      {"cert without key", [&](SecurityOptions& s) { s.tls_cert_file = good; }, absl::StatusCode::kInvalidArgument,
       "--tls_cert and --tls_key must be given together"},
      {"not a certificate",
       [&](SecurityOptions& s) {
         s.tls_cert_file = good;
         s.tls_key_file = good;
       },
       absl::StatusCode::kInvalidArgument, "holds no PEM certificate"},
  };
  for (const Case& c : cases) {
    DaemonOptions o = Options(dir);
    c.set(o.security);
    Daemon daemon(o);
    EXPECT_THAT(daemon.Start(), StatusIs(c.code, HasSubstr(c.message))) << c.name;
  }
}

// A CA and a server certificate for 127.0.0.1 and localhost, made with the openssl CLI.
class Tls {
 public:
  explicit Tls(const std::string& dir) : dir_(dir) {}
  // False (with the command's output) when openssl fails.
  bool Generate(std::string* log) {
    const std::string script = absl::StrCat(
        "set -e; cd ", dir_, "; umask 077\n",
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=dynamiq-test-ca\n",
        "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=dynamiqd\n",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext\n",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 "
        "-extfile san.ext\n",
        // An unrelated CA, to show that verification really happens.
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other.pem -days 2 -subj /CN=other-ca\n",
        "chmod 644 ca.pem server.pem other.pem\n");
    const std::string file = dir_ + "/make-certs.sh";
    std::ofstream(file) << script;
    FILE* pipe = popen(absl::StrCat("bash ", file, " 2>&1").c_str(), "r");
    if (pipe == nullptr) return false;
    char buffer[4096];
    size_t n;
    while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) log->append(buffer, n);
    return pclose(pipe) == 0;
  }
  std::string ca() const { return dir_ + "/ca.pem"; }
  std::string other_ca() const { return dir_ + "/other.pem"; }
  std::string cert() const { return dir_ + "/server.pem"; }
  std::string key() const { return dir_ + "/server.key"; }

 private:
  std::string dir_;
};

struct Process {
  int code = -1;
  std::string out, err;
};

Process RunCommand(const std::string& command) {
  char tmpl[] = "/tmp/dqsec-err-XXXXXX";
  const int fd = mkstemp(tmpl);
  close(fd);
  Process p;
  FILE* pipe = popen(absl::StrCat(command, " 2>", tmpl).c_str(), "r");
  if (pipe == nullptr) return p;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) p.out.append(buffer, n);
  const int status = pclose(pipe);
  p.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(tmpl);
  p.err.assign(std::istreambuf_iterator<char>(err), std::istreambuf_iterator<char>());
  unlink(tmpl);
  return p;
}

TEST(TlsTest, DynamiqctlRoundTripOverTlsWithAToken) {
  TempDir temp;
  const std::string dir = temp.path();
  Tls tls(dir);
  std::string log;
  ASSERT_TRUE(tls.Generate(&log)) << log;
  DaemonOptions o = Options(dir);
  o.security.tls_cert_file = tls.cert();
  o.security.tls_key_file = tls.key();
  o.security.operator_token_file = WriteFile(dir + "/token", absl::StrCat(kToken, "\n"));
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  const std::string ctl = absl::StrCat(DQ_DYNAMIQCTL, " --timeout=5 --daemon=", daemon.listen_address());

  Process p = RunCommand(absl::StrCat(ctl, " --tls_ca=", tls.ca(), " --token_file=", dir, "/token --json status"));
  EXPECT_EQ(p.code, 0) << p.err;
  EXPECT_THAT(p.out, HasSubstr("\"num_nodes\":1"));
  // The token from the environment, as documented.
  p = RunCommand(absl::StrCat("DQ_TOKEN_FILE=", dir, "/token ", ctl, " --tls_ca=", tls.ca(), " --json status"));
  EXPECT_EQ(p.code, 0) << p.err;
  // "localhost" is in the certificate too.
  p = RunCommand(absl::StrCat(DQ_DYNAMIQCTL, " --timeout=5 --daemon=localhost:",
                              daemon.listen_address().substr(daemon.listen_address().rfind(':') + 1),
                              " --tls_ca=", tls.ca(), " health"));
  EXPECT_EQ(p.code, 0) << p.err;
  // Health needs no token; TLS is still required.
  p = RunCommand(absl::StrCat(ctl, " --tls_ca=", tls.ca(), " health"));
  EXPECT_EQ(p.code, 0) << p.err;
  p = RunCommand(absl::StrCat(ctl, " --tls_ca=", tls.ca(), " status"));
  EXPECT_EQ(p.code, 1);
  EXPECT_THAT(p.err, HasSubstr("UNAUTHENTICATED: dynamiq.v1.Control requires an operator token"));
  // Plaintext against the TLS port, and a CA that did not sign the certificate, both fail.
  p = RunCommand(absl::StrCat(ctl, " --token_file=", dir, "/token status"));
  EXPECT_EQ(p.code, 1);
  EXPECT_THAT(p.err, HasSubstr("UNAVAILABLE"));
  p = RunCommand(absl::StrCat(ctl, " --tls_ca=", tls.other_ca(), " --token_file=", dir, "/token status"));
  EXPECT_EQ(p.code, 1);
  EXPECT_THAT(p.err, HasSubstr("UNAVAILABLE"));
  // A token file others can read is refused by the client too.
  WriteFile(dir + "/loose", absl::StrCat(kToken, "\n"), 0644);
  p = RunCommand(absl::StrCat(ctl, " --tls_ca=", tls.ca(), " --token_file=", dir, "/loose status"));
  EXPECT_EQ(p.code, 1);
  EXPECT_THAT(p.err, HasSubstr("has mode 0644"));
  // --help documents both flags.
  p = RunCommand(absl::StrCat(DQ_DYNAMIQCTL, " --help"));
  EXPECT_THAT(p.out, AllOf(HasSubstr("--token_file"), HasSubstr("--tls_ca"), HasSubstr("DQ_TOKEN_FILE")));
}

// Two daemons forming a cluster with the given security options (node 0 first, the others once
// it listens). Returns each node's Start status; the daemons stay up for the caller.
std::vector<absl::Status> StartCluster(const std::string& dir, const std::vector<SecurityOptions>& security,
                                       std::vector<std::unique_ptr<Daemon>>& daemons,
                                       absl::Duration timeout = absl::Seconds(20)) {
  const uint32_t nodes = static_cast<uint32_t>(security.size());
  std::vector<absl::Status> status(nodes);
  DaemonOptions o0 = Options(dir, 0, nodes);
  o0.security = security[0];
  o0.timeout = timeout;
  daemons.push_back(std::make_unique<Daemon>(o0));
  std::vector<std::thread> threads;
  threads.emplace_back([&] { status[0] = daemons[0]->Start(); });
  for (int i = 0; i < 1000 && daemons[0]->listen_address().empty(); ++i) absl::SleepFor(absl::Milliseconds(10));
  for (uint32_t r = 1; r < nodes; ++r) {
    DaemonOptions o = Options(dir, r, nodes);
    o.coordinator = daemons[0]->listen_address();
    o.security = security[r];
    o.timeout = timeout;
    daemons.push_back(std::make_unique<Daemon>(o));
  }
  for (uint32_t r = 1; r < nodes; ++r) threads.emplace_back([&, r] { status[r] = daemons[r]->Start(); });
  for (auto& t : threads) t.join();
  return status;
}

// One worker of job "job" on each node of a StartCluster cluster, holding `n` floats set by
// `value(node, k)`.
std::vector<testing::DaemonTestWorker> WorkerPerNode(const std::string& dir, size_t n,
                                                     const std::function<float(uint32_t, size_t)>& value) {
  auto workers = testing::ConnectTestWorkers(dir, 2, 1, n);
  EXPECT_THAT(workers, IsOk());
  if (!workers.ok()) return {};
  for (uint32_t r = 0; r < 2; ++r) {
    for (size_t k = 0; k < n; ++k) (*workers)[r].data()[k] = value(r, k);
  }
  return *std::move(workers);
}

TEST(ClusterSecretTest, ANodeWithAnotherSecretCannotJoin) {
  TempDir temp;
  const std::string dir = temp.path();
  SecurityOptions a, b, none;
  a.cluster_secret_file = WriteFile(dir + "/a", kSecret);
  b.cluster_secret_file = WriteFile(dir + "/b", "another-secret-0123456789abcdef");
  std::vector<std::unique_ptr<Daemon>> daemons;
  // Node 0 waits for a node that never joins: its timeout bounds the test.
  const absl::Time start = absl::Now();
  std::vector<absl::Status> status = StartCluster(dir, {a, b}, daemons, absl::Seconds(3));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_THAT(status[1], StatusIs(absl::StatusCode::kUnauthenticated,
                                  AllOf(HasSubstr("joining the cluster"), HasSubstr("does not match"))));
  EXPECT_FALSE(status[0].ok());
  EXPECT_GE(RejectedRequests(*daemons[0], "unauthenticated"), 1);

  // No secret at all: refused too, with a message that says what is missing.
  daemons.clear();
  status = StartCluster(dir, {a, none}, daemons, absl::Seconds(3));
  EXPECT_THAT(status[1], StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("requires the cluster secret")));

  // A node with a secret does not join a coordinator without one (which would check nothing).
  daemons.clear();
  status = StartCluster(dir, {none, a}, daemons, absl::Seconds(3));
  EXPECT_THAT(status[1], StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("runs without one")));
}

TEST(ClusterSecretTest, StrayProcessCannotUseTheRendezvous) {
  // What a stray process on the network sees at the coordinator's port.
  TempDir temp;
  const std::string dir = temp.path();
  SecurityOptions a;
  a.cluster_secret_file = WriteFile(dir + "/a", kSecret);
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<absl::Status> status = StartCluster(dir, {a, a}, daemons);
  ASSERT_THAT(status[0], IsOk());
  ASSERT_THAT(status[1], IsOk());
  auto channel = grpc::CreateChannel(daemons[0]->listen_address(), grpc::InsecureChannelCredentials());
  auto stub = dynamiq::v1::Rendezvous::NewStub(channel);
  for (const std::string& token : {std::string(), std::string("wrong-token-0123456789abcdef"),
                                   RendezvousToken("another-secret-0123456789abcdef")}) {
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    dynamiq::v1::StoreSetRequest request;
    request.set_key("job/x/gen0/rank0");
    request.set_value("10.9.9.9:1");
    dynamiq::v1::StoreSetResponse response;
    EXPECT_EQ(stub->Set(&context, request, &response).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    // Nor can it delete what the nodes agreed on.
    grpc::ClientContext delete_context;
    if (!token.empty()) delete_context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    dynamiq::v1::StoreDeleteRequest deletion;
    deletion.set_prefix("cluster/");
    dynamiq::v1::StoreDeleteResponse deleted;
    EXPECT_EQ(stub->Delete(&delete_context, deletion, &deleted).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", RendezvousToken(kSecret)));
  dynamiq::v1::StoreGetRequest request;
  request.set_key("cluster/authentication");
  dynamiq::v1::StoreGetResponse response;
  ASSERT_TRUE(stub->Get(&context, request, &response).ok());
  EXPECT_EQ(response.value(), "hmac-sha256");
}

TEST(ClusterSecretTest, TwoNodesAllReduceWithAuthenticatedMessagesOverTlsRendezvous) {
  TempDir temp;
  const std::string dir = temp.path();
  Tls tls(dir);
  std::string log;
  ASSERT_TRUE(tls.Generate(&log)) << log;
  SecurityOptions s;
  s.cluster_secret_file = WriteFile(dir + "/secret", kSecret);
  s.tls_cert_file = tls.cert();
  s.tls_key_file = tls.key();
  s.tls_ca_file = tls.ca();
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<absl::Status> status = StartCluster(dir, {s, s}, daemons);
  ASSERT_THAT(status[0], IsOk());
  ASSERT_THAT(status[1], IsOk());
  const size_t n = 50000;
  std::vector<testing::DaemonTestWorker> workers =
      WorkerPerNode(dir, n, [](uint32_t r, size_t k) { return static_cast<float>((k % 7) + r); });
  ASSERT_EQ(workers.size(), 2u);
  std::vector<grpc::Status> results(2);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) threads.emplace_back([&, r] { results[r] = workers[r].AllReduce("g", n); });
  for (auto& t : threads) t.join();
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].error_message();
    // Compressed (dynamiq, 5 bits): close to the exact sum, not equal.
    double error = 0, norm = 0;
    for (size_t k = 0; k < n; ++k) {
      const double exact = 2.0 * (k % 7) + 1;
      error += (workers[r].data()[k] - exact) * (workers[r].data()[k] - exact);
      norm += exact * exact;
    }
    EXPECT_LT(error / norm, 1e-2);
  }
  EXPECT_EQ(0, std::memcmp(workers[0].data(), workers[1].data(), n * sizeof(float)));
}

// A process that finds a job's transport port (here: from the coordinator's store; in the wild: a
// port scan) and claims node 1's rank before node 1 connects is turned away, plain hello or keyed
// without proof, and the real node 1 joins: the hellos prove the job's key (engine/tcp_hello.h).
TEST(ClusterSecretTest, AStrangerOnTheTransportPortCannotTakeANodesPlace) {
  TempDir temp;
  const std::string dir = temp.path();
  SecurityOptions s;
  s.cluster_secret_file = WriteFile(dir + "/secret", kSecret);
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<absl::Status> status = StartCluster(dir, {s, s}, daemons);
  ASSERT_THAT(status[0], IsOk());
  ASSERT_THAT(status[1], IsOk());
  const size_t n = 4096;
  std::vector<testing::DaemonTestWorker> workers =
      WorkerPerNode(dir, n, [](uint32_t, size_t k) { return static_cast<float>(k % 5); });
  ASSERT_EQ(workers.size(), 2u);
  std::vector<grpc::Status> results(2);
  std::thread node0([&] { results[0] = workers[0].AllReduce("g", n); });
  // Node 0's group now listens for rank 1.
  GrpcStore store(daemons[0]->listen_address(), nullptr, RendezvousToken(kSecret));
  engine::PrefixStore group(Cluster::RendezvousPrefix("job", 1, 0, 0), store);
  for (const bool keyed : {false, true}) {
    const int fd = testing::ConnectToRank(group, 0);
    std::vector<uint8_t> hello =
        testing::Cat(keyed ? testing::kKeyedHelloMagic : testing::kPlainHelloMagic, testing::LittleEndian(1, 4));
    if (keyed) hello = testing::Cat(hello, std::vector<uint8_t>(16, 7));
    EXPECT_TRUE(testing::SendRaw(fd, hello));
    if (keyed) EXPECT_TRUE(testing::SendRaw(fd, std::vector<uint8_t>(32, 0)));  // a proof made up
    EXPECT_TRUE(testing::ClosedByPeer(fd)) << (keyed ? "keyed" : "plain");
    common::CloseFd(fd);
  }
  std::thread node1([&] { results[1] = workers[1].AllReduce("g", n); });
  node0.join();
  node1.join();
  for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(results[r].ok()) << r << ": " << results[r].error_message();
  EXPECT_EQ(0, std::memcmp(workers[0].data(), workers[1].data(), n * sizeof(float)));
}

// A job's coordinator that hands out one in-memory transport, once.
class OneTransport final : public JobCoordinator {
 public:
  explicit OneTransport(std::unique_ptr<engine::Transport> transport) : transport_(std::move(transport)) {}
  absl::StatusOr<std::unique_ptr<engine::Transport>> Connect(const GroupView&, uint64_t) override {
    if (!transport_) return absl::UnavailableError("already connected once");
    return std::move(transport_);
  }
  absl::StatusOr<bool> PollConfig(uint64_t, uint64_t*, JobConfig*) override { return false; }
  absl::Status ReportFailure(uint64_t, const absl::Status&, absl::Time) override { return absl::OkStatus(); }
  std::optional<FailureCause> LookupFailure(uint64_t, absl::Time) override { return std::nullopt; }

 private:
  std::unique_ptr<engine::Transport> transport_;
};

// The daemon gives each job an authenticator (the two-node test above runs with it); this checks
// that the job hands it to the engine: a node without one cannot take part.
TEST(ClusterSecretTest, JobsAuthenticateTheirCrossNodeMessages) {
  for (bool both : {true, false}) {
    std::vector<std::unique_ptr<engine::Transport>> transports = engine::MakeMemoryTransports(2);
    std::vector<std::unique_ptr<Job>> jobs;
    for (int node = 0; node < 2; ++node) {
      Job::Options o;
      o.id = "job";
      o.num_nodes = 2;
      o.config = *MakeJobConfig("dynamiq", 5, "ring", 16, "measured");
      o.timeout = absl::Seconds(10);
      o.coordinator = std::make_shared<OneTransport>(std::move(transports[node]));
      if (both || node == 0) o.authenticator = engine::StepAuthenticator::ForJob(kSecret, "job");
      jobs.push_back(std::make_unique<Job>(std::move(o)));
      ASSERT_THAT(jobs.back()->AddWorker(1, 0, 1), IsOk());
    }
    std::vector<std::vector<float>> data(2, std::vector<float>(4096, 1.0f));
    std::vector<absl::StatusOr<Job::Result>> results(2, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int node = 0; node < 2; ++node) {
      threads.emplace_back([&, node] {
        Job::Request r;
        r.worker_id = 1;
        r.tensor_name = "g";
        r.num_elements = data[node].size();
        r.region = absl::MakeSpan(reinterpret_cast<uint8_t*>(data[node].data()), data[node].size() * 4);
        results[node] = jobs[node]->Submit(r);
      });
    }
    for (auto& t : threads) t.join();
    if (both) {
      EXPECT_THAT(results[0], IsOk());
      EXPECT_THAT(results[1], IsOk());
      EXPECT_EQ(data[0][7], 2.0f);
    } else {
      // Whichever node checks a header first fails with the reason and aborts the other.
      EXPECT_FALSE(results[0].ok());
      EXPECT_FALSE(results[1].ok());
      const bool node1_saw =
          absl::IsUnauthenticated(results[1].status()) &&
          absl::StrContains(results[1].status().message(), "rank 0 authenticates its messages with a cluster secret");
      const bool node0_saw = absl::IsUnauthenticated(results[0].status()) &&
                             absl::StrContains(results[0].status().message(), "rank 1 sent an unauthenticated message");
      EXPECT_TRUE(node0_saw || node1_saw) << results[0].status() << " / " << results[1].status();
    }
  }
}

TEST(ClusterSecretTest, ANodeThatCannotVerifyTheCoordinatorsCertificateSaysSo) {
  TempDir temp;
  const std::string dir = temp.path();
  Tls tls(dir);
  std::string log;
  ASSERT_TRUE(tls.Generate(&log)) << log;
  SecurityOptions good, wrong_ca;
  good.tls_cert_file = wrong_ca.tls_cert_file = tls.cert();
  good.tls_key_file = wrong_ca.tls_key_file = tls.key();
  good.tls_ca_file = tls.ca();
  wrong_ca.tls_ca_file = tls.other_ca();
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<absl::Status> status = StartCluster(dir, {good, wrong_ca}, daemons, absl::Seconds(2));
  EXPECT_THAT(status[1], StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("does --tls_ca verify")));
  // And TLS without a CA on a multi-node cluster is refused up front.
  SecurityOptions no_ca = good;
  no_ca.tls_ca_file.clear();
  Daemon daemon([&] {
    DaemonOptions o = Options(dir, 0, 2);
    o.security = no_ca;
    return o;
  }());
  EXPECT_THAT(daemon.Start(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs --tls_ca")));
}

TEST(WorkerSocketTest, AnotherUidIsRefusedAndCounted) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a child as another uid";
  TempDir temp;
  const std::string dir = temp.path();
  chmod(dir.c_str(), 0755);  // let the child reach the socket's directory
  DaemonOptions o = Options(dir);
  o.worker_socket = dir + "/sock/dynamiqd.sock";
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  chmod((dir + "/sock").c_str(), 0755);
  // exit code: 0 refused by connect (the socket's mode), 1 connected then dropped without a
  // byte of gRPC (the SO_PEERCRED check), 2 the daemon answered.
  auto try_as_nobody = [&]() -> int {
    const pid_t child = fork();
    if (child == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
      const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", o.worker_socket.c_str());
      if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(0);
      // An HTTP/2 client preface: a served connection answers with a SETTINGS frame.
      static const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\4\0\0\0\0\0";
      (void)!send(fd, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL);  // the daemon may have closed it already
      timeval tv{5, 0};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      char byte;
      _exit(read(fd, &byte, 1) > 0 ? 2 : 1);
    }
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  // The socket is 0600: the kernel refuses the connection.
  EXPECT_EQ(try_as_nobody(), 0);
  // Were it opened up (a careless chmod), the uid check still drops the connection, and counts it.
  const double before = RejectedRequests(daemon, "permission_denied");
  ASSERT_EQ(chmod(o.worker_socket.c_str(), 0777), 0);
  EXPECT_EQ(try_as_nobody(), 1);
  // The listener counts the refusal on its own thread, which may run after the child has seen the
  // connection close: poll (bounded) instead of reading the counter once.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (RejectedRequests(daemon, "permission_denied") < before + 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(RejectedRequests(daemon, "permission_denied"), before + 1);
  // The daemon's own uid still gets through.
  EXPECT_THAT(testing::ConnectTestWorker(o.worker_socket, "job", 0, 1, 16), IsOk());
}

// Issue 23.7: a worker of another uid used to see only "UNAVAILABLE: Broken pipe" (the daemon drops
// its connection). The client now says why before it connects.
TEST(WorkerSocketTest, AClientOfAnotherUidIsToldTheDaemonServesOnlyItsOwnUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a child as another uid";
  TempDir temp;
  const std::string dir = temp.path();
  chmod(dir.c_str(), 0755);  // let the child reach the socket's folder
  DaemonOptions o = Options(dir);
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
    ClientOptions options;
    options.socket_path = o.worker_socket;
    options.job_id = "j";
    const absl::StatusOr<Client> client = Client::Connect(options);
    const std::string s = client.ok() ? "connected" : client.status().ToString();
    (void)!write(fds[1], s.data(), s.size());
    _exit(0);
  }
  close(fds[1]);
  std::string said;
  char buf[1024];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) said.append(buf, n);
  close(fds[0]);
  waitpid(child, nullptr, 0);
  EXPECT_THAT(said, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(said, HasSubstr("belongs to uid 0 and this process runs as uid 65534"));
  EXPECT_THAT(said, HasSubstr("serves only workers of its own user"));
}

// Issue 22.3: a socket folder another user can write lets them rename the socket and bind their
// own in its place. dynamiqd refuses such a folder (and one of another owner), creates a missing
// one 0700, and on shutdown unlinks only the socket it created.
TEST(WorkerSocketTest, AFolderOthersCanWriteIsRefusedAndAMissingOneIsCreatedPrivate) {
  TempDir temp;
  const std::string dir = temp.path();
  for (mode_t mode : {01777, 0777, 0775, 0757}) {
    const std::string shared = absl::StrCat(dir, "/shared", mode);
    ASSERT_EQ(mkdir(shared.c_str(), 0700), 0);
    ASSERT_EQ(chmod(shared.c_str(), mode), 0);
    DaemonOptions o = Options(dir);
    o.worker_socket = shared + "/dynamiqd.sock";
    Daemon daemon(o);
    const absl::Status started = daemon.Start();
    EXPECT_EQ(started.code(), absl::StatusCode::kFailedPrecondition) << started;
    EXPECT_THAT(std::string(started.message()), HasSubstr(absl::StrFormat("has mode 0%o", mode)));
    EXPECT_THAT(std::string(started.message()), HasSubstr("chmod go-w " + shared));
    struct stat st;
    EXPECT_NE(lstat(o.worker_socket.c_str(), &st), 0) << "no socket is created in a refused folder";
  }
  if (geteuid() == 0) {
    const std::string theirs = dir + "/theirs";
    ASSERT_EQ(mkdir(theirs.c_str(), 0700), 0);
    ASSERT_EQ(chown(theirs.c_str(), 65534, 65534), 0);
    DaemonOptions o = Options(dir);
    o.worker_socket = theirs + "/dynamiqd.sock";
    Daemon daemon(o);
    const absl::Status started = daemon.Start();
    EXPECT_EQ(started.code(), absl::StatusCode::kFailedPrecondition) << started;
    EXPECT_THAT(std::string(started.message()), HasSubstr("belongs to uid 65534"));
  }
  // A missing folder is created 0700 whatever the umask.
  const mode_t old_umask = umask(0);
  DaemonOptions o = Options(dir);
  o.worker_socket = dir + "/fresh/dynamiqd.sock";
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  umask(old_umask);
  struct stat st;
  ASSERT_EQ(stat((dir + "/fresh").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
}

TEST(WorkerSocketTest, ShutdownUnlinksOnlyTheSocketTheDaemonCreated) {
  TempDir temp;
  const std::string dir = temp.path();
  DaemonOptions o = Options(dir);
  Daemon daemon(o);
  ASSERT_THAT(daemon.Start(), IsOk());
  // Someone renames the daemon's socket and binds another at its path.
  ASSERT_EQ(rename(o.worker_socket.c_str(), (o.worker_socket + ".moved").c_str()), 0);
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", o.worker_socket.c_str());
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  daemon.Shutdown();
  struct stat st;
  EXPECT_EQ(lstat(o.worker_socket.c_str(), &st), 0) << "the daemon removed a socket it did not create";
  close(fd);
}

TEST(SharedMemoryTest, BuffersAreOwnerOnlyAndUnlinkedOnceMapped) {
  TempDir temp;
  const std::string dir = temp.path();
  Daemon daemon(Options(dir));
  ASSERT_THAT(daemon.Start(), IsOk());
  auto stub = dynamiq::v1::Worker::NewStub(
      grpc::CreateChannel("unix:" + dir + "/node0.sock", grpc::InsecureChannelCredentials()));
  dynamiq::v1::RegisterRequest reg;
  reg.set_job_id("job");
  reg.set_local_world_size(1);
  dynamiq::v1::RegisterResponse reg_resp;
  grpc::ClientContext c1;
  ASSERT_TRUE(stub->Register(&c1, reg, &reg_resp).ok());
  dynamiq::v1::AllocateBufferRequest alloc;
  alloc.set_worker_id(reg_resp.worker_id());
  alloc.set_bytes(4096);
  dynamiq::v1::AllocateBufferResponse alloc_resp;
  grpc::ClientContext c2;
  ASSERT_TRUE(stub->AllocateBuffer(&c2, alloc, &alloc_resp).ok());
  const std::string path = absl::StrCat("/dev/shm/", absl::StripPrefix(alloc_resp.shm_name(), "/"));
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, geteuid());
  auto region = ipc::ShmRegion::Open(alloc_resp.shm_name(), 4096);
  ASSERT_THAT(region, IsOk());
  dynamiq::v1::MappedRequest mapped;
  mapped.set_worker_id(reg_resp.worker_id());
  mapped.set_buffer_id(alloc_resp.buffer_id());
  dynamiq::v1::MappedResponse mapped_resp;
  grpc::ClientContext c3;
  ASSERT_TRUE(stub->Mapped(&c3, mapped, &mapped_resp).ok());
  // Nobody can open it any more; the mappings keep working.
  EXPECT_NE(stat(path.c_str(), &st), 0);
  region->data()[0] = 42;
  EXPECT_EQ(region->data()[0], 42);
}

// Issue 22.5: a buffer the worker never reported mapped keeps its /dev/shm name; when the daemon
// is then killed, nothing unlinks it. The next dynamiqd removes such objects of dead creators, and
// leaves those of live processes alone.
TEST(SharedMemoryTest, ObjectsLeftByACrashedDaemonAreRemovedAtTheNextStart) {
  // Children that create an object each, like a daemon that allocated a buffer: one dies at once
  // without cleaning up (as under kill -9), one stays alive until the test ends.
  auto spawn = [](bool stay) -> std::pair<pid_t, std::string> {
    int fds[2];
    if (pipe(fds) != 0) return {-1, ""};
    const pid_t child = fork();
    if (child == 0) {
      close(fds[0]);
      auto region = ipc::ShmRegion::Create(4096, "orphan");
      const std::string name = region.ok() ? region->name() : "";
      (void)!write(fds[1], name.data(), name.size());
      close(fds[1]);
      if (stay) pause();
      _exit(0);  // no destructors: the name stays linked
    }
    close(fds[1]);
    char buf[256];
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    close(fds[0]);
    return {child, std::string(buf, n > 0 ? n : 0)};
  };
  auto [dead_pid, dead_name] = spawn(false);
  auto [live_pid, live_name] = spawn(true);
  ASSERT_FALSE(dead_name.empty());
  ASSERT_FALSE(live_name.empty());
  waitpid(dead_pid, nullptr, 0);
  auto linked = [](const std::string& name) {
    struct stat st;
    return stat(absl::StrCat("/dev/shm", name).c_str(), &st) == 0;
  };
  ASSERT_TRUE(linked(dead_name));
  TempDir temp;
  Daemon daemon(Options(temp.path()));
  ASSERT_THAT(daemon.Start(), IsOk());
  EXPECT_FALSE(linked(dead_name)) << dead_name << " of a dead creator was left";
  EXPECT_TRUE(linked(live_name)) << live_name << " of a live process was removed";
  kill(live_pid, SIGKILL);
  waitpid(live_pid, nullptr, 0);
  shm_unlink(live_name.c_str());
}

}  // namespace
}  // namespace dynamiq::server

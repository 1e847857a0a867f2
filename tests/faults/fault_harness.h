// Test support for the fault suite (tests/faults/): real dynamiqd processes (optionally inside
// network namespaces), worker processes (dq-fault-worker, built on the C++ client) driven line by
// line over pipes, the daemons' resources read from /proc (fds, threads, RSS, mapped shared
// memory) and network namespaces joined by veth pairs. Every wait is bounded.
#ifndef DQ_TESTS_FAULTS_FAULT_HARNESS_H_
#define DQ_TESTS_FAULTS_FAULT_HARNESS_H_

#include <dirent.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dynamiq/v1/control.grpc.pb.h"

extern char** environ;

namespace dynamiq::faults {

// A scratch directory, removed with its contents.
class ScratchDir {
 public:
  ScratchDir() {
    char tmpl[] = "/tmp/dqfaults-XXXXXX";
    const char* made = mkdtemp(tmpl);
    path_ = made != nullptr ? made : "/tmp";
    chmod(path_.c_str(), 0700);
  }
  ~ScratchDir() {
    if (path_ != "/tmp") {
      std::error_code ignored;
      std::filesystem::remove_all(path_, ignored);
    }
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::string Tail(const std::string& s, size_t n = 3000) { return s.size() <= n ? s : s.substr(s.size() - n); }

// A child process: stdin and stdout are pipes (line protocol), stderr goes to a log file.
class Child {
 public:
  static absl::StatusOr<std::unique_ptr<Child>> Spawn(const std::vector<std::string>& argv,
                                                      const std::string& log_path) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0) return absl::ErrnoToStatus(errno, "pipe");
    if (pipe2(out, O_CLOEXEC) != 0) {
      close(in[0]), close(in[1]);
      return absl::ErrnoToStatus(errno, "pipe");
    }
    const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    if (log >= 0) posix_spawn_file_actions_adddup2(&actions, log, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid = -1;
    const int err = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    if (log >= 0) close(log);
    if (err != 0) {
      close(in[1]);
      close(out[0]);
      return absl::ErrnoToStatus(err, absl::StrCat("posix_spawn ", argv[0]));
    }
    auto child = std::unique_ptr<Child>(new Child);
    child->pid_ = pid;
    child->stdin_ = in[1];
    child->stdout_ = out[0];
    child->log_path_ = log_path;
    return child;
  }

  ~Child() {
    if (stdin_ >= 0) close(stdin_);
    if (stdout_ >= 0) close(stdout_);
    if (!exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  pid_t pid() const { return pid_; }
  std::string log() const { return ReadFile(log_path_); }

  bool Send(const std::string& line) {
    const std::string data = line + "\n";
    return write(stdin_, data.data(), data.size()) == static_cast<ssize_t>(data.size());
  }
  void CloseStdin() {
    if (stdin_ >= 0) close(stdin_);
    stdin_ = -1;
  }

  // The next stdout line, or nullopt at the deadline or end of file.
  std::optional<std::string> ReadLine(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      const size_t nl = buffered_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffered_.substr(0, nl);
        buffered_.erase(0, nl + 1);
        return line;
      }
      const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (left <= 0 || stdout_ < 0) return std::nullopt;
      pollfd p{stdout_, POLLIN, 0};
      const int r = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
      if (r < 0 && errno != EINTR) return std::nullopt;
      if (r <= 0) continue;
      char chunk[4096];
      const ssize_t n = read(stdout_, chunk, sizeof(chunk));
      if (n <= 0) {
        close(stdout_);
        stdout_ = -1;
        if (!buffered_.empty()) {
          std::string line = std::move(buffered_);
          buffered_.clear();
          return line;
        }
        return std::nullopt;
      }
      buffered_.append(chunk, static_cast<size_t>(n));
    }
  }

  void Signal(int sig) { kill(pid_, sig); }

  // Waits for the process to exit; its wait status, or nullopt at the deadline.
  std::optional<int> Wait(absl::Duration timeout) {
    if (exited_) return status_;
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        status_ = status;
        return status;
      }
      if (absl::Now() >= deadline) return std::nullopt;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  bool Alive() { return !Wait(absl::ZeroDuration()).has_value(); }

 private:
  Child() = default;
  pid_t pid_ = -1;
  int stdin_ = -1, stdout_ = -1;
  std::string log_path_;
  std::string buffered_;
  bool exited_ = false;
  int status_ = 0;
};

// What the kernel says a process holds.
struct Resources {
  int fds = -1;
  int threads = -1;
  int64_t rss_kb = -1;
  int shm_mappings = -1;  // mappings of dynamiq shared-memory buffers
  std::string ToString() const {
    return absl::StrCat("fds=", fds, " threads=", threads, " rss=", rss_kb, "kB shm_mappings=", shm_mappings);
  }
};

inline Resources ReadResources(pid_t pid) {
  Resources r;
  const std::string proc = absl::StrCat("/proc/", pid);
  if (DIR* d = opendir((proc + "/fd").c_str())) {
    r.fds = 0;
    while (dirent* e = readdir(d)) r.fds += e->d_name[0] != '.';
    closedir(d);
  }
  for (absl::string_view line : absl::StrSplit(ReadFile(proc + "/status"), '\n')) {
    if (absl::ConsumePrefix(&line, "Threads:")) (void)absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &r.threads);
    if (absl::ConsumePrefix(&line, "VmRSS:")) {
      line = absl::StripAsciiWhitespace(line);
      (void)absl::SimpleAtoi(line.substr(0, line.find(' ')), &r.rss_kb);
    }
  }
  r.shm_mappings = 0;
  for (absl::string_view line : absl::StrSplit(ReadFile(proc + "/maps"), '\n')) {
    r.shm_mappings += absl::StrContains(line, "/dev/shm/dynamiq-");
  }
  return r;
}

// Shared-memory names a daemon with this pid created that still exist.
inline int ShmNamesOf(pid_t pid) {
  int count = 0;
  const std::string prefix = absl::StrCat("dynamiq-", pid, "-");
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) count += absl::StartsWith(e->d_name, prefix);
    closedir(d);
  }
  return count;
}

// A free TCP port on 127.0.0.1 (bound and released; good enough for tests).
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

// One dynamiqd process.
struct DaemonSpec {
  uint32_t node_rank = 0;
  uint32_t num_nodes = 1;
  std::string listen;       // host:port
  std::string coordinator;  // empty on node 0
  std::string socket;
  std::string netns;  // run inside this network namespace (ip netns exec)
  double timeout_seconds = 5;
  std::string codec = "none";
  int metrics_port = -1;
  std::vector<std::string> flags;  // more flags
};

class DaemonProcess {
 public:
  DaemonProcess(std::string binary, DaemonSpec spec, std::string log) : binary_(std::move(binary)), spec_(spec) {
    log_ = std::move(log);
  }

  absl::Status Spawn() {
    std::vector<std::string> argv;
    if (!spec_.netns.empty()) argv = {"ip", "netns", "exec", spec_.netns};
    argv.push_back(binary_);
    argv.push_back(absl::StrCat("--node_rank=", spec_.node_rank));
    argv.push_back(absl::StrCat("--num_nodes=", spec_.num_nodes));
    argv.push_back(absl::StrCat("--listen=", spec_.listen));
    if (!spec_.coordinator.empty()) argv.push_back(absl::StrCat("--coordinator=", spec_.coordinator));
    argv.push_back(absl::StrCat("--worker_socket=", spec_.socket));
    argv.push_back(absl::StrCat("--timeout=", spec_.timeout_seconds));
    argv.push_back(absl::StrCat("--codec=", spec_.codec));
    argv.push_back(absl::StrCat("--metrics_port=", spec_.metrics_port));
    argv.push_back("--error_sample_rate=0");
    for (const std::string& f : spec_.flags) argv.push_back(f);
    auto child = Child::Spawn(argv, log_);
    if (!child.ok()) return child.status();
    child_ = *std::move(child);
    return absl::OkStatus();
  }

  // Waits until the daemon logged that it is ready (or exited, or the deadline passed).
  absl::Status WaitReady(absl::Duration timeout = absl::Seconds(20)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (absl::StrContains(ReadFile(log_), " ready; ")) return absl::OkStatus();
      if (!child_->Alive()) {
        return absl::UnavailableError(
            absl::StrCat("dynamiqd node ", spec_.node_rank, " exited: ", Tail(ReadFile(log_))));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("dynamiqd node ", spec_.node_rank, " not ready in time: ", Tail(ReadFile(log_))));
  }

  absl::Status Start() {
    if (absl::Status s = Spawn(); !s.ok()) return s;
    return WaitReady();
  }

  pid_t pid() const { return child_ ? child_->pid() : -1; }
  Child& child() { return *child_; }
  const DaemonSpec& spec() const { return spec_; }
  std::string log() const { return ReadFile(log_); }
  bool Alive() { return child_ && child_->Alive(); }
  Resources resources() const { return ReadResources(pid()); }

  void Kill(int sig = SIGKILL) {
    if (!child_) return;
    child_->Signal(sig);
    child_->Wait(absl::Seconds(20));
  }
  // SIGTERM and wait for a clean exit; false if it had to be killed or exited with an error.
  bool Stop() {
    if (!child_ || !child_->Alive()) return false;
    child_->Signal(SIGTERM);
    std::optional<int> st = child_->Wait(absl::Seconds(20));
    if (!st.has_value()) {
      child_->Signal(SIGKILL);
      child_->Wait(absl::Seconds(5));
      return false;
    }
    return WIFEXITED(*st) && WEXITSTATUS(*st) == 0;
  }

  // The operator API (dynamiq.v1.Control) over TCP; from another namespace use `address`.
  std::unique_ptr<dynamiq::v1::Control::Stub> Control() const {
    return dynamiq::v1::Control::NewStub(grpc::CreateChannel(spec_.listen, grpc::InsecureChannelCredentials()));
  }

 private:
  std::string binary_;
  DaemonSpec spec_;
  std::string log_;
  std::unique_ptr<Child> child_;
};

// Polls (bounded) until the daemon's resources are back within the tolerances of `base`: fds and
// threads at most a few above (gRPC's thread pools and idle connections fluctuate), shared-memory
// mappings exactly `shm_mappings`. Returns the last reading.
inline Resources WaitForResources(pid_t pid, const Resources& base, int shm_mappings, int fd_slack = 2,
                                  int thread_slack = 3, absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  Resources r;
  do {
    r = ReadResources(pid);
    if (r.fds >= 0 && r.fds <= base.fds + fd_slack && r.threads <= base.threads + thread_slack &&
        r.shm_mappings == shm_mappings) {
      return r;
    }
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  return r;
}

// One worker process (dq-fault-worker in interactive mode).
struct WorkerSpec {
  std::string socket;
  std::string job = "job";
  uint32_t local_rank = 0;
  uint32_t local_world_size = 1;
  int64_t global_rank = 0;
  int64_t world = 1;
  int64_t elements = 4096;
  double tolerance = 0;
  double client_timeout = 30;
};

class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Start(const std::string& binary, const WorkerSpec& spec,
                                                       const std::string& log) {
    std::vector<std::string> argv = {binary,
                                     absl::StrCat("--socket=", spec.socket),
                                     absl::StrCat("--job=", spec.job),
                                     absl::StrCat("--local_rank=", spec.local_rank),
                                     absl::StrCat("--local_world_size=", spec.local_world_size),
                                     absl::StrCat("--global_rank=", spec.global_rank),
                                     absl::StrCat("--world=", spec.world),
                                     absl::StrCat("--elements=", spec.elements),
                                     absl::StrCat("--tolerance=", spec.tolerance),
                                     absl::StrCat("--timeout=", spec.client_timeout)};
    auto child = Child::Spawn(argv, log);
    if (!child.ok()) return child.status();
    auto w = std::unique_ptr<Worker>(new Worker);
    w->child_ = *std::move(child);
    std::optional<std::string> line = w->child_->ReadLine(absl::Seconds(20));
    if (!line.has_value() || !absl::StartsWith(*line, "ready ")) {
      return absl::UnavailableError(absl::StrCat("worker ", spec.job, "/", spec.local_rank, " did not start: ",
                                                 line.value_or("(no output)"), " ", Tail(w->child_->log())));
    }
    return w;
  }

  // Submits one all-reduce (the reply comes with Result).
  bool Submit(const std::string& args = "") { return child_->Send(args.empty() ? "ar" : absl::StrCat("ar ", args)); }
  // The reply line of the oldest submitted all-reduce ("ok ...", "bad ...", "err CODE secs message").
  std::string Result(absl::Duration timeout = absl::Seconds(30)) {
    return child_->ReadLine(timeout).value_or("(no reply)");
  }
  std::string AllReduce(const std::string& args = "", absl::Duration timeout = absl::Seconds(30)) {
    Submit(args);
    return Result(timeout);
  }
  pid_t pid() const { return child_->pid(); }
  Child& child() { return *child_; }
  void Quit() {
    child_->Send("quit");
    child_->Wait(absl::Seconds(10));
  }

 private:
  Worker() = default;
  std::unique_ptr<Child> child_;
};

// The code of an "err CODE ..." reply ("" for other replies).
inline std::string ReplyCode(const std::string& reply) {
  std::vector<std::string> f = absl::StrSplit(reply, ' ');
  return f.size() >= 2 && f[0] == "err" ? f[1] : "";
}

// Submits on all workers at once and collects every reply.
inline std::vector<std::string> AllReduceAll(const std::vector<Worker*>& workers, const std::string& args = "",
                                             absl::Duration timeout = absl::Seconds(30)) {
  for (Worker* w : workers) w->Submit(args);
  std::vector<std::string> replies;
  for (Worker* w : workers) replies.push_back(w->Result(timeout));
  return replies;
}

// Runs a command line (sh -c) with a bounded time; its exit status (-1 if it did not finish).
inline int Shell(const std::string& command, std::string* output = nullptr, int timeout_seconds = 20) {
  const std::string wrapped = absl::StrCat("timeout ", timeout_seconds, " sh -c '", command, "' 2>&1");
  FILE* p = popen(wrapped.c_str(), "r");
  if (p == nullptr) return -1;
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  const int st = pclose(p);
  if (output != nullptr) *output = out;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// Network namespaces <prefix>0..n-1, each with a veth to a bridge in the root namespace, on
// 10.<subnet>.0.0/24 (node k at 10.<subnet>.0.k+1, the bridge, so this process reaches the nodes'
// operator ports, at .254). Removed by the destructor. `ok()` is false
// (with `error()`) when namespaces cannot be made here (not root, no ip, no veth support).
class NetnsCluster {
 public:
  NetnsCluster(const std::string& prefix, int nodes, int subnet) : prefix_(prefix), nodes_(nodes), subnet_(subnet) {
    if (geteuid() != 0) {
      error_ = "not root";
      return;
    }
    Cleanup();
    std::vector<std::string> cmds = {absl::StrCat("ip link add ", Bridge(), " type bridge"),
                                     absl::StrCat("ip addr add 10.", subnet_, ".0.254/24 dev ", Bridge()),
                                     absl::StrCat("ip link set ", Bridge(), " up")};
    for (int k = 0; k < nodes; ++k) {
      const std::string ns = Ns(k), v = Veth(k);
      cmds.push_back(absl::StrCat("ip netns add ", ns));
      cmds.push_back(absl::StrCat("ip -n ", ns, " link set lo up"));
      cmds.push_back(absl::StrCat("ip link add ", v, " type veth peer name eth0 netns ", ns));
      cmds.push_back(absl::StrCat("ip link set ", v, " master ", Bridge(), " up"));
      cmds.push_back(absl::StrCat("ip -n ", ns, " addr add ", Address(k), "/24 dev eth0"));
      cmds.push_back(absl::StrCat("ip -n ", ns, " link set eth0 up"));
    }
    for (const std::string& c : cmds) {
      std::string out;
      if (Shell(c, &out) != 0) {
        error_ = absl::StrCat("'", c, "' failed: ", out);
        return;
      }
    }
    ok_ = true;
  }
  ~NetnsCluster() { Cleanup(); }

  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  std::string Ns(int k) const { return absl::StrCat(prefix_, k); }
  std::string Veth(int k) const { return absl::StrCat(prefix_, "v", k); }  // root-namespace end of node k's link
  std::string Bridge() const { return absl::StrCat(prefix_, "br"); }
  std::string Address(int k) const { return absl::StrCat("10.", subnet_, ".0.", k + 1); }
  // Node k's link (inside its namespace) down or up.
  bool SetLink(int k, bool up) {
    return Shell(absl::StrCat("ip -n ", Ns(k), " link set eth0 ", up ? "up" : "down")) == 0;
  }
  int nodes() const { return nodes_; }

  // One cluster of dynamiqd processes, node k in namespace Ns(k) listening on Address(k):7070
  // (node 0 coordinates), its worker socket at <dir>/node<k>.sock and log at <dir>/node<k>.log,
  // with `timeout_seconds` and `flags`. Not spawned yet.
  std::vector<std::unique_ptr<DaemonProcess>> Daemons(const std::string& binary, const std::string& dir,
                                                      double timeout_seconds,
                                                      const std::vector<std::string>& flags) const {
    std::vector<std::unique_ptr<DaemonProcess>> daemons;
    for (int k = 0; k < nodes_; ++k) {
      DaemonSpec s;
      s.node_rank = static_cast<uint32_t>(k);
      s.num_nodes = static_cast<uint32_t>(nodes_);
      s.listen = absl::StrCat(Address(k), ":7070");
      if (k > 0) s.coordinator = absl::StrCat(Address(0), ":7070");
      s.socket = absl::StrCat(dir, "/node", k, ".sock");
      s.netns = Ns(k);
      s.timeout_seconds = timeout_seconds;
      s.flags = flags;
      daemons.push_back(std::make_unique<DaemonProcess>(binary, s, absl::StrCat(dir, "/node", k, ".log")));
    }
    return daemons;
  }

 private:
  void Cleanup() {
    for (int k = 0; k < nodes_; ++k) {
      Shell(absl::StrCat("ip netns del ", Ns(k), " 2>/dev/null"));
      Shell(absl::StrCat("ip link del ", Veth(k), " 2>/dev/null"));
    }
    Shell(absl::StrCat("ip link del ", Bridge(), " 2>/dev/null"));
  }

  std::string prefix_;
  int nodes_;
  int subnet_;
  bool ok_ = false;
  std::string error_;
};

// `nodes` dynamiqd processes forming one cluster on loopback (fixed ports, so a restarted node
// comes back at the same address), node k's worker socket at <dir>/node<k>.sock.
class LoopbackCluster {
 public:
  LoopbackCluster(std::string binary, std::string dir, int nodes, double timeout_seconds, std::string codec = "none")
      : binary_(std::move(binary)), dir_(std::move(dir)) {
    for (int k = 0; k < nodes; ++k) {
      DaemonSpec s;
      s.node_rank = static_cast<uint32_t>(k);
      s.num_nodes = static_cast<uint32_t>(nodes);
      s.listen = absl::StrCat("127.0.0.1:", FreePort());
      s.socket = absl::StrCat(dir_, "/node", k, ".sock");
      s.timeout_seconds = timeout_seconds;
      s.codec = codec;
      specs_.push_back(s);
    }
    for (int k = 1; k < nodes; ++k) specs_[k].coordinator = specs_[0].listen;
    daemons_.resize(nodes);
  }
  DaemonSpec& spec(int k) { return specs_[k]; }
  DaemonProcess& node(int k) { return *daemons_[k]; }
  int size() const { return static_cast<int>(specs_.size()); }
  std::string socket(int k) const { return specs_[k].socket; }
  std::vector<std::string> sockets() const {
    std::vector<std::string> all;
    for (const auto& spec : specs_) all.push_back(spec.socket);
    return all;
  }

  // Spawns the given nodes (all by default) and waits until every one is ready.
  absl::Status Start(std::vector<int> which = {}) {
    if (which.empty()) {
      for (int k = 0; k < size(); ++k) which.push_back(k);
    }
    for (int k : which) {
      daemons_[k] =
          std::make_unique<DaemonProcess>(binary_, specs_[k], absl::StrCat(dir_, "/node", k, ".", ++starts_, ".log"));
      if (absl::Status s = daemons_[k]->Spawn(); !s.ok()) return s;
    }
    for (int k : which) {
      if (absl::Status s = daemons_[k]->WaitReady(); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  std::string binary_;
  std::string dir_;
  std::vector<DaemonSpec> specs_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  int starts_ = 0;
};

// GET /metrics from a daemon started with --metrics_port=0 (the address is in its log).
inline std::string ScrapeMetrics(const std::string& log) {
  const size_t at = log.find("metrics on http://");
  if (at == std::string::npos) return "";
  const std::string rest = log.substr(at + 18);
  const std::string hostport = rest.substr(0, rest.find('/'));
  const size_t colon = hostport.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(hostport.substr(colon + 1), &port)) return "";
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

// The value of the first sample whose line starts with `name{` and contains every `labels` part.
inline double MetricValue(const std::string& text, const std::string& name, const std::vector<std::string>& labels) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, name + "{")) continue;
    bool all = true;
    for (const std::string& l : labels) all &= absl::StrContains(line, l);
    double v = 0;
    if (all && absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) return v;
  }
  return -1;
}

// The workers of one job: `per_node` on each node whose worker socket is in `sockets`
// (global rank = node * per_node + local rank). Logs go to <dir>/<job>.<node>.<local>.<n>.log.
class JobWorkers {
 public:
  JobWorkers(std::string binary, std::string dir, std::string job, std::vector<std::string> sockets, int per_node,
             int64_t elements, double tolerance = 0)
      : binary_(std::move(binary)), dir_(std::move(dir)), sockets_(std::move(sockets)), per_node_(per_node) {
    job_ = std::move(job);
    elements_ = elements;
    tolerance_ = tolerance;
    workers_.resize(sockets_.size() * per_node);
  }
  absl::Status Start() {
    for (int node = 0; node < nodes(); ++node) {
      for (int local = 0; local < per_node_; ++local) {
        if (absl::Status s = Restart(node, local); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }
  // (Re)starts one worker: a fresh process that registers the same local rank.
  absl::Status Restart(int node, int local) {
    WorkerSpec w;
    w.socket = sockets_[node];
    w.job = job_;
    w.local_rank = static_cast<uint32_t>(local);
    w.local_world_size = static_cast<uint32_t>(per_node_);
    w.global_rank = node * per_node_ + local;
    w.world = nodes() * per_node_;
    w.elements = elements_;
    w.tolerance = tolerance_;
    auto worker =
        Worker::Start(binary_, w, absl::StrCat(dir_, "/", job_, ".", node, ".", local, ".", ++starts_, ".log"));
    if (!worker.ok()) return worker.status();
    workers_[node * per_node_ + local] = *std::move(worker);
    return absl::OkStatus();
  }
  int nodes() const { return static_cast<int>(sockets_.size()); }
  // Every worker unregisters and exits (before stopping daemons: idle connections slow gRPC's
  // shutdown down).
  void QuitAll() {
    for (auto& w : workers_) {
      if (w) w->child().Send("quit");
    }
    for (auto& w : workers_) {
      if (w) w->child().Wait(absl::Seconds(10));
    }
  }
  Worker& at(int node, int local) { return *workers_[node * per_node_ + local]; }
  std::vector<Worker*> all() {
    std::vector<Worker*> out;
    for (auto& w : workers_) out.push_back(w.get());
    return out;
  }
  std::vector<Worker*> except(const Worker* skip) {
    std::vector<Worker*> out;
    for (auto& w : workers_) {
      if (w.get() != skip) out.push_back(w.get());
    }
    return out;
  }

 private:
  std::string binary_, dir_, job_;
  std::vector<std::string> sockets_;
  int per_node_;
  int64_t elements_;
  double tolerance_;
  std::vector<std::unique_ptr<Worker>> workers_;
  int starts_ = 0;
};

// Every reply starts with "ok" (the failure message lists them all).
inline std::string NotAllOk(const std::vector<std::string>& replies) {
  for (const std::string& r : replies) {
    if (!absl::StartsWith(r, "ok ")) return absl::StrJoin(replies, "\n");
  }
  return "";
}

// A job's status on one daemon (GetStatus over its operator API); nullopt if unknown.
inline std::optional<dynamiq::v1::JobStatus> JobStatusOf(const DaemonProcess& daemon, const std::string& job) {
  auto control = daemon.Control();
  dynamiq::v1::GetStatusRequest req;
  dynamiq::v1::GetStatusResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!control->GetStatus(&ctx, req, &resp).ok()) return std::nullopt;
  for (const auto& j : resp.jobs()) {
    if (j.job_id() == job) return j;
  }
  return std::nullopt;
}

// Polls (bounded) until `job` has a collective in flight on `daemon`.
inline bool WaitInflight(const DaemonProcess& daemon, const std::string& job,
                         absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    auto s = JobStatusOf(daemon, job);
    if (s.has_value() && s->inflight() > 0) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

// Polls (bounded) until `daemon` no longer runs `job` (its last local worker left: retired).
inline bool WaitJobRetired(const DaemonProcess& daemon, const std::string& job,
                           absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (!JobStatusOf(daemon, job).has_value()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

}  // namespace dynamiq::faults

#endif  // DQ_TESTS_FAULTS_FAULT_HARNESS_H_

#include "bench/tcp_store.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"

namespace dynamiq::bench {
using common::CloseFd;
using common::ConnectWithRetry;
using common::ErrnoStatus;
using common::ListenOn;
using common::PeerName;
using common::PollFd;
using common::ReadFull;
using common::SetNoDelay;
using common::SockaddrString;
using common::SplitHostPort;
using common::WriteFull;

namespace {

enum class Op : uint8_t { kSet = 1, kGet = 2, kWait = 3 };

// A frame's remaining bytes must arrive within this long once its first byte has (a client that
// stalls mid-frame is dropped); responses must be written within it too.
constexpr absl::Duration kFrameTimeout = absl::Seconds(60);
// How often a server thread blocked in GET/WAIT checks whether its client hung up.
constexpr absl::Duration kHangupCheckInterval = absl::Milliseconds(250);
// The client waits this much longer than the server-side timeout for the answer.
constexpr absl::Duration kClientGrace = absl::Seconds(10);
// A SET is answered at once; this bounds the client's wait for that answer.
constexpr absl::Duration kSetTimeout = absl::Seconds(30);
constexpr size_t kMaxConnections = 4096;
constexpr size_t kMaxIdleConnections = 8;
constexpr absl::Duration kJoinTimeout = absl::Seconds(5);

void LogLine(absl::string_view line) {
  std::string s = absl::StrCat("[dynamiq tcp_store] ", line, "\n");
  std::fwrite(s.data(), 1, s.size(), stderr);
}

// ---- Byte order -------------------------------------------------------------------------------

void PutU32(std::string& out, uint32_t v) {
  char b[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
  out.append(b, 4);
}
void PutU64(std::string& out, uint64_t v) {
  PutU32(out, static_cast<uint32_t>(v >> 32));
  PutU32(out, static_cast<uint32_t>(v));
}
uint32_t GetU32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | uint32_t{u[3]};
}

// Bounds-checked reader over a frame body.
class Reader {
 public:
  explicit Reader(absl::string_view data) : data_(data) {}
  bool U32(uint32_t* v) {
    if (data_.size() < 4) return false;
    *v = GetU32(data_.data());
    data_.remove_prefix(4);
    return true;
  }
  bool U64(uint64_t* v) {
    uint32_t hi, lo;
    if (!U32(&hi) || !U32(&lo)) return false;
    *v = (uint64_t{hi} << 32) | lo;
    return true;
  }
  bool Bytes(size_t n, absl::string_view* v) {
    if (data_.size() < n) return false;
    *v = data_.substr(0, n);
    data_.remove_prefix(n);
    return true;
  }
  bool done() const { return data_.empty(); }

 private:
  absl::string_view data_;
};

uint64_t TimeoutMillis(absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return 0;
  timeout = std::min(timeout, kMaxServerTimeout);
  return static_cast<uint64_t>(absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1))));
}

// Prepends the u32 length to a frame whose type byte and body are in `payload`.
std::string Frame(const std::string& payload) {
  std::string out;
  out.reserve(payload.size() + 4);
  PutU32(out, static_cast<uint32_t>(payload.size()));
  out += payload;
  return out;
}

// Reads one frame (type byte + body). The first byte may take until `first_byte_deadline`; the
// rest must follow within kFrameTimeout. Closes nothing.
absl::Status ReadFrame(int fd, absl::Time first_byte_deadline, absl::string_view what, std::string* frame,
                       size_t* received) {
  char len_bytes[4];
  *received = 0;
  DQ_RETURN_IF_ERROR(PollFd(fd, POLLIN, first_byte_deadline, what));
  DQ_RETURN_IF_ERROR(ReadFull(fd, len_bytes, 4, absl::Now() + kFrameTimeout, what, received));
  uint32_t len = GetU32(len_bytes);
  if (len == 0 || len > kMaxFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": frame of ", len, " bytes (allowed 1..", kMaxFrameBytes, ")"));
  }
  frame->resize(len);
  return ReadFull(fd, frame->data(), len, absl::Now() + kFrameTimeout, what);
}

}  // namespace

// ---- Server -----------------------------------------------------------------------------------

namespace internal {

struct TcpStoreServerState {
  ~TcpStoreServerState() {
    CloseFd(listen_fd);
    CloseFd(wake_read);
    CloseFd(wake_write);
  }

  int listen_fd = -1;
  int wake_read = -1;  // self-pipe that wakes the accept loop for shutdown
  int wake_write = -1;

  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::map<std::string, std::string, std::less<>> values ABSL_GUARDED_BY(mu);
  // Live connections: id -> socket. A connection thread removes its entry before closing the
  // socket, so shutdown(2) from the destructor never hits a reused descriptor number.
  std::map<uint64_t, int> connections ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> finished ABSL_GUARDED_BY(mu);  // threads ready to join
  std::map<uint64_t, std::thread> threads;             // accept thread only, then the destructor
};

namespace {

// A blocked GET/WAIT: true when the client hung up (so the thread can stop waiting for it).
bool PeerHungUp(int fd) {
  pollfd p = {fd, static_cast<short>(POLLRDHUP), 0};
  int rc;
  do {
    rc = poll(&p, 1, 0);
  } while (rc < 0 && errno == EINTR);
  return rc > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

struct Response {
  absl::Status status;
  std::string value;  // body for an OK GET
  bool hung_up = false;
};

// Waits (under `state.mu`) until `present()` holds, the timeout passes, the server stops, or the
// client hangs up.
template <typename Present>
Response AwaitKeys(TcpStoreServerState& state, int fd, uint64_t timeout_ms, Present present,
                   absl::FunctionRef<std::string()> describe_missing) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  Response r;
  const absl::Duration timeout = std::min(absl::Milliseconds(timeout_ms), kMaxServerTimeout);
  const absl::Time deadline = absl::Now() + timeout;
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) { return state.stopping || present(); };
  for (;;) {
    absl::Duration left = deadline - absl::Now();
    if (state.mu.AwaitWithTimeout(absl::Condition(&ready), std::min(left, kHangupCheckInterval))) break;
    if (absl::Now() >= deadline) {
      r.status = absl::DeadlineExceededError(describe_missing());
      return r;
    }
    state.mu.Unlock();
    bool hung_up = PeerHungUp(fd);
    state.mu.Lock();
    if (hung_up) {
      r.hung_up = true;
      return r;
    }
  }
  if (state.stopping) r.status = absl::UnavailableError("store server is shutting down");
  return r;
}

// Executes one request. An error return means the frame is malformed (close the connection);
// otherwise `*response` holds the answer.
absl::Status Execute(TcpStoreServerState& state, int fd, absl::string_view frame, Response* response) {
  const auto op = static_cast<Op>(static_cast<uint8_t>(frame[0]));
  Reader in(frame.substr(1));
  if (op == Op::kSet) {
    uint32_t key_len, value_len;
    absl::string_view key, value;
    if (!in.U32(&key_len) || key_len > kMaxKeyBytes || !in.Bytes(key_len, &key) || !in.U32(&value_len) ||
        value_len > kMaxValueBytes || !in.Bytes(value_len, &value) || !in.done()) {
      return absl::InvalidArgumentError("malformed SET (bad key/value length or trailing bytes)");
    }
    std::string k(key), v(value);  // Copy outside the lock (values reach 64 MiB).
    absl::MutexLock lock(&state.mu);
    state.values.insert_or_assign(std::move(k), std::move(v));
    return absl::OkStatus();
  }
  if (op == Op::kGet) {
    uint64_t timeout_ms;
    uint32_t key_len;
    absl::string_view key;
    if (!in.U64(&timeout_ms) || !in.U32(&key_len) || key_len > kMaxKeyBytes || !in.Bytes(key_len, &key) || !in.done()) {
      return absl::InvalidArgumentError("malformed GET (bad key length or trailing bytes)");
    }
    absl::MutexLock lock(&state.mu);
    auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) { return state.values.count(key) > 0; };
    *response = AwaitKeys(state, fd, timeout_ms, present, [&] {
      return absl::StrCat("store key '", key, "' was not set within ",
                          absl::FormatDuration(absl::Milliseconds(timeout_ms)));
    });
    if (response->status.ok() && !response->hung_up) response->value = state.values.find(key)->second;
    return absl::OkStatus();
  }
  if (op == Op::kWait) {
    uint64_t timeout_ms;
    uint32_t n;
    if (!in.U64(&timeout_ms) || !in.U32(&n) || n > kMaxWaitKeys) {
      return absl::InvalidArgumentError("malformed WAIT (bad key count)");
    }
    std::vector<absl::string_view> keys(n);
    for (uint32_t i = 0; i < n; ++i) {
      uint32_t key_len;
      if (!in.U32(&key_len) || key_len > kMaxKeyBytes || !in.Bytes(key_len, &keys[i])) {
        return absl::InvalidArgumentError("malformed WAIT (bad key length)");
      }
    }
    if (!in.done()) return absl::InvalidArgumentError("malformed WAIT (trailing bytes)");
    absl::MutexLock lock(&state.mu);
    auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
      for (absl::string_view k : keys) {
        if (state.values.count(k) == 0) return false;
      }
      return true;
    };
    *response = AwaitKeys(state, fd, timeout_ms, present, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      std::vector<absl::string_view> missing;
      for (absl::string_view k : keys) {
        if (state.values.count(k) == 0) missing.push_back(k);
      }
      return absl::StrCat("store keys not set within ", absl::FormatDuration(absl::Milliseconds(timeout_ms)), ": ",
                          absl::StrJoin(missing, ", "));
    });
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown request type ", static_cast<int>(frame[0])));
}

std::string EncodeResponse(const Response& r) {
  std::string payload;
  payload.push_back(static_cast<char>(r.status.code()));
  if (r.status.ok()) {
    payload += r.value;
  } else {
    payload.append(r.status.message().data(), std::min<size_t>(r.status.message().size(), kMaxKeyBytes * 4));
  }
  return Frame(payload);
}

void ServeConnection(std::shared_ptr<TcpStoreServerState> state, uint64_t id, int fd) {
  const std::string what = absl::StrCat("store connection from ", PeerName(fd));
  constexpr absl::string_view kIo = "request";
  // Errors caused by the server's own shutdown are not worth a log line.
  auto log = [&](const absl::Status& s) {
    bool stopping;
    {
      absl::MutexLock lock(&state->mu);
      stopping = state->stopping;
    }
    if (!stopping) LogLine(absl::StrCat("closing ", what, ": ", s.message()));
  };
  for (;;) {
    std::string frame;
    size_t received = 0;
    absl::Status s = ReadFrame(fd, absl::InfiniteFuture(), kIo, &frame, &received);
    if (!s.ok()) {
      // A clean close between frames is the normal end of a connection; anything else is logged.
      if (!(received == 0 && absl::IsUnavailable(s))) log(s);
      break;
    }
    Response response;
    s = Execute(*state, fd, frame, &response);
    if (!s.ok()) {
      log(s);
      break;
    }
    if (response.hung_up) break;
    s = WriteFull(fd, EncodeResponse(response), absl::Now() + kFrameTimeout, "response");
    if (!s.ok()) {
      log(s);
      break;
    }
  }
  {
    absl::MutexLock lock(&state->mu);
    state->connections.erase(id);
    state->finished.push_back(id);
  }
  CloseFd(fd);
}

}  // namespace
}  // namespace internal

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(const std::string& listen_address) {
  DQ_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(listen_address));
  auto state = std::make_shared<internal::TcpStoreServerState>();
  DQ_ASSIGN_OR_RETURN(state->listen_fd, ListenOn(host_port.first, host_port.second, 512));

  sockaddr_storage bound = {};
  socklen_t len = sizeof(bound);
  if (getsockname(state->listen_fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, "getsockname", errno);
  }
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) return ErrnoStatus(absl::StatusCode::kInternal, "pipe2", errno);
  state->wake_read = pipe_fds[0];
  state->wake_write = pipe_fds[1];
  int port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  std::unique_ptr<TcpStoreServer> server(new TcpStoreServer(state, port, SockaddrString(bound)));
  server->accept_thread_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

TcpStoreServer::TcpStoreServer(std::shared_ptr<internal::TcpStoreServerState> state, int port, std::string address)
    : state_(std::move(state)), port_(port), address_(std::move(address)) {}

void TcpStoreServer::AcceptLoop() {
  internal::TcpStoreServerState& st = *state_;
  uint64_t next_id = 0;
  for (;;) {
    // Join connection threads that have finished.
    std::vector<uint64_t> finished;
    {
      absl::MutexLock lock(&st.mu);
      finished.swap(st.finished);
    }
    for (uint64_t id : finished) {
      auto it = st.threads.find(id);
      if (it != st.threads.end()) {
        it->second.join();
        st.threads.erase(it);
      }
    }

    pollfd p[2] = {{st.listen_fd, POLLIN, 0}, {st.wake_read, POLLIN, 0}};
    int rc = poll(p, 2, 1000);
    if (rc < 0 && errno != EINTR) {
      LogLine(absl::StrCat("accept loop: poll: ", strerror(errno)));
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    if (p[1].revents != 0) return;  // Shutdown.
    if (rc <= 0 || (p[0].revents & POLLIN) == 0) continue;

    int fd = accept4(st.listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        LogLine(absl::StrCat("accept: ", strerror(errno), "; retrying in 100ms"));
        absl::SleepFor(absl::Milliseconds(100));
      }
      continue;  // EINTR, EAGAIN, ECONNABORTED, ...: try again.
    }
    SetNoDelay(fd);
    uint64_t id = ++next_id;
    {
      absl::MutexLock lock(&st.mu);
      if (st.stopping) {
        CloseFd(fd);
        return;
      }
      if (st.connections.size() >= kMaxConnections) {
        LogLine(absl::StrCat("refusing connection from ", PeerName(fd), ": already ", kMaxConnections, " connections"));
        CloseFd(fd);
        continue;
      }
      st.connections[id] = fd;
    }
    st.threads[id] = std::thread(internal::ServeConnection, state_, id, fd);
  }
}

TcpStoreServer::~TcpStoreServer() {
  internal::TcpStoreServerState& st = *state_;
  {
    absl::MutexLock lock(&st.mu);
    st.stopping = true;                                                   // Wakes blocked GET/WAIT requests.
    for (const auto& [id, fd] : st.connections) shutdown(fd, SHUT_RDWR);  // Wakes blocked reads/writes.
  }
  char byte = 1;
  while (write(st.wake_write, &byte, 1) < 0 && errno == EINTR) {
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  // New connection attempts are refused from now on (the listening socket's backlog is dropped).
  CloseFd(st.listen_fd);
  st.listen_fd = -1;

  auto all_done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) { return st.connections.empty(); };
  bool done;
  {
    absl::MutexLock lock(&st.mu);
    done = st.mu.AwaitWithTimeout(absl::Condition(&all_done), kJoinTimeout);
  }
  if (!done) {
    LogLine("server shutdown: some connection threads did not finish within 5s; detaching them");
  }
  for (auto& [id, thread] : st.threads) {
    if (done) {
      thread.join();
    } else {
      thread.detach();  // It holds its own reference to the shared state.
    }
  }
  st.threads.clear();
}

// ---- Client -----------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::Connect(const std::string& address,
                                                                        absl::Duration timeout) {
  DQ_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(address));
  DQ_ASSIGN_OR_RETURN(int fd, ConnectWithRetry(host_port.first, host_port.second, absl::Now() + timeout, "the store"));
  return std::unique_ptr<TcpStoreClient>(new TcpStoreClient(host_port.first, host_port.second, timeout, fd));
}

TcpStoreClient::TcpStoreClient(std::string host, std::string port, absl::Duration connect_timeout, int first_fd)
    : host_(std::move(host)),
      port_(std::move(port)),
      address_(absl::StrCat(host_.find(':') != std::string::npos ? absl::StrCat("[", host_, "]") : host_, ":", port_)),
      connect_timeout_(connect_timeout) {
  idle_fds_.push_back(first_fd);
}

TcpStoreClient::~TcpStoreClient() {
  absl::MutexLock lock(&mu_);
  for (int fd : idle_fds_) CloseFd(fd);
}

absl::StatusOr<int> TcpStoreClient::TakeConnection(absl::Time deadline, bool* reused) {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_fds_.empty()) {
      int fd = idle_fds_.back();
      idle_fds_.pop_back();
      *reused = true;
      return fd;
    }
  }
  *reused = false;
  return ConnectWithRetry(host_, port_, std::min(deadline, absl::Now() + connect_timeout_), "the store");
}

void TcpStoreClient::ReturnConnection(int fd) {
  absl::MutexLock lock(&mu_);
  if (idle_fds_.size() < kMaxIdleConnections) {
    idle_fds_.push_back(fd);
  } else {
    CloseFd(fd);
  }
}

absl::StatusOr<std::string> TcpStoreClient::Call(const std::string& request, absl::Duration server_timeout) {
  const absl::Time deadline = absl::Now() + std::min(server_timeout, kMaxServerTimeout) + kClientGrace;
  const std::string what = absl::StrCat("store at ", address_);
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool reused = false;
    DQ_ASSIGN_OR_RETURN(int fd, TakeConnection(deadline, &reused));
    std::string frame;
    size_t received = 0;
    absl::Status s = WriteFull(fd, request, deadline, what);
    if (s.ok()) s = ReadFrame(fd, deadline, what, &frame, &received);
    if (!s.ok()) {
      CloseFd(fd);
      // A pooled connection the server has since closed fails before any answer: retry once.
      if (reused && received == 0 && absl::IsUnavailable(s)) continue;
      if (absl::IsDeadlineExceeded(s)) {
        return absl::DeadlineExceededError(
            absl::StrCat(what, " did not answer within ", absl::FormatDuration(server_timeout + kClientGrace)));
      }
      return absl::UnavailableError(s.message());
    }
    const int code = static_cast<uint8_t>(frame[0]);
    if (code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
      CloseFd(fd);
      return absl::InternalError(absl::StrCat(what, " sent an invalid status code ", code));
    }
    ReturnConnection(fd);
    if (code != 0) return absl::Status(static_cast<absl::StatusCode>(code), frame.substr(1));
    return frame.substr(1);
  }
  return absl::UnavailableError(absl::StrCat(what, " closed the connection twice in a row"));
}

absl::Status TcpStoreClient::Set(absl::string_view key, absl::string_view value) {
  if (key.size() > kMaxKeyBytes || value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("store SET of key '", key.substr(0, 64), "': key of ", key.size(),
                                                   " bytes (max ", kMaxKeyBytes, ") or value of ", value.size(),
                                                   " bytes (max ", kMaxValueBytes, ")"));
  }
  std::string payload;
  payload.push_back(static_cast<char>(Op::kSet));
  PutU32(payload, static_cast<uint32_t>(key.size()));
  payload.append(key.data(), key.size());
  PutU32(payload, static_cast<uint32_t>(value.size()));
  payload.append(value.data(), value.size());
  return Call(Frame(payload), kSetTimeout).status();
}

absl::StatusOr<std::string> TcpStoreClient::Get(absl::string_view key, absl::Duration timeout) {
  if (key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("store GET: key of ", key.size(), " bytes exceeds the ", kMaxKeyBytes, "-byte limit"));
  }
  std::string payload;
  payload.push_back(static_cast<char>(Op::kGet));
  PutU64(payload, TimeoutMillis(timeout));
  PutU32(payload, static_cast<uint32_t>(key.size()));
  payload.append(key.data(), key.size());
  return Call(Frame(payload), std::max(timeout, absl::ZeroDuration()));
}

absl::Status TcpStoreClient::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  if (keys.size() > kMaxWaitKeys) {
    return absl::InvalidArgumentError(
        absl::StrCat("store WAIT of ", keys.size(), " keys exceeds the ", kMaxWaitKeys, "-key limit"));
  }
  std::string payload;
  payload.push_back(static_cast<char>(Op::kWait));
  PutU64(payload, TimeoutMillis(timeout));
  PutU32(payload, static_cast<uint32_t>(keys.size()));
  for (const std::string& k : keys) {
    if (k.size() > kMaxKeyBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("store WAIT: key of ", k.size(), " bytes exceeds the ", kMaxKeyBytes, "-byte limit"));
    }
    PutU32(payload, static_cast<uint32_t>(k.size()));
    payload += k;
  }
  if (payload.size() > kMaxFrameBytes) return absl::InvalidArgumentError("store WAIT request too large");
  return Call(Frame(payload), std::max(timeout, absl::ZeroDuration())).status();
}

}  // namespace dynamiq::bench

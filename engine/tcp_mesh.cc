#include "engine/tcp_mesh.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "engine/tcp_hello.h"
#include "engine/tcp_mesh_impl.h"

namespace dynamiq::engine {

using tcp_frame::Parts;
using tcp_mesh_internal::Early;
using tcp_mesh_internal::EarlyPtr;
using tcp_mesh_internal::Link;
using tcp_mesh_internal::Op;
using tcp_mesh_internal::Outgoing;
using tcp_mesh_internal::Session;
using tcp_mesh_internal::View;

namespace {

// The transport's threads block in recv and sendmsg (closing shuts the sockets down to free them).
void SetBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK); }

// A member's record of the connections it holds intact ("mesh/<rank>"): per node
// "<node>:<made epoch>.<made sequence>:<floor epoch>.<floor sequence>", separated by ';'.
struct Held {
  Session made, floor;
};
std::string SessionText(Session s) { return absl::StrCat(s.epoch, ".", s.sequence); }
bool ParseSession(absl::string_view text, Session* s) {
  std::vector<absl::string_view> f = absl::StrSplit(text, '.');
  return f.size() == 2 && absl::SimpleAtoi(f[0], &s->epoch) && absl::SimpleAtoi(f[1], &s->sequence);
}
// What `record` says of the connection to `node` (nothing for a record that does not parse: a
// connection is kept only when both ends say so).
std::optional<Held> HeldTo(absl::string_view record, int node) {
  for (absl::string_view entry : absl::StrSplit(record, ';', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(entry, ':');
    int n = -1;
    Held held;
    if (f.size() == 3 && absl::SimpleAtoi(f[0], &n) && n == node && ParseSession(f[1], &held.made) &&
        ParseSession(f[2], &held.floor)) {
      return held;
    }
  }
  return std::nullopt;
}

// Whether the connection is not waiting out a retransmission timeout. One that went through a cut
// link (or towards a peer that vanished) backs its timer off and, once the link is back, takes
// seconds to move again, where a new connection starts at once: it is not kept for the next view.
// (Unacknowledged bytes alone say nothing: the receiver may delay its ACK by tens of milliseconds.)
bool Settled(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return false;
  return info.tcpi_retransmits == 0 && info.tcpi_backoff == 0 && info.tcpi_ca_state != TCP_CA_Loss;
}

}  // namespace

TcpMesh::Impl::~Impl() {
  std::vector<std::unique_ptr<Link>> all;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    for (auto& l : links_) {
      if (l == nullptr) continue;
      shutdown(l->fd, SHUT_RDWR);
      all.push_back(std::move(l));
    }
  }
  Join(all);
}

void TcpMesh::Impl::Join(std::vector<std::unique_ptr<Link>>& links) {
  for (auto& l : links) {
    if (l->reader.joinable()) l->reader.join();
    if (l->writer.joinable()) l->writer.join();
    common::CloseFd(l->fd);
  }
  links.clear();
}

TcpMesh::Counts TcpMesh::Impl::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

void TcpMesh::Impl::Attach(Link& l, View& v, int q, bool kept) {
  l.view = &v;
  l.index = q;
  if (kept) {
    l.floor = v.session();
    l.sends.push_back({nullptr, v.session()});
    for (auto it = l.ahead.begin(); it != l.ahead.end();) {
      if (it->first > v.session()) break;
      for (auto& [tag, e] : it->second) {
        if (it->first == v.session()) {
          l.early[tag].push_back(std::move(e));
        } else {
          Refund(l, e->bytes.size());
        }
      }
      it = l.ahead.erase(it);
    }
    if (auto g = l.gave_up_ahead.find(v.session()); g != l.gave_up_ahead.end()) {
      LostPeer(v, q, absl::UnavailableError(absl::StrCat(v.Who(), ": rank ", q, " gave up: ", g->second)));
    }
    l.gave_up_ahead.erase(l.gave_up_ahead.begin(), l.gave_up_ahead.upper_bound(v.session()));
  }
  if (!l.status.ok()) {
    LostPeer(v, q,
             absl::UnavailableError(absl::StrCat(v.Who(), ": connection to rank ", q, " lost: ", l.status.message())));
  }
}

absl::StatusOr<std::unique_ptr<Transport>> TcpMesh::Impl::Connect(Store& store, const std::vector<int>& members,
                                                                  Session session) {
  const int size = static_cast<int>(members.size());
  int me = -1;
  for (int i = 0; i < size; ++i) {
    if (members[i] < 0 || members[i] >= num_nodes_ || (i > 0 && members[i] <= members[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("tcp mesh: members must be ascending node ids below ", num_nodes_));
    }
    if (members[i] == node_) me = i;
  }
  if (me < 0) return absl::InvalidArgumentError(absl::StrCat("tcp mesh: node ", node_, " is not a member"));
  if (options_.hostname.empty()) return absl::InvalidArgumentError("tcp transport: no hostname to listen on");
  {
    absl::MutexLock lock(&mu_);
    if (attached_ != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("tcp mesh of node ", node_, ": the transport of session ",
                                                        SessionText(attached_->session()), " is still there"));
    }
  }
  const absl::Time deadline = absl::Now() + options_.timeout;
  auto remaining = [deadline] { return std::max(absl::ZeroDuration(), deadline - absl::Now()); };
  // A backlog for strangers too: connections queue while the hellos are read.
  absl::StatusOr<int> listening = common::ListenOn(options_.hostname, "0", std::max(size, 128));
  if (!listening.ok()) return common::Annotate(listening.status(), "tcp transport");
  common::UniqueFd listener(*listening);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(listener.fd, reinterpret_cast<sockaddr*>(&bound), &len);
  // "host:port" (IPv6 hosts in brackets), as common::SplitHostPort reads it back.
  DQ_RETURN_IF_ERROR(store.Set(absl::StrCat("tcp/", me), common::SockaddrString(bound)));

  // Which connections each end holds intact, published so that both ends of a pair decide alike.
  std::vector<std::optional<Held>> mine(size);
  std::string record;
  {
    absl::MutexLock lock(&mu_);
    for (int q = 0; q < size; ++q) {
      const Link* l = q == me ? nullptr : links_[members[q]].get();
      if (l == nullptr || !l->status.ok() || !Settled(l->fd)) continue;
      mine[q] = Held{l->made, l->floor};
      absl::StrAppend(&record, members[q], ":", SessionText(l->made), ":", SessionText(l->floor), ";");
    }
  }
  DQ_RETURN_IF_ERROR(store.Set(absl::StrCat("mesh/", me), record));
  std::vector<bool> keep(size, false);
  for (int q = 0; q < size; ++q) {
    if (!mine[q].has_value()) continue;
    DQ_ASSIGN_OR_RETURN(const std::string theirs, store.Get(absl::StrCat("mesh/", q), remaining()));
    const std::optional<Held> held = HeldTo(theirs, node_);
    keep[q] = held.has_value() && held->made == mine[q]->made && session > mine[q]->floor && session > held->floor;
  }
  std::vector<std::unique_ptr<Link>> retired;
  {
    absl::MutexLock lock(&mu_);
    for (int q = 0; q < size; ++q) {
      std::unique_ptr<Link>& l = links_[members[q]];
      if (q == me || keep[q] || l == nullptr) continue;
      BreakLink(*l, absl::CancelledError("replaced by a new connection"));
      for (auto& [later, kept] : l->ahead) {
        for (auto& [tag, e] : kept) Refund(*l, e->bytes.size());
      }
      l->ahead.clear();
      retired.push_back(std::move(l));
    }
  }
  Join(retired);

  // Lower ranks: connect and introduce ourselves (engine/tcp_hello.h). Higher ranks: accepted
  // concurrently, each introducing itself; anything else is turned away. The wait ends early when
  // the store's waits would (engine::InterruptibleStore: a peer that failed the collective
  // instead of joining, a view that changed).
  std::vector<TcpLink> made(size);
  std::vector<common::UniqueFd> made_fds(size);
  for (int q = 0; q < me; ++q) {
    if (keep[q]) continue;
    DQ_ASSIGN_OR_RETURN(const std::string address, store.Get(absl::StrCat("tcp/", q), remaining()));
    DQ_ASSIGN_OR_RETURN(const auto host_port, common::SplitHostPort(address));
    DQ_ASSIGN_OR_RETURN(made[q], DialPeer(host_port.first, host_port.second, me, q, options_.key, deadline));
    made_fds[q].reset(made[q].fd);
    SetBlocking(made[q].fd);
  }
  std::vector<bool> wanted(size, false);
  for (int q = me + 1; q < size; ++q) wanted[q] = !keep[q];
  if (std::find(wanted.begin(), wanted.end(), true) != wanted.end()) {
    HelloAcceptor acceptor(listener.fd, me, size, options_.key, options_.hello_timeout, wanted);
    DQ_ASSIGN_OR_RETURN(std::vector<TcpLink> accepted,
                        acceptor.AcceptAll(deadline, options_.timeout, [&store] { return store.Interrupted(); }));
    for (int q = me + 1; q < size; ++q) {
      if (accepted[q].fd < 0) continue;
      made[q] = std::move(accepted[q]);
      made_fds[q].reset(made[q].fd);
      common::SetNoDelay(made[q].fd);
      SetBlocking(made[q].fd);
    }
  }

  auto view = std::make_unique<View>(shared_from_this(), me, members, session);
  std::vector<Link*> start;
  {
    absl::MutexLock lock(&mu_);
    for (int q = 0; q < size; ++q) {
      if (q == me) continue;
      if (!keep[q]) {
        auto l = std::make_unique<Link>();
        l->node = members[q];
        l->fd = made_fds[q].release();
        l->session_key = std::move(made[q].session);
        l->made = l->floor = l->peer_session = session;
        start.push_back(l.get());
        links_[members[q]] = std::move(l);
        ++counts_.made;
      } else {
        ++counts_.kept;
      }
      view->links[q] = links_[members[q]].get();
      Attach(*view->links[q], *view, q, keep[q]);
    }
    attached_ = view.get();
  }
  for (Link* l : start) {
    l->reader = std::thread([this, l] { ReadLoop(*l); });
    l->writer = std::thread([this, l] { WriteLoop(*l); });
  }
  return std::unique_ptr<Transport>(std::move(view));
}

TcpMesh::TcpMesh(int node, int num_nodes, TcpTransportOptions options, bool keep_connections)
    : impl_(std::make_shared<Impl>(node, num_nodes, std::move(options), keep_connections)) {}

TcpMesh::~TcpMesh() = default;

absl::StatusOr<std::unique_ptr<Transport>> TcpMesh::Connect(Store& store, const std::vector<int>& members,
                                                            TcpMeshSession session) {
  return impl_->Connect(store, members, session);
}

TcpMesh::Counts TcpMesh::counts() const { return impl_->counts(); }

}  // namespace dynamiq::engine

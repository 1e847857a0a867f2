// ErrorFeedback: the EF21 state (Richtarik et al.; the error feedback ARC-Top-K is analysed with)
// of one job's arc_topk collectives on this node, per tensor name.
//
// Why in the daemon: the state must persist across steps and be identical in meaning on every
// node, and only the daemon sees what the compressor selected (the rows of the plan all nodes
// agreed on); a client would have to re-derive the selection from the result. The daemon's unit of
// compression is the node (its workers' local sum is one rank of the cross-node all-reduce), so
// the state is per node: `local` is this node's g_i, `global` the estimate G = sum_i g_i that
// every node holds bit-identically.
//
// One step of tensor t with this node's sum x (ErrorFeedbackAllReduce, server/error_feedback_all_reduce.h:
// a decorator of the cross-node all-reduce), momentum eta in (0, 1]
// (EF21M, Fatkhullin et al.; eta = 1 is plain EF21):
//   first step (or after a reset): v_i = g_i = x; G = all-reduce_none(x) (dense, exact); result G.
//   later:  v_i = (1 - eta) v_i + eta x; u = v_i - g_i;
//           R = all-reduce_arc_topk(u) = sum_i C(u_i) (C keeps the agreed rows);
//           g_i += C(u_i) (the kept rows of u); G += R; result G.
// Invariant: G = sum_i g_i, so the nodes never drift apart; what is not sent stays in x - g_i and
// is sent once its rows rank high enough.
//
// Bounded: at most `max_bytes` of state per job (8 bytes per element of every tensor, 12 with
// momentum, plus kStateOverheadBytes and the name per tensor). States that are not used again go:
// a state untouched for `max_idle_collectives` of the job's collectives is retired, and a tensor
// that does not fit evicts the least recently used states until it does (their tensors restart
// with the dense first step when they come back). Only a tensor whose own state exceeds the limit
// fails its collective, with RESOURCE_EXHAUSTED naming the limit (--error_feedback_mib). Both
// rules count the job's collective sequence numbers, so every node that sees the same collectives
// under the same limit retires the same states at the same collective (every node must run the
// same --error_feedback_mib). Reset: a state is dropped when the tensor's size or the job's config
// epoch changes (any compression change), and all states go with the job.
//
// Thread safety: none; the job's reducer thread owns it (one collective at a time).
#ifndef DQ_SERVER_ERROR_FEEDBACK_H_
#define DQ_SERVER_ERROR_FEEDBACK_H_

#include <stddef.h>
#include <stdint.h>

#include <list>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dynamiq::server {

struct ErrorFeedbackState {
  uint64_t epoch = 0;
  bool initialized = false;     // false: the next step is the dense first step
  std::vector<float> local;     // g_i
  std::vector<float> global;    // G
  std::vector<float> momentum;  // v_i (empty when eta = 1)
};

class ErrorFeedback {
 public:
  // What a state costs beyond its vectors (map and list nodes, vector headers), charged with its
  // name against max_bytes so that many tiny states are bounded too.
  static constexpr size_t kStateOverheadBytes = 256;
  // A state untouched for this many of the job's collectives is retired (default).
  static constexpr uint64_t kDefaultMaxIdleCollectives = 16384;

  // `momentum` is eta in (0, 1].
  explicit ErrorFeedback(size_t max_bytes, double momentum = 1.0,
                         uint64_t max_idle_collectives = kDefaultMaxIdleCollectives)
      : max_bytes_(max_bytes), momentum_(momentum), max_idle_(max_idle_collectives) {}
  double momentum() const { return momentum_; }

  // The state of `tensor` (n elements) under config `epoch` for the job's collective `sequence`
  // (non-decreasing from call to call): reset (uninitialized) when new, when n changed, or when
  // the epoch changed. Retires idle states first, then evicts least recently used ones to make
  // room; RESOURCE_EXHAUSTED only if this tensor's state alone exceeds max_bytes. The pointer is
  // valid until the next call.
  absl::StatusOr<ErrorFeedbackState*> Get(absl::string_view tensor, size_t n, uint64_t epoch, uint64_t sequence);

  size_t bytes() const { return bytes_; }
  size_t tensors() const { return states_.size(); }
  // States dropped so far because they were idle / to make room for another.
  uint64_t retired_idle() const { return retired_idle_; }
  uint64_t evicted() const { return evicted_; }
  void Clear();

 private:
  struct Entry {
    ErrorFeedbackState state;
    uint64_t last_used = 0;                   // the job's collective sequence
    std::list<std::string>::iterator in_lru;  // its place in lru_
  };
  using Map = std::map<std::string, Entry, std::less<>>;

  size_t PerElement() const;
  size_t Cost(const Map::iterator& it) const;
  void Erase(Map::iterator it);

  size_t max_bytes_;
  double momentum_;
  uint64_t max_idle_;
  size_t bytes_ = 0;
  uint64_t retired_idle_ = 0;
  uint64_t evicted_ = 0;
  Map states_;
  std::list<std::string> lru_;  // names, least recently used first
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_ERROR_FEEDBACK_H_

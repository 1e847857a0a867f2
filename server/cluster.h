// Cluster: this node's side of the coordinator protocol, over the coordinator's store (in-process
// on a single node; node 0's Rendezvous service over gRPC otherwise). Whatever the nodes of a
// cluster agree on goes through here, under one key layout (<id>: the job id with '%' and '/'
// escaped as %25 and %2F, so that one job's keys never lie under another's prefix):
//
//   member/<r>                          node r's peer address (RendezvousService's Join)
//   cluster/error_sample_rate           node 0's --error_sample_rate, adopted by every node
//   cluster/incarnation_floor           the highest incarnation of any job whose keys a node let go
//   job/<id>/live/<r>                   node r runs the job (some incarnation of it)
//   job/<id>/base                       the floor when the job's keys were created
//   job/<id>/node<r>/incarnations       how many times node r has created job <id> since then
//   job/<id>/inc<k>/view<E>-from<s>/... incarnation k's transport rendezvous: view E's connection
//                                       made for collective s (server/group_view.h)
//   job/<id>/inc<k>/latest_view         its newest group view's epoch (claimed by compare-and-set)
//   job/<id>/inc<k>/view/<E>            view E: GroupView::Encode (epoch 0, every node, is not stored)
//   job/<id>/inc<k>/join/<r>            node r (a restarted dynamiqd) asks the members to admit it
//   job/<id>/inc<k>/latest_epoch        its newest compression change (claimed by compare-and-set)
//   job/<id>/inc<k>/config/<E>          epoch E: a serialized dynamiq.v1.PublishedConfig
//   job/<id>/inc<k>/failed/<seq>        why a node failed collective seq: "<code>|<node>|<message>"
//
// A node's c-th creation of the job is incarnation base + c. Key lifecycle: the store keeps nothing
// that no node needs any more. `member/` and `cluster/` are one key per node or setting. A node sets
// `live/<r>` before it claims an incarnation; when it retires its last incarnation of the job
// (RetireJob) it raises the floor to its newest incarnation, then deletes `live/<r>`, and the node
// that deletes the last live key deletes every key under `job/<id>/` with it, in one atomic step of
// the store (engine::Store::Deletion). A later run of the id starts a new base from the floor, so
// its incarnations stay above every earlier one (stale messages never fit) and every node that
// creates it agrees on them, as before. While a job runs, its other keys are bounded: a node
// deletes a connection's rendezvous keys once it has written keys of two later connections, its own
// failure reports past the newest 64, the publisher of config epoch E deletes epoch E - 16
// (PollConfig looks no further back), and the claimant of view E deletes view E - 16. A job's keys stay while some node
// holds its live key: a node killed with the job running keeps it until that node runs the id again and retires it (or
// the coordinator restarts, with an empty store).
//
// The settings every node must share (--device, --transport, --step_budget, the codec defaults, ...)
// are not keys: the coordinator compares them when a node joins and refuses a node whose settings
// differ from node 0's before it becomes a member (Options::settings).
//
// (server/security.h adds the cluster-authentication agreement under cluster/.) Start-up waits
// (Join, the agreements) give up after options.timeout, report what they wait for every 5 s on
// stderr, and end with CANCELLED as soon as `cancelled` says so. Thread-safe.
#ifndef DQ_SERVER_CLUSTER_H_
#define DQ_SERVER_CLUSTER_H_

#include <stdint.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/store.h"
#include "server/group_view.h"
#include "server/grpc_store.h"
#include "server/job_config.h"
#include "server/membership.h"

namespace dynamiq::server {

class Cluster {
 public:
  struct Options {
    uint32_t node_rank = 0;
    uint32_t num_nodes = 1;
    std::string coordinator;  // its address, for messages
    absl::Duration timeout = absl::Seconds(300);
    std::function<bool()> cancelled;  // start-up waits stop once it returns true (unset: never)
    // What this node sends when it joins: the coordinator refuses it, naming the differences, unless
    // they are node 0's (server/rendezvous_service.h; dynamiqd: ClusterSettings()).
    NodeSettings settings;
  };

  // A single node: an in-process store, no waiting.
  static std::unique_ptr<Cluster> Local(Options options, const std::string& me);
  // Joins the cluster through the coordinator's store as `me` (this node's peer address) and waits
  // until every node has: DEADLINE_EXCEEDED naming the missing ranks (or the silent coordinator)
  // after options.timeout, CANCELLED when cancelled.
  static absl::StatusOr<std::unique_ptr<Cluster>> Join(Options options, std::unique_ptr<GrpcStore> coordinator,
                                                       const std::string& me);

  // The coordinator's store (writes of a job's rendezvous keys are noted, to delete them later).
  engine::Store& store() { return *noting_store_; }
  // Peer addresses by node rank.
  std::vector<std::string> members() const;

  // Start-up agreement: node 0 publishes its --error_sample_rate, the others adopt it (with a log
  // line when theirs differed). The settings every node must match are compared when it joins
  // (Options::settings).
  absl::StatusOr<double> AgreeOnErrorSampleRate(double mine);

  // A coordinator that answers but no longer knows this node restarted with an empty store: join it
  // again and return true (the jobs' keys are lost with it). False when it knows this node or does
  // not answer.
  absl::StatusOr<bool> RejoinIfForgotten();

  // Heartbeats to the coordinator (server/membership.h): the live set it answers with, which live()
  // returns from then on. The call ends by `deadline`. On one node: every node live, no call.
  absl::StatusOr<LiveSet> Heartbeat(absl::Time deadline);
  // The newest live set a heartbeat brought (epoch 0 before any, or from a coordinator without
  // heartbeats: every node live).
  LiveSet live() const;

  // Counts one more creation of `job_id` on this node; returns the count (the new incarnation).
  // Marks the job live on this node first (its live key): every successful claim is ended by
  // RetireJob.
  absl::StatusOr<uint64_t> ClaimIncarnation(const std::string& job_id);
  // The incarnation of `job_id` this node should rejoin instead of starting the job's next one
  // (server/membership.h): its previous dynamiqd died running it (the node's live key of the job is
  // still set and this process has not run the job), another live node still runs it (the same
  // count of incarnations), and the members went on in a view without this node; waits up to
  // `wait` for that view while the others still run it. nullopt: start afresh (ClaimIncarnation).
  struct Rejoin {
    uint64_t incarnation = 0;
    uint64_t view_epoch = 0;  // the members' newest view, which leaves this node out
  };
  absl::StatusOr<std::optional<Rejoin>> RejoinableIncarnation(const std::string& job_id, absl::Duration wait);
  // Takes `incarnation` (RejoinableIncarnation's) on this node without counting another, and asks
  // its members to admit this node (its join key).
  absl::Status RejoinIncarnation(const std::string& job_id, uint64_t incarnation);
  // The key by which node `node` asks to join a running incarnation.
  static std::string JoinKey(const std::string& job_id, uint64_t incarnation, uint32_t node);

  // This node is done with the incarnation (its last local worker left, or it could not be created
  // after all): forgets its keys and, once no incarnation of the job runs here any more, deletes the
  // job's live key of this node, and every key of the job if no node runs it (key lifecycle above).
  // Best effort: bounded by GrpcStore::kDeleteRpcDeadline, a failure is logged and leaves the keys.
  void RetireJob(const std::string& job_id, uint64_t incarnation);
  // " (node 1 is at incarnation 3 of job j, this node at 2: ...)" when the nodes' counts differ, or
  // the nodes that never created the job; "" when nothing is known to be wrong.
  std::string IncarnationHint(const std::string& job_id, uint64_t incarnation);
  // Where view `view_epoch`'s connection for collective `first_sequence` rendezvouses.
  static std::string RendezvousPrefix(const std::string& job_id, uint64_t incarnation, uint64_t view_epoch,
                                      uint64_t first_sequence);
  // The keys of the job's group views (key layout above).
  static std::string LatestViewKey(const std::string& job_id, uint64_t incarnation);
  static std::string ViewKey(const std::string& job_id, uint64_t incarnation, uint64_t epoch);

  // Publishes a compression change of the job's incarnation: claims the next epoch by
  // compare-and-set, `change` maps the newest configuration (the newest epoch's, or `initial`) to
  // the new one, which applies from collective `apply_at()` on (asked once the epoch is claimed,
  // so the boundary it reserves is never announced before the claim is visible). ABORTED unless the
  // newest epoch is `expected_epoch` (when set).
  absl::StatusOr<PublishedChange> PublishConfig(
      const std::string& job_id, uint64_t incarnation, const JobConfig& initial,
      absl::FunctionRef<absl::StatusOr<JobConfig>(const JobConfig& newest)> change,
      absl::FunctionRef<uint64_t()> apply_at, std::optional<uint64_t> expected_epoch);
  // The newest epoch past `*epoch` whose collective `sequence` has reached: true and `*epoch`,
  // `*config` set; false when there is none (or the coordinator did not answer). With
  // `latest_view`, the job's newest-view record (LatestViewKey; nullopt: none yet) comes back from
  // the same round trip, so a boundary costs one call to the coordinator; it is left alone when the
  // coordinator did not answer.
  absl::StatusOr<bool> PollConfig(const std::string& job_id, uint64_t incarnation, uint64_t sequence, uint64_t* epoch,
                                  JobConfig* config, std::optional<std::optional<std::string>>* latest_view = nullptr);

  // Why a node failed a collective without its cross-node part. Report gives up at `deadline` and
  // logs a failure to report; Lookup waits until `deadline` for another node's cause (none: nullopt).
  struct Failure {
    uint32_t node = 0;
    absl::Status status;  // what that node's workers got
  };
  absl::Status ReportFailure(const std::string& job_id, uint64_t incarnation, uint64_t sequence,
                             const absl::Status& cause, absl::Time deadline);
  std::optional<Failure> LookupFailure(const std::string& job_id, uint64_t incarnation, uint64_t sequence,
                                       absl::Time deadline);
  // A cause already published, without waiting for one (one read, bounded by its round trip).
  std::optional<Failure> PublishedFailure(const std::string& job_id, uint64_t incarnation, uint64_t sequence);

 private:
  Cluster(Options options, std::unique_ptr<engine::Store> store, GrpcStore* coordinator, std::string me,
          std::vector<std::string> members);
  // What Join still waits for, after `last` (the latest join's error).
  static std::string DescribeJoinWait(const Options& options, GrpcStore& store, const absl::Status& last);
  // A key node 0 sets at start, waited for in cancellable slices.
  absl::StatusOr<std::string> WaitForStartKey(const std::string& key);
  // Deletes `deletion` from the store, logging a failure as about `what` (best effort).
  void DeleteKeys(const engine::Store::Deletion& deletion, absl::string_view what);
  // This node's next count of the job, above the base of the job's keys.
  absl::StatusOr<uint64_t> CountIncarnation(const std::string& job_id);
  // The job's base (set from the floor by the first claim since its keys were created).
  absl::StatusOr<uint64_t> IncarnationBase(const std::string& job_id);
  // Raises the floor to at least `incarnation`.
  absl::Status RaiseIncarnationFloor(uint64_t incarnation);
  // Drops one live incarnation of the job on this node; the last one raises the floor past the
  // newest incarnation it ran, then deletes the live key (and, if no node runs the job any more, all
  // the job's keys).
  void ReleaseJob(const std::string& job_id) ABSL_LOCKS_EXCLUDED(live_mu_);
  // A key written through store(): notes the connections of a job's rendezvous this node writes
  // keys of, and deletes the ones it no longer needs.
  void NoteWrite(absl::string_view key) ABSL_LOCKS_EXCLUDED(keys_mu_);
  // After writing a key of an incarnation that this node has retired meanwhile (a compression
  // change or a failure report racing the job's end): delete the job's keys again if no node runs it.
  void CleanUpIfRetired(const std::string& job_id, uint64_t incarnation) ABSL_LOCKS_EXCLUDED(keys_mu_);

  // What this node tracks of an incarnation it runs, to delete its keys as they fall out of use.
  struct LiveIncarnation {
    // The newest connection this node wrote keys of (view epoch, first collective), and the one
    // before it (kept for a lagging node).
    std::optional<std::pair<uint64_t, uint64_t>> connection;
    std::optional<std::pair<uint64_t, uint64_t>> older_connection;
    std::deque<uint64_t> failures;  // collectives whose failure this node reported
  };

  const Options options_;
  const std::unique_ptr<engine::Store> store_;
  GrpcStore* const coordinator_;  // store_ over gRPC, for joining (a Rendezvous call); null on one node
  const std::unique_ptr<engine::Store> noting_store_;  // store_, with NoteWrite on every write: store()
  const std::string me_;
  mutable absl::Mutex mu_;
  std::vector<std::string> members_ ABSL_GUARDED_BY(mu_);
  LiveSet live_ ABSL_GUARDED_BY(mu_);
  // Held across the store calls that set and delete this node's live keys, so that a claim and a
  // retirement of the same job on this node never cross.
  absl::Mutex live_mu_ ABSL_ACQUIRED_BEFORE(keys_mu_);
  struct LiveJob {
    int incarnations = 0;  // how many of its incarnations run here
    uint64_t newest = 0;   // the newest incarnation of it this node claimed
  };
  std::map<std::string, LiveJob> live_jobs_ ABSL_GUARDED_BY(live_mu_);  // by job id
  absl::Mutex keys_mu_;
  std::map<std::string, LiveIncarnation, std::less<>> incarnations_ ABSL_GUARDED_BY(keys_mu_);  // "job/<id>/inc<k>"
  std::deque<std::string> retired_ ABSL_GUARDED_BY(keys_mu_);  // recently retired, by "job/<id>/inc<k>"
};

}  // namespace dynamiq::server

#endif  // DQ_SERVER_CLUSTER_H_

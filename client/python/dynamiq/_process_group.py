"""The torch.distributed backend "dynamiq": a ProcessGroup whose SUM/AVG all-reduces of floating-point
tensors go through the node's dynamiqd (compressed between nodes with the job's codec), and whose
other collectives run exactly on an inner Gloo group over the same store.

    import torch.distributed as dist, dynamiq.torch     # the import registers the backend
    dist.init_process_group("dynamiq")                   # env:// (RANK, WORLD_SIZE, MASTER_*) + DQ_*
    model = torch.nn.parallel.DistributedDataParallel(net)   # no hook needed
    with dynamiq.torch.exact():
        dist.all_reduce(loss)                            # never quantized

What goes where (docs/python.md has the table):
  - all_reduce / all_reduce_coalesced / reduce_scatter, op SUM or AVG, float32/bfloat16/float16, at
    least `exact_below` elements, outside exact(): dynamiqd (bfloat16 travels as it is, float16 as
    float32). The daemon sums a node's workers exactly in fp32 and compresses only between nodes.
  - everything else (exact() blocks, small tensors, MAX/MIN/PRODUCT, integer and float64 tensors,
    broadcast, all_gather, gather, scatter, reduce, all_to_all, send/recv, barrier): the inner
    ProcessGroupGloo, exact. Floating-point all-reduces on that path are summed in fp32.

Every rank must take the same path for the same collective: the choice depends only on the op,
the dtype, the element count, exact() and exact_below, which init checks to be the same everywhere.

Groups of dist.new_group: a group whose ranks run on every node of the daemons' cluster registers
as a sub-job of the job (its own collective context in dynamiqd) and works like the default group;
a group missing a node (a job's cross-node all-reduce involves every node) runs every collective
on its inner Gloo group, exact. destroy_process_group(group) unregisters it.

Work objects. torch 1.13's Python bindings cannot override Work's C++ virtuals, and the Work that
wraps a torch Future (_create_work_from_future) does not raise from wait(). So a collective called
from torch.distributed's own Python functions (dist.all_reduce and friends, whose result user code
waits on) returns a Python Work whose wait() raises the collective's error; a call from C++ (DDP's
reducer, through the ProcessGroup trampoline) gets the future-wrapping C++ Work, whose future
carries the error to DDP (backward() raises it).
"""

import atexit
import collections
import contextlib
import datetime
import functools
import json
import os
import queue
import sys
import threading
import time
import weakref
import zlib

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, PrefixStore, ProcessGroup,
                                        ProcessGroupGloo, Work, _create_work_from_future)

import dynamiq
from dynamiq import torch as _dqtorch
from dynamiq._names import CallNames

__all__ = ["BACKEND", "ProcessGroupDynamiq", "exact", "get_process_group"]

BACKEND = "dynamiq"
# All-reduces of fewer elements run exactly on the inner Gloo group (loss scalars, metrics).
# Default of ProcessGroupDynamiq(exact_below=...); environment DQ_TORCH_EXACT_BELOW.
DEFAULT_EXACT_BELOW = 1024
# Free shared-memory buffers kept for reuse; a DDP model needs one per bucket in flight.
_MAX_FREE_SLOTS = 32
# How long init waits for every rank's membership record, at most (or the group's timeout), counted
# from the start of init_process_group: with env:// rendezvous torch's TCPStore on rank 0 has
# already waited up to the timeout for the other ranks to connect before the group is created.
_JOIN_SECONDS = 300
# When the current dist.init_process_group call began (time.monotonic()), or None outside one.
_init_started = None

_DAEMON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GLOO_DTYPES = (torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_DAEMON_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
_EXACT_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)

_exact_lock = threading.Lock()
_exact_depth = 0

# Open groups, closed at interpreter exit (see _close_at_exit).
_open_groups = weakref.WeakSet()


@contextlib.contextmanager
def exact():
    """Within this block, all-reduces (and reduce_scatters) on a dynamiq process group are exact:
    they bypass dynamiqd's codec and run on the group's inner Gloo group, summed in fp32. Applies to
    every thread of the process (DDP's backward may run on another thread). Every rank must enter
    it around the same collectives. Nests."""
    global _exact_depth
    with _exact_lock:
        _exact_depth += 1
    try:
        yield
    finally:
        with _exact_lock:
            _exact_depth -= 1


def _in_exact():
    return _exact_depth > 0


def get_process_group(group=None):
    """The ProcessGroupDynamiq of `group` (default: the default group); ValueError if it is not one."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupDynamiq):
        raise ValueError(f"not a dynamiq process group: {type(pg).__name__} (init_process_group(\"{BACKEND}\"))")
    return pg


# torch.distributed's Python functions whose Work user code waits on: a collective called from
# one of these returns a _PythonWork (raising wait()). Compared by code object, not by name.
def _python_api_codes():
    c10d = dist.distributed_c10d
    names = ("all_reduce", "all_reduce_coalesced", "all_reduce_multigpu", "reduce_scatter",
             "reduce_scatter_multigpu", "_reduce_scatter_base")
    return frozenset(getattr(c10d, n).__code__ for n in names if hasattr(getattr(c10d, n, None), "__code__"))


_PYTHON_API = _python_api_codes()


class _PythonWork(Work):
    """The Work a Python caller gets: wait() raises the collective's error (the C++ Work that wraps a
    future does not). Only ever handed to Python code (see the module comment)."""

    def __init__(self, future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None):
        self._future.wait()  # raises the collective's error
        return True

    def is_completed(self):
        return self._future.done()

    def is_success(self):
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 -- any error means not successful
            return False
        return True

    def exception(self):
        try:
            self._future.value()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    def result(self):
        return self._future.wait()

    def get_future(self):
        return self._future

    def synchronize(self):
        pass


def _caller():
    """The code object of whoever called the ProcessGroup method that calls this, or None when
    C++ called it directly (DDP's reducer runs allreduce from an autograd thread: no Python frame)."""
    try:
        return sys._getframe(2).f_code
    except ValueError:
        return None


def _work_for(future, caller):
    """`future` (completing with the output tensors, or failing) as the Work `caller` expects."""
    if caller in _PYTHON_API:
        return _PythonWork(future)
    # For C++ the future must fail with a real error: Python's set_exception stores the exception as
    # a value that only Python unwraps. A callback that raises makes then()'s future fail.
    return _create_work_from_future(future.then(lambda f: f.value()))


def _chain(future, fn):
    """A future of fn(future.value()), failing with the same exception when `future` or fn fails
    (then() would wrap it in a callback error message)."""
    out = torch.futures.Future()

    def done(f):
        try:
            out.set_result(fn(f.value()))
        except Exception as e:  # noqa: BLE001 -- handed to whoever waits
            out.set_exception(e)

    future.add_done_callback(done)
    return out


class _SlotPool:
    """Shared-memory buffers of a Client, reused across collectives. Thread-safe."""

    def __init__(self, client):
        self._client = client
        self._free = []
        self._lock = threading.Lock()

    def acquire(self, nbytes, device=None):
        with self._lock:
            fitting = [s for s in self._free if s.fits(nbytes, device)]
            if fitting:
                slot = min(fitting, key=lambda s: s.buffer.size)
                self._free.remove(slot)
                return slot
        return _dqtorch._Slot(self._client, nbytes, device)

    def release(self, slot):
        with self._lock:
            if len(self._free) < _MAX_FREE_SLOTS:
                self._free.append(slot)
                return
        slot.release()

    def clear(self):
        with self._lock:
            slots, self._free = self._free, []
        for s in slots:
            _release_quietly(s)


def _op_name(op):
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(dist.ReduceOp, name, None):
            return name
    return str(op)


def _env_count(name, fallback, minimum):
    """The whole number in environment variable `name` (else `fallback`, torchrun's), or None when
    neither is set; ValueError naming the variable for anything else."""
    for var in (name, fallback):
        text = os.environ.get(var)
        if text is None:
            continue
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise ValueError(f"dynamiq backend: {var} must be a whole number, {minimum} or more, got {text!r}"
                             + (f" ({name} overrides it)" if var == fallback else ""))
        return value
    return None


def _exact_below(value):
    """exact_below= if given, else DQ_TORCH_EXACT_BELOW, else DEFAULT_EXACT_BELOW; ValueError naming
    where a bad value came from."""
    where = "exact_below"
    if value is None:
        value = os.environ.get("DQ_TORCH_EXACT_BELOW")
        if value is None:
            return DEFAULT_EXACT_BELOW
        where = "DQ_TORCH_EXACT_BELOW"
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = None
    if count is None or count < 0 or (isinstance(value, float) and value != count):
        raise ValueError(f"dynamiq backend: {where} must be a whole number of elements, 0 or more (all-reduces of "
                         f"fewer elements stay exact; default {DEFAULT_EXACT_BELOW}), got {value!r}")
    return count


def _check_device(tensor, what):
    if tensor.layout != torch.strided:
        raise ValueError(f"dynamiq backend: {what} takes dense tensors, not {tensor.layout}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"dynamiq backend: {what} takes CPU or CUDA tensors, got one on {tensor.device}")


class ProcessGroupDynamiq(ProcessGroup):
    """A torch.distributed ProcessGroup over the node's dynamiqd. Created by
    dist.init_process_group("dynamiq", ...) and dist.new_group (the registered creator passes the
    store, the rank and size in the group, the timeout and, for new_group, the group's global ranks
    and name); connects a dynamiq.Client from the DQ_* environment (DQ_LOCAL_RANK and
    DQ_LOCAL_WORLD_SIZE default to torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE), checks through the
    store that the job's workers are exactly the group's ranks, and connects an inner
    ProcessGroupGloo on the same store for the exact collectives.

    Args:
      exact_below: all-reduces of fewer elements run exactly on the inner Gloo group (default
        DQ_TORCH_EXACT_BELOW, else DEFAULT_EXACT_BELOW = 1024; a group of new_group: the default
        group's). Must be the same on every rank.
      client: a dynamiq.Client to use (default: one from the DQ_* environment, with the group's
        timeout as its deadline unless DQ_TIMEOUT_SECONDS is set). Default group only.
      max_records: how many per-collective records to keep in `records`.
      global_ranks: a group of new_group: its ranks in the default group, ascending. It then
        registers as a sub-job of the default group's job (_subjob_id), or, where its ranks do not
        run on every node, uses no daemon (`uses_daemon` False, `client` and `job` None).
      group_name: torch's name of the group (the same on every rank), part of the sub-job's id.

    After collectives, `records` holds one dict per daemon all-reduce (the latest max_records):
    name, elements, dtype, sequence, config_epoch, codec, bits, wire_bytes (bytes this node sent),
    seconds, and measured_vnmse when dynamiqd's error probe sampled it; `exact_collectives` counts
    those that took the Gloo path.
    """

    def __init__(self, store, rank, world_size, timeout, *, exact_below=None, client=None, max_records=100_000,
                 global_ranks=None, group_name=None):
        super().__init__(rank, world_size)
        self._started = time.monotonic() if _init_started is None else _init_started
        self._timeout = timeout
        self._store = store
        self.records = collections.deque(maxlen=max_records)
        self.exact_collectives = 0
        # Daemon collectives are named by the learned period of their sequence (dynamiq/_names.py).
        self._names = CallNames("torch")
        self._submit_lock = threading.Lock()
        self._queue = queue.Queue()
        self._thread = None
        self._closed = False
        self._owns_client = client is None
        self.client = None
        self._pool = None
        # Every rank's membership record (index: rank in this group), once checked.
        self._members = None
        # Whether AVG goes to the daemon with weight 1 per worker: its unweighted mean divides by
        # nodes x this node's workers where the side lane has no per-node slots (GPU nodes, more
        # than 15 nodes), wrong where nodes run different numbers of the group's ranks.
        self._weighted_avg = False
        self.global_ranks = list(global_ranks) if global_ranks else list(range(world_size))
        self.uses_daemon = True
        try:
            if global_ranks:
                self.client = self._join_subgroup(group_name, timeout, exact_below, client)
            else:
                self.exact_below = _exact_below(exact_below)
                self.client = client if client is not None else self._connect(timeout)
        except Exception as e:
            self._publish_member({"error": str(e)})
            raise
        self.job = None if self.client is None else self.client.job
        try:
            if self.client is not None:
                self._pool = _SlotPool(self.client)
                self._check_membership()
            # The exact collectives: a Gloo group over the same store, under its own prefix.
            self._gloo = ProcessGroupGloo(PrefixStore("dynamiq.gloo", store), rank, world_size, timeout)
        except BaseException:
            self.close()
            raise
        _open_groups.add(self)

    # -- set-up ----------------------------------------------------------------------------------

    def _connect(self, timeout):
        env = os.environ
        local_rank = _env_count("DQ_LOCAL_RANK", "LOCAL_RANK", minimum=0)
        local_world = _env_count("DQ_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", minimum=1)
        me = f"dynamiq backend: rank {self.rank()}"
        if local_world is None and local_rank is not None and local_rank >= 1:
            # The client would default the local world size to 1 and refuse the rank without saying so.
            raise ValueError(f"{me}: local rank {local_rank} (DQ_LOCAL_RANK or LOCAL_RANK) needs the number of this "
                             f"job's processes on this node, but neither DQ_LOCAL_WORLD_SIZE nor LOCAL_WORLD_SIZE is "
                             f"set (it defaulted to 1): set DQ_LOCAL_WORLD_SIZE (torchrun sets LOCAL_WORLD_SIZE)")
        seconds = None
        if "DQ_TIMEOUT_SECONDS" not in env and timeout is not None:
            seconds = max(1.0, timeout.total_seconds())
        try:
            return dynamiq.Client(local_rank=local_rank, local_world_size=local_world, timeout=seconds)
        except dynamiq.Error as e:
            where = env.get("DQ_SOCKET", "the default socket")
            code = getattr(e, "code", "")
            if code == "ALREADY_EXISTS":
                # The daemon answered: another process of this node registered the same local rank.
                if local_rank is None:
                    why = ("neither DQ_LOCAL_RANK nor LOCAL_RANK is set, so this rank took local rank 0 like another "
                           "process of this node: set DQ_LOCAL_RANK to each process's rank on its node (0, 1, ...; "
                           "torchrun sets LOCAL_RANK) and DQ_LOCAL_WORLD_SIZE to their number")
                else:
                    why = (f"another process of this node already has local rank {local_rank} (DQ_LOCAL_RANK or "
                           f"LOCAL_RANK): give each process of the node its own")
                raise RuntimeError(f"{me}: dynamiqd at {where} refused its registration ({why}): {e}") from e
            if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):  # nobody answered at the socket
                raise RuntimeError(f"{me} cannot register with dynamiqd at {where} "
                                   f"(DQ_SOCKET; is dynamiqd running on this node?): {e}") from e
            # The daemon (or the client's own checks) answered: its message says what was wrong.
            raise RuntimeError(f"{me} cannot register with dynamiqd at {where}: {e}") from e

    def _join_subgroup(self, group_name, timeout, exact_below, client):
        """Registers a group of dist.new_group in dynamiqd: a sub-job of the default group's job, its
        own collective context (sequence, names, compression state), with this process's index among
        the group's ranks on its node as local rank. Returns its Client, or None where the group's
        ranks do not run on every node of the daemons' cluster: a job's cross-node all-reduce
        involves every node, so such a group runs every collective on its inner Gloo group."""
        if client is not None:
            raise ValueError("dynamiq backend: client= is for the default group; a group of new_group registers "
                             "its own")
        parent = dist.distributed_c10d._get_default_group()
        if not isinstance(parent, ProcessGroupDynamiq) or parent._members is None or parent.client is None:
            raise ValueError(f"dynamiq backend: new_group(backend=\"{BACKEND}\") needs the default group on the "
                             f"dynamiq backend too (init_process_group(\"{BACKEND}\")), whose ranks say which node "
                             f"each rank runs on; the default group is {type(parent).__name__}: use "
                             f"new_group(..., backend=\"gloo\")")
        # The default group checked it is the same on every rank.
        self.exact_below = parent.exact_below if exact_below is None else _exact_below(exact_below)
        by_node = collections.defaultdict(list)  # node -> the group's global ranks on it, ascending
        for g in self.global_ranks:
            by_node[parent._members[g]["node"]].append(g)
        if len(by_node) < parent.client.num_nodes:
            self.uses_daemon = False
            return None
        me = parent.rank()
        mine = by_node[parent._members[me]["node"]]
        job = _subjob_id(parent.client.job, group_name, self.global_ranks)
        seconds = None
        if "DQ_TIMEOUT_SECONDS" not in os.environ and timeout is not None:
            seconds = max(1.0, timeout.total_seconds())
        try:
            return dynamiq.Client(socket=parent.client.socket, job=job, local_rank=mine.index(me),
                                  local_world_size=len(mine), timeout=seconds)
        except dynamiq.Error as e:
            # --max_jobs reached, or a multi-node NCCL cluster (one job at a time): the daemon cannot
            # give the group a job of its own, Gloo can run it.
            hint = ""
            if getattr(e, "code", "") in ("FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"):
                hint = " (a group can run on Gloo instead: new_group(..., backend=\"gloo\"))"
            raise RuntimeError(f"dynamiq backend: rank {me} cannot register group {group_name} (ranks "
                               f"{_ranks_text(self.global_ranks)}) with dynamiqd at {parent.client.socket} as job "
                               f"'{job}': {e}{hint}") from e

    def _publish_member(self, record):
        try:
            self._store.set(f"dynamiq/member/{self.rank()}", json.dumps(record))
        except Exception:  # noqa: BLE001 -- best effort: the others then time out naming this rank
            pass

    def _check_membership(self):
        """Every rank publishes (node, local rank, local world size, job, exact_below) and checks
        that the group's ranks are exactly the job's workers on every node."""
        c = self.client
        mine = {"node": c.node_rank, "nodes": c.num_nodes, "local_rank": c.local_rank,
                "local_world": c.local_world_size, "job": c.job, "exact_below": self.exact_below,
                "pid": os.getpid()}
        self._publish_member(mine)
        keys = [f"dynamiq/member/{r}" for r in range(self.size())]
        bound = _JOIN_SECONDS if self._timeout is None else min(_JOIN_SECONDS, self._timeout.total_seconds())
        # What is left of the bound since init_process_group began (at least a moment, to read
        # what is there).
        left = max(1.0, bound - (time.monotonic() - self._started))
        try:
            self._store.wait(keys, datetime.timedelta(seconds=left))
        except RuntimeError as e:
            waited = time.monotonic() - self._started
            raise RuntimeError(f"dynamiq backend: not every rank of the world of {self.size()} joined within "
                               f"{waited:.0f} s of init_process_group (timeout {bound:.0f} s; a wrong WORLD_SIZE, "
                               f"or a rank failed to start): {e}") from e
        members = [json.loads(self._store.get(k)) for k in keys]
        for r, m in enumerate(members):
            if "error" in m:
                raise RuntimeError(f"dynamiq backend: rank {r} failed to join: {m['error']}")
        # Settings every rank must share: not a world-size problem, say which variable differs.
        differ = []
        for r, m in enumerate(members):
            if m["exact_below"] != mine["exact_below"]:
                differ.append(f"rank {r} has exact_below {m['exact_below']}, rank {self.rank()} "
                              f"{mine['exact_below']} (set DQ_TORCH_EXACT_BELOW, or exact_below=, the same on every "
                              f"rank)")
        if differ:
            raise ValueError("dynamiq backend: the ranks disagree on a setting that must be the same on every rank: "
                             + "; ".join(differ))
        problems = []
        for r, m in enumerate(members):
            if m["job"] != mine["job"]:
                problems.append(f"rank {r} is in job '{m['job']}', rank {self.rank()} in '{mine['job']}' (DQ_JOB)")
        seen = {}
        for r, m in enumerate(members):
            where = (m["node"], m["local_rank"])
            if where in seen:
                problems.append(f"ranks {seen[where]} and {r} are both local rank {m['local_rank']} of node "
                                f"{m['node']} (DQ_LOCAL_RANK)")
            seen[where] = r
        per_node = collections.defaultdict(list)
        for m in members:
            per_node[m["node"]].append(m)
        expected = 0
        for node in range(mine["nodes"]):
            ms = per_node.get(node, [])
            if not ms:
                problems.append(f"no rank runs on node {node} of the job's {mine['nodes']} nodes")
                continue
            local_world = ms[0]["local_world"]
            expected += local_world
            if any(m["local_world"] != local_world for m in ms):
                problems.append(f"ranks on node {node} disagree on DQ_LOCAL_WORLD_SIZE")
            elif len(ms) != local_world:
                problems.append(f"node {node} has {len(ms)} ranks of the group, but DQ_LOCAL_WORLD_SIZE={local_world}")
        if problems or expected != self.size():
            summary = (f"dynamiq backend: world size {self.size()} (rank {self.rank()}) does not match job "
                       f"'{mine['job']}' on {mine['nodes']} node(s) with {expected} worker(s)")
            raise ValueError("; ".join([summary] + problems))
        self._members = members
        self._weighted_avg = len({len(ms) for ms in per_node.values()}) > 1

    # -- the daemon path ---------------------------------------------------------------------------

    def _ensure_thread(self):
        if self._thread is None:
            self._thread = threading.Thread(target=_complete_loop, args=(self._queue, self._pool, self.records),
                                            name="dynamiq-pg", daemon=True)
            self._thread.start()

    def _daemon_all_reduce(self, tensors, average, kind):
        """All-reduces the concatenation of `tensors` (same dtype) through dynamiqd; a future that
        completes with `tensors` holding the result."""
        if self._closed:
            raise RuntimeError("dynamiq backend: the process group is closed")
        dtype = tensors[0].dtype
        send_dtype = _dqtorch.wire_dtype(dtype)
        n = sum(t.numel() for t in tensors)
        itemsize = torch.tensor([], dtype=send_dtype).element_size()
        future = torch.futures.Future()
        with self._submit_lock:
            slot = self._pool.acquire(max(1, n) * itemsize, tensors[0].device)
            view = slot.view(send_dtype, n)
            offset = 0
            for t in tensors:
                view[offset:offset + t.numel()].copy_(t.reshape(-1))
                offset += t.numel()
            slot.before_submit(tensors)
            name = self._names.name(kind, str(dtype).replace("torch.", ""), n)
            started = time.perf_counter()
            try:
                pending = self.client.all_reduce_async(slot.buffer, name, count=n, dtype=_dqtorch._dq_dtype(send_dtype),
                                                       average=average, weight=1.0 if self._weighted_avg else None)
            except dynamiq.Error as e:
                _release_quietly(slot)
                raise RuntimeError(f"dynamiq backend: all-reduce '{name}' ({n} x {dtype}) failed: {e}") from e
            except BaseException:
                self._pool.release(slot)
                raise
            self._ensure_thread()
            self._queue.put((pending, slot, view, tensors, future, name, n, dtype, started))
        return future

    # -- the exact path ------------------------------------------------------------------------------

    def _gloo_all_reduce(self, tensors, op):
        """Exact all-reduce of each tensor on the inner Gloo group: floating point summed in fp32."""
        self.exact_collectives += 1
        staged = [t if t.dtype in (torch.float32, torch.float64) or not t.is_floating_point()
                  else t.to(torch.float32) for t in tensors]
        staged = [s if s.is_contiguous() else s.contiguous() for s in staged]
        gloo_op = dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op
        futures = []
        for s in staged:
            opts = AllreduceOptions()
            opts.reduceOp = gloo_op
            futures.append(self._gloo.allreduce([s], opts).get_future())
        world = self.size()

        def finish(done):
            for x in done:
                x.value()  # raises a failed all-reduce's error
            for t, s in zip(tensors, staged):
                if op == dist.ReduceOp.AVG:
                    s.div_(world)
                if s is not t:
                    t.copy_(s)
            return tensors

        return _chain(torch.futures.collect_all(futures), finish)

    def _route(self, tensors, op, what):
        """'daemon' or 'exact' for an all-reduce of `tensors` with `op`; raises for what is not supported."""
        if not tensors:
            raise ValueError(f"dynamiq backend: {what} of no tensors")
        for t in tensors:
            _check_device(t, what)
        if any(t.device != tensors[0].device for t in tensors):
            raise ValueError(f"dynamiq backend: {what} of tensors on different devices "
                             f"{sorted({str(t.device) for t in tensors})}")
        dtype = tensors[0].dtype
        if any(t.dtype != dtype for t in tensors):
            raise TypeError(f"dynamiq backend: {what} of mixed dtypes {sorted({str(t.dtype) for t in tensors})}")
        if not any(op == o for o in _EXACT_OPS):
            raise ValueError(f"dynamiq backend: {what} does not support op {_op_name(op)} "
                             f"(SUM, AVG, MAX, MIN, PRODUCT)")
        if dtype in _DAEMON_DTYPES:
            daemon_op = any(op == o for o in _DAEMON_OPS)
            big = sum(t.numel() for t in tensors) >= self.exact_below
            if daemon_op and big and not _in_exact() and self.uses_daemon:
                return "daemon"
            return "exact"
        if dtype in _GLOO_DTYPES:
            if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                raise TypeError(f"dynamiq backend: {what} with AVG of {dtype} tensors (use SUM and divide)")
            return "exact"
        raise TypeError(f"dynamiq backend: {what} of {dtype} tensors is not supported (float32, bfloat16 and "
                        f"float16 go through dynamiqd; float64 and integer types exactly through Gloo)")

    def _all_reduce(self, tensors, op, kind):
        if self._route(tensors, op, kind) == "daemon":
            if self._closed:
                raise RuntimeError("dynamiq backend: the process group is closed")
            if all(t.numel() == 0 for t in tensors):
                # Nothing to reduce (torch's own backends complete it at once too). Every rank has
                # the same element count, so every rank skips it, and it takes no name.
                future = torch.futures.Future()
                future.set_result(tensors)
                return future
            return self._daemon_all_reduce(tensors, op == dist.ReduceOp.AVG, kind)
        return self._gloo_all_reduce(tensors, op)

    # -- ProcessGroup ---------------------------------------------------------------------------------

    def getBackendName(self):  # noqa: N802 -- the C++ virtual's name
        return BACKEND

    def allreduce(self, tensors, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        if len(tensors) != 1:
            raise ValueError(f"dynamiq backend: allreduce takes one tensor per process, got {len(tensors)}")
        if tensors[0].is_sparse:
            # Sparse COO: Gloo's sparse all-reduce, exact, as on torch's gloo backend.
            self.exact_collectives += 1
            return self._gloo.allreduce(list(tensors), AllreduceOptions() if opts is None else opts)
        return _work_for(self._all_reduce(list(tensors), op, "allreduce"), _caller())

    def allreduce_coalesced(self, tensors, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return _work_for(self._all_reduce(list(tensors), op, "allreduce_coalesced"), _caller())

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """Each rank's output is its slice of the all-reduced inputs: one all-reduce of the
        concatenated inputs (through the same path as all_reduce), so it moves a whole all-reduce's
        bytes, not a reduce-scatter's."""
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        if len(output_tensors) != 1 or len(input_tensors) != 1 or len(input_tensors[0]) != self.size():
            raise ValueError(f"dynamiq backend: reduce_scatter takes one output and {self.size()} inputs per process")
        output, inputs = output_tensors[0], [t.detach().clone() for t in input_tensors[0]]
        if any(t.shape != output.shape or t.dtype != output.dtype for t in inputs):
            raise ValueError("dynamiq backend: reduce_scatter inputs must all have the output's shape and dtype")
        future = self._all_reduce(inputs, op, "reduce_scatter")
        mine = self.rank()

        def finish(reduced):
            output.copy_(reduced[mine])
            return [output]

        return _work_for(_chain(future, finish), _caller())

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002 -- torch's name
        chunks = list(input.reshape(-1).chunk(self.size()))
        return self.reduce_scatter([output.reshape(-1)], [[c.reshape(-1) for c in chunks]], opts)

    def barrier(self, opts=None):
        """Waits for this rank's daemon all-reduces in flight, then a Gloo barrier."""
        self._drain()
        return self._gloo.barrier() if opts is None else self._gloo.barrier(opts)

    def broadcast(self, tensors, opts):
        return self._gloo.broadcast(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._gloo.allgather(output_tensors, input_tensors, AllgatherOptions() if opts is None else opts)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002
        outs = list(output.reshape(-1).chunk(self.size()))
        return self._gloo.allgather([outs], [input.reshape(-1)], AllgatherOptions() if opts is None else opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._gloo.allgather_coalesced(output_lists, input_list,
                                              AllgatherOptions() if opts is None else opts)

    def gather(self, output_tensors, input_tensors, opts):
        return self._gloo.gather(output_tensors, input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts):
        return self._gloo.scatter(output_tensors, input_tensors, opts)

    def reduce(self, tensors, opts):
        return self._gloo.reduce(tensors, opts)

    def alltoall(self, output_tensors, input_tensors, opts):
        return self._gloo.alltoall(output_tensors, input_tensors, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):  # noqa: A002
        return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def send(self, tensors, dst, tag):
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._gloo.recv_anysource(tensors, tag)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """Waits for this rank's daemon all-reduces in flight, then Gloo's monitored barrier, which
        names the ranks that did not arrive within `timeout` (default: the group's)."""
        self._drain()
        timeout = self._timeout if timeout is None else timeout
        if timeout is None:
            return self._gloo.monitored_barrier(wait_all_ranks=wait_all_ranks)
        return self._gloo.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    # -- lifetime -----------------------------------------------------------------------------------

    def _drain(self):
        """Waits until the daemon all-reduces submitted so far have completed (or failed)."""
        if self._thread is None:
            return
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    def close(self):
        """Waits for the daemon all-reduces in flight, stops the completion thread, frees the
        buffers and closes the client (if the group created it). Idempotent; the group is unusable
        afterwards. dist.destroy_process_group() calls it for the groups it destroys, and so does
        the interpreter's exit for groups still open: the completion thread must not be inside
        torch when Python shuts down (a thread that wakes up then to take the GIL is ended with a
        forced unwind, which a noexcept frame of torch's turns into "terminate called without an
        active exception", SIGABRT)."""
        if self._closed:
            return
        self._closed = True
        _open_groups.discard(self)
        if self._thread is not None:
            self._queue.put(None)
            if self._thread is not threading.current_thread():  # closed from a future's callback
                self._thread.join()
            self._thread = None
        if self._pool is not None:
            self._pool.clear()
        if self._owns_client and getattr(self, "client", None) is not None:
            try:
                self.client.close()
            except dynamiq.Error:
                pass  # the daemon is gone: nothing left to unregister from


def _subjob_id(job, group_name, ranks):
    """The dynamiqd job a group of new_group registers under: the same on every rank (torch names
    groups by a counter that every rank advances alike), different for two groups of the same ranks."""
    return f"{job}/g{group_name}.{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"


def _ranks_text(ranks):
    return str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)})"


def _release_quietly(slot):
    """Frees a slot's buffer; a daemon that is gone already freed it (its error is the caller's)."""
    try:
        slot.release()
    except dynamiq.Error:
        pass


def _complete_loop(pending_queue, pool, records):
    """Waits for the daemon's all-reduces in submission order (a job completes its collectives in
    order), copies each result back and completes its future. A threading.Event in the queue is set
    when everything before it is done; None stops the loop."""
    while True:
        item = pending_queue.get()
        if item is None:
            return
        if isinstance(item, threading.Event):
            item.set()
            continue
        pending, slot, view, tensors, future, name, n, dtype, started = item
        del item
        try:
            result = pending.wait()
            offset = 0
            for t in tensors:
                t.copy_(view[offset:offset + t.numel()].reshape(t.shape))
                offset += t.numel()
            slot.after_copy_back(tensors)
            records.append({"name": name, "elements": n, "dtype": str(dtype).replace("torch.", ""),
                            "sequence": result.sequence, "config_epoch": result.config_epoch, "codec": result.codec,
                            "bits": result.bits, "wire_bytes": result.wire_bytes,
                            "seconds": time.perf_counter() - started})
            if result.measured_vnmse is not None:  # dynamiqd's error probe sampled it
                records[-1]["measured_vnmse"] = result.measured_vnmse
            error = None
        except BaseException as e:  # noqa: B902 -- the caller must see every failure
            error = RuntimeError(f"dynamiq backend: all-reduce '{name}' ({n} x {dtype}) failed: {e}")
        # The views go before the slot is reused or freed (a buffer is freed once nothing maps it).
        del view, pending
        if error is None:
            pool.release(slot)
            future.set_result(tensors)
        else:
            _release_quietly(slot)
            future.set_exception(error)
        del slot, tensors, future


def _close_at_exit():
    """Closes the groups still open when the interpreter exits (atexit runs before Python starts
    to shut down threads): waits for their daemon all-reduces in flight and stops their
    completion threads."""
    for pg in list(_open_groups):
        try:
            pg.close()
        except Exception as e:  # noqa: BLE001 -- at exit: report, and close the others
            print(f"dynamiq backend: closing a process group at exit: {e}", file=sys.stderr)


def _timed_init(init):
    """torch.distributed.init_process_group that notes when it began, so that the group's wait for
    the other ranks ends within the timeout of the whole call (_check_membership)."""
    if getattr(init, "_dynamiq_timed", False):
        return init

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        global _init_started
        outer, _init_started = _init_started, time.monotonic()
        try:
            return init(*args, **kwargs)
        finally:
            _init_started = outer

    init_process_group._dynamiq_timed = True
    return init_process_group


def _closing_destroy(destroy):
    """torch.distributed.destroy_process_group that also closes the ProcessGroupDynamiq groups it
    destroys (torch 1.13 has no hook for it)."""
    if getattr(destroy, "_dynamiq_closes", False):
        return destroy

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        c10d = dist.distributed_c10d
        if group is None or group == c10d.GroupMember.WORLD:
            doomed = list(c10d._pg_map.keys())
        else:
            doomed = [group]
        destroy(group)
        for pg in doomed:
            if isinstance(pg, ProcessGroupDynamiq):
                pg.close()

    destroy_process_group._dynamiq_closes = True
    return destroy_process_group


def _dynamiq_monitored_barrier(barrier):
    """torch.distributed.monitored_barrier that runs on a ProcessGroupDynamiq too (torch 1.13 refuses
    every backend but "gloo" by name; the group's inner Gloo group runs it)."""
    if getattr(barrier, "_dynamiq_monitored", False):
        return barrier

    @functools.wraps(barrier)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        c10d = dist.distributed_c10d
        pg = c10d.GroupMember.WORLD if group is None else group
        if isinstance(pg, ProcessGroupDynamiq):
            return pg.monitored_barrier(c10d.default_pg_timeout if timeout is None else timeout, wait_all_ranks)
        return barrier(group, timeout, wait_all_ranks)

    monitored_barrier._dynamiq_monitored = True
    return monitored_barrier


def _create(options, pg_options=None):
    """torch's extended creator API: besides the store, rank, size and timeout, a group of new_group
    gets its global ranks (empty for the default group) and its name."""
    if pg_options is not None:
        raise ValueError(f"dynamiq backend: takes no pg_options, got {type(pg_options).__name__}")
    return ProcessGroupDynamiq(options.store, options.group_rank, options.group_size, options.timeout,
                               global_ranks=list(options.global_ranks_in_group), group_name=options.group_id)


def _register():
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True)
    # torch.distributed re-exports distributed_c10d's functions: wrap both names.
    c10d = dist.distributed_c10d
    c10d.destroy_process_group = _closing_destroy(c10d.destroy_process_group)
    dist.destroy_process_group = _closing_destroy(dist.destroy_process_group)
    c10d.monitored_barrier = _dynamiq_monitored_barrier(c10d.monitored_barrier)
    dist.monitored_barrier = _dynamiq_monitored_barrier(dist.monitored_barrier)
    c10d.init_process_group = _timed_init(c10d.init_process_group)
    dist.init_process_group = _timed_init(dist.init_process_group)
    atexit.register(_close_at_exit)


_register()

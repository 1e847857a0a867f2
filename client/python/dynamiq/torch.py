"""PyTorch integration: a DDP communication hook and a plain all_reduce through dynamiqd.

    import torch.distributed as dist, dynamiq.torch
    dist.init_process_group("gloo", ...)                 # DDP still broadcasts parameters over it
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = dynamiq.torch.DynamiqState()                  # connects with the DQ_* environment
    model.register_comm_hook(state, dynamiq.torch.allreduce_hook)

Each gradient bucket is copied into a shared-memory buffer of the node's dynamiqd (one per bucket
index, reused every step), submitted asynchronously, and the hook returns at once so backward keeps
computing later buckets; a background thread waits for the daemon, copies the averaged result back
into the bucket and completes the torch.futures.Future DDP waits on.

The daemon compresses only between nodes (workers of one node are summed exactly in fp32 shared
memory), with the job's configuration: dynamiqd's --codec/--bits/--min_compress_elements for new
jobs, or what DynamiqState(codec=..., control=...) sets through the operator API before training.
Weights (contribution accounting): state.set_weight(w) before a step's backward makes every bucket of
that step a weighted all-reduce, sum(w_i g_i) / sum(w_i); DropCompute (dynamiq/_drop_compute.py)
builds straggler-tolerant gradient accumulation on it. See docs/python.md.
"""

import atexit
import collections
import itertools
import math
import queue
import sys
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import dynamiq
from dynamiq._names import CallNames

__all__ = ["BACKEND", "DropCompute", "DynamiqState", "ProcessGroupDynamiq", "StepResult", "allreduce_hook",
           "all_reduce", "exact", "get_process_group", "select_threshold", "simulate_steps", "wire_dtype"]

# Buffers grow in steps of this many bytes, so that slightly larger rebuilt buckets reuse them.
_ALLOCATION_QUANTUM = 1 << 20
# Super-group size of the DynamiQ codec (kernels::kSuperGroupSize): the unit of its bit allocation.
_SUPER_GROUP = 256
# Tensors of at least this many elements start on a super-group boundary in the shared buffer
# (zero padding after each, at most 255 elements, <= 6%); smaller ones are packed after them.
_MIN_ALIGNED_ELEMENTS = 4096
# How many tiny all-reduces DynamiqState waits for a compression change to take effect. The daemon
# applies a change two collectives after the job's next one on the node that took it.
_MAX_CONFIG_SYNC_COLLECTIVES = 8


def wire_dtype(dtype):
    """The dtype a tensor of `dtype` travels to the daemon in: float32 and bfloat16 as they are,
    float16 as float32 (exact; the daemon takes float32 or bfloat16 and accumulates in fp32).
    TypeError for anything else."""
    if dtype == torch.float32 or dtype == torch.float16:
        return torch.float32
    if dtype == torch.bfloat16:
        return torch.bfloat16
    raise TypeError(f"dynamiq all-reduces float32, bfloat16 or float16 tensors, not {dtype}")


def aligned_layout(sizes, quantum=_SUPER_GROUP, min_aligned=_MIN_ALIGNED_ELEMENTS):
    """Where each of a bucket's tensors (element counts `sizes`, in bucket order) goes in the
    buffer sent to the daemon: returns (offsets, total). Tensors of >= min_aligned elements or of
    a multiple of `quantum` come first, in bucket order, each starting at a multiple of `quantum`
    (zero padding after it); the others follow, packed. DynamiQ allocates bits and scales per
    256-element super-group: a super-group that straddles two tensors mixes their scales, and the
    all-zero rows of dead units stop being all-zero super-groups (which cost no code bits).
    Identical on every rank for identical sizes."""
    offsets, total = [0] * len(sizes), 0
    aligned = [n >= min_aligned or n % quantum == 0 for n in sizes]
    for i, n in enumerate(sizes):
        if aligned[i]:
            offsets[i] = total
            total += -(-n // quantum) * quantum
    for i, n in enumerate(sizes):
        if not aligned[i]:
            offsets[i] = total
            total += n
    return offsets, total


def _check_weight(weight):
    """A worker's weight as a float: finite and >= 0 (a sample count), else ValueError. The daemon
    checks too; this names the mistake before anything is submitted."""
    w = float(weight)
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"dynamiq: a weight must be finite and >= 0 (a sample count), got {weight!r}")
    return w


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _dq_dtype(torch_dtype):
    return dynamiq.bfloat16 if torch_dtype == torch.bfloat16 else dynamiq.float32


def _on_gpu_daemon(client, device):
    """True if tensors on `device` go into device buffers of client's daemon (a CUDA tensor and a
    --device=cuda daemon); else they are staged through host shared memory."""
    return device is not None and device.type == "cuda" and client.daemon_device == "cuda"


def _sync_streams(devices):
    """Waits for the work queued on the current stream of every CUDA device in `devices`."""
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.current_stream(d).synchronize()


class _Slot:
    """A buffer of the daemon and a torch view of it per dtype (no copies): host shared memory, or,
    for CUDA tensors on a --device=cuda daemon (device given), the daemon GPU's memory opened through
    CUDA IPC, so a CUDA bucket moves device to device and never through host memory.

    Ordering with torch's streams: before_submit() after filling the view (the daemon reads the buffer
    as soon as the request arrives), after_copy_back() after copying results out of it (the future's
    consumer may run on another stream)."""

    def __init__(self, client, nbytes, device=None):
        size = -(-nbytes // _ALLOCATION_QUANTUM) * _ALLOCATION_QUANTUM
        self._gpu_daemon = client.daemon_device == "cuda"
        self.on_device = _on_gpu_daemon(client, device)
        self.buffer = client.allocate(size, memory="cuda" if self.on_device else "host")
        self._views = {}

    def view(self, dtype, count):
        full = self._views.get(dtype)
        if full is None:
            bf16 = dtype == torch.bfloat16
            if self.on_device:
                array = self.buffer.cuda_array("int16" if bf16 else "float32")
                full = torch.as_tensor(array, device=torch.device("cuda", self.buffer.device))
            else:
                # torch 1.13 takes no uint16 arrays: int16 bits, reinterpreted.
                full = torch.from_numpy(self.buffer.numpy(np.int16 if bf16 else np.float32))
            if bf16:
                full = full.view(torch.bfloat16)
            self._views[dtype] = full
        return full[:count]

    def fits(self, nbytes, device=None):
        """True if the slot can carry `nbytes` of tensors on `device` (the same kind of memory)."""
        wants_device = device is not None and device.type == "cuda" and self._gpu_daemon
        return self.buffer.size >= nbytes and self.on_device == wants_device

    def before_submit(self, tensors):
        """The view holds the tensors' values: wait for the copies (device to device, or from another
        GPU) before the daemon reads. (A copy from a CUDA tensor into host memory has already
        completed when copy_ returns.)"""
        if self.on_device:
            _sync_streams([t.device for t in tensors] + [torch.device("cuda", self.buffer.device)])

    def after_copy_back(self, tensors):
        """Results were copied out of the view into `tensors`: make them visible to every stream."""
        _sync_streams([t.device for t in tensors])

    def release(self):
        """Frees the buffer now, or, if something still maps it (a traceback holding a view after
        a failed all-reduce), when the last view goes away."""
        self._views.clear()
        try:
            self.buffer.release()
        except BufferError:
            pass  # unmapped and freed in the daemon by the Buffer's destructor instead
        self.buffer = None


class DynamiqState:
    """State of the DDP communication hook (allreduce_hook): the dynamiq Client, one shared-memory
    buffer per bucket index, the completion thread, and what the daemon reported per collective.

    Args:
      client: a dynamiq.Client; default: dynamiq.Client() from the DQ_* environment (closed by
        close()).
      process_group: the torch.distributed group DDP runs on (default: the default group). Used
        for the warm-up steps, record_error's exact reference, and to agree on a compression
        change; the dynamiq job must consist of exactly its ranks.
      average: divide the sum by the number of workers (DDP's semantics). Default True.
      warmup_steps: the first this many steps (backward passes) bypass dynamiqd and run torch's
        own uncompressed all-reduce on process_group (default_hooks.allreduce_hook). The daemon has
        no per-request codec switch, so exact warm-up steps take the process group's path.
      codec, bits, min_compress_elements, topology, lossy_phase_ms: if any is given, global rank 0
        changes the job's compression through the operator API at `control` (any dynamiqd's
        --listen address; the change reaches every node through the coordinator), and every rank then runs
        tiny all-reduces until the daemon reports the new config epoch, so all of training runs
        with it. Unset fields keep the job's values (dynamiqctl set-compression semantics).
        lossy_phase_ms > 0: the loss-tolerant all-reduce (daemons of --transport=udp; codec none or
        bf16); pair it with a periodic sync_state of the model to bound the drift it leaves.
      control: host:port of a dynamiqd's operator API; required with the options above.
      record_error: also all-reduce every bucket exactly over process_group (costs a second,
        uncompressed all-reduce) and record the squared error and squared norm of the daemon's
        result, for vNMSE = sum(err) / sum(norm) per step. For measurements, not training speed.
      name_prefix: prefix of the collective names ("<prefix>.bucket<i>"); every worker must use the
        same one.
      max_records: how many of the latest per-collective records to keep (see `records`).

    Weights: set_weight(w) before a step's backward makes every bucket of that step a weighted
    all-reduce (see set_weight); DropCompute all-reduces its accumulated gradients through submit()
    with a weight.
    """

    def __init__(self, client=None, process_group=None, *, average=True, warmup_steps=0, codec=None,
                 bits=None, min_compress_elements=None, topology=None, control=None,
                 record_error=False, name_prefix="ddp", max_records=100_000, lossy_phase_ms=None):
        self._owns_client = client is None
        self.client = client if client is not None else dynamiq.Client()
        self.process_group = process_group
        self.average = average
        self.warmup_steps = int(warmup_steps)
        self.record_error = record_error
        self.name_prefix = name_prefix
        self.step = 0
        # One record per dynamiq collective (dicts; see docs/python.md), appended by the
        # completion thread in completion order; the oldest are dropped past max_records.
        self.records = collections.deque(maxlen=max_records)
        self._slots = {}
        # (step, weight) of set_weight(), consumed by that step's last bucket.
        self._weight = None
        self._lock = threading.Lock()  # DDP may call hooks from one autograd thread per device
        self._queue = queue.Queue()
        self._thread = None
        self._closed = False
        _open_states.add(self)
        if any(v is not None for v in (codec, bits, min_compress_elements, topology, lossy_phase_ms)):
            self._set_compression(control, codec=codec, bits=bits,
                                  min_compress_elements=min_compress_elements, topology=topology,
                                  lossy_phase_ms=lossy_phase_ms)

    # -- compression -------------------------------------------------------------------------

    def _set_compression(self, control, **config):
        if not dist.is_initialized():
            # Without it every worker would make its own change and stop syncing at its own epoch.
            raise ValueError("DynamiqState: codec options need torch.distributed initialized "
                             "(global rank 0 changes the job's compression, the others wait for it)")
        group = self.process_group
        rank = dist.get_rank(group)
        # broadcast() takes a global rank: that of the group's rank 0.
        source = 0 if group is None else dist.distributed_c10d._get_global_rank(group, 0)
        epoch = torch.zeros(1, dtype=torch.int64)
        error = None
        if rank == 0:
            try:
                if control is None:
                    raise ValueError("DynamiqState: codec/bits/min_compress_elements/topology need "
                                     "control='host:port' (a dynamiqd's --listen address)")
                changes = {k: v for k, v in config.items() if v is not None}
                epoch[0] = dynamiq.Control(control).set_compression(self.client.job, **changes)
            except Exception as e:  # every rank must leave the broadcast below
                error = e
                epoch[0] = -1
        dist.broadcast(epoch, src=source, group=group)
        if error is not None:
            raise error
        if epoch[0] < 0:
            raise RuntimeError("DynamiqState: rank 0 failed to change the job's compression (see its error)")
        target = int(epoch[0])
        buffer = self.client.allocate(4)
        try:
            value = buffer.numpy(np.float32, 1)
            for _ in range(_MAX_CONFIG_SYNC_COLLECTIVES):
                value[0] = 0
                # Every worker sees the same epoch for the same collective, so all stop together.
                if self.client.all_reduce(value, "dynamiq.torch.config").config_epoch >= target:
                    break
            else:
                raise RuntimeError(f"dynamiqd did not apply config epoch {target} within "
                                   f"{_MAX_CONFIG_SYNC_COLLECTIVES} collectives")
        finally:
            value = None  # the view must go before the buffer
            try:
                buffer.release()
            except BufferError:
                pass  # a traceback still holds the view: the buffer goes with it

    # -- weights -------------------------------------------------------------------------------

    def set_weight(self, weight):
        """Makes every bucket of the next backward pass (step `self.step`) a weighted all-reduce:
        each worker's bucket g_i counts with its `weight` w_i (finite, >= 0: its sample count), and
        the hook's result is sum(w_i g_i) / sum(w_i) (average=True; 0 when every weight is 0) or
        sum(w_i g_i). With DDP's gradients (each worker's mean over its own batch) and w_i its batch
        size, that is the mean over every sample of the step, whatever the split. A weight of 0
        still takes part (the worker's bucket counts for nothing). The weight applies to that one
        step; None makes it unweighted again. Every worker must give a weight for the same steps
        (the daemon refuses a collective where some do and some do not: dynamiq.Error
        INVALID_ARGUMENT); --device=cuda daemons refuse weights (UNIMPLEMENTED). Not during the
        warm-up steps, which run torch's unweighted all-reduce."""
        w = None if weight is None else _check_weight(weight)
        if w is not None and self.step < self.warmup_steps:
            raise ValueError(f"DynamiqState.set_weight: step {self.step} is a warm-up step (warmup_steps="
                             f"{self.warmup_steps}), all-reduced by torch without weights")
        with self._lock:
            self._weight = None if w is None else (self.step, w)

    def _take_weight(self, step, last):
        """The weight set for `step` (or None); the step's last bucket clears it."""
        with self._lock:
            weight = self._weight[1] if self._weight is not None and self._weight[0] == step else None
            if last:
                self._weight = None
            return weight

    # -- the hook ----------------------------------------------------------------------------

    def _slot(self, index, nbytes, device):
        slot = self._slots.get(index)
        if slot is not None and not slot.fits(nbytes, device):
            # The bucket grew (DDP rebuilds buckets after the first step); its last all-reduce
            # completed before this step's backward began.
            slot.release()
            slot = None
        if slot is None:
            slot = _Slot(self.client, nbytes, device)
            self._slots[index] = slot
        return slot

    def _ensure_thread(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._complete_loop, name="dynamiq-hook", daemon=True)
            self._thread.start()

    def submit(self, tensor, index, step, sizes=None, *, weight=None, name=None):
        """Starts the all-reduce of one flat gradient tensor and returns a torch.futures.Future that
        completes with `tensor` holding the (averaged) result. What allreduce_hook calls.
        sizes: element counts of the tensors `tensor` concatenates (DDP's bucket.parameters());
        if given, they travel in aligned_layout() (super-group aligned; same result, lower error).
        weight: this worker's weight (see set_weight); None: unweighted.
        name: the collective's name; default "<name_prefix>.bucket<index>". `index` also keys the
        reused buffer (any hashable)."""
        if self._closed:
            raise RuntimeError("DynamiqState is closed")
        if weight is not None:
            weight = _check_weight(weight)
        send_dtype = wire_dtype(tensor.dtype)
        flat = tensor.reshape(-1)
        n = count = flat.numel()
        segments = gaps = None
        if sizes is not None and sum(sizes) == n and len(sizes) > 1:
            sources = list(itertools.accumulate([0] + list(sizes[:-1])))
            offsets, total = aligned_layout(sizes)
            if offsets != sources:  # already aligned (e.g. every size a multiple of 256): one copy
                segments = list(zip(sources, offsets, sizes))
                ends = sorted((dst, dst + k) for _, dst, k in segments)
                starts = [start for start, _ in ends[1:]] + [total]
                gaps = [(end, start) for (_, end), start in zip(ends, starts) if start > end]
                n = total
        with self._lock:
            slot = self._slot(index, n * torch.tensor([], dtype=send_dtype).element_size(), tensor.device)
            view = slot.view(send_dtype, n)
            if segments is None:
                view.copy_(flat)
            else:
                for begin, end in gaps:
                    view[begin:end].zero_()
                for src, dst, k in segments:
                    view[dst:dst + k].copy_(flat[src:src + k])
            slot.before_submit([tensor])
            reference = work = None
            if self.record_error:
                reference = tensor.detach().reshape(-1).to(torch.float32, copy=True)
                if weight is not None:
                    reference *= weight
                work = dist.all_reduce(reference, group=self.process_group, async_op=True)
            if name is None:
                name = f"{self.name_prefix}.bucket{index}"
            started = time.perf_counter()
            pending = self.client.all_reduce_async(slot.buffer, name, count=n, dtype=_dq_dtype(send_dtype),
                                                   average=self.average, weight=weight)
            future = torch.futures.Future()
            self._ensure_thread()
            self._queue.put((pending, slot, view, tensor, future, step, index, count, started, reference, work,
                             segments, weight))
        return future

    def _complete_loop(self):
        # The daemon completes a job's collectives in order, so waiting in submission order is
        # never slower than waiting for any.
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending, slot, view, tensor, future, step, index, n, started, reference, work, segments, weight = item
            try:
                result = pending.wait()
                if segments is None:
                    tensor.copy_(view.reshape(tensor.shape))
                else:
                    flat = tensor.view(-1)
                    for src, dst, k in segments:
                        flat[src:src + k].copy_(view[dst:dst + k])
                slot.after_copy_back([tensor])
                record = {"step": step, "bucket": index, "elements": n, "sequence": result.sequence,
                          "config_epoch": result.config_epoch, "codec": result.codec,
                          "bits": result.bits, "wire_bytes": result.wire_bytes,
                          "seconds": time.perf_counter() - started, "weight": weight,
                          "weight_sum": result.weight_sum, "contributors": result.contributors,
                          "nodes": list(result.nodes)}
                if result.measured_vnmse is not None:
                    record["measured_vnmse"] = result.measured_vnmse
                if work is not None:
                    work.wait()
                    if self.average:
                        # What the daemon divides by: the sum of the weights, or the workers.
                        total = result.weight_sum if weight is not None else dist.get_world_size(self.process_group)
                        if total > 0:
                            reference /= total
                        else:
                            reference.zero_()
                    got = view.to(torch.float32) if segments is None else torch.cat(
                        [view[dst:dst + k] for _, dst, k in segments]).to(torch.float32)
                    got = got.to(reference.device)
                    record["sq_error"] = float(((got - reference) ** 2).sum(dtype=torch.float64))
                    record["sq_norm"] = float((reference ** 2).sum(dtype=torch.float64))
                self.records.append(record)
                future.set_result(tensor)
            except BaseException as e:  # noqa: B902 -- DDP must see every failure
                future.set_exception(e)
            # Drop this item's views now: a slot can only be released once nothing maps it.
            del item, pending, slot, view, tensor, future, reference, work, segments

    def close(self):
        """Stops the completion thread (after the pending all-reduces), releases the buffers and,
        if the state created its Client, closes it. Idempotent. The interpreter's exit closes a
        state still open (its completion thread must not be inside torch when Python shuts down)."""
        if self._closed:
            return
        self._closed = True
        _open_states.discard(self)
        if self._thread is not None:
            self._queue.put(None)
            if self._thread is not threading.current_thread():  # closed from a future's callback
                self._thread.join()
        for slot in self._slots.values():
            slot.release()
        self._slots.clear()
        if self._owns_client:
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def step_summary(self, step):
        """Sums of the records of one step: buckets, elements, wire_bytes, the element-weighted mean of
        the bits the daemon reported (the job's setting, e.g. an error budget's current choice),
        vnmse (if record_error) and daemon_vnmse: the element-weighted mean of the vNMSE the daemon
        measured for the step's buckets (if its error probe sampled them; dynamiqd
        --error_sample_rate=1 samples every compressed collective)."""
        rs = [r for r in self.records if r["step"] == step]
        elements = sum(r["elements"] for r in rs)
        out = {"step": step, "buckets": len(rs), "elements": elements,
               "wire_bytes": sum(r["wire_bytes"] for r in rs),
               "bits": sum(r["bits"] * r["elements"] for r in rs) / elements if elements else 0.0}
        if rs and "sq_error" in rs[0]:
            norm = sum(r["sq_norm"] for r in rs)
            out["vnmse"] = sum(r["sq_error"] for r in rs) / norm if norm > 0 else 0.0
        measured = [r for r in rs if "measured_vnmse" in r]
        if measured:
            out["daemon_vnmse"] = (sum(r["measured_vnmse"] * r["elements"] for r in measured) /
                                   sum(r["elements"] for r in measured))
        return out


def allreduce_hook(state, bucket):
    """DDP communication hook: model.register_comm_hook(state, allreduce_hook) with a DynamiqState.

    Returns a torch.futures.Future at once; it completes (from the state's background thread) with
    the bucket holding the average over all workers (weighted, after state.set_weight()), or with
    the daemon's error (dynamiq.Error), which DDP raises from backward()."""
    step = state.step
    last = bucket.is_last()
    if last:
        state.step += 1
    if step < state.warmup_steps:
        return default_hooks.allreduce_hook(state.process_group, bucket)
    weight = state._take_weight(step, last)
    sizes = [p.numel() for p in bucket.parameters()]
    return state.submit(bucket.buffer(), bucket.index(), step, sizes=sizes, weight=weight)


_default_client = None
_default_slot = None
_default_lock = threading.Lock()
# Names of all_reduce calls without name=: the learned period of their sequence (dynamiq/_names.py).
_default_names = CallNames("all_reduce")
# Hook states not yet closed, closed at interpreter exit.
_open_states = weakref.WeakSet()


def _close_at_exit():
    for state in list(_open_states):
        try:
            state.close()
        except Exception as e:  # noqa: BLE001 -- at exit: report, and close the others
            print(f"dynamiq.torch: closing a DynamiqState at exit: {e}", file=sys.stderr)


atexit.register(_close_at_exit)


def all_reduce(tensor, average=False, *, weight=None, client=None, name=None):
    """All-reduces `tensor` in place through dynamiqd (synchronously; the GIL is released while
    waiting) and returns it. float32 and bfloat16 travel as they are, float16 as float32. CUDA
    tensors go into device buffers when the daemon runs --device=cuda (device to device, CUDA IPC),
    else they are staged through host shared memory.

    weight: this worker's weight (finite, >= 0; e.g. its sample count): the result is
    sum(w_i t_i), with average divided by sum(w_i) (0 when every weight is 0); every worker of the
    collective passes one or none does. The sum of the weights is exact (an fp64 side lane beside
    the data, whatever the codec); CPU daemons only (--device=cuda: dynamiq.Error UNIMPLEMENTED).

    client: default, one dynamiq.Client per process from the DQ_* environment, created on first use.
    name: the collective's name (every worker must pass the same); default
    "all_reduce.<dtype>.<count>.<k>", named from the sequence of this process's calls without a
    name so that a training loop's calls get the same names every step (daemon state such as
    arc_topk's error feedback is kept per name; workers must then call in the same order).
    An empty tensor is returned at once (like torch.distributed's all_reduce).
    Raises dynamiq.Error with the daemon's message on failure (e.g. workers disagreeing on size)."""
    global _default_client, _default_slot
    send_dtype = wire_dtype(tensor.dtype)
    if weight is not None:
        weight = _check_weight(weight)
    if tensor.numel() == 0:
        return tensor
    nbytes = tensor.numel() * torch.tensor([], dtype=send_dtype).element_size()
    if client is None:
        # The default client's slot is shared: one all-reduce at a time through it.
        with _default_lock:
            if _default_client is None:
                _default_client = dynamiq.Client()
            if name is None:
                name = _default_names.name("", _dtype_name(tensor.dtype), tensor.numel())
            if _default_slot is None or not _default_slot.fits(nbytes, tensor.device):
                if _default_slot is not None:
                    _default_slot.release()
                _default_slot = _Slot(_default_client, nbytes, tensor.device)
            _all_reduce_through(_default_client, _default_slot, tensor, send_dtype, name, average, weight)
        return tensor
    if name is None:
        with _default_lock:
            name = _default_names.name("", _dtype_name(tensor.dtype), tensor.numel())
    slot = _Slot(client, nbytes, tensor.device)
    try:
        _all_reduce_through(client, slot, tensor, send_dtype, name, average, weight)
    finally:
        slot.release()
    return tensor


def _all_reduce_through(client, slot, tensor, send_dtype, name, average, weight=None):
    n = tensor.numel()
    view = slot.view(send_dtype, n)
    view.copy_(tensor.reshape(-1))
    slot.before_submit([tensor])
    client.all_reduce(slot.buffer, name, count=n, dtype=_dq_dtype(send_dtype), average=average, weight=weight)
    tensor.copy_(view.reshape(tensor.shape))
    slot.after_copy_back([tensor])


# The torch.distributed backend "dynamiq" (registered on import): dist.init_process_group("dynamiq").
from dynamiq._process_group import (  # noqa: E402,F401  (re-exported; needs the names above)
    BACKEND,
    DEFAULT_EXACT_BELOW,
    ProcessGroupDynamiq,
    exact,
    get_process_group,
)

# DropCompute: straggler-tolerant gradient accumulation on the weighted all-reduce (needs the above).
from dynamiq._drop_compute import (  # noqa: E402,F401  (re-exported)
    DropCompute,
    StepResult,
    select_threshold,
    simulate_steps,
)

# sync_state: the members' state for a worker that joins a running job.
from dynamiq._sync_state import sync_state  # noqa: E402,F401  (re-exported)

"""DropCompute (Giladi et al., "DropCompute: simple and more robust distributed synchronous training via
compute variance reduction", arXiv 2306.10598): gradient accumulation with a compute deadline.

    dc = dynamiq.torch.DropCompute(ddp, micro_batches=4, threshold="auto", state=state)
    for step in range(steps):
        parts = split(next_batch(), 4)
        result = dc.step(lambda m: loss_fn(ddp(parts[m][0]), parts[m][1]))
        optimizer.step()

Each step runs up to `micro_batches` forward/backward passes under DDP's no_sync(), checking the
time since the step's compute started before every micro-batch and between its forward and
backward; past the threshold the worker stops (a forward that ended late is discarded) and
all-reduces what it accumulated, weighted by what it computed. A synchronous step then waits for
the threshold, not for the slowest worker. The threshold is fixed (seconds) or chosen from the
workers' recorded micro-batch times by the paper's rule (select_threshold), the same on every worker.
See docs/python.md, "DropCompute".
"""

import contextlib
import dataclasses
import math
import time

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["DropCompute", "StepResult", "select_threshold", "simulate_steps"]

# DDP's default bucket size: the accumulated gradients travel in buckets of at most this much.
_DEFAULT_BUCKET_CAP_MB = 25


def simulate_steps(forward, backward, threshold, min_micro_batches=0):
    """What DropCompute's stopping rule does with recorded micro-batch times.

    forward, backward: seconds, arrays of shape [..., K] (K planned micro-batches; e.g. [steps,
    workers, K]); threshold: seconds >= 0 (math.inf: never stop), or an array of them that
    broadcasts against [...]. Returns (completed, compute): the micro-batches each worker completes
    and its compute time, arrays of shape [...] (broadcast).

    The rule (DropCompute.step): before micro-batch m > 0 the worker stops if the elapsed time is
    past the threshold; after a forward, too, discarding that forward. So micro-batch m completes
    iff its forward ends by the threshold (or m < min_micro_batches), and the compute time is where
    the worker stopped: the end of its last backward, or of the discarded forward."""
    f = np.asarray(forward, dtype=np.float64)
    b = np.asarray(backward, dtype=np.float64)
    tau = np.asarray(threshold, dtype=np.float64)
    k = f.shape[-1]
    ends = np.cumsum(f + b, axis=-1)  # end of micro-batch m's backward
    forward_ends = ends - b
    shape = np.broadcast_shapes(f.shape[:-1], tau.shape)
    ends, forward_ends = np.broadcast_to(ends, shape + (k,)), np.broadcast_to(forward_ends, shape + (k,))
    completed = np.maximum(min(min_micro_batches, k), (forward_ends <= tau[..., None]).sum(axis=-1))
    previous = np.concatenate([np.zeros(shape + (1,)), ends], axis=-1)  # end of micro-batch m - 1
    stopped_at = np.take_along_axis(previous, completed[..., None], axis=-1)[..., 0]
    next_forward = np.take_along_axis(np.concatenate([forward_ends, ends[..., -1:]], axis=-1),
                                      completed[..., None], axis=-1)[..., 0]
    # Not all done: stopped before the next micro-batch, or after its (discarded) forward.
    compute = np.where((completed == k) | (stopped_at > tau), stopped_at, next_forward)
    return completed, compute


def select_threshold(forward, backward, overhead=0.0, min_micro_batches=0, max_dropped=None):
    """The paper's automatic threshold: the one that maximises the effective throughput
    E[micro-batches completed per step] / E[step time], over recorded times.

    forward, backward: seconds of every micro-batch, arrays of shape [steps, workers, K], recorded
    without a threshold; overhead: the seconds of a step outside the workers' compute (all-reduce,
    optimizer, data), added to every step. A step with threshold T takes the slowest worker's
    compute time (simulate_steps) plus the overhead, and completes the sum of the workers'
    micro-batches. Each worker's count and compute time change only at its recorded forward and
    backward ends, so every such breakpoint is evaluated exactly, in one sweep in time order
    (O(E log E) for E = 2 x steps x workers x K breakpoints), no grid. The result is the middle of
    the best breakpoint's plateau (up to the next breakpoint), where rounding cannot change what a
    step does. max_dropped (a fraction; not in the paper): only thresholds that drop at most that
    share of the micro-batches on these times.

    Returns (threshold, info): math.inf when stopping never pays; info has `speedup` (throughput
    with the threshold over throughput without), `completed_fraction` (the share of the
    micro-batches completed on these times), `step_seconds` and `full_step_seconds` (the mean step
    time with and without the threshold), `overhead_seconds`."""
    f = np.asarray(forward, dtype=np.float64)
    b = np.asarray(backward, dtype=np.float64)
    if f.ndim != 3 or f.shape != b.shape or f.size == 0:
        raise ValueError(f"select_threshold: forward and backward must be [steps, workers, K] arrays of the "
                         f"same shape, got {f.shape} and {b.shape}")
    if not (np.isfinite(f).all() and np.isfinite(b).all()) or (f < 0).any() or (b < 0).any():
        raise ValueError("select_threshold: micro-batch times must be finite and >= 0")
    steps, workers, k = f.shape
    ends = np.cumsum(f + b, axis=-1)
    # Each worker's breakpoints in time order, and its (completed, compute) from each one on.
    taus = np.sort(np.concatenate([ends - b, ends], axis=-1), axis=-1)  # [steps, workers, 2K]
    completed, compute = simulate_steps(f[:, :, None, :], b[:, :, None, :], taus, min_micro_batches)
    first_completed, first_compute = simulate_steps(f, b, 0.0, min_micro_batches)  # from 0 s on
    step_compute = first_compute.max(axis=1)  # [steps]
    # Per step, its slowest worker as the threshold passes each breakpoint: compute times only
    # grow with the threshold, so that is a running maximum over the step's breakpoints.
    order = np.argsort(taus.reshape(steps, -1), axis=1, kind="stable")
    step_taus = np.take_along_axis(taus.reshape(steps, -1), order, axis=1)
    running = np.maximum.accumulate(np.concatenate(
        [step_compute[:, None], np.take_along_axis(compute.reshape(steps, -1), order, axis=1)], axis=1), axis=1)
    step_delta = np.diff(running, axis=1)  # growth of the step's time at each breakpoint
    previous = np.concatenate([first_completed[:, :, None], completed[:, :, :-1]], axis=-1)
    count_delta = np.take_along_axis((completed - previous).reshape(steps, -1), order, axis=1)
    # All steps' breakpoints in time order: totals after each distinct threshold.
    flat = np.argsort(step_taus.ravel(), kind="stable")
    tau_sorted = step_taus.ravel()[flat]
    counts = first_completed.sum() + np.cumsum(count_delta.ravel()[flat])
    seconds = step_compute.sum() + np.cumsum(step_delta.ravel()[flat])
    last = np.append(tau_sorted[1:] != tau_sorted[:-1], True)  # the last event at each threshold
    tau_sorted, counts, seconds = tau_sorted[last], counts[last], seconds[last]
    tau_sorted = np.append(0.0, tau_sorted)
    counts = np.append(first_completed.sum(), counts)
    seconds = np.append(step_compute.sum(), seconds)
    rates = counts / (seconds + steps * overhead)
    if max_dropped is not None:  # the last breakpoint (nothing dropped) always qualifies
        rates[counts < steps * workers * k * (1 - max_dropped) - 1e-9] = -np.inf
    best = rates.max()
    # Ties (equal throughput): the largest threshold, which drops the least.
    index = int(np.flatnonzero(rates >= best * (1 - 1e-12))[-1])
    full = len(rates) - 1  # past the last breakpoint every worker completes everything
    threshold = math.inf if index == full else (tau_sorted[index] + tau_sorted[index + 1]) / 2
    info = {"speedup": float(rates[index] / rates[full]) if rates[full] > 0 else 1.0,
            "completed_fraction": float(counts[index] / (steps * workers * k)),
            "step_seconds": float(seconds[index] / steps + overhead),
            "full_step_seconds": float(seconds[full] / steps + overhead), "overhead_seconds": float(overhead),
            "breakpoints": len(rates), "steps": steps, "workers": workers}
    return float(threshold), info


@dataclasses.dataclass
class StepResult:
    """What one DropCompute.step did on this worker.

    computed: micro-batches whose gradient was accumulated; planned: micro_batches; weight: this
    worker's weight (completed micro-batches, or their samples); weight_sum: the sum over all
    workers (None with normalize="planned", which sends no weights); threshold: the deadline in
    force (seconds; None: none, e.g. while calibrating); calibrating: the step was recorded for the
    automatic threshold; discarded_forward: a forward ran past the deadline and was thrown away;
    compute_seconds: from the step's start to the stop; sync_seconds: the all-reduce;
    forward_seconds/backward_seconds: per micro-batch (the discarded forward included)."""
    step: int
    computed: int
    planned: int
    weight: float
    weight_sum: float
    threshold: float
    calibrating: bool
    discarded_forward: bool
    compute_seconds: float
    sync_seconds: float
    forward_seconds: list
    backward_seconds: list

    @property
    def dropped(self):
        """Micro-batches this worker did not contribute."""
        return self.planned - self.computed


class DropCompute:
    """Gradient accumulation over `micro_batches` micro-batches that stops at a compute deadline, then
    all-reduces the accumulated gradients weighted by what each worker computed.

    Args:
      model: the DistributedDataParallel module (micro-batches run under its no_sync(), so DDP itself
        never all-reduces; its buffers are broadcast from rank 0 at each step's first forward, as in
        DDP's own accumulation) or a plain module replicated by the caller.
      micro_batches: K, the planned micro-batches per step.
      threshold: None (never stop: plain accumulation), seconds of compute per step, or "auto":
        record `window` steps (after `warmup` unrecorded ones) without a deadline, all-gather every
        worker's micro-batch times over the process group and take select_threshold()'s choice, the
        same on every worker; with recalibrate_every=N, a new window every N steps.
      state: a dynamiq.torch.DynamiqState: the gradients go through dynamiqd as weighted all-reduces
        ("<name_prefix>.sync<i>"; its warm-up steps through torch on its process group, exactly).
        Without one they go through torch.distributed on the process group (gloo, or the "dynamiq"
        backend): a sum of the gradients and an exact float64 sum of the weights.
      process_group: for the all-gather of the times and the torch path (default: DDP's, the state's,
        then the default group).
      normalize: "computed" (default): the result is the mean gradient over the micro-batches (or
        samples) every worker actually computed, sum_i(acc_i) / sum_i(w_i); "planned": the paper's
        scaling, sum_i(acc_i) / (K * workers), as if dropped micro-batches had zero gradient.
      min_micro_batches: micro-batches computed whatever the deadline (default 0: the paper lets a
        worker contribute nothing; it still takes part with weight 0).
      max_dropped: with "auto", the largest share of micro-batches the threshold may drop on the
        recorded times (default None: the paper's rule alone).
      bucket_cap_mb: size of the all-reduced buckets (DDP's default 25).
      clock: seconds, monotonic (default time.perf_counter); tests pass a fake one.
      synchronize: called before every clock reading, so the times include queued device work;
        default: torch.cuda.synchronize() when a parameter is on a CUDA device, else nothing.

    Not thread-safe: one step at a time, from the training loop."""

    def __init__(self, model, micro_batches, threshold=None, *, state=None, process_group=None,
                 normalize="computed", min_micro_batches=0, max_dropped=None, window=20, warmup=2,
                 recalibrate_every=0, bucket_cap_mb=_DEFAULT_BUCKET_CAP_MB, clock=time.perf_counter,
                 synchronize=None):
        if int(micro_batches) < 1:
            raise ValueError(f"DropCompute: micro_batches must be >= 1, got {micro_batches!r}")
        if normalize not in ("computed", "planned"):
            raise ValueError(f"DropCompute: normalize is 'computed' or 'planned', got {normalize!r}")
        self.auto = threshold == "auto"
        if not self.auto and threshold is not None:
            threshold = float(threshold)
            if not threshold >= 0:
                raise ValueError(f"DropCompute: threshold must be None, 'auto' or seconds >= 0, got {threshold!r}")
        if self.auto and (int(window) < 1 or int(warmup) < 0 or int(recalibrate_every) < 0):
            raise ValueError("DropCompute: window must be >= 1, warmup and recalibrate_every >= 0")
        self.model = model
        self.micro_batches = int(micro_batches)
        self.threshold = None if self.auto else threshold
        self.state = state
        self.normalize = normalize
        self.min_micro_batches = int(min_micro_batches)
        self.max_dropped = max_dropped
        self.window = int(window)
        self.warmup = int(warmup)
        self.recalibrate_every = int(recalibrate_every)
        self.clock = clock
        self.steps = 0
        # The latest automatic choice: select_threshold's info plus "threshold" and "step"; and the
        # times it was made from (all workers': forward, backward [steps, workers, K], overhead).
        self.selection = None
        self.recorded = None
        self._ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if process_group is None:
            process_group = getattr(model, "process_group", None) if self._ddp else None
            if process_group is None and state is not None:
                process_group = state.process_group
        self.process_group = process_group
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buckets = _buckets(self._params, int(bucket_cap_mb * 1024 * 1024))
        if synchronize is None:
            devices = {p.device for p in self._params if p.device.type == "cuda"}
            synchronize = (lambda: [torch.cuda.synchronize(d) for d in devices]) if devices else (lambda: None)
        self._synchronize = synchronize
        # Calibration: the next window's first step, and the rows recorded so far.
        self._window_start = self.warmup if self.auto else None
        self._rows = []
        self._last_end = None

    # -- one step ------------------------------------------------------------------------------

    def step(self, forward):
        """Runs one step's micro-batches and all-reduces their gradients; returns a StepResult.

        forward(m) runs micro-batch m (0 <= m < micro_batches) through the model and returns its
        loss (a scalar tensor, the micro-batch's mean), or (loss, samples) to weight by samples:
        then the step's weight is the sum of the completed micro-batches' samples, and each loss
        is scaled by its samples before backward. The step starts from zero gradients (it sets
        them to None) and leaves the all-reduced result in every parameter's .grad, ready for
        optimizer.step()."""
        now = self._now
        calibrating = self._calibrating()
        deadline = None if calibrating else self.threshold
        for p in self._params:
            p.grad = None
        if self._ddp:
            # DDP broadcasts rank 0's buffers at the first forward after a synced backward; under
            # no_sync it never syncs, so ask for that broadcast once per step, as its own
            # accumulation does (every worker runs micro-batch 0's forward: a collective).
            self.model.require_forward_param_sync = True
        start = now()
        gap = start - self._last_end if self._last_end is not None else math.nan
        forwards, backwards = [], []
        computed, weight, discarded = 0, 0.0, False
        with self.model.no_sync() if self._ddp else contextlib.nullcontext():
            for m in range(self.micro_batches):
                enforced = deadline is not None and m >= self.min_micro_batches
                began = now()
                # Micro-batch 0 always starts (0 s elapsed): every worker runs DDP's forward once.
                if enforced and m > 0 and began - start > deadline:
                    break
                out = forward(m)
                loss, samples = out if isinstance(out, tuple) else (out, None)
                forward_end = now()
                forwards.append(forward_end - began)
                if enforced and forward_end - start > deadline:
                    discarded = True
                    break
                if samples is not None and self.normalize == "computed":
                    loss = loss * float(samples)
                loss.backward()
                backwards.append(now() - forward_end)
                computed += 1
                weight += 1.0 if samples is None else float(samples)
        compute_end = now()
        weight_sum = self._all_reduce(weight)
        end = now()
        self._last_end = end
        result = StepResult(step=self.steps, computed=computed, planned=self.micro_batches, weight=weight,
                            weight_sum=weight_sum, threshold=deadline, calibrating=calibrating,
                            discarded_forward=discarded, compute_seconds=compute_end - start,
                            sync_seconds=end - compute_end, forward_seconds=forwards, backward_seconds=backwards)
        if calibrating:
            self._record(result, gap)
        self.steps += 1
        return result

    def _now(self):
        self._synchronize()
        return self.clock()

    # -- the all-reduce --------------------------------------------------------------------------

    def _all_reduce(self, weight):
        """All-reduces the accumulated gradients into every parameter's .grad; returns the sum of
        the weights (None with normalize="planned" through dynamiqd)."""
        grads = [_flat_grads(bucket) for bucket in self._buckets]
        state = self.state
        if state is not None:
            if state.step >= state.warmup_steps:
                return self._all_reduce_dynamiq(grads, weight)
            state.step += 1  # a warm-up step of the state: exact, through torch
        return self._all_reduce_torch(grads, weight)

    def _all_reduce_dynamiq(self, grads, weight):
        state = self.state
        step = state.step
        state.step += 1
        weighted = self.normalize == "computed"
        futures = []
        for i, (bucket, flat) in enumerate(zip(self._buckets, grads)):
            # The daemon computes sum(w_i g_i) / sum(w_i): g_i is the worker's own mean.
            if weighted and weight > 0:
                flat /= weight
            elif not weighted:
                flat /= self.micro_batches
            futures.append(state.submit(flat, ("drop_compute", i), step, sizes=[p.numel() for p in bucket],
                                        weight=weight if weighted else None, name=f"{state.name_prefix}.sync{i}"))
        for bucket, future in zip(self._buckets, futures):
            _set_grads(bucket, future.wait())
        if not weighted:
            return None
        for record in reversed(state.records):  # the completion thread's record of this step
            if record["step"] == step:
                return record["weight_sum"]
        return None

    def _all_reduce_torch(self, grads, weight):
        group = self.process_group
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        weights = torch.tensor([weight], dtype=torch.float64)
        if world > 1:
            works = [dist.all_reduce(flat, group=group, async_op=True) for flat in grads]
            if self.normalize == "computed":
                dist.all_reduce(weights, group=group)  # float64: exact on gloo and the dynamiq backend
            for work in works:
                work.wait()
        total = float(weights[0])
        divisor = total if self.normalize == "computed" else float(self.micro_batches * world)
        for bucket, flat in zip(self._buckets, grads):
            if divisor > 0:
                flat /= divisor
            else:
                flat.zero_()  # every weight 0: the result is 0, as the daemon's
            _set_grads(bucket, flat)
        return total if self.normalize == "computed" else None

    # -- automatic threshold -----------------------------------------------------------------------

    def _calibrating(self):
        return self._window_start is not None and self.steps >= self._window_start

    def _record(self, result, gap):
        k = self.micro_batches
        self._rows.append(result.forward_seconds[:k] + result.backward_seconds[:k] +
                          [result.sync_seconds, gap])
        if len(self._rows) < self.window:
            return
        mine = torch.tensor(self._rows, dtype=torch.float64)
        self._rows = []
        if dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.process_group))]
            dist.all_gather(rows, mine, group=self.process_group)
        else:
            rows = [mine]
        times = torch.stack(rows, dim=1).numpy()  # [steps, workers, 2K + 2], rank order
        forward, backward = times[..., :k], times[..., k:2 * k]
        sync, gap = times[..., 2 * k], times[..., 2 * k + 1]
        # Outside compute: the all-reduce as the slowest worker saw it (it waited for nobody), plus
        # the time between steps (optimizer, data).
        between = np.where(np.isnan(gap), 0.0, gap).max(axis=1)  # unknown before the first step: 0
        overhead = float(np.median(sync.min(axis=1) + between))
        self.recorded = {"forward": forward, "backward": backward, "overhead": overhead}
        threshold, info = select_threshold(forward, backward, overhead, self.min_micro_batches, self.max_dropped)
        self.threshold = None if math.isinf(threshold) else threshold
        self.selection = dict(info, threshold=self.threshold, step=self.steps)
        self._window_start = self.steps + 1 + self.recalibrate_every if self.recalibrate_every else None


def _buckets(params, cap_bytes):
    """Parameters in buckets of at most cap_bytes (at least one parameter each), in reverse order as
    DDP's, one dtype and device per bucket. Identical on every worker for identical models."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _flat_grads(bucket):
    """The bucket's accumulated gradients, concatenated (zeros for parameters without one)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])


def _set_grads(bucket, flat):
    offset = 0
    for p in bucket:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p)
        offset += n

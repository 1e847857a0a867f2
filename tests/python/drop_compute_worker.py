"""One worker process of test_drop_compute.py: `drop_compute_worker.py OUT_DIR`, with RANK,
WORLD_SIZE and the DQ_* variables set by the test (codec none). Writes OUT_DIR/rank<r>.pt.

Phases, in order (every rank runs all of them; each has its own collective names):
  hook    DDP + allreduce_hook with state.set_weight(WEIGHTS[step][rank]); saves the all-reduced
          gradients and this rank's local gradients in float64 (the test computes the reference).
  drop    DropCompute on the same DDP model with a fake clock: rank r's micro-batches take
          FORWARD[r] / BACKWARD[r] seconds, so each rank completes a known number under THRESHOLD;
          through dynamiqd (weights), through dynamiqd with normalize="planned", through torch
          (gloo, no state), and with a state whose warmup_steps=1 (step 0 through torch, step 1
          through dynamiqd). Saves the results and every micro-batch's local float64 gradients.
  auto    threshold="auto" with a fake clock of seeded log-normal micro-batch times (rank 3 three
          times slower on some steps); saves the recorded times, the selection and the thresholds.
"""

import copy
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import dynamiq.torch

# Per step, every rank's weight: unequal with a 0, all 1 (the unweighted mean), fractional, all 0.
WEIGHTS = [[0, 1, 3, 2], [1, 1, 1, 1], [0.5, 2, 7, 1], [0, 0, 0, 0]]
K = 4
THRESHOLD = 10.0
# Fake seconds per micro-batch (forward, backward) by rank: with THRESHOLD, rank 0 completes all 4;
# rank 1 2 (micro-batch 2's forward ends at 11 and is discarded); rank 2 none (its first forward ends
# at 12); rank 3 3 (it stops before micro-batch 3, 10.5 s in).
FORWARD = [1.0, 2.0, 12.0, 1.5]
BACKWARD = [1.0, 2.5, 1.0, 2.0]
COMPLETED = [4, 2, 0, 3]
AUTO_STEPS, AUTO_WINDOW, AUTO_WARMUP = 10, 6, 1


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch(rank, step, m=0):
    g = torch.Generator().manual_seed(10000 * step + 100 * rank + m)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def local_grads(net, x, y):
    net.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    return [p.grad.double().clone() for p in net.parameters()]


def timed_forward(ddp, clock, rank, step, forward, backward):
    """forward(m) for DropCompute: advances the fake clock by forward[m] during the forward and by
    backward[m] when the backward reaches the output."""
    def run(m):
        x, y = batch(rank, step, m)
        clock.advance(forward[m])
        out = ddp(x)
        out.register_hook(lambda grad: clock.advance(backward[m]))
        return torch.nn.functional.cross_entropy(out, y)
    return run


def main():
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/pg-store", rank=rank, world_size=world)
    net = model()
    reference = copy.deepcopy(net)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    saved = {}

    # -- hook: weighted buckets --------------------------------------------------------------------
    state = dynamiq.torch.DynamiqState(name_prefix="hook")
    ddp.register_comm_hook(state, dynamiq.torch.allreduce_hook)
    steps = []
    for step, weights in enumerate(WEIGHTS):
        x, y = batch(rank, step)
        ddp.zero_grad(set_to_none=True)
        state.set_weight(weights[rank])
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        steps.append({"result": [p.grad.double().clone() for p in net.parameters()],
                      "local": local_grads(reference, x, y)})
    saved["hook"] = {"steps": steps, "records": list(state.records)}

    # -- drop: a fixed threshold, each path ----------------------------------------------------------
    micro = [local_grads(reference, *batch(rank, 0, m)) for m in range(K)]
    saved["drop_micro"] = micro
    for name, options in (("dynamiq", dict(state=state)), ("planned", dict(state=state, normalize="planned")),
                          ("torch", {})):
        clock = FakeClock()
        dc = dynamiq.torch.DropCompute(ddp, K, THRESHOLD, clock=clock, **options)
        result = dc.step(timed_forward(ddp, clock, rank, 0, [FORWARD[rank]] * K, [BACKWARD[rank]] * K))
        saved["drop_" + name] = {"result": result, "grads": [p.grad.double().clone() for p in net.parameters()]}
    warm = dynamiq.torch.DynamiqState(state.client, name_prefix="warm", warmup_steps=1)  # one registration
    clock = FakeClock()
    dc = dynamiq.torch.DropCompute(ddp, K, THRESHOLD, clock=clock, state=warm)
    for name in ("warm0", "warm1"):  # the same micro-batches twice, no optimizer: the same result
        result = dc.step(timed_forward(ddp, clock, rank, 0, [FORWARD[rank]] * K, [BACKWARD[rank]] * K))
        saved["drop_" + name] = {"result": result, "grads": [p.grad.double().clone() for p in net.parameters()]}
    saved["warm_records"] = list(warm.records)
    warm.close()

    # -- auto: the threshold every rank picks --------------------------------------------------------
    rng = np.random.default_rng([7, rank])
    slow = np.random.default_rng(7).random(AUTO_STEPS) < 0.3  # the same steps on every rank
    clock = FakeClock()
    dc = dynamiq.torch.DropCompute(ddp, K, "auto", state=state, window=AUTO_WINDOW, warmup=AUTO_WARMUP, clock=clock)
    results = []
    for step in range(AUTO_STEPS):
        f = 0.01 * rng.lognormal(0.0, 0.5, K)
        b = 2 * f
        if rank == 3 and slow[step]:
            f, b = 3 * f, 3 * b
        results.append(dc.step(timed_forward(ddp, clock, rank, step, f, b)))
        clock.advance(0.004)  # the optimizer, between steps
    saved["auto"] = {"results": results, "selection": dc.selection, "recorded": dc.recorded}
    torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
    state.close()


if __name__ == "__main__":
    main()

"""One worker process of test_torch.py: `ddp_worker.py MODE OUT_DIR [CONTROL]`, with RANK,
WORLD_SIZE and the DQ_* variables set by the test. Writes OUT_DIR/rank<r>.pt for the test to check.

Modes:
  exact       DDP + dynamiq hook (1 warm-up step) vs torch.distributed.all_reduce of the same
              local gradients, 3 steps; the job's codec is `none`.
  compressed  the same with DynamiqState(codec="dynamiq", bits=5, control=CONTROL) switching the
              job to DynamiQ 5-bit first.
  mismatch    each rank names its buckets differently; records the exception backward() raises.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

import dynamiq.torch

STEPS = 3


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)


def main():
    mode, out = sys.argv[1], sys.argv[2]
    control = sys.argv[3] if len(sys.argv) > 3 else None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/pg-store", rank=rank, world_size=world)
    net = model()
    reference = copy.deepcopy(net)  # no DDP: local gradients, all-reduced by torch
    if mode == "mismatch":
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        state = dynamiq.torch.DynamiqState(name_prefix=f"rank{rank}")
    else:
        # Small buckets: several all-reduces in flight per step, of sizes around min_compress. DDP
        # puts the first 1 MiB in one bucket whatever bucket_cap_mb says; torch 1.13 reads that
        # limit from this module attribute when it builds the reducer.
        dist._DEFAULT_FIRST_BUCKET_BYTES = 20000
        ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.02)
        options = {}
        if mode == "compressed":
            # record_error: the hook's own exact reference over the process group, to compare with
            # the error the daemon measures (its error probe).
            options = dict(codec="dynamiq", bits=5, min_compress_elements=0, control=control, record_error=True)
        state = dynamiq.torch.DynamiqState(warmup_steps=1 if mode == "exact" else 0, **options)
    ddp.register_comm_hook(state, dynamiq.torch.allreduce_hook)

    saved = {"steps": [], "error": None}
    for step in range(STEPS):
        x, y = batch(rank, step)
        ddp.zero_grad(set_to_none=True)
        try:
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        except RuntimeError as e:
            saved["error"] = str(e)
            break
        reference.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        expected = []
        for p in reference.parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            expected.append(g / world)
        saved["steps"].append({"dynamiq": [p.grad.clone() for p in net.parameters()], "torch": expected})
    saved["records"] = list(state.records)
    torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

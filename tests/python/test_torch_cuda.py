"""dynamiq.torch with CUDA tensors against --device=cuda daemons (two daemons on one GPU over the
hybrid path, --transport=gloo): buckets go into the daemon GPU's memory through CUDA IPC, never
through host memory, and give the same results as CPU tensors on CPU daemons. Needs a GPU (skips
without one, and where dynamiqd was built without CUDA); scripts/gpu-check runs it on a lent GPU."""

import faulthandler
import os
import subprocess
import sys
import threading

import pytest
import torch

import dynamiq
import dynamiq.torch
from conftest import CLIENT_TIMEOUT_SECONDS, HERE, dynamiqd_binary, run_workers, worker_envs
from test_client import concurrently


def _gpu_daemons_available():
    if not torch.cuda.is_available():
        return False
    out = subprocess.run([dynamiqd_binary(), "--help"], capture_output=True, text=True, timeout=30)
    return "--transport" in out.stdout + out.stderr


pytestmark = pytest.mark.skipif(not _gpu_daemons_available(), reason="needs a CUDA device and a CUDA build")


# A hung test dumps every thread's stack and its daemons' logs, then ends the run (the GPU check has
# one device call: a hang must leave a diagnosis, not a timeout).
WATCHDOG_SECONDS = 100
_clusters = []


@pytest.fixture(autouse=True)
def watchdog():
    def dump():
        err = sys.__stderr__
        print(f"\n=== test_torch_cuda: no progress in {WATCHDOG_SECONDS} s; stacks and daemon logs ===", file=err)
        faulthandler.dump_traceback(file=err, all_threads=True)
        for c in _clusters:
            for path in c.logs:
                print(f"--- {path}\n{c.log(path)}", file=err)
        err.flush()
        os._exit(3)

    timer = threading.Timer(WATCHDOG_SECONDS, dump)
    timer.daemon = True
    timer.start()
    # If a thread hangs holding the GIL, the timer cannot run: faulthandler's own thread can.
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS + 10, exit=True, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()
    timer.cancel()
    _clusters.clear()


def gpu_cluster(cluster, **flags):
    c = cluster(2, device="cuda", transport="gloo", **flags)
    _clusters.append(c)
    return c


def clients(c, job):
    return [dynamiq.Client(socket=s, job=job, local_rank=0, local_world_size=1, timeout=CLIENT_TIMEOUT_SECONDS)
            for s in c.sockets]


def test_cuda_buckets_go_through_device_buffers_and_sum_exactly(cluster):
    c = gpu_cluster(cluster, codec="none")
    cs = clients(c, "cuda-hook")
    assert [x.daemon_device for x in cs] == ["cuda", "cuda"]
    states = [dynamiq.torch.DynamiqState(x) for x in cs]
    for step, (dtype, n) in enumerate([(torch.float32, 1000), (torch.bfloat16, 3000), (torch.float16, 200),
                                       (torch.float32, 600_000)]):
        buckets = [(torch.arange(n, device="cuda") % 64 * (2 * r + 1)).to(dtype) for r in range(2)]
        futures = [s.submit(b, 0, step) for s, b in zip(states, buckets)]
        for f, b in zip(futures, buckets):
            assert f.wait() is b and b.device.type == "cuda" and b.dtype == dtype
            assert torch.equal(b, (torch.arange(n, device="cuda") % 64 * 2).to(dtype))  # (x + 3x) / 2
        for s in states:
            assert s._slots[0].on_device and s._slots[0].buffer.memory == "cuda"
    # all_reduce() of CUDA tensors, sum and average.
    tensors = [torch.full((7, 300), float(r + 1), device="cuda") for r in range(2)]
    _, errors = concurrently(*[lambda x=x, t=t: dynamiq.torch.all_reduce(t, client=x, name="sum")
                               for x, t in zip(cs, tensors)])
    assert errors == [None, None]
    for t in tensors:
        assert torch.equal(t, torch.full((7, 300), 3.0, device="cuda"))
    for s in states:
        s.close()
    for x in cs:
        x.close()


def test_cuda_tensors_on_gpu_daemons_match_cpu_tensors_on_cpu_daemons_bit_for_bit(cluster):
    n = 100_003
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    results = {}
    for kind in ("cuda", "cpu"):
        if kind == "cuda":
            c = gpu_cluster(cluster, codec="dynamiq", bits=5)
        else:
            c = cluster(2, codec="dynamiq", bits=5)
            _clusters.append(c)
        cs = clients(c, "same")
        tensors = [x.to(kind) for x in inputs]
        for step in range(3):
            _, errors = concurrently(*[lambda x=x, t=t: dynamiq.torch.all_reduce(t, client=x, name=f"g{step}")
                                       for x, t in zip(cs, tensors)])
            assert errors == [None, None]
        results[kind] = [t.cpu() for t in tensors]
        for x in cs:
            x.close()
        c.stop()
    assert torch.equal(results["cuda"][0], results["cuda"][1])
    assert torch.equal(results["cuda"][0], results["cpu"][0])


def test_process_group_backend_all_reduces_cuda_tensors_and_runs_ddp(cluster, workdir):
    c = gpu_cluster(cluster, codec="none")
    results = run_workers([os.path.join(HERE, "pg_worker.py"), "cuda", workdir], worker_envs(c, 2, 1, "pg-cuda"))
    for code, out in results:
        assert code == 0, out[-4000:]
    outs = [torch.load(os.path.join(workdir, f"rank{r}.pt")) for r in range(2)]
    for o in outs:
        assert "error" not in o, o.get("error")
        assert torch.equal(o["sum"], o["sum_want"])
        assert torch.equal(o["bf16_avg"], o["bf16_avg_want"])
        assert o["memory"] == ["cuda"]
        want = [(a + b) / 2 for a, b in zip(outs[0]["local_grads"], outs[1]["local_grads"])]
        for got, w in zip(o["ddp_grads"], want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-7)

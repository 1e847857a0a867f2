"""DropCompute and weighted all-reduce through dynamiq.torch (issue #38): the weighted mean against a
float64 reference (all_reduce, the DDP hook's set_weight, DropCompute's three all-reduce paths), the
deadline with a fake clock, and the automatic threshold against a brute-force sweep."""

import copy
import math
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch

import dynamiq
import dynamiq.torch
from conftest import CLIENT_TIMEOUT_SECONDS, HERE, Cluster, run_workers, worker_envs
from test_client import concurrently

import drop_compute_worker as dcw

WORKER = os.path.join(HERE, "drop_compute_worker.py")


def net():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def micro_batch(m):
    g = torch.Generator().manual_seed(m)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def fake_forward(model, clock, forward, backward, samples=None):
    """forward(m) for DropCompute: forward[m] fake seconds in the forward, backward[m] in the backward."""
    def run(m):
        x, y = micro_batch(m)
        clock.advance(forward[m])
        out = model(x)
        out.register_hook(lambda grad: clock.advance(backward[m]))
        loss = torch.nn.functional.cross_entropy(out, y)
        return loss if samples is None else (loss, samples[m])
    return run


def micro_batch_grads(model, m):
    model = copy.deepcopy(model)
    x, y = micro_batch(m)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.double() for p in model.parameters()]


# -- the deadline (one process, no daemon) ------------------------------------------------------------

@pytest.mark.parametrize("threshold, min_micro_batches, computed, compute_seconds, discarded", [
    (None, 0, 4, 12.0, False),  # no deadline: plain accumulation
    (5.0, 0, 2, 6.0, False),    # micro-batch 1 ends at 6 > 5: stops before micro-batch 2
    (3.5, 0, 1, 4.0, True),     # micro-batch 1's forward ends at 4 > 3.5: discarded
    (0.5, 0, 0, 1.0, True),     # the first forward is late: weight 0
    (0.5, 1, 1, 3.0, False),    # ... unless one micro-batch is always computed
    (0.5, 2, 2, 6.0, False),
])
def test_step_stops_at_the_deadline_with_a_fake_clock(threshold, min_micro_batches, computed, compute_seconds,
                                                      discarded):
    model = net()
    clock = dcw.FakeClock()
    dc = dynamiq.torch.DropCompute(model, 4, threshold, min_micro_batches=min_micro_batches, clock=clock)
    result = dc.step(fake_forward(model, clock, [1.0] * 4, [2.0] * 4))
    assert (result.computed, result.dropped, result.weight, result.weight_sum) == (computed, 4 - computed,
                                                                                 computed, computed)
    assert result.compute_seconds == compute_seconds and result.discarded_forward == discarded
    assert result.threshold == threshold and not result.calibrating
    assert len(result.forward_seconds) == computed + discarded and result.backward_seconds == [2.0] * computed
    # The gradient is the mean over the completed micro-batches (0 when none completed).
    per_batch = [micro_batch_grads(model, m) for m in range(computed)]
    for i, p in enumerate(model.parameters()):
        want = sum(g[i] for g in per_batch) / computed if computed else torch.zeros_like(p, dtype=torch.float64)
        assert torch.allclose(p.grad.double(), want, rtol=1e-6, atol=1e-7)


def test_step_weights_by_samples_and_planned_divides_by_the_planned_count():
    model = net()
    clock = dcw.FakeClock()
    samples = [4, 1, 3, 2]
    dc = dynamiq.torch.DropCompute(model, 4, 5.0, clock=clock)
    result = dc.step(fake_forward(model, clock, [1.0] * 4, [2.0] * 4, samples))
    assert (result.computed, result.weight) == (2, 5.0)
    grads = [micro_batch_grads(model, m) for m in range(2)]
    for i, p in enumerate(model.parameters()):
        assert torch.allclose(p.grad.double(), (4 * grads[0][i] + 1 * grads[1][i]) / 5, rtol=1e-6, atol=1e-7)
    # The paper's scaling: the sum over the completed micro-batches over the planned 4.
    dc = dynamiq.torch.DropCompute(model, 4, 5.0, clock=clock, normalize="planned")
    result = dc.step(fake_forward(model, clock, [1.0] * 4, [2.0] * 4))
    assert result.computed == 2 and result.weight_sum is None
    for i, p in enumerate(model.parameters()):
        assert torch.allclose(p.grad.double(), (grads[0][i] + grads[1][i]) / 4, rtol=1e-6, atol=1e-7)


def test_simulate_steps_predicts_what_step_does():
    rng = np.random.default_rng(3)
    forward, backward = rng.uniform(0.5, 2.0, (30, 4)), rng.uniform(0.5, 3.0, (30, 4))
    thresholds = [0.0, 0.7, 2.0, 4.5, 6.1, 9.0, math.inf]
    model = net()
    for i, (f, b) in enumerate(zip(forward, backward)):
        tau = thresholds[i % len(thresholds)]
        clock = dcw.FakeClock()
        dc = dynamiq.torch.DropCompute(model, 4, None if math.isinf(tau) else tau, min_micro_batches=i % 2,
                                       clock=clock)
        result = dc.step(fake_forward(model, clock, f, b))
        completed, compute = dynamiq.torch.simulate_steps(f, b, tau, min_micro_batches=i % 2)
        assert (result.computed, result.compute_seconds) == (int(completed), pytest.approx(float(compute)))


def test_bad_arguments_are_refused():
    model = net()
    with pytest.raises(ValueError, match="micro_batches"):
        dynamiq.torch.DropCompute(model, 0)
    with pytest.raises(ValueError, match="threshold"):
        dynamiq.torch.DropCompute(model, 2, -1.0)
    with pytest.raises(ValueError, match="normalize"):
        dynamiq.torch.DropCompute(model, 2, normalize="mean")
    with pytest.raises(ValueError, match="same shape"):
        dynamiq.torch.select_threshold(np.ones((2, 2, 3)), np.ones((2, 2, 2)))
    with pytest.raises(ValueError, match="weight"):
        dynamiq.torch.all_reduce(torch.ones(3), weight=-1.0)
    with pytest.raises(ValueError, match="weight"):
        dynamiq.torch.all_reduce(torch.ones(3), weight=math.nan)


# -- the automatic threshold against a brute-force sweep ----------------------------------------------

def synthetic_times(seed, steps=60, workers=4, k=4, sigma=0.5, slow=3.0, slow_share=0.1):
    """The paper's noise: log-normal micro-batch times (median 10 ms, backward twice the forward),
    plus one worker `slow` times slower on `slow_share` of the steps."""
    rng = np.random.default_rng(seed)
    forward = 0.01 * rng.lognormal(0.0, sigma, (steps, workers, k))
    forward[rng.random(steps) < slow_share, workers - 1, :] *= slow
    return forward, 2 * forward


def sweep_rate(forward, backward, tau, overhead):
    """Micro-batches completed per second with threshold tau, simulated step by step (independent of
    simulate_steps): check before each micro-batch and after each forward."""
    completed, seconds = 0, 0.0
    for f_step, b_step in zip(forward, backward):
        slowest = 0.0
        for f, b in zip(f_step, b_step):
            t = 0.0
            for m in range(len(f)):
                if m > 0 and t > tau:
                    break
                t += f[m]
                if t > tau:
                    break
                t += b[m]
                completed += 1
            slowest = max(slowest, t)
        seconds += slowest + overhead
    return completed / seconds


def assert_sweep_agrees(forward, backward, overhead, threshold):
    top = np.cumsum(forward + backward, axis=-1).max() * 1.05
    grid = np.linspace(top / 1000, top, 1000)
    rates = [sweep_rate(forward, backward, tau, overhead) for tau in grid]
    best = int(np.argmax(rates))
    chosen = sweep_rate(forward, backward, threshold, overhead)
    # As good as the sweep's best (it evaluates every breakpoint exactly), and the same threshold
    # within 10 %.
    assert chosen >= rates[best] * (1 - 1e-9)
    assert threshold == pytest.approx(grid[best], rel=0.1)
    return chosen / sweep_rate(forward, backward, math.inf, overhead)


@pytest.mark.parametrize("seed, sigma, workers, overhead", [(0, 0.5, 4, 0.005), (1, 0.3, 4, 0.02),
                                                            (2, 0.5, 8, 0.0), (3, 0.8, 6, 0.01)])
def test_automatic_threshold_is_the_best_of_a_brute_force_sweep(seed, sigma, workers, overhead):
    forward, backward = synthetic_times(seed, sigma=sigma, workers=workers)
    threshold, info = dynamiq.torch.select_threshold(forward, backward, overhead)
    speedup = assert_sweep_agrees(forward, backward, overhead, threshold)
    assert info["speedup"] == pytest.approx(speedup) and info["speedup"] > 1.05
    assert 0 < info["completed_fraction"] < 1


def test_max_dropped_bounds_the_drop_rate_and_no_noise_means_no_threshold():
    forward, backward = synthetic_times(0, sigma=0.8)
    free, info = dynamiq.torch.select_threshold(forward, backward, 0.005)
    bounded, bounded_info = dynamiq.torch.select_threshold(forward, backward, 0.005, max_dropped=0.05)
    assert info["completed_fraction"] < 0.95 <= bounded_info["completed_fraction"] and bounded > free
    assert 1.0 <= bounded_info["speedup"] <= info["speedup"]
    # Identical workers and steps: stopping never pays.
    same = np.full((10, 4, 3), 0.01)
    assert dynamiq.torch.select_threshold(same, same, 0.001)[0] == math.inf


# -- weighted all-reduce through dynamiqd -------------------------------------------------------------

def test_all_reduce_weighted_mean_matches_a_float64_reference(cluster):
    c = cluster(nodes=2, codec="none")
    clients = [dynamiq.Client(socket=c.sockets[r // 2], job="weighted", local_rank=r % 2, local_world_size=2,
                              timeout=CLIENT_TIMEOUT_SECONDS) for r in range(4)]
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(3000, generator=g) for _ in range(4)]
    # Unequal with a 0, all 1 (the unweighted mean), fractional, all 0 (the result is 0).
    for weights in ([0, 1, 3, 2], [1, 1, 1, 1], [0.5, 2.0, 7.0, 1.25], [0, 0, 0, 0]):
        want = sum(w * t.double() for w, t in zip(weights, tensors))
        total = float(sum(weights))
        for average in (True, False):
            got = [t.clone() for t in tensors]
            _, errors = concurrently(*[lambda c=c, t=t, w=w: dynamiq.torch.all_reduce(t, average, weight=w, client=c,
                                                                                       name=f"w.{average}")
                                       for c, t, w in zip(clients, got, weights)])
            assert errors == [None] * 4
            reference = (want / total if total else want * 0) if average else want
            for t in got:  # codec none: the reference up to fp32 rounding, and the same on every worker
                assert torch.allclose(t.double(), reference, rtol=1e-5, atol=1e-6), (weights, average)
                assert torch.equal(t, got[0])
    for client in clients:
        client.close()


# -- DDP: the hook's weights, DropCompute's paths, the automatic threshold (one run) -----------------

@pytest.fixture(scope="module")
def ddp_run():
    """drop_compute_worker.py on 2 nodes x 2 workers (codec none): every rank's saved results."""
    directory = tempfile.mkdtemp(prefix="dqdc-")
    daemons = Cluster(directory, 2, {"codec": "none"})
    try:
        results = run_workers([WORKER, directory], worker_envs(daemons, 2, 2, "dropcompute"))
        for code, out in results:
            assert code == 0, out[-4000:]
        yield [torch.load(os.path.join(directory, f"rank{r}.pt")) for r in range(4)]
    finally:
        daemons.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_hook_with_set_weight_gives_the_weighted_mean(ddp_run):
    for step, weights in enumerate(dcw.WEIGHTS):
        total = sum(weights)
        for i in range(len(ddp_run[0]["hook"]["steps"][step]["local"])):
            weighted = sum(w * run["hook"]["steps"][step]["local"][i] for w, run in zip(weights, ddp_run))
            want = weighted / total if total else weighted * 0
            for run in ddp_run:
                assert torch.allclose(run["hook"]["steps"][step]["result"][i], want, rtol=1e-5, atol=1e-7)
    records = ddp_run[0]["hook"]["records"]
    assert {(r["step"], r["weight_sum"], r["contributors"]) for r in records} == {
        (s, float(sum(w)), 4) for s, w in enumerate(dcw.WEIGHTS)}
    assert [r["weight"] for r in records if r["step"] == 0] == [0.0] * len({r["bucket"] for r in records})


@pytest.mark.parametrize("path", ["dynamiq", "planned", "torch", "warm0", "warm1"])
def test_drop_compute_all_reduces_the_mean_over_computed_micro_batches(ddp_run, path):
    completed = [run["drop_" + path]["result"].computed for run in ddp_run]
    assert completed == dcw.COMPLETED
    assert [run["drop_" + path]["result"].discarded_forward for run in ddp_run] == [False, True, True, False]
    sums = [[sum(run["drop_micro"][m][i] for m in range(c)) if c else run["drop_micro"][0][i] * 0
             for i in range(len(run["drop_micro"][0]))] for run, c in zip(ddp_run, completed)]
    divisor = sum(completed) if path != "planned" else dcw.K * len(ddp_run)
    for i in range(len(sums[0])):
        want = sum(s[i] for s in sums) / divisor
        for run in ddp_run:
            assert torch.allclose(run["drop_" + path]["grads"][i], want, rtol=1e-5, atol=1e-7)
    weight_sum = None if path == "planned" else float(sum(completed))
    assert [run["drop_" + path]["result"].weight_sum for run in ddp_run] == [weight_sum] * 4
    if path.startswith("warm"):  # the state's warm-up step went through torch, the next through dynamiqd
        assert {r["step"] for r in ddp_run[0]["warm_records"]} == {1}


def test_automatic_threshold_is_the_same_on_every_rank_and_a_sweep_best(ddp_run):
    selections = [run["auto"]["selection"] for run in ddp_run]
    assert selections[0] is not None and all(s == selections[0] for s in selections)
    results = [run["auto"]["results"] for run in ddp_run]
    window = range(dcw.AUTO_WARMUP, dcw.AUTO_WARMUP + dcw.AUTO_WINDOW)
    assert [s for s, r in enumerate(results[0]) if r.calibrating] == list(window)
    threshold = selections[0]["threshold"]
    for rank_results in results:
        assert [r.threshold for r in rank_results[window.stop:]] == [threshold] * (dcw.AUTO_STEPS - window.stop)
    # The recorded times are every rank's, in rank order: the selection is the sweep's best on them.
    recorded = ddp_run[0]["auto"]["recorded"]
    assert recorded["forward"].shape == (dcw.AUTO_WINDOW, 4, dcw.K)
    mine = [r.forward_seconds for r in results[2][window.start:window.stop]]
    assert np.allclose(recorded["forward"][:, 2, :], mine)
    assert recorded["overhead"] == pytest.approx(0.004)
    assert_sweep_agrees(recorded["forward"], recorded["backward"], recorded["overhead"], threshold)

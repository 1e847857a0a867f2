"""dynamiq._names.CallNames, the names of the torch backend's (and dynamiq.torch.all_reduce's)
collectives: the same every step, identical on every rank (a function of the calls' signatures
only), and never one name for two calls of a step once the period is known."""

import random

from dynamiq._names import MAX_HISTORY, CallNames


def steps(sizes, count, names=None, inserts=None):
    """Names `count` steps of calls of `sizes` (float32 all-reduces); inserts: {step: [sizes]}
    called after that step. Returns a list of lists of names."""
    names = names or CallNames("t")
    out = []
    for s in range(count):
        out.append([names.name("allreduce", "float32", n) for n in sizes])
        for n in (inserts or {}).get(s, []):
            names.name("allreduce", "float32", n)
    return out


def smallest_period(step):
    for p in range(1, len(step) + 1):
        if len(step) % p == 0 and step == step[p:] + step[:p]:
            return p


def test_ddp_buckets_keep_their_names_from_the_second_step():
    # Distinct bucket sizes (DDP's usual first bucket is its own size): step 2 reuses step 1's names.
    out = steps([262144, 6553600, 6553600, 1000], 6)
    assert all(s == out[0] for s in out)
    assert len(set(out[0])) == 4  # the two equal buckets keep apart
    assert out[0][0] == "t.allreduce.float32.262144.0"


def test_one_call_per_step():
    names = CallNames("t")
    out = steps([5000], 5, names)
    assert all(s == out[0] for s in out) and names.period == 1


def test_the_same_calls_give_the_same_names():
    a, b = CallNames("torch"), CallNames("torch")
    sizes = [3000, 1000, 3000, 2000, 3000, 3000, 5000]
    assert steps(sizes, 10, a) == steps(sizes, 10, b)


def test_equal_buckets_first_share_names_only_in_the_first_steps():
    # A step that starts with a block that repeats (two equal buckets) looks like two steps at
    # first; the guess is refuted and from the third step on every bucket has its own name.
    for sizes in ([1000, 1000, 2000], [1000] * 6 + [2000], [1000, 2000] * 5 + [3000], [7] * 12 + [9, 5],
                  [1000, 1000, 1000, 2000, 2000, 2000]):
        out = steps(sizes, 10)
        for s in out[3:]:
            assert s == out[3] and len(set(s)) == len(s), sizes


def test_inserted_calls_do_not_change_the_names():
    # Extra all-reduces (an evaluation) between steps get their own names; the steps keep theirs.
    out = steps([10, 20, 30], 20, inserts={4: [99], 12: [98, 97]})
    assert all(s == out[0] for s in out)
    # Another insertion before the steps after the first one outnumber those before it: the
    # period might have been wrong (see test_equal_buckets_first...), so it is learned again.
    out = steps([10, 20, 30], 40, inserts={4: [99], 7: [98, 97]})
    assert out[-1] == out[-2] and len(set(out[-1])) == 3


def test_changed_calls_are_learned_again():
    names = CallNames("t")
    before = steps([10, 20, 30], 5, names)
    after = steps([10, 25, 30, 40], 10, names)
    assert after[-1] == after[-2] == after[-3] and len(set(after[-1])) == 4
    assert names.period == 4
    assert before[-1] == before[0]


def test_random_steps_converge_without_shared_names():
    # Steps of 1-14 calls over three sizes (much more repetition inside a step than DDP's): from
    # the fourth step on (at most) names repeat every step and no two calls of a step share one.
    rng = random.Random(7)
    for _ in range(300):
        step = [rng.choice([10, 20, 30]) for _ in range(rng.randint(1, 14))]
        p = smallest_period(step)
        out = steps(step, 3 * len(step) + 8)
        last = out[-1]
        assert out[-2] == last, step
        for i in range(len(step)):
            for j in range(i):
                # Where the step is itself a repetition (period p < its length) the repeated
                # calls may share a name: nothing in the signatures tells them apart.
                if (i - j) % p:
                    assert last[i] != last[j], (step, last)


def test_memory_is_bounded_for_calls_that_never_repeat():
    names = CallNames("t")
    seen = set()
    for k in range(3 * MAX_HISTORY):
        name = names.name("allreduce", "float32", 1000 + k)
        assert name not in seen
        seen.add(name)
        assert len(names._sigs) <= MAX_HISTORY
    assert names.period is None


def test_ddps_first_iteration_then_its_rebuilt_buckets():
    # torch 1.13's DDP runs its first iteration with one bucket of all its parameters and then
    # rebuilds the buckets: that first call never comes back. The rebuilt buckets are named from
    # their first step (step 2) on, and keep their names from step 3.
    names = CallNames("t")
    first = names.name("allreduce", "float32", 17226)
    out = steps([8906, 8320], 6, names)
    assert first not in out[0]
    assert all(s == out[0] for s in out) and names.period == 2

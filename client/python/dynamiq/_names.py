"""Names for a process's daemon collectives that repeat step after step.

dynamiqd keeps state per collective name: arc_topk's error feedback (server/error_feedback.h) and
--step_budget's per-bucket shares (server/step_budget_planner.h). A caller that does not name its
collectives (DDP's reducer through the "dynamiq" backend, dynamiq.torch.all_reduce without name=)
needs names that come back every training step, or that state never helps: a new name per call
is a dense first step every time, and state that is never used again.

A name must also be identical on every rank of the job (the daemon matches the workers'
submissions by name, and the cross-node collective id hashes it), so it is a deterministic
function of the sequence of calls only: of each call's signature (kind, dtype, element count) in
order, never of anything local such as a data pointer.

CallNames learns the period of the sequence of signatures; `period` says what it locked.
  - Learning: the history since an anchor (the first call, or where the last guess failed) is
    matched against itself (its smallest period, with the prefix function of Knuth-Morris-Pratt,
    amortized O(1) per call). While it has not repeated, each call gets a fresh name,
    "<prefix>[.<kind>].<dtype>.<n>.<k>" with k a counter of the instance (a fresh name is never
    given to another call). Once it repeats with period P, call c gets the name of call c - P: a
    DDP step's buckets (the same order every step) get the same names in step 2 as in step 1.
    After a full period has repeated, the period is locked and the history dropped.
  - Locked: each call must be the period's next one and gets its name. A call that breaks it is
    taken for an insertion (an extra all-reduce, say at an evaluation; up to MAX_INSERTED calls
    in a row): fresh names, and the calls after it must go on where the period left off. If they
    do for longer than the period had held before the break, it stands; if one does not, the
    period was wrong (or the calls changed) and learning starts again at that call.
  - Unsticking: after `patience` calls without a lock (FIRST_PATIENCE, doubling; FIRST_PATIENCE
    more after a signature never seen before), learning goes on from a periodic stretch at the end
    of the history if one covers half of it: calls before the loop (or a change) must not keep the
    anchor from ever repeating. One such call is recognised at once: torch 1.13's DDP all-reduces
    one bucket of all its parameters in its first iteration and then rebuilds its buckets, so an
    anchor whose element count is that of all the calls after it (of its kind and dtype, none of
    them repeating yet) is dropped: the rebuilt buckets keep their names from their second step on.

Where the calls of a step are themselves a repetition (all buckets of one size, with nothing else
on the daemon path) no function of the signatures can tell the step from several steps, and the
smallest period wins: such buckets share names. Otherwise a guess can be wrong only when the calls
from the anchor start with a block that repeats within the step (two equal-size buckets first,
say), and then two calls of one step share a name (and dynamiqd's state) for a while: a guess
refuted while learning gives every call since the anchor a new fresh name (the shared ones are
never used again), and a locked one is refuted when it breaks again before the calls since its
last break outnumber those before it (a wrong period breaks once a step).
Every refuted lock raises a lower bound on the period (Fine and Wilf, _raise_min_period), so the
same wrong guess is not made again from another anchor; a signature never seen before (the calls
changed) drops the bound, as does a lock that held TRUSTED_PERIODS periods.

Simulated over 1,200 runs of random steps of 1-20 calls drawn from 1-8 sizes (far more repetition
within a step than DDP's buckets), half of them with a change of steps and all with up to three
insertions, 150 steps after the last disturbance (tests/python/test_names.py runs a small version
without disturbances): 0.14% of the calls shared a name, nearly all within three steps of a
disturbance; 4 runs still shared one later, and 12 still gave new (dense) names 100 steps on.
Bounded: MAX_HISTORY calls of history (periods up to half of it) and as many signatures remembered.
"""

import itertools

__all__ = ["CallNames"]

# Calls of history kept while learning; the longest period learned is half of it.
MAX_HISTORY = 8192
# Calls in a row that may break a locked period as an insertion before it is given up.
MAX_INSERTED = 8
# Periods a lock must hold before the lower bound from failed guesses is dropped.
TRUSTED_PERIODS = 16
# Calls without a lock after which learning looks for a periodic stretch at the end of the history
# (doubling each time it looks).
FIRST_PATIENCE = 64


def _repeats_from(sigs, start):
    """Whether sigs[start:] has a period shorter than itself (a border, by the prefix function)."""
    border = [0] * (len(sigs) - start)
    for i in range(1, len(border)):
        b = border[i - 1]
        while b > 0 and sigs[start + i] != sigs[start + b]:
            b = border[b - 1]
        border[i] = b + 1 if sigs[start + i] == sigs[start + b] else b
    return bool(border) and border[-1] > 0


class CallNames:
    """Names for a sequence of collectives (see the module comment). Not thread-safe: the caller
    names its calls in submission order under its own lock."""

    def __init__(self, prefix):
        self._prefix = prefix
        self._fresh = itertools.count()
        # Locked: the period's (signature, name) pairs and the position of the next call, and how
        # many calls in a row followed it. After a break: how many had followed it before, how
        # many calls were taken for an insertion (None once the period goes on), and whether one
        # of them was a signature never seen before.
        self._pattern = None
        self._position = 0
        self._run = 0
        self._run_before_break = None
        self._inserted = None
        self._novel_break = False
        # Learning: signatures and names since the anchor, their prefix function, and the
        # smallest period of the history (== its length while it has not repeated).
        self._sigs = []
        self._names = []
        self._border = []
        self._period = 0
        self._rest = 0  # elements of the calls after the anchor (_add)
        self._patience = FIRST_PATIENCE
        # A lower bound on the period, from the guesses that failed, and the signatures seen.
        self._min_period = 1
        self._seen = set()

    @property
    def period(self):
        """The locked period (calls per step), or None while learning."""
        return None if self._pattern is None else len(self._pattern)

    def name(self, kind, dtype, count):
        """The name of the next call: `kind` (e.g. "allreduce", or "" for none), `dtype` (a string)
        and `count` elements."""
        sig = (kind, dtype, count)
        novel = sig not in self._seen
        if novel:
            # The calls changed (or this is an insertion): what failed guesses said about the
            # period no longer holds.
            if len(self._seen) >= MAX_HISTORY:
                self._seen.clear()
            self._seen.add(sig)
            self._min_period = 1
            self._patience = min(self._patience, len(self._sigs) + FIRST_PATIENCE)
        return self._next(sig, novel)

    def _next(self, sig, novel):
        if self._pattern is None:
            return self._learn(sig, novel)
        expected, name = self._pattern[self._position]
        if expected == sig:
            self._position = (self._position + 1) % len(self._pattern)
            self._run += 1
            self._inserted = None
            if self._run >= TRUSTED_PERIODS * len(self._pattern):
                self._min_period = 1  # what failed before says nothing about what comes next
            if self._run_before_break is not None and self._run > self._run_before_break:
                self._run_before_break = None  # the break was an insertion: the period stands
            return name
        if self._run_before_break is None:
            # The first break: an insertion until the calls after it say otherwise.
            self._run_before_break, self._run, self._inserted, self._novel_break = self._run, 0, 1, novel
            return self._new(sig)
        if self._inserted is not None and self._inserted < MAX_INSERTED:
            self._inserted += 1
            self._novel_break = self._novel_break or novel
            return self._new(sig)
        # The period does not go on after its break: it was wrong, or the calls changed. A run of
        # r calls that followed period P and then broke it bounds the true period (_raise_min_period);
        # the run before the break counts only if no new signature came with the break.
        period = len(self._pattern)
        self._raise_min_period(max(self._run, 0 if self._novel_break else self._run_before_break) - period + 2)
        self._patience = min(MAX_HISTORY, max(FIRST_PATIENCE, 2 * (max(self._run, period, self._min_period) + 2)))
        self._pattern = None
        self._run_before_break = self._inserted = None
        return self._learn(sig, novel)

    def _new(self, sig):
        kind, dtype, count = sig
        head = f"{self._prefix}.{kind}" if kind else self._prefix
        return f"{head}.{dtype}.{count}.{next(self._fresh)}"

    def _raise_min_period(self, bound):
        # A stretch of r calls with period P that then breaks it is no part of a stream of period
        # T unless T >= r - P + 2 (Fine and Wilf: a stretch of length >= T + P - 1 with periods T
        # and P has period gcd(T, P), and so would not break). Every later guess is at least this.
        self._min_period = min(MAX_HISTORY // 2, max(self._min_period, bound))

    def _learn(self, sig, novel):
        n = len(self._sigs)
        if n >= self._patience:
            # No lock for a while: the calls from the anchor may start with one-off calls (an
            # all-reduce before training, a change). Go on from a periodic stretch at the end.
            self._patience = min(MAX_HISTORY, 2 * self._patience)
            self._unstick()
            if self._pattern is not None:
                return self._next(sig, novel)
        c = len(self._sigs)
        self._sigs.append(sig)
        period = self._extend()
        previous, self._period = self._period, period
        if c > 0 and previous < c and period > previous:
            # The guess `previous` is refuted: calls under it shared names with earlier calls. Give
            # every call so far a new name (the shared ones are never used again), repeating with
            # the new period where there is one.
            self._names = self._renamed(self._sigs[:c], period)
        name = self._names[c - period] if period <= c else self._new(sig)
        self._names.append(name)
        self._rest = self._add(self._rest, self._sigs[0], sig) if c > 0 else 0
        if c > 1 and period > c and self._rest == self._sigs[0][2] and _repeats_from(self._sigs, 1) is False:
            # The anchor all-reduced as many elements as the calls after it together, and nothing
            # repeated, not even from the call after it: DDP's first iteration (one bucket of all
            # its parameters; torch then rebuilds its buckets). The anchor will not come back:
            # learn from the call after it (the names stay: nothing repeated, so none is shared).
            self._start(1, rename=False)
        self._lock_if_repeated()
        return name

    def _extend(self):
        """Extends the prefix function to the last signature; returns the history's smallest period
        of at least _min_period (its length if there is none)."""
        sigs, border = self._sigs, self._border
        c = len(sigs) - 1
        b = border[c - 1] if c > 0 else 0
        while b > 0 and sigs[b] != sigs[c]:
            b = border[b - 1]
        if c > 0 and sigs[b] == sigs[c]:
            b += 1
        border.append(b)
        # Every period of sigs[:c + 1] is c + 1 - (one of its borders, longest first).
        while b > 0 and c + 1 - b < self._min_period:
            b = border[b - 1]
        return c + 1 - b

    def _unstick(self):
        """Learning from the end of the history: from the stretch at its end with the smallest
        period q >= _min_period that repeats there at least twice and covers half the history
        (Z-function of the reversed history); else from its last half when it is full."""
        r = self._sigs[::-1]
        n = len(r)
        z = [0] * n
        left = right = 0
        best = None
        for q in range(1, n):
            if q < right:
                z[q] = min(right - q, z[q - left])
            while q + z[q] < n and r[z[q]] == r[q + z[q]]:
                z[q] += 1
            if q + z[q] > right:
                left, right = q, q + z[q]
            if best is None and q >= self._min_period and z[q] >= q and 2 * (q + z[q]) >= n:
                best = q
        if best is not None:
            self._start(n - (best + z[best]))
        elif n >= MAX_HISTORY:
            self._start(n // 2)

    def _start(self, drop, rename=True):
        """Learning again from the history without its first `drop` calls. With `rename`, the calls
        kept get new names (some may have shared theirs with calls dropped); where they repeat,
        later ones take their period's names."""
        sigs, names = self._sigs[drop:], self._names[drop:]
        self._sigs, self._names, self._border, self._period, self._rest = [], [], [], 0, 0
        for i, s in enumerate(sigs):
            self._sigs.append(s)
            self._period = self._extend()
            if i > 0:
                self._rest = self._add(self._rest, sigs[0], s)
        self._names = self._renamed(sigs, self._period) if rename else names
        self._lock_if_repeated()

    @staticmethod
    def _add(rest, anchor, sig):
        """The elements of the calls after the anchor of its kind and dtype (None after another)."""
        return None if rest is None or sig[:2] != anchor[:2] else rest + sig[2]

    def _renamed(self, sigs, period):
        """Names for calls `sigs` of period `period`: fresh for the first period, repeating after."""
        names = [self._new(s) for s in sigs[:period]]
        for i in range(period, len(sigs)):
            names.append(names[i - period])
        return names

    def _lock_if_repeated(self):
        period, n = self._period, len(self._sigs)
        if n and n >= 2 * period:
            # A full period has repeated: lock it. The next call is position n % period.
            self._pattern = list(zip(self._sigs[:period], self._names[:period]))
            self._position = n % period
            self._run = n
            self._run_before_break = self._inserted = None
            self._sigs, self._names, self._border, self._period = [], [], [], 0

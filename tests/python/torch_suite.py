"""torch's own distributed test suite (DistributedTest._DistTestBase, torch_suite_cases.py) on the
dynamiq backend, against gloo on the same harness (issue 43). ctest runs it as torch_suite_one_node
and torch_suite_two_nodes (label torch_suite); by hand:

    PYTHONPATH=build/python DYNAMIQD=build/bin/dynamiqd /usr/bin/python3 tests/python/torch_suite.py --nodes 1

Three runs of the CPU selection ("not cuda and not gpu and not nccl"), two ranks:
  gloo     BACKEND=gloo: the baseline.
  dynamiq  BACKEND=dynamiq against --nodes dynamiqd with codec none (every result must be exact):
           the tests torch selects for a backend it does not know.
  as-gloo  the same daemons, with the tests torch selects for gloo (object collectives,
           monitored_barrier, timeouts, DDP, sparse all-reduce), each run on the dynamiq backend.
Fails when a test fails in either dynamiq run but not with gloo, or when a test that passes with
gloo is skipped in the as-gloo run, and does so again when run once more on its own (one that
passes then is printed as FLAKY, with its first failure). Prints the table of docs/python.md and
what was skipped, why.
"""

import argparse
import collections
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import Cluster  # noqa: E402 -- the daemons of the Python tests

SELECTION = "not cuda and not gpu and not nccl"
WORLD_SIZE = 2
# torch's harness kills a test's ranks after this many seconds (its default is 300).
TEST_SECONDS = 60
# Bound on one run of the selection (about a minute each here).
RUN_SECONDS = 420
# The stand-in for expecttest (torch's harness imports it; Debian does not package it).
EXPECTTEST = "ACCEPT = False\n\nimport unittest\n\n\nclass TestCase(unittest.TestCase):\n    pass\n"


Result = collections.namedtuple("Result", "outcome message details")
NOT_RUN = Result("not run", "", "")


def run_suite(label, env, work, keyword=None, tests=()):
    """Runs torch_suite_cases.py under pytest (the -k `keyword` selection, or the named `tests`):
    {test name: Result}, outcome "passed", "failed" or "skipped"; a failure's details hold its
    traceback and captured output (torch's harness logs a timed-out rank's stack there)."""
    xml = os.path.join(work, f"{label}.xml")
    log = os.path.join(work, f"{label}.log")
    cases = os.path.join(HERE, "torch_suite_cases.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-o", "junit_logging=all",
           f"--junitxml={xml}"]
    cmd += ["-k", keyword, cases] if keyword else [f"{cases}::TestDistBackendWithFork::{t}" for t in tests]
    # file:// as in torch's CI: test_barrier_timeout_global re-initializes with it (else skipped).
    env = dict(env, INIT_METHOD=f"file://{os.path.join(work, label)}.init")
    started = time.monotonic()
    with open(log, "w") as out:
        # Its own session: on a timeout the forked ranks go with it.
        proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=RUN_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            sys.exit(f"torch_suite: the {label} run did not finish within {RUN_SECONDS} s; its log:\n{tail(log)}")
    if not os.path.exists(xml):
        sys.exit(f"torch_suite: the {label} run wrote no results (exit {proc.returncode}):\n{tail(log)}")
    results = {}
    for case in ET.parse(xml).iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            output = "".join(e.text or "" for e in case if e.tag in ("system-out", "system-err"))
            message = bad.get("message") or ""  # the exception: every failed rank's traceback
            results[case.get("name")] = Result("failed", message, f"{message}\n{output.strip()}")
        elif skipped is not None:
            results[case.get("name")] = Result("skipped", skipped.get("message") or "", "")
        else:
            results[case.get("name")] = Result("passed", "", "")
    if not results or any(not name.startswith("test_") for name in results):
        sys.exit(f"torch_suite: the {label} run did not collect torch's tests:\n{tail(log)}")
    print(f"torch_suite: {label}: {summary(results)} in {time.monotonic() - started:.0f} s", flush=True)
    return results


def tail(path, chars=6000):
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def summary(results):
    counts = collections.Counter(r.outcome for r in results.values())
    return f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"


def reason(message):
    """A skip message without the "pytest skip" decoration."""
    return message.split("\n")[0].strip()


def suspects(gloo, runs):
    """{run label: [test names]} that fail in a dynamiq run (or, as gloo, do not pass) while gloo
    passes or skips them."""
    out = {}
    for label, results in runs.items():
        names = [name for name, r in results.items()
                 if r.outcome == "failed" and gloo.get(name, NOT_RUN).outcome != "failed"]
        if label == "as-gloo":
            names += [name for name, r in gloo.items()
                      if r.outcome == "passed" and results.get(name, NOT_RUN).outcome not in ("passed", "failed")]
        if names:
            out[label] = sorted(set(names))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="dynamiqd daemons forming a cluster")
    parser.add_argument("-k", dest="keyword", default="", help="further restricts the selection (pytest -k)")
    parser.add_argument("--keep", help="directory to keep the logs and junit files in")
    args = parser.parse_args()
    keyword = SELECTION if not args.keyword else f"({SELECTION}) and ({args.keyword})"
    work = tempfile.mkdtemp(prefix="dqts-")  # short: Unix socket paths are limited to 108 bytes
    base = dict(os.environ, WORLD_SIZE=str(WORLD_SIZE), DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(TEST_SECONDS),
                DQ_TIMEOUT_SECONDS=str(TEST_SECONDS), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                PYTHONDONTWRITEBYTECODE="1")
    base.pop("DQ_SUITE_SELECT_AS", None)
    # The runs start in `work`: a relative PYTHONPATH (build/python) must not change meaning.
    paths = [os.path.abspath(p) for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    if importlib.util.find_spec("expecttest") is None:
        stubs = os.path.join(work, "stubs")
        os.mkdir(stubs)
        with open(os.path.join(stubs, "expecttest.py"), "w") as f:
            f.write(EXPECTTEST)
        paths.insert(0, stubs)
    base["PYTHONPATH"] = os.pathsep.join(paths)
    cluster = None
    try:
        gloo = run_suite("gloo", dict(base, BACKEND="gloo"), work, keyword)
        cluster = Cluster(work, args.nodes, {"codec": "none"})
        # Every float SUM/AVG all-reduce to the daemon, however small (the default keeps those
        # below 1024 elements on Gloo: most of the suite's tensors).
        dq_env = dict(base, BACKEND="dynamiq", DQ_SUITE_SOCKETS=os.pathsep.join(cluster.sockets),
                      DQ_TORCH_EXACT_BELOW="0")
        envs = {"dynamiq": dq_env, "as-gloo": dict(dq_env, DQ_SUITE_SELECT_AS="gloo")}
        runs = {label: run_suite(label, env, work, keyword) for label, env in envs.items()}
        # A suspect is run once more on its own: what fails again is a failure; what passes then is
        # reported as flaky (a loaded machine can push a rank past the harness's 60 s), with the
        # first run's details.
        again = {label: run_suite(f"{label}-again", envs[label], work, tests=names)
                 for label, names in suspects(gloo, runs).items()}
        cluster.stop()
        with open(cluster.logs[0], errors="replace") as f:
            jobs = re.findall(r"job (\S+): incarnation \d+ started", f.read())
        daemon_logs = [tail(path, 3000) for path in cluster.logs]
    finally:
        if cluster is not None:
            cluster.stop()
        if args.keep:
            shutil.copytree(work, args.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock"))
        shutil.rmtree(work, ignore_errors=True)
    return report(args.nodes, gloo, runs, again, jobs, daemon_logs, whole=not args.keyword)


def report(nodes, gloo, runs, again, jobs, daemon_logs, whole):
    """Prints the comparison; 1 if a dynamiq run fails (twice) what gloo passes, or, for the whole
    selection, nothing passed on dynamiq or no group reached the daemon; else 0."""
    dq, as_gloo = runs["dynamiq"], runs["as-gloo"]
    groups = [j for j in jobs if "/g" in j]
    print(f"\ndynamiqd (node 0) ran {len(jobs)} jobs, {len(groups)} of them groups of new_group")
    problems, flaky = [], []
    if whole and not any(r.outcome == "passed" for r in dq.values()):
        problems.append("no test passed with BACKEND=dynamiq")
    if whole and not groups:
        problems.append("no group of new_group registered with dynamiqd")
    for label, names in suspects(gloo, runs).items():
        for name in names:
            first, second = runs[label].get(name, NOT_RUN), again[label].get(name, NOT_RUN)
            line = (f"{label}: {name} was {first.outcome} (with gloo: {gloo.get(name, NOT_RUN).outcome}), "
                    f"on its own then {second.outcome}: {first.message[:300]}")
            (flaky if second.outcome == "passed" else problems).append(line)
            for r in (first, second):
                if r.details:
                    print(f"\n--- {label}: {name} ---\n{r.details[-4000:]}")
    print(f"\n| backend ({nodes} node{'s' if nodes > 1 else ''}, {WORLD_SIZE} ranks) | passed | failed | skipped |")
    print("|---|---|---|---|")
    for label, results in (("gloo", gloo), ("dynamiq", dq), ("dynamiq, gloo's selection", as_gloo)):
        counts = collections.Counter(r.outcome for r in results.values())
        print(f"| {label} | {counts['passed']} | {counts['failed']} | {counts['skipped']} |")
    # What torch skips for dynamiq but runs for gloo, and how those tests fare on dynamiq.
    by_reason = collections.defaultdict(list)
    for name, r in sorted(dq.items()):
        if r.outcome == "skipped" and gloo.get(name, NOT_RUN).outcome != "skipped":
            by_reason[reason(r.message)].append(f"{name} ({as_gloo.get(name, NOT_RUN).outcome} as gloo)")
    print("\nSkipped with dynamiq, run with gloo (torch's reason: tests):")
    for why, names in sorted(by_reason.items()):
        print(f"  {why}: {', '.join(names)}")
    failures = sorted(name for name, r in gloo.items() if r.outcome == "failed")
    print(f"\nFailing with gloo too ({len(failures)}): {', '.join(failures)}")
    if flaky:
        print("\nFLAKY (failed, then passed on its own):\n  " + "\n  ".join(flaky))
    if problems:
        for i, log in enumerate(daemon_logs):
            print(f"\n--- dynamiqd node {i} (its log's end) ---\n{log}")
        print("\nFAILED:\n  " + "\n  ".join(problems))
        return 1
    print("\nOK: no test fails with dynamiq that passes with gloo")
    return 0


if __name__ == "__main__":
    sys.exit(main())

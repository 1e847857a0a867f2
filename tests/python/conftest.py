"""Fixtures for the Python tests: real dynamiqd daemons on loopback, and worker processes.

The tests run under ctest (tests/CMakeLists.txt) with PYTHONPATH=<build>/python and
DYNAMIQD=<build>/bin/dynamiqd; by hand:
    PYTHONPATH=build/python DYNAMIQD=build/bin/dynamiqd /usr/bin/python3 -m pytest -q tests/python
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# Every blocking step of a test is bounded by these.
DAEMON_START_SECONDS = 30
WORKER_SECONDS = 90
# Client deadline inside tests: a bug makes a test fail within this, not hang for 300 s.
CLIENT_TIMEOUT_SECONDS = 30


def dynamiqd_binary():
    for candidate in (os.environ.get("DYNAMIQD"), os.path.join(REPO, "build", "bin", "dynamiqd")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("no dynamiqd: set DYNAMIQD (ctest does) or build build/bin/dynamiqd")


_flags_cache = {}


def dynamiqd_supports(flag):
    binary = dynamiqd_binary()
    if binary not in _flags_cache:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
        _flags_cache[binary] = out.stdout + out.stderr
    return f"--{flag}" in _flags_cache[binary]


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def socket_accepts(path):
    """Whether a Unix socket at `path` accepts connections (exists and is listening)."""
    with socket.socket(socket.AF_UNIX) as s:
        return s.connect_ex(path) == 0


def wait_for_port(proc, port, log_path, timeout=DAEMON_START_SECONDS):
    """Waits until a daemon accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None:
            pytest.fail(f"dynamiqd exited with {proc.returncode}:\n{Cluster.log(log_path)}")
        if time.monotonic() > deadline:
            pytest.fail(f"dynamiqd not listening on port {port} within {timeout} s")
        time.sleep(0.02)


class Cluster:
    """`nodes` dynamiqd processes on loopback: worker sockets in a private temp dir, free ports."""

    def __init__(self, directory, nodes, flags):
        self.directory = directory
        self.procs, self.sockets, self.logs = [], [], []
        try:
            ports = free_ports(nodes)
            self.controls = [f"127.0.0.1:{p}" for p in ports]
            extra = [f"--{k}={v}" for k, v in flags.items()]
            if dynamiqd_supports("metrics_port"):
                extra.append("--metrics_port=0")
            for node in range(nodes):
                sock = os.path.join(directory, f"n{node}.sock")
                cmd = [dynamiqd_binary(), f"--num_nodes={nodes}", f"--node_rank={node}",
                       f"--listen={self.controls[node]}", f"--worker_socket={sock}", "--timeout=60"] + extra
                if node > 0:
                    # Node 0 serves the rendezvous; a node that finds nobody listening gives up.
                    wait_for_port(self.procs[0], ports[0], self.logs[0])
                    cmd.append(f"--coordinator={self.controls[0]}")
                path = os.path.join(directory, f"dynamiqd{node}.log")
                with open(path, "w") as out:
                    self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
                self.sockets.append(sock)
                self.logs.append(path)
            deadline = time.monotonic() + DAEMON_START_SECONDS
            # The socket file appears at bind(), a moment before listen(): wait until it accepts.
            while not all(socket_accepts(s) for s in self.sockets):
                for p, path in zip(self.procs, self.logs):
                    if p.poll() is not None:
                        pytest.fail(f"dynamiqd exited with {p.returncode}:\n{self.log(path)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"dynamiqd not ready within {DAEMON_START_SECONDS} s:\n{self.log(self.logs[0])}")
                time.sleep(0.02)
        except BaseException:
            self.stop()  # no daemon outlives a failed start
            raise

    @property
    def socket(self):
        return self.sockets[0]

    @property
    def control(self):
        return self.controls[0]

    @staticmethod
    def log(path):
        with open(path) as f:
            return f.read()[-4000:]

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def workdir():
    # Short paths: Unix socket paths are limited to 108 bytes, pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="dqpy-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def node():
    """One single-node dynamiqd (codec none) shared by a module's tests; each test uses its own
    job id. Stopping a daemon takes a second or more, so tests share one where they can."""
    d = tempfile.mkdtemp(prefix="dqpy-")
    c = Cluster(d, 1, {"codec": "none"})
    yield c
    c.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cluster(workdir):
    """cluster(nodes=1, **dynamiqd_flags) starts daemons that are stopped (SIGTERM) at teardown."""
    started = []

    def start(nodes=1, **flags):
        c = Cluster(workdir, nodes, flags)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def run_workers(script_args, envs, timeout=WORKER_SECONDS):
    """Runs one `python3 <script_args>` per env dict (added to the environment) concurrently and
    returns their (returncode, output) pairs; kills them all past `timeout` seconds."""
    procs = []
    for env in envs:
        full = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                    DQ_TIMEOUT_SECONDS=str(CLIENT_TIMEOUT_SECONDS), **env)
        procs.append(subprocess.Popen([sys.executable, *script_args], env=full, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            pytest.fail(f"worker did not finish within {timeout} s:\n{out[-4000:]}")
        results.append((p.returncode, out))
    return results


def worker_envs(cluster, nodes, per_node, job):
    """torchrun-style and DQ_* variables for nodes x per_node workers of `job`."""
    envs = []
    for rank in range(nodes * per_node):
        node, local = divmod(rank, per_node)
        envs.append(dict(RANK=str(rank), WORLD_SIZE=str(nodes * per_node), DQ_SOCKET=cluster.sockets[node],
                         DQ_JOB=job, DQ_LOCAL_RANK=str(local), DQ_LOCAL_WORLD_SIZE=str(per_node)))
    return envs


def load_json(path):
    with open(path) as f:
        return json.load(f)

#!/usr/bin/python3
"""Live test of the dashboards and alert rules against a real Prometheus scraping real daemons.

Starts two dynamiqd nodes on loopback (free ports, --error_sample_rate=1), one
dynamiq-example-worker per node all-reducing continuously, and Debian's prometheus with
deploy/prometheus/prometheus.yml (targets and intervals replaced: 1 s scrapes) and alerts.yml.
Halfway it changes the job's compression with dynamiqctl (so the config-epoch annotation has
something to mark) and makes each daemon reject a request (so the fault panels see a rejection).
Then it evaluates, through Prometheus' HTTP API, every dashboard variable query, every query of
every panel (instant or range, as the panel asks, with the variables substituted the way Grafana
does: "All" and an explicit multi-value selection) and every annotation query, and fails if one
errors, returns no series or only NaN/Inf. It also checks that every rule of alerts.yml evaluated
without error. Everything it starts is killed on exit; the whole run is bounded (< 90 s).

Exit status: 0 pass, 1 fail, 77 skipped (no prometheus binary, or a dynamiqd without metrics).
"""
import argparse
import glob
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import yaml

SKIP = 77
DEADLINE_S = 85
SCRAPE_S = 1  # Prometheus scrape and rule evaluation interval here
JOB = "dash"
# Grafana's values for a 1 s scrape interval (datasource timeInterval) and a short time range:
# $__interval is clamped to the scrape interval, $__rate_interval = max(interval + scrape, 4 scrapes).
INTERVAL_S = SCRAPE_S
RATE_INTERVAL_S = max(INTERVAL_S + SCRAPE_S, 4 * SCRAPE_S)


class Failure(Exception):
    pass


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Everything the test starts; stop() kills it all."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.procs = []  # (name, Popen, log path)

    def start(self, name, cmd, env=None):
        log = os.path.join(self.tmp, f"{name}.log")
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                 preexec_fn=lambda: os.nice(5))
        self.procs.append((name, p, log))
        return p

    def stop(self):
        for _, p, _ in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 5
        for _, p, _ in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def dump_logs(self, lines=15):
        for name, p, log in self.procs:
            with open(log, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
            print(f"--- {name} (exit {p.poll()}) {log}\n" + "\n".join(tail))


class Prom:
    def __init__(self, url):
        self.url = url

    def get(self, path, **params):
        q = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise Failure(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr, t=None):
        return self.get("/api/v1/query", query=expr, **({"time": t} if t else {}))

    def query_range(self, expr, start, end, step):
        return self.get("/api/v1/query_range", query=expr, start=start, end=end, step=step)


def wait_for(what, cond, timeout):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            if cond():
                return
        except (Failure, OSError) as e:  # not up yet
            last = e
        time.sleep(0.25)
    raise Failure(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last})" if last else ""))


# Grafana's escaping of multi-value variables in Prometheus regex matchers
# (prometheusSpecialRegexEscape): regex metacharacters get a double backslash inside the string.
def grafana_regex_value(values):
    esc = [re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), v.replace("\\", "\\\\\\\\")) for v in values]
    return esc[0] if len(esc) == 1 else "(" + "|".join(esc) + ")"


def substitute(expr, variables, range_s):
    out = expr
    builtins = {"$__rate_interval": f"{RATE_INTERVAL_S}s", "$__interval": f"{INTERVAL_S}s",
                "$__range": f"{int(range_s)}s"}
    for k in sorted(builtins, key=len, reverse=True):
        out = out.replace(k, builtins[k])
    for name, value in variables.items():
        out = re.sub(r"\$\{" + name + r"\}|\$" + name + r"\b", lambda _: value, out)
    if "$" in out.replace("$1", ""):
        raise Failure(f"unsubstituted variable left in {out!r}")
    return out


def label_values(prom, definition, variables, start, end):
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition.strip())
    if not m:
        raise Failure(f"unsupported variable query {definition!r}")
    selector = substitute(m.group(1), variables, end - start)
    return prom.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": selector, "start": start, "end": end})


def finite_values(data):
    vals = []
    for series in data.get("result", []):
        if "value" in series:
            vals.append(series["value"][1])
        vals += [v for _, v in series.get("values", [])]
    return [v for v in vals if math.isfinite(float(v))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--bin", required=True, help="directory with dynamiqd, dynamiqctl, dynamiq-example-worker")
    ap.add_argument("--prometheus", default=shutil.which("prometheus") or "/usr/bin/prometheus")
    a = ap.parse_args()
    a.repo = os.path.abspath(a.repo)
    t_start = time.monotonic()

    def remaining():
        return DEADLINE_S - (time.monotonic() - t_start)

    dynamiqd, ctl, worker = (os.path.join(a.bin, n) for n in ("dynamiqd", "dynamiqctl", "dynamiq-example-worker"))
    if not os.access(a.prometheus, os.X_OK):
        print(f"no prometheus binary at {a.prometheus} (Debian package prometheus); skipping")
        return SKIP
    helptext = subprocess.run([dynamiqd, "--help"], capture_output=True, text=True, timeout=10)
    if "--metrics_port" not in helptext.stdout + helptext.stderr:
        print("this dynamiqd has no --metrics_port; skipping")
        return SKIP

    # Unix socket paths must stay under 108 bytes: fall back to /tmp when $TMPDIR is deep.
    tmp = tempfile.mkdtemp(prefix="dq-dash-", dir="/tmp" if len(tempfile.gettempdir()) > 60 else None)
    cluster = Cluster(tmp)

    def on_alarm(*_):
        raise Failure(f"the test ran past its {DEADLINE_S}s deadline")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(DEADLINE_S)
    try:
        return run(a, tmp, cluster, dynamiqd, ctl, worker, remaining)
    except Failure as e:
        print(f"FAIL: {e}")
        cluster.dump_logs()
        return 1
    finally:
        signal.alarm(0)
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def run(a, tmp, cluster, dynamiqd, ctl, worker, remaining):
    # --- two dynamiqd nodes -------------------------------------------------------------------
    listen = [free_port(), free_port()]
    metrics = [free_port(), free_port()]
    sockets = [os.path.join(tmp, f"node{n}.sock") for n in (0, 1)]
    for n in (0, 1):
        cmd = [dynamiqd, "--num_nodes=2", f"--node_rank={n}", f"--listen=127.0.0.1:{listen[n]}",
               f"--worker_socket={sockets[n]}", f"--metrics_port={metrics[n]}", "--error_sample_rate=1",
               "--codec=dynamiq", "--bits=5", "--timeout=30"]
        if n:
            cmd.append(f"--coordinator=127.0.0.1:{listen[0]}")
        cluster.start(f"dynamiqd{n}", cmd)
        if n == 0:  # node 1 exits at once if the coordinator does not answer yet
            wait_for("node 0's --listen port", lambda: socket.create_connection(
                ("127.0.0.1", listen[0]), timeout=1).close() is None, 20)
    for n in (0, 1):
        wait_for(f"node {n}'s /metrics", lambda n=n: urllib.request.urlopen(
            f"http://127.0.0.1:{metrics[n]}/metrics", timeout=2).status == 200 and os.path.exists(sockets[n]), 20)

    # --- prometheus with the shipped config ---------------------------------------------------
    with open(os.path.join(a.repo, "deploy/prometheus/prometheus.yml")) as f:
        cfg = yaml.safe_load(f)
    cfg["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
    cfg["rule_files"] = [os.path.join(a.repo, "deploy/prometheus", r) for r in cfg.get("rule_files", [])]
    cfg.pop("alerting", None)
    jobs = [j for j in cfg["scrape_configs"] if j["job_name"] == "dynamiq"]
    if len(jobs) != 1:
        raise Failure("prometheus.yml has no scrape job 'dynamiq'")
    jobs[0].pop("file_sd_configs", None)
    jobs[0]["scrape_timeout"] = f"{SCRAPE_S}s"
    jobs[0]["static_configs"] = [{"targets": [f"127.0.0.1:{p}" for p in metrics]}]
    cfg["scrape_configs"] = jobs
    cfg_path = os.path.join(tmp, "prometheus.yml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    prom_port = free_port()
    cluster.start("prometheus", [a.prometheus, f"--config.file={cfg_path}", f"--storage.tsdb.path={tmp}/tsdb",
                                 f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"])
    prom = Prom(f"http://127.0.0.1:{prom_port}")
    wait_for("prometheus to be ready",
             lambda: urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2).status == 200, 20)

    # --- load: one worker per node, all-reducing until the end ---------------------------------
    t_load = time.time()
    for n in (0, 1):
        env = dict(os.environ, DQ_SOCKET=sockets[n], DQ_JOB=JOB, DQ_LOCAL_RANK="0", DQ_LOCAL_WORLD_SIZE="1")
        cluster.start(f"worker{n}", [worker, "--elements=65536", "--iterations=1000000", "--buckets=4"],
                      env=env)
    wait_for("collectives of both nodes in prometheus", lambda: len(prom.query(
        f'sum by (instance) (dynamiq_collectives_total{{job="{JOB}", result="ok"}}) > 0')["result"]) == 2, 20)

    # Rejected requests: an operator asks each node about a job that does not exist (NOT_FOUND).
    for n in (0, 1):
        r = subprocess.run([ctl, f"--daemon=127.0.0.1:{listen[n]}", "flight-recorder", "--job=no-such-job"],
                           capture_output=True, text=True, timeout=10)
        if r.returncode == 0 or "NOT_FOUND" not in r.stderr:
            raise Failure(f"dynamiqctl flight-recorder of a missing job: rc={r.returncode} {r.stderr.strip()}")

    # The annotation marks an epoch that rose since 30 s earlier: the job must have existed 30 s
    # before the change. Then change to 4 bits.
    while time.time() < t_load + 31:
        time.sleep(0.25)
    r = subprocess.run([ctl, f"--daemon=127.0.0.1:{listen[1]}", "set-compression", f"--job={JOB}",
                        "--codec=dynamiq", "--bits=4"], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise Failure(f"dynamiqctl set-compression: {r.stdout}{r.stderr}")
    wait_for("the new config epoch and 4-bit error samples on both nodes", lambda: len(prom.query(
        f'dynamiq_config_epoch{{job="{JOB}"}} >= 1 and on (instance) '
        f'dynamiq_compression_error_vnmse_count{{job="{JOB}", bits="4"}}')["result"]) == 2, 15)
    # Then put the job under an error budget (dash spelling of the flags): the budget gauges on both
    # nodes, the controller's state and events on node 0.
    r = subprocess.run([ctl, f"--daemon=127.0.0.1:{listen[1]}", "set-compression", f"--job={JOB}",
                        "--target-vnmse=0.01", "--sample-rate=0.5"], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise Failure(f"dynamiqctl set-compression --target-vnmse: {r.stdout}{r.stderr}")
    wait_for("the error budget on both nodes and the controller on node 0", lambda: len(prom.query(
        f'dynamiq_error_budget_target_vnmse{{job="{JOB}"}}')["result"]) == 2 and len(prom.query(
        f'dynamiq_error_budget_events_total{{job="{JOB}", kind="policy"}} > 0 and on (instance) '
        f'dynamiq_error_budget_measured_vnmse{{job="{JOB}"}}')["result"]) == 1, 15)
    wait_for("rejections in prometheus", lambda: len(prom.query(
        'dynamiq_rejected_requests_total{reason="not_found"} > 0')["result"]) == 2, 10)
    time.sleep(RATE_INTERVAL_S + 1)  # a full rate window under the new configuration

    # --- every variable, panel and annotation query --------------------------------------------
    end = time.time()
    start = t_load
    range_s = end - start
    checked = 0
    problems = []
    dashboards = sorted(glob.glob(os.path.join(a.repo, "dashboards/*.json")))
    if not dashboards:
        raise Failure("no dashboards")
    for path in dashboards:
        with open(path) as f:
            d = json.load(f)
        name = os.path.basename(path)
        variables = {v["name"]: v for v in d["templating"]["list"]}
        # "All" first, then the explicit selection of every value the variable query returns.
        selections = [{"datasource": "prometheus"}, {"datasource": "prometheus"}]
        for var in ("instance", "job"):  # job's query depends on $instance
            for sel in selections:
                vals = label_values(prom, variables[var]["definition"], sel, start, end)
                if not vals:
                    problems.append(f"{name}: variable {var} has no values")
                    vals = ["none"]
                if var == "instance" and sorted(vals) != sorted(f"127.0.0.1:{p}" for p in metrics):
                    problems.append(f"{name}: variable instance = {vals}, want both daemons")
                if var == "job" and JOB not in vals:
                    problems.append(f"{name}: variable job = {vals}, want {JOB}")
                checked += 1
            selections[0][var] = variables[var].get("allValue") or ".*"
            selections[1][var] = grafana_regex_value(vals)
        for sel in selections:
            for p in d["panels"]:
                for t in p.get("targets", []):
                    where = f"{name} {p['title']!r} {t['refId']} ({'all' if sel is selections[0] else 'each'})"
                    expr = substitute(t["expr"], sel, range_s)
                    try:
                        if t.get("instant"):
                            data = prom.query(expr, end)
                        else:
                            data = prom.query_range(expr, start, end, INTERVAL_S)
                    except Failure as e:
                        problems.append(f"{where}: {e}")
                        continue
                    checked += 1
                    if not data["result"]:
                        problems.append(f"{where}: no series for {expr}")
                    elif not finite_values(data):
                        problems.append(f"{where}: only NaN/Inf for {expr}")
                    elif p["type"] == "stat" and sel is selections[0]:
                        print(f"  {name} {p['title']}: {float(finite_values(data)[-1]):.4g}")
            for ann in d["annotations"]["list"]:
                if ann.get("builtIn"):
                    continue
                step = int(ann.get("step", "60s").rstrip("s"))
                expr = substitute(ann["expr"], sel, range_s)
                try:
                    data = prom.query_range(expr, end - 2 * step, end, step)
                except Failure as e:
                    problems.append(f"{name} annotation {ann['name']!r}: {e}")
                    continue
                checked += 1
                if not data["result"]:
                    problems.append(f"{name} annotation {ann['name']!r}: no mark for the compression change: {expr}")

    # --- alert and recording rules evaluated cleanly --------------------------------------------
    rules = [r for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]]
    if not rules:
        problems.append("prometheus loaded no rules")
    for r in rules:
        if r.get("health") != "ok" or r.get("lastError"):
            problems.append(f"rule {r['name']}: health {r.get('health')} {r.get('lastError', '')}")

    print(f"{checked} queries evaluated against {len(dashboards)} dashboards; {len(rules)} rules checked; "
          f"load ran {range_s:.0f}s; {remaining():.0f}s of the deadline left")
    if problems:
        raise Failure(f"{len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())

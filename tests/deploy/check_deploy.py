#!/usr/bin/python3
"""Static checks of deploy/ and dashboards/: one ctest per subcommand.

  check_deploy.py --repo DIR prometheus                       promtool check config/rules, test rules, runbooks
  check_deploy.py --repo DIR systemd --dynamiqd BIN           systemd-analyze verify + security, flags exist
  check_deploy.py --repo DIR yaml                             every YAML file parses
  check_deploy.py --repo DIR kubernetes --dynamiqd BIN        manifests consistent; kubectl kustomize
  check_deploy.py --repo DIR k8s-start                        dynamiqd-k8s-start's rank discovery
  check_deploy.py --repo DIR dashboards                       Grafana JSON lint, provisioning
  check_deploy.py --repo DIR docker --binary BIN...           Dockerfile stages; runtime packages cover ldd

Exit status: 0 pass, 1 fail, 77 skipped (a tool is missing).
"""
import argparse
import glob
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import yaml

SKIP = 77
errors = []


def fail(msg):
    errors.append(msg)
    print(f"FAIL: {msg}")


def run(cmd, **kw):
    kw.setdefault("timeout", 120)
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def load_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def dynamiqd_flags(dynamiqd):
    """Flag names dynamiqd accepts, from its --help (its own flags) plus abseil's built-ins."""
    out = run([dynamiqd, "--help"])
    flags = set(re.findall(r"^\s+--(\w+) \(", out.stdout + out.stderr, re.M))
    if not flags:
        fail(f"no flags found in `{dynamiqd} --help`")
    return flags | {"flagfile", "fromenv", "tryfromenv", "undefok"}


def check_flags(where, words, known):
    for w in words:
        m = re.match(r"--([A-Za-z_][\w]*)(=|$)", w)
        if m and m.group(1) not in known:
            fail(f"{where}: dynamiqd has no flag --{m.group(1)}")


# --- prometheus ----------------------------------------------------------------------------------


def github_anchors(markdown):
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            text = re.sub(r"[`*_]", "", m.group(1)).strip().lower()
            text = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            anchors.add(text)
    return anchors


def cmd_prometheus(a):
    if not shutil.which("promtool"):
        print("promtool not found (Debian package prometheus); skipping")
        return SKIP
    d = os.path.join(a.repo, "deploy/prometheus")
    for cmd in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                ["test", "rules", "alerts_test.yml"]):
        r = run(["promtool"] + cmd, cwd=d)
        print(f"promtool {' '.join(cmd)}: rc={r.returncode}\n{r.stdout}{r.stderr}")
        if r.returncode != 0:
            fail(f"promtool {' '.join(cmd)} exited {r.returncode}")
    # Every alert is documented: summary, description, and a runbook_url naming a real section.
    with open(os.path.join(a.repo, "docs/operations.md")) as f:
        anchors = github_anchors(f.read())
    alerts = 0
    for group in load_yaml_docs(os.path.join(d, "alerts.yml"))[0]["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            alerts += 1
            name, ann = rule["alert"], rule.get("annotations", {})
            for key in ("summary", "description", "runbook_url"):
                if not ann.get(key):
                    fail(f"alert {name} has no {key}")
            url = ann.get("runbook_url", "")
            if not url.startswith("docs/operations.md#"):
                fail(f"alert {name}: runbook_url {url!r} does not point into docs/operations.md")
            elif url.split("#", 1)[1] not in anchors:
                fail(f"alert {name}: docs/operations.md has no section #{url.split('#', 1)[1]}")
            if rule.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
                fail(f"alert {name}: severity must be critical, warning or info")
    print(f"{alerts} alerts documented")
    # The scrape job keeps dynamiq's `job` label (dashboards and alerts read it).
    cfg = load_yaml_docs(os.path.join(d, "prometheus.yml"))[0]
    jobs = [j for j in cfg.get("scrape_configs", []) if j.get("job_name") == "dynamiq"]
    if len(jobs) != 1 or jobs[0].get("honor_labels") is not True:
        fail("prometheus.yml needs exactly one scrape job 'dynamiq' with honor_labels: true")
    return 0


# --- systemd -------------------------------------------------------------------------------------


def cmd_systemd(a):
    unit = os.path.join(a.repo, "deploy/systemd/dynamiqd.service")
    with open(unit) as f:
        text = f.read()
    exec_start = re.findall(r"^ExecStart=(\S+)(.*)$", text, re.M)
    if len(exec_start) != 1:
        fail("dynamiqd.service needs exactly one ExecStart=")
        return 1
    binary, rest = exec_start[0]
    known = dynamiqd_flags(a.dynamiqd)
    check_flags("dynamiqd.service ExecStart", rest.split(), known)
    # The options file: DYNAMIQD_OPTS assignments, commented examples included.
    with open(os.path.join(a.repo, "deploy/systemd/dynamiqd.default")) as f:
        opts = re.findall(r'^#?DYNAMIQD_OPTS="([^"]*)"', f.read(), re.M)
    if not opts:
        fail("dynamiqd.default sets no DYNAMIQD_OPTS")
    for o in opts:
        check_flags("dynamiqd.default", o.split(), known)
    if "$DYNAMIQD_OPTS" not in rest or "EnvironmentFile=-/etc/default/dynamiqd" not in text:
        fail("ExecStart must take $DYNAMIQD_OPTS from EnvironmentFile=-/etc/default/dynamiqd")
    sock = re.search(r"--worker_socket=(\S+)", rest)
    rt = re.search(r"^RuntimeDirectory=(\S+)$", text, re.M)
    if not sock or not rt or os.path.dirname(sock.group(1)) != f"/run/{rt.group(1)}":
        fail("--worker_socket must live in the unit's RuntimeDirectory under /run")
    for forbidden in ("PrivateDevices=yes", "RemoveIPC=yes", "DynamicUser=yes", "PrivateIPC=yes"):
        if re.search(rf"^{forbidden}$", text, re.M):
            fail(f"{forbidden} breaks sharing /dev/shm or the daemon's uid with workers")

    if not shutil.which("systemd-analyze"):
        print("systemd-analyze not found; skipping the verification")
        return SKIP
    # systemd-analyze verify needs ExecStart= to exist: verify a copy whose ExecStart runs the
    # dynamiqd just built instead of the installed path; everything else is the file as shipped.
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "dynamiqd.service")
        with open(copy, "w") as f:
            f.write(text.replace(f"ExecStart={binary}", f"ExecStart={os.path.abspath(a.dynamiqd)}", 1))
        r = run(["systemd-analyze", "verify", "--man=no", copy])
        out = (r.stdout + r.stderr).strip()
        print(f"systemd-analyze verify: rc={r.returncode} {out}")
        # Unknown or misspelt settings are only warnings ("Unknown key ..., ignoring"): any message
        # about our unit fails.
        if r.returncode != 0 or "dynamiqd.service" in out:
            fail(f"systemd-analyze verify: {out}")
        r = run(["systemd-analyze", "security", "--offline=true", copy])
        m = re.search(r"Overall exposure level for dynamiqd.service: ([\d.]+)", r.stdout + r.stderr)
        if m is None:
            print(f"systemd-analyze security --offline unavailable: {r.stderr.strip()}")
        else:
            print(f"systemd-analyze security: exposure {m.group(1)}")
            if float(m.group(1)) > 3.0:
                fail(f"sandbox exposure {m.group(1)} > 3.0 (systemd-analyze security)")
    return 0


# --- yaml ----------------------------------------------------------------------------------------


def yaml_files(repo):
    files = []
    for pattern in ("deploy/**/*.yml", "deploy/**/*.yaml", "dashboards/**/*.yml", "dashboards/**/*.yaml"):
        files += glob.glob(os.path.join(repo, pattern), recursive=True)
    return sorted(set(files))


def cmd_yaml(a):
    files = yaml_files(a.repo)
    if len(files) < 10:
        fail(f"expected the deploy/ and dashboards/ YAML files, found {len(files)}")
    for path in files:
        try:
            docs = load_yaml_docs(path)
            if not docs:
                fail(f"{path}: empty")
        except yaml.YAMLError as e:
            fail(f"{path}: {e}")
    print(f"{len(files)} YAML files parse")
    return 0


# --- kubernetes ----------------------------------------------------------------------------------

NAMESPACED = {"ConfigMap", "Service", "DaemonSet", "ServiceMonitor", "Job"}


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def env_value(container, name):
    for e in container.get("env", []):
        if e["name"] == name:
            return e
    return None


def cmd_kubernetes(a):
    kdir = os.path.join(a.repo, "deploy/kubernetes")
    objs = {}
    for path in sorted(glob.glob(os.path.join(kdir, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        for d in load_yaml_docs(path):
            where = f"{os.path.basename(path)}: {d.get('kind')}"
            for key in ("apiVersion", "kind", "metadata"):
                if key not in d:
                    fail(f"{where}: no {key}")
            md = d.get("metadata", {})
            if not md.get("name"):
                fail(f"{where}: no metadata.name")
            if d.get("kind") in NAMESPACED and md.get("namespace") != "dynamiq":
                fail(f"{where}: metadata.namespace must be dynamiq")
            objs[(d.get("kind"), md.get("name"))] = (os.path.basename(path), d)
    kust = load_yaml_docs(os.path.join(kdir, "kustomization.yaml"))[0]
    for res in kust.get("resources", []):
        if not os.path.exists(os.path.join(kdir, res)):
            fail(f"kustomization.yaml: resource {res} does not exist")

    def get(kind, name):
        if (kind, name) not in objs:
            fail(f"no {kind} {name}")
            return None
        return objs[(kind, name)][1]

    ds, cm = get("DaemonSet", "dynamiqd"), get("ConfigMap", "dynamiqd-config")
    svc, sm = get("Service", "dynamiqd-peers"), get("ServiceMonitor", "dynamiqd")
    worker = get("Job", "dynamiq-example-worker")
    if not (ds and cm and svc and sm and worker):
        return 1
    known = dynamiqd_flags(a.dynamiqd)

    # DaemonSet.
    spec = ds["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    pod = spec["template"]["spec"]
    if not selects(spec["selector"]["matchLabels"], pod_labels):
        fail("DaemonSet selector does not match its pod template labels")
    if pod.get("hostIPC") is not True:
        fail("DaemonSet needs hostIPC: true (workers share /dev/shm)")
    if pod.get("hostNetwork") and pod.get("dnsPolicy") != "ClusterFirstWithHostNet":
        fail("hostNetwork pods need dnsPolicy: ClusterFirstWithHostNet to resolve the peers Service")
    containers = pod["containers"]
    if len(containers) != 1:
        fail("DaemonSet should run one container")
    c = containers[0]
    for key in ("name", "image"):
        if not c.get(key):
            fail(f"DaemonSet container has no {key}")
    args = c.get("args", [])
    check_flags("DaemonSet args", args, known)
    flags = dict(re.match(r"--(\w+)=(.*)", x).groups() for x in args if re.match(r"--(\w+)=(.*)", x))
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    listen_port = int(env_value(c, "DYNAMIQ_PORT")["value"]) if env_value(c, "DYNAMIQ_PORT") else 7070
    metrics_port = int(flags.get("metrics_port", "9400"))
    if ports.get("grpc") != listen_port or ports.get("metrics") != metrics_port:
        fail(f"container ports {ports} do not match --listen port {listen_port} / --metrics_port {metrics_port}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        if not p or p.get("grpc", {}).get("port") != listen_port:
            fail(f"{probe} must be a grpc probe on the --listen port {listen_port}")
    ann = spec["template"]["metadata"].get("annotations", {})
    if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != str(metrics_port):
        fail(f"prometheus.io annotations {ann} do not match --metrics_port {metrics_port}")
    if env_value(c, "POD_IP") is None or env_value(c, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] != "status.podIP":
        fail("POD_IP must come from status.podIP")
    nn = env_value(c, "DYNAMIQ_NUM_NODES")
    ref = (nn or {}).get("valueFrom", {}).get("configMapKeyRef", {})
    if ref.get("name") != cm["metadata"]["name"] or ref.get("key") not in cm["data"]:
        fail("DYNAMIQ_NUM_NODES must come from a key of the ConfigMap")
    peers = (env_value(c, "DYNAMIQ_PEERS_SERVICE") or {}).get("value", "")
    if peers.split(".")[:2] != [svc["metadata"]["name"], svc["metadata"]["namespace"]]:
        fail(f"DYNAMIQ_PEERS_SERVICE {peers!r} is not <service>.<namespace> of the headless Service")
    # Volumes: every mount has a volume; the socket directory and the flag file are where args say.
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {}
    for cont in pod.get("initContainers", []) + containers:
        for m in cont.get("volumeMounts", []):
            if m["name"] not in vols:
                fail(f"container {cont['name']} mounts unknown volume {m['name']}")
            if cont is c:
                mounts[m["mountPath"]] = vols.get(m["name"], {})
    sock_dir = os.path.dirname(flags.get("worker_socket", ""))
    host_sock = mounts.get(sock_dir, {}).get("hostPath", {}).get("path")
    if not host_sock:
        fail(f"--worker_socket directory {sock_dir!r} is not a hostPath mount")
    ff = flags.get("flagfile", "")
    cmv = mounts.get(os.path.dirname(ff), {}).get("configMap", {})
    items = {i["path"]: i["key"] for i in cmv.get("items", [])}
    key = items.get(os.path.basename(ff))
    if cmv.get("name") != cm["metadata"]["name"] or key not in cm["data"]:
        fail(f"--flagfile {ff!r} is not a key of the ConfigMap mounted there")
    else:
        lines = [x.strip() for x in cm["data"][key].splitlines() if x.strip() and not x.startswith("#")]
        check_flags("ConfigMap dynamiqd.flags", lines, known)
        managed = {"num_nodes", "node_rank", "listen", "coordinator", "worker_socket", "metrics_port"}
        for x in lines:
            if re.match(r"--(\w+)", x) and re.match(r"--(\w+)", x).group(1) in managed:
                fail(f"ConfigMap dynamiqd.flags sets {x}, which the DaemonSet manages")
    uid = pod.get("securityContext", {}).get("runAsUser")

    # Headless Service: selects the pods, publishes not-ready ones, exposes both ports.
    sspec = svc["spec"]
    if sspec.get("clusterIP") != "None" or sspec.get("publishNotReadyAddresses") is not True:
        fail("peers Service must be headless (clusterIP: None) with publishNotReadyAddresses: true")
    if not selects(sspec.get("selector"), pod_labels):
        fail("peers Service selector does not match the DaemonSet pods")
    sports = {p["name"]: p for p in sspec.get("ports", [])}
    if sports.get("metrics", {}).get("port") != metrics_port or sports.get("grpc", {}).get("port") != listen_port:
        fail(f"Service ports {sports} do not match {listen_port}/{metrics_port}")

    # ServiceMonitor: selects the Service, scrapes its metrics port, keeps dynamiq's job label and
    # names the scrape job "dynamiq" (as deploy/prometheus/prometheus.yml and alerts.yml expect).
    smspec = sm["spec"]
    if not selects(smspec["selector"]["matchLabels"], svc["metadata"]["labels"]):
        fail("ServiceMonitor selector does not match the Service")
    if svc["metadata"]["labels"].get(smspec.get("jobLabel")) != "dynamiq":
        fail("ServiceMonitor jobLabel must name a Service label whose value is 'dynamiq'")
    eps = smspec.get("endpoints", [])
    if not eps or eps[0].get("port") not in sports or eps[0].get("honorLabels") is not True:
        fail("ServiceMonitor endpoint must scrape a Service port with honorLabels: true")

    # Example worker: what a training pod needs to reach the daemon.
    wpod = worker["spec"]["template"]["spec"]
    if wpod.get("hostIPC") is not True:
        fail("example worker needs hostIPC: true")
    if wpod.get("securityContext", {}).get("runAsUser") != uid:
        fail(f"example worker must run as the daemon's uid {uid}")
    wc = wpod["containers"][0]
    sock = (env_value(wc, "DQ_SOCKET") or {}).get("value", "")
    wvols = {v["name"]: v for v in wpod.get("volumes", [])}
    wmount = [m for m in wc.get("volumeMounts", []) if m["mountPath"] == os.path.dirname(sock)]
    if (os.path.basename(sock) != os.path.basename(flags.get("worker_socket", "")) or not wmount or
            wvols.get(wmount[0]["name"], {}).get("hostPath", {}).get("path") != host_sock):
        fail(f"example worker's DQ_SOCKET {sock!r} is not the daemon's socket on hostPath {host_sock}")
    if worker["spec"].get("completions") != int(cm["data"]["num-nodes"]):
        fail("example worker completions must equal the ConfigMap's num-nodes (one worker per node)")

    if shutil.which("kubectl"):
        r = run(["kubectl", "kustomize", kdir], timeout=60)
        if r.returncode != 0:
            fail(f"kubectl kustomize: {r.stderr.strip()}")
        else:
            kinds = sorted(d["kind"] for d in yaml.safe_load_all(r.stdout) if d)
            print(f"kubectl kustomize: {kinds}")
            for d in yaml.safe_load_all(r.stdout):
                if d and d["kind"] == "DaemonSet":
                    images = [x["image"] for x in d["spec"]["template"]["spec"]["containers"]]
                    if any(":" not in i for i in images):
                        fail(f"kustomize left untagged images {images}")
    else:
        print("kubectl not found: kustomize build not checked")
    return 0


# --- k8s-start -----------------------------------------------------------------------------------


def cmd_k8s_start(a):
    script = os.path.join(a.repo, "deploy/docker/dynamiqd-k8s-start")
    with tempfile.TemporaryDirectory() as tmp:
        fake = os.path.join(tmp, "dynamiqd")
        with open(fake, "w") as f:
            f.write('#!/bin/sh\nprintf "%s\\n" "$@"\n')
        os.chmod(fake, 0o755)

        def start(env, *args):
            e = {"PATH": os.environ["PATH"], "DYNAMIQD": fake, "DYNAMIQ_DISCOVERY_TIMEOUT": "3"}
            e.update(env)
            return run([script, *args], env=e, timeout=30)

        # Ranks follow the numeric order of addresses (127.0.0.9 before 127.0.0.10), rank 0 is the
        # coordinator, and discovered flags come after (so override) the arguments. Loopback
        # addresses, with the coordinator's port listening, so the wait for it returns at once.
        peers = ["127.0.0.10", "127.0.0.9", "127.0.1.2", "127.0.0.200"]
        order = sorted(peers, key=ipaddress.IPv4Address)
        with socket.socket() as coordinator:
            coordinator.bind((order[0], 0))
            coordinator.listen(8)
            port = str(coordinator.getsockname()[1])
            for ip in peers:
                r = start({"POD_IP": ip, "DYNAMIQ_NUM_NODES": "4", "DYNAMIQ_PEERS": ",".join(peers),
                           "DYNAMIQ_PORT": port}, "--codec=none")
                want = ["--codec=none", "--num_nodes=4", f"--node_rank={order.index(ip)}", f"--listen={ip}:{port}"]
                if order.index(ip) > 0:
                    want.append(f"--coordinator={order[0]}:{port}")
                if r.returncode != 0 or r.stdout.split() != want or "not reachable" in r.stderr:
                    fail(f"POD_IP={ip}: got rc={r.returncode} {r.stdout.split()} {r.stderr.strip()}, want {want}")
        # A coordinator that never answers: wait until the deadline, then start anyway.
        t0 = time.monotonic()
        r = start({"POD_IP": "127.0.0.3", "DYNAMIQ_NUM_NODES": "2", "DYNAMIQ_PEERS": "127.0.0.2,127.0.0.3",
                   "DYNAMIQ_PORT": port})
        waited = time.monotonic() - t0
        if r.returncode != 0 or "not reachable after 3s" not in r.stderr or not 2.5 < waited < 15:
            fail(f"unreachable coordinator: rc={r.returncode} after {waited:.1f}s {r.stderr.strip()!r}")
        # Through DNS (getent): localhost is a one-node cluster.
        r = start({"POD_IP": "127.0.0.1", "DYNAMIQ_NUM_NODES": "1", "DYNAMIQ_PEERS_SERVICE": "localhost",
                   "DYNAMIQ_PORT": "7171"})
        if r.returncode != 0 or r.stdout.split() != ["--num_nodes=1", "--node_rank=0", "--listen=127.0.0.1:7171"]:
            fail(f"DNS discovery of localhost: rc={r.returncode} {r.stdout.split()} {r.stderr.strip()}")
        # Failures are loud: too few peers (after the timeout), too many, not among them, bad count.
        cases = [
            ({"POD_IP": "127.0.0.1", "DYNAMIQ_NUM_NODES": "2", "DYNAMIQ_PEERS_SERVICE": "localhost"}, "1 of 2 peers"),
            ({"POD_IP": "10.0.0.1", "DYNAMIQ_NUM_NODES": "1", "DYNAMIQ_PEERS": "10.0.0.1,10.0.0.2"},
             "but DYNAMIQ_NUM_NODES is 1"),
            ({"POD_IP": "10.0.0.3", "DYNAMIQ_NUM_NODES": "2", "DYNAMIQ_PEERS": "10.0.0.1,10.0.0.2"},
             "not among the peers"),
            ({"POD_IP": "10.0.0.1", "DYNAMIQ_NUM_NODES": "0", "DYNAMIQ_PEERS": "10.0.0.1"}, "positive integer"),
            ({"DYNAMIQ_NUM_NODES": "1", "DYNAMIQ_PEERS": "10.0.0.1"}, "POD_IP is not set"),
        ]
        for env, msg in cases:
            r = start(env)
            if r.returncode == 0 or msg not in r.stderr or r.stdout:
                fail(f"{env}: want failure '{msg}', got rc={r.returncode} {r.stdout!r} {r.stderr.strip()!r}")
    return 0


# --- dashboards ----------------------------------------------------------------------------------

DS = {"type": "prometheus", "uid": "${datasource}"}


def defined_metrics(repo):
    """dynamiq_* families the daemon registers (server/metrics.cc), with histogram series names."""
    path = os.path.join(repo, "server/metrics.cc")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        src = f.read()
    names = set()
    for m in re.finditer(r'Build(Counter|Gauge|Histogram)\(\)\s*\.Name\("(dynamiq_\w+)"\)', src):
        names.add(m.group(2))
        if m.group(1) == "Histogram":
            names |= {m.group(2) + s for s in ("_bucket", "_sum", "_count")}
    return names


def check_metric_names(where, expr, known):
    if known is None:
        return
    for name in re.findall(r"\b(dynamiq_\w+)", expr):
        if name not in known:
            fail(f"{where}: {name} is not a metric dynamiqd defines (server/metrics.cc)")


def overlaps(a, b):
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and
            a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def cmd_dashboards(a):
    known = defined_metrics(a.repo)
    if known is None:
        print("server/metrics.cc not found: metric names not checked")
    files = sorted(glob.glob(os.path.join(a.repo, "dashboards/*.json")))
    if not files:
        fail("no dashboards/*.json")
    uids = set()
    for path in files:
        name = os.path.basename(path)
        with open(path) as f:
            d = json.load(f)
        if d.get("uid") in uids or not d.get("uid"):
            fail(f"{name}: missing or duplicate uid {d.get('uid')!r}")
        uids.add(d.get("uid"))
        if not isinstance(d.get("schemaVersion"), int) or d["schemaVersion"] < 36:
            fail(f"{name}: schemaVersion {d.get('schemaVersion')} is older than Grafana 9")
        if d.get("id") is not None:
            fail(f"{name}: id must be null (Grafana assigns it)")
        variables = {v["name"]: v for v in d.get("templating", {}).get("list", [])}
        dsv = variables.get("datasource", {})
        if dsv.get("type") != "datasource" or dsv.get("query") != "prometheus":
            fail(f"{name}: needs a datasource variable of type datasource, query prometheus")
        for var in ("job", "instance"):
            v = variables.get(var)
            if not v or v.get("type") != "query" or v.get("datasource") != DS or "label_values" not in v.get("definition", ""):
                fail(f"{name}: needs a query variable {var} over ${{datasource}}")
            else:
                check_metric_names(f"{name} variable {var}", v["definition"], known)
        ids, boxes, exprs = set(), [], 0
        for p in d.get("panels", []):
            title = f"{name} panel {p.get('id')} {p.get('title')!r}"
            if p.get("id") in ids or not isinstance(p.get("id"), int):
                fail(f"{title}: missing or duplicate id")
            ids.add(p.get("id"))
            g = p.get("gridPos", {})
            if not all(isinstance(g.get(k), int) for k in "xywh") or g["x"] + g["w"] > 24:
                fail(f"{title}: bad gridPos {g}")
            else:
                for other_title, og in boxes:
                    if overlaps(g, og):
                        fail(f"{title} overlaps {other_title}")
                boxes.append((title, g))
            if p.get("type") == "row":
                if p.get("panels"):
                    fail(f"{title}: collapsed rows hide panels; keep them expanded")
                continue
            if p.get("datasource") != DS:
                fail(f"{title}: datasource must be {DS}, got {p.get('datasource')}")
            if not p.get("title") or not p.get("description"):
                fail(f"{title}: needs a title and a description")
            targets = p.get("targets") or []
            if not targets:
                fail(f"{title}: no targets")
            refs = set()
            for t in targets:
                if t.get("refId") in refs or not t.get("refId"):
                    fail(f"{title}: missing or duplicate refId {t.get('refId')}")
                refs.add(t.get("refId"))
                if t.get("datasource") != DS:
                    fail(f"{title} target {t.get('refId')}: datasource must be {DS}")
                if not (t.get("expr") or "").strip():
                    fail(f"{title} target {t.get('refId')}: no expr")
                    continue
                exprs += 1
                check_metric_names(title, t["expr"], known)
                if "[" in t["expr"] and not re.search(r"\[\$__(rate_interval|range|interval)\]", t["expr"]):
                    fail(f"{title}: range selectors should use $__rate_interval, $__interval or $__range")
        for ann in d.get("annotations", {}).get("list", []):
            if ann.get("builtIn"):
                continue
            if ann.get("datasource") != DS or not ann.get("expr"):
                fail(f"{name} annotation {ann.get('name')!r}: needs datasource {DS} and an expr")
            else:
                check_metric_names(f"{name} annotation", ann["expr"], known)
        print(f"{name}: {len(ids)} panels, {exprs} queries")
    # The JSON files are dashboards/generate.py's output, not hand edits that drifted from it.
    gen = os.path.join(a.repo, "dashboards/generate.py")
    with tempfile.TemporaryDirectory() as tmp:
        r = run([sys.executable, gen, tmp])
        if r.returncode != 0:
            fail(f"dashboards/generate.py failed: {r.stderr.strip()}")
        produced = sorted(os.listdir(tmp))
        if produced != [os.path.basename(f) for f in files]:
            fail(f"dashboards/generate.py writes {produced}, dashboards/ has {[os.path.basename(f) for f in files]}")
        for f in produced:
            with open(os.path.join(tmp, f)) as x, open(os.path.join(a.repo, "dashboards", f)) as y:
                if x.read() != y.read():
                    fail(f"dashboards/{f} differs from what dashboards/generate.py writes: run it")
    # Provisioning: Grafana loads the dashboards' directory and a Prometheus datasource.
    prov = os.path.join(a.repo, "dashboards/provisioning")
    dsfiles = glob.glob(os.path.join(prov, "datasources/*.yaml"))
    dbfiles = glob.glob(os.path.join(prov, "dashboards/*.yaml"))
    if not dsfiles or not dbfiles:
        fail("dashboards/provisioning needs datasources/*.yaml and dashboards/*.yaml")
    for path in dsfiles:
        doc = load_yaml_docs(path)[0]
        if doc.get("apiVersion") != 1 or not any(x.get("type") == "prometheus" and x.get("url")
                                                 for x in doc.get("datasources", [])):
            fail(f"{path}: needs apiVersion 1 and a prometheus datasource with a url")
    for path in dbfiles:
        doc = load_yaml_docs(path)[0]
        provs = doc.get("providers", [])
        if doc.get("apiVersion") != 1 or not provs or any(
                x.get("type") != "file" or not x.get("options", {}).get("path") for x in provs):
            fail(f"{path}: needs apiVersion 1 and file providers with options.path")
    # The alert rules read the same metric names.
    for group in load_yaml_docs(os.path.join(a.repo, "deploy/prometheus/alerts.yml"))[0]["groups"]:
        for rule in group["rules"]:
            check_metric_names(f"alerts.yml {rule.get('alert') or rule.get('record')}", rule["expr"], known)
    return 0


# --- docker --------------------------------------------------------------------------------------


def parse_dockerfile(path):
    with open(path) as f:
        text = re.sub(r"\\\n", " ", f.read())
    stages = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        if op.upper() == "FROM":
            stages.append({"from": rest.split()[0], "name": rest.split()[-1] if " AS " in rest.upper() else None,
                           "lines": []})
        elif stages:
            stages[-1]["lines"].append((op.upper(), rest.strip()))
    return stages


def installed_packages():
    """{package: (depends, essential)} of every installed package, from one dpkg-query."""
    r = run(["dpkg-query", "-W", "-f=${Package}\t${Status}\t${Essential}\t${Depends}, ${Pre-Depends}\n"])
    pkgs = {}
    for line in r.stdout.splitlines():
        name, status, essential, depends = line.split("\t")
        if status.endswith(" installed"):
            alternatives = [[re.sub(r"\(.*?\)|:\w+", "", alt).strip() for alt in dep.split("|")]
                            for dep in depends.split(",") if dep.strip()]
            pkgs[name] = (alternatives, essential == "yes")
    return pkgs


def package_closure(roots, installed):
    """Installed packages reachable from `roots` through Depends/Pre-Depends (for each dependency,
    the first alternative that is installed)."""
    seen, todo = set(), list(roots)
    while todo:
        p = todo.pop()
        if p in seen or p not in installed:
            continue
        seen.add(p)
        for alts in installed[p][0]:
            todo += [alt for alt in alts if alt in installed][:1]
    return seen


def owning_packages(libs):
    """{library path as ldd printed it: Debian package} for the paths dpkg knows (merged /usr:
    dpkg may know /lib/x/libfoo.so.1 where ldd printed /usr/lib/x/..., or a symlink's target)."""
    candidates = {}
    for lib in libs:
        for c in {lib, os.path.realpath(lib)}:
            for v in (c, c[len("/usr"):] if c.startswith("/usr/lib/") else "/usr" + c):
                candidates.setdefault(v, lib)
    r = run(["dpkg-query", "-S", *candidates])
    owners = {}
    for line in r.stdout.splitlines():
        pkg, _, path = line.partition(": ")
        if path in candidates:
            owners.setdefault(candidates[path], pkg.split(",")[0].split(":")[0].strip())
    return owners


def cmd_docker(a):
    path = os.path.join(a.repo, "deploy/docker/Dockerfile")
    stages = parse_dockerfile(path)
    if len(stages) != 2:
        fail(f"Dockerfile: expected a build and a runtime stage, found {len(stages)}")
        return 1
    build, runtime = stages
    for s in stages:
        if s["from"] != "debian:bookworm":
            fail(f"Dockerfile: stage FROM {s['from']}, want debian:bookworm")
    build_runs = " ".join(r for op, r in build["lines"] if op == "RUN")
    for script in ("scripts/install-deps", "scripts/build"):
        if script not in build_runs:
            fail(f"Dockerfile build stage does not run {script}")
    m = re.search(r"BUILD_DIR=(\S+)", build_runs)
    bindir = (m.group(1) if m else "build") + "/bin/"
    # Runtime packages: every `apt-get install` argument that is not an option.
    pkgs = set()
    for op, r in runtime["lines"]:
        if op == "RUN":
            for cmd in r.split("&&"):
                words = cmd.split()
                if words[:2] == ["apt-get", "install"]:
                    pkgs |= {w for w in words[2:] if not w.startswith("-")}
    copied = set()
    for op, r in runtime["lines"]:
        if op == "COPY":
            words = r.split()
            if words[0] == f"--from={build['name']}":
                for src in words[1:-1]:
                    if not src.startswith(bindir):
                        fail(f"Dockerfile copies {src}, not from the build directory {bindir}")
                    copied.add(os.path.basename(src))
            else:
                for src in words[:-1]:
                    if not os.path.exists(os.path.join(a.repo, src)):
                        fail(f"Dockerfile copies {src}, which does not exist")
                    copied.add(os.path.basename(src))
    entry = [json.loads(r) for op, r in runtime["lines"] if op == "ENTRYPOINT"]
    if not entry or os.path.basename(entry[0][0]) not in copied:
        fail(f"Dockerfile ENTRYPOINT {entry} is not a copied binary")
    for b in a.binary:
        if os.path.basename(b) not in copied:
            fail(f"Dockerfile does not copy {os.path.basename(b)} into the runtime image")
    if not shutil.which("dpkg-query") or not shutil.which("ldd"):
        print("dpkg-query or ldd missing: runtime libraries not checked")
        return SKIP
    installed = installed_packages()
    missing = sorted(p for p in pkgs if p not in installed)
    if missing:
        fail(f"runtime packages not installed here (misspelt?): {missing}")
    # debian:bookworm holds the Essential packages and what they depend on; apt-get install adds the
    # listed packages and their dependencies. Every library the binaries load must come from those.
    base = {p for p, (_, essential) in installed.items() if essential}
    cpu_image = "DQ_ENABLE_CUDA=OFF" in build_runs
    available = package_closure(base | pkgs, installed)
    for b in a.binary:
        r = run(["ldd", b])
        if r.returncode != 0:
            fail(f"ldd {b}: {r.stderr.strip()}")
            continue
        if "not found" in r.stdout:
            fail(f"ldd {b}: unresolved libraries\n{r.stdout}")
        libs = re.findall(r"=> (/\S+)", r.stdout)
        if cpu_image:
            # The image is built with DQ_ENABLE_CUDA=OFF: a binary built here with CUDA (GPU nodes,
            # --device=cuda) loads the CUDA runtime and NCCL, which that build does not link.
            gpu = [lib for lib in libs if re.match(r"lib(cudart|nccl|cuda)\.so", os.path.basename(lib))]
            if gpu:
                print(f"{os.path.basename(b)}: not checked (the CPU image does not link them): "
                      f"{', '.join(os.path.basename(lib) for lib in gpu)}")
            libs = [lib for lib in libs if lib not in gpu]
        owners = owning_packages(libs)
        before = len(errors)
        for lib in libs:
            pkg = owners.get(lib)
            if pkg is None:
                fail(f"{b}: {lib} belongs to no Debian package (built locally?)")
            elif pkg not in available:
                fail(f"{os.path.basename(b)} needs {lib} from {pkg}, which the runtime image does not install")
        if len(errors) == before:
            print(f"{os.path.basename(b)}: {len(libs)} shared libraries, all from runtime packages")
    ignore = os.path.join(a.repo, "deploy/docker/Dockerfile.dockerignore")
    if not os.path.exists(ignore) or not {".git", "build-*"} <= set(open(ignore).read().split()):
        fail("Dockerfile.dockerignore must keep .git and build-* out of the context")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--dynamiqd")
    ap.add_argument("--binary", action="append", default=[])
    ap.add_argument("check", choices=["prometheus", "systemd", "yaml", "kubernetes", "k8s-start", "dashboards",
                                      "docker"])
    a = ap.parse_args()
    if a.check in ("systemd", "kubernetes") and not a.dynamiqd:
        ap.error(f"{a.check} needs --dynamiqd")
    rc = globals()["cmd_" + a.check.replace("-", "_")](a)
    if errors:
        print(f"{len(errors)} problem(s)")
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Writes the Grafana dashboards dashboards/dynamiq-overview.json and dashboards/dynamiq-nodes.json.

The JSON files are what Grafana loads (dashboards/provisioning/); this script is their source:
change a panel here and run `dashboards/generate.py` (or `generate.py OUTPUT_DIR`). The test
deploy_dashboards_lint fails when the JSON files differ from what this script writes, and
dashboards_live evaluates every query against a real Prometheus.

Conventions: every panel and query uses the ${datasource} variable; per-job series are filtered by
$job and $instance, node-level ones by $instance; rates use $__rate_interval. `job` is dynamiq's
training job label (scraped with honor_labels: true); the scrape job is "dynamiq".
"""
import json
import os
import sys

DS = {"type": "prometheus", "uid": "${datasource}"}
J = 'job=~"$job", instance=~"$instance"'  # per-job series
I = 'instance=~"$instance"'  # node-level series
RI = "$__rate_interval"


class Builder:
    def __init__(self):
        self.panels = []
        self.next_id = 1
        self.x = 0
        self.y = 0
        self.row_h = 0

    def _id(self):
        i = self.next_id
        self.next_id += 1
        return i

    def row(self, title):
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": self._id(),
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def _place(self, w, h):
        if self.x + w > 24:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def add(self, panel, w, h):
        panel["id"] = self._id()
        panel["gridPos"] = self._place(w, h)
        panel["datasource"] = DS
        for k, t in enumerate(panel["targets"]):
            t.setdefault("refId", chr(ord("A") + k))
            t["datasource"] = DS
            t.setdefault("editorMode", "code")
        self.panels.append(panel)


def target(expr, legend="__auto", **kw):
    t = {"expr": expr, "legendFormat": legend, "range": True, "instant": False}
    t.update(kw)
    return t


def instant(expr, legend="__auto", fmt="time_series"):
    return {"expr": expr, "legendFormat": legend, "range": False, "instant": True, "format": fmt}


def timeseries(title, desc, targets, unit, *, log=False, min0=True, stack=False, bars=False, thresholds=None,
               overrides=None, calcs=("mean", "max", "lastNotNull")):
    custom = {"drawStyle": "bars" if bars else "line", "lineWidth": 1, "fillOpacity": 60 if bars else 10,
              "gradientMode": "none", "showPoints": "never", "spanNulls": False, "lineInterpolation": "linear",
              "axisPlacement": "auto", "axisLabel": "", "barAlignment": 0,
              "stacking": {"mode": "normal" if stack else "none", "group": "A"},
              "scaleDistribution": {"type": "log", "log": 10} if log else {"type": "linear"},
              "thresholdsStyle": {"mode": "line+area" if thresholds else "off"}}
    if min0 and not log:
        custom["axisSoftMin"] = 0
    defaults = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}}
    defaults["thresholds"] = thresholds or {"mode": "absolute", "steps": [{"color": "green", "value": None}]}
    return {"type": "timeseries", "title": title, "description": desc, "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                                   "calcs": list(calcs)},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title, desc, expr, unit, *, steps=None, decimals=None, graph=True):
    defaults = {"unit": unit, "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": steps or [{"color": "green", "value": None}]}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {"type": "stat", "title": title, "description": desc, "targets": [target(expr, "")],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area" if graph else "none", "justifyMode": "auto",
                        "orientation": "auto", "textMode": "auto", "wideLayout": True,
                        "showPercentChange": False}}


def table(title, desc, targets, hide=("Time",), rename=None):
    return {"type": "table", "title": title, "description": desc, "targets": targets,
            "fieldConfig": {"defaults": {"custom": {"align": "auto", "cellOptions": {"type": "auto"}}},
                            "overrides": []},
            "options": {"showHeader": True, "cellHeight": "sm",
                        "footer": {"show": False, "reducer": ["sum"], "countRows": False, "fields": ""}},
            "transformations": [{"id": "merge", "options": {}},
                                {"id": "organize", "options": {"excludeByName": {h: True for h in hide},
                                                               "renameByName": rename or {}}}]}


def variables():
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
         "regex": "", "skipUrlSync": False},
        {"name": "instance", "label": "Node", "type": "query", "datasource": DS,
         "definition": "label_values(dynamiq_build_info, instance)",
         "query": {"qryType": 1, "query": "label_values(dynamiq_build_info, instance)",
                   "refId": "PrometheusVariableQueryEditor-VariableQuery"},
         "current": {}, "hide": 0, "includeAll": True, "allValue": ".*", "multi": True, "options": [],
         "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 1},
        {"name": "job", "label": "Training job", "type": "query", "datasource": DS,
         "definition": 'label_values(dynamiq_job_compression_info{instance=~"$instance"}, job)',
         "query": {"qryType": 1, "query": 'label_values(dynamiq_job_compression_info{instance=~"$instance"}, job)',
                   "refId": "PrometheusVariableQueryEditor-VariableQuery"},
         "current": {}, "hide": 0, "includeAll": True, "allValue": ".*", "multi": True, "options": [],
         "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 1},
    ]


BUILTIN_ANNOTATION = {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
                      "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                      "type": "dashboard"}

EPOCH_ANNOTATION = {
    "datasource": DS, "enable": True, "hide": False, "iconColor": "orange", "name": "Compression changes",
    # At each 30 s step: jobs whose config epoch rose since the previous step (one mark per change,
    # whatever the scrape interval, as long as it is below 30 s).
    "expr": f'max by (job) (dynamiq_config_epoch{{{J}}}) > max by (job) (dynamiq_config_epoch{{{J}}} offset 30s)',
    "step": "30s", "titleFormat": "Compression changed", "textFormat": "job {{job}}: new compression settings (dynamiqctl set-compression)",
    "tagKeys": "job", "useValueForTime": False,
}


def dashboard(uid, title, desc, panels, annotations):
    return {
        "annotations": {"list": annotations},
        "description": desc,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{"asDropdown": False, "icon": "external link", "includeVars": True, "keepTime": True,
                   "tags": ["dynamiq"], "targetBlank": False, "title": "dynamiq", "type": "dashboards"}],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["dynamiq"],
        "templating": {"list": variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def rate(metric, sel=J):
    return f"rate({metric}{{{sel}}}[{RI}])"


def overview():
    b = Builder()
    b.row("Summary")
    b.add(stat("Daemons up", "Daemons Prometheus scraped successfully at the last scrape (`up` of the scrape job dynamiq).",
               f'sum(up{{job="dynamiq", {I}}})', "none", graph=False), 3, 4)
    b.add(stat("Cluster size", "Nodes in the cluster as configured (--num_nodes).",
               f"max(dynamiq_nodes{{{I}}})", "none", graph=False), 3, 4)
    b.add(stat("Workers", "Workers registered with the selected daemons, all selected jobs.",
               f"sum(dynamiq_connected_workers{{{J}}})", "none"), 3, 4)
    b.add(stat("Collectives/s", "Finished collectives per second, any result, summed over nodes.",
               f"sum({rate('dynamiq_collectives_total')})", "ops"), 3, 4)
    b.add(stat("Bus bandwidth", "Bus bandwidth per node (nccl-tests definition on the uncompressed size), "
               "averaged over the selected nodes and jobs, weighted by collective time.",
               f"sum({rate('dynamiq_bus_bytes_total')}) / sum({rate('dynamiq_collective_duration_seconds_sum')})",
               "Bps"), 3, 4)
    b.add(stat("Compression ratio", "Bus bytes over bytes actually sent: how much less the network carries "
               "than an uncompressed ring all-reduce.",
               f"sum({rate('dynamiq_bus_bytes_total')}) / sum({rate('dynamiq_wire_bytes_total')})", "suffix:x",
               decimals=2), 3, 4)
    b.add(stat("Mean vNMSE (range)", "Mean measured compression error of the sampled collectives over the "
               "dashboard's time range. Budget in deploy/prometheus/alerts.yml: 1e-2.",
               f"sum(increase(dynamiq_compression_error_vnmse_sum{{{J}}}[$__range])) / "
               f"sum(increase(dynamiq_compression_error_vnmse_count{{{J}}}[$__range]))", "sci",
               steps=[{"color": "green", "value": None}, {"color": "orange", "value": 0.003},
                      {"color": "red", "value": 0.01}], graph=False), 3, 4)
    b.add(stat("Failed collectives (range)", "Collectives that ended in error, timeout or abort over the time "
               "range (every node counts its own).",
               f'sum(increase(dynamiq_collectives_total{{result!="ok", {J}}}[$__range]))', "none",
               steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}], graph=False), 3, 4)

    b.row("Throughput")
    b.add(timeseries("Algorithm bandwidth per node and codec",
                     "Uncompressed bytes all-reduced per second of collective time (nccl-tests algbw): "
                     "rate(payload bytes) / rate(collective seconds). Concurrent collectives each count their "
                     "own time, so overlapping buckets lower it.",
                     [target(f"sum by (instance, codec) ({rate('dynamiq_payload_bytes_total')}) / "
                             f"sum by (instance, codec) ({rate('dynamiq_collective_duration_seconds_sum')})",
                             "{{instance}} {{codec}}")], "Bps"), 12, 8)
    b.add(timeseries("Bus bandwidth per node and codec",
                     "algbw x 2(n-1)/n: comparable with the link speed and across cluster sizes "
                     "(nccl-tests busbw).",
                     [target(f"sum by (instance, codec) ({rate('dynamiq_bus_bytes_total')}) / "
                             f"sum by (instance, codec) ({rate('dynamiq_collective_duration_seconds_sum')})",
                             "{{instance}} {{codec}}")], "Bps"), 12, 8)
    b.add(timeseries("Wire bandwidth sent per node and codec",
                     "Bytes each node actually sent for cross-node all-reduces per second of wall-clock time "
                     "(compressed, headers included): the network load dynamiq puts on each link.",
                     [target(f"sum by (instance, codec) ({rate('dynamiq_wire_bytes_total')})",
                             "{{instance}} {{codec}}")], "Bps"), 8, 8)
    b.add(timeseries("Compression ratio per job and codec",
                     "rate(bus bytes) / rate(wire bytes): bytes an uncompressed ring would send over bytes "
                     "sent. 32 bits / ratio = bits per coordinate on the wire.",
                     [target(f"sum by (job, codec) ({rate('dynamiq_bus_bytes_total')}) / "
                             f"sum by (job, codec) ({rate('dynamiq_wire_bytes_total')})", "{{job}} {{codec}}")],
                     "suffix:x"), 8, 8)
    b.add(timeseries("Wire bits per coordinate",
                     "32 x wire bytes / bus bytes: what the configured bits cost on the wire, metadata and "
                     "headers included (dynamiq --bits counts metadata; small tensors go as fp32).",
                     [target(f"32 * sum by (job, codec) ({rate('dynamiq_wire_bytes_total')}) / "
                             f"sum by (job, codec) ({rate('dynamiq_bus_bytes_total')})", "{{job}} {{codec}}")],
                     "none"), 8, 8)

    b.row("Latency")
    lat = [target(f"histogram_quantile({q}, sum by (job, le) ({rate('dynamiq_collective_duration_seconds_bucket')}))",
                  f"{{{{job}}}} p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]
    b.add(timeseries("Collective latency quantiles per job",
                     "Time from the last local worker's submission to the result in every local buffer, of "
                     "successful collectives, all selected nodes.", lat, "s", log=True), 12, 8)
    b.add(timeseries("p99 latency per node",
                     "Nodes run collectives in lockstep: the node that submits last waits least, so the node "
                     "with the lowest latency is usually the straggler the others wait for.",
                     [target(f"histogram_quantile(0.99, sum by (instance, le) "
                             f"({rate('dynamiq_collective_duration_seconds_bucket')}))", "{{instance}}")],
                     "s", log=True), 12, 8)
    b.add(timeseries("Collectives per second by result", "Finished collectives per second, by job and result.",
                     [target(f"sum by (job, result) ({rate('dynamiq_collectives_total')})", "{{job}} {{result}}")],
                     "ops"), 12, 8)
    b.add(timeseries("Mean collective size", "Uncompressed bytes per successful collective. Small collectives "
                     "are latency-bound: expect lower bandwidth.",
                     [target(f"sum by (job) ({rate('dynamiq_payload_bytes_total')}) / "
                             f"sum by (job) ({rate('dynamiq_collective_duration_seconds_count')})", "{{job}}")],
                     "bytes"), 12, 8)

    b.row("Compression error")
    heat = {"type": "heatmap", "title": "vNMSE of sampled collectives",
            "description": "Distribution of the measured vNMSE ||x^-x||^2/||x||^2 of sampled collectives "
                           "(--error_sample_rate), against an exact fp32 sum. Orange marks: compression changes.",
            "targets": [target(f"sum by (le) (increase(dynamiq_compression_error_vnmse_bucket{{{J}}}[{RI}]))",
                               "{{le}}", format="heatmap")],
            "fieldConfig": {"defaults": {"custom": {"hideFrom": {"legend": False, "tooltip": False, "viz": False},
                                                    "scaleDistribution": {"type": "linear"}}},
                            "overrides": []},
            "options": {"calculate": False, "cellGap": 1, "cellValues": {},
                        "color": {"mode": "scheme", "scheme": "Oranges", "exponent": 0.5, "fill": "dark-orange",
                                  "scale": "exponential", "steps": 64, "reverse": False},
                        "exemplars": {"color": "rgba(255,0,255,0.7)"}, "filterValues": {"le": 1e-9},
                        "legend": {"show": True}, "rowsFrame": {"layout": "le"}, "showValue": "never",
                        "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": False},
                        "yAxis": {"axisPlacement": "left", "reverse": False, "unit": "sci"}}}
    b.add(heat, 12, 9)
    q = [target(f"histogram_quantile({p}, sum by (job, codec, bits, le) "
                f"({rate('dynamiq_compression_error_vnmse_bucket')}))",
                f"{{{{job}}}} {{{{codec}}}} {{{{bits}}}}b p{int(p * 100)}") for p in (0.5, 0.9, 0.99)]
    q.append(target(f"sum by (job, codec, bits) ({rate('dynamiq_compression_error_vnmse_sum')}) / "
                    f"sum by (job, codec, bits) ({rate('dynamiq_compression_error_vnmse_count')})",
                    "{{job}} {{codec}} {{bits}}b mean"))
    budget = {"mode": "absolute", "steps": [{"color": "transparent", "value": None}, {"color": "red", "value": 0.01}]}
    b.add(timeseries("vNMSE quantiles and mean per codec",
                     "Quantiles (bucket resolution: a factor of 3.2) and the exact mean of the measured vNMSE "
                     "per job, codec and bits. Red: the alert budget (1e-2).", q, "sci", log=True,
                     thresholds=budget), 12, 9)
    b.add(timeseries("Sampled collectives per second", "Collectives whose error was measured (all nodes sample "
                     "the same ones).",
                     [target(f"sum by (job) ({rate('dynamiq_compression_error_samples_total')})", "{{job}}")],
                     "ops"), 8, 7)
    b.add(timeseries("Config epoch", "Each compression change (dynamiqctl set-compression) raises the job's "
                     "epoch by one.",
                     [target(f"max by (job) (dynamiq_config_epoch{{{J}}})", "{{job}}")], "none",
                     calcs=("lastNotNull",)), 8, 7)
    b.add(table("Active compression", "The compression each job runs now (dynamiq_job_compression_info).",
                [instant(f"max by (job, codec, bits, topology) (dynamiq_job_compression_info{{{J}}})", "",
                         "table")], hide=("Time", "Value")), 8, 7)

    b.row("Error budget")
    b.add(timeseries("Error budget: target and measured vNMSE",
                     "Jobs under an error budget (dynamiqctl set-compression --target-vnmse): the target, and the "
                     "latest error sample the controller on node 0 used. The controller raises the bits when "
                     "samples exceed the target and lowers them, slowly, when they stay well below "
                     "(docs/error_budget.md).",
                     [target(f"max by (job) (dynamiq_error_budget_target_vnmse{{{J}}})", "{{job}} target"),
                      target(f"max by (job) (dynamiq_error_budget_measured_vnmse{{{J}}})", "{{job}} measured")],
                     "sci", log=True), 8, 8)
    b.add(timeseries("Error budget: bits chosen", "The DynamiQ average bit budget in force for each job under "
                     "an error budget (the controller's choice).",
                     [target(f"max by (job) (dynamiq_error_budget_bits{{{J}}})", "{{job}}")], "none",
                     calcs=("min", "max", "lastNotNull")), 8, 8)
    b.add(timeseries("Error budget: controller events", "Per interval: raise/lower/clamp (published decisions), "
                     "rejected (an operator's change came first), policy (controller started). Saturated (1): "
                     "at max bits and still above target.",
                     [target(f"sum by (job, kind) (increase(dynamiq_error_budget_events_total{{{J}}}[{RI}]))",
                             "{{job}} {{kind}}"),
                      target(f"max by (job) (dynamiq_error_budget_saturated{{{J}}})", "{{job}} saturated")],
                     "none", bars=True), 8, 8)

    b.row("Faults")
    b.add(timeseries("Failed collectives by cause", "Failures per interval by cause: timeout (--timeout hit), "
                     "abort (a worker or the daemon gave up), peer_failure (a node or link failed), mismatch "
                     "(nodes disagree on a collective).",
                     [target(f"sum by (job, kind) (increase(dynamiq_faults_total{{{J}}}[{RI}]))",
                             "{{job}} {{kind}}")], "none", bars=True, stack=True), 8, 8)
    b.add(timeseries("Failed collectives by result", "Collectives per interval that did not end ok.",
                     [target(f'sum by (job, result) (increase(dynamiq_collectives_total{{result!="ok", {J}}}[{RI}]))',
                             "{{job}} {{result}}")], "none", bars=True, stack=True), 8, 8)
    b.add(timeseries("Rejected requests by reason", "Worker and operator requests refused per interval, by gRPC "
                     "code (invalid_argument, not_found, unauthenticated, ...).",
                     [target(f"sum by (reason) (increase(dynamiq_rejected_requests_total{{{I}}}[{RI}]))",
                             "{{reason}}")], "none", bars=True, stack=True), 8, 8)

    b.row("Stragglers")
    b.add(timeseries("Waited for, by node", "Seconds per second the nodes' parts of collectives waited for each "
                     "node (the node whose local part was ready last), summed over the nodes that waited: a node "
                     "that stands out is the one every step waits for.",
                     [target(f"sum by (job, node) (rate(dynamiq_node_wait_seconds_total{{{J}}}[{RI}]))",
                             "{{job}} node {{node}}")], "s", stack=True), 12, 8)
    b.add(timeseries("Waited for, by local worker", "Seconds per second a collective's first local worker waited "
                     "for its last one to submit, by the node (instance) and local rank of the one that was last.",
                     [target(f"sum by (instance, job, local_rank) "
                             f"(rate(dynamiq_local_wait_seconds_total{{{J}}}[{RI}]))",
                             "{{instance}} {{job}} rank {{local_rank}}")], "s", stack=True), 12, 8)

    b.row("Workers and resources")
    b.add(timeseries("Connected workers",
                     "Registered workers per node and job, and per node those whose all-reduces come through a "
                     "submission ring in shared memory (the others make one gRPC call each).",
                     [target(f"sum by (instance, job) (dynamiq_connected_workers{{{J}}})", "{{instance}} {{job}}"),
                      target(f"sum by (instance) (dynamiq_submission_rings{{{I}}})",
                             "{{instance}} through submission rings")],
                     "none", calcs=("min", "max", "lastNotNull")), 8, 7)
    b.add(timeseries("In-flight collectives", "Collectives some local worker submitted that have not finished.",
                     [target(f"sum by (instance, job) (dynamiq_inflight_collectives{{{J}}})",
                             "{{instance}} {{job}}")], "none"), 8, 7)
    b.add(timeseries("Shared memory mapped", "Shared-memory bytes the daemon allocated to its workers.",
                     [target(f"sum by (instance) (dynamiq_shm_mapped_bytes{{{I}}})", "{{instance}}")], "bytes"),
          8, 7)
    return dashboard("dynamiq-overview", "dynamiq / Overview",
                     "dynamiq compressed all-reduce: throughput, compression ratio and error, latency, faults. "
                     "See docs/operations.md.", b.panels, [BUILTIN_ANNOTATION, EPOCH_ANNOTATION])


def nodes():
    b = Builder()
    b.row("Daemons")
    b.add(table("Daemons", "One row per selected dynamiqd: rank, version, scrape status.",
                [instant(f"max by (instance, version, git_commit) (dynamiq_build_info{{{I}}})", "", "table"),
                 instant(f"max by (instance) (dynamiq_node_rank{{{I}}})", "", "table"),
                 instant(f'max by (instance) (up{{job="dynamiq", {I}}})', "", "table")],
                hide=("Time", "Value #A"), rename={"Value #B": "rank", "Value #C": "up"}), 12, 7)
    b.add(timeseries("Scrape status", "1: Prometheus scraped the daemon; 0: it could not.",
                     [target(f'max by (instance) (up{{job="dynamiq", {I}}})', "{{instance}}")], "none",
                     calcs=("min", "lastNotNull")), 12, 7)

    b.row("Network")
    b.add(timeseries("Bytes sent to each peer", "Per node, bytes per second sent to each peer node (all jobs).",
                     [target(f'sum by (instance, peer) (rate(dynamiq_peer_bytes_total{{direction="sent", {I}}}[{RI}]))',
                             "{{instance}} to {{peer}}")], "Bps"), 12, 8)
    b.add(timeseries("Bytes received from each peer", "Per node, bytes per second received from each peer node.",
                     [target(f'sum by (instance, peer) (rate(dynamiq_peer_bytes_total{{direction="received", {I}}}[{RI}]))',
                             "{{instance}} from {{peer}}")], "Bps"), 12, 8)

    b.row("Load")
    b.add(timeseries("Collectives per second per node", "Finished collectives per second, by node and result.",
                     [target(f"sum by (instance, result) ({rate('dynamiq_collectives_total')})",
                             "{{instance}} {{result}}")], "ops"), 12, 8)
    b.add(timeseries("Collective time share per node", "Seconds of collective time per second: above 1 means "
                     "collectives overlap (asynchronous buckets).",
                     [target(f"sum by (instance) ({rate('dynamiq_collective_duration_seconds_sum')})",
                             "{{instance}}")], "none"), 12, 8)
    b.add(timeseries("Connected workers per node", "Registered workers, all selected jobs.",
                     [target(f"sum by (instance) (dynamiq_connected_workers{{{J}}})", "{{instance}}")], "none",
                     calcs=("min", "max", "lastNotNull")), 8, 7)
    b.add(timeseries("In-flight collectives per node", "Submitted, not finished, all selected jobs.",
                     [target(f"sum by (instance) (dynamiq_inflight_collectives{{{J}}})", "{{instance}}")], "none"),
          8, 7)
    b.add(timeseries("Shared memory mapped per node", "Shared-memory bytes allocated to local workers.",
                     [target(f"sum by (instance) (dynamiq_shm_mapped_bytes{{{I}}})", "{{instance}}")], "bytes"),
          8, 7)

    b.row("Faults and scrapes")
    b.add(timeseries("Rejected requests per node", "Refused worker and operator requests per interval, by node "
                     "and gRPC code.",
                     [target(f"sum by (instance, reason) (increase(dynamiq_rejected_requests_total{{{I}}}[{RI}]))",
                             "{{instance}} {{reason}}")], "none", bars=True, stack=True), 8, 8)
    b.add(timeseries("Failed collectives per node", "Failures per interval by node and cause, all selected jobs.",
                     [target(f"sum by (instance, kind) (increase(dynamiq_faults_total{{{J}}}[{RI}]))",
                             "{{instance}} {{kind}}")], "none", bars=True, stack=True), 8, 8)
    b.add(timeseries("Scrape duration", "How long Prometheus takes to scrape each daemon.",
                     [target(f'max by (instance) (scrape_duration_seconds{{job="dynamiq", {I}}})', "{{instance}}")], "s"), 8, 8)
    return dashboard("dynamiq-nodes", "dynamiq / Nodes",
                     "dynamiq per-node view: daemons, peer traffic, load, shared memory, rejected requests. "
                     "See docs/operations.md.", b.panels, [BUILTIN_ANNOTATION, EPOCH_ANNOTATION])


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    for name, d in (("dynamiq-overview.json", overview()), ("dynamiq-nodes.json", nodes())):
        with open(f"{out}/{name}", "w") as f:
            json.dump(d, f, indent=2)
            f.write("\n")

#!/usr/bin/env python3
"""Checks the monitoring objects of one rendered chart against the chart's own files.

Usage: check-monitoring.py CHART RENDERED.yaml [VALUES.yaml]

The PrometheusRule is a CRD, which kubernetes-validate skips: here it must hold exactly the
alerts of files/duet-alerts.yaml less prometheusRule.disabledAlerts (whose schema must list
exactly the file's alert names), each with the file's
expression, duration and labels plus prometheusRule.ruleLabels, and its runbook link moved
to prometheusRule.runbookUrl. The dashboard's ConfigMap must carry files/duet-dashboard.json
unchanged under the sidecar's labels. Either must be rendered exactly when enabled.
Needs PyYAML (kubernetes-validate's venv has it).
"""

import json
import os
import sys

import yaml


def values(chart, extra):
    """The chart's values with the -f file's top-level blocks laid over them (one level
    deep: enough for the blocks checked here)."""
    merged = yaml.safe_load(open(os.path.join(chart, "values.yaml")))
    if extra:
        for key, block in (yaml.safe_load(open(extra)) or {}).items():
            if isinstance(block, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **block}
            else:
                merged[key] = block
    return merged


def check_rules(chart, rendered, pr):
    file = yaml.safe_load(open(os.path.join(chart, "files/duet-alerts.yaml")))
    want = [r for g in file["groups"] for r in g["rules"]]
    names = [r["alert"] for r in want]
    assert len(set(names)) == len(names), f"alert names repeat: {names}"
    schema = json.load(open(os.path.join(chart, "values.schema.json")))
    listed = schema["properties"]["prometheusRule"]["properties"]["disabledAlerts"]["items"]["enum"]
    assert listed == names, (
        f"values.schema.json's prometheusRule.disabledAlerts lists {listed}; "
        f"files/duet-alerts.yaml has {names}"
    )
    if not pr["enabled"]:
        assert not rendered, "a PrometheusRule rendered with prometheusRule.enabled false"
        return
    assert len(rendered) == 1, f"expected one PrometheusRule, found {len(rendered)}"
    doc = rendered[0]
    for key, value in pr["labels"].items():
        assert doc["metadata"]["labels"].get(key) == value, f"PrometheusRule label {key}"
    got = {r["alert"]: r for g in doc["spec"]["groups"] for r in g["rules"]}
    expected = [r for r in want if r["alert"] not in pr["disabledAlerts"]]
    assert sorted(got) == sorted(r["alert"] for r in expected), (
        f"alerts rendered {sorted(got)}, expected {sorted(r['alert'] for r in expected)}"
    )
    for rule in expected:
        out = got[rule["alert"]]
        for key in ("expr", "for"):
            assert out.get(key) == rule.get(key), f"{rule['alert']}: {key} changed"
        assert out["labels"] == {**pr["ruleLabels"], **rule["labels"]}, (
            f"{rule['alert']}: labels {out['labels']}"
        )
        assert out["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        for key in ("summary", "description"):
            assert out["annotations"][key] == rule["annotations"][key], rule["alert"]
        anchor = rule["annotations"]["runbook_url"].split("#")[1]
        base = pr["runbookUrl"] or rule["annotations"]["runbook_url"].split("#")[0]
        assert out["annotations"]["runbook_url"] == f"{base}#{anchor}", (
            f"{rule['alert']}: runbook_url {out['annotations']['runbook_url']}"
        )


def check_dashboard(chart, rendered, gd):
    if not gd["enabled"]:
        assert not rendered, "a dashboard ConfigMap rendered with grafanaDashboard.enabled false"
        return
    assert len(rendered) == 1, f"expected one dashboard ConfigMap, found {len(rendered)}"
    doc = rendered[0]
    for key, value in gd["labels"].items():
        assert doc["metadata"]["labels"].get(key) == value, f"dashboard label {key}"
    for key, value in gd["annotations"].items():
        assert doc["metadata"]["annotations"].get(key) == value, f"dashboard annotation {key}"
    file = json.load(open(os.path.join(chart, "files/duet-dashboard.json")))
    assert json.loads(doc["data"]["duet.json"]) == file, "the ConfigMap's dashboard differs"


def main():
    chart, rendered_path = sys.argv[1], sys.argv[2]
    v = values(chart, sys.argv[3] if len(sys.argv) > 3 else None)
    docs = [d for d in yaml.safe_load_all(open(rendered_path)) if d]
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    dashboards = [d for d in docs if d["kind"] == "ConfigMap" and "duet.json" in d["data"]]
    check_rules(chart, rules, v["prometheusRule"])
    check_dashboard(chart, dashboards, v["grafanaDashboard"])


if __name__ == "__main__":
    main()

"""The Grafana dashboard and the Prometheus alert rules query only metrics the server exports: a renamed metric
would otherwise blank a panel or silence an alert without any error."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml

from verispec.batching import BatchCounters
from verispec.server.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
NAME = re.compile(r"\b((?:verispec|process)_[a-z0-9_]+)")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def exported() -> set[str]:
    """Every sample name a batched server's registry exposes (counters as name_total, histograms' series)."""
    metrics = Metrics()
    metrics.watch_batch(SimpleNamespace(counters=BatchCounters(), size=0))
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + s for s in SUFFIXES)
    return names


def queried(text: str) -> set[str]:
    return set(NAME.findall(text))


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads((DEPLOY / "grafana" / "verispec-dashboard.json").read_text())
    return [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel.get("targets", [])]


def test_every_dashboard_panel_queries_exported_metrics():
    known = exported()
    queries = dashboard_queries()
    assert len(queries) >= 20
    missing = {(title, name) for title, expr in queries for name in queried(expr) if name not in known}
    assert not missing, missing


def test_the_dashboard_shows_batching_and_speculation_under_load():
    names = set().union(*(queried(expr) for _, expr in dashboard_queries()))
    assert {"verispec_batch_sequences_total", "verispec_batch_passes_total", "verispec_batch_speculating_total",
            "verispec_batch_tokens_total"} <= names


def test_every_alert_rule_queries_exported_metrics():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "verispec-alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert exprs
    known = exported()
    missing = {name for expr in exprs for name in queried(expr) if name not in known}
    assert not missing, missing


def test_the_check_catches_a_renamed_metric():
    assert "verispec_accepted_tokens_total" in exported()
    assert "verispec_acepted_tokens_total" not in exported()

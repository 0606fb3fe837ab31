"""Where the Grafana and Prometheus files live in the repository."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GRAFANA_DIR = REPO / "grafana"
DASHBOARDS_DIR = GRAFANA_DIR / "dashboards"
RULES_DIR = GRAFANA_DIR / "rules"
RULE_TESTS_DIR = RULES_DIR / "tests"
RULE_FILES = sorted(RULES_DIR.glob("*.yaml"))

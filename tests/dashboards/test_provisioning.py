"""Provisioning files: a stock Grafana gets the datasource and the boards without clicking."""

from __future__ import annotations

import yaml

from .paths import DASHBOARDS_DIR, GRAFANA_DIR

PROVISIONING = GRAFANA_DIR / "provisioning"


def _load(path):
    return yaml.safe_load(path.read_text())


def test_prometheus_datasource_is_provisioned():
    doc = _load(PROVISIONING / "datasources" / "prometheus.yaml")
    assert doc["apiVersion"] == 1
    (ds,) = [d for d in doc["datasources"] if d["type"] == "prometheus"]
    assert ds["url"].startswith("http://") and ds["access"] == "proxy" and ds["isDefault"] is True
    prometheus = _load(GRAFANA_DIR / "prometheus.yml")
    assert ds["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]


def test_dashboard_provider_points_at_the_boards_as_mounted():
    doc = _load(PROVISIONING / "dashboards" / "kvscope.yaml")
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    compose = _load(GRAFANA_DIR / "compose.yaml")
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./dashboards"] == path
    assert mounts["./provisioning"] == "/etc/grafana/provisioning"
    assert any(DASHBOARDS_DIR.glob("*.json"))


def test_compose_mounts_existing_files():
    compose = _load(GRAFANA_DIR / "compose.yaml")
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            local = volume.split(":", 1)[0]
            assert (GRAFANA_DIR / local).exists(), volume

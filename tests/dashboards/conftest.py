"""Shared fixtures of the dashboard and rules tests."""

from __future__ import annotations

import importlib.util

import pytest

from .paths import GRAFANA_DIR


@pytest.fixture(scope="session")
def build_module():
    """grafana/build.py, imported from its path (it is a script, not an installed package)."""
    pytest.importorskip("grafana_foundation_sdk", reason="pip install grafana-foundation-sdk (extra `grafana`)")
    spec = importlib.util.spec_from_file_location("kvscope_grafana_build", GRAFANA_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

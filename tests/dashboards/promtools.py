"""Finding and running the Prometheus binaries (`promtool`, `prometheus`) from tests.

Tests that need them skip, naming the fix, when they are missing. CI installs them with
`.ci/install-prometheus.sh` (Debian/Ubuntu package `prometheus`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

SEARCH_DIRS = ("/usr/bin", "/usr/local/bin")
INSTALL_HINT = "run `.ci/install-prometheus.sh` (apt-get install prometheus) or put it on PATH"


def find_binary(name: str) -> str | None:
    """Path of `name` on PATH or in /usr/bin (or /usr/local/bin), else None."""
    found = shutil.which(name)
    if found:
        return found
    for d in SEARCH_DIRS:
        candidate = Path(d) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def require_binary(name: str) -> str:
    """Path of `name`, or skip the calling test with the reason and the fix."""
    path = find_binary(name)
    if path is None:
        pytest.skip(f"`{name}` not found on PATH or in {', '.join(SEARCH_DIRS)}: {INSTALL_HINT}")
    return path


def run_promtool(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [require_binary("promtool"), *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
    )


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fast_scrape_config(job: str, target: str, rule_files) -> str:
    """Prometheus config for tests: scrape `target` and evaluate the rules every second."""
    rules = "\n".join(f"  - {p}" for p in rule_files)
    return f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
{rules}
scrape_configs:
  - job_name: {job}
    static_configs:
      - targets: ["{target}"]
"""


class PrometheusServer:
    """A throw-away `prometheus` on 127.0.0.1 with its own config and TSDB in `workdir`."""

    def __init__(self, config_text: str, workdir: Path) -> None:
        self.binary = require_binary("prometheus")
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(config_text)
        self.log_path = workdir / "prometheus.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._log = None

    def start(self, ready_timeout: float = 30) -> "PrometheusServer":
        self._log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {ready_timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if self._log is not None:
            self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

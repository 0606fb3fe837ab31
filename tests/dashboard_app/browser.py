"""Real-browser helpers: a headless `streamlit run` of the dashboard and a headless Chromium."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "dashboard" / "app.py"
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)


def find_browser() -> tuple[str, str] | None:
    """(chromium, chromedriver) paths, or None when either is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def streamlit_server(paths: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60) -> Iterator[str]:
    """Run the dashboard headless on 127.0.0.1 and a free port; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP),
           "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port", str(port),
           "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none", "--", *paths]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode}: {Path(log.name).read_text()}")
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"streamlit did not answer in {timeout} s: {Path(log.name).read_text()}")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


@contextmanager
def chromium(width: int = 1440, height: int = 2200):
    """A headless Chromium driven by selenium, with a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_browser()
    assert found is not None
    binary, driver_path = found
    profile = tempfile.mkdtemp(prefix="kvscope-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_rendered(driver, title: str, timeout: float = 30) -> None:
    """Wait until the page shows its title, the script run has finished and charts have drawn."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, timeout)
    wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, "h1"), title))

    def settled(d) -> bool:
        running = d.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidgetRunningIcon"]')
        charts = d.find_elements(By.CSS_SELECTOR, '[data-testid="stVegaLiteChart"]')
        drawn = d.find_elements(By.CSS_SELECTOR, '[data-testid="stVegaLiteChart"] canvas, '
                                                 '[data-testid="stVegaLiteChart"] svg.marks')
        return not running and len(drawn) >= len(charts)

    wait.until(settled)
    time.sleep(1.0)  # let fonts, grids and chart transitions finish before a screenshot


def page_errors(driver) -> list[str]:
    """Texts of exception and error elements on the page."""
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"], [data-testid="stAlertContentError"]')
    texts = [e.text for e in found]
    body = driver.find_element(By.TAG_NAME, "body").text
    if "Traceback (most recent call last)" in body:
        texts.append("Traceback in page text")
    return texts

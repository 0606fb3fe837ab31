"""The dashboard in a real browser: `streamlit run` headless, every page opened in headless Chromium.

Writes one screenshot per page to $KVSCOPE_SCREENSHOT_DIR, else to a pytest temporary directory,
and prints where. Needs chromium and chromedriver (`.ci/install-browser.sh`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .browser import chromium, find_browser, page_errors, streamlit_server, wait_rendered
from .conftest import MALFORMED, TWO_ROUNDS, two_engine_copy
from .vllm_traces import vllm_spans_of

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(find_browser() is None,
                       reason="chromium or chromedriver not found on PATH (run .ci/install-browser.sh)"),
]

# Replay first: a deep link as the first request of a fresh server (Streamlit runs a page file directly
# there when the entry script has a sibling folder named pages/, so ours is named views/).
PAGES = [("replay", "Replay"), ("", "Overview"), ("requests", "Requests"), ("live", "Live")]


@pytest.fixture(scope="module")
def screenshot_dir(tmp_path_factory) -> Path:
    path = Path(os.environ.get("KVSCOPE_SCREENSHOT_DIR") or tmp_path_factory.mktemp("dashboard-screenshots"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def metric_value(driver, label: str) -> str:
    from selenium.webdriver.common.by import By

    for metric in driver.find_elements(By.CSS_SELECTOR, '[data-testid="stMetric"]'):
        if metric.find_element(By.CSS_SELECTOR, '[data-testid="stMetricLabel"]').text.strip() == label:
            return metric.find_element(By.CSS_SELECTOR, '[data-testid="stMetricValue"]').text.strip()
    raise AssertionError(f"no metric {label!r}")


def table(driver, index: int) -> tuple[list[str], list[str]]:
    """(column headers, cell texts row by row) of the page's `index`th st.dataframe, from the grid's
    accessible DOM (the cells are drawn on a canvas)."""
    from selenium.webdriver.common.by import By

    grid = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stDataFrame"]')[index]
    return ([e.get_attribute("textContent") for e in grid.find_elements(By.CSS_SELECTOR, '[role="columnheader"]')],
            [e.get_attribute("textContent") for e in grid.find_elements(By.CSS_SELECTOR, '[role="gridcell"]')])


def wait_for(driver, condition, timeout: float = 30):
    """Wait until `condition(driver)` holds; elements replaced by a rerun meanwhile are retried."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    ignored = (StaleElementReferenceException, NoSuchElementException, AssertionError)
    return WebDriverWait(driver, timeout, ignored_exceptions=ignored).until(lambda d: condition(d))


def test_every_page_renders_without_errors(fake_prometheus, screenshot_dir, capsys, expected, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    shots = []
    # beside kvscope's file, a Collector file of vLLM's request spans of two odd requests (the fixture holds
    # an older vLLM's span, without latencies, of each even one)
    vllm_file = vllm_spans_of(TWO_ROUNDS, {"cmpl-r2-05": 0.25, "cmpl-r2-07": 0.5}, tmp_path / "vllm.jsonl")
    with streamlit_server([str(TWO_ROUNDS), str(vllm_file)], env={"KVSCOPE_PROMETHEUS_URL": fake_prometheus}) as base, \
            chromium() as driver:
        for path, title in PAGES:
            driver.get(f"{base}/{path}")
            wait_rendered(driver, title)
            assert page_errors(driver) == [], title
            shots.append(screenshot_dir / f"{title.lower()}.png")
            driver.save_screenshot(str(shots[-1]))

        driver.get(base)
        wait_rendered(driver, "Overview")
        assert metric_value(driver, "Requests") == "20"
        assert metric_value(driver, "Token hit rate") == f"{expected.hit_rate * 100:.1f}%"

        driver.get(f"{base}/requests")
        wait_rendered(driver, "Requests")
        search = driver.find_element(By.CSS_SELECTOR, 'input[aria-label="Search request or trace id"]')
        search.send_keys("r2-06", Keys.ENTER)
        wait_for(driver, lambda d: any("cmpl-r2-06" in h.text for h in d.find_elements(By.CSS_SELECTOR, "h3")))
        wait_rendered(driver, "Requests")
        assert metric_value(driver, "Load time") == f"{expected.load_ms['cmpl-r2-06']:.2f} ms"
        shots.append(screenshot_dir / "requests-selected.png")
        driver.save_screenshot(str(shots[-1]))
        # vLLM's latencies beside the load time; the waterfall led by vLLM's span; copies per KV group
        headers, cells = table(driver, 0)
        load_at = headers.index("load time (ms)")
        assert headers[load_at:load_at + 4] == ["load time (ms)", "queue (ms)", "TTFT (ms)", "e2e (ms)"]
        assert cells[headers.index("TTFT (ms)")] == ""  # its span (an older vLLM's) has no latencies: empty, not 0
        assert table(driver, 1)[1][0] == "vLLM request"
        headers, cells = table(driver, 2)
        assert headers == ["group", "scanned", "null skipped", "pending", "start", "workers", "blocks", "bytes",
                           "copy time (ms)", "GB/s", "slowest rank", "failed"]
        rows = [dict(zip(headers, cells[i:i + len(headers)])) for i in range(0, len(cells), len(headers))]
        assert [(r["group"], r["workers"]) for r in rows] == [("g0 sliding_window", "1"), ("g1 full_attention", "1")]
        assert all(r["pending"] == r["blocks"] for r in rows) and rows[0]["null skipped"] != "0"  # the window's nulls
        assert [float(r["GB/s"]) for r in rows] == pytest.approx([1.5, 1.5], rel=1e-3)  # the fixture's slow load
        search = driver.find_element(By.CSS_SELECTOR, 'input[aria-label="Search request or trace id"]')
        search.send_keys(Keys.CONTROL, "a")  # clear() leaves the app's value as it was
        search.send_keys("r2-05", Keys.ENTER)
        wait_for(driver, lambda d: any("cmpl-r2-05" in h.text for h in d.find_elements(By.CSS_SELECTOR, "h3")))
        wait_rendered(driver, "Requests")
        assert metric_value(driver, "Time to first token (vLLM)") == "250.00 ms"
        headers, cells = table(driver, 0)
        assert float(cells[headers.index("TTFT (ms)")]) == 250 and page_errors(driver) == []
        shots.append(screenshot_dir / "requests-with-vllm.png")
        driver.save_screenshot(str(shots[-1]))

        driver.get(f"{base}/replay")
        wait_rendered(driver, "Replay")
        step = next(b for b in driver.find_elements(By.TAG_NAME, "button") if b.text.strip().endswith("Step"))
        for n in range(2, 5):
            step.click()
            wait_for(driver, lambda d, n=n: metric_value(d, "Request") == f"{n} of 20")
        slider = driver.find_element(By.CSS_SELECTOR, 'input[type="range"][aria-label="Request (in arrival order)"]')
        driver.execute_script("arguments[0].focus()", slider)  # the range input itself is visually hidden
        ActionChains(driver).send_keys(Keys.END).perform()
        wait_for(driver, lambda d: metric_value(d, "Request") == "20 of 20")
        wait_rendered(driver, "Replay")
        assert page_errors(driver) == []
        assert metric_value(driver, "Cumulative token hit rate") == f"{expected.hit_rate * 100:.1f}%"
        shots.append(screenshot_dir / "replay-last-step.png")
        driver.save_screenshot(str(shots[-1]))

        # Upload a Collector file with bad lines: its requests join, its problems are listed.
        driver.get(base)
        wait_rendered(driver, "Overview")
        driver.find_element(By.CSS_SELECTOR, 'input[type="file"]').send_keys(str(MALFORMED))
        wait_for(driver, lambda d: metric_value(d, "Requests") == "23")
        wait_rendered(driver, "Overview")
        warning = driver.find_element(By.CSS_SELECTOR, '[data-testid="stAlertContentWarning"]').text
        assert "6 problem(s)" in warning
        assert page_errors(driver) == []
        shots.append(screenshot_dir / "overview-with-upload.png")
        driver.save_screenshot(str(shots[-1]))

    with capsys.disabled():
        print(f"\ndashboard screenshots: {screenshot_dir}")
    assert all(p.stat().st_size > 10_000 for p in shots)


def test_several_engines_show_a_table_by_engine_and_an_engine_filter(tmp_path):
    """Data parallelism in the browser: the fixture's lines split between two engines (each line's
    resource names one), the Overview's table by engine and the Requests page's engine column."""
    from selenium.webdriver.common.by import By

    dp_file = two_engine_copy(tmp_path)
    with streamlit_server([str(dp_file)]) as base, chromium() as driver:
        driver.get(base)
        wait_rendered(driver, "Overview")
        assert page_errors(driver) == []
        assert any(h.text.startswith("By engine") for h in driver.find_elements(By.CSS_SELECTOR, "h3"))
        headers, cells = table(driver, 0)
        assert headers[:3] == ["engine", "requests", "tokens queried"]
        rows = [cells[i:i + len(headers)] for i in range(0, len(cells), len(headers))]
        assert [r[0] for r in rows] == ["0", "1"] and sum(int(r[1]) for r in rows) == 20
        driver.get(f"{base}/requests")
        wait_rendered(driver, "Requests")
        assert page_errors(driver) == []
        assert table(driver, 0)[0][:2] == ["request", "engine"]
        assert driver.find_elements(By.CSS_SELECTOR, '[data-testid="stSelectbox"]')


def test_a_load_kvscope_deferred_shows_its_wait_for_device_kv_room(tmp_path, screenshot_dir):
    """A real trace file from vLLM's own scheduler under device-KV pressure (`stall_scenarios`: kvscope
    defers loads there): the Requests page shows the deferral columns, and the deferred request's view
    says how long it waited and leads its waterfall with the wait."""
    from connector.tiny_models import build_model
    from dashboard import traces
    from tests.compat.stall_scenarios import WINDOW, three_loads_past_their_reserve

    trace_file = tmp_path / "deferrals.jsonl"
    engine = three_loads_past_their_reserve(build_model("gemma3", window=WINDOW), trace_file=trace_file)
    try:
        engine.run(max_steps=200)
    finally:
        engine.shutdown()  # flushes the spans to the file
    requests = traces.requests_table(traces.read_trace_files([trace_file]).spans).set_index("request_id")
    deferred = requests[requests["deferred_lookups"].notna()]
    assert len(deferred), "the scenario deferred no load"
    request_id = deferred.index[0]
    with streamlit_server([str(trace_file)]) as base, chromium() as driver:
        headers, said = _request_view(driver, base, request_id)
        assert {"deferred", "KV room wait (ms)"} <= set(headers)
        times = int(deferred.loc[request_id, "deferred_lookups"])
        told = f"kvscope deferred its load {'once' if times == 1 else f'{times} times'} ("
        assert any(told in text for text in said), said  # (after the alert's icon name)
        assert table(driver, 1)[1][0] == traces.DEVICE_KV_WAIT  # the waterfall's first row
        driver.save_screenshot(str(screenshot_dir / "requests-deferred.png"))


def test_a_request_that_ended_waiting_for_device_kv_room_shows_its_wait(tmp_path, screenshot_dir):
    """A real trace file: vLLM's own scheduler under device-KV pressure (`stall_scenarios`), and a client aborting
    the first request whose load kvscope deferred, while it waits: its `kvscope.deferral` span gives it a row
    ticked 'ended waiting', its view says it ended before its load could start, and its waterfall is the wait."""
    from connector.tiny_models import build_model
    from dashboard import traces
    from tests.compat.stall_scenarios import WINDOW, three_loads_past_their_reserve

    trace_file = tmp_path / "ended-waiting.jsonl"
    engine = three_loads_past_their_reserve(build_model("gemma3", window=WINDOW), trace_file=trace_file)
    admission = engine.scheduler.get_kv_connector()._scheduler.admission
    aborted: list[str] = []

    def abort_a_deferred_request(_scheduled) -> None:  # after a step's schedule, as a client's abort lands
        if not aborted and admission.deferred:
            aborted.append(next(iter(admission.deferred)))
            engine.abort(aborted)

    try:
        engine.run(max_steps=200, on_scheduled=abort_a_deferred_request)
    finally:
        engine.shutdown()  # flushes the spans to the file
    assert aborted, "the scenario deferred no load"
    request_id = aborted[0]
    requests = traces.requests_table(traces.read_trace_files([trace_file]).spans).set_index("request_id")
    assert requests.loc[request_id, "ended_waiting"] and requests.loc[request_id, "lookups"] == 0
    with streamlit_server([str(trace_file)]) as base, chromium() as driver:
        headers, said = _request_view(driver, base, request_id)
        assert {"deferred", "KV room wait (ms)", "ended waiting"} <= set(headers)
        assert any("and the request ended (aborted" in text and "vLLM never admitted it" in text
                   for text in said), said
        cells = table(driver, 1)[1]
        assert cells[0] == traces.DEVICE_KV_WAIT and "lookup" not in cells  # the waterfall: the wait alone
        driver.save_screenshot(str(screenshot_dir / "requests-ended-waiting.png"))


def _request_view(driver, base: str, request_id: str) -> tuple[list[str], list[str]]:
    """The Requests page searched for one request: the table's headers (before the search) and the texts
    of the request view's alerts."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(f"{base}/requests")
    wait_rendered(driver, "Requests")
    assert page_errors(driver) == []
    headers, _ = table(driver, 0)
    search = driver.find_element(By.CSS_SELECTOR, 'input[aria-label="Search request or trace id"]')
    search.send_keys(request_id, Keys.ENTER)
    wait_for(driver, lambda d: any(request_id in h.text for h in d.find_elements(By.CSS_SELECTOR, "h3")))
    wait_rendered(driver, "Requests")
    assert page_errors(driver) == []
    return headers, [e.text for e in driver.find_elements(By.CSS_SELECTOR, '[data-testid="stAlert"]')]

"""The Prometheus client, the trace-path sources, number formatting and the launcher."""

from __future__ import annotations

import io
import json
import math
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from dashboard import formatting, launch, prometheus, sources

from . import conftest
from .conftest import TWO_ROUNDS


def test_fetch_live_queries_hit_rate_and_load_quantiles(fake_prometheus):
    conftest._PrometheusHandler.queries.clear()
    live = prometheus.fetch_live(fake_prometheus, 3600, now=1_700_000_000)
    assert live.hit_rate["value"].tolist() == [0.25, 0.5, 0.75]  # NaN (0/0) left out
    assert prometheus.latest(live.hit_rate, "hit rate") == 0.75
    assert sorted(set(live.load_latency["series"])) == ["p50", "p95", "p99"]
    assert prometheus.latest(live.load_latency, "p95") == 0.004
    asked = conftest._PrometheusHandler.queries  # (asked side by side: in any order)
    assert "sum(rate(kvscope_hit_tokens_total[60s])) / sum(rate(kvscope_lookup_tokens_total[60s]))" in asked
    assert ("histogram_quantile(0.5, sum by (le) "
            "(rate(kvscope_request_load_duration_seconds_bucket[60s])))") in asked and len(asked) == 4


def test_errors_say_what_went_wrong(fake_prometheus, closed_port_url):
    with pytest.raises(prometheus.PrometheusError, match="Could not reach Prometheus .* connection failed"):
        prometheus.query_range(closed_port_url, "up", 0, 60, 15)
    with pytest.raises(prometheus.PrometheusError, match="rejected the query .*bad_data.*unknown query"):
        prometheus.query_range(fake_prometheus, "up", 0, 60, 15)
    with pytest.raises(prometheus.PrometheusError, match="not an HTTP URL"):
        prometheus.query_range("localhost:9090", "up", 0, 60, 15)


class _Answering:
    """A stand-in `requests.Session` whose every GET is answered HTTP `status_code` (200) with `body`."""

    def __init__(self, body, status_code: int = 200):
        self.body, self.status_code = body, status_code

    def get(self, url, params, timeout, stream):
        body = io.BytesIO(json.dumps(self.body).encode())
        raw = SimpleNamespace(read1=lambda size, decode_content: body.read1(size))
        return SimpleNamespace(status_code=self.status_code, raw=raw, close=lambda: None)


def _matrix(values) -> dict:
    return {"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {}, "values": values}]}}


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (_matrix([[1, "abc"]]), 'result[0].values[0] is [1, "abc"], expected [unix seconds, "value"]'),
        (_matrix([[1, None]]), "result[0].values[0] is [1, null]"),
        (_matrix([[1, True]]), "result[0].values[0] is [1, true]"),  # float() would take it for 1
        (_matrix([[1]]), "result[0].values[0] is [1]"),
        (_matrix([[1e300, "1"]]), 'result[0].values[0] is [1e+300, "1"]'),  # no time a frame can hold
        (_matrix(5), 'result[0] is {"metric": {}, "values": 5}, expected a series'),
        ({"status": "success", "data": {"resultType": "matrix", "result": ["x"]}}, 'result[0] is "x", expected'),
        ({"status": "success", "data": {"resultType": "matrix", "result": 5}}, "result is 5, not a list of series"),
        ({"status": "success", "data": [1]}, "answered a None, not a matrix"),
    ],
    ids=["value-not-a-number", "value-null", "value-boolean", "no-value", "time-past-2262", "values-not-a-list",
         "series-not-an-object", "result-not-a-list", "data-not-an-object"],
)
def test_a_malformed_answer_says_what_is_malformed(body, said):
    with pytest.raises(prometheus.PrometheusError) as raised:
        prometheus.fetch_live("http://prometheus:9090", 3600, now=1_700_000_000, session=_Answering(body))
    assert str(raised.value).startswith("Prometheus at http://prometheus:9090 ") and said in str(raised.value)


def test_a_url_no_http_client_can_parse_is_named():
    long_label = "http://" + "a" * 70 + ".com"  # a host label over 63 characters: urllib3's LocationParseError
    for url in (long_label, "http://ex ample", "http://.example.com"):
        with pytest.raises(prometheus.PrometheusError, match=f"^'{re.escape(url)}' is not a valid URL .*localhost"):
            prometheus.query_range(url, "up", 0, 60, 15, timeout=1)


def test_step_and_window():
    assert prometheus.step_seconds(900) == 15 and prometheus.step_seconds(86400) == 360
    assert prometheus.step_seconds(7201) == 31  # rounded up: never more than MAX_POINTS points
    assert prometheus.rate_window(15) == "60s" and prometheus.rate_window(360) == "1440s"
    assert prometheus.latest(prometheus.matrix_to_frame([], "x"), "x") != prometheus.latest(
        prometheus.matrix_to_frame([], "x"), "x")  # NaN


def test_trace_paths_from_arguments_then_environment(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl.gz").write_bytes(b"")
    (tmp_path / "c.zst").write_bytes(b"")  # the Collector's `compression: zstd`
    (tmp_path / "d.pb").write_bytes(b"")  # and `format: proto`
    (tmp_path / "notes.txt").write_text("")
    env = {"KVSCOPE_TRACE_FILES": " x.jsonl, ,y.jsonl "}
    assert sources.trace_paths(["p.jsonl"], env) == sources.TracePaths(["p.jsonl"])
    assert sources.trace_paths([], env).paths == ["x.jsonl", "y.jsonl"]
    assert sources.trace_paths([], {}) == sources.TracePaths([])
    assert sources.trace_paths([str(tmp_path)], {}) == sources.TracePaths(
        [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl.gz", "c.zst", "d.pb")])  # notes.txt: silently
    assert sources.file_key(str(tmp_path / "missing")) == (str(tmp_path / "missing"), -1, -1)
    assert sources.file_key(str(TWO_ROUNDS))[2] == TWO_ROUNDS.stat().st_size


def test_a_folder_holding_no_trace_files_is_named_with_the_names_read(tmp_path):
    odd, empty = tmp_path / "odd", tmp_path / "empty"
    odd.mkdir()
    empty.mkdir()
    for name in ("trace.JSONL", "trace.txt", "a.log", "b.log"):
        (odd / name).write_text("")
    given = sources.trace_paths([str(odd), str(empty), str(TWO_ROUNDS)], {})
    assert given.paths == [str(TWO_ROUNDS)]
    accepted = ", ".join(sources.TRACE_SUFFIXES)
    assert given.empty_folders == [
        f"The folder {odd} holds no trace files (only a.log, b.log, trace.JSONL and 1 more, which are left out): the "
        f"dashboard reads the files in a folder whose names end in {accepted}.",
        f"The folder {empty} holds no trace files (it is empty): the dashboard reads the files in a folder whose "
        f"names end in {accepted}.",
    ]


def test_formatting():
    assert formatting.percent(0.48051) == "48.1%" and formatting.percent(math.nan) == "–"
    assert formatting.millis(1.914) == "1.91 ms" and formatting.millis(None) == "–"
    assert formatting.data_size(169869312) == "170 MB" and formatting.data_size(999) == "999 B"
    assert formatting.data_size(1.5e12) == "1.5 TB" and formatting.count(3968) == "3,968"


def test_sizes_take_the_next_unit_at_1000_of_one_and_keep_their_sign():
    assert formatting.data_size(999) == "999 B" and formatting.data_size(1000) == "1 kB"
    assert formatting.data_size(-1500) == "-1.5 kB"


def test_a_size_that_rounds_to_1000_of_one_unit_reads_in_the_next():
    """Rounded before the unit is chosen, as durations are: the pages showed "1e+03 kB" and "1000 B"."""
    assert formatting.data_size(999_999) == "1 MB" and formatting.data_size(999.6) == "1 kB"
    assert formatting.data_size(999_499) == "999 kB" and formatting.data_size(1_234_000_000) == "1.23 GB"
    assert formatting.data_size(2e15) == "2,000 TB" and formatting.data_size(1.5e12) == "1.5 TB"


def test_launch_runs_streamlit_on_the_app_with_the_paths(monkeypatch):
    started = []
    monkeypatch.setattr(launch.os, "execv", lambda path, cmd: started.append((path, cmd)))
    launch.main([str(TWO_ROUNDS)], ["--server.port", "8599"])
    path, cmd = started[0]
    assert path == cmd[0] and cmd[:4] == [sys.executable, "-m", "streamlit", "run"]
    assert Path(cmd[4]) == conftest.APP
    assert cmd[cmd.index("--server.port") + 1] == "8599"
    assert cmd[cmd.index("--") + 1:] == [str(TWO_ROUNDS)]


def test_a_supervisors_sigterm_to_kvscope_dashboard_stops_the_server():
    """The real command: `kvscope dashboard` serves, and SIGTERM to the process started stops the
    server (a launcher that waited on streamlit left it running, orphaned, on its port)."""
    import signal
    import subprocess
    import time
    import urllib.request

    from tests.dashboard_app.browser import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "connector.cli", "dashboard", str(TWO_ROUNDS), "--headless",
                             "--port", str(port), "--address", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    health = f"http://127.0.0.1:{port}/_stcore/health"

    def answers() -> bool:
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                return r.read().strip() == b"ok"
        except OSError:
            return False

    try:
        deadline = time.monotonic() + 60
        while not answers():
            assert proc.poll() is None and time.monotonic() < deadline, "kvscope dashboard did not start"
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) is not None
        deadline = time.monotonic() + 10
        while answers():  # nothing left serving on the port
            assert time.monotonic() < deadline, "the dashboard still serves after SIGTERM"
            time.sleep(0.3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launch_refuses_missing_paths(capsys):
    assert launch.main(["/no/such/trace.jsonl"]) == 2
    assert "no such trace file" in capsys.readouterr().err


def test_committed_fixture_is_what_make_fixture_writes(tmp_path, monkeypatch):
    """tests/fixtures/traces/two_rounds.jsonl is current: regenerate it with make_fixture.py after changes."""
    monkeypatch.syspath_prepend(str(conftest.FIXTURES))
    import make_fixture
    out = tmp_path / "two_rounds.jsonl"
    make_fixture.generate(out)
    assert out.read_text() == TWO_ROUNDS.read_text()


def test_samples_that_are_no_finite_number_are_left_out():
    """A quantile of an empty histogram is NaN, one past its last finite bucket +Inf: neither is a point to draw."""
    values = [[1, "0.5"], [2, "NaN"], [3, "+Inf"], [4, "-Inf"]]
    assert prometheus.matrix_to_frame([{"metric": {}, "values": values}], "p99")["value"].tolist() == [0.5]


def test_each_series_is_a_line_of_its_own_and_the_latest_value_is_the_last_in_time():
    """A query answered with a series per label set (an engine label kept by a user's recording rule): each is
    named by its labels, not all drawn as one line."""
    frame = prometheus.matrix_to_frame([{"metric": {"engine": "0"}, "values": [[1, "0.5"]]},
                                        {"metric": {"engine": "1"}, "values": [[1, "0.25"]]}], "hit rate")
    assert frame["series"].tolist() == ["hit rate {'engine': '0'}", "hit rate {'engine': '1'}"]
    unordered = pd.DataFrame({"time": pd.to_datetime([2, 1], unit="s", utc=True), "value": [0.5, 0.25], "series": "x"})
    assert prometheus.latest(unordered, "x") == 0.5


def test_an_http_error_is_an_error_whatever_its_body_says():
    """A proxy in front of Prometheus may answer 503 with a body it kept: not an answer to this query."""
    with pytest.raises(prometheus.PrometheusError, match=r"rejected the query \(HTTP 503"):
        prometheus.query_range("http://prometheus:9090", "up", 0, 60, 15,
                               session=_Answering(_matrix([[1, "0.5"]]), status_code=503))


class _Misbehaving(BaseHTTPRequestHandler):
    """Answers every GET as `how` says: "dribble" (a valid answer a byte every 0.2 s), "slow" (one after 0.6 s),
    "huge" (a valid answer of 200 kB), "deep" (JSON nested 100,000 deep), "vllm" (vLLM's own 404 for a path it
    lacks), "basic auth" (a valid answer to user:secret only, else 401 as Prometheus' web config answers),
    "forbidden" (403), "bad gateway" (a proxy's 502 page), "loop" (a redirect to itself), "login" (a redirect
    to a login page)."""

    how = "dribble"
    _PAGES = {"forbidden": (403, b"Forbidden\n"), "bad gateway": (502, b"<html>502 Bad Gateway</html>"),
              "login page": (200, b"<html><form>Sign in</form></html>")}

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        how = "login page" if self.path == "/login" else self.how
        if how in ("loop", "login"):
            self.send_response(302)
            self.send_header("Location", self.path if how == "loop" else "/login")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if how == "basic auth" and self.headers.get("Authorization") != "Basic dXNlcjpzZWNyZXQ=":  # user:secret
            self._send(401, b"Unauthorized\n", ("WWW-Authenticate", 'Basic realm="prometheus"'))
            return
        if how in self._PAGES:
            self._send(*self._PAGES[how])
            return
        if how == "slow":
            time.sleep(0.6)
        answer = json.dumps(_matrix([[1, "0.5"]])).encode()
        body = {"dribble": answer, "slow": answer, "basic auth": answer,
                "huge": json.dumps(_matrix([[i, "0.5"] for i in range(12_000)])).encode(),
                "deep": b"[" * 100_000 + b"]" * 100_000,
                "vllm": b'{"detail":"Not Found"}'}[self.how]
        self.send_response(404 if self.how == "vllm" else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.how != "dribble":
            self.wfile.write(body)
            return
        for byte in body:
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:  # the client gave up
                return
            time.sleep(0.2)

    def _send(self, status: int, body: bytes, *header: tuple[str, str]) -> None:
        self.send_response(status)
        for name, value in header:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def misbehaving():
    """(base URL, the handler class whose `how` picks the misbehaviour)."""
    handler = type("Handler", (_Misbehaving,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_answering_a_byte_at_a_time_is_given_up_on_within_the_budget(misbehaving, monkeypatch):
    """Each byte came well within the 5 s a wait may take: the four queries took minutes, the page with them."""
    url, handler = misbehaving
    monkeypatch.setattr(prometheus, "FETCH_BUDGET_S", 1.5)
    started = time.monotonic()
    with pytest.raises(prometheus.PrometheusError, match="no answer in time"):
        prometheus.fetch_live(url, 900, now=1_700_000_000)
    assert time.monotonic() - started < 4


def test_a_slow_prometheus_answers_the_four_queries_side_by_side_within_the_budget(misbehaving, monkeypatch):
    """Each answer takes about 0.6 s (a byte every 0.2 s is too slow for this budget: "slow" sends it whole after
    0.6 s): four in a row would pass the 1.5 s budget, side by side they fit."""
    url, handler = misbehaving
    handler.how = "slow"
    monkeypatch.setattr(prometheus, "FETCH_BUDGET_S", 1.5)
    live = prometheus.fetch_live(url, 900, now=1_700_000_000)
    assert live.hit_rate["value"].tolist() == [0.5]


def test_an_answer_too_large_to_be_prometheus_is_refused_unread(misbehaving, monkeypatch):
    url, handler = misbehaving
    handler.how = "huge"
    monkeypatch.setattr(prometheus, "MAX_ANSWER_BYTES", 100_000)
    with pytest.raises(prometheus.PrometheusError, match=r"sent more than 0 MB: is http://127.0.0.1:\d+ a Prometheus"):
        prometheus.query_range(url, "up", 0, 60, 15)
    monkeypatch.setattr(prometheus, "MAX_ANSWER_BYTES", 16 << 20)
    assert len(prometheus.query_range(url, "up", 0, 60, 15)[0]["values"]) == 12_000  # the same, under the cap


def test_json_that_is_no_prometheus_answer_asks_whether_it_is_prometheus(misbehaving):
    """JSON nested past Python's parser raised out of the page."""
    url, handler = misbehaving
    handler.how = "deep"
    with pytest.raises(prometheus.PrometheusError, match=r"HTTP 200 without a Prometheus API response: is .* a Prom"):
        prometheus.query_range(url, "up", 0, 60, 15)


@pytest.mark.parametrize(("how", "said"), [
    ("vllm", r"HTTP 404 without a Prometheus API response: there is no query API at that path\. Enter Prometheus' "
             r"base URL .*, not vLLM's"),
    ("basic auth", r"HTTP 401 without a Prometheus API response: it asks for credentials \(or refused the ones "
                   r"given\)\. This page sends HTTP "
                   r"basic authentication given in the URL, like http://user:password@127\.0\.0\.1:\d+, and no"),
    ("forbidden", r"HTTP 403 without a Prometheus API response: access refused"),
    ("bad gateway", r"HTTP 502 without a Prometheus API response: a proxy in front of it could not reach the server"),
    ("login", r"HTTP 200 without a Prometheus API response after a redirect to http://127\.0\.0\.1:\d+/login: is "),
    ("loop", r"Could not reach Prometheus at http://127\.0\.0\.1:\d+: redirected in a loop\."),
])
def test_an_answer_from_no_prometheus_api_says_what_its_status_tells(misbehaving, how, said):
    """vLLM's base URL answers {"detail": "Not Found"}, Prometheus' basic auth a text 401, a proxy an HTML page: each
    was "is it a Prometheus server?", which sent the user to check the wrong thing."""
    url, handler = misbehaving
    handler.how = how
    with pytest.raises(prometheus.PrometheusError, match=said):
        prometheus.query_range(url, "up", 0, 60, 15)


def test_credentials_in_the_url_are_sent_and_its_password_is_never_shown(misbehaving):
    url, handler = misbehaving
    handler.how = "basic auth"
    with_secret = url.replace("http://", "http://user:secret@")
    assert prometheus.query_range(with_secret, "up", 0, 60, 15)[0]["values"] == [[1, "0.5"]]
    port = url.rsplit(":", 1)[1]
    for wrong, said in [
        (url.replace("http://", "http://user:wrong@"), "like http://user:password@127.0.0.1:"),  # a 401
        (with_secret.replace("127.0.0.1", "127.0.0.1:1"), "http://user:***@127.0.0.1:1:"),  # no valid URL
        (with_secret.replace(port, "99999"), "http://user:***@127.0.0.1:99999"),  # urllib3 quotes the URL
        (with_secret.replace("http://", ""), "'user:***@127.0.0.1:"),  # no scheme
    ]:
        with pytest.raises(prometheus.PrometheusError) as raised:
            prometheus.query_range(wrong, "up", 0, 60, 15, timeout=2)
        assert said in str(raised.value)
        assert "wrong" not in str(raised.value) and "secret" not in str(raised.value), str(raised.value)
    # the hint keeps the scheme and drops the credentials given (it doubled them: user:password@alice:***@host)
    said = prometheus._not_prometheus("https://alice:wrong@prom:9090/p", SimpleNamespace(status_code=401))
    assert "like https://user:password@prom:9090/p, and no other kind" in said and "wrong" not in said


def test_a_prometheus_url_with_a_query_is_refused_and_an_upper_case_scheme_taken(fake_prometheus):
    with pytest.raises(prometheus.PrometheusError, match="has a query or fragment: enter the server's base URL"):
        prometheus.query_range(f"{fake_prometheus}/graph?g0.expr=up", "up", 0, 60, 15)
    live = prometheus.fetch_live(fake_prometheus.replace("http://", "HTTP://"), 900, now=1_700_000_000)
    assert live.hit_rate["value"].tolist() == [0.25, 0.5, 0.75]

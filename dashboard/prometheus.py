"""Live view: kvscope metrics from a Prometheus server's HTTP API (``/api/v1/query_range``).

No Streamlit here: the Live page passes the URL and the time range in and shows the frames.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pandas as pd
import requests
import urllib3

HIT_RATE_QUERY = "sum(rate(kvscope_hit_tokens_total[{window}])) / sum(rate(kvscope_lookup_tokens_total[{window}]))"
LOAD_QUANTILE_QUERY = (
    "histogram_quantile({q}, sum by (le) (rate(kvscope_request_load_duration_seconds_bucket[{window}])))"
)
QUANTILES = (0.5, 0.95, 0.99)
RANGES_S = {"15 minutes": 900, "1 hour": 3600, "6 hours": 6 * 3600, "24 hours": 86400}
MAX_POINTS = 240  # per series
MAX_ANSWER_BYTES = 16 << 20  # an answer of one series of MAX_POINTS points is a few kB
FETCH_BUDGET_S = 10.0  # the page's queries, side by side: it waits no longer (but for one last wait of `timeout`)


class PrometheusError(Exception):
    """Prometheus could not be asked or answered with an error; the message says which and what to try."""


@dataclass(frozen=True)
class LiveData:
    hit_rate: pd.DataFrame  # time, value, series
    load_latency: pd.DataFrame  # time, value (seconds), series ("p50", "p95", "p99")
    queries: dict[str, str]  # series -> PromQL, to show


def step_seconds(range_s: float) -> int:
    """Query resolution: about MAX_POINTS points, never finer than 15 s."""
    return max(15, math.ceil(range_s / MAX_POINTS))


def rate_window(step_s: int) -> str:
    """rate() window: four steps, at least a minute, so each window holds several scrapes."""
    return f"{max(60, 4 * step_s)}s"


def fetch_live(base_url: str, range_s: float, now: float, *, timeout: float = 5.0,
               session: requests.Session | None = None) -> LiveData:
    """Hit rate and request load latency quantiles over the last `range_s` seconds before `now`."""
    step = step_seconds(range_s)
    window = rate_window(step)
    queries = {"hit rate": HIT_RATE_QUERY.format(window=window)}
    for q in QUANTILES:
        queries[f"p{round(q * 100)}"] = LOAD_QUANTILE_QUERY.format(q=q, window=window)
    start, end = now - range_s, now
    frames = {}
    deadline = time.monotonic() + FETCH_BUDGET_S
    with ThreadPoolExecutor(len(queries)) as pool:  # side by side: a slow server's four answers take one's time
        asked = {name: pool.submit(query_range, base_url, query, start, end, step, timeout=timeout, session=session,
                                   deadline=deadline) for name, query in queries.items()}
    for name, answer in asked.items():
        result = answer.result()  # (the first query's error, in order, is the one said)
        try:
            frames[name] = matrix_to_frame(result, name)
        except PrometheusError as exc:
            shown = _without_password(base_url.strip().rstrip("/"))
            raise PrometheusError(f"Prometheus at {shown} sent {exc}") from None
    latency = pd.concat([frames[f"p{round(q * 100)}"] for q in QUANTILES], ignore_index=True)
    return LiveData(hit_rate=frames["hit rate"], load_latency=latency, queries=queries)


def query_range(base_url: str, query: str, start: float, end: float, step: int, *, timeout: float = 5.0,
                session: requests.Session | None = None, deadline: float | None = None) -> list[dict]:
    """The `result` list of a range query (a matrix), or PrometheusError with a readable reason. `timeout`
    bounds each wait for the server, `deadline` (`time.monotonic()`; default: two timeouts from now) the whole
    answer: a server sending it a byte at a time never times out a wait. A password in the URL is in no
    message (an error's own text, urllib3's, may quote the URL whole)."""
    try:
        return _query_range(base_url, query, start, end, step, timeout, session, deadline)
    except PrometheusError as exc:
        said = f":{_password(base_url)}@"
        if said != ":@" and said in str(exc):  # as URLs quote it (a bare short password would match words)
            raise PrometheusError(str(exc).replace(said, ":***@")) from None
        raise


def _query_range(base_url, query, start, end, step, timeout, session, deadline) -> list[dict]:
    base = base_url.strip().rstrip("/")
    shown = _without_password(base)  # in messages: a password given in the URL is not
    if not base.lower().startswith(("http://", "https://")):
        raise PrometheusError(f"{_without_password(base_url)!r} is not an HTTP URL: enter one like "
                              "http://localhost:9090")
    if "?" in base or "#" in base:  # (a page of Prometheus' UI pasted in)
        raise PrometheusError(f"{shown!r} has a query or fragment: enter the server's base URL, like "
                              "http://localhost:9090 (with its --web.route-prefix path, if it has one)")
    url = f"{base}/api/v1/query_range"
    params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": str(step)}
    deadline = time.monotonic() + 2 * timeout if deadline is None else deadline
    try:
        left = deadline - time.monotonic()
        if left <= 0:
            raise requests.Timeout()
        response = (session or requests).get(url, params=params, timeout=min(timeout, left), stream=True)
        content = _read_capped(response, deadline)
    except (requests.exceptions.InvalidURL, ValueError) as exc:  # ValueError: urllib3's LocationParseError, idna's
        raise PrometheusError(
            f"{shown!r} is not a valid URL ({_short(str(exc))}): enter one like http://localhost:9090") from exc
    except requests.RequestException as exc:
        raise PrometheusError(
            f"Could not reach Prometheus at {shown}: {_reason(exc)}. Check the URL and that Prometheus is "
            "running and reachable from the machine that runs this dashboard."
        ) from exc
    if content is None:
        raise PrometheusError(f"{shown}/api/v1/query_range sent more than {MAX_ANSWER_BYTES >> 20} MB: is {shown} a "
                              "Prometheus server?")
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's parser goes
        body = None
    if not isinstance(body, dict) or body.get("status") not in ("success", "error"):  # (vLLM's {"detail": ...})
        raise PrometheusError(_not_prometheus(base, response))
    if response.status_code != 200 or body.get("status") != "success":
        raise PrometheusError(
            f"Prometheus at {shown} rejected the query (HTTP {response.status_code}, "
            f"{body.get('errorType', 'error')}): {body.get('error', 'no reason given')}"
        )
    data = body.get("data")
    kind = data.get("resultType") if isinstance(data, dict) else None
    if kind != "matrix":
        raise PrometheusError(f"Prometheus at {shown} answered a {kind!r}, not a matrix")
    result = data.get("result")
    if not isinstance(result, list | None):
        raise PrometheusError(f"Prometheus at {shown} answered a matrix whose result is {_short(json.dumps(result))}, "
                              "not a list of series")
    return result or []


def _read_capped(response, deadline: float) -> bytes | None:
    """The answer's body, None past MAX_ANSWER_BYTES; requests.Timeout past ``deadline``. Read as it comes
    (`read1`: what has arrived, up to 64 kB), so that the deadline is checked however slowly it comes."""
    chunks, size = [], 0
    try:
        while chunk := response.raw.read1(1 << 16, decode_content=True):
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                return None
            if time.monotonic() > deadline:
                raise requests.Timeout()
            chunks.append(chunk)
    except requests.RequestException:  # (an OSError: not to be taken for one below)
        raise
    except urllib3.exceptions.ReadTimeoutError as exc:  # (as requests names urllib3's errors)
        raise requests.Timeout(exc) from exc
    except urllib3.exceptions.DecodeError as exc:
        raise requests.exceptions.ContentDecodingError(exc) from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise requests.ConnectionError(exc) from exc
    finally:
        response.close()
    return b"".join(chunks)


def _not_prometheus(base: str, response) -> str:
    """Why an answer that is no Prometheus API response came, as far as its HTTP status tells, and what to try."""
    shown, status = _without_password(base), response.status_code
    said = f"{shown}/api/v1/query_range answered HTTP {status} without a Prometheus API response"
    history = getattr(response, "history", None)
    if history:  # (a login page, a proxy's front page)
        said += f" after a redirect to {_short(_without_password(getattr(response, 'url', '') or '?'))}"
    if status in (401, 407):
        return (f"{said}: it asks for credentials (or refused the ones given). This page sends HTTP basic "
                f"authentication given in the URL, like {_with_credentials(base)}, and no other kind")
    if status == 403:
        return f"{said}: access refused. Check that the credentials in the URL may read this Prometheus' API"
    if status == 404:
        return (f"{said}: there is no query API at that path. Enter Prometheus' base URL (with its "
                "--web.route-prefix path, if it has one), not vLLM's")
    if status in (502, 503, 504):
        return (f"{said}: a proxy in front of it could not reach the server behind (is that Prometheus server "
                "running?)")
    return f"{said}: is {shown} a Prometheus server (not vLLM's /metrics endpoint)?"


@dataclass(frozen=True)
class _UrlParts:
    """A URL taken apart as typed, a scheme-less ``user:password@host:9090/path`` too (urllib's `urlsplit` reads
    ``user`` as the scheme there)."""

    scheme: str  # with its "://", "" when the URL has none
    user: str
    password: str  # "" when the user information has none
    has_password: bool
    host: str  # host[:port]
    path: str  # with its leading "/", "" when there is none

    @classmethod
    def of(cls, url: str) -> _UrlParts:
        scheme, sep, rest = url.partition("://")
        if not sep:
            scheme, rest = "", url
        authority, slash, path = rest.partition("/")
        user_info, _, host = authority.rpartition("@")
        user, colon, password = user_info.partition(":")
        return cls(scheme + sep, user, password, bool(colon), host, slash + path)


def _without_password(url: str) -> str:
    """``url`` with the password of its user information (``user:password@``) masked, to be shown."""
    parts = _UrlParts.of(url)
    return f"{parts.scheme}{parts.user}:***@{parts.host}{parts.path}" if parts.has_password else url


def _password(url: str) -> str:
    """The password of ``url``'s user information, "" when it has none."""
    return _UrlParts.of(url.strip()).password


def _with_credentials(base: str) -> str:
    """``base`` as it would carry basic-auth credentials: ``scheme://user:password@host[:port][/path]``."""
    parts = _UrlParts.of(base)
    return f"{parts.scheme}user:password@{parts.host}{parts.path}"


def _reason(exc: requests.RequestException) -> str:
    if isinstance(exc, requests.Timeout):
        return "no answer in time"
    if isinstance(exc, requests.TooManyRedirects):  # (a login page sending the client round, a proxy's loop)
        return "redirected in a loop"
    if isinstance(exc, requests.ConnectionError):
        return "connection failed"
    return type(exc).__name__


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


_TIME_LIMIT_S = 9e9  # |Unix seconds| a frame's nanosecond timestamps hold (they end in 1677 and 2262) with margin


def _sample(pair: object) -> tuple[float, float] | None:
    """(time, value) of one `[unix seconds, "value"]` pair of a matrix, None when it is not one."""
    if not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[1], bool):
        return None
    try:
        ts, value = float(pair[0]), float(pair[1])
    except (TypeError, ValueError):
        return None
    return (ts, value) if abs(ts) < _TIME_LIMIT_S else None


def matrix_to_frame(result: list[dict], name: str) -> pd.DataFrame:
    """Long frame (time, value, series) of a matrix result; NaN/Inf samples (e.g. 0/0) are left out.

    PrometheusError when the matrix is malformed: the message says where ("a malformed answer to ...").
    """
    rows = []
    for i, series in enumerate(result):
        values = (series.get("values") or []) if isinstance(series, dict) else None  # none: native histograms
        if not isinstance(values, list):
            raise PrometheusError(f"a malformed answer to the {name!r} query: result[{i}] is "
                                  f"{_short(json.dumps(series))}, "
                                  'expected a series {"metric": {...}, "values": [[time, "value"], ...]}')
        label = name if len(result) == 1 else f"{name} {series.get('metric') or i}"
        for j, pair in enumerate(values):
            sample = _sample(pair)
            if sample is None:
                raise PrometheusError(f"a malformed answer to the {name!r} query: result[{i}].values[{j}] is "
                                      f'{_short(json.dumps(pair))}, expected [unix seconds, "value"]')
            if math.isfinite(sample[1]):
                rows.append((*sample, label))
    frame = pd.DataFrame(rows, columns=["ts", "value", "series"])
    frame["time"] = pd.to_datetime(frame["ts"], unit="s", utc=True)
    return frame[["time", "value", "series"]]


def latest(frame: pd.DataFrame, series: str) -> float:
    """Last value of one series, NaN when it has none."""
    part = frame[frame["series"] == series]
    return float(part.sort_values("time")["value"].iloc[-1]) if len(part) else math.nan

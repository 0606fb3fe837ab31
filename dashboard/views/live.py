"""Live: kvscope metrics from a Prometheus server that scrapes vLLM's /metrics."""

import os
import time

import streamlit as st

from dashboard import charts, formatting, prometheus

st.title("Live")
st.caption("Token hit rate and request load latency from Prometheus (`/api/v1/query_range`), "
           "for a Prometheus server that scrapes vLLM's `/metrics` with the kvscope connector loaded.")

url_col, range_col = st.columns([3, 1])
url = url_col.text_input("Prometheus URL", value=os.environ.get("KVSCOPE_PROMETHEUS_URL", ""),
                         placeholder="http://localhost:9090", key="live_url")
range_label = range_col.selectbox("Range", list(prometheus.RANGES_S), index=1, key="live_range")
if not url.strip():
    st.info("Enter the URL of a Prometheus server to query it.")
    st.stop()

try:
    live = prometheus.fetch_live(url, prometheus.RANGES_S[range_label], now=time.time())
except prometheus.PrometheusError as exc:
    st.error(str(exc), icon=":material/cloud_off:")
    st.stop()

row = st.columns(4)
row[0].metric("Token hit rate (latest)", formatting.percent(prometheus.latest(live.hit_rate, "hit rate")))
for col, name in zip(row[1:], ("p50", "p95", "p99")):
    latest_ms = prometheus.latest(live.load_latency, name) * 1e3
    col.metric(f"Load-to-report time {name} (latest)", formatting.millis(latest_ms))

if live.hit_rate.empty and live.load_latency.empty:
    st.info("Prometheus answered, but has no kvscope samples in this range: is it scraping vLLM's /metrics "
            "with the kvscope connector loaded, and have requests been served?")
else:
    left, right = st.columns(2)
    left.subheader("Token hit rate")
    left.altair_chart(charts.live_series(live.hit_rate, "token hit rate", "%"), width="stretch")
    right.subheader("Request load time")
    latency_ms = live.load_latency.assign(value=live.load_latency["value"] * 1e3)
    right.altair_chart(charts.live_series(latency_ms, "milliseconds", ".1f"), width="stretch")

with st.expander("Queries"):
    for name, query in live.queries.items():
        st.code(query, language="promql")

"""kvscope dashboard: a Streamlit app that replays the connector's traces (hit rates, load latency)."""

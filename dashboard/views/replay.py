"""Replay: requests as they arrive, with the cumulative hit rate and host traffic up to each one."""

import streamlit as st

from dashboard import charts, data, formatting, traces, widgets

loaded = data.current()
st.title("Replay")
widgets.read_problems(loaded.traces)
loaded = data.require_requests()
requests, spans = loaded.requests, loaded.spans
engines = traces.engines_of(requests)
if len(engines) > 1:  # data parallelism: each engine's host tier fills and serves apart from the others'
    engine = st.selectbox("Engine", [None, *engines], key="replay_engine",
                          format_func=lambda e: "all (their tiers added together)" if e is None else str(e),
                          help="Each engine has its own host tier: replay one to see its tier's story")
    if engine is not None:
        requests, spans = traces.of_engine(requests, spans, engine)
timeline = traces.replay_timeline(requests, spans)
last = len(timeline)
st.caption(traces.REPLAY_DEFINITION)

if "replay_step" not in st.session_state or not 1 <= st.session_state.replay_step <= last:
    st.session_state.replay_step = 1
st.session_state.setdefault("replay_playing", False)


def move(delta: int) -> None:
    st.session_state.replay_step = min(max(st.session_state.replay_step + delta, 1), last)


def to_next_miss() -> None:
    found = traces.next_miss(timeline, st.session_state.replay_step)
    if found is None:
        st.toast("No request after this one missed the host tier.", icon=":material/info:")
    else:
        st.session_state.replay_step = found


def toggle_play() -> None:
    playing = not st.session_state.replay_playing
    if playing and st.session_state.replay_step >= last:
        st.session_state.replay_step = 1  # play again from the start
    st.session_state.replay_playing = playing


controls = st.columns([1, 1, 1, 1, 1, 3], vertical_alignment="bottom")
controls[0].button("Start", icon=":material/first_page:", on_click=move, args=(-last,), width="stretch")
controls[1].button("Back", icon=":material/chevron_left:", on_click=move, args=(-1,), width="stretch")
controls[2].button("Pause" if st.session_state.replay_playing else "Play", key="replay_play",
                   icon=":material/pause:" if st.session_state.replay_playing else ":material/play_arrow:",
                   on_click=toggle_play, type="primary", width="stretch")
controls[3].button("Step", icon=":material/chevron_right:", on_click=move, args=(1,), width="stretch")
controls[4].button("Next miss", icon=":material/skip_next:", on_click=to_next_miss, key="replay_next_miss",
                   width="stretch", help=traces.NEXT_MISS_DEFINITION)
seconds_per_step = controls[5].select_slider("Seconds per step while playing", options=[0.25, 0.5, 1.0, 2.0],
                                             value=0.5, key="replay_speed")


@st.fragment(run_every=seconds_per_step if st.session_state.replay_playing else None)
def player() -> None:
    if st.session_state.replay_playing:
        if st.session_state.replay_step >= last:
            st.session_state.replay_playing = False
            st.rerun(scope="app")  # stops the timer and relabels Play
        st.session_state.replay_step += 1
    if last > 1:
        st.slider("Request (in arrival order)", 1, last, key="replay_step")
    state = traces.replay_state(timeline, st.session_state.replay_step)
    request = traces.find_request(requests, state["trace_id"], state["request_id"])

    row = st.columns(4)
    row[0].metric("Request", f"{formatting.count(state['step'])} of {formatting.count(last)}",
                  help=f"id {state['request_id']}, trace {state['trace_id']}")
    row[1].metric("Cumulative token hit rate", formatting.percent(state["cum_hit_rate"]),
                  help=traces.HIT_RATE_DEFINITION)
    row[2].metric("Loaded from host so far", formatting.data_size(state["cum_bytes_loaded"]))
    row[3].metric("Stored to host so far", formatting.data_size(state["cum_bytes_stored"]))

    left, right = st.columns(2)
    left.altair_chart(charts.replay_hit_rate(timeline, state["step"]), width="stretch")
    right.altair_chart(charts.replay_traffic(timeline, state["step"]), width="stretch")

    st.subheader(f"Request `{state['request']}` at {state['t_s']:.3f} s")
    widgets.request_numbers(request, spans)
    widgets.request_waterfall(spans, requests, request, key="replay_waterfall", vllm=loaded.vllm)

    st.subheader("Arrived so far")
    arrived = timeline[timeline["step"] <= state["step"]].iloc[::-1].head(10)
    st.dataframe(
        arrived[["step", "request", "t_s", "tokens_queried", "tokens_hit", "cum_hit_rate"]],
        hide_index=True,
        placeholder="–",
        width="stretch",
        column_config={
            "t_s": st.column_config.NumberColumn("arrival (s)", format="%.3f"),
            "tokens_queried": st.column_config.NumberColumn("queried"),
            "tokens_hit": st.column_config.NumberColumn("hit"),
            "cum_hit_rate": st.column_config.NumberColumn("cumulative hit rate", format="percent"),
        },
    )


player()

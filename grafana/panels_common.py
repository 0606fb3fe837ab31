"""Shared defaults for the kvscope Grafana boards: datasource, selectors, variables, panel styles.

Every board module builds its panels through these helpers so that all boards look alike and
filter alike (`$model_name`, `$instance`, `$engine`), and so that rendering is deterministic.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import prometheus as prometheus_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dashboard_m

TAG = "kvscope"
# Every panel queries the Prometheus chosen in the `datasource` variable.
DATASOURCE = dashboard_m.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Label filter shared by every query: vLLM adds model_name and engine to all of its metrics, and
# Prometheus adds instance (the scrape target: one vLLM server; engines of several servers share indices).
ENGINE_SELECTOR = 'model_name=~"$model_name", instance=~"$instance", engine=~"$engine"'

# Grid: 24 columns wide.
FULL, HALF, THIRD, QUARTER = 24, 12, 8, 6
HEIGHT = 8
STAT_HEIGHT = 8

# Custom Grafana units (`suffix:` puts the text after the value).
TOKENS_PER_SECOND = "suffix: tokens/s"
BLOCKS_PER_SECOND = "suffix: blocks/s"
BLOCKS_PER_MINUTE = "suffix: blocks/min"
ENTRIES_PER_SECOND = "suffix: entries/s"
RECORDS_PER_MINUTE = "suffix: records/min"
LOADS_PER_MINUTE = "suffix: loads/min"


def sel(*extra: str) -> str:
    """A `{...}` label selector with the engine filter and any extra matchers."""
    return "{" + ", ".join((ENGINE_SELECTOR, *extra)) + "}"


INF_BUCKET = 'le="+Inf"'  # a histogram's count of observations


def quantile(q: float, buckets, by: Sequence[str] = ()) -> str:
    """`histogram_quantile` of bucket rates summed by `by`, only where the histogram had observations:
    an idle span has no quantile rather than NaN (as the recording rules do it). `buckets(*matchers)`
    is the bucket-rate expression with extra label matchers (the guard asks for ``le="+Inf"``)."""
    keep = ", ".join(by)
    summed = "sum by (" + ", ".join(("le", *by)) + f") ({buckets()})"
    observed = "sum" + (f" by ({keep})" if keep else "") + f" ({buckets(INF_BUCKET)}) > 0"
    return f"histogram_quantile({q}, {summed} and ignoring (le) ({observed}))"


def quantile_queries(quantiles: Sequence[float], buckets, by: Sequence[str], legend: str) -> list:
    """A `quantile` range query per quantile, its legend ``legend`` with ``{p}`` the percentile ("p99")."""
    return queries(*((quantile(q, buckets, by), legend.replace("{p}", f"p{round(q * 100)}")) for q in quantiles))


def query(expr: str, legend: str = "", ref_id: str = "A", instant: bool = False) -> prometheus_b.Dataquery:
    q = prometheus_b.Dataquery().expr(expr).ref_id(ref_id)
    q = q.instant() if instant else q.range()
    if legend:
        q = q.legend_format(legend)
    return q


def queries(*pairs: tuple[str, str]) -> list[prometheus_b.Dataquery]:
    """(expr, legend) pairs -> range queries with ref ids A, B, C, ..."""
    return [query(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(pairs)]


def instant(expr: str, legend: str = "") -> list[prometheus_b.Dataquery]:
    """The single instant query of a stat panel (the value now, not a series over time)."""
    return [query(expr, legend, "A", instant=True)]


def thresholds(*steps: tuple[float | None, str]) -> dashboard_b.ThresholdsConfig:
    """Absolute thresholds; the first step's value is None (the base colour)."""
    return (
        dashboard_b.ThresholdsConfig()
        .mode(dashboard_m.ThresholdsMode.ABSOLUTE)
        .steps([dashboard_m.Threshold(value=v, color=c) for v, c in steps])
    )


def timeseries(
    title: str,
    description: str,
    targets: Sequence[prometheus_b.Dataquery],
    unit: str,
    width: int = HALF,
    height: int = HEIGHT,
    min_value: float | None = 0,
    max_value: float | None = None,
    stacked: bool = False,
) -> timeseries_b.Panel:
    panel = (
        timeseries_b.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(list(targets))
        .unit(unit)
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(10)
        .show_points(common_m.VisibilityMode.NEVER)
        .legend(
            common_b.VizLegendOptions()
            .display_mode(common_m.LegendDisplayMode.TABLE)
            .placement(common_m.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["mean", "max", "lastNotNull"])
        )
        .tooltip(
            common_b.VizTooltipOptions()
            .mode(common_m.TooltipDisplayMode.MULTI)
            .sort(common_m.SortOrder.DESCENDING)
        )
    )
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    if stacked:
        panel = panel.stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL))
    return panel


def stat(
    title: str,
    description: str,
    targets: Sequence[prometheus_b.Dataquery],
    unit: str,
    steps: Sequence[tuple[float | None, str]],
    width: int = QUARTER,
    height: int = STAT_HEIGHT,
    calc: str = "lastNotNull",
    sparkline: bool = True,
) -> stat_b.Panel:
    return (
        stat_b.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(list(targets))
        .unit(unit)
        .span(width)
        .height(height)
        .thresholds(thresholds(*steps))
        .color_mode(common_m.BigValueColorMode.VALUE)
        .graph_mode(common_m.BigValueGraphMode.AREA if sparkline else common_m.BigValueGraphMode.NONE)
        .reduce_options(common_b.ReduceDataOptions().calcs([calc]).values(False))
        .no_value("no data")
    )


def row(title: str) -> dashboard_b.Row:
    return dashboard_b.Row(title)


# --- template variables --------------------------------------------------------------------

def datasource_variable() -> dashboard_b.DatasourceVariable:
    return (
        dashboard_b.DatasourceVariable("datasource")
        .label("Prometheus")
        .type("prometheus")
        .description("The Prometheus that scrapes vLLM's /metrics and evaluates the kvscope rules.")
    )


def label_variable(
    name: str, label: str, metric_selector: str, description: str,
    sort: dashboard_m.VariableSort = dashboard_m.VariableSort.ALPHABETICAL_ASC,
) -> dashboard_b.QueryVariable:
    """A multi-value variable over the values of `name` in `metric_selector`; All means `.*`. Indices
    (engine, group) sort as numbers: alphabetically engine 10 came before 2, and so did its repeated row."""
    return (
        dashboard_b.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DATASOURCE)
        .query(f"label_values({metric_selector}, {name})")
        .refresh(dashboard_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(sort)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dashboard_m.VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


def engine_variables() -> list[dashboard_b.QueryVariable]:
    """`model_name` and `engine`, the labels vLLM puts on every metric it exports, and the scrape
    target `instance` between them: alerts fire per instance and engine, so one pick of each shows
    what an alert saw."""
    return [
        label_variable(
            "model_name", "Model", "kvscope_lookup_tokens_total",
            "vLLM's model_name label (the served model name).",
        ),
        label_variable(
            "instance", "Instance", 'kvscope_lookup_tokens_total{model_name=~"$model_name"}',
            "The scrape target: one vLLM server. Replicas of a model have engines of the same index; pick "
            "one instance and one engine to see the numbers an alert on them uses.",
        ),
        label_variable(
            "engine", "Engine", 'kvscope_lookup_tokens_total{model_name=~"$model_name", instance=~"$instance"}',
            "vLLM's engine label (engine core index; several with data parallelism, numbered from the "
            "server's first data-parallel rank: 0 on one server, its own ranks behind an external or hybrid "
            "load balancer).",
            sort=dashboard_m.VariableSort.NUMERICAL_ASC,
        ),
    ]


def dashboard(uid: str, title: str, description: str) -> dashboard_b.Dashboard:
    """A board with the shared time range, refresh, tags and links to its sibling boards."""
    return (
        dashboard_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([TAG])
        .editable()
        .timezone("browser")
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(dashboard_m.DashboardCursorSync.CROSSHAIR)
        .link(
            dashboard_b.DashboardLink("kvscope boards")
            .type(dashboard_m.DashboardLinkType.DASHBOARDS)
            .tags([TAG])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )


def with_panels(board: dashboard_b.Dashboard, items: Iterable[object]) -> dashboard_b.Dashboard:
    """Add rows and panels in order (a row is followed by the panels it heads)."""
    for item in items:
        if isinstance(item, dashboard_b.Row):
            board = board.with_row(item)
        else:
            board = board.with_panel(item)  # type: ignore[arg-type]
    return board


# --- rendering -----------------------------------------------------------------------------

def render(board: dashboard_b.Dashboard) -> str:
    """Deterministic JSON: panel ids numbered in order, keys sorted, 2-space indent, final newline."""
    model = board.build()
    next_id = 1
    for panel in model.panels or []:
        panel.id_val = next_id
        next_id += 1
        for inner in getattr(panel, "panels", None) or []:  # panels inside collapsed rows
            inner.id_val = next_id
            next_id += 1
    return json.dumps(json.loads(JSONEncoder().encode(model)), sort_keys=True, indent=2) + "\n"

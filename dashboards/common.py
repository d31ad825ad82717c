"""Building blocks every healthagent dashboard shares (grafanalib 0.7.1).

Why a module of helpers: the four dashboards must agree on the things a reviewer or an operator
checks first - every panel and query on the ``datasource`` variable, the same ``cluster``/``node``
/``job`` variables, the same selector filters, a modern ``schemaVersion`` and a fixed layout - and
one function per rule keeps them agreeing.

Label facts the queries rely on (docs/dashboards.md says the same to operators):
- the agent exports neither ``node`` nor ``cluster``; Prometheus adds ``node`` by relabelling
  (``__meta_kubernetes_pod_node_name``) and ``cluster`` as an external label, which is absent on a
  single Prometheus. The ``cluster`` variable therefore allows All = ``.*``, which also matches a
  series that has no ``cluster`` label at all.
- the training metrics carry the training job in ``job``; the scrape must use
  ``honor_labels: true`` or Prometheus renames it to ``exported_job``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import attr
from grafanalib.core import (
    Annotations,
    Dashboard,
    GridPos,
    Stat,
    StateTimeline,
    Table,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

# Grafana 10.x writes 38/39; Grafana migrates anything older on load, but an old number makes it
# rewrite the panels we generate (grafanalib's own default, 12, predates the panel schema used here).
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
REFRESH_ON_TIME_RANGE_CHANGE = 2

# Selector filters by scope. Node-level health metrics filter on cluster and node; training
# metrics on cluster, node (the nodes its ranks report from) and job.
CLUSTER = 'cluster=~"$cluster"'
NODE = 'node=~"$node"'
JOB = 'job=~"$job"'
NODE_FILTERS = (CLUSTER, NODE)
TRAINING_FILTERS = (CLUSTER, NODE, JOB)

# The range every rate()/increase() panel uses: Grafana sizes it from the scrape interval.
RATE = "[$__rate_interval]"

GREEN_RED = [{"color": "green", "value": None}, {"color": "red", "value": 1}]


def sel(metric: str, *matchers: str, filters: Sequence[str] = NODE_FILTERS) -> str:
    """``metric{cluster=~"$cluster",node=~"$node",<matchers>}``: every selector goes through here."""
    return metric + "{" + ",".join([*filters, *matchers]) + "}"


# -- template variables ---------------------------------------------------------------------------

def datasource_variable() -> Template:
    return Template(name="datasource", label="Data source", type="datasource", query="prometheus",
                    default="default", refresh=1)


def query_variable(name: str, label: str, query: str, *, include_all: bool = True,
                   multi: bool = True) -> Template:
    """A Prometheus ``label_values`` variable; "All" is the regex ``.*`` so a missing label matches."""
    return Template(
        name=name, label=label, query=query, dataSource=DATASOURCE, includeAll=include_all,
        multi=multi, allValue=".*" if include_all else None,
        default="All" if include_all else None, refresh=REFRESH_ON_TIME_RANGE_CHANGE, sort=1,
    )


def cluster_variable() -> Template:
    return query_variable("cluster", "Cluster", "label_values(healthagent_build_info, cluster)")


def node_variable(*, single: bool = False) -> Template:
    return query_variable("node", "Node", f"label_values({sel('healthagent_build_info', filters=(CLUSTER,))}, node)",
                          include_all=not single, multi=not single)


def job_variable() -> Template:
    return query_variable(
        "job", "Training job", f"label_values({sel('healthagent_training_world_size', filters=(CLUSTER,))}, job)")


# -- panels -------------------------------------------------------------------------------------

def target(expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> Target:
    return Target(expr=expr, legendFormat=legend, instant=instant, datasource=DATASOURCE,
                  format="table" if table else "time_series")


def _with_ref_ids(targets: Iterable[Target]) -> list[Target]:
    return [attr.evolve(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)]


def timeseries(title: str, description: str, targets: Sequence[Target], *, unit: str = "short",
               stacked: bool = False, bars: bool = False, step: bool = False) -> TimeSeries:
    return TimeSeries(
        title=title, description=description, dataSource=DATASOURCE, targets=_with_ref_ids(targets),
        unit=unit, drawStyle="bars" if bars else "line", fillOpacity=60 if bars or stacked else 10,
        stacking={"mode": "normal", "group": "A"} if stacked else {},
        lineInterpolation="stepAfter" if step else "linear", legendDisplayMode="table",
        legendPlacement="right", legendCalcs=["lastNotNull", "max"], tooltipMode="multi",
        tooltipSort="desc",
    )


def stat(title: str, description: str, targets: Sequence[Target], *, unit: str = "short",
         thresholds: list | None = None, text_mode: str = "auto", decimals: int | None = None) -> Stat:
    return Stat(
        title=title, description=description, dataSource=DATASOURCE, targets=_with_ref_ids(targets),
        format=unit, reduceCalc="lastNotNull", color={"mode": "thresholds"}, graphMode="none", textMode=text_mode,
        colorMode="background" if thresholds else "value", decimals=decimals,
        thresholds=thresholds or [{"color": "blue", "value": None}], noValue="0",
    )


def table(title: str, description: str, targets: Sequence[Target], *,
          sort_by: str | None = None) -> Table:
    """An instant-query table; several queries are merged on their common labels (the node...)."""
    from grafanalib.core import TableSortByField

    return Table(
        title=title, description=description, dataSource=DATASOURCE, targets=_with_ref_ids(targets),
        transformations=[{"id": "merge", "options": {}},
                         {"id": "organize", "options": {"excludeByName": {"Time": True}}}],
        sortBy=[TableSortByField(displayName=sort_by, desc=True)] if sort_by else [],
        filterable=True,
    )


def state_timeline(title: str, description: str, targets: Sequence[Target], *,
                   mappings: list | None = None, thresholds: list | None = None) -> StateTimeline:
    return StateTimeline(
        title=title, description=description, dataSource=DATASOURCE, targets=_with_ref_ids(targets),
        mappings=mappings or [], thresholds=thresholds or GREEN_RED,
    )


def up_down_mappings(up_text: str = "up", down_text: str = "DOWN") -> list[dict]:
    return [{"type": "value", "options": {
        "0": {"text": down_text, "color": "red", "index": 0},
        "1": {"text": up_text, "color": "green", "index": 1},
    }}]


# -- layout and the dashboard -------------------------------------------------------------------

GRID_WIDTH = 24


def layout(rows: Sequence[tuple[int, Sequence]]) -> list:
    """Place panels row by row: ``(height, [panel, ...])``, the row's panels share its width evenly.

    Positions are computed, never hand-written, so panels cannot overlap and the JSON is stable.
    """
    placed = []
    y = 0
    for height, panels in rows:
        width = GRID_WIDTH // len(panels)
        for i, panel in enumerate(panels):
            last = i == len(panels) - 1
            w = GRID_WIDTH - width * i if last else width
            placed.append(attr.evolve(panel, gridPos=GridPos(h=height, w=w, x=width * i, y=y)))
        y += height
    return placed


def prometheus_annotation(name: str, expr: str, *, title: str, text: str, tags: str,
                          color: str = "orange") -> dict:
    """A Grafana annotation backed by a Prometheus query (one marker per step the query has data)."""
    return {
        "datasource": DATASOURCE, "enable": True, "expr": expr, "iconColor": color, "name": name,
        "step": "$__interval", "tagKeys": tags, "textFormat": text, "titleFormat": title,
        "useValueForTime": False,
    }


def builtin_annotation() -> dict:
    """Grafana's own annotations and alerts, as a dashboard saved by Grafana 10 carries them."""
    return {
        "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
        "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
        "type": "dashboard",
    }


def dashboard(*, title: str, uid: str, description: str, rows: Sequence[tuple[int, Sequence]],
              variables: Sequence[Template], annotations: Sequence[dict] = (),
              tags: Sequence[str] = ()) -> Dashboard:
    """The dashboard with a stable uid, stable panel ids (in layout order) and the schema version."""
    return Dashboard(
        title=title, uid=uid, description=description, tags=["healthagent", *tags],
        panels=layout(rows), schemaVersion=SCHEMA_VERSION, timezone="browser", refresh="30s",
        time=Time("now-6h", "now"), graphTooltip=1,
        templating=Templating(list=[datasource_variable(), *variables]),
        annotations=Annotations(list=[builtin_annotation(), *annotations]),
    ).auto_panel_ids()

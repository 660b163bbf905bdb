"""Plotly figures, built from plain arrays (pure functions: the AppTest tests read their specs back)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

_LAYOUT = dict(margin=dict(l=40, r=10, t=40, b=40), height=420)


def heatmap(
    z: np.ndarray, x: Sequence[object], y: Sequence[object], title: str, x_title: str, y_title: str,
    colorbar: str, colorscale: str = "Viridis", text: np.ndarray | None = None,
) -> go.Figure:
    """z [len(y), len(x)]."""
    hover = f"{x_title} %{{x}}<br>{y_title} %{{y}}<br>{colorbar} %{{z}}<extra></extra>"
    fig = go.Figure(go.Heatmap(z=z, x=list(x), y=list(y), colorscale=colorscale, text=text,
                               colorbar=dict(title=colorbar), hovertemplate=hover))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, **_LAYOUT)
    fig.update_xaxes(type="category")  # layer and expert ids are labels, not quantities
    fig.update_yaxes(type="category")
    return fig


def lines(
    x: Sequence[object], series: dict[str, np.ndarray], title: str, x_title: str, y_title: str
) -> go.Figure:
    fig = go.Figure([go.Scatter(x=list(x), y=v, mode="lines+markers", name=k) for k, v in series.items()])
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, **_LAYOUT)
    return fig


def bars(
    x: Sequence[object], series: dict[str, np.ndarray], title: str, x_title: str, y_title: str
) -> go.Figure:
    fig = go.Figure([go.Bar(x=list(x), y=v, name=k) for k, v in series.items()])
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, barmode="group", **_LAYOUT)
    return fig


def points(
    series: dict[str, tuple[Sequence[float], Sequence[float], Sequence[str]]], title: str, x_title: str, y_title: str
) -> go.Figure:
    """One line of labelled markers per series: name -> (x, y, label of each point)."""
    fig = go.Figure([go.Scatter(x=list(x), y=list(y), text=list(t), mode="lines+markers+text", name=k,
                                textposition="top center") for k, (x, y, t) in series.items()])
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, **_LAYOUT)
    return fig

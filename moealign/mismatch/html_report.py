"""The self-contained HTML report of ``moealign mismatch --report DIR``.

:func:`render_html` turns the report dict (see below) into one HTML page that opens offline: no external URL,
no script at all, no web font; the plots are drawn with matplotlib (Agg / SVG backends only, never pyplot, so no
display is needed) and embedded as inline SVG with their text as paths. :func:`write_report_dir` writes
``report.html`` and ``report.json`` (strict JSON: NaN and infinities written as ``null``) atomically into a
directory.

Every text that comes from the report is escaped (:func:`html.escape`): token texts can hold ``<``, ``&`` and
quotes. Every section may be absent or empty: a plot without data is a ``<figure class="plot missing">`` saying
"not measured: REASON", a table without rows says the same; NaN values are skipped in plots and shown as
"n/a" in tables.

The input (extra keys are ignored)::

    model, rollout {engine, precision, dtype}, train {...}, num_tokens, moe_layers, elapsed_s,
    warnings [str] (shown first, when any),
    runs [{name, metrics {...}}],
    levers {players [...], runs [{label, levers [...], metrics {mean_abs_logp_diff, kl_k3, max_abs_logp_diff,
            router_flip_rate, per_layer_flip_rate [...]}}]},
    attribution {primary, metrics {METRIC: {gap, residual, shares {cause: float}}}},
    diagnosis {headline, first_lever, preset, text [...], ranked [{cause, lever, share, fraction}],
               findings [{field, severity, message}]},
    plots {logp_hist {edges, series, zeros}, position {positions, series}, is_tail {grid, series {RUN: {above,
           below}}, icepop_band, tis_threshold}, kept_set {sizes, series {RUN: {tokens, support_mismatch_rate}}},
           worst_tokens [{sample, position, context, token, abs_logp_diff, rollout_logp, train_logp,
           flipped_layers}], full_vocab_kl {positions, series, summary {RUN: {mean, max}}},
           flip_rate {layers, series}},
    contract {rollout {...}, train {...}, fields [{field, rollout, train, status, message}]}
"""

from __future__ import annotations

import html
import io
import json
import math
import os
import re
from typing import Any, Callable

from .._files import atomic_write
from ..errors import ConfigError, MoealignError

__all__ = ["PLOT_IDS", "render_html", "report_json", "write_report_dir"]

#: The plots of the page, in order: ``<figure class="plot" id="plot-NAME">``.
PLOT_IDS = ("flip-rate", "logp-hist", "position", "is-tail", "kept-set", "attribution", "full-vocab-kl")

#: Rows of the worst-token table.
WORST_TOKENS = 20
#: Characters of context shown before a worst token.
CONTEXT_CHARS = 120
#: Scalar metrics shown first in the run tables (others follow in the report's order).
METRIC_ORDER = ("mean_abs_logp_diff", "max_abs_logp_diff", "kl_k3", "router_flip_rate", "token_flip_rate",
                "support_mismatch_rate")
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf")


class _Missing(MoealignError):
    """A plot or table that cannot be drawn; the message is the reason shown."""


# --------------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------------


def _plain(value: Any) -> str:
    """Escaped text for an attribute or the <title> (where no element may go)."""
    return html.escape(value if isinstance(value, str) else str(value), quote=True)


def _esc(value: Any) -> str:
    """Escaped text content, isolated in ``<bdi>``: a bidi control in model or user text (a prompt ending in U+202E)
    cannot reorder anything after it. Every piece of text the report shows goes through here."""
    text = _plain(value)
    return f"<bdi>{text}</bdi>" if text else ""


def _num(value: Any) -> float | None:
    """A finite float, or None (missing, NaN, inf, not a number)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _fmt(value: Any) -> str:
    """A number for a table: "n/a" for missing / NaN, 4 significant digits otherwise."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if value is None:
        return "n/a"
    try:
        x = float(value)
    except (TypeError, ValueError):
        return _esc(value)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def _text(value: Any) -> str:
    """Any report value as escaped text for a table cell."""
    if value is None:
        return "&mdash;"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _fmt(value)
    if isinstance(value, str):
        return _esc(value)
    try:
        return _esc(json.dumps(_strict(value), sort_keys=True))
    except (TypeError, ValueError):
        return _esc(value)


def _seq(value: Any) -> list:
    """A list from a list / tuple / array; anything else is a missing section."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    raise _Missing("no data" if value is None else f"malformed data ({type(value).__name__})")


def _floats(value: Any) -> list[float]:
    """Floats, NaN where an entry is missing or not a number."""
    out = []
    for v in _seq(value):
        x = _num(v)
        out.append(float("nan") if x is None else x)
    return out


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _strict(obj: Any) -> Any:
    """``obj`` with NaN / infinities as None, arrays and tuples as lists, keys as strings: strict JSON."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_strict(v) for v in obj]
    if hasattr(obj, "tolist"):                      # numpy / torch arrays and scalars
        return _strict(obj.tolist())
    if hasattr(obj, "item"):
        return _strict(obj.item())
    try:
        x = float(obj)
    except (TypeError, ValueError):
        return str(obj)
    return x if math.isfinite(x) else None


def report_json(report: dict) -> str:
    """The report as strict JSON (``indent=1``; NaN and infinities as ``null``)."""
    return json.dumps(_strict(report), indent=1, allow_nan=False) + "\n"


# --------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------


class _Colors:
    """One colour per run name, the same in every plot."""

    def __init__(self):
        self._map: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name not in self._map:
            self._map[name] = _PALETTE[len(self._map) % len(_PALETTE)]
        return self._map[name]


def _new_figure(width: float = 7.5, height: float = 3.8):
    # Figure objects with an explicit Agg canvas: no pyplot, no display, no change to the process's backend
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _label(name: Any) -> str:
    """A run name as a matplotlib label: ``$`` would start mathtext, a leading ``_`` hides it from the legend."""
    text = str(name).replace("$", r"\$")
    return " " + text if text.startswith("_") else text


_SVG_START = re.compile(r"<svg\b")
_SVG_IDS = re.compile(r'(\bid=")|(href="#)|(url\(#)')


def _svg(fig, name: str) -> str:
    """The figure as inline SVG: no XML prolog / DOCTYPE / metadata, ids prefixed per plot (several SVGs share
    one document), text drawn as paths (no font needed)."""
    import matplotlib
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": f"moealign-{name}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    start = _SVG_START.search(text)
    if start is None:
        raise _Missing("matplotlib wrote no <svg> element")
    text = text[start.start():]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    prefix = f"p-{name}-"
    return _SVG_IDS.sub(lambda m: m.group(0) + prefix, text).strip()


def _finish_axes(ax, *, legend: bool = True) -> None:
    ax.grid(True, alpha=0.3, which="major")
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", framealpha=0.8)


def _series(section: dict, key: str = "series") -> dict:
    series = section.get(key)
    if not isinstance(series, dict) or not series:
        raise _Missing("no series")
    return series


def _plot_flip_rate(report: dict, colors: _Colors) -> tuple[Any, str]:
    section = _dict(_dict(report.get("plots")).get("flip_rate"))
    if section.get("series"):
        series = {str(k): _floats(v) for k, v in _series(section).items()}
        layers = _seq(section.get("layers", report.get("moe_layers")))
    else:                                       # fall back to the lever runs' per-layer metrics
        runs = _dict(report.get("levers")).get("runs") or []
        series = {str(r.get("label")): _floats(_dict(r.get("metrics")).get("per_layer_flip_rate"))
                  for r in runs if isinstance(r, dict) and _dict(r.get("metrics")).get("per_layer_flip_rate")}
        if not series:
            raise _Missing("no per-layer router flip rates")
        layers = _seq(report.get("moe_layers") or list(range(max(len(v) for v in series.values()))))
    series = {k: v for k, v in series.items() if any(not math.isnan(x) for x in v)}
    if not series or not layers:
        raise _Missing("no per-layer router flip rates")
    fig, ax = _new_figure()
    n = len(series)
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(layers)) if j < len(values)
              and not math.isnan(values[j])]
        ys = [values[j] for j in range(len(layers)) if j < len(values) and not math.isnan(values[j])]
        ax.bar(xs, ys, width=width, label=_label(name), color=colors(name))
    ax.set_xticks(range(len(layers)), [str(x) for x in layers])
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("router flip rate")
    _finish_axes(ax)
    return fig, "Per-layer router flip rate (fraction of tokens whose expert set differs), one bar per run."


def _plot_logp_hist(report: dict, colors: _Colors) -> tuple[Any, str]:
    section = _dict(_dict(report.get("plots")).get("logp_hist"))
    edges = _floats(section.get("edges"))
    series = _series(section)
    zeros = _dict(section.get("zeros"))
    if len(edges) < 2 or any(math.isnan(e) or e <= 0 for e in edges):
        raise _Missing("no positive log-spaced bin edges")
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise _Missing("bin edges are not increasing")
    fig, ax = _new_figure()
    drawn = 0
    zero_notes = []
    for name, counts in series.items():
        name = str(name)
        counts = _floats(counts)
        if len(counts) != len(edges) - 1:
            raise _Missing(f"{name}: {len(counts)} counts for {len(edges) - 1} bins")
        nz = zeros.get(name)
        nz_text = _fmt(nz) if nz is not None else "n/a"
        zero_notes.append(f"{name}: {nz_text}")
        values = [c if c > 0 else float("nan") for c in counts]        # NaN / 0: no step on a log axis
        if all(math.isnan(v) for v in values):
            continue
        ax.stairs(values, edges, label=_label(f"{name} ({nz_text} exact zeros)"), color=colors(name), linewidth=1.5)
        drawn += 1
    if not drawn:
        raise _Missing("every histogram is empty")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|Δ log p| (rollout vs train)")
    ax.set_ylabel("tokens")
    _finish_axes(ax)
    return fig, ("Histogram of |Δ log p| per run (log-spaced bins). A log axis cannot show 0: exact zeros per run — "
                 + "; ".join(zero_notes) + ".")


def _lines(ax, xs: list, series: dict, colors: _Colors) -> int:
    drawn = 0
    for name, values in series.items():
        name = str(name)
        values = _floats(values)
        pts = [(x, y) for x, y in zip(xs, values) if _num(x) is not None and not math.isnan(y)]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=_label(name), color=colors(name), linewidth=1.3,
                marker="o" if len(pts) <= 30 else None, markersize=3)
        drawn += 1
    return drawn


def _by_position(report: dict, colors: _Colors, key: str, ylabel: str, missing: str) -> Any:
    """A figure of ``report["plots"][key]``: one line per run against the response position."""
    section = _dict(_dict(report.get("plots")).get(key))
    fig, ax = _new_figure()
    if not _lines(ax, _seq(section.get("positions")), _series(section), colors):
        raise _Missing(missing)
    ax.set_xlabel("position in the response")
    ax.set_ylabel(ylabel)
    _finish_axes(ax)
    return fig


def _plot_position(report: dict, colors: _Colors) -> tuple[Any, str]:
    fig = _by_position(report, colors, "position", "mean |Δ log p|", "no position has a token")
    return fig, "Mean |Δ log p| at each response position, one line per run (positions without a token skipped)."


def _plot_is_tail(report: dict, colors: _Colors) -> tuple[Any, str]:
    section = _dict(_dict(report.get("plots")).get("is_tail"))
    grid = _floats(section.get("grid"))
    series = _series(section)
    fig, ax = _new_figure()
    drawn = 0
    positive = False
    for name, tails in series.items():
        name = str(name)
        tails = _dict(tails)
        for side, keep, style in (("above", lambda g: g > 1, "-"), ("below", lambda g: g < 1, "--")):
            if tails.get(side) is None:
                continue
            values = _floats(tails[side])
            pts = [(g, y) for g, y in zip(grid, values) if not math.isnan(g) and g > 0 and keep(g)
                   and not math.isnan(y)]
            if not pts:
                continue
            positive |= any(y > 0 for _, y in pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colors(name),
                    label=_label(f"{name}: P(ratio {'>' if side == 'above' else '<'} x)"), linewidth=1.3)
            drawn += 1
    if not drawn:
        raise _Missing("no tail fractions")
    notes = []
    band = section.get("icepop_band")
    if isinstance(band, (list, tuple)) and len(band) == 2 and all(_num(b) is not None and _num(b) > 0 for b in band):
        lo, hi = float(band[0]), float(band[1])
        ax.axvspan(lo, hi, color="#999999", alpha=0.15, label=f"IcePop band [{lo:g}, {hi:g}]")
        notes.append(f"the IcePop band [{lo:g}, {hi:g}] is shaded")
    tis = _num(section.get("tis_threshold"))
    if tis is not None and tis > 0:
        ax.axvline(tis, color="black", linestyle=":", linewidth=1.2, label=f"TIS threshold {tis:g}")
        notes.append(f"the TIS threshold {tis:g} is the dotted line")
    ax.set_xscale("log")
    if positive:
        ax.set_yscale("log")
    ax.set_xlabel("IS ratio x = π_train / π_rollout")
    ax.set_ylabel("fraction of tokens")
    _finish_axes(ax)
    caption = "IS-ratio tails: fraction of tokens with ratio above x (x > 1, solid) and below x (x < 1, dashed)"
    return fig, caption + ("; " + ", ".join(notes) if notes else "") + "."


def _plot_kept_set(report: dict, colors: _Colors) -> tuple[Any, str]:
    section = _dict(_dict(report.get("plots")).get("kept_set"))
    sizes = _floats(section.get("sizes"))
    series = _series(section)
    fig, ax = _new_figure()
    drawn = 0
    for name, data in series.items():
        name = str(name)
        data = _dict(data)
        rates = _floats(data.get("support_mismatch_rate"))
        tokens = _floats(data["tokens"]) if data.get("tokens") is not None else [float("nan")] * len(rates)
        pts = [(s, r, t) for s, r, t in zip(sizes, rates, tokens + [float("nan")] * len(rates))
               if not math.isnan(s) and s > 0 and not math.isnan(r) and not (t == 0)]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=colors(name), label=_label(name), linewidth=1.2,
                markersize=4)
        drawn += 1
    if not drawn:
        raise _Missing("no kept-set bin has tokens")
    ax.set_xscale("log")
    ax.set_xlabel("kept-set size (bin upper edge)")
    ax.set_ylabel("support-mismatch rate")
    _finish_axes(ax)
    return fig, "Support-mismatch rate against the size of the rollout's kept set, per run (empty bins skipped)."


def _plot_attribution(report: dict, colors: _Colors) -> tuple[Any, str]:
    attribution = _dict(report.get("attribution"))
    metrics = _dict(attribution.get("metrics"))
    if not metrics:
        raise _Missing("no attribution")
    primary = attribution.get("primary")
    if primary not in metrics:
        primary = next(iter(metrics))
    entry = _dict(metrics[primary])
    bars = [(str(k), _num(v)) for k, v in _dict(entry.get("shares")).items()]
    bars.append(("residual", _num(entry.get("residual"))))
    bars = [(k, v) for k, v in bars if v is not None]
    if not bars:
        raise _Missing(f"no shares for {primary}")
    fig, ax = _new_figure(7.5, max(2.2, 0.45 * len(bars) + 1.2))
    names = [k for k, _ in bars][::-1]
    values = [v for _, v in bars][::-1]
    ax.barh(range(len(names)), values, color=["#7f7f7f" if n == "residual" else ("#1f77b4" if v >= 0 else "#ff7f0e")
                                  for n, v in zip(names, values)])
    ax.set_yticks(range(len(names)), [_label(n) for n in names])
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel(_label(f"share of the gap in {primary}"))
    _finish_axes(ax, legend=False)
    gap = _fmt(entry.get("gap"))
    return fig, (f"Attribution of {primary} (gap {gap}): the share of each cause (negative: turning its lever on "
                 "made the metric worse) and the residual no lever explains.")


def _plot_full_vocab_kl(report: dict, colors: _Colors) -> tuple[Any, str]:
    fig = _by_position(report, colors, "full_vocab_kl", "mean KL(π_rollout ‖ π_train)", "no full-vocabulary KL values")
    return fig, "Full-vocabulary KL per response position (mean over samples), one line per run."


_PLOTS: dict[str, tuple[str, Callable]] = {
    "flip-rate": ("Router flip rate per MoE layer", _plot_flip_rate),
    "logp-hist": ("|Δ log p| histogram", _plot_logp_hist),
    "position": ("|Δ log p| by position", _plot_position),
    "is-tail": ("IS-ratio tail", _plot_is_tail),
    "kept-set": ("Kept-set size vs support mismatch", _plot_kept_set),
    "attribution": ("Attribution", _plot_attribution),
    "full-vocab-kl": ("Full-vocabulary KL by position", _plot_full_vocab_kl),
}


def _figure(name: str, report: dict, colors: _Colors) -> str:
    title, builder = _PLOTS[name]
    fig = None
    try:
        fig, caption = builder(report, colors)
        svg = _svg(fig, name)
    except _Missing as exc:
        return _missing_figure(name, title, str(exc))
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        return _missing_figure(name, title, f"malformed data ({type(exc).__name__}: {exc})")
    finally:
        if fig is not None:
            fig.clear()
    return (f'<figure class="plot" id="plot-{name}"><h3>{_esc(title)}</h3>{svg}'
            f"<figcaption>{_esc(caption)}</figcaption></figure>")


def _missing_figure(name: str, title: str, reason: str) -> str:
    return (f'<figure class="plot missing" id="plot-{name}"><h3>{_esc(title)}</h3>'
            f'<p class="not-measured">not measured: {_esc(reason)}</p></figure>')


# --------------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------------


def _table(table_id: str, head: list[str], rows: list[str], *, caption: str | None = None) -> str:
    cap = f"<caption>{_esc(caption)}</caption>" if caption else ""
    th = "".join(f"<th>{_esc(h)}</th>" for h in head)
    return (f'<table id="{table_id}">{cap}<thead><tr>{th}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def _not_measured(table_id: str, reason: str) -> str:
    return f'<p class="not-measured" id="{table_id}">not measured: {_esc(reason)}</p>'


def _metric_columns(metric_dicts: list[dict]) -> list[str]:
    seen: list[str] = []
    for m in metric_dicts:
        for k, v in m.items():
            if k not in seen and (v is None or isinstance(v, (int, float)) and not isinstance(v, bool)):
                seen.append(k)
    return [k for k in METRIC_ORDER if k in seen] + [k for k in seen if k not in METRIC_ORDER]


def _runs_table(report: dict) -> str:
    runs = [r for r in (report.get("runs") or []) if isinstance(r, dict)]
    if not runs:
        return _not_measured("table-runs", "no runs")
    metrics = [_dict(r.get("metrics")) for r in runs]
    cols = _metric_columns(metrics)
    rows = [f"<tr><th>{_esc(r.get('name', '?'))}</th>" + "".join(f"<td class=\"num\">{_fmt(m.get(c))}</td>"
                                                                    for c in cols) + "</tr>"
            for r, m in zip(runs, metrics)]
    return _table("table-runs", ["run"] + cols, rows)


def _levers_table(report: dict) -> str:
    levers = _dict(report.get("levers"))
    runs = [r for r in (levers.get("runs") or []) if isinstance(r, dict)]
    if not runs:
        return _not_measured("table-levers", "no lever runs")
    metrics = [_dict(r.get("metrics")) for r in runs]
    cols = _metric_columns(metrics)
    rows = []
    for r, m in zip(runs, metrics):
        names = ", ".join(str(x) for x in (r.get("levers") or [])) or "none"
        rows.append(f"<tr><th>{_esc(r.get('label', '?'))}</th><td>{_esc(names)}</td>"
                    + "".join(f'<td class="num">{_fmt(m.get(c))}</td>' for c in cols) + "</tr>")
    players = ", ".join(str(p) for p in (levers.get("players") or []))
    return _table("table-levers", ["run", "levers on"] + cols, rows,
                  caption=f"levers: {players}" if players else None)


def _attribution_table(report: dict) -> str:
    attribution = _dict(report.get("attribution"))
    metrics = {str(k): _dict(v) for k, v in _dict(attribution.get("metrics")).items()}
    if not metrics:
        return _not_measured("table-attribution", "no attribution")
    causes: list[str] = []
    for entry in metrics.values():
        causes += [str(c) for c in _dict(entry.get("shares")) if str(c) not in causes]
    names = list(metrics)
    rows = [f"<tr><th>{_esc(c)}</th>" + "".join(f'<td class="num">{_fmt(_dict(metrics[n].get("shares")).get(c))}</td>'
                                                for n in names) + "</tr>" for c in causes]
    for key in ("residual", "gap"):
        rows.append(f'<tr class="{key}"><th>{key}</th>'
                    + "".join(f'<td class="num">{_fmt(metrics[n].get(key))}</td>' for n in names) + "</tr>")
    primary = attribution.get("primary")
    head = ["cause"] + [f"{n} (primary)" if n == primary else n for n in names]
    return _table("table-attribution", head, rows, caption="share of the gap explained by each cause")


def _worst_tokens_table(report: dict) -> str:
    tokens = _dict(report.get("plots")).get("worst_tokens")
    tokens = [t for t in (tokens or []) if isinstance(t, dict)] if isinstance(tokens, (list, tuple)) else []
    if not tokens:
        return _not_measured("table-worst-tokens", "no per-token scores")

    def key(t):
        x = _num(t.get("abs_logp_diff"))
        return (x is None, -(x or 0.0))

    rows = []
    for t in sorted(tokens, key=key)[:WORST_TOKENS]:
        context = t.get("context")
        context = "" if context is None else str(context)
        cut = "…" if len(context) > CONTEXT_CHARS else ""
        context = context[-CONTEXT_CHARS:]
        token = "" if t.get("token") is None else str(t.get("token"))
        flipped = t.get("flipped_layers")
        flipped = ", ".join(str(x) for x in flipped) if isinstance(flipped, (list, tuple)) and flipped else "none"
        rows.append(
            f'<tr><td class="num">{_text(t.get("sample"))}</td><td class="num">{_text(t.get("position"))}</td>'
            f'<td class="token-cell"><span class="context">{_esc(cut + context)}</span>'
            f'<mark class="token">{_esc(token)}</mark></td>'
            f'<td class="num">{_fmt(t.get("abs_logp_diff"))}</td><td class="num">{_fmt(t.get("rollout_logp"))}</td>'
            f'<td class="num">{_fmt(t.get("train_logp"))}</td><td>{_esc(flipped)}</td></tr>')
    return _table("table-worst-tokens", ["sample", "position", "token (in context)", "|Δ log p|", "rollout log p",
                                         "train log p", "flipped layers"], rows,
                  caption=f"the {len(rows)} tokens with the largest |Δ log p|")


def _contract_table(report: dict) -> str:
    fields = _dict(report.get("contract")).get("fields")
    fields = [f for f in (fields or []) if isinstance(f, dict)] if isinstance(fields, (list, tuple)) else []
    if not fields:
        return _not_measured("table-contract", "no execution contract")
    rows = []
    for f in fields:
        status = str(f.get("status", ""))
        cls = f' class="status-{_plain(status)}"' if status in ("gap", "info", "differs", "same") else ""
        rows.append(f"<tr{cls}><td><code>{_esc(f.get('field', ''))}</code></td><td>{_text(f.get('rollout'))}</td>"
                    f"<td>{_text(f.get('train'))}</td><td>{_esc(status)}</td><td>{_text(f.get('message'))}</td></tr>")
    return _table("table-contract", ["field", "rollout", "train", "status", "note"], rows,
                  caption="execution contract: rollout vs train")


def _kl_summary_table(report: dict) -> str:
    summary = _dict(_dict(_dict(report.get("plots")).get("full_vocab_kl")).get("summary"))
    if not summary:
        return ""
    rows = [f"<tr><th>{_esc(k)}</th><td class=\"num\">{_fmt(_dict(v).get('mean'))}</td>"
            f"<td class=\"num\">{_fmt(_dict(v).get('max'))}</td></tr>" for k, v in summary.items()]
    return _table("table-full-vocab-kl", ["run", "mean KL", "max KL"], rows, caption="full-vocabulary KL")


# --------------------------------------------------------------------------------------------------
# the page
# --------------------------------------------------------------------------------------------------


def _engine(side: Any) -> str:
    side = _dict(side)
    if not side:
        return "n/a"
    parts = [str(side.get("engine", "?"))]
    extra = [f"{k} {side[k]}" for k in ("precision", "dtype") if side.get(k) is not None]
    return _esc(parts[0] + (f" ({', '.join(extra)})" if extra else ""))


def _join(value: Any) -> str:
    """A list as "a, b, c" (escaped); anything else as a cell value."""
    if isinstance(value, (list, tuple)):
        return _esc(", ".join(str(x) for x in value)) or "n/a"
    return "n/a" if value is None else _text(value)


def _header(report: dict) -> str:
    facts = [("rollout", _engine(report.get("rollout"))), ("train", _engine(report.get("train"))),
             ("tokens", _text(report.get("num_tokens"))),
             ("MoE layers", _join(report.get("moe_layers"))),
             ("elapsed", f"{_fmt(report.get('elapsed_s'))} s")]
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts)
    return (f"<header><h1>Rollout vs train mismatch: {_esc(report.get('model', 'unknown model'))}</h1>"
            f'<dl class="facts">{dl}</dl></header>')


def _warnings(report: dict) -> str:
    """The run's warnings (``report["warnings"]``: routes or weights that are not the model's), above everything."""
    lines = report.get("warnings") or []
    if not isinstance(lines, list) or not lines:
        return ""
    items = "".join(f"<li>{_esc(line)}</li>" for line in lines)
    return f'<section id="warnings"><h2>Warnings</h2><ul class="warnings">{items}</ul></section>'


def _diagnosis(report: dict) -> str:
    d = _dict(report.get("diagnosis"))
    if not d:
        return '<section id="diagnosis"><h2>Diagnosis</h2>' + _not_measured("diagnosis-text", "no diagnosis") + \
            "</section>"
    out = ['<section id="diagnosis"><h2>Diagnosis</h2>']
    if d.get("headline"):
        out.append(f'<p class="headline">{_esc(d["headline"])}</p>')
    facts = []
    if d.get("first_lever"):
        facts.append(f"first lever to pull: <strong>{_esc(d['first_lever'])}</strong>")
    if "preset" in d:
        facts.append("suggested correction preset: " + (f"<code>{_esc(d['preset'])}</code>" if d["preset"]
                                                          else "none needed"))
    if facts:
        out.append(f"<p>{'; '.join(facts)}.</p>")
    text = d.get("text")
    if isinstance(text, str):
        text = [text]
    for line in text or []:
        out.append(f"<p>{_esc(line)}</p>")
    ranked = [r for r in (d.get("ranked") or []) if isinstance(r, dict)]
    if ranked:
        rows = [f"<tr><td>{_esc(r.get('cause', ''))}</td><td>{_esc(r.get('lever', '') or '')}</td>"
                f"<td class=\"num\">{_fmt(r.get('share'))}</td><td class=\"num\">{_fmt(r.get('fraction'))}</td></tr>"
                for r in ranked]
        out.append(_table("table-ranked", ["cause", "lever", "share", "fraction of the gap"], rows,
                          caption="causes, largest first"))
    findings = [f for f in (d.get("findings") or []) if isinstance(f, dict)]
    if findings:
        items = "".join(f'<li class="severity-{_plain(f.get("severity", ""))}"><code>{_esc(f.get("field", ""))}'
                        f'</code> ({_esc(f.get("severity", ""))}): {_esc(f.get("message", ""))}</li>'
                        for f in findings)
        out.append(f'<ul class="findings">{items}</ul>')
    out.append("</section>")
    return "".join(out)


_CSS = """
bdi,td,th,dd,li,caption,figcaption{unicode-bidi:isolate}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;margin:1.5em auto;
 max-width:1100px;padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.3em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1em;margin:.2em 0}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:.1em 1em;margin:0}dl.facts dt{font-weight:600}
dl.facts dd{margin:0}
p.headline{font-size:1.15em;font-weight:600;background:#f3f6fa;border-left:4px solid #1f77b4;padding:.5em .8em}
table{border-collapse:collapse;margin:.8em 0;font-size:.9em}caption{text-align:left;color:#555;padding:.2em 0}
th,td{border:1px solid #ddd;padding:.25em .5em;text-align:left;vertical-align:top}thead th{background:#f5f5f5}
td.num{text-align:right;font-variant-numeric:tabular-nums;font-family:ui-monospace,monospace}
tr.status-gap td{background:#fbd5d5}tr.status-info td{background:#fff3c4}
tr.residual th,tr.gap th{font-style:italic}
td.token-cell{font-family:ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;max-width:32em}
span.context{color:#999}mark.token{background:#ffe066;color:#000;font-weight:600}
li.severity-gap{color:#a00}ul.warnings li{color:#a00;font-weight:600}li.severity-info{color:#7a5d00}
figure.plot{margin:1.2em 0;padding:.5em;border:1px solid #eee;border-radius:4px}
figure.plot svg{max-width:100%;height:auto;display:block}
figure.plot figcaption{color:#444;font-size:.9em;margin-top:.3em}
figure.plot.missing{background:#fafafa}.not-measured{color:#888;font-style:italic}
"""


def _safe(builder: Callable[[dict], str], report: dict, section_id: str) -> str:
    """A header / table section, or "not measured: malformed data" when the report's values have the wrong
    types (a page is always produced)."""
    try:
        return builder(report)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        return _not_measured(section_id, f"malformed data ({type(exc).__name__}: {exc})")


def render_html(report: dict) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG, no script, no external resource)."""
    if not isinstance(report, dict):
        raise ConfigError(f"render_html: the report must be a dict, got {type(report).__name__}")
    colors = _Colors()
    runs = report.get("runs")
    lever_runs = _dict(report.get("levers")).get("runs")
    for name in ([str(r.get("name")) for r in (runs if isinstance(runs, list) else []) if isinstance(r, dict)]
                 + [str(r.get("label")) for r in (lever_runs if isinstance(lever_runs, list) else [])
                    if isinstance(r, dict)]):
        colors(name)
    title = f"moealign mismatch: {report.get('model', 'report')}"
    body = [
        _safe(_header, report, "header"),
        _safe(_warnings, report, "warnings"),
        _safe(_diagnosis, report, "diagnosis"),
        '<section id="tables"><h2>Tables</h2>',
        "<h3>Runs</h3>", _safe(_runs_table, report, "table-runs"),
        "<h3>Lever runs</h3>", _safe(_levers_table, report, "table-levers"),
        "<h3>Attribution</h3>", _safe(_attribution_table, report, "table-attribution"),
        "<h3>Worst tokens</h3>", _safe(_worst_tokens_table, report, "table-worst-tokens"),
        "<h3>Execution contract</h3>", _safe(_contract_table, report, "table-contract"),
        _safe(_kl_summary_table, report, "table-full-vocab-kl"),
        "</section>",
        '<section id="plots"><h2>Plots</h2>',
        *(_figure(name, report, colors) for name in PLOT_IDS),
        "</section>",
    ]
    csp = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_plain(title)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_report_dir(report: dict, directory: str | os.PathLike) -> dict[str, str]:
    """Write ``report.html`` and ``report.json`` (strict JSON) atomically into ``directory``, created if missing.

    Returns ``{"html": path, "json": path}``. A ``directory`` that exists and is not a directory is refused
    (:class:`~moealign.errors.ConfigError`); both files are rendered before either is written.
    """
    try:
        path = os.fspath(directory)
    except TypeError:
        path = None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"--report must be a non-empty directory path, got {directory!r}")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"--report {path}: exists and is not a directory")
    html_text = render_html(report)
    json_text = report_json(report)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--report {path}: cannot create the directory ({exc.strerror or exc})") from None
    out = {"html": os.path.join(path, "report.html"), "json": os.path.join(path, "report.json")}
    for key, text in (("json", json_text), ("html", html_text)):
        def writer(tmp: str, text: str = text) -> None:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
        atomic_write(out[key], writer, flag="--report", error_cls=ConfigError)
    return out

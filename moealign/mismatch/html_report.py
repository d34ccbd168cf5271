"""The self-contained HTML report of ``moealign mismatch --report DIR``.

:func:`render_html` turns the report dict (see below) into one HTML page that opens offline: no external URL,
no script at all, no web font; the plots are drawn with matplotlib (Agg / SVG backends only, never pyplot, so no
display is needed) and embedded as inline SVG with their text as paths. :func:`write_report_dir` writes
``report.html`` and ``report.json`` (strict JSON: NaN and infinities written as ``null``) atomically into a
directory.

The page leads with the answer: the headline, first lever, preset and causes by share next to the attribution
chart. Then the plots (one colour per run or cause name in every plot, :class:`_Colors`, listed once in a sticky
legend; each run's marks carry an SVG id ``...-run{INDEX}-{N}`` so a browser test can check the colours), the
diagnosis in words, the tables (each in a horizontally scrolling box; the lever table folded in ``<details>``).

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

import colorsys
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
PLOT_IDS = ("attribution", "flip-rate", "logp-hist", "position", "full-vocab-kl", "is-tail", "kept-set")

#: Rows of the worst-token table.
WORST_TOKENS = 20
#: Characters of context shown before a worst token.
CONTEXT_CHARS = 120
#: Scalar metrics shown first in the run tables (others follow in the report's order).
METRIC_ORDER = ("mean_abs_logp_diff", "max_abs_logp_diff", "kl_k3", "router_flip_rate", "token_flip_rate",
                "support_mismatch_rate")
#: Run colours, in order of first appearance (tab10 then tab20's light half, greys left out: grey is the residual's
#: and black the reference lines'). Past these, :class:`_Colors` generates further distinct colours.
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
            "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")
#: Colours no run gets: the attribution's residual bar and the plots' reference marks.
_RESERVED = ("#7f7f7f", "#000000", "#999999", "#c7c7c7")


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
    """The one mapping from a run (or lever set, or cause) name to its colour, the same in every plot.

    Every name gets a distinct colour (the palette first, then generated hues, never a reserved grey). Each drawn
    mark of a run carries an SVG id ``...-run{INDEX}-{N}`` (:meth:`gid`) so the page can be checked: one colour
    per run, no two runs sharing one. :meth:`legend` lists the runs the drawn plots used, once.
    """

    def __init__(self, names=()):
        self._map: dict[str, str] = {}
        self._used: list[str] = []          # names drawn by a finished figure, in order
        self._pending: list[str] = []       # names drawn by the figure being built
        self._marks = 0
        for name in names:
            self.colour(name)

    def colour(self, name: Any) -> str:
        """The colour of ``name`` (assigned on first sight), without marking it drawn."""
        name = str(name)
        if name not in self._map:
            taken = set(self._map.values()) | set(_RESERVED)
            i = len(self._map)
            colour = _PALETTE[i] if i < len(_PALETTE) else None
            k = 0
            while colour is None or colour in taken:       # golden-angle hues at three lightnesses
                hue = (0.61803398875 * (i + k)) % 1.0
                light = (0.45, 0.32, 0.6)[(i + k) % 3]
                colour = "#%02x%02x%02x" % tuple(round(255 * c) for c in colorsys.hls_to_rgb(hue, light, 0.65))
                k += 1
            self._map[name] = colour
        return self._map[name]

    def __call__(self, name: Any) -> str:
        """The colour of ``name``, marked as drawn by the figure being built."""
        name = str(name)
        if name not in self._pending:
            self._pending.append(name)
        return self.colour(name)

    def gid(self, name: Any) -> str:
        """A unique SVG id for one drawn mark of run ``name`` (its colour map index in it)."""
        self(name)
        self._marks += 1
        return f"run{list(self._map).index(str(name))}-{self._marks}"

    def begin(self) -> None:
        self._pending = []

    def commit(self) -> None:
        """The figure was drawn: its runs go into the legend."""
        self._used += [n for n in self._pending if n not in self._used]
        self._pending = []

    @property
    def used(self) -> list[str]:
        return list(self._used)

    def legend(self) -> str:
        """The colour legend of every run the drawn plots show (HTML, shown once above the plots)."""
        if not self._used:
            return ""
        order = list(self._map)
        used = sorted(self._used, key=order.index)
        items = "".join(
            f'<li data-run="{order.index(n)}" data-colour="{self._map[n]}"><svg class="swatch" width="22" height="12" '
            f'viewBox="0 0 22 12" aria-hidden="true"><rect width="22" height="12" rx="2" fill="{self._map[n]}"/>'
            f"</svg>{_esc(n)}</li>" for n in used)
        return f'<ul class="legend" id="run-colours" aria-label="one colour per run in every plot">{items}</ul>'


def _new_figure(width: float = 6.0, height: float = 3.3):
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


def _finish_axes(ax, *, legend: bool = False) -> None:
    """Grid lines; no run legend (the page shows the run colours once, above the plots); ``legend=True`` for
    marks that are not runs (bands, thresholds)."""
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
        bars = ax.bar(xs, ys, width=width, label=_label(name), color=colors(name))
        for bar in bars:
            bar.set_gid(colors.gid(name))
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
        ax.stairs(values, edges, label=_label(name), color=colors(name), linewidth=1.5, gid=colors.gid(name))
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
                marker="o" if len(pts) <= 30 else None, markersize=3, gid=colors.gid(name))
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


#: Panels per row of the IS-ratio tail's small multiples.
IS_TAIL_COLUMNS = 3


def _ratio_ticks(lo: float, hi: float) -> list[float]:
    """At most 6 plain ratio ticks (0.9, 1, 1.1, 2, ...) inside [lo, hi], 1 kept when inside."""
    nice = sorted({m * 10.0 ** e for e in range(-2, 3) for m in (1, 2, 5)} | {0.8, 0.9, 0.95, 1.05, 1.1, 1.25})
    ticks = [t for t in nice if lo <= t <= hi]
    while len(ticks) > 6:
        ticks = [t for i, t in enumerate(ticks) if i % 2 == 0 or t == 1.0]
    return ticks


def _plot_is_tail(report: dict, colors: _Colors) -> tuple[Any, str]:
    """Small multiples: one panel per run (its two tails in its colour), the first run drawn faintly in every other
    panel for reference, shared axes fitted to the ratios the runs reach; the IcePop band and the TIS threshold
    drawn where they fall in that range, and the caption says when no token reaches them."""
    section = _dict(_dict(report.get("plots")).get("is_tail"))
    grid = _floats(section.get("grid"))
    series = _series(section)
    curves: dict[str, list[tuple[str, list, list]]] = {}
    sides: dict[str, dict[str, list]] = {}
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
            curves.setdefault(name, []).append((style, [p[0] for p in pts], [p[1] for p in pts]))
            sides.setdefault(name, {})[side] = pts
    if not curves:
        raise _Missing("no tail fractions")
    band = section.get("icepop_band")
    band = ((float(band[0]), float(band[1])) if isinstance(band, (list, tuple)) and len(band) == 2
            and all(_num(b) is not None and _num(b) > 0 for b in band) else None)
    tis = _num(section.get("tis_threshold"))
    tis = tis if tis is not None and tis > 0 else None

    def none_beyond(side: str, limit: float) -> bool:
        """Every run's tail on ``side`` is 0 at a grid ratio inside ``limit``: no token's ratio passes it."""
        inside = (lambda g: g <= limit) if side == "above" else (lambda g: g >= limit)
        return all(any(inside(g) and y == 0 for g, y in sides.get(n, {}).get(side, [])) for n in curves)

    # x range: the ratios where some run has a tail (a bf16 vs fp32 run stays within a few percent of 1), padded;
    # without any tail, the band and the threshold
    xs_data = [x for run in curves.values() for _, xs, ys in run for x, y in zip(xs, ys) if y > 0]
    span = xs_data or list(band or ()) + ([tis] if tis is not None else [])
    if span:
        lo, hi = min(span + [1.0]), max(span + [1.0])
        pad = max((hi / lo) ** 0.08, 1.02)
        xlim = (lo / pad, hi * pad)
    else:
        xlim = None
    names = list(curves)
    cols = min(IS_TAIL_COLUMNS, len(names))
    rows = -(-len(names) // cols)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
    fig = Figure(figsize=(3.2 * cols + 0.4, 2.0 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    reference = names[0]
    for i, ax in enumerate(axes.flat):
        if i >= len(names):
            ax.set_visible(False)
            continue
        name = names[i]
        if band is not None:
            ax.axvspan(*band, color="#999999", alpha=0.15)
        if tis is not None:
            ax.axvline(tis, color="black", linestyle=":", linewidth=1.0)
        ax.axvline(1.0, color="black", linewidth=0.5, alpha=0.4)
        if name != reference:
            for style, xs, ys in curves[reference]:
                ax.plot(xs, ys, style, color=colors(reference), linewidth=1.0, alpha=0.35,
                        gid=colors.gid(reference))
        for style, xs, ys in curves[name]:
            ax.plot(xs, ys, style, color=colors(name), linewidth=1.6, gid=colors.gid(name))
        if positive and not any(y > 0 for _, _, ys in curves[name] for y in ys):
            ax.text(0.5, 0.5, "no tail: every ratio ≈ 1", transform=ax.transAxes, ha="center", va="center",
                    fontsize="small", color=colors(name))
        ax.set_title(_label(name), fontsize="medium", color=colors(name), loc="left")
        ax.set_xscale("log")
        if xlim is not None and xlim[0] < xlim[1]:
            ax.set_xlim(*xlim)
            ticks = _ratio_ticks(*xlim)
            if len(ticks) >= 2:
                ax.xaxis.set_major_locator(FixedLocator(ticks))
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(NullFormatter())
        if positive:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3, which="major")
    fig.supxlabel("IS ratio x = π_train / π_rollout", fontsize="medium")
    fig.supylabel("fraction of tokens", fontsize="medium")
    notes = []
    if band is not None:
        inside = none_beyond("above", band[1]) and none_beyond("below", band[0])
        notes.append(f"the IcePop band [{band[0]:g}, {band[1]:g}] is shaded"
                     + (" (every token's ratio lies inside it)" if inside else ""))
    if tis is not None:
        notes.append(f"the TIS threshold {tis:g} is the dotted line"
                     + (" (no token's ratio exceeds it)" if none_beyond("above", tis) else ""))
    caption = (f"IS-ratio tails, one panel per run: the fraction of tokens with ratio above x (x > 1, solid) and below "
               f"x (x < 1, dashed); {reference} drawn faintly in every other panel for reference; the x axis spans "
               f"the ratios the runs reach")
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
                markersize=4, gid=colors.gid(name))
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
    bars = sorted(((k, v) for k, v in bars if v is not None), key=lambda kv: -kv[1])
    residual = _num(entry.get("residual"))
    if residual is not None:
        bars.append(("residual", residual))
    if not bars:
        raise _Missing(f"no shares for {primary}")
    gap = _num(entry.get("gap"))
    fig, ax = _new_figure(5.6, max(2.0, 0.42 * len(bars) + 1.0))
    names = [k for k, _ in bars][::-1]
    values = [v for _, v in bars][::-1]
    for i, (n, v) in enumerate(zip(names, values)):
        if n == "residual":
            ax.barh([i], [v], color=_RESERVED[0])
        else:
            (bar,) = ax.barh([i], [v], color=colors(n), alpha=1.0 if v >= 0 else 0.45, hatch=None if v >= 0 else "//",
                             edgecolor=colors(n))
            bar.set_gid(colors.gid(n))
        text = f"{100 * v / gap:.0f}%" if gap else _fmt(v)
        ax.annotate(text, (v, i), xytext=(3 if v >= 0 else -3, 0), textcoords="offset points",
                    ha="left" if v >= 0 else "right", va="center", fontsize="small")
    ax.set_yticks(range(len(names)), [_label(n) for n in names])
    ax.axvline(0, color="black", linewidth=0.8)
    ax.margins(x=0.18)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.set_xlabel(_label(f"share of the gap in {primary}" + (f" ({gap:.4g})" if gap is not None else "")))
    ax.grid(True, axis="x", alpha=0.3)
    return fig, (f"Attribution of {primary} (gap {_fmt(entry.get('gap'))}): the share of each cause, largest first, "
                 "as a percentage of the gap (hatched, negative: turning its lever on made the metric worse), and "
                 "the residual no lever explains (grey). Each cause has its colour in every plot.")


def _plot_full_vocab_kl(report: dict, colors: _Colors) -> tuple[Any, str]:
    fig = _by_position(report, colors, "full_vocab_kl", "mean KL(π_rollout ‖ π_train)", "no full-vocabulary KL values")
    return fig, "Full-vocabulary KL per response position (mean over samples), one line per run."


_PLOTS: dict[str, tuple[str, Callable]] = {
    "attribution": ("What causes the gap", _plot_attribution),
    "flip-rate": ("Router flip rate per MoE layer", _plot_flip_rate),
    "logp-hist": ("|Δ log p| histogram", _plot_logp_hist),
    "position": ("|Δ log p| by position", _plot_position),
    "is-tail": ("IS-ratio tail", _plot_is_tail),
    "kept-set": ("Kept-set size vs support mismatch", _plot_kept_set),
    "full-vocab-kl": ("Full-vocabulary KL by position", _plot_full_vocab_kl),
}
#: Plots drawn across the whole width of the plot grid.
_WIDE = ("is-tail",)


def _figure(name: str, report: dict, colors: _Colors) -> str:
    title, builder = _PLOTS[name]
    fig = None
    colors.begin()
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
    colors.commit()
    wide = " wide" if name in _WIDE else ""
    return (f'<figure class="plot{wide}" id="plot-{name}"><h3>{_esc(title)}</h3>{svg}'
            f"<figcaption>{_esc(caption)}</figcaption></figure>")


def _missing_figure(name: str, title: str, reason: str) -> str:
    wide = " wide" if name in _WIDE else ""
    return (f'<figure class="plot missing{wide}" id="plot-{name}"><h3>{_esc(title)}</h3>'
            f'<p class="not-measured">not measured: {_esc(reason)}</p></figure>')


# --------------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------------


def _table(table_id: str, head: list[str], rows: list[str], *, caption: str | None = None) -> str:
    cap = f"<caption>{_esc(caption)}</caption>" if caption else ""
    th = "".join(f"<th>{_esc(h)}</th>" for h in head)
    return (f'<div class="scroll"><table id="{table_id}">{cap}<thead><tr>{th}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>")


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
    dl = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in facts)
    return (f"<header><h1>Rollout vs train mismatch: {_esc(report.get('model', 'unknown model'))}</h1>"
            f'<dl class="facts">{dl}</dl></header>')


def _warnings(report: dict) -> str:
    """The run's warnings (``report["warnings"]``: routes or weights that are not the model's), above everything."""
    lines = report.get("warnings") or []
    if not isinstance(lines, list) or not lines:
        return ""
    items = "".join(f"<li>{_esc(line)}</li>" for line in lines)
    return f'<section id="warnings"><h2>Warnings</h2><ul class="warnings">{items}</ul></section>'


def _summary(report: dict) -> str:
    """The answer, first on the page next to the attribution chart: the headline, the first lever, the preset and
    the causes by share."""
    d = _dict(report.get("diagnosis"))
    if not d:
        return '<div id="diagnosis"><h2>Diagnosis</h2>' + _not_measured("diagnosis-text", "no diagnosis") + "</div>"
    out = ['<div id="diagnosis"><h2>Diagnosis</h2>']
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
    ranked = [r for r in (d.get("ranked") or []) if isinstance(r, dict)]
    if ranked:
        rows = [f"<tr><td>{_esc(r.get('cause', ''))}</td><td>{_esc(r.get('lever', '') or '')}</td>"
                f"<td class=\"num\">{_fmt(r.get('share'))}</td><td class=\"num\">{_fmt(r.get('fraction'))}</td></tr>"
                for r in ranked]
        out.append(_table("table-ranked", ["cause", "lever", "share", "fraction of the gap"], rows,
                          caption="causes, largest first"))
    out.append("</div>")
    return "".join(out)


def _details(report: dict) -> str:
    """The diagnosis in words and the contract's findings, after the plots."""
    d = _dict(report.get("diagnosis"))
    text = d.get("text")
    if isinstance(text, str):
        text = [text]
    lines = [f"<p>{_esc(line)}</p>" for line in (text if isinstance(text, (list, tuple)) else [])]
    findings = [f for f in (d.get("findings") or []) if isinstance(f, dict)]
    if findings:
        items = "".join(f'<li class="severity-{_plain(f.get("severity", ""))}"><code>{_esc(f.get("field", ""))}'
                        f'</code> ({_esc(f.get("severity", ""))}): {_esc(f.get("message", ""))}</li>'
                        for f in findings)
        lines.append(f'<ul class="findings">{items}</ul>')
    if not lines:
        return ""
    return '<section id="diagnosis-details"><h2>The diagnosis in detail</h2>' + "".join(lines) + "</section>"


def _levers_details(report: dict) -> str:
    """The lever table, folded by default (``<details>``: no script)."""
    runs = [r for r in (_dict(report.get("levers")).get("runs") or []) if isinstance(r, dict)]
    summary = f"Lever runs: {len(runs)} lever set{'s' if len(runs) != 1 else ''} scored" if runs else "Lever runs"
    return (f'<details id="levers-details"><summary>{_esc(summary)}</summary>'
            f"{_levers_table(report)}</details>")


def _legend_note(report: dict, colors: _Colors) -> str:
    """What a cause's name means as a run (when the plots draw one)."""
    causes = {str(c) for e in _dict(_dict(report.get("attribution")).get("metrics")).values()
              for c in _dict(_dict(e).get("shares"))}
    if not causes & set(colors.used):
        return ""
    return ('<p class="legend-note">One colour per run in every plot. A cause names the run with its lever alone on '
            "(the same colour as its bar above); baseline: no lever; all levers: every lever on.</p>")


def _run_names(report: dict) -> list[str]:
    """The names the plots draw, in a fixed order (baseline first, then the attribution's causes, then the plot
    series), so that one name has one colour in every plot."""
    names: list[str] = ["baseline"]
    attribution = _dict(report.get("attribution"))
    for entry in _dict(attribution.get("metrics")).values():
        names += [str(c) for c in _dict(_dict(entry).get("shares"))]
    for section in _dict(report.get("plots")).values():
        series = _dict(section).get("series") if isinstance(section, dict) else None
        names += [str(k) for k in _dict(series)]
    return list(dict.fromkeys(names))


_CSS = """
bdi,td,th,dd,li,caption,figcaption,summary{unicode-bidi:isolate}
*,*::before,*::after{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;margin:.8em auto;
 max-width:1240px;padding:0 1em;color:#222;line-height:1.35}
h1{font-size:1.3em;margin:0 0 .2em}h2{border-bottom:1px solid #ddd;padding-bottom:.15em;margin:1.2em 0 .5em;
 font-size:1.2em}
h3{font-size:1em;margin:.2em 0}
dl.facts{display:flex;flex-wrap:wrap;gap:.1em 1.4em;margin:0;color:#444;font-size:.92em}
dl.facts div{display:flex;gap:.4em}dl.facts dt{font-weight:600}dl.facts dd{margin:0}
#answer{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1.15fr);gap:1.2em;align-items:start;margin-top:.6em}
#answer h2{margin-top:0}#answer figure.plot{margin:0}
p.headline{font-size:1.2em;font-weight:600;background:#f3f6fa;border-left:4px solid #333;padding:.5em .8em;
 margin:.4em 0}
div.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;margin:.6em 0;font-size:.88em}caption{text-align:left;color:#555;padding:.2em 0}
th,td{border:1px solid #ddd;padding:.2em .45em;text-align:left;vertical-align:top}thead th{background:#f5f5f5}
td.num{text-align:right;font-variant-numeric:tabular-nums;font-family:ui-monospace,monospace;white-space:nowrap}
tr.status-gap td{background:#fbd5d5}tr.status-info td{background:#fff3c4}
tr.residual th,tr.gap th{font-style:italic}
td.token-cell{font-family:ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;min-width:16em;
 max-width:32em}
span.context{color:#999}mark.token{background:#ffe066;color:#000;font-weight:600}
li.severity-gap{color:#a00}ul.warnings li{color:#a00;font-weight:600}li.severity-info{color:#7a5d00}
ul.legend{position:sticky;top:0;z-index:1;background:#fff;list-style:none;display:flex;flex-wrap:wrap;
 gap:.2em 1.3em;margin:0;padding:.4em 0;border-bottom:1px solid #eee;font-size:.92em}
ul.legend li{display:flex;align-items:center;gap:.35em}svg.swatch{flex:none}
div.plot-grid{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));grid-auto-flow:dense;gap:1em;
 margin-top:.6em}
figure.plot{margin:0;padding:.5em;border:1px solid #eee;border-radius:4px;min-width:0}
figure.plot.wide{grid-column:1/-1}
figure.plot svg{width:100%;max-width:100%;height:auto;display:block}
figure.plot.wide svg{max-width:1000px;margin:0 auto}
figure.plot figcaption{color:#444;font-size:.88em;margin-top:.3em}
p.legend-note{margin:.2em 0;color:#555;font-size:.9em}
figure.plot.missing{background:#fafafa}.not-measured{color:#888;font-style:italic}
details{margin:1em 0;border:1px solid #ddd;border-radius:4px;padding:.4em .6em}
details summary{cursor:pointer;font-weight:600}
@media (max-width:900px){#answer,div.plot-grid{grid-template-columns:minmax(0,1fr)}}
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
    colors = _Colors(_run_names(report))
    figures = {name: _figure(name, report, colors) for name in PLOT_IDS}
    title = f"moealign mismatch: {report.get('model', 'report')}"
    body = [
        _safe(_header, report, "header"),
        _safe(_warnings, report, "warnings"),
        '<section id="answer">', _safe(_summary, report, "diagnosis"), figures["attribution"], "</section>",
        '<section id="plots"><h2>Plots</h2>', _legend_note(report, colors), colors.legend(), '<div class="plot-grid">',
        *(figures[name] for name in PLOT_IDS if name != "attribution"),
        "</div></section>",
        _safe(_details, report, "diagnosis-details"),
        '<section id="tables"><h2>Tables</h2>',
        "<h3>Runs</h3>", _safe(_runs_table, report, "table-runs"),
        "<h3>Attribution</h3>", _safe(_attribution_table, report, "table-attribution"),
        "<h3>Worst tokens</h3>", _safe(_worst_tokens_table, report, "table-worst-tokens"),
        "<h3>Execution contract</h3>", _safe(_contract_table, report, "table-contract"),
        _safe(_kl_summary_table, report, "table-full-vocab-kl"),
        _safe(_levers_details, report, "table-levers"),
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

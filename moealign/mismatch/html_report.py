"""The self-contained HTML report of ``moealign mismatch --report DIR``: what it shows.

How it looks is :mod:`moealign.report_html`'s, shared with ``rl-check --report``: the page shell, the stylesheet,
the escaping, the SVG plots, one colour per run or cause (the same as in rl-check's report: no lever blue, every
lever green, routing replay orange, ...), the files. This module says what goes on the page.

:func:`render_html` turns the report dict (see below) into one HTML page that opens offline (no script, no
external resource; plots drawn by matplotlib as inline SVG). :func:`write_report_dir` writes ``report.html``
and ``report.json`` (strict JSON: NaN and infinities written as ``null``) atomically into a directory.

The page leads with the answer: the headline, first lever, preset and causes by share next to the attribution
chart. Then the plots (one colour per run or cause name in every plot, listed once in a sticky legend; each run's
marks carry an SVG id ``...-run{INDEX}-{N}`` so a browser test can check the colours), the diagnosis in words,
the tables (each in a horizontally scrolling box; the lever table folded in ``<details>``).

Every text that comes from the report is escaped (:func:`~moealign.report_html.esc`): token texts can hold ``<``,
``&`` and quotes. Every section may be absent or empty: a plot without data is a ``<figure class="plot missing">``
saying "not measured: REASON", a table without rows says the same; NaN values are skipped in plots and shown as
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

import math
import os
from typing import Any, Callable

from ..errors import ConfigError
from ..report_html import (ALL_LEVERS, NO_LEVER, RESERVED, NotMeasured, RunColours, answer_section, cell, engine_text,
                           esc, figure_html, finish_axes, floats, fmt, header, mapping, mpl_label, new_figure,
                           not_measured, num, page, plain, plot_lines, plots_section, report_json, safe, seq, table,
                           write_report_files)
from .levers import CAUSES

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


def _series(section: dict, key: str = "series") -> dict:
    series = section.get(key)
    if not isinstance(series, dict) or not series:
        raise NotMeasured("no series")
    return series


def _plot_flip_rate(report: dict, colours: RunColours) -> tuple[Any, str]:
    section = mapping(mapping(report.get("plots")).get("flip_rate"))
    if section.get("series"):
        series = {str(k): floats(v) for k, v in _series(section).items()}
        layers = seq(section.get("layers", report.get("moe_layers")))
    else:                                       # fall back to the lever runs' per-layer metrics
        runs = mapping(report.get("levers")).get("runs") or []
        series = {str(r.get("label")): floats(mapping(r.get("metrics")).get("per_layer_flip_rate"))
                  for r in runs if isinstance(r, dict) and mapping(r.get("metrics")).get("per_layer_flip_rate")}
        if not series:
            raise NotMeasured("no per-layer router flip rates")
        layers = seq(report.get("moe_layers") or list(range(max(len(v) for v in series.values()))))
    series = {k: v for k, v in series.items() if any(not math.isnan(x) for x in v)}
    if not series or not layers:
        raise NotMeasured("no per-layer router flip rates")
    fig, ax = new_figure()
    n = len(series)
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(layers)) if j < len(values)
              and not math.isnan(values[j])]
        ys = [values[j] for j in range(len(layers)) if j < len(values) and not math.isnan(values[j])]
        bars = ax.bar(xs, ys, width=width, label=mpl_label(name), color=colours(name))
        for bar in bars:
            bar.set_gid(colours.gid(name))
    ax.set_xticks(range(len(layers)), [str(x) for x in layers])
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("router flip rate")
    finish_axes(ax)
    return fig, "Per-layer router flip rate (fraction of tokens whose expert set differs), one bar per run."


def _plot_logp_hist(report: dict, colours: RunColours) -> tuple[Any, str]:
    section = mapping(mapping(report.get("plots")).get("logp_hist"))
    edges = floats(section.get("edges"))
    series = _series(section)
    zeros = mapping(section.get("zeros"))
    if len(edges) < 2 or any(math.isnan(e) or e <= 0 for e in edges):
        raise NotMeasured("no positive log-spaced bin edges")
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise NotMeasured("bin edges are not increasing")
    fig, ax = new_figure()
    drawn = 0
    zero_notes = []
    for name, counts in series.items():
        name = str(name)
        counts = floats(counts)
        if len(counts) != len(edges) - 1:
            raise NotMeasured(f"{name}: {len(counts)} counts for {len(edges) - 1} bins")
        nz = zeros.get(name)
        nz_text = fmt(nz) if nz is not None else "n/a"
        zero_notes.append(f"{name}: {nz_text}")
        values = [c if c > 0 else float("nan") for c in counts]        # NaN / 0: no step on a log axis
        if all(math.isnan(v) for v in values):
            continue
        ax.stairs(values, edges, label=mpl_label(name), color=colours(name), linewidth=1.5, gid=colours.gid(name))
        drawn += 1
    if not drawn:
        raise NotMeasured("every histogram is empty")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|Δ log p| (rollout vs train)")
    ax.set_ylabel("tokens")
    finish_axes(ax)
    return fig, ("Histogram of |Δ log p| per run (log-spaced bins). A log axis cannot show 0: exact zeros per run — "
                 + "; ".join(zero_notes) + ".")


def _by_position(report: dict, colours: RunColours, key: str, ylabel: str, missing: str) -> Any:
    """A figure of ``report["plots"][key]``: one line per run against the response position."""
    section = mapping(mapping(report.get("plots")).get(key))
    fig, ax = new_figure()
    positions = seq(section.get("positions"))
    if not plot_lines(ax, {name: (positions, values) for name, values in _series(section).items()}, colours):
        raise NotMeasured(missing)
    ax.set_xlabel("position in the response")
    ax.set_ylabel(ylabel)
    finish_axes(ax)
    return fig


def _plot_position(report: dict, colours: RunColours) -> tuple[Any, str]:
    fig = _by_position(report, colours, "position", "mean |Δ log p|", "no position has a token")
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


def _plot_is_tail(report: dict, colours: RunColours) -> tuple[Any, str]:
    """Small multiples: one panel per run (its two tails in its colour), the first run drawn faintly in every other
    panel for reference, shared axes fitted to the ratios the runs reach; the IcePop band and the TIS threshold
    drawn where they fall in that range, and the caption says when no token reaches them."""
    section = mapping(mapping(report.get("plots")).get("is_tail"))
    grid = floats(section.get("grid"))
    series = _series(section)
    curves: dict[str, list[tuple[str, list, list]]] = {}
    sides: dict[str, dict[str, list]] = {}
    positive = False
    for name, tails in series.items():
        name = str(name)
        tails = mapping(tails)
        for side, keep, style in (("above", lambda g: g > 1, "-"), ("below", lambda g: g < 1, "--")):
            if tails.get(side) is None:
                continue
            values = floats(tails[side])
            pts = [(g, y) for g, y in zip(grid, values) if not math.isnan(g) and g > 0 and keep(g)
                   and not math.isnan(y)]
            if not pts:
                continue
            positive |= any(y > 0 for _, y in pts)
            curves.setdefault(name, []).append((style, [p[0] for p in pts], [p[1] for p in pts]))
            sides.setdefault(name, {})[side] = pts
    if not curves:
        raise NotMeasured("no tail fractions")
    band = section.get("icepop_band")
    band = ((float(band[0]), float(band[1])) if isinstance(band, (list, tuple)) and len(band) == 2
            and all(num(b) is not None and num(b) > 0 for b in band) else None)
    tis = num(section.get("tis_threshold"))
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
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
    fig, axes = new_figure(3.2 * cols + 0.4, 2.0 * rows + 0.6, rows=rows, cols=cols, sharex=True, sharey=True,
                           squeeze=False)
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
                ax.plot(xs, ys, style, color=colours(reference), linewidth=1.0, alpha=0.35,
                        gid=colours.gid(reference))
        for style, xs, ys in curves[name]:
            ax.plot(xs, ys, style, color=colours(name), linewidth=1.6, gid=colours.gid(name))
        if positive and not any(y > 0 for _, _, ys in curves[name] for y in ys):
            ax.text(0.5, 0.5, "no tail: every ratio ≈ 1", transform=ax.transAxes, ha="center", va="center",
                    fontsize="small", color=colours(name))
        ax.set_title(mpl_label(name), fontsize="medium", color=colours(name), loc="left")
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


def _plot_kept_set(report: dict, colours: RunColours) -> tuple[Any, str]:
    section = mapping(mapping(report.get("plots")).get("kept_set"))
    sizes = floats(section.get("sizes"))
    series = _series(section)
    fig, ax = new_figure()
    drawn = 0
    for name, data in series.items():
        name = str(name)
        data = mapping(data)
        rates = floats(data.get("support_mismatch_rate"))
        tokens = floats(data["tokens"]) if data.get("tokens") is not None else [float("nan")] * len(rates)
        pts = [(s, r, t) for s, r, t in zip(sizes, rates, tokens + [float("nan")] * len(rates))
               if not math.isnan(s) and s > 0 and not math.isnan(r) and not (t == 0)]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=colours(name), label=mpl_label(name),
                linewidth=1.2, markersize=4, gid=colours.gid(name))
        drawn += 1
    if not drawn:
        raise NotMeasured("no kept-set bin has tokens")
    ax.set_xscale("log")
    ax.set_xlabel("kept-set size (bin upper edge)")
    ax.set_ylabel("support-mismatch rate")
    finish_axes(ax)
    return fig, "Support-mismatch rate against the size of the rollout's kept set, per run (empty bins skipped)."


def _plot_attribution(report: dict, colours: RunColours) -> tuple[Any, str]:
    attribution = mapping(report.get("attribution"))
    metrics = mapping(attribution.get("metrics"))
    if not metrics:
        raise NotMeasured("no attribution")
    primary = attribution.get("primary")
    if primary not in metrics:
        primary = next(iter(metrics))
    entry = mapping(metrics[primary])
    bars = [(str(k), num(v)) for k, v in mapping(entry.get("shares")).items()]
    bars = sorted(((k, v) for k, v in bars if v is not None), key=lambda kv: -kv[1])
    residual = num(entry.get("residual"))
    if residual is not None:
        bars.append(("residual", residual))
    if not bars:
        raise NotMeasured(f"no shares for {primary}")
    gap = num(entry.get("gap"))
    fig, ax = new_figure(5.6, max(2.0, 0.42 * len(bars) + 1.0))
    names = [k for k, _ in bars][::-1]
    values = [v for _, v in bars][::-1]
    for i, (n, v) in enumerate(zip(names, values)):
        if n == "residual":
            ax.barh([i], [v], color=RESERVED[0])
        else:
            (bar,) = ax.barh([i], [v], color=colours(n), alpha=1.0 if v >= 0 else 0.45,
                             hatch=None if v >= 0 else "//", edgecolor=colours(n))
            bar.set_gid(colours.gid(n))
        text = f"{100 * v / gap:.0f}%" if gap else fmt(v)
        ax.annotate(text, (v, i), xytext=(3 if v >= 0 else -3, 0), textcoords="offset points",
                    ha="left" if v >= 0 else "right", va="center", fontsize="small")
    ax.set_yticks(range(len(names)), [mpl_label(n) for n in names])
    ax.axvline(0, color="black", linewidth=0.8)
    ax.margins(x=0.18)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.set_xlabel(mpl_label(f"share of the gap in {primary}" + (f" ({gap:.4g})" if gap is not None else "")))
    ax.grid(True, axis="x", alpha=0.3)
    return fig, (f"Attribution of {primary} (gap {fmt(entry.get('gap'))}): the share of each cause, largest first, "
                 "as a percentage of the gap (hatched, negative: turning its lever on made the metric worse), and "
                 "the residual no lever explains (grey). Each cause has its colour in every plot.")


def _plot_full_vocab_kl(report: dict, colours: RunColours) -> tuple[Any, str]:
    fig = _by_position(report, colours, "full_vocab_kl", "mean KL(π_rollout ‖ π_train)", "no full-vocabulary KL values")
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


# --------------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------------


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
        return not_measured("table-runs", "no runs")
    metrics = [mapping(r.get("metrics")) for r in runs]
    cols = _metric_columns(metrics)
    rows = [f"<tr><th>{esc(r.get('name', '?'))}</th>" + "".join(f"<td class=\"num\">{fmt(m.get(c))}</td>"
                                                                    for c in cols) + "</tr>"
            for r, m in zip(runs, metrics)]
    return table("table-runs", ["run"] + cols, rows)


def _levers_table(report: dict) -> str:
    levers = mapping(report.get("levers"))
    runs = [r for r in (levers.get("runs") or []) if isinstance(r, dict)]
    if not runs:
        return not_measured("table-levers", "no lever runs")
    metrics = [mapping(r.get("metrics")) for r in runs]
    cols = _metric_columns(metrics)
    rows = []
    for r, m in zip(runs, metrics):
        names = ", ".join(str(x) for x in (r.get("levers") or [])) or "none"
        rows.append(f"<tr><th>{esc(r.get('label', '?'))}</th><td>{esc(names)}</td>"
                    + "".join(f'<td class="num">{fmt(m.get(c))}</td>' for c in cols) + "</tr>")
    players = ", ".join(str(p) for p in (levers.get("players") or []))
    return table("table-levers", ["run", "levers on"] + cols, rows,
                  caption=f"levers: {players}" if players else None)


def _attribution_table(report: dict) -> str:
    attribution = mapping(report.get("attribution"))
    metrics = {str(k): mapping(v) for k, v in mapping(attribution.get("metrics")).items()}
    if not metrics:
        return not_measured("table-attribution", "no attribution")
    causes: list[str] = []
    for entry in metrics.values():
        causes += [str(c) for c in mapping(entry.get("shares")) if str(c) not in causes]
    names = list(metrics)
    rows = [f"<tr><th>{esc(c)}</th>" + "".join(f'<td class="num">{fmt(mapping(metrics[n].get("shares")).get(c))}</td>'
                                                for n in names) + "</tr>" for c in causes]
    for key in ("residual", "gap"):
        rows.append(f'<tr class="{key}"><th>{key}</th>'
                    + "".join(f'<td class="num">{fmt(metrics[n].get(key))}</td>' for n in names) + "</tr>")
    primary = attribution.get("primary")
    head = ["cause"] + [f"{n} (primary)" if n == primary else n for n in names]
    return table("table-attribution", head, rows, caption="share of the gap explained by each cause")


def _worst_tokens_table(report: dict) -> str:
    tokens = mapping(report.get("plots")).get("worst_tokens")
    tokens = [t for t in (tokens or []) if isinstance(t, dict)] if isinstance(tokens, (list, tuple)) else []
    if not tokens:
        return not_measured("table-worst-tokens", "no per-token scores")

    def key(t):
        x = num(t.get("abs_logp_diff"))
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
            f'<tr><td class="num">{cell(t.get("sample"))}</td><td class="num">{cell(t.get("position"))}</td>'
            f'<td class="token-cell"><span class="context">{esc(cut + context)}</span>'
            f'<mark class="token">{esc(token)}</mark></td>'
            f'<td class="num">{fmt(t.get("abs_logp_diff"))}</td><td class="num">{fmt(t.get("rollout_logp"))}</td>'
            f'<td class="num">{fmt(t.get("train_logp"))}</td><td>{esc(flipped)}</td></tr>')
    return table("table-worst-tokens", ["sample", "position", "token (in context)", "|Δ log p|", "rollout log p",
                                         "train log p", "flipped layers"], rows,
                  caption=f"the {len(rows)} tokens with the largest |Δ log p|")


def _contract_table(report: dict) -> str:
    fields = mapping(report.get("contract")).get("fields")
    fields = [f for f in (fields or []) if isinstance(f, dict)] if isinstance(fields, (list, tuple)) else []
    if not fields:
        return not_measured("table-contract", "no execution contract")
    rows = []
    for f in fields:
        status = str(f.get("status", ""))
        cls = f' class="status-{plain(status)}"' if status in ("gap", "info", "differs", "same") else ""
        rows.append(f"<tr{cls}><td><code>{esc(f.get('field', ''))}</code></td><td>{cell(f.get('rollout'))}</td>"
                    f"<td>{cell(f.get('train'))}</td><td>{esc(status)}</td><td>{cell(f.get('message'))}</td></tr>")
    return table("table-contract", ["field", "rollout", "train", "status", "note"], rows,
                  caption="execution contract: rollout vs train")


def _kl_summary_table(report: dict) -> str:
    summary = mapping(mapping(mapping(report.get("plots")).get("full_vocab_kl")).get("summary"))
    if not summary:
        return ""
    rows = [f"<tr><th>{esc(k)}</th><td class=\"num\">{fmt(mapping(v).get('mean'))}</td>"
            f"<td class=\"num\">{fmt(mapping(v).get('max'))}</td></tr>" for k, v in summary.items()]
    return table("table-full-vocab-kl", ["run", "mean KL", "max KL"], rows, caption="full-vocabulary KL")


# --------------------------------------------------------------------------------------------------
# the page
# --------------------------------------------------------------------------------------------------


def _join(value: Any) -> str:
    """A list as "a, b, c" (escaped); anything else as a cell value."""
    if isinstance(value, (list, tuple)):
        return esc(", ".join(str(x) for x in value)) or "n/a"
    return "n/a" if value is None else cell(value)


def _header(report: dict) -> str:
    return header("Rollout vs train mismatch", report.get("model", "unknown model"), [
        ("rollout", engine_text(report.get("rollout"))), ("train", engine_text(report.get("train"))),
        ("tokens", cell(report.get("num_tokens"))), ("MoE layers", _join(report.get("moe_layers"))),
        ("elapsed", f"{fmt(report.get('elapsed_s'))} s")])


def _warnings(report: dict) -> str:
    """The run's warnings (``report["warnings"]``: routes or weights that are not the model's), above everything."""
    lines = report.get("warnings") or []
    if not isinstance(lines, list) or not lines:
        return ""
    items = "".join(f"<li>{esc(line)}</li>" for line in lines)
    return f'<section id="warnings"><h2>Warnings</h2><ul class="warnings">{items}</ul></section>'


def _summary(report: dict) -> str:
    """The answer, first on the page next to the attribution chart: the headline, the first lever, the preset and
    the causes by share."""
    d = mapping(report.get("diagnosis"))
    if not d:
        return '<div id="diagnosis"><h2>Diagnosis</h2>' + not_measured("diagnosis-text", "no diagnosis") + "</div>"
    out = ['<div id="diagnosis"><h2>Diagnosis</h2>']
    if d.get("headline"):
        out.append(f'<p class="headline">{esc(d["headline"])}</p>')
    facts = []
    if d.get("first_lever"):
        facts.append(f"first lever to pull: <strong>{esc(d['first_lever'])}</strong>")
    if "preset" in d:
        facts.append("suggested correction preset" + (f" for {esc(d['preset_for'])}" if d.get("preset_for") else "")
                     + ": " + (f"<code>{esc(d['preset'])}</code>" if d["preset"] else "none needed"))
    if facts:
        out.append(f"<p>{'; '.join(facts)}.</p>")
    if d.get("aligned_switch"):
        out.append(f'<p class="aligned-switch" id="aligned-switch"><strong>Bitwise:</strong> {esc(d["aligned_switch"])}.</p>')
    ranked = [r for r in (d.get("ranked") or []) if isinstance(r, dict)]
    if ranked:
        rows = [f"<tr><td>{esc(r.get('cause', ''))}</td><td>{esc(r.get('lever', '') or '')}</td>"
                f"<td class=\"num\">{fmt(r.get('share'))}</td><td class=\"num\">{fmt(r.get('fraction'))}</td></tr>"
                for r in ranked]
        entry = _primary_entry(report)
        if entry is not None and "residual" in entry:
            gap = num(entry.get("gap"))
            residual = num(entry.get("residual"))
            why = f" ({entry['residual_cause']})" if entry.get("residual_cause") else ""
            rows.append(f'<tr class="residual"><td>residual after all levers{esc(why)}</td><td></td>'
                        f'<td class="num">{fmt(residual)}</td>'
                        f'<td class="num">{fmt(residual / gap if gap and residual is not None else None)}</td></tr>')
        out.append(table("table-ranked", ["cause", "lever", "share", "fraction of the gap"], rows,
                          caption="causes, largest first"))
    out.append("</div>")
    return "".join(out)


def _primary_entry(report: dict) -> dict | None:
    """The attribution of the primary metric (``{"gap", "residual", "levers", "shares", ...}``), or None."""
    attribution = mapping(report.get("attribution"))
    metrics = mapping(attribution.get("metrics"))
    entry = metrics.get(attribution.get("primary"))
    return mapping(entry) if entry else None


def _details(report: dict) -> str:
    """The diagnosis in words and the contract's findings, after the plots."""
    d = mapping(report.get("diagnosis"))
    text = d.get("text")
    if isinstance(text, str):
        text = [text]
    lines = [f"<p>{esc(line)}</p>" for line in (text if isinstance(text, (list, tuple)) else [])]
    findings = [f for f in (d.get("findings") or []) if isinstance(f, dict)]
    if findings:
        items = "".join(f'<li class="severity-{plain(f.get("severity", ""))}"><code>{esc(f.get("field", ""))}'
                        f'</code> ({esc(f.get("severity", ""))}): {esc(f.get("message", ""))}</li>'
                        for f in findings)
        lines.append(f'<ul class="findings">{items}</ul>')
    if not lines:
        return ""
    return '<section id="diagnosis-details"><h2>The diagnosis in detail</h2>' + "".join(lines) + "</section>"


def _levers_details(report: dict) -> str:
    """The lever table, folded by default (``<details>``: no script)."""
    runs = [r for r in (mapping(report.get("levers")).get("runs") or []) if isinstance(r, dict)]
    summary = f"Lever runs: {len(runs)} lever set{'s' if len(runs) != 1 else ''} scored" if runs else "Lever runs"
    return (f'<details id="levers-details"><summary>{esc(summary)}</summary>'
            f"{_levers_table(report)}</details>")


def _legend_note(report: dict, colours: RunColours) -> str:
    """What a cause's name means as a run (when the plots draw one)."""
    causes = {str(c) for e in mapping(mapping(report.get("attribution")).get("metrics")).values()
              for c in mapping(mapping(e).get("shares"))}
    if not causes & set(colours.used):
        return ""
    return ('<p class="legend-note">One colour per run in every plot. A cause names the run with its lever alone on '
            "(the same colour as its bar above); baseline: no lever; all levers: every lever on.</p>")


def _roles(names: list[str]) -> dict[str, str]:
    """The role of each run name the plots draw (:data:`~moealign.report_html.LEVER_COLOURS`): baseline no lever,
    all levers every lever, a cause the run with its lever alone on; so a run has the same colour as in rl-check's
    report (stock: no lever, aligned: every lever)."""
    by_cause = {cause: lever for lever, cause in CAUSES.items()}
    roles = {"baseline": NO_LEVER, "all levers": ALL_LEVERS}
    return {n: roles.get(n, by_cause.get(n)) for n in names if n in roles or n in by_cause}


def _run_names(report: dict) -> list[str]:
    """The names the plots draw, in a fixed order (baseline first, then the attribution's causes, then the plot
    series), so that one name has one colour in every plot."""
    names: list[str] = ["baseline"]
    attribution = mapping(report.get("attribution"))
    for entry in mapping(attribution.get("metrics")).values():
        names += [str(c) for c in mapping(mapping(entry).get("shares"))]
    for section in mapping(report.get("plots")).values():
        series = mapping(section).get("series") if isinstance(section, dict) else None
        names += [str(k) for k in mapping(series)]
    return list(dict.fromkeys(names))


def _figure(name: str, report: dict, colours: RunColours) -> str:
    title, builder = _PLOTS[name]
    return figure_html(name, title, lambda: builder(report, colours), colours, wide=name in _WIDE)


def render_html(report: dict) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG, no script, no external resource)."""
    if not isinstance(report, dict):
        raise ConfigError(f"render_html: the report must be a dict, got {type(report).__name__}")
    names = _run_names(report)
    colours = RunColours(names, roles=_roles(names))
    figures = {name: _figure(name, report, colours) for name in PLOT_IDS}
    body = [
        safe(_header, report, "header"),
        safe(_warnings, report, "warnings"),
        answer_section(safe(_summary, report, "diagnosis"), figures["attribution"]),
        plots_section([figures[name] for name in PLOT_IDS if name != "attribution"], colours,
                      note=_legend_note(report, colours)),
        safe(_details, report, "diagnosis-details"),
        '<section id="tables"><h2>Tables</h2>',
        "<h3>Runs</h3>", safe(_runs_table, report, "table-runs"),
        "<h3>Attribution</h3>", safe(_attribution_table, report, "table-attribution"),
        "<h3>Worst tokens</h3>", safe(_worst_tokens_table, report, "table-worst-tokens"),
        "<h3>Execution contract</h3>", safe(_contract_table, report, "table-contract"),
        safe(_kl_summary_table, report, "table-full-vocab-kl"),
        safe(_levers_details, report, "table-levers"),
        "</section>",
    ]
    return page(f"moealign mismatch: {report.get('model', 'report')}", body)


def write_report_dir(report: dict, directory: str | os.PathLike) -> dict[str, str]:
    """Write ``report.html`` and ``report.json`` (strict JSON) atomically into ``directory``, created if missing.

    Returns ``{"html": path, "json": path}``. A ``directory`` that exists and is not a directory is refused
    (:class:`~moealign.errors.ConfigError`); both files are rendered before either is written.
    """
    return write_report_files(directory, lambda: (render_html(report), report_json(report)))

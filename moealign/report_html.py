"""The one look of moealign's HTML reports (``mismatch --report DIR`` and ``rl-check --report DIR``).

Both reports are thin: they say what to show (:mod:`moealign.mismatch.html_report`,
:mod:`moealign.rl.report`); this module says how, once:

* **the page shell** (:func:`page`): one self-contained HTML page that opens offline (no script, no external
  URL, no web font; a Content-Security-Policy that forbids any fetch), one stylesheet (:data:`CSS`), the header
  (:func:`header`: title and facts), the answer first (:func:`answer_section`: the verdict next to the lead
  picture, side by side on the first screen), the plots (:func:`plots_section`: the colour legend once, sticky,
  then the plot grid), tables that scroll in their own box (:func:`table`);
* **escaping**: every text that comes from a report (model or user text: token texts, prompts, run names) goes
  through :func:`esc` (:func:`html.escape`, isolated in ``<bdi>`` so a bidi control cannot reorder what follows)
  or :func:`plain` (attributes, ``<title>``);
* **the plots** (:func:`figure_html`): matplotlib Figure objects on an Agg canvas (never pyplot, no display, the
  process's backend untouched), embedded as inline SVG with text drawn as paths and ids prefixed per plot; a plot
  that cannot be drawn is a ``<figure class="plot missing">`` saying "not measured: REASON" (:class:`NotMeasured`,
  or malformed data);
* **one colour per run or cause** (:class:`RunColours`, :data:`LEVER_COLOURS`): a run is coloured by the levers it
  has on, the same in both reports: no lever (mismatch's ``baseline``, rl-check's ``stock``) blue, every lever
  (mismatch's ``all levers``, rl-check's ``aligned``) green, routing replay alone (mismatch's cause ``routing
  flips``, ``rl-check --levers replay``) orange, the sampling mask alone purple, and so on; other names get
  further colours, never a lever's and never a reserved grey; each drawn mark carries an SVG id
  ``...-run{INDEX}-{N}`` so a browser test can check that one run has one colour;
* **the files** (:func:`write_report_files`): ``report.html`` and ``report.json`` (strict JSON: NaN and
  infinities as ``null``, :func:`report_json`), both rendered before either is written, each written atomically
  (:func:`moealign._files.atomic_write`).

This module imports neither command (``moealign.mismatch``, ``moealign.rl``); both import it.
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

from ._files import atomic_write
from .errors import ConfigError, MoealignError

__all__ = ["CSS", "LEVER_COLOURS", "NO_LEVER", "ALL_LEVERS", "OTHER_COLOURS", "RESERVED", "NotMeasured",
           "RunColours", "plain", "esc", "num", "fmt", "cell", "seq", "floats", "mapping", "strict", "report_json",
           "new_figure", "mpl_label", "svg_of", "finish_axes", "plot_lines", "figure_html", "missing_figure",
           "table", "not_measured", "safe", "engine_text", "header", "answer_section", "plots_section", "page",
           "write_report_files"]

# --------------------------------------------------------------------------------------------------
# the palette: one colour per run or cause, the same in every report
# --------------------------------------------------------------------------------------------------

#: The role of a run with no lever on (mismatch's ``baseline``, rl-check's ``stock``).
NO_LEVER = "none"
#: The role of a run with every lever on (mismatch's ``all levers``, rl-check's ``aligned``).
ALL_LEVERS = "all"
#: The colour of each role: no lever, every lever, and each lever alone by its name (the run with that lever alone
#: on, named in the mismatch report by the cause it removes). The same in both reports.
LEVER_COLOURS = {
    NO_LEVER: "#1f77b4",                # blue
    ALL_LEVERS: "#2ca02c",              # green
    "routing_replay": "#ff7f0e",        # orange
    "sampling_mask": "#9467bd",         # purple
    "precision": "#d62728",             # red
    "precision:router": "#8c564b",
    "precision:attention": "#e377c2",
    "precision:experts": "#bcbd22",
    "precision:lm_head": "#17becf",
    "precision:other": "#aec7e8",
    "precision:fp8": "#ffbb78",
    "batch_invariant": "#98df8a",
    "weights": "#ff9896",
    "canonical": "#c5b0d5",             # the default pair's diagnosis: each engine's own kernels
    "prefill": "#c49c94",               # ... and prefill vs decode
}
#: Colours of names without a role, in order of first appearance (tab20's light half); past these,
#: :class:`RunColours` generates further distinct colours.
OTHER_COLOURS = ("#f7b6d2", "#dbdb8d", "#9edae5")
#: Colours no run gets: the attribution's residual bar (the first) and the plots' reference marks.
RESERVED = ("#7f7f7f", "#000000", "#999999", "#c7c7c7")


class NotMeasured(MoealignError):
    """A plot or table that cannot be drawn; the message is the reason shown ("not measured: REASON")."""


class RunColours:
    """The one mapping from a run (or lever set, or cause) name to its colour, the same in every plot of a page
    and, through ``roles``, the same in both reports.

    ``roles``: ``{name: role}``, a role being a key of :data:`LEVER_COLOURS` (the levers the named run has on). A
    name with a role gets the role's colour (unless another name took it first); every other name gets a distinct
    colour of :data:`OTHER_COLOURS`, then generated hues, never a lever's colour nor a reserved grey. Each drawn
    mark of a run carries an SVG id ``...-run{INDEX}-{N}`` (:meth:`gid`); :meth:`legend` lists the runs the drawn
    plots used, once.
    """

    def __init__(self, names=(), roles: dict | None = None):
        self._roles = {str(k): str(v) for k, v in (roles or {}).items()}
        self._map: dict[str, str] = {}
        self._used: list[str] = []          # names drawn by a finished figure, in order
        self._pending: list[str] = []       # names drawn by the figure being built
        self._marks = 0
        self._others = 0                    # names given a colour without a role
        for name in names:
            self.colour(name)

    def colour(self, name: Any) -> str:
        """The colour of ``name`` (assigned on first sight), without marking it drawn."""
        name = str(name)
        if name not in self._map:
            taken = set(self._map.values())
            colour = LEVER_COLOURS.get(self._roles.get(name, ""))
            if colour is None or colour in taken:
                colour = self._other(taken)
            self._map[name] = colour
        return self._map[name]

    def _other(self, taken: set) -> str:
        refused = taken | set(RESERVED) | set(LEVER_COLOURS.values())
        colour = next((c for c in OTHER_COLOURS if c not in refused), None)
        i, k = self._others, 0
        while colour is None or colour in refused:      # golden-angle hues at three lightnesses
            hue = (0.61803398875 * (i + k)) % 1.0
            light = (0.45, 0.32, 0.6)[(i + k) % 3]
            colour = "#%02x%02x%02x" % tuple(round(255 * c) for c in colorsys.hls_to_rgb(hue, light, 0.65))
            k += 1
        self._others += 1
        return colour

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

    def swatch(self, name: Any) -> str:
        """A small box in the colour of ``name`` (inline SVG)."""
        return (f'<svg class="swatch" width="22" height="12" viewBox="0 0 22 12" aria-hidden="true"><rect width="22" '
                f'height="12" rx="2" fill="{self.colour(name)}"/></svg>')

    def legend(self) -> str:
        """The colour legend of every run the drawn plots show (HTML, shown once above the plots)."""
        if not self._used:
            return ""
        order = list(self._map)
        used = sorted(self._used, key=order.index)
        items = "".join(f'<li data-run="{order.index(n)}" data-colour="{self._map[n]}">{self.swatch(n)}{esc(n)}</li>'
                        for n in used)
        return f'<ul class="legend" id="run-colours" aria-label="one colour per run in every plot">{items}</ul>'


# --------------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------------


def plain(value: Any) -> str:
    """Escaped text for an attribute or the <title> (where no element may go)."""
    return html.escape(value if isinstance(value, str) else str(value), quote=True)


def esc(value: Any) -> str:
    """Escaped text content, isolated in ``<bdi>``: a bidi control in model or user text (a prompt ending in U+202E)
    cannot reorder anything after it. Every piece of text a report shows goes through here."""
    text = plain(value)
    return f"<bdi>{text}</bdi>" if text else ""


def num(value: Any) -> float | None:
    """A finite float, or None (missing, NaN, inf, not a number)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def fmt(value: Any) -> str:
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
        return esc(value)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def cell(value: Any) -> str:
    """Any report value as escaped text for a table cell."""
    if value is None:
        return "&mdash;"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt(value)
    if isinstance(value, str):
        return esc(value)
    try:
        return esc(json.dumps(strict(value), sort_keys=True))
    except (TypeError, ValueError):
        return esc(value)


def seq(value: Any) -> list:
    """A list from a list / tuple / array; anything else is a plot or table not measured."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    raise NotMeasured("no data" if value is None else f"malformed data ({type(value).__name__})")


def floats(value: Any) -> list[float]:
    """Floats, NaN where an entry is missing or not a number."""
    out = []
    for v in seq(value):
        x = num(v)
        out.append(float("nan") if x is None else x)
    return out


def mapping(value: Any) -> dict:
    """``value`` if it is a dict, else ``{}`` (a report section of the wrong type reads as absent)."""
    return value if isinstance(value, dict) else {}


def strict(obj: Any) -> Any:
    """``obj`` with NaN / infinities as None, arrays and tuples as lists, keys as strings: strict JSON."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [strict(v) for v in obj]
    if hasattr(obj, "tolist"):                      # numpy / torch arrays and scalars
        return strict(obj.tolist())
    if hasattr(obj, "item"):
        return strict(obj.item())
    try:
        x = float(obj)
    except (TypeError, ValueError):
        return str(obj)
    return x if math.isfinite(x) else None


def report_json(report: dict) -> str:
    """The report as strict JSON (``indent=1``; NaN and infinities as ``null``)."""
    return json.dumps(strict(report), indent=1, allow_nan=False) + "\n"


# --------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------


def new_figure(width: float = 6.0, height: float = 3.3, *, rows: int | None = None, cols: int | None = None,
               **subplots):
    """A Figure on an explicit Agg canvas (no pyplot, no display, the process's backend untouched), constrained
    layout, and its axes: one, or a ``rows`` x ``cols`` array (``subplots`` passed to :meth:`Figure.subplots`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    if rows is None and cols is None:
        return fig, fig.add_subplot()
    return fig, fig.subplots(rows or 1, cols or 1, **subplots)


def mpl_label(name: Any) -> str:
    """A run name as a matplotlib label: ``$`` would start mathtext, a leading ``_`` hides it from the legend."""
    text = str(name).replace("$", r"\$")
    return " " + text if text.startswith("_") else text


_SVG_START = re.compile(r"<svg\b")
_SVG_IDS = re.compile(r'(\bid=")|(href="#)|(url\(#)')


def svg_of(fig, name: str) -> str:
    """The figure as inline SVG: no XML prolog / DOCTYPE / metadata, ids prefixed per plot (several SVGs share
    one document), text drawn as paths (no font needed)."""
    import matplotlib
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": f"moealign-{name}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    start = _SVG_START.search(text)
    if start is None:
        raise NotMeasured("matplotlib wrote no <svg> element")
    text = text[start.start():]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    prefix = f"p-{name}-"
    return _SVG_IDS.sub(lambda m: m.group(0) + prefix, text).strip()


def finish_axes(ax, *, legend: bool = False) -> None:
    """Grid lines; no run legend (the page shows the run colours once, above the plots); ``legend=True`` for
    marks that are not runs (bands, thresholds)."""
    ax.grid(True, alpha=0.3, which="major")
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", framealpha=0.8)


def plot_lines(ax, series: dict, colours: RunColours) -> int:
    """One line per run: ``series`` is ``{name: (xs, ys)}``; points whose x or y is missing / NaN are skipped, a
    run without a point is not drawn. Returns the number of runs drawn."""
    drawn = 0
    for name, (xs, ys) in series.items():
        name = str(name)
        ys = floats(ys)
        pts = [(x, y) for x, y in zip(seq(xs), ys) if num(x) is not None and not math.isnan(y)]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=mpl_label(name), color=colours(name), linewidth=1.3,
                marker="o" if len(pts) <= 30 else None, markersize=3, gid=colours.gid(name))
        drawn += 1
    return drawn


#: Errors of a report's values of the wrong type: the section is "not measured: malformed data" (a page is always
#: produced).
_MALFORMED = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError)


def figure_html(name: str, title: str, build: Callable[[], tuple[Any, str]], colours: RunColours, *,
                wide: bool = False) -> str:
    """``<figure class="plot" id="plot-NAME">``: ``build()`` returns ``(matplotlib figure, caption)``; it raises
    :class:`NotMeasured` (or fails on malformed data) for a plot that cannot be drawn, which becomes a missing
    figure (and adds nothing to the legend). ``wide``: across the whole plot grid."""
    fig = None
    colours.begin()
    try:
        fig, caption = build()
        svg = svg_of(fig, name)
    except NotMeasured as exc:
        return missing_figure(name, title, str(exc), wide=wide)
    except _MALFORMED as exc:
        return missing_figure(name, title, f"malformed data ({type(exc).__name__}: {exc})", wide=wide)
    finally:
        if fig is not None:
            fig.clear()
    colours.commit()
    cls = " wide" if wide else ""
    return (f'<figure class="plot{cls}" id="plot-{name}"><h3>{esc(title)}</h3>{svg}'
            f"<figcaption>{esc(caption)}</figcaption></figure>")


def missing_figure(name: str, title: str, reason: str, *, wide: bool = False) -> str:
    cls = " wide" if wide else ""
    return (f'<figure class="plot missing{cls}" id="plot-{name}"><h3>{esc(title)}</h3>'
            f'<p class="not-measured">not measured: {esc(reason)}</p></figure>')


# --------------------------------------------------------------------------------------------------
# tables and sections
# --------------------------------------------------------------------------------------------------


def table(table_id: str, head: list[str], rows: list[str], *, caption: str | None = None) -> str:
    """A table in its own horizontally scrolling box; ``rows``: ``<tr>`` HTML (values already escaped)."""
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    return (f'<div class="scroll"><table id="{table_id}">{cap}<thead><tr>{th}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def not_measured(element_id: str, reason: str) -> str:
    return f'<p class="not-measured" id="{element_id}">not measured: {esc(reason)}</p>'


def safe(builder: Callable[[dict], str], report: dict, section_id: str) -> str:
    """A section built by ``builder(report)``, or "not measured: malformed data" when the report's values have the
    wrong types (a page is always produced)."""
    try:
        return builder(report)
    except _MALFORMED as exc:
        return not_measured(section_id, f"malformed data ({type(exc).__name__}: {exc})")


def engine_text(side: Any, extra: tuple[str, ...] = ("precision", "dtype")) -> str:
    """One side of the comparison (``{engine, precision, dtype, ...}``) as escaped text: "vllm (precision bf16)"."""
    side = mapping(side)
    if not side:
        return "n/a"
    parts = [f"{k} {side[k]}" for k in extra if side.get(k) is not None]
    return esc(str(side.get("engine", "?")) + (f" ({', '.join(parts)})" if parts else ""))


def header(heading: str, subject: Any, facts: list[tuple[str, str]]) -> str:
    """``<header>``: ``<h1>HEADING: SUBJECT</h1>`` (``heading`` is this module's caller's own text, ``subject``
    the report's, escaped) and the facts ``[(label, HTML already escaped)]`` in one line."""
    dl = "".join(f"<div><dt>{plain(k)}</dt><dd>{v}</dd></div>" for k, v in facts)
    return f'<header><h1>{plain(heading)}: {esc(subject)}</h1><dl class="facts">{dl}</dl></header>'


def answer_section(answer: str, lead_figure: str) -> str:
    """The first screen: the answer in words (its own ``<div>`` with an ``<h2>``) next to the lead picture."""
    return f'<section id="answer">{answer}{lead_figure}</section>'


def plots_section(figures: list[str], colours: RunColours, note: str = "") -> str:
    """The plots: an optional note (HTML), the run colours once (sticky), the plot grid."""
    return ('<section id="plots"><h2>Plots</h2>' + note + colours.legend() + '<div class="plot-grid">'
            + "".join(figures) + "</div></section>")


#: The one stylesheet of every report.
CSS = """
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

#: No script, no fetch: inline styles and (never used) data: images only.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def page(title: Any, body: list[str]) -> str:
    """One self-contained HTML page: ``title`` (report text, escaped) and the body's sections (HTML, in order)."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{plain(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


# --------------------------------------------------------------------------------------------------
# the files
# --------------------------------------------------------------------------------------------------


def write_report_files(directory: str | os.PathLike, render: Callable[[], tuple[str, str]], *,
                       flag: str = "--report") -> dict[str, str]:
    """Write ``report.html`` and ``report.json`` atomically into ``directory``, created if missing.

    ``render()`` returns ``(html_text, json_text)``; it runs after ``directory`` is checked and before anything
    is created or written (a report that cannot be rendered writes nothing). Returns ``{"html": path, "json":
    path}``. A ``directory`` that exists and is not a directory is refused (:class:`~moealign.errors.ConfigError`).
    """
    try:
        path = os.fspath(directory)
    except TypeError:
        path = None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{flag} must be a non-empty directory path, got {directory!r}")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: exists and is not a directory")
    html_text, json_text = render()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create the directory ({exc.strerror or exc})") from None
    out = {"html": os.path.join(path, "report.html"), "json": os.path.join(path, "report.json")}
    for key, text in (("json", json_text), ("html", html_text)):
        def writer(tmp: str, text: str = text) -> None:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
        atomic_write(out[key], writer, flag=flag, error_cls=ConfigError)
    return out

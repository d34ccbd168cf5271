"""``moealign rl-check``'s outputs: the per-step table, ``--fail-above`` over every step, and the HTML report: what it
shows (the verdict next to the mismatch KL per step, then router flips, |Δ log p|, the reward curve and the refit
check over steps, one colour per run, the per-step tables). How it looks (the page, the plots, the colours, the
files) is :mod:`moealign.report_html`'s, shared with ``mismatch --report``: a run has the colour of its levers there
(stock, no lever: the mismatch report's baseline; aligned, every lever: its all levers)."""

from __future__ import annotations

import math
import os

from ..errors import ConfigError
from ..report_html import (ALL_LEVERS, NO_LEVER, NotMeasured, RunColours, answer_section, cell, esc, figure_html,
                           finish_axes, fmt, header, mapping, new_figure, not_measured, num, page, plot_lines,
                           plots_section, report_json, safe, table, write_report_files)

__all__ = ["PLOT_IDS", "format_steps", "check_steps", "render_html", "write_report_dir"]


def _g(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec)


def format_steps(report: dict) -> str:
    """One table per run: a row per step (reward, loss, grad norm, mismatch, flips, masked, refit, verify, time)."""
    lines = [f"moealign rl-check: {report['model']}, reward {report['reward']}, correction {report['correction']}, "
             f"rollout {report['rollout'].get('engine')} {report['config']['rollout_precision']} "
             f"(TP={report['config']['rollout_tp']}), train {report['train'].get('engine')} "
             f"{report['config']['train_precision']}, lr {report['config']['lr']:g}, "
             f"staleness {report['config']['staleness']}"]
    head = (f"{'step':>4} {'reward':>13} {'loss':>8} {'|grad|':>7} {'kl_k3':>9} {'max|dlp|':>9} {'mean|dlp|':>9} "
            f"{'flips':>7} {'masked':>7} {'refit ms':>8} {'verify':>7} {'rollout s':>9} {'train s':>7} "
            f"{'check s':>7}")
    for run in report["runs"]:
        probe = run.get("probe") or {}
        lines += ["", f"[{run['name']}] levers {run['levers']}: routing replay {'on' if run['replay'] else 'off'}, "
                      f"sampling mask {'on' if run['sampling_mask'] else 'off'}; probe bound "
                      f"{_g(probe.get('bound'))} (step-0 gap {_g(probe.get('step0_gap'))})", head]
        for s in run["steps"]:
            m, t, v = s["metrics"], s["time"], s.get("verify")
            verdict = "-" if v is None else ("ok" if v["ok"] else "FAILED")
            refit_ms = "-" if s.get("refit") is None else f"{s['refit']['seconds'] * 1e3:.0f}"
            lines.append(
                f"{s['step']:>4} {s['reward_mean']:>6.3f}±{s['reward_std']:<6.3f} {s['loss']:>8.4f} "
                f"{s['grad_norm']:>7.3f} {_g(m['kl_k3'], '.2e'):>9} {_g(m['max_abs_logp_diff'], '.2e'):>9} "
                f"{_g(m['mean_abs_logp_diff'], '.2e'):>9} {m['router_flip_rate']:>7.4f} "
                f"{s['correction']['masked_fraction']:>7.4f} {refit_ms:>8} {verdict:>7} {t['rollout']:>9.2f} "
                f"{t['train']:>7.2f} {t['measure'] + t['verify']:>7.2f}")
        aligned = [s["aligned"] for s in run["steps"] if "aligned" in s]
        if aligned:
            equal = sum(a["bitwise_equal"] for a in aligned)
            lines.append(f"aligned (canonical forward on both engines): the three log-probs (rollout, the trainer's "
                         f"recompute, the first training forward) bitwise equal at {equal} of {len(aligned)} steps"
                         + ("" if equal == len(aligned) else
                            f" (steps {[s['step'] for s in run['steps'] if not s['aligned']['bitwise_equal']]} differ)"))
    return "\n".join(lines)


def check_steps(report: dict, bounds: dict[str, float]) -> list[str]:
    """``--fail-above`` over every step of the judged run (the aligned one when both ran), plus every failed refit
    verification of any run."""
    failures = []
    runs = report["runs"]
    judged = next((r for r in runs if r["name"] == "aligned"), runs[-1] if runs else None)
    for run in runs:
        for s in run["steps"]:
            v = s.get("verify")
            if v is not None and not v["ok"]:
                failures.append(f"{run['name']} step {s['step']}: refit verification failed ({v['weights']})")
            a = s.get("aligned")
            if a is not None and not a["bitwise_equal"]:
                pairs = [name for name, ok in (("rollout vs recompute", a.get("rollout_vs_recompute", False)),
                                               ("recompute vs training forward", a.get("recompute_vs_train", True)))
                         if not ok]
                failures.append(f"{run['name']} step {s['step']}: --aligned, yet {a['tokens_differing']} of "
                                f"{a['tokens']} log-probs differ ({', '.join(pairs) or 'the certificate'})")
    if judged is not None:
        for s in judged["steps"]:
            for name, bound in bounds.items():
                value = s["metrics"].get(name)
                if value is None:
                    raise ConfigError(f"--fail-above {name}: rl-check does not report it per step; choose one of "
                                      f"{', '.join(s['metrics'])}")
                if not (value <= bound):
                    failures.append(f"{judged['name']} step {s['step']}: {name} = {value:.6g} > {bound:.6g}")
    return failures


# --------------------------------------------------------------------------------------------------
# the HTML report: what it shows (how it looks is moealign/report_html.py's, shared with the mismatch report)
# --------------------------------------------------------------------------------------------------

#: The plots of the page, in order (``<figure class="plot" id="plot-NAME">``); the first is the picture next to the
#: verdict.
PLOT_IDS = ("kl", "max-abs-logp-diff", "router-flips", "reward", "probe-gap", "refit-time")

#: Per plot: title, y label, the value of one step, log axis, caption.
_PLOTS = {
    "kl": ("Mismatch KL (k3) per step", "kl_k3", lambda s: s["metrics"]["kl_k3"], True,
           "The rollout vs train mismatch (KL k3 over the step's tokens) at every step, one line per run."),
    "max-abs-logp-diff": ("Max |Δ log p| per step", "max |Δ log p|", lambda s: s["metrics"]["max_abs_logp_diff"],
                          True, "The largest |Δ log p| of a token (rollout vs train) at every step, one line per run."),
    "router-flips": ("Router flip rate per step", "router flip rate", lambda s: s["metrics"]["router_flip_rate"],
                     False, "The fraction of routed tokens whose expert set differs between rollout and train."),
    "reward": ("Reward per step", "mean reward", lambda s: s["reward_mean"], False,
               "The mean verifiable reward of the step's completions, one line per run."),
    "probe-gap": ("Refit check: probe mean |Δ log p|", "probe gap",
                  lambda s: (s.get("verify") or {}).get("probe_gap"), True,
                  "The refit check's probe: mean |Δ log p| of the refit engine against the trainer after each refit."),
    "refit-time": ("Refit time per step", "seconds", lambda s: (s.get("refit") or {}).get("seconds"), False,
                   "Wall time of the in-place refit into the running vLLM engine at every step."),
}
#: The smallest value drawn on a log axis (a 0 is drawn there).
_LOG_FLOOR = 1e-16


def _runs(report: dict) -> list[dict]:
    runs = report.get("runs")
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, (list, tuple)) else []


def _steps(run: dict) -> list[dict]:
    steps = run.get("steps")
    return [s for s in steps if isinstance(s, dict)] if isinstance(steps, (list, tuple)) else []


def _value(getter, step: dict) -> float | None:
    try:
        return num(getter(step))
    except (KeyError, TypeError, AttributeError, IndexError):
        return None


def _role(run: dict) -> str:
    """The run's levers as a colour role (the same colour as the mismatch report's run with those levers)."""
    return {(False, False): NO_LEVER, (True, True): ALL_LEVERS, (True, False): "routing_replay",
            (False, True): "sampling_mask"}[(bool(run.get("replay")), bool(run.get("sampling_mask")))]


def _plot(report: dict, name: str, colours: RunColours):
    _, ylabel, getter, log, caption = _PLOTS[name]
    series = {}
    for run in _runs(report):
        steps = _steps(run)
        values = [_value(getter, s) for s in steps]
        if log:
            values = [None if v is None else max(v, _LOG_FLOOR) for v in values]
        series[str(run.get("name", "?"))] = ([s.get("step") for s in steps], values)
    fig, ax = new_figure(5.6, 3.3)
    if not plot_lines(ax, series, colours):
        raise NotMeasured("no step has a value")
    if log:
        ax.set_yscale("log")
        caption += f" Log axis: a 0 is drawn at {_LOG_FLOOR:g}."
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    finish_axes(ax)
    return fig, caption


def _max(steps: list[dict], metric: str) -> float | None:
    values = [v for v in (_value(lambda s: s["metrics"][metric], s) for s in steps) if v is not None]
    return max(values) if values else None


def _run_line(run: dict, colours: RunColours) -> str:
    steps = _steps(run)
    checks = [bool(s["verify"].get("ok")) for s in steps if isinstance(s.get("verify"), dict)]
    text = (f"(levers {run.get('levers')}): refit verified at {sum(checks)}/{len(checks)} steps; max router flip "
            f"rate {_g(_max(steps, 'router_flip_rate'))}; max kl_k3 {_g(_max(steps, 'kl_k3'))}")
    aligned = [s["aligned"] for s in steps if isinstance(s.get("aligned"), dict)]
    if aligned:
        text += (f"; --aligned: log-probs bitwise equal to the rollout's at "
                 f"{sum(bool(a.get('bitwise_equal')) for a in aligned)} of {len(aligned)} steps")
    name = str(run.get("name", "?"))
    return f"<li>{colours.swatch(name)} <strong>{esc(name)}</strong> {esc(text)}</li>"


def _verdict(report: dict, colours: RunColours) -> str:
    """The answer, first on the page next to the KL plot: a headline (the judged run's worst mismatch, the other
    run's beside it, the refit checks) and one line per run, after its colour."""
    runs = _runs(report)
    out = ['<div id="verdict"><h2>Verdict</h2>']
    if not runs:
        return "".join(out) + not_measured("verdict-text", "no runs") + "</div>"
    judged = next((r for r in runs if r.get("name") == "aligned"), runs[-1])
    verified = [(r, s) for r in runs for s in _steps(r) if isinstance(s.get("verify"), dict)]
    failed = [f"{r.get('name')} step {s.get('step')}" for r, s in verified if not s["verify"].get("ok")]

    def worst(run: dict) -> str:
        steps = _steps(run)
        return f"max kl_k3 {fmt(_max(steps, 'kl_k3'))}, max router flip rate {fmt(_max(steps, 'router_flip_rate'))}"

    headline = f"{judged.get('name')}: {worst(judged)} over {len(_steps(judged))} steps"
    others = [f"{r.get('name')}: {worst(r)}" for r in runs if r is not judged]
    headline += (f" ({'; '.join(others)})" if others else "") + "; " + (
        f"refit verification FAILED at {', '.join(failed)}" if failed else
        "every refit verified" if verified else "no refit verified") + "."
    out.append(f'<p class="headline">{esc(headline)}</p>')
    out.append('<ul class="verdicts">' + "".join(_run_line(r, colours) for r in runs) + "</ul></div>")
    return "".join(out)


def _header(report: dict) -> str:
    config, rollout, train = (mapping(report.get(k)) for k in ("config", "rollout", "train"))
    return header("RL check", report.get("model", "unknown model"), [
        ("rollout", esc(f"{rollout.get('engine', '?')} {config.get('rollout_precision', '?')} "
                        f"(TP={config.get('rollout_tp', '?')})")),
        ("train", esc(f"{train.get('engine', '?')} {config.get('train_precision', '?')}")),
        ("reward", esc(report.get("reward", "n/a"))), ("correction", esc(report.get("correction", "n/a"))),
        ("steps", cell(config.get("steps"))), ("lr", cell(config.get("lr"))),
        ("staleness", cell(config.get("staleness"))), ("elapsed", f"{fmt(report.get('elapsed_s'))} s")])


_STEP_COLUMNS = ("step", "reward", "loss", "|grad|", "kl_k3", "max |Δ log p|", "mean |Δ log p|", "router flips",
                 "masked", "refit ms", "verify", "rollout s", "train s", "check s")


def _step_row(s: dict, aligned: bool) -> str:
    m, t = mapping(s.get("metrics")), mapping(s.get("time"))
    verify, refit = s.get("verify"), s.get("refit")
    verdict = "&mdash;" if not isinstance(verify, dict) else ("ok" if verify.get("ok") else "FAILED")
    refit_ms = num(mapping(refit).get("seconds"))
    check = [num(t.get("measure")), num(t.get("verify"))]
    cells = [cell(s.get("step")), f"{fmt(s.get('reward_mean'))} ± {fmt(s.get('reward_std'))}", fmt(s.get("loss")),
             fmt(s.get("grad_norm")), *(fmt(m.get(k)) for k in ("kl_k3", "max_abs_logp_diff", "mean_abs_logp_diff",
                                                                 "router_flip_rate")),
             fmt(mapping(s.get("correction")).get("masked_fraction")),
             "&mdash;" if refit_ms is None else f"{refit_ms * 1e3:.0f}", verdict, fmt(t.get("rollout")),
             fmt(t.get("train")), fmt(None if None in check else sum(check))]
    if aligned:
        cells.append(fmt(mapping(s.get("aligned")).get("bitwise_equal")) if isinstance(s.get("aligned"), dict)
                     else "&mdash;")
    return "<tr>" + "".join(f'<td class="num">{c}</td>' for c in cells) + "</tr>"


def _tables(report: dict) -> str:
    runs = _runs(report)
    if not runs:
        return not_measured("table-steps", "no runs")
    out = []
    for i, run in enumerate(runs):
        steps = _steps(run)
        aligned = any(isinstance(s.get("aligned"), dict) for s in steps)
        probe = mapping(run.get("probe"))
        on = {k: ("on" if run.get(k) else "off") for k in ("replay", "sampling_mask")}
        caption = (f"{run.get('name', '?')}: levers {run.get('levers')}; routing replay {on['replay']}, sampling "
                   f"mask {on['sampling_mask']}; probe bound {_g(num(probe.get('bound')))} "
                   f"(step-0 gap {_g(num(probe.get('step0_gap')))})")
        head = list(_STEP_COLUMNS) + (["bitwise equal (--aligned)"] if aligned else [])
        out.append(table(f"table-steps-{i}", head, [_step_row(s, aligned) for s in steps], caption=caption))
    return "".join(out)


def _legend_note(colours: RunColours) -> str:
    if not colours.used:
        return ""
    return ('<p class="legend-note">One colour per run in every plot, by the levers it has on: the colours of '
            "<code>moealign mismatch --report</code> (no lever: its baseline; every lever: its all levers; routing "
            "replay alone: routing flips; the sampling mask alone: sampling truncation).</p>")


def render_html(report: dict) -> str:
    """The report as one self-contained page (inline CSS and SVG, no script, no external resource): the verdict
    next to the mismatch KL per step, the other plots over steps (one colour per run), the per-step tables."""
    if not isinstance(report, dict):
        raise ConfigError(f"render_html: the report must be a dict, got {type(report).__name__}")
    runs = _runs(report)
    colours = RunColours([str(r.get("name", "?")) for r in runs],
                         roles={str(r.get("name", "?")): _role(r) for r in runs})
    figures = {name: figure_html(name, _PLOTS[name][0], lambda name=name: _plot(report, name, colours), colours)
               for name in PLOT_IDS}
    body = [
        safe(_header, report, "header"),
        answer_section(safe(lambda r: _verdict(r, colours), report, "verdict"), figures[PLOT_IDS[0]]),
        plots_section([figures[name] for name in PLOT_IDS[1:]], colours, note=_legend_note(colours)),
        '<section id="tables"><h2>Per step</h2>', safe(_tables, report, "table-steps"), "</section>",
    ]
    return page(f"moealign rl-check: {report.get('model', 'report')}", body)


def write_report_dir(report: dict, directory: str | os.PathLike) -> dict[str, str]:
    """``DIR/report.html`` and ``DIR/report.json`` (strict JSON: NaN and infinities as ``null``), both rendered
    before either is written, each written atomically; ``DIR`` created if missing, refused if it is a file."""
    return write_report_files(directory, lambda: (render_html(report), report_json(report)))

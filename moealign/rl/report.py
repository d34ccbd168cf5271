"""``moealign rl-check``'s outputs: the per-step table, ``--fail-above`` over every step, and the HTML report's
plots over steps (mismatch KL and router flips per step for each run, the reward curve, the refit check)."""

from __future__ import annotations

import html
import io
import math
import os

from ..errors import ConfigError

__all__ = ["format_steps", "check_steps", "render_html", "write_report_dir"]


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
            lines.append(f"aligned (canonical forward on both engines): the trainer's log-probs bitwise equal to the "
                         f"rollout's at {equal} of {len(aligned)} steps"
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
                failures.append(f"{run['name']} step {s['step']}: --aligned, yet {a['tokens_differing']} of "
                                f"{a['tokens']} log-probs differ from the rollout's")
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
# HTML
# --------------------------------------------------------------------------------------------------

#: One colour per run, the same in every plot.
RUN_COLORS = {"stock": "#d62728", "aligned": "#1f77b4"}


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _series(run: dict, getter) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for s in run["steps"]:
        value = getter(s)
        if value is not None and isinstance(value, (int, float)) and math.isfinite(value):
            xs.append(s["step"])
            ys.append(float(value))
    return xs, ys


def _plot(report: dict, title: str, ylabel: str, getter, *, log: bool = False) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    for run in report["runs"]:
        xs, ys = _series(run, getter)
        if log:
            ys = [max(y, 1e-16) for y in ys]
        ax.plot(xs, ys, marker="o", label=run["name"], color=RUN_COLORS.get(run["name"], "#2ca02c"))
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    return _svg(fig)


def render_html(report: dict) -> str:
    """A self-contained page (inline SVG, no script): the headline, plots over steps, the per-step table."""
    plots = [
        _plot(report, "mismatch KL (k3) per step", "kl_k3", lambda s: s["metrics"]["kl_k3"], log=True),
        _plot(report, "max |Δ log p| per step", "max |Δ log p|", lambda s: s["metrics"]["max_abs_logp_diff"],
              log=True),
        _plot(report, "router flip rate per step", "flip rate", lambda s: s["metrics"]["router_flip_rate"]),
        _plot(report, "reward (balanced brackets)", "mean reward", lambda s: s["reward_mean"]),
        _plot(report, "refit check: probe mean |Δ log p|", "probe gap",
              lambda s: (s.get("verify") or {}).get("probe_gap"), log=True),
        _plot(report, "refit time per step", "seconds",
              lambda s: (s.get("refit") or {}).get("seconds")),
    ]
    verdicts = []
    for run in report["runs"]:
        checks = [s["verify"]["ok"] for s in run["steps"] if s.get("verify")]
        flips = max((s["metrics"]["router_flip_rate"] for s in run["steps"]), default=float("nan"))
        kl = max((s["metrics"]["kl_k3"] for s in run["steps"]), default=float("nan"))
        verdicts.append(f"<li><b>{html.escape(run['name'])}</b> (levers {html.escape(run['levers'])}): refit verified "
                        f"at {sum(checks)}/{len(checks)} steps; max router flip rate {_g(flips)}; max kl_k3 "
                        f"{_g(kl)}</li>")
    table = html.escape(format_steps(report))
    figures = "".join(f"<figure>{svg}</figure>" for svg in plots)
    return ("<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='Content-Security-Policy' "
            "content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
            "<title>moealign rl-check</title><style>body{font-family:sans-serif;margin:1.5em;max-width:100%}"
            "figure{display:inline-block;margin:0.5em;max-width:46%}figure svg{max-width:100%;height:auto}"
            "pre{overflow-x:auto;background:#f6f6f6;padding:0.5em;font-size:12px}</style></head><body>"
            f"<h1>moealign rl-check</h1><p>{html.escape(str(report['model']))}: reward "
            f"{html.escape(report['reward'])}, correction {html.escape(report['correction'])}</p>"
            f"<ul>{''.join(verdicts)}</ul><div>{figures}</div><h2>Per step</h2><pre>{table}</pre></body></html>")


def write_report_dir(report: dict, directory: str) -> dict[str, str]:
    """``DIR/report.html`` and ``DIR/report.json``, each written atomically."""
    import json

    from .._files import atomic_write

    os.makedirs(directory, exist_ok=True)
    paths = {"html": os.path.join(directory, "report.html"), "json": os.path.join(directory, "report.json")}

    def write_html(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(render_html(report))

    def write_json(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1, allow_nan=True)
            fh.write("\n")

    atomic_write(paths["html"], write_html, flag="--report")
    atomic_write(paths["json"], write_json, flag="--report")
    return paths

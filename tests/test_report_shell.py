"""One visual language (issue 36, item 6): ``mismatch --report`` and ``rl-check --report`` are one product.

Both reports are drawn by moealign/report_html.py (below both commands: it imports neither): the same page shell
(stylesheet, CSP, header, the answer first with its picture beside it, the sticky colour legend, the files), and
one colour per run by the levers it has on (rl-check's stock run the colour of the mismatch report's baseline, its
aligned run that of "all levers", routing replay alone that of the cause "routing flips", ...). The rl-check page
is also checked on its own: escaping, bad data, strict JSON, the files, and in headless chromium (no overflow, one
colour per run, the verdict and the KL chart side by side on the first screen).
"""

from __future__ import annotations

import ast
import json
import math
import os
import random
import re
import time
from pathlib import Path

import pytest

from moealign._files import TMP_MARKER
from moealign.errors import ConfigError
from moealign.mismatch import html_report
from moealign.mismatch.levers import CAUSES
from moealign.report_html import ALL_LEVERS, CSS, LEVER_COLOURS, NO_LEVER, OTHER_COLOURS, RESERVED
from moealign.rl import report as rl_report

from test_html_report import (ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, COLOURS_JS, OVERFLOW_JS, SHARED_COLOURS_JS,
                              _browser_or_fail, synthetic_report)

ROOT = Path(__file__).resolve().parents[1]
XSS = "<script>alert(1)</script>"
NAN = float("nan")


def rl_synthetic(steps: int = 6, seed: int = 0, runs=(("stock", "none", False, False),
                                                      ("aligned", "all", True, True))) -> dict:
    """An rl-check report in the schema run_rl_check returns: seeded numbers, the aligned run without flips."""
    rng = random.Random(seed)

    def run(name: str, levers: str, replay: bool, mask: bool) -> dict:
        scale = 0.02 if replay and mask else 1.0
        return {"name": name, "levers": levers, "replay": replay, "sampling_mask": mask,
                "probe": {"bound": 0.08, "step0_gap": 0.01}, "initial_refit": {"verify": {"ok": True}},
                "steps": [{"step": i, "reward_mean": 0.2 + 0.05 * i * rng.uniform(.5, 1.5), "reward_std": 0.1,
                           "loss": -0.01 * rng.uniform(.5, 1.5), "grad_norm": 0.5,
                           "metrics": {"kl_k3": 0.01 * scale * rng.uniform(.5, 1.5), "max_abs_logp_diff": 2.0 * scale,
                                       "mean_abs_logp_diff": 0.05 * scale,
                                       "router_flip_rate": 0.0 if replay else 0.02 * rng.uniform(.5, 1.5),
                                       "support_mismatch_rate": 0.0 if mask else 0.01},
                           "correction": {"masked_fraction": 0.01},
                           "refit": {"seconds": 0.12 * rng.uniform(.5, 1.5), "tensors": 167, "workers": 1},
                           "verify": {"ok": True, "weights": {"checked": 167}, "probe_bound": 0.08,
                                      "probe_gap": 0.01 * rng.uniform(.5, 1.5)},
                           "time": {"rollout": 1.0, "train": 2.0, "measure": 0.3, "refit": 0.1, "verify": 0.2,
                                    "total": 3.6}}
                          for i in range(steps)]}

    return {"command": "rl-check", "model": "embedded:tiny_moe", "reward": "balanced_brackets",
            "correction": "decoupled_token_icepop",
            "config": {"steps": steps, "group_size": 2, "num_prompts": 4, "max_new_tokens": 8, "lr": 1e-3,
                       "levers": "all", "staleness": 0, "rollout_precision": "bf16", "train_precision": "fp32",
                       "rollout_tp": 1, "seed": 0, "temperature": 1.0, "top_p": 0.9, "compare": True,
                       "aligned": False},
            "rollout": {"engine": "vllm"}, "train": {"engine": "megatron"}, "runs": [run(*r) for r in runs],
            "elapsed_s": 12.3}


@pytest.fixture(scope="module")
def pages() -> dict:
    return {"mismatch": html_report.render_html(synthetic_report()), "rl": rl_report.render_html(rl_synthetic())}


def _legend(page: str) -> dict[str, str]:
    """{run name: colour} of the page's colour legend."""
    legend = re.search(r'<ul class="legend" id="run-colours".*?</ul>', page, flags=re.S).group(0)
    return {name: colour for colour, name in
            re.findall(r'data-colour="([^"]+)"><svg class="swatch".*?</svg><bdi>(.*?)</bdi></li>', legend)}


def _imports(path: Path) -> set[str]:
    """Absolute module names ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}
    return out


def test_the_report_module_is_below_both_commands():
    shared = _imports(ROOT / "moealign" / "report_html.py")
    assert not {m for m in shared if m.startswith(("moealign.mismatch", "moealign.rl"))}, shared
    for user in ("mismatch/html_report.py", "rl/report.py"):
        assert "moealign.report_html" in _imports(ROOT / "moealign" / user), user
    # negative control: the checker sees a command's module where one is imported
    assert "moealign.mismatch.levers" in _imports(ROOT / "moealign" / "mismatch" / "html_report.py")


def test_both_reports_share_one_page_shell(pages):
    for name, page in pages.items():
        styles = re.findall(r"<style>(.*?)</style>", page, flags=re.S)
        assert styles == [CSS], name
        head = page[:page.index("<body>")]
        assert "default-src 'none'" in head and '<meta name="viewport"' in head, name
        assert re.search(r'<header><h1>[^<]+: <bdi>embedded:tiny_moe</bdi></h1><dl class="facts">', page), name
        assert "<script" not in page.lower()
    shells = {name: re.sub(r"<title>.*?</title>", "", page[:page.index("<body>")]) for name, page in pages.items()}
    assert shells["mismatch"] == shells["rl"]


def test_the_picture_comes_first_in_both_reports(pages):
    """The answer section opens the page (after the header): its words and a drawn plot side by side; then the
    plots with the legend, then the tables."""
    for name, page in pages.items():
        answer = re.search(r'<section id="answer">(.*?)</section>', page, flags=re.S)
        assert answer, name
        lead = re.search(r'<figure class="plot" id="plot-([a-z-]+)"><h3>.*?</h3><svg', answer.group(1))
        assert lead, name
        first_figure = re.search(r'<figure class="plot[^"]*" id="plot-', page).start()
        assert answer.start() < first_figure < answer.end(), name
        order = [page.index(x) for x in ("<header>", '<section id="answer">', '<section id="plots">',
                                         '<ul class="legend" id="run-colours"', '<section id="tables">')]
        assert order == sorted(order), (name, order)


def test_one_colour_per_lever_set_in_both_reports(pages):
    mismatch, rl = _legend(pages["mismatch"]), _legend(pages["rl"])
    assert mismatch["baseline"] == rl["stock"] == LEVER_COLOURS[NO_LEVER]
    assert mismatch["all levers"] == rl["aligned"] == LEVER_COLOURS[ALL_LEVERS]
    assert rl["stock"] != rl["aligned"]
    one = {"replay": ("routing_replay", CAUSES["routing_replay"]), "mask": ("sampling_mask", CAUSES["sampling_mask"])}
    for levers, (lever, cause) in one.items():
        page = rl_report.render_html(rl_synthetic(runs=(("aligned", levers, levers == "replay", levers == "mask"),)))
        assert _legend(page)["aligned"] == mismatch[cause] == LEVER_COLOURS[lever], levers
    # every drawn mark of an rl-check run is in its legend colour, and each run's marks are tagged
    legend = re.search(r'<ul class="legend" id="run-colours".*?</ul>', pages["rl"], flags=re.S).group(0)
    for run, colour in re.findall(r'data-run="(\d+)" data-colour="([^"]+)"', legend):
        marks = re.findall(rf'<g id="p-[a-z-]+-run{run}-\d+">\s*<path[^>]*style="([^"]*)"', pages["rl"])
        assert len(marks) >= len(rl_report.PLOT_IDS), run
        assert all(f"stroke: {colour}" in m for m in marks), (run, colour, marks[:2])


def test_the_palette_covers_every_lever_and_keeps_them_apart():
    assert set(CAUSES) | {NO_LEVER, ALL_LEVERS} <= set(LEVER_COLOURS)
    colours = list(LEVER_COLOURS.values()) + list(OTHER_COLOURS) + list(RESERVED)
    assert len(colours) == len(set(colours))
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in colours)


def test_rl_page_keeps_its_content(pages):
    page = pages["rl"]
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count("<svg") - page.count('<svg class="swatch"') == len(rl_report.PLOT_IDS) == 6
    assert page.count("refit verified at 6/6 steps") == 2
    for i in range(2):
        rows = re.search(rf'<table id="table-steps-{i}">.*?</table>', page, flags=re.S).group(0)
        assert rows.count("<tr>") == 1 + 6 and rows.count(">ok<") == 6
    assert "every refit verified" in page


def test_rl_page_escapes_report_text_and_survives_bad_data():
    report = rl_synthetic()
    report["model"] = '"><img src=x onerror=alert(1)>'
    report["runs"][0]["name"] = XSS
    report["runs"][1]["levers"] = "<i>all</i>"
    page = rl_report.render_html(report)
    assert "<img" not in page and "<script" not in page.lower() and "<i>all</i>" not in page
    assert "<bdi>&lt;script&gt;alert(1)&lt;/script&gt;</bdi>" in page
    # a failed verification is the headline; NaN is n/a in the tables and skipped in the plots
    report = rl_synthetic()
    report["runs"][1]["steps"][2]["verify"]["ok"] = False
    report["runs"][0]["steps"][1]["metrics"]["kl_k3"] = NAN
    page = rl_report.render_html(report)
    assert "refit verification FAILED at aligned step 2" in re.search(r'<p class="headline">(.*?)</p>', page).group(1)
    assert "n/a" in re.search(r'<table id="table-steps-0">.*?</table>', page, flags=re.S).group(0)
    # --no-verify: no verification claimed, the probe plot not measured, the others drawn
    for run in report["runs"]:
        for step in run["steps"]:
            del step["verify"]
    page = rl_report.render_html(report)
    assert "no refit verified" in re.search(r'<p class="headline">(.*?)</p>', page).group(1)
    assert ('<figure class="plot missing" id="plot-probe-gap">' in page
            and page.count('<figure class="plot" id="plot-') == len(rl_report.PLOT_IDS) - 1)
    for bad in (7, "text", [1, "x"], None, NAN, {"steps": 3}):
        page = rl_report.render_html({k: bad for k in ("model", "runs", "config", "rollout", "train", "reward",
                                                       "correction", "elapsed_s")})
        assert page.rstrip().endswith("</html>") and "<header><h1>" in page
        assert all(f'<figure class="plot missing" id="plot-{n}">' in page for n in rl_report.PLOT_IDS)
    report = rl_synthetic()
    report["runs"] = [{"name": "x", "steps": [{"step": 0, "metrics": "garbage"}, "not a step"]}, "not a run"]
    page = rl_report.render_html(report)
    assert page.rstrip().endswith("</html>") and "refit verified at 0/0 steps" in page
    with pytest.raises(ConfigError):
        rl_report.render_html([1, 2])


def test_rl_report_files_strict_atomic_and_refused(tmp_path):
    report = rl_synthetic()
    report["runs"][0]["steps"][0]["metrics"]["kl_k3"] = NAN
    paths = rl_report.write_report_dir(report, tmp_path / "a" / "b")
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["report.html", "report.json"]

    def refuse(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    parsed = json.loads(Path(paths["json"]).read_text(), parse_constant=refuse)
    assert parsed["runs"][0]["steps"][0]["metrics"]["kl_k3"] is None
    assert math.isclose(parsed["runs"][1]["steps"][0]["metrics"]["max_abs_logp_diff"], 0.04)
    assert Path(paths["html"]).read_text(encoding="utf-8") == rl_report.render_html(report)
    assert not [n for n in os.listdir(tmp_path / "a" / "b") if TMP_MARKER in n]
    f = tmp_path / "file"
    f.write_text("keep me")
    with pytest.raises(ConfigError, match="not a directory"):
        rl_report.write_report_dir(report, f)
    assert f.read_text() == "keep me"
    with pytest.raises(ConfigError):                       # a report that cannot be rendered writes nothing
        rl_report.write_report_dir("not a dict", tmp_path / "never")
    assert not (tmp_path / "never").exists()


#: The verdict and the lead plot on the first screen.
FIRST_SCREEN_JS = """() => {
    const box = el => { if (!el) return null; const r = el.getBoundingClientRect();
                        return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, width: r.width}; };
    return {height: innerHeight, headline: box(document.querySelector('#answer p.headline')),
            lead: box(document.querySelector('#answer figure.plot > svg'))};
}"""


@pytest.mark.heavy
def test_rl_report_in_headless_chromium(tmp_path):
    """The rl-check page as the mismatch page is checked: no error, no request, the verdict and the KL chart side
    by side on a 1280x800 first screen, nothing wider than the viewport (1280 and 600 pixels), one colour per run
    in every plot and the legend, no two runs sharing one."""
    sync_playwright = _browser_or_fail()
    t0 = time.perf_counter()
    url = Path(rl_report.write_report_dir(rl_synthetic(), tmp_path / "rl")["html"]).resolve().as_uri()
    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(url, wait_until="load")
            page.wait_for_timeout(200)
            first = page.evaluate(FIRST_SCREEN_JS)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "rl-report-first-screen.png"))
            layouts = []
            for width in (1280, 600):
                page.set_viewport_size({"width": width, "height": 800})
                layouts.append(page.evaluate(OVERFLOW_JS))
            colours = page.evaluate(COLOURS_JS)
            shared = page.evaluate(SHARED_COLOURS_JS, colours["drawn"])
        finally:
            browser.close()
    print(f"rl-check browser test: {time.perf_counter() - t0:.2f} s")
    assert not errors, errors
    assert [u for u in requests if u.split("#")[0] != url] == []
    head, lead = first["headline"], first["lead"]
    assert head and lead and lead["width"] > 400, first
    assert 0 <= head["top"] and head["bottom"] <= first["height"] and lead["bottom"] <= first["height"], first
    assert head["right"] <= lead["left"] and head["top"] < lead["bottom"], first
    for layout in layouts:
        assert layout["scrollWidth"] <= layout["viewport"] and not layout["wide"], layout
    drawn, legend = colours["drawn"], colours["legend"]
    assert set(drawn) == set(legend) == {"0", "1"}, colours
    assert shared == {"several": [], "shared": []}, colours
    for run, values in drawn.items():
        assert set(values) == {legend[run]["colour"]}, (legend[run], values)
    assert {v["name"]: v["colour"] for v in legend.values()} == {"stock": "rgb(31, 119, 180)",
                                                                  "aligned": "rgb(44, 160, 44)"}

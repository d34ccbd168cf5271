"""The HTML report of ``moealign mismatch --report DIR`` (moealign/mismatch/html_report.py).

Unit tests (no browser): escaping, missing / malformed sections, NaN handling, the page is self-contained,
write_report_dir (atomic, strict JSON, refuses a file). The browser test opens the page in Debian's headless
chromium (/usr/bin/chromium) through Playwright: no console or page error, every drawn plot has an SVG of nonzero
size, the injected ``<script>`` is text and did not run, no request left the page; it saves a full-page
screenshot and the page under ``test-artifacts/``; :func:`check_layout` (also run on a real report by
test_diagnosis.py) checks the first screen (headline and attribution chart side by side at 1280x800, screenshot kept),
the folded lever table, no element wider than the viewport (1280 and 600 pixels, folds open and closed), one colour per
run and no colour shared by two runs, each checker next to a negative control. Without /usr/bin/chromium the browser test fails (run
``bash tools/setup.sh test``, which installs it); ``MOEALIGN_NO_BROWSER=1`` skips it instead.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path

import pytest

from moealign._files import TMP_MARKER
from moealign.errors import ConfigError, MoealignError
from moealign.mismatch import html_report
from moealign.mismatch.html_report import PLOT_IDS, render_html, report_json, write_report_dir
from moealign.mismatch.plots import IS_GRID
from moealign.report_html import RESERVED, RunColours

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
XSS = "<script>alert(1)</script>"
NAN = float("nan")


# --------------------------------------------------------------------------------------------------
# the synthetic report
# --------------------------------------------------------------------------------------------------


def synthetic_report(seed: int = 0, *, empty: tuple[str, ...] = ("kept_set",)) -> dict:
    """A realistic report in the schema render_html reads: seeded random numbers, NaN, exact zeros, a token
    whose text is ``<script>alert(1)</script>``, and the ``plots`` sections named in ``empty`` left empty."""
    rng = random.Random(seed)
    layers = [0, 1, 2, 3]
    players = ["sampling_mask", "routing_replay", "precision", "batch_invariant"]
    labels = ["baseline", "routing_replay", "routing_replay+precision", "all levers"]
    scale = {"baseline": 1.0, "routing_replay": 0.35, "routing_replay+precision": 0.12, "all levers": 0.03}

    def metrics(s: float, flips: bool) -> dict:
        per_layer = [rng.uniform(0.02, 0.2) * s if flips else 0.0 for _ in layers]
        return {"mean_abs_logp_diff": 0.05 * s * rng.uniform(0.8, 1.2), "max_abs_logp_diff": 2.5 * s,
                "kl_k3": 0.004 * s * s, "router_flip_rate": sum(per_layer) / len(per_layer),
                "per_layer_flip_rate": per_layer}

    lever_runs = [{"label": lab, "levers": [] if lab == "baseline" else (players if lab == "all levers"
                                                                          else lab.split("+")),
                   "metrics": metrics(scale[lab], "routing_replay" not in lab and lab != "all levers")}
                  for lab in labels]
    runs = [{"name": n, "metrics": dict(metrics(s, "routing_replay" not in n),
                                        support_mismatch_rate=NAN if n == "baseline" else 0.001 * s,
                                        token_flip_rate=0.1 * s)}
            for n, s in (("baseline", 1.0), ("routing_replay", 0.3), ("sampling_mask", 0.9),
                         ("routing_replay+sampling_mask", 0.1))]

    k = 24
    edges = [10 ** (-8 + 9 * i / k) for i in range(k + 1)]      # 1e-8 .. 10
    hist_runs = ["baseline", "routing_replay", "all levers"]

    def hist(s: float) -> list[int]:
        centre = k * (0.75 + 0.1 * math.log10(s))
        return [int(1500 * math.exp(-((i - centre) / 3.0) ** 2) / 5.3) for i in range(k)]

    positions = list(range(48))
    grid = [10 ** (-2 + 4 * i / 40) for i in range(41)]         # 0.01 .. 100

    def tails(s: float) -> dict:
        above = [min(1.0, s * 0.3 * math.exp(-3 * math.log(g))) if g > 1 else 1.0 for g in grid]
        below = [min(1.0, s * 0.3 * math.exp(3 * math.log(g))) if g < 1 else 1.0 for g in grid]
        return {"above": above, "below": below}

    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    worst = []
    for i in range(30):
        worst.append({"sample": rng.randrange(8), "position": rng.randrange(48),
                      "context": f"The answer to item {i} is & \"quoted\" text with 'quotes' and a long tail " * 3,
                      "token": f" tok{i}", "abs_logp_diff": rng.uniform(0.05, 3.0),
                      "rollout_logp": -rng.uniform(0, 2), "train_logp": -rng.uniform(0, 4),
                      "flipped_layers": sorted(rng.sample(layers, rng.randrange(3)))})
    worst[3].update(token=XSS, context="before the <b>injection</b> & ", abs_logp_diff=9.5)
    worst[4].update(abs_logp_diff=NAN, rollout_logp=NAN)                   # sorts last (not among the 20)
    worst[5].update(abs_logp_diff=7.0, train_logp=NAN)

    plots = {
        "flip_rate": {"layers": layers, "series": {r["label"]: r["metrics"]["per_layer_flip_rate"]
                                                   for r in lever_runs}},
        "logp_hist": {"edges": edges, "series": {n: hist(scale[n]) for n in hist_runs},
                      "zeros": {"baseline": 0, "routing_replay": 37, "all levers": 412}},
        "position": {"positions": positions,
                     "series": {n: [NAN if p % 11 == 10 else 0.05 * scale[n] * (1 + p / 24) * rng.uniform(.7, 1.3)
                                    for p in positions] for n in hist_runs}},
        "is_tail": {"grid": grid, "series": {n: tails(scale[n]) for n in hist_runs}, "icepop_band": [0.5, 5.0],
                    "tis_threshold": 2.0},
        "kept_set": {"sizes": sizes, "series": {n: {"tokens": [0 if j == 0 else rng.randrange(10, 300)
                                                               for j in range(len(sizes))],
                                                    "support_mismatch_rate": [NAN if j == 0 else
                                                                              0.002 * scale[n] * j
                                                                              for j in range(len(sizes))]}
                                                for n in hist_runs}},
        "worst_tokens": worst,
        "full_vocab_kl": {"positions": positions,
                          "series": {n: [0.003 * scale[n] * rng.uniform(.5, 1.5) for _ in positions]
                                     for n in ("baseline", "all levers")},
                          "summary": {"baseline": {"mean": 0.003, "max": 0.011},
                                      "all levers": {"mean": 1e-4, "max": NAN}}},
    }
    for name in empty:
        plots[name] = {}

    shares = {"routing flips": 0.031, "sampling truncation": 0.002, "precision: router": 0.009,
              "precision: lm_head": -0.0015, "batch variance": 0.0004}
    attribution = {"primary": "mean_abs_logp_diff", "metrics": {
        m: {"gap": sum(shares.values()) * f + 0.001 * f, "residual": 0.001 * f,
            "shares": {c: v * f for c, v in shares.items()}}
        for m, f in (("mean_abs_logp_diff", 1.0), ("kl_k3", 0.1), ("max_abs_logp_diff", 40.0))}}
    attribution["metrics"]["kl_k3"]["residual"] = NAN

    return {
        "model": "embedded:tiny_moe", "rollout": {"engine": "transformers", "precision": "bf16", "dtype": "bf16"},
        "train": {"engine": "transformers", "precision": "fp32", "dtype": "fp32"},
        "num_tokens": 1500, "moe_layers": layers, "elapsed_s": 12.3,
        "runs": runs,
        "levers": {"players": players, "runs": lever_runs},
        "attribution": attribution,
        "diagnosis": {"headline": "Router flips explain most of the mismatch: turn on routing replay first.",
                      "first_lever": "routing_replay", "preset": "decoupled_geo_rs",
                      "text": ["Routing replay removes 62% of the mean |Δ log p| gap.",
                               "The lm_head runs in bfloat16 on the train side & float32 in the rollout <engine>."],
                      "ranked": [{"cause": c, "lever": "routing_replay" if c == "routing flips" else None,
                                  "share": v, "fraction": v / sum(shares.values())}
                                 for c, v in sorted(shares.items(), key=lambda kv: -kv[1])],
                      "findings": [{"field": "weights.layers.2", "severity": "gap",
                                    "message": "checksums differ between rollout and train"},
                                   {"field": "attention.implementation", "severity": "info",
                                    "message": "sdpa vs eager"}]},
        "plots": plots,
        "contract": {"rollout": {"dtypes": {"lm_head": "float32"}}, "train": {"dtypes": {"lm_head": "bfloat16"}},
                     "fields": [{"field": "dtypes.lm_head", "rollout": "float32", "train": "bfloat16",
                                 "status": "differs", "message": "head precision differs"},
                                {"field": "weights.layers.2", "rollout": "ab12", "train": "cd34", "status": "gap",
                                 "message": "weights differ"},
                                {"field": "attention.implementation", "rollout": "sdpa", "train": "eager",
                                 "status": "info", "message": "kernels differ"},
                                {"field": "tokenizer", "rollout": {"vocab": 4096}, "train": {"vocab": 4096},
                                 "status": "same", "message": ""},
                                {"field": "seed", "rollout": None, "train": NAN, "status": "same", "message": None}]},
    }


def _figure(html: str, name: str) -> str:
    m = re.search(rf'<figure class="([^"]*)" id="plot-{name}">(.*?)</figure>', html, flags=re.S)
    assert m, f"no figure plot-{name}"
    return m.group(0)


def _is_missing(html: str, name: str) -> bool:
    return "missing" in re.search(rf'<figure class="([^"]*)" id="plot-{name}">', html).group(1).split()


@pytest.fixture(scope="module")
def page_html() -> str:
    return render_html(synthetic_report())


# --------------------------------------------------------------------------------------------------
# unit tests (no browser)
# --------------------------------------------------------------------------------------------------


def test_every_plot_is_drawn_from_the_synthetic_report(page_html):
    for name in PLOT_IDS:
        fig = _figure(page_html, name)
        if name == "kept-set":                              # the section left empty
            assert _is_missing(page_html, name) and "not measured" in fig
        else:
            assert not _is_missing(page_html, name), fig[:400]
            assert "<svg" in fig and "<figcaption>" in fig
    full = render_html(synthetic_report(empty=()))
    assert all(not _is_missing(full, name) for name in PLOT_IDS)
    for table in ("table-runs", "table-levers", "table-attribution", "table-worst-tokens", "table-contract",
                  "table-ranked", "table-full-vocab-kl"):
        assert f'<table id="{table}">' in page_html, table


def test_zeros_per_run_are_stated(page_html):
    fig = _figure(page_html, "logp-hist")
    for text in ("baseline: 0", "routing_replay: 37", "all levers: 412"):
        assert text in fig


def test_text_from_the_report_is_escaped(page_html):
    assert XSS not in page_html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page_html
    assert "<script" not in page_html.lower()
    assert "<b>injection</b>" not in page_html and "&lt;b&gt;injection&lt;/b&gt;" in page_html
    assert "&lt;engine&gt;" in page_html                          # diagnosis text
    hostile = synthetic_report()
    hostile["model"] = '"><img src=x onerror=alert(1)>'
    hostile["runs"][0]["name"] = "<i>run</i> $x$ & 'q'"
    hostile["plots"]["position"]["series"]["$\\frac{"] = [0.1] * 48     # mathtext that does not parse
    hostile["contract"]["fields"][0]["field"] = "</table><script>x()</script>"
    hostile["diagnosis"]["findings"][0]["severity"] = '"><script>'
    page = render_html(hostile)
    assert "<img" not in page and "<script" not in page.lower() and "<i>run</i>" not in page
    assert "&lt;i&gt;run&lt;/i&gt; $x$ &amp; &#x27;q&#x27;" in page
    assert not _is_missing(page, "position")


def test_page_is_self_contained(page_html):
    lower = page_html.lower()
    for bad in ("<link", "<script", "@import", "@font-face", "<iframe", "<object", "<embed", "<!doctype svg",
                "<?xml", "<metadata"):
        assert bad not in lower, bad
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//|ftp:)""", page_html, flags=re.I)
    assert not re.search(r"url\(\s*['\"]?\s*(https?:|//)", page_html, flags=re.I)
    # the SVG namespace is the only URL-like text (a name, never fetched)
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", page_html))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls
    assert "Content-Security-Policy" in page_html and "default-src 'none'" in page_html


def test_element_ids_are_unique_across_the_inline_svgs(page_html):
    ids = re.findall(r'\bid="([^"]+)"', page_html)
    dupes = {i for i in ids if ids.count(i) > 1}
    assert not dupes, sorted(dupes)[:10]
    refs = set(re.findall(r'href="#([^"]+)"', page_html)) | set(re.findall(r"url\(#([^)]+)\)", page_html))
    assert refs <= set(ids), sorted(refs - set(ids))[:10]


def test_nan_is_na_in_tables_and_skipped_in_plots(page_html):
    runs = re.search(r'<table id="table-runs">.*?</table>', page_html, flags=re.S).group(0)
    assert "n/a" in runs                                           # baseline support_mismatch_rate NaN
    assert "nan" not in runs.lower().replace("n/a", "")
    worst = re.search(r'<table id="table-worst-tokens">.*?</table>', page_html, flags=re.S).group(0)
    assert worst.count("<tr>") == 1 + html_report.WORST_TOKENS    # header + 20 rows of 30 tokens
    assert "n/a" in worst                                          # worst[5]'s train log p
    assert "nan" not in worst.lower().replace("n/a", "")
    few = synthetic_report()
    few["plots"]["worst_tokens"] = few["plots"]["worst_tokens"][3:6]
    worst = re.search(r'<table id="table-worst-tokens">.*?</table>', render_html(few), flags=re.S).group(0)
    assert worst.count("<tr>") == 4 and worst.count("n/a") == 3   # the NaN |Δ log p| row comes last
    assert worst.rindex("n/a") > worst.rindex("<tr>")
    attribution = re.search(r'<table id="table-attribution">.*?</table>', page_html, flags=re.S).group(0)
    assert "n/a" in attribution
    contract = re.search(r'<table id="table-contract">.*?</table>', page_html, flags=re.S).group(0)
    assert 'class="status-gap"' in contract and 'class="status-info"' in contract
    # a series that is NaN everywhere is skipped; one that has a value draws
    report = synthetic_report()
    report["plots"]["position"]["series"] = {"baseline": [NAN] * 48}
    assert _is_missing(render_html(report), "position")
    report["plots"]["position"]["series"]["baseline"][5] = 0.1
    assert not _is_missing(render_html(report), "position")


def test_worst_tokens_sorted_largest_first(page_html):
    worst = re.search(r'<table id="table-worst-tokens">.*?</table>', page_html, flags=re.S).group(0)
    first = re.search(r'<mark class="token">(.*?)</mark>', worst).group(1)
    assert first == "<bdi>&lt;script&gt;alert(1)&lt;/script&gt;</bdi>"        # |Δ log p| 9.5: the largest


@pytest.mark.parametrize("drop", ["runs", "levers", "attribution", "diagnosis", "plots", "contract", "rollout",
                                  "train", "moe_layers", "model"])
def test_a_missing_section_renders(drop):
    report = synthetic_report(empty=())
    del report[drop]
    page = render_html(report)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for name in PLOT_IDS:
        _figure(page, name)


def test_an_empty_report_says_not_measured_everywhere():
    page = render_html({})
    for name in PLOT_IDS:
        assert _is_missing(page, name)
        assert "not measured:" in _figure(page, name)
    for table in ("table-runs", "table-levers", "table-attribution", "table-worst-tokens", "table-contract"):
        assert re.search(rf'<p class="not-measured" id="{table}">not measured: ', page), table


@pytest.mark.parametrize("section, value", [
    ("logp_hist", {"edges": [0, 1, 2], "series": {"a": [1, 2]}}),           # a zero edge on a log axis
    ("logp_hist", {"edges": [1e-3, 1e-2], "series": {"a": [1, 2, 3]}}),      # counts do not match the bins
    ("logp_hist", {"edges": [1e-3, 1e-2], "series": {"a": [0]}}),            # all zero
    ("position", {"positions": "abc", "series": {"a": [1]}}),
    ("position", {"positions": [0, 1], "series": {"a": None}}),
    ("is_tail", {"grid": [0.5, 2.0], "series": {"a": "x"}}),
    ("is_tail", {"grid": [0.5, 2.0], "series": {"a": {"above": [NAN, NAN]}}}),
    ("kept_set", {"sizes": [1, 2], "series": {"a": {"tokens": [0, 0], "support_mismatch_rate": [0.1, 0.2]}}}),
    ("full_vocab_kl", {"positions": [], "series": {}}),
    ("flip_rate", {"layers": [0, 1], "series": {"a": [NAN, NAN]}}),
])
def test_malformed_or_empty_plot_data_is_not_measured(section, value):
    report = {"moe_layers": [0, 1], "plots": {section: value}}         # no lever runs: no flip-rate fallback
    page = render_html(report)
    name = section.replace("_", "-")
    assert _is_missing(page, name), _figure(page, name)[:300]
    assert "not measured:" in _figure(page, name)


@pytest.mark.parametrize("bad", [7, "text", [1, "x"], {"runs": 3, "fields": "y"}, None, NAN])
def test_values_of_the_wrong_type_never_crash(bad):
    keys = ["model", "rollout", "train", "num_tokens", "moe_layers", "elapsed_s", "runs", "levers", "attribution",
            "diagnosis", "plots", "contract"]
    page = render_html({k: bad for k in keys})
    assert page.rstrip().endswith("</html>") and "<header><h1>" in page
    assert all(_is_missing(page, n) for n in PLOT_IDS)


def test_entries_of_the_wrong_type_never_crash():
    report = synthetic_report()
    report["runs"][0] = "not a run"
    report["levers"]["runs"][1]["metrics"] = [1, 2]
    report["diagnosis"]["ranked"] = 5
    report["contract"]["fields"][0] = None
    report["plots"]["worst_tokens"][0]["flipped_layers"] = 3
    report["plots"]["logp_hist"]["zeros"] = "x"
    page = render_html(report)
    assert page.rstrip().endswith("</html>")


def test_flip_rate_falls_back_to_lever_metrics():
    report = synthetic_report()
    del report["plots"]["flip_rate"]
    assert not _is_missing(render_html(report), "flip-rate")


def test_plots_not_a_dict_and_non_dict_report():
    report = synthetic_report()
    report["plots"] = "garbage"
    report["attribution"] = {"metrics": {"kl_k3": {"shares": {"x": "y"}, "residual": None}}}
    page = render_html(report)
    assert all(_is_missing(page, n) for n in PLOT_IDS if n != "flip-rate")
    with pytest.raises(ConfigError):
        render_html([1, 2])


def test_the_page_leads_with_the_answer(page_html):
    """The headline and the attribution chart come first (one section), then the plots, the prose, the tables; the
    lever table is folded (<details>, no script) and every table scrolls inside its own box."""
    order = [page_html.index(x) for x in ('<p class="headline">', 'id="plot-attribution"', '<section id="plots">',
                                          'id="plot-flip-rate"', '<section id="diagnosis-details">',
                                          '<section id="tables">', '<details id="levers-details">')]
    assert order == sorted(order), order
    answer = re.search(r'<section id="answer">(.*?)</section>', page_html, flags=re.S).group(1)
    assert '<p class="headline">' in answer and 'id="plot-attribution"' in answer
    details = re.search(r'<details id="levers-details">(.*?)</details>', page_html, flags=re.S).group(0)
    assert '<table id="table-levers">' in details and " open" not in details.split(">")[0]
    assert "<summary><bdi>Lever runs: 4 lever sets scored</bdi></summary>" in details
    assert page_html.count("<table ") == page_html.count('<div class="scroll"><table ')


def test_one_colour_per_run_name():
    colors = RunColours(["baseline"])
    names = [f"run {i}" for i in range(200)]
    got = [colors.colour(n) for n in names]
    assert len(set(got)) == len(got) and colors.colour("baseline") not in got
    assert not set(got) & set(RESERVED)
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in got)
    assert colors.colour("run 7") == got[7]                      # stable: asked again, the same colour
    page = render_html(synthetic_report())
    legend = re.search(r'<ul class="legend" id="run-colours".*?</ul>', page, flags=re.S).group(0)
    colours = re.findall(r'data-colour="([^"]+)"', legend)
    assert len(colours) == len(set(colours)) == 9
    assert 'data-run="0" data-colour="#1f77b4"><svg' in legend and "<bdi>baseline</bdi>" in legend
    # each run's marks in every plot carry its index and are drawn in its legend colour
    for run, colour in re.findall(r'data-run="(\d+)" data-colour="([^"]+)"', legend):
        marks = re.findall(rf'<g id="p-[a-z-]+-run{run}-\d+">\s*<path[^>]*style="([^"]*)"', page)
        assert marks, run
        assert all(f"fill: {colour}" in m or f"stroke: {colour}" in m for m in marks), (run, colour, marks[:2])
    # a plot whose drawing fails adds nothing to the legend
    report = synthetic_report()
    report["plots"]["position"]["series"] = {"only here": "garbage"}
    assert "only here" not in re.search(r'<ul class="legend".*?</ul>', render_html(report), flags=re.S).group(0)


def test_is_tail_is_small_multiples():
    """One panel per run (3 runs in the synthetic report), no legend of 2 x runs entries, the x range fitted to the
    ratios a run reaches, the band and the threshold."""
    fig, caption = html_report._plot_is_tail(synthetic_report(), RunColours())
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 3 and all(ax.get_legend() is None for ax in axes)
    assert [ax.get_title(loc="left") for ax in axes] == ["baseline", "routing_replay", "all levers"]
    assert "one panel per run" in caption and "IcePop band [0.5, 5]" in caption
    report = synthetic_report()
    grid = report["plots"]["is_tail"]["grid"] = IS_GRID                # the real grid: 100 points a decade
    for tails in report["plots"]["is_tail"]["series"].values():          # every ratio within [0.9, 1.1]
        tails["above"] = [0.3 if 1 < g < 1.1 else 0.0 for g in grid]
        tails["below"] = [0.3 if 0.9 < g < 1 else 0.0 for g in grid]
    report["plots"]["is_tail"]["icepop_band"] = None
    report["plots"]["is_tail"]["tis_threshold"] = None
    fig, _ = html_report._plot_is_tail(report, RunColours())
    lo, hi = fig.axes[0].get_xlim()
    assert 0.5 < lo < 0.9 and 1.1 < hi < 2, (lo, hi)


def test_report_json_is_strict(tmp_path):
    np = pytest.importorskip("numpy")
    report = synthetic_report()
    report["extra"] = {"array": np.array([1.0, np.nan, np.inf]), "scalar": np.float32(0.5), "tuple": (1, -math.inf)}

    def refuse(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    parsed = json.loads(report_json(report), parse_constant=refuse)
    assert parsed["extra"] == {"array": [1.0, None, None], "scalar": 0.5, "tuple": [1, None]}
    assert parsed["plots"]["position"]["series"]["baseline"][10] is None
    assert parsed["runs"][0]["metrics"]["support_mismatch_rate"] is None
    assert report_json(report).startswith('{\n "model"')                 # indent=1
    paths = write_report_dir(report, tmp_path / "out")
    assert json.loads(Path(paths["json"]).read_text(), parse_constant=refuse) == parsed


def test_write_report_dir_creates_and_returns_paths(tmp_path):
    target = tmp_path / "a" / "b"
    paths = write_report_dir(synthetic_report(), str(target))
    assert paths == {"html": str(target / "report.html"), "json": str(target / "report.json")}
    assert Path(paths["html"]).read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(os.listdir(target)) == ["report.html", "report.json"]
    write_report_dir(synthetic_report(seed=1), target)                   # an existing directory is reused
    assert not [n for n in os.listdir(target) if TMP_MARKER in n]


def test_write_report_dir_refuses_a_file(tmp_path):
    f = tmp_path / "report"
    f.write_text("keep me")
    with pytest.raises(ConfigError, match="not a directory") as info:
        write_report_dir(synthetic_report(), f)
    assert isinstance(info.value, MoealignError)
    assert f.read_text() == "keep me"
    with pytest.raises(ConfigError):
        write_report_dir(synthetic_report(), "")
    with pytest.raises(ConfigError):
        write_report_dir(synthetic_report(), tmp_path / "report" / "sub")   # below a file


def test_write_report_dir_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_report_dir(synthetic_report(seed=1), out)
    before = {n: (out / n).read_bytes() for n in ("report.html", "report.json")}
    real_replace = os.replace

    def failing_replace(src, dst, *a, **k):
        if str(dst).endswith("report.html"):
            raise OSError("disk full (simulated)")
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        write_report_dir(synthetic_report(seed=2), out)
    monkeypatch.undo()
    assert (out / "report.html").read_bytes() == before["report.html"]      # old page intact, no half file
    assert not [n for n in os.listdir(out) if TMP_MARKER in n]
    # a report that cannot be rendered writes nothing at all
    with pytest.raises(ConfigError):
        write_report_dir("not a dict", tmp_path / "never")
    assert not (tmp_path / "never").exists()


# --------------------------------------------------------------------------------------------------
# the browser test
# --------------------------------------------------------------------------------------------------


#: Elements that stick out of the viewport, except inside a scroll (or clipping) box that fits it; and the page's own
#: scroll width. Elements not shown (a folded ``<details>``) are skipped: the checks run with them folded and open.
OVERFLOW_JS = """() => {
    const vw = document.documentElement.clientWidth;
    const fits = r => r.left >= -0.5 && r.right <= vw + 0.5;
    const clippedInside = el => {
        for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
            const ox = getComputedStyle(a).overflowX;
            if (ox === 'auto' || ox === 'scroll' || ox === 'hidden' || ox === 'clip') return fits(a.getBoundingClientRect());
        }
        return false;
    };
    const wide = [];
    for (const el of document.body.querySelectorAll('*')) {
        const r = el.getBoundingClientRect();
        if ((r.width === 0 && r.height === 0) || !el.checkVisibility()) continue;
        if (!fits(r) && !clippedInside(el)) wide.push(`${el.tagName.toLowerCase()}#${el.id}.${el.getAttribute('class') || ''} `
                                                       + `${Math.round(r.left)}..${Math.round(r.right)} > ${vw}`);
    }
    return {viewport: vw, scrollWidth: document.documentElement.scrollWidth, wide: wide.slice(0, 20)};
}"""

#: Every run's colours as drawn: the marks the report tags ``...-run{INDEX}-{N}`` in every plot's SVG (a line's stroke,
#: a bar's fill), and the legend's swatch per run index.
COLOURS_JS = """() => {
    const colour = el => { const cs = getComputedStyle(el); return cs.stroke !== 'none' ? cs.stroke : cs.fill; };
    const drawn = {}, plots = {};
    for (const g of document.querySelectorAll('figure.plot svg g[id]')) {
        const m = g.id.match(/-run(\\d+)-\\d+$/);
        const shape = m && g.querySelector('path');
        if (!shape) continue;
        (drawn[m[1]] = drawn[m[1]] || []).push(colour(shape));
        (plots[m[1]] = plots[m[1]] || new Set()).add(g.closest('figure').id);
    }
    const legend = {};
    for (const li of document.querySelectorAll('#run-colours li[data-run]'))
        legend[li.dataset.run] = {name: li.textContent, colour: getComputedStyle(li.querySelector('rect')).fill};
    return {drawn, legend, plots: Object.fromEntries(Object.entries(plots).map(([k, v]) => [k, [...v].sort()]))};
}"""

#: The colour checker: given {run: [colours drawn]}, the runs drawn in more than one colour and the colours that
#: more than one run shares.
SHARED_COLOURS_JS = """(drawn) => {
    const byColour = {}, several = [];
    for (const [run, colours] of Object.entries(drawn)) {
        const distinct = [...new Set(colours)];
        if (distinct.length > 1) several.push(run);
        for (const c of distinct) (byColour[c] = byColour[c] || []).push(run);
    }
    const shared = Object.entries(byColour).filter(([c, runs]) => runs.length > 1).map(([c, runs]) => [c, runs.sort()]);
    return {several: several.sort(), shared};
}"""

#: Where the headline and the plots sit on the first screen.
FIRST_SCREEN_JS = """() => {
    const box = el => { if (!el) return null; const r = el.getBoundingClientRect();
                        return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, width: r.width}; };
    const svgs = [...document.querySelectorAll('figure.plot:not(.missing) > svg')];
    const onScreen = svgs.filter(s => { const r = s.getBoundingClientRect();
                                        return r.top >= 0 && r.bottom <= innerHeight && r.width > 250; });
    const levers = document.querySelector('#table-levers');
    return {height: innerHeight, pageHeight: document.documentElement.scrollHeight,
            headline: box(document.querySelector('p.headline')),
            attribution: box(document.querySelector('#plot-attribution > svg')),
            plotsOnScreen: onScreen.map(s => s.closest('figure').id),
            leversFolded: !!levers && !!levers.closest('details') && !levers.closest('details').open
                          && !levers.checkVisibility()};
}"""


def check_layout(page, *, artifact: str) -> dict:
    """The layout checks of a report open in ``page`` (any report): a 1280x800 first screen holding the headline
    and the attribution chart side by side (screenshot under ``test-artifacts/ARTIFACT``), the lever table folded,
    no element wider than the viewport at 1280 and 600 pixels, one colour per run in every plot and the legend, no
    two runs sharing one. Each checker also runs on a negative control. Returns the measurements."""
    page.set_viewport_size({"width": 1280, "height": 800})
    page.evaluate("window.scrollTo(0, 0)")
    first = page.evaluate(FIRST_SCREEN_JS)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / artifact))
    head, chart = first["headline"], first["attribution"]
    assert head and 0 <= head["top"] and head["bottom"] <= first["height"], first
    assert chart and 0 <= chart["top"] and chart["bottom"] <= first["height"] and chart["width"] > 400, first
    assert head["right"] <= chart["left"] and head["top"] < chart["bottom"] and chart["top"] < head["bottom"], first
    assert "plot-attribution" in first["plotsOnScreen"], first
    assert first["leversFolded"], first

    for width, unfold in ((1280, False), (600, False), (1280, True), (600, True)):
        page.set_viewport_size({"width": width, "height": 800})
        page.evaluate("(open) => document.querySelectorAll('details').forEach(d => { d.open = open; })", unfold)
        layout = page.evaluate(OVERFLOW_JS)
        assert layout["scrollWidth"] <= layout["viewport"] and not layout["wide"], (width, unfold, layout)
    page.evaluate("() => document.querySelectorAll('details').forEach(d => { d.open = false; })")
    # negative control: an element wider than the viewport, outside any scroll box, is reported
    page.evaluate("""() => { const d = document.createElement('div'); d.id = 'too-wide'; d.style.width = '3000px';
                              d.style.height = '4px'; document.body.appendChild(d); }""")
    control = page.evaluate(OVERFLOW_JS)
    page.evaluate("document.getElementById('too-wide').remove()")
    assert control["scrollWidth"] > control["viewport"] and any(w.startswith("div#too-wide") for w in control["wide"])
    page.set_viewport_size({"width": 1280, "height": 800})

    colours = page.evaluate(COLOURS_JS)
    drawn, legend = colours["drawn"], colours["legend"]
    assert drawn and len(drawn) >= 2, colours
    assert page.evaluate(SHARED_COLOURS_JS, drawn) == {"several": [], "shared": []}, colours
    assert set(drawn) == set(legend), colours                        # the legend lists exactly the runs drawn
    for run, values in drawn.items():
        assert set(values) == {legend[run]["colour"]}, (legend[run], values)
    assert len({v["colour"] for v in legend.values()}) == len(legend), legend
    # negative controls of the checker: two runs in one colour, one run in two colours
    bad = page.evaluate(SHARED_COLOURS_JS, {"a": ["rgb(1, 2, 3)"], "b": ["rgb(1, 2, 3)"],
                                            "c": ["rgb(4, 5, 6)", "rgb(7, 8, 9)"]})
    assert bad == {"several": ["c"], "shared": [["rgb(1, 2, 3)", ["a", "b"]]]}, bad
    first["colours"] = colours
    return first


def _browser_or_fail():
    if os.environ.get("MOEALIGN_NO_BROWSER") == "1":
        pytest.skip("MOEALIGN_NO_BROWSER=1: the headless-browser test of the HTML report is skipped")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run `bash tools/setup.sh test` (it installs Debian's chromium), "
                    "or set MOEALIGN_NO_BROWSER=1 to skip this test", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.fail(f"playwright does not import ({exc}): run `bash tools/setup.sh test` (installs .[test])",
                    pytrace=False)
    return sync_playwright


def test_report_in_headless_chromium(tmp_path):
    sync_playwright = _browser_or_fail()
    t0 = time.perf_counter()
    paths = write_report_dir(synthetic_report(), tmp_path / "report")
    url = Path(paths["html"]).resolve().as_uri()
    errors, requests, dialogs = [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("request", lambda r: requests.append(r.url))

            def on_dialog(d):
                dialogs.append(d.message)
                d.dismiss()

            page.on("dialog", on_dialog)
            page.goto(url, wait_until="load")
            page.wait_for_timeout(200)          # late errors / requests
            figures = page.evaluate("""() => [...document.querySelectorAll('figure.plot')].map(f => {
                const svg = f.querySelector(':scope > svg');
                const r = svg ? svg.getBoundingClientRect() : null;
                return {id: f.id, missing: f.classList.contains('missing'),
                        w: r ? r.width : 0, h: r ? r.height : 0,
                        caption: (f.querySelector('figcaption') || f.querySelector('.not-measured') || {}).textContent};
            })""")
            xss = page.evaluate("""(xss) => ({
                scripts: document.querySelectorAll('script').length,
                shown: [...document.querySelectorAll('mark.token')].some(m => m.textContent === xss),
                bodyText: document.body.innerText.includes(xss),
            })""", XSS)
            rows = page.evaluate("""() => [...document.querySelectorAll('#table-contract tbody tr')].map(
                tr => [tr.className, getComputedStyle(tr.querySelector('td')).backgroundColor])""")
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
            shutil.copyfile(paths["html"], ARTIFACTS / "report.html")
            layout = check_layout(page, artifact="report-first-screen.png")
            # a report whose runs outnumber the palette still gives every run its own colour
            many = synthetic_report()
            many["plots"]["position"]["series"].update({f"run {i}": [0.01 * i] * 48 for i in range(30)})
            other_page = browser.new_page()
            other_page.goto(Path(write_report_dir(many, tmp_path / "many")["html"]).resolve().as_uri(),
                            wait_until="load")
            many_layout = check_layout(other_page, artifact="report-many-runs-first-screen.png")
        finally:
            browser.close()
    elapsed = time.perf_counter() - t0
    print(f"browser test: {elapsed:.2f} s (render, launch, load, checks, screenshot)")

    assert not errors, errors
    assert not dialogs, f"the injected script ran: {dialogs}"
    assert {f["id"] for f in figures} == {f"plot-{n}" for n in PLOT_IDS}
    drawn = [f for f in figures if not f["missing"]]
    assert {f["id"] for f in drawn} == {f"plot-{n}" for n in PLOT_IDS if n != "kept-set"}
    for f in drawn:
        assert f["w"] > 50 and f["h"] > 50, f
    assert all("not measured" in f["caption"] for f in figures if f["missing"])
    assert xss == {"scripts": 0, "shown": True, "bodyText": True}
    other = [u for u in requests if u.split("#")[0] != url]
    assert not other, f"requests left the page: {other}"
    assert requests and requests[0] == url
    colours = {cls: bg for cls, bg in rows}
    assert colours["status-gap"] != colours["status-info"] != colours["status-same"]
    assert (ARTIFACTS / "report.png").stat().st_size > 10_000
    print(f"page height {layout['pageHeight']} px at 1280x800; runs coloured: "
          + ", ".join(v["name"] for v in layout["colours"]["legend"].values()))
    # baseline, routing_replay, routing_replay+precision, all levers (plots) and the 5 causes (attribution bars)
    assert len(layout["colours"]["legend"]) == 9
    assert len(many_layout["colours"]["legend"]) == 9 + 30

"""Acceptance of the diagnosis on the embedded default (transformers rollout and trainer, CPU).

* the attribution's parts add up to the measured gap, and with every lever on the two sides agree bitwise;
* each cause's share of the gap is reproducible across sampling seeds within ``SHARE_TOLERANCE``;
* an injected fault is named first: weights of one layer perturbed on the rollout side, a one-sided fp32 LM head,
  routing replay switched off (and, in ``test_diagnosis_vllm.py``, TP = 2 stock reductions on the vLLM side);
* the report of a real run renders in headless Chromium without console errors, every plot drawn.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from moealign.mismatch import MismatchConfig, run_mismatch
from moealign.mismatch.levers import CAUSES

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

#: Absolute tolerance on each cause's fraction of the mean |delta log p| gap across seeds 0, 1, 2.
SHARE_TOLERANCE = 0.10

SMALL = dict(rollout_engine="hf", train_engine="hf", num_prompts=12, max_new_tokens=24, batch_size=6, device="cpu")


def _report(**kw) -> dict:
    return run_mismatch(MismatchConfig(**{**SMALL, "diagnose": True, **kw}))


@pytest.fixture(scope="module")
def default_reports():
    """bf16 rollout vs fp32 trainer (the mismatch test's default precisions), three sampling seeds."""
    return {seed: _report(seed=seed) for seed in (0, 1, 2)}


def _fractions(report: dict) -> dict:
    a = report["attribution"]["metrics"]["mean_abs_logp_diff"]
    return {cause: share / a["gap"] for cause, share in a["shares"].items()}


def test_attribution_adds_up_to_the_measured_gap(default_reports):
    report = default_reports[0]
    runs = {r["name"]: r["metrics"] for r in report["runs"]}
    for metric, a in report["attribution"]["metrics"].items():
        total = sum(a["shares"].values()) + a["residual"]
        assert math.isclose(total, a["gap"], rel_tol=1e-9, abs_tol=1e-12), (metric, total, a["gap"])
        # the gap attributed is the one the mismatch test measures (its baseline run)
        assert math.isclose(a["gap"], runs["baseline"][metric], rel_tol=1e-9, abs_tol=1e-12), metric
    players = report["levers"]["players"]
    assert players == ["sampling_mask", "routing_replay", "precision", "batch_invariant"]
    assert report["levers"]["regions"] == [f"precision:{r}" for r in ("router", "attention", "experts", "lm_head",
                                                                       "other")]
    # every lever on: the same network, precision, batching and log-prob formula on both sides -> bitwise
    final = next(r for r in report["levers"]["runs"] if set(r["levers"]) == set(players))
    assert final["metrics"]["max_abs_logp_diff"] == 0.0
    assert report["diagnosis"]["residual_class"] == "aligned" and report["diagnosis"]["preset"] == "disabled"
    # negative control: no lever, or every lever but one, leaves a gap
    base = next(r for r in report["levers"]["runs"] if not r["levers"])
    assert base["metrics"]["max_abs_logp_diff"] > 0
    for p in ("precision", "sampling_mask"):
        one_off = next(r for r in report["levers"]["runs"] if set(r["levers"]) == set(players) - {p})
        assert one_off["metrics"]["max_abs_logp_diff"] > 0, p
    # the regions' split of precision adds up to what precision removes alone
    regions = report["attribution"]["metrics"]["mean_abs_logp_diff"]["regions"]
    assert math.isclose(sum(regions["shares"].values()), regions["removed_alone"], rel_tol=1e-9, abs_tol=1e-12)
    # the rollout side was re-scored along its own path bitwise (no note says otherwise)
    assert not any("did not reproduce" in n for n in report["levers"]["notes"])


def test_shares_are_reproducible_across_seeds(default_reports):
    fractions = {seed: _fractions(r) for seed, r in default_reports.items()}
    causes = set().union(*fractions.values())
    for cause in causes:
        values = [fractions[s].get(cause, 0.0) for s in fractions]
        assert max(values) - min(values) <= SHARE_TOLERANCE, (cause, values)
    # and the ranking's head is the same cause every time
    firsts = {r["diagnosis"]["ranked"][0]["cause"] for r in default_reports.values()}
    assert len(firsts) == 1, firsts


def test_full_vocabulary_kl_is_measured(default_reports):
    kl = default_reports[0]["plots"]["full_vocab_kl"]
    assert kl["summary"]["baseline"]["mean"] > 0
    assert kl["summary"]["all levers"]["max"] == 0.0          # the whole distribution agrees, not just the token


def _first(report: dict) -> str:
    return report["diagnosis"]["first_cause"]


def _top_share(report: dict) -> str:
    return report["diagnosis"]["ranked"][0]["lever"]


def test_shared_forwards_give_the_same_attribution(monkeypatch):
    """The diagnosis with forwards shared between lever sets (LM-head variants in one decode, the mismatch test's
    own trainer passes, the kept logits of the full-vocabulary KL, one forward for a batch-invariant decode)
    equals the straightforward evaluation (every lever set on its own, each rollout setup decoded) bitwise: every
    lever run's metrics, the Shapley / Owen shares, the KL; with fewer decodes."""
    import json

    from moealign.mismatch import MismatchConfig, levers, run_mismatch
    from moealign.patches.hf import rollout

    calls = []

    def counting(name):
        real = getattr(rollout, name)

        def call(*args, **kwargs):
            calls.append((name, bool(kwargs.get("head_variants"))))
            return real(*args, **kwargs)
        return call

    for name in ("rescore_decode_all", "rescore_forward"):
        monkeypatch.setattr(rollout, name, counting(name))
    cfg = dict(rollout_engine="hf", train_engine="hf", num_prompts=4, max_new_tokens=4, batch_size=2, device="cpu",
               diagnose=True)
    monkeypatch.setattr(levers, "DECODE_WORKERS", 1)         # every call counted here (the forked ones: below)
    out = {}
    for share in (True, False):
        monkeypatch.setattr(levers, "SHARE_FORWARDS", share)
        calls.clear()
        report = run_mismatch(MismatchConfig(**cfg))
        out[share] = (report, [n for n, _ in calls].count("rescore_decode_all"),
                      [n for n, _ in calls].count("rescore_forward"), sum(h for _, h in calls))
    (shared, n_shared, n_forward, with_heads), (plain, n_plain, n_plain_forward, _) = out[True], out[False]
    # a forward that does not reproduce the decode (one logit of the first sample nudged) is caught on the first
    # micro-batch: the batch-invariant setups are decoded instead, with a note, and the attribution is unchanged
    real_forward = rollout.rescore_forward

    def nudged(*args, **kwargs):
        res = real_forward(*args, **kwargs)
        res.logits[0][0, 0] += 1e-3
        return res

    monkeypatch.setattr(levers, "SHARE_FORWARDS", True)
    monkeypatch.setattr(rollout, "rescore_forward", nudged)
    caught = run_mismatch(MismatchConfig(**cfg))
    assert any("did not reproduce the decode" in n for n in caught["levers"]["notes"])
    assert caught["levers"]["work"]["rollout_forwards"] == 0 and caught["levers"]["work"]["forward_checks"] == 1
    assert len(shared["levers"]["regions"]) == 5 and len(shared["levers"]["runs"]) == 47
    dump = lambda x: json.dumps(x, sort_keys=True)                     # noqa: E731 - repr: exact floats
    assert dump(shared["levers"]["runs"]) == dump(plain["levers"]["runs"])
    assert dump(shared["attribution"]) == dump(plain["attribution"])
    assert dump(shared["plots"]["full_vocab_kl"]) == dump(plain["plots"]["full_vocab_kl"])
    assert dump(caught["attribution"]) == dump(plain["attribution"])
    assert shared["attribution"]["metrics"]["mean_abs_logp_diff"]["levers"]["precision"] != 0
    # the sharing happened: 34 rollout setups in 16 decodes and 2 batch-invariant forwards of 2 micro-batches
    # each (the first forward's micro-batch decoded too, to confirm it), the KL's 2 re-scorings reused
    # (straightforward: 34 + 2 decodes)
    assert (n_shared, n_forward, with_heads) == (33, 4, 37), (n_shared, n_forward, with_heads)
    assert shared["levers"]["work"] == {"rollout_decodes": 16, "rollout_forwards": 2, "forward_checks": 1,
                                        "train_passes": 5}, shared["levers"]["work"]
    assert (n_plain, n_plain_forward) == (72, 0), (n_plain, n_plain_forward)


def _workers_run(monkeypatch, nudge_child: str | None = None):
    """The diagnosis of a small run with the rollout setups decoded in 2 processes (``DECODE_WORKERS = 2``, also
    where torch has one thread): ``(report, decodes run in this process)``. ``nudge_child``: ``"logits"`` makes a
    forked worker's decodes differ from this process's (its logits scaled by 1.001), ``"raise"`` makes them fail."""
    from moealign.mismatch import MismatchConfig, levers, run_mismatch
    from moealign.patches.hf import rollout

    parent, here = os.getpid(), []
    real = rollout.rescore_decode_all

    def decode(*args, **kwargs):
        if os.getpid() == parent:
            here.append(1)
        elif nudge_child == "raise":
            raise RuntimeError("planted worker failure")
        res = real(*args, **kwargs)
        if os.getpid() != parent and nudge_child == "logits":
            for logits in res.logits:
                logits.mul_(1.001)
        return res

    monkeypatch.setattr(rollout, "rescore_decode_all", decode)
    monkeypatch.setattr(levers, "DECODE_WORKERS", 2)
    report = run_mismatch(MismatchConfig(rollout_engine="hf", train_engine="hf", num_prompts=4, max_new_tokens=4,
                                         batch_size=2, device="cpu", diagnose=True))
    return report, len(here)


@pytest.fixture
def one_thread():
    """One intra-op thread in this process (as under the suite's xdist workers), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_decode_workers_give_the_same_attribution(monkeypatch, one_thread):
    """The rollout setups decoded in forked processes (:data:`moealign.mismatch.levers.DECODE_WORKERS`) give the
    bits of decoding them one at a time in this process: every lever run, the attribution, the KL. Negative
    controls: a worker whose decodes differ from this process's is caught by the base check (every worker decodes
    a micro-batch of it) and the setups are decoded here, with a note; a worker that fails has its micro-batches
    decoded here, with a note. The attribution is the same in all three (the fallback decodes on this process's
    threads: one, by the fixture, as the workers')."""
    import json

    from moealign.mismatch import MismatchConfig, levers, run_mismatch

    monkeypatch.setattr(levers, "DECODE_WORKERS", 1)
    one = run_mismatch(MismatchConfig(rollout_engine="hf", train_engine="hf", num_prompts=4, max_new_tokens=4,
                                      batch_size=2, device="cpu", diagnose=True))
    forked, here = _workers_run(monkeypatch)
    dump = lambda x: json.dumps(x, sort_keys=True)                     # noqa: E731 - repr: exact floats
    assert dump(forked["levers"]["runs"]) == dump(one["levers"]["runs"])
    assert dump(forked["attribution"]) == dump(one["attribution"])
    assert dump(forked["plots"]["full_vocab_kl"]) == dump(one["plots"]["full_vocab_kl"])
    assert forked["levers"]["work"] == one["levers"]["work"] and not forked["levers"]["notes"]
    assert (forked["levers"]["decode_workers"], one["levers"]["decode_workers"]) == (2, 1)
    # 16 decoded setups x 2 micro-batches + the confirming decode: the other process decoded about half
    assert 10 <= here <= 22, here
    nudged, here = _workers_run(monkeypatch, "logits")
    assert any("process(es) did not reproduce the record" in n for n in nudged["levers"]["notes"]), nudged["levers"]["notes"]
    assert here == 1 + 33 and dump(nudged["attribution"]) == dump(one["attribution"])   # the check's half, then all
    failed, _ = _workers_run(monkeypatch, "raise")
    assert any("decode worker" in n and "planted worker failure" in n for n in failed["levers"]["notes"])
    assert dump(failed["attribution"]) == dump(one["attribution"])


def test_weights_of_one_layer_perturbed_on_one_side_are_named_first():
    report = _report(inject_fault="weights:layer=2", top_p=1.0, rollout_precision="bf16", train_precision="bf16")
    assert _first(report) == CAUSES["weights"]
    finding = report["diagnosis"]["findings"][0]
    assert finding["field"].startswith("weights") and "layer 2" in finding["message"]
    assert _top_share(report) == "weights"
    # control: the same run without the fault names no weights
    clean = _report(top_p=1.0, rollout_precision="bf16", train_precision="bf16")
    assert not any(f["field"].startswith("weights") for f in clean["diagnosis"]["findings"])
    assert "weights" not in clean["levers"]["players"]


def test_one_sided_fp32_lm_head_is_named_first():
    report = _report(rollout_precision="bf16-fp32-head", train_precision="bf16", top_p=1.0)
    assert "LM head" in _first(report) and "one-sided" in _first(report)
    assert report["levers"]["regions"] == ["precision:lm_head"]
    # the one-sided head is a measured cause too (in bf16 the decode-vs-full batch effects can be larger)
    share = next(r for r in report["diagnosis"]["ranked"] if r["lever"] == "precision:lm_head")
    assert share["share"] > 0 and share["fraction"] > 0.05, share


def test_routing_replay_switched_off_is_named_first():
    # the router's precision differs (an fp32 router on the trainer): routes flip by construction, and the game
    # has one precision region (8 lever sets, not the default pair's 47)
    pair = dict(top_p=1.0, rollout_precision="bf16", train_precision="bf16-fp32-router")
    report = _report(inject_fault="replay-off", **pair)
    assert report["levers"]["regions"] == ["precision:router"]
    assert _first(report) == "routing replay switched off"
    replay = next(r for r in report["runs"] if r["name"] == "routing_replay")
    assert replay["metrics"]["router_flip_rate"] > 0
    # control: with the replay working, nothing flips under it and no such finding
    clean = _report(**pair)
    assert next(r for r in clean["runs"] if r["name"] == "routing_replay")["metrics"]["router_flip_rate"] == 0
    assert _first(clean) != "routing replay switched off"


def test_real_report_renders_in_headless_chromium(default_reports, tmp_path):
    from test_html_report import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _browser_or_fail, check_layout

    from moealign.mismatch.html_report import PLOT_IDS, write_report_dir

    sync_playwright = _browser_or_fail()
    paths = write_report_dir(default_reports[0], tmp_path / "report")
    url = Path(paths["html"]).resolve().as_uri()
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url, wait_until="load")
            figures = page.evaluate("""() => [...document.querySelectorAll('figure.plot')].map(f => {
                const svg = f.querySelector(':scope > svg');
                const r = svg ? svg.getBoundingClientRect() : null;
                return {id: f.id, missing: f.classList.contains('missing'), w: r ? r.width : 0, h: r ? r.height : 0};
            })""")
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "mismatch-report.png"), full_page=True)
            shutil.copyfile(paths["html"], ARTIFACTS / "mismatch-report.html")
            # the first screen holds the headline and the attribution chart; nothing wider than the viewport; one
            # colour per run in every plot
            check_layout(page, artifact="mismatch-report-first-screen.png")
        finally:
            browser.close()
    assert not errors, errors
    assert {f["id"] for f in figures} == {f"plot-{n}" for n in PLOT_IDS}
    for f in figures:                      # a real run measures every plot
        assert not f["missing"] and f["w"] > 50 and f["h"] > 50, f

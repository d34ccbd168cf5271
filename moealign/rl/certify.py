"""One call after any refit: :func:`certify_refit` checks the state a weight hash sees and the state it does not.

::

    from moealign.rl import Probe, certify_refit

    probe = Probe(seqs); probe.calibrate(llm, trainer)      # step 0, identical weights: the probes' bounds
    ...                                                      # any refit mechanism (moealign's refit, your own)
    cert = certify_refit(llm, trainer, probe=probe)          # or a WeightManifest (digests, buffers, prefix cache)
    cert.ok, cert.first_failed, cert.to_dict()               # one JSON verdict; cert.check() raises RefitError

Each check (:data:`CHECKS`: what it catches, the public bug it stands for) is ``passed``, ``failed`` or ``not_run``
(with the reason: a check that cannot apply to this engine, e.g. the prefix cache with caching off, or one whose
input is missing). The verdict names the first failed check in :data:`CHECKS`' order. Refused by name before any
work (:class:`~moealign.errors.MoealignError`): a sleeping engine (``llm.sleep()`` without ``wake_up()``), a probe
that cannot run (sequences plus decoded tokens longer than the engine's context, token ids outside its vocabulary,
a probe without a trainer for the teacher-forced side: a weight manifest, a snapshot), an uncalibrated probe.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import ConfigError, InputTypeError, RefitError
from .refit import NOT_CHECKED, Probe, verify_refit

__all__ = ["CHECKS", "PREFIX_CHECK_TOKENS", "RefitCertificate", "certify_refit", "prefix_cache_check",
           "prime_prefix_cache"]

#: Tokens the prefix-cache check samples per run: one. The first sampled token's log-prob comes from the prefill of
#: the prompt's tail, whose attention reads the cached block, so stale KV changes it (bitwise compared); more tokens
#: would add decode steps (~3 ms each on the embedded model) that read the same block again and catch nothing more.
PREFIX_CHECK_TOKENS = 1

#: The checks in verdict order: ``name -> (what it catches, the public bug it stands for)``.
CHECKS: dict[str, tuple[str, str]] = {
    "engine_awake": (
        "an engine left asleep (llm.sleep() without wake_up(): scheduler paused, weights offloaded or discarded); "
        "refused by name before any other check. Weights a wake restored from the base checkpoint are caught by "
        "tensor_digests",
        "TRL #5312 (sleep level 2 + wake_up restored the base weights: mismatch 0.015 -> 0.201)"),
    "config": (
        "a trainer whose config differs from the engine's in a field that changes a shape or the forward (RoPE "
        "settings included): equal tensors, other logits",
        "SGLang #28676 (state derived from the config at load)"),
    "tensor_digests": (
        "any tensor whose held bytes differ from the trainer's, per (tensor, worker), under its own name, read "
        "where the kernels read it (oneDNN / packed linears through the kernel, prepacked experts unpacked)",
        "SkyRL #1816 (tensors loaded under the wrong names, every byte count right)"),
    "derived_buffers": (
        "RoPE cos/sin caches that differ from the values their settings give, or settings that differ from the "
        "checkpoint's config (theta, rotary dimension, positions); tensors derived from the weights at load (MLA's "
        "absorbed W_UK_T / W_UV) that differ from what vLLM derives from the held kv_b_proj; every other buffer is "
        "named as unchecked",
        "SGLang #28676 (derived tensors built once: log-prob diff 0.06 -> 3.83), vLLM #55087"),
    "prefill_probe": (
        "any forward difference on a prompt's single prefill (derived state no digest reads, a stale kernel copy): "
        "vLLM's log-probs vs the trainer replaying vLLM's routes, mean |delta log p| within factor x step 0",
        "SGLang #28676 (derived caches the forward reads)"),
    "decode_probe": (
        "a fault on the decode path only (KV-cache reads, one-token steps, captured graphs with old pointers): "
        "tokens vLLM decodes with its own sampler and seed, scored teacher-forced by the trainer replaying the "
        "decode's routes",
        "NeMo-RL #2895 (decode CUDA graphs kept old pointers: prefill fine, decode corrupt, gen_kl_error 0.55)"),
    "prefix_cache": (
        "KV computed before the refit served after it: a probe prompt long enough to fill a KV block, run with "
        "caching on (one sampled token, whose log-prob the tail's prefill computes reading the cached block), must "
        "equal a cold run of the same prompt (a cache salt no block has), bitwise",
        "NeMo-RL #4018 (prefix cache never reset across 17 refits: KV up to 17 steps old)"),
}


@dataclass
class RefitCertificate:
    """:func:`certify_refit`'s verdict: one entry per check of :data:`CHECKS` (``status``: passed / failed /
    not_run, ``detail``, ``seconds``, what it catches and its public bug), the engine's config fields, what no check
    covers. ``to_dict()`` is the JSON verdict."""

    checks: list[dict]
    config: dict
    seconds: float = 0.0
    not_checked: list[str] = field(default_factory=list)
    refit_check: Any = None

    @property
    def ok(self) -> bool:
        return self.first_failed is None

    @property
    def first_failed(self) -> str | None:
        return next((c["name"] for c in self.checks if c["status"] == "failed"), None)

    def check(self) -> "RefitCertificate":
        """Raise :class:`~moealign.errors.RefitError` naming the first failed check and every failure."""
        if not self.ok:
            raise RefitError("refit certificate failed: " + self.describe())
        return self

    def describe(self) -> str:
        return "; ".join(f"{c['name']} {c['status'].upper() if c['status'] == 'failed' else c['status']}"
                         + (f" ({c['detail']})" if c["detail"] else "") for c in self.checks)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "first_failed": self.first_failed, "seconds": round(self.seconds, 6),
                "checks": [dict(c) for c in self.checks], "config": dict(self.config),
                "not_checked": list(self.not_checked)}


def _entry(name: str, status: str, detail: str = "", seconds: float = 0.0, **extra) -> dict:
    catches, bug = CHECKS[name]
    return {"name": name, "status": status, "detail": detail, "seconds": round(seconds, 6), "catches": catches,
            "stands_for": bug, **extra}


def _cache_prompts(prompts: Sequence[torch.Tensor], block: int, decode_tokens: int, context: int
                   ) -> tuple[list[list[int]] | None, str]:
    """Each prompt tiled to ``block + 8`` tokens (one full KV block, which vLLM caches, and a tail it computes); None
    with the reason where the context cannot hold that plus the decoded tokens."""
    length = block + 8
    if length + decode_tokens > context:
        return None, (f"the engine's context ({context}) cannot hold a prompt that fills one KV block ({block} "
                      f"tokens) plus a tail and {decode_tokens} decoded tokens: no prompt can hit the cache")
    out = []
    for seq in prompts:
        ids = seq.tolist()
        out.append((ids * (length // len(ids) + 1))[:length])
    return out, ""


def _check_prompts(prompts, what: str) -> list[torch.Tensor]:
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError(f"{what}: a non-empty list of 1-D token tensors")
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() == 0 or p.is_floating_point() \
                or bool((p < 0).any()):
            raise ConfigError(f"{what}[{i}]: a non-empty 1-D tensor of token ids >= 0")
    return list(prompts)


def prime_prefix_cache(llm, prompts: Sequence[torch.Tensor], *, decode_tokens: int = PREFIX_CHECK_TOKENS,
                       seed: int = 0) -> int:
    """Run the prefix-cache check's prompts once (plain ``llm.generate``, caching on, one sampled token: a prefill)
    so that their KV blocks are cached: call it before the first refit; :func:`certify_refit` re-primes them after every check. Returns the
    number of prompts (0 where the check cannot apply: caching off, a context too short)."""
    from ..patches.vllm.refit import as_llm, check_awake, decode_token_ids, engine_busy

    llm = as_llm(llm)
    check_awake(llm, "priming the prefix cache")
    prompts = _check_prompts(prompts, "prime_prefix_cache prompts")
    cache = llm.llm_engine.vllm_config.cache_config
    if not getattr(cache, "enable_prefix_caching", False):
        return 0
    tiled, _ = _cache_prompts(prompts, int(cache.block_size), decode_tokens,
                              int(llm.llm_engine.model_config.max_model_len))
    if tiled is None:
        return 0
    with engine_busy(llm, "priming the prefix cache", exclusive=False):
        decode_token_ids(llm, tiled, decode_tokens, seed, None)
    return len(tiled)


def prefix_cache_check(llm, prompts: Sequence[torch.Tensor], *, decode_tokens: int = PREFIX_CHECK_TOKENS,
                       seed: int = 0) -> dict:
    """The prefix-cache check alone (:data:`CHECKS` ``prefix_cache``): ``{"status", "detail", "cached_tokens"}``.
    With caching on, each prompt (tiled to one KV block and a tail) is run as is, reusing whatever the cache holds
    for it, and, in the same vLLM call (same seeds), with a cache salt no block has (a cold run); the sampled tokens
    and their log-probs must be equal (``torch.equal``). ``decode_tokens`` (default :data:`PREFIX_CHECK_TOKENS`, one:
    the whole check is one prefill step) tokens are sampled per run.
    The first run leaves the prompts' blocks cached under the current weights, priming the next check."""
    from ..patches.vllm.refit import as_llm, decode_token_ids, engine_busy

    llm = as_llm(llm)
    cache = llm.llm_engine.vllm_config.cache_config
    if not getattr(cache, "enable_prefix_caching", False):
        return {"status": "not_run", "detail": "prefix caching is off: no cached KV can outlive a refit",
                "cached_tokens": 0}
    tiled, why = _cache_prompts(_check_prompts(prompts, "prefix-cache prompts"), int(cache.block_size),
                                decode_tokens, int(llm.llm_engine.model_config.max_model_len))
    if tiled is None:
        return {"status": "not_run", "detail": why, "cached_tokens": 0}
    n = len(tiled)
    with engine_busy(llm, "the prefix-cache check", exclusive=False):      # both runs in one call, the same seeds
        both = decode_token_ids(llm, tiled + tiled, decode_tokens, [seed + i for i in range(n)] * 2,
                                [None] * n + [f"moealign-cold-{uuid.uuid4().hex}"] * n)
    hit, cold = both[:n], both[n:]
    cached = sum(h[2] for h in hit)
    bad = [i for i, (h, c) in enumerate(zip(hit, cold)) if h[0] != c[0] or not torch.equal(h[1], c[1])]
    if bad:
        i = bad[0]
        h, c = hit[i], cold[i]
        n = min(len(h[1]), len(c[1]))
        diff = float((h[1][:n] - c[1][:n]).abs().max()) if n else math.inf
        return {"status": "failed", "cached_tokens": cached,
                "detail": f"the PREFIX CACHE serves stale KV: prompt {i} reused {h[2]} cached tokens and its decode "
                          f"differs from a cold run of the same prompt (tokens {h[0]} vs {c[0]}, max |delta log p| "
                          f"{diff:.3g}); {len(bad)} of {len(tiled)} prompts differ. The refit did not reset the "
                          f"prefix cache (llm.reset_prefix_cache())"}
    return {"status": "passed", "cached_tokens": cached,
            "detail": f"{len(tiled)} prompt{'s' if len(tiled) > 1 else ''} of {len(tiled[0])} tokens, "
                      f"{decode_tokens} sampled token{'s' if decode_tokens > 1 else ''}: runs reusing {cached} cached "
                      f"tokens equal cold runs bitwise"}


def _engine_config(llm, sleep: dict, probe: Probe | None) -> dict:
    from ..patches.vllm.engine import vllm_version

    engine = llm.llm_engine
    cache = engine.vllm_config.cache_config
    out = {"model": str(engine.model_config.model), "dtype": str(engine.model_config.dtype).replace("torch.", ""),
           "max_model_len": int(engine.model_config.max_model_len),
           "tensor_parallel_size": int(engine.vllm_config.parallel_config.tensor_parallel_size),
           "prefix_caching": bool(getattr(cache, "enable_prefix_caching", False)),
           "block_size": int(cache.block_size), "vllm": str(vllm_version()), "sleep_mode": dict(sleep)}
    if probe is not None:
        out["probe"] = {"sequences": len(probe.sequences), "score_last": probe.score_last,
                        "decode_tokens": probe.decode_tokens, "seed": probe.seed, "bound": probe.bound,
                        "step0_gap": probe.step0_gap, "decode_bound": probe.decode_bound,
                        "decode_step0_gap": probe.decode_step0_gap}
    return out


def certify_refit(llm, trainer_or_manifest, hf_config=None, *, probe: Probe | None = None, expected=None,
                  cache_prompts: Sequence[torch.Tensor] | None = None, derived: bool = True) -> RefitCertificate:
    """Every check of :data:`CHECKS` on ``llm`` after a refit, one verdict (:class:`RefitCertificate`; never raises
    for a failed check: read ``.ok`` / ``.first_failed`` or call ``.check()``).

    ``trainer_or_manifest``: what :func:`~moealign.rl.verify_refit` takes (a moealign train engine, a Megatron
    ``GPTModel`` / transformers model, a snapshot mapping, a :class:`~moealign.rl.WeightManifest`). ``probe``: a
    calibrated :class:`~moealign.rl.Probe` (the prefill probe; the decode probe where it was calibrated with a
    decode; its first sequence is the prefix-cache check's prompt: one KV block of stale KV is as visible as two, and
    each prompt costs a cached and a cold prefill of a block and a tail); it needs a train engine. ``expected``: the
    tensors the engine should hold when they are not the trainer's (staleness; the probes then do not run).
    ``cache_prompts``: the prefix-cache check's prompts (all of them; without a probe, e.g. with a manifest, the only
    ones). ``derived=False`` skips the buffer check."""
    from ..patches.vllm.refit import as_llm, check_awake, check_derived_buffers
    from .manifest import WeightManifest

    t0 = time.perf_counter()
    llm = as_llm(llm)
    sleep = check_awake(llm, "certify_refit")                 # before any work: a sleeping engine is refused
    manifest = isinstance(trainer_or_manifest, WeightManifest)
    if probe is not None:
        if not isinstance(probe, Probe):
            raise InputTypeError(f"probe must be a moealign.rl.Probe, got {type(probe).__name__}")
        if expected is None:
            probe.check_runs(llm, trainer_or_manifest)          # no trainer (a manifest, a snapshot): refused here
            if probe.bound is None:
                raise ConfigError("the refit probe has no bound: calibrate it at step 0 (Probe.calibrate)")
        else:
            probe.check_runs(llm, need_trainer=False)
    if expected is not None and manifest:
        raise ConfigError("certify_refit with a weight manifest: expected= needs the trainer's tensors")
    prompts = cache_prompts if cache_prompts is not None else (probe.sequences[:1] if probe is not None else None)
    if prompts is not None:
        prompts = _check_prompts(prompts, "cache_prompts")
    seed = probe.seed if probe is not None else 0

    checks = [_entry("engine_awake", "passed", "awake; sleep mode " + (
        "available" if sleep["available"] else f"unavailable: {sleep['reason']}"))]
    t = time.perf_counter()
    base = verify_refit(llm, trainer_or_manifest, hf_config, expected=expected)
    digest_s = time.perf_counter() - t
    checks.append(_entry("config", "failed" if base.config_mismatches else "passed",
                         "; ".join(base.config_mismatches) if base.config_mismatches else (
                             "the trainer states no config" if any(x.startswith("the config") for x in
                                                                   base.not_checked) else "equal")))
    checks.append(_entry("tensor_digests", "passed" if base.weights.ok else "failed", base.weights.describe(),
                         digest_s))
    if derived:
        t = time.perf_counter()
        buffers = check_derived_buffers(llm)
        status = "failed" if buffers["problems"] else ("passed" if buffers["checked"] else "not_run")
        detail = ("; ".join(f"worker {r}: {why}" for r, why in buffers["problems"]) if buffers["problems"] else
                  f"{buffers['checked']} derived buffer(s) / tensor(s) (RoPE caches, MLA's absorbed matrices) equal "
                  f"the values recomputed from their sources bitwise"
                  if buffers["checked"] else "no derived buffer this check reads")
        if buffers["unchecked"]:
            detail += f"; unchecked buffers: {buffers['unchecked'][:6]}"
        checks.append(_entry("derived_buffers", status, detail, time.perf_counter() - t,
                             unchecked=buffers["unchecked"]))
    else:
        checks.append(_entry("derived_buffers", "not_run", "derived=False"))
    refit_check = base
    if probe is None or expected is not None:
        why = "no probe" if probe is None else "the engine holds an earlier snapshot by design (expected=)"
        checks.append(_entry("prefill_probe", "not_run", why))
        checks.append(_entry("decode_probe", "not_run", why))
    else:
        decodes = probe.decode_tokens > 0 and probe.decode_bound is not None and probe.decodes(llm)
        t = time.perf_counter()
        if decodes:             # both probes from one vLLM call and one trainer forward (Probe.both_gaps)
            (gap, largest), (dgap, dmax) = probe.both_gaps(llm, trainer_or_manifest)
        else:
            gap, largest = probe.gaps(llm, trainer_or_manifest)
        probe_s = time.perf_counter() - t
        ok = math.isfinite(gap) and gap <= probe.bound
        checks.append(_entry("prefill_probe", "passed" if ok else "failed",
                             f"mean |delta log p| {gap:.3g} (bound {probe.bound:.3g}; largest {largest:.3g})"
                             + ("; one vLLM call and one trainer forward with the decode probe" if decodes else ""),
                             probe_s, gap=gap, bound=probe.bound, largest=largest))
        refit_check.probe_gap, refit_check.probe_bound, refit_check.probe_max = gap, probe.bound, largest
        if not decodes:
            why = ("Probe.decode_tokens is 0" if probe.decode_tokens == 0 else
                   "prefix caching is on: moealign's recorder needs every position forwarded to give a decode's "
                   "routes (issue 38 item 0)" if not probe.decodes(llm) else
                   "the probe was calibrated without a decode (Probe.calibrate(..., decode=True))")
            checks.append(_entry("decode_probe", "not_run", why))
        else:
            ok = math.isfinite(dgap) and dgap <= probe.decode_bound
            checks.append(_entry("decode_probe", "passed" if ok else "failed",
                                 f"mean |delta log p| {dgap:.3g} over {probe.decode_tokens} decoded tokens per "
                                 f"sequence (bound {probe.decode_bound:.3g}; largest {dmax:.3g})"
                                 + ("" if ok else ": the DECODE PATH differs from the prefill (which the prefill "
                                                  "probe checks)"),
                                 0.0, gap=dgap, bound=probe.decode_bound, largest=dmax,
                                 shared_with="prefill_probe"))
            refit_check.decode_gap, refit_check.decode_bound, refit_check.decode_max = dgap, probe.decode_bound, dmax
    if prompts is None:
        checks.append(_entry("prefix_cache", "not_run", "no probe and no cache_prompts"))
    else:
        t = time.perf_counter()
        result = prefix_cache_check(llm, prompts, seed=seed)
        checks.append(_entry("prefix_cache", result["status"], result["detail"], time.perf_counter() - t,
                             cached_tokens=result["cached_tokens"]))
    ran = {c["name"] for c in checks if c["status"] != "not_run"}
    not_checked = [x for x in NOT_CHECKED if not (
        (x.startswith("decode path") and "decode_probe" in ran) or (x.startswith("prefix") and "prefix_cache" in ran)
        or (x.startswith("non-weight buffers") and "derived_buffers" in ran))]
    if "derived_buffers" in ran:
        not_checked.append("derived state other than the RoPE caches and MLA's absorbed matrices (see docs/refit.md, "
                           "per family): only the probes see it")
    if "prefill_probe" not in ran:
        not_checked.insert(0, "the forward (no probe ran: the weights were compared, the logits were not)")
    return RefitCertificate(checks=checks, config=_engine_config(llm, sleep, probe),
                            seconds=time.perf_counter() - t0, not_checked=not_checked, refit_check=refit_check)

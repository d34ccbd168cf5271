"""Run by tests/test_refit_hostile.py in a child process (vLLM keeps process-wide state): the refit API
(``moealign.rl.refit`` / ``verify_refit``) against hostile inputs, on one engine (the embedded model, **fp16**, so
that a weight of 1e6 overflows it) and moealign's own transformers train engine (fp32).

usage: python tests/vllm_refit_hostile_child.py

Prints one ``RESULT {json}`` line. Every hostile case is paired with what happens to the engine (its prompt
log-probs, ``verify_refit`` against the trainer) so that a refusal that moved weights is seen.
"""

from __future__ import annotations

import copy
import json
import threading


def main() -> dict:
    import torch

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.errors import MoealignError
    from moealign.mismatch.engines import HFTrainEngine, VLLMRolloutEngine
    from moealign.patches.vllm import refit as vr
    from moealign.patches.vllm.rollout import model_runner
    from moealign.rl.refit import Probe, refit, trainer_tensors, verify_refit
    from vllm import SamplingParams

    path = str(embedded_model_path())
    rollout = VLLMRolloutEngine(path, "fp16", "cpu")
    llm = rollout.llm
    trainer = HFTrainEngine(path, "fp32", "cpu")
    prompt = default_prompts()[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def logprobs() -> torch.Tensor:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    def attempt(fn) -> dict:
        """The error a call raised: its class, whether it is moealign's, its message (None: no error)."""
        try:
            fn()
        except Exception as exc:            # noqa: BLE001 - the test asserts on the class
            return {"cls": type(exc).__name__, "moealign": isinstance(exc, MoealignError), "msg": str(exc)}
        return {"cls": None, "moealign": None, "msg": None}

    out: dict = {}
    state = dict(trainer_tensors(trainer))
    names = list(state)
    before = perturbed = None
    layout = vr.checkpoint_layout(path)
    out["errors"] = {}

    def section(title, fn):
        """Run one section; an exception (raw or not) is recorded, the next section still runs."""
        try:
            fn()
        except Exception as exc:            # noqa: BLE001 - recorded for the test's message
            out["errors"][title] = f"{type(exc).__name__}: {exc}"
            try:
                refit(llm, trainer)
            except Exception:               # noqa: BLE001
                pass

    def s0():
        nonlocal before, perturbed
        # 0. an identical refit, verified with a probe calibrated on moealign's own transformers train engine (k)
        refit(llm, trainer)
        before = logprobs()
        tok = llm.get_tokenizer()
        probe = Probe([torch.tensor(tok(p)["input_ids"][:40]) for p in default_prompts()[:2]])
        out["calibrate"] = attempt(lambda: probe.calibrate(llm, trainer))
        base = verify_refit(llm, trainer, probe=probe)
        out["base_ok"] = base.ok
        out["base_dict"] = base.to_dict()
        out["base_no_probe_dict"] = verify_refit(llm, trainer).to_dict()

    section('identical', s0)

    def s1():
        nonlocal before, perturbed
        # (b) equal tensors, a config field that changes the forward: refused by name, nothing moved
        cfg0 = trainer.model.config
        perturbed = {n: (t * 1.01 if t.is_floating_point() else t) for n, t in state.items()}
        out["arch"] = {}
        for field, change in (("rope_theta", lambda c: c.rope_parameters.update(rope_theta=20000.0)),
                              ("rms_norm_eps", lambda c: setattr(c, "rms_norm_eps", 1e-2)),
                              ("norm_topk_prob", lambda c: setattr(c, "norm_topk_prob", False)),
                              ("hidden_act", lambda c: setattr(c, "hidden_act", "gelu")),
                              ("mlp_only_layers", lambda c: setattr(c, "mlp_only_layers", [1]))):
            cfg = copy.deepcopy(cfg0)
            change(cfg)
            out["arch"][field] = {"refit": attempt(lambda: refit(llm, perturbed, hf_config=cfg)),
                                  "verify": verify_refit(llm, trainer, hf_config=cfg).to_dict()}
        out["arch_control"] = verify_refit(llm, trainer, hf_config=copy.deepcopy(cfg0)).ok
        out["arch_unchanged"] = verify_refit(llm, trainer).ok and bool(torch.equal(logprobs(), before))

    section('config', s1)

    def s2():
        nonlocal before, perturbed
        # (c) a NaN in the last tensor of a changed snapshot: refused before any weight moved
        late = dict(perturbed)
        last = names[-1]
        late[last] = late[last].clone()
        late[last].view(-1)[-1] = float("nan")
        out["nan_last_name"] = last
        out["nan"] = attempt(lambda: refit(llm, late))
        out["nan_unchanged"] = verify_refit(llm, trainer).ok and bool(torch.equal(logprobs(), before))
        # ... the same through a one-shot stream (cannot be read twice): the error says what had moved
        named = list(vr.checkpoint_named(late.items(), layout))
        manifest = {n: tuple(t.shape) for n, t in named}
        out["nan_stream"] = attempt(lambda: vr.refit_weights(llm, iter(named), manifest, chunk_bytes=1))
        out["nan_stream_mixed"] = not verify_refit(llm, trainer).ok
        refit(llm, trainer)                                 # a clean refit after a failed one is exact again
        out["after_failure_ok"] = verify_refit(llm, trainer).ok and bool(torch.equal(logprobs(), before))

    section('nan', s2)

    def s3():
        nonlocal before, perturbed
        # (j) a value the fp16 engine cannot hold
        huge = dict(perturbed)
        mid = names[len(names) // 2]
        huge[mid] = huge[mid].clone()
        huge[mid].view(-1)[0] = 1e6
        out["overflow_name"] = mid
        out["overflow"] = attempt(lambda: refit(llm, huge))
        out["overflow_unchanged"] = verify_refit(llm, trainer).ok and bool(torch.equal(logprobs(), before))
        fits = dict(state)
        fits[mid] = fits[mid].clone()
        fits[mid].view(-1)[0] = 6e4                            # control: the largest fp16 range still fits
        out["fits"] = attempt(lambda: refit(llm, fits))
        out["fits_verify"] = verify_refit(llm, fits).ok
        refit(llm, trainer)

    section('overflow', s3)

    def s4():
        nonlocal before, perturbed
        # (d) a stale copy of the LM head in the CPU kernel that computes the logits (the parameter left current)
        head = model_runner(llm).model.lm_head
        kernel = head.cpu_linear
        stale = head.weight.detach().clone()
        stale[:, :8] *= 1.5
        head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, stale, bias)
        out["stale_moved"] = float((logprobs() - before).abs().max())
        stale_check = verify_refit(llm, trainer)
        out["stale_ok"] = stale_check.ok
        out["stale_mismatches"] = [list(m) for m in stale_check.weights.mismatches]
        head.cpu_linear = kernel
        out["stale_restored_ok"] = verify_refit(llm, trainer).ok

    section('stale lm_head', s4)

    def s5():
        nonlocal before, perturbed
        # (i) two refits at once: the second is refused by name, and so is a verification during the first
        gate, started = threading.Event(), threading.Event()
        named_ok = list(vr.checkpoint_named(state.items(), layout))

        def slow():
            for i, item in enumerate(named_ok):
                if i == len(named_ok) // 2:
                    started.set()
                    gate.wait(60)
                yield item

        first: dict = {}
        thread = threading.Thread(target=lambda: first.update(attempt(lambda: vr.refit_weights(
            llm, slow(), {n: tuple(t.shape) for n, t in named_ok}, chunk_bytes=1))))
        thread.start()
        started.wait(60)
        out["concurrent_second"] = attempt(lambda: refit(llm, trainer))
        out["concurrent_verify"] = attempt(lambda: verify_refit(llm, trainer))
        gate.set()
        thread.join(60)
        out["concurrent_first"] = first
        out["concurrent_after_ok"] = verify_refit(llm, trainer).ok and bool(torch.equal(logprobs(), before))
        refit(llm, trainer)
        out["concurrent_next_ok"] = verify_refit(llm, trainer).ok

    section('concurrent', s5)

    def s6():
        nonlocal before, perturbed
        # (m) values and engines refit cannot use
        listed = dict(state)
        listed[names[3]] = state[names[3]].tolist()
        out["list_value"] = attempt(lambda: refit(llm, listed))
        out["list_name"] = names[3]
        meta = dict(state)
        meta[names[4]] = state[names[4]].to("meta")
        out["meta_value"] = attempt(lambda: refit(llm, meta))
        out["meta_name"] = names[4]
        out["not_llm"] = attempt(lambda: refit(object(), trainer))
        out["values_unchanged"] = verify_refit(llm, trainer).ok and bool(torch.equal(logprobs(), before))

    section('values', s6)

    rollout.close()
    out["closed_rollout"] = attempt(lambda: refit(rollout, trainer))
    llm.llm_engine.engine_core.shutdown()
    out["shut_down"] = attempt(lambda: refit(llm, trainer))
    out["shut_down_verify"] = attempt(lambda: verify_refit(llm, trainer))
    engine = llm.llm_engine
    del llm.llm_engine
    out["deleted"] = attempt(lambda: refit(llm, trainer))
    llm.llm_engine = engine
    trainer.close()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)

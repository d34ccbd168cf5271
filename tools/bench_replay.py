"""Benchmark: cost of route/kept-set recording in generate() and of routing replay in the training forward.

Each figure is a ratio against its baseline measured in the same run, interleaved, minimum (and median) of N:

* generate():   ``hf.generate_with_record`` (routes + kept sets + log-probs) vs plain ``model.generate``
                with the same sampling settings and seed (target: at most 1.03x).
* train fwd:    full-sequence forward (+ backward with ``--backward``) with routing replay vs without
                (target: at most 1.03x). The replayed step is what a trainer does per micro-batch: attach,
                ``set_routes(record.replay_batch(...))`` (validation, device copy), the forward (the model's
                tokens checked against the batch's), ``check(calls=1)``, undo.
* verify:       the same replayed step with the replay verifier on (the default: a pre-hook on each experts module
                queues the ``top_k_index`` they receive, the forward's routers are compared in one batched pass into
                device counters; ``verify_report()`` once after the step)
                vs ``verify=False`` (target: at most 1.01x). On a shared machine that ratio is within the noise, so
                the verifier's own work is also timed alone: every router's ``observe`` on the tensors of one step
                plus the report (the host read), as a share of the replayed step (``verify_share``).
* set_routes:   the host-side part of replay alone: ``set_routes(batch)`` (the batch's routes into each router's
                targets on the device), timed by itself, as a share of the plain step (``set_routes_share``).
* ops:          with ``--count-ops``: the aten ops (each one a kernel launch and some host time on a GPU; views
                not counted) a replayed training forward adds over the plain one, per router (inside the router
                modules) and per forward (the token check, the verifier's batched pass), and those of ``set_routes``
                (:func:`replay_ops`; ``tests/test_replay_op_count.py`` pins them on the embedded model).
* storage:      bytes per (token, MoE layer) of the saved route table (target: top_k bytes for <= 256
                experts; vLLM's capture and SGLang use 4 bytes per id, verl 2).

    python tools/bench_replay.py                 # the embedded model, CPU
    python tools/bench_replay.py --model PATH --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from moealign.embedded import default_prompts, embedded_model_path  # noqa: E402
from moealign.patches import hf  # noqa: E402
from moealign.record import RolloutRecord, SamplingParams  # noqa: E402
from moealign.routing_replay.protocol import AUX_LOSS_MODES  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved as _interleaved  # noqa: E402
from _timing import sync  # noqa: E402
from _timing import write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="transformers MoE checkpoint (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="generate() dtype")
    ap.add_argument("--train-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--backward", action="store_true", help="time forward + backward in the training step")
    ap.add_argument("--aux-loss", default="own", choices=AUX_LOSS_MODES,
                    help="replay_routing's aux_loss mode (default own: the model's aux loss left alone)")
    ap.add_argument("--train-only", action="store_true",
                    help="record once, skip the generate() timing (the training-step and verify figures only)")
    ap.add_argument("--json", help="write the figures as JSON")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS plain and replayed training steps (torch.profiler) and print, per op, "
                         "what a replayed step adds over a plain one (host and device time per step)")
    ap.add_argument("--count-ops", action="store_true",
                    help="also count the aten ops a replayed forward adds over the plain one, per router and per "
                         "forward (torch dispatch; views not counted)")
    ap.add_argument("--prompts", help="JSON list of prompts (default: the shipped set)")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    path = args.model or str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    prompts = default_prompts(args.prompts)[: args.batch]
    enc = tok(prompts, return_tensors="pt", padding=True)
    ids, am = enc["input_ids"].to(args.device), enc["attention_mask"].to(args.device)
    sampling = SamplingParams(temperature=1.0, top_p=0.9)

    gen_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtypes[args.dtype]).to(args.device).eval()

    def plain_generate():
        torch.manual_seed(0)
        with torch.no_grad():
            gen_model.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0, top_k=0,
                               top_p=0.9, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                               pad_token_id=tok.pad_token_id, use_cache=True)

    def recorded_generate():
        torch.manual_seed(0)
        return _record(gen_model, ids, am, sampling, args, tok)

    # no EOS stop in either path so both generate the same number of tokens
    record = recorded_generate()
    gen = None if args.train_only else _interleaved({"plain": plain_generate, "record": recorded_generate},
                                                    args.repeats, args.device)

    train_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtypes[args.train_dtype]).to(args.device)
    train_model.train(args.backward)
    batch = record.replay_batch("padded", side="right", pad_token_id=tok.pad_token_id)   # routes + their tokens
    x, xm = batch.input_ids.to(args.device), batch.attention_mask.to(args.device)
    info = hf.describe_model(train_model)

    def step(replay=None):
        forward = replay.forward() if replay is not None else contextlib.nullcontext()
        backward = replay.backward() if replay is not None else contextlib.nullcontext()
        if args.backward:
            with forward:
                out = train_model(input_ids=x, attention_mask=xm, use_cache=False)
            with backward:
                out.logits.float().logsumexp(-1).mean().backward()
            train_model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad(), forward:
                train_model(input_ids=x, attention_mask=xm, use_cache=False)

    def replayed_step(verify=True):
        with hf.RoutingReplay(train_model, info, aux_loss=args.aux_loss, verify=verify).attach() as replay:
            replay.set_routes(batch)
            step(replay)
            replay.check(calls=1)       # with verify: reads the verifier's device counters (one sync)

    step()
    replayed_step()
    replayed_step(False)
    train = _interleaved({"plain": step, "replay": replayed_step, "replay_noverify": lambda: replayed_step(False)},
                         args.repeats * 3, args.device)

    profiled = _profile({"plain": step, "replay": replayed_step, "replay_noverify": lambda: replayed_step(False)},
                        args.profile, args.device) if args.profile else None

    ops = None
    if args.count_ops:
        ops = {f"verify={v}": replay_ops(train_model, info, batch, aux_loss=args.aux_loss, verify=v)
               for v in (True, False)}
        train_model.train(args.backward)

    # the verifier's own work per step, alone: what the experts' pre-hooks queue (same shapes as in the step)
    # and the one read of the counters that check() does
    with hf.RoutingReplay(train_model, info, aux_loss=args.aux_loss).attach() as replay:
        replay.set_routes(batch)
        verifier, ran, expected, mask, n = (replay.verifier, replay._targets, replay._expected, replay._mask,
                                            replay._rows_replayed)

        def verify_work():
            verifier.reset()
            for i in range(len(ran)):
                verifier.defer(i, ran[i], expected[i], mask, replayed_rows=n, expected_sorted=True)
            verifier.report()

        alone = _interleaved({"verify": verify_work}, args.repeats * 20, args.device)
        conv = _interleaved({"set_routes": lambda: replay.set_routes(batch)}, args.repeats * 20, args.device)

    with tempfile.TemporaryDirectory() as tmp:
        file = os.path.join(tmp, "record.safetensors")
        record.save(file)
        loaded = RolloutRecord.load(file)
    route_rows = sum(s.routes.shape[0] for s in loaded.samples)
    n_layers, k = len(record.meta.moe_layers), record.meta.top_k
    route_bytes = sum(s.routes.numel() * s.routes.element_size() for s in loaded.samples)
    bytes_per_token_layer = route_bytes / (route_rows * n_layers)

    result = {
        "model": "embedded:tiny_moe" if not args.model else args.model,
        "device": args.device, "threads": torch.get_num_threads(),
        "batch": args.batch, "new_tokens": args.new_tokens, "gen_dtype": args.dtype, "train_dtype": args.train_dtype,
        "train_step": "forward+backward" if args.backward else "forward", "aux_loss": args.aux_loss,
        "train_plain_ms": train["plain"] * 1e3, "train_replay_ms": train["replay"] * 1e3,
        "train_ratio": train["replay"] / train["plain"],
        "train_ratio_median": train["replay_median"] / train["plain_median"],
        "train_replay_noverify_ms": train["replay_noverify"] * 1e3,
        "verify_ratio": train["replay"] / train["replay_noverify"],
        "verify_ratio_median": train["replay_median"] / train["replay_noverify_median"],
        "verify_work_ms": alone["verify"] * 1e3, "verify_share": alone["verify"] / train["replay_noverify"],
        "set_routes_ms": conv["set_routes"] * 1e3, "set_routes_share": conv["set_routes"] / train["plain"],
        "route_bytes_per_token_layer": bytes_per_token_layer, "top_k": k, "num_experts": record.meta.num_experts,
        "route_dtype": str(record.meta.route_dtype).replace("torch.", ""),
    }
    print(f"model {result['model']} on {args.device} ({result['threads']} threads), batch {args.batch} x "
          f"{args.new_tokens} new tokens")
    if gen is not None:
        result.update({"generate_plain_ms": gen["plain"] * 1e3, "generate_record_ms": gen["record"] * 1e3,
                       "generate_ratio": gen["record"] / gen["plain"],
                       "generate_ratio_median": gen["record_median"] / gen["plain_median"]})
        print(f"generate() {args.dtype}:  plain {result['generate_plain_ms']:8.2f} ms   record "
              f"{result['generate_record_ms']:8.2f} ms   ratio {result['generate_ratio']:.3f}x  (target <= 1.03x; "
              f"medians {result['generate_ratio_median']:.3f}x)")
    print(f"train {result['train_step']} {args.train_dtype}:  plain {result['train_plain_ms']:8.2f} ms   replay "
          f"{result['train_replay_ms']:8.2f} ms   ratio {result['train_ratio']:.3f}x  (target <= 1.03x; "
          f"medians {result['train_ratio_median']:.3f}x)")
    print(f"replay verifier:  replay verify=False {result['train_replay_noverify_ms']:8.2f} ms   verify=True "
          f"{result['train_replay_ms']:8.2f} ms   ratio {result['verify_ratio']:.4f}x  (target <= 1.01x; "
          f"medians {result['verify_ratio_median']:.4f}x); its work alone {result['verify_work_ms']:.3f} ms = "
          f"{100 * result['verify_share']:.2f}% of the replayed step")
    print(f"set_routes alone: {result['set_routes_ms']:.3f} ms = {100 * result['set_routes_share']:.2f}% of the plain "
          f"step")
    print(f"route storage: {bytes_per_token_layer:.2f} bytes per (token, layer) = {result['route_dtype']} x top_k "
          f"{k} (target <= {k}; vLLM/SGLang {4 * k}, verl {2 * k})")
    if ops is not None:
        result["ops"] = ops
        for name, o in ops.items():
            print(f"aten ops ({name}, {o['routers']} routers, {o['rows_routed']} of {o['rows']} rows routed): a "
                  f"replayed forward adds {o['per_router']:+d} per router and {o['per_forward']:+d} per forward over "
                  f"the plain {o['plain']}; set_routes {o['set_routes']}")
    if profiled is not None:
        result["profile"] = profiled
    if args.json:
        write_json(args.json, result)
    return 0


def _profile(fns: dict, steps: int, device: str, top: int = 15) -> dict:
    """Per op (``torch.profiler`` key averages over ``steps`` calls of each function): calls, self host and self
    device microseconds per step; printed as what each variant adds over ``plain``, largest first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = str(device).startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    per_op = {}
    for name, fn in fns.items():
        with profile(activities=activities) as prof:
            for _ in range(steps):
                fn()
            sync(device)
        per_op[name] = {e.key: {"calls": e.count / steps, "host_us": e.self_cpu_time_total / steps,
                                "device_us": getattr(e, "self_device_time_total", 0.0) / steps}
                        for e in prof.key_averages()}
    base = per_op["plain"]
    zero = {"calls": 0.0, "host_us": 0.0, "device_us": 0.0}
    for name, ops in per_op.items():
        if name == "plain":
            continue
        total = {k: sum(v[k] for v in ops.values()) - sum(v[k] for v in base.values()) for k in ("host_us", "device_us")}
        print(f"profile: {name} - plain per step: host {total['host_us'] / 1e3:+.2f} ms, device "
              f"{total['device_us'] / 1e3:+.2f} ms (self times; host includes the profiler's own cost)")
        diff = {op: {k: v[k] - base.get(op, zero)[k] for k in v} for op, v in ops.items()}
        key = "device_us" if cuda else "host_us"
        for op, d in sorted(diff.items(), key=lambda kv: -abs(kv[1][key]))[:top]:
            print(f"  {op[:60]:60s} calls {d['calls']:+8.1f}  host {d['host_us']:+9.1f} us  device "
                  f"{d['device_us']:+9.1f} us")
        if cuda:
            for op, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]["host_us"]))[:top]:
                print(f"  [host] {op[:53]:53s} calls {d['calls']:+8.1f}  host {d['host_us']:+9.1f} us")
    return per_op


_VIEW_OPS = {"view", "_unsafe_view", "select", "slice", "unsqueeze", "squeeze", "expand", "alias", "detach", "permute",
             "t", "transpose", "as_strided", "reshape", "unbind", "lift_fresh", "_reshape_alias", "split"}


def _op_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCount(TorchDispatchMode):
        """Non-view aten ops by region: "router" while a router module runs, else "other"."""

        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()
            self.region = "other"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _VIEW_OPS:
                self.counts[self.region] += 1
            return func(*args, **(kwargs or {}))

    return OpCount()


def _counted_forward(model, info, batch) -> tuple[int, int]:
    """(ops inside the routers, ops elsewhere) of one forward of ``batch`` (no grad)."""
    counter = _op_counter()
    hooks = []
    for _, router in info.routers:
        hooks.append(router.register_forward_pre_hook(lambda *a: setattr(counter, "region", "router")))
        hooks.append(router.register_forward_hook(lambda *a: setattr(counter, "region", "other")))
    try:
        with torch.no_grad(), counter:
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return counter.counts["router"], counter.counts["other"]


def replay_ops(model, info, batch, *, aux_loss: str = "own", verify: bool = True, wrap_router=None) -> dict:
    """The aten ops (views not counted) a replayed training-mode forward of ``batch`` adds over the plain one:
    ``per_router`` (inside the router modules, divided by their number), ``per_forward`` (outside them: the token
    check, the verifier's batched pass), ``set_routes`` (its own ops), ``plain`` (the plain forward's). The second
    replayed forward is counted (the first makes the verifier's counters). ``wrap_router(forward) -> forward`` wraps
    each replayed router forward (a test's control)."""
    model.train()
    plain_router, plain_other = _counted_forward(model, info, batch)
    with hf.RoutingReplay(model, info, aux_loss=aux_loss, verify=verify).attach() as replay:
        counter = _op_counter()
        with counter:
            replay.set_routes(batch)
        if wrap_router is not None:
            for _, router in info.routers:
                router.forward = wrap_router(router.forward)
        _counted_forward(model, info, batch)
        replay.check(calls=1)
        replay.reset_counters()
        router_ops, other_ops = _counted_forward(model, info, batch)
        replay.check(calls=1)
    model.eval()
    n = len(info.routers)
    return {"routers": n, "rows": batch.rows, "rows_routed": batch.num_replayed_rows,
            "per_router": (router_ops - plain_router) // n, "per_router_rest": (router_ops - plain_router) % n,
            "per_forward": other_ops - plain_other, "set_routes": sum(counter.counts.values()),
            "plain": plain_router + plain_other}


def _record(model, ids, am, sampling, args, tok):
    # min_new_tokens keeps both paths at the same length (no early EOS)
    gen_config = model.generation_config
    old = gen_config.min_new_tokens
    gen_config.min_new_tokens = args.new_tokens
    try:
        return hf.generate_with_record(model, ids, am, sampling=sampling, max_new_tokens=args.new_tokens,
                                       pad_token_id=tok.pad_token_id)
    finally:
        gen_config.min_new_tokens = old


if __name__ == "__main__":
    sys.exit(main())

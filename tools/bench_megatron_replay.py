"""Benchmark: what Megatron routing replay (RouterReplayDriver) adds to a Megatron-core training step.

The embedded model converted to a Megatron ``GPTModel`` (local spec; CPU: gloo, one process). Each round
times a forward + backward without replay, and the same step with replay: converting the record's padded
routes into each router's sequence-first targets (``set_routes``), REPLAY_FORWARD around the forward,
REPLAY_BACKWARD around the backward (activation recompute re-runs the routers there with
``--recompute``), and the counter check. The replayed routes are the model's own choices, so both steps
compute the same network. Printed: minimum and median of interleaved rounds, and replay / plain
(target: at most 1.03).

The replayed step runs with the replay verifier on (the default: each token dispatcher's ``dispatch_preprocess``
feeds the routing map it receives into device counters, read once by ``check``); the same step with
``verify=False`` is timed too, and their ratio is the verifier's cost (target: at most 1.01). On a shared machine
that ratio is within the noise, so the verifier's own work is also timed alone: every router's ``defer`` (one
batched pass per call, as the driver) on the routing maps of one step (twice with ``--recompute``) plus the report,
as a share of the replayed step.

    python tools/bench_megatron_replay.py                  # embedded model, CPU
    python tools/bench_megatron_replay.py --batch 8 --seq 512 --recompute --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from _timing import interleaved, write_json  # noqa: E402

from moealign.embedded import embedded_model_path  # noqa: E402
from moealign.routing_replay.protocol import ReplayBatch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="transformers MoE checkpoint (default: the embedded model)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--recompute", action="store_true", help="full activation recompute (REPLAY_BACKWARD)")
    ap.add_argument("--json", help="write the figures as JSON")
    args = ap.parse_args(argv)

    import transformers

    from moealign.patches import megatron as mg
    from moealign.patches.megatron import checkpoint as mc

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = args.model or str(embedded_model_path())
    with mg.init_single_process(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
            if args.recompute else {}
        model = mc.build_megatron_from_hf(hf_model, **extra).to(device)
        layers = tuple(range(hf_model.config.num_hidden_layers))
        del hf_model
        model.train()
        B, T = args.batch, args.seq
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.vocab_size, (B, T), generator=g).to(device)
        pos = torch.arange(T, device=device).expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)[None, None]

        # the model's own routes, in the record's padded layout [B*T, layers, k]
        routers = mg.moe_routers(model)
        maps = []
        handles = [r.register_forward_hook(lambda m, a, out: maps.append(out[1].detach())) for _, r in routers]
        with torch.no_grad():
            model(ids, pos, mask)
        for h in handles:
            h.remove()
        k = int(routers[0][1].topk)
        routes = torch.stack([m.reshape(T, B, -1).transpose(0, 1).reshape(B * T, -1).nonzero()[:, 1].reshape(-1, k)
                              for m in maps], dim=1).to(torch.uint8).cpu()
        moe_layers = tuple(layer for layer, _ in routers)
        routes = routes[:, [layers.index(x) for x in moe_layers]]

        def plain():
            model(ids, pos, mask).float().logsumexp(-1).mean().backward()
            model.zero_grad(set_to_none=True)

        batch = ReplayBatch.padded(routes.reshape(B, T, *routes.shape[1:]), input_ids=ids.cpu(), attention_mask=torch.ones(B, T, dtype=torch.int64),
                                   moe_layers=moe_layers)
        calls = 2 if args.recompute else 1

        def replayed(driver):
            driver.reset_counters()
            driver.set_routes(batch)
            with driver.forward():
                out = model(ids, pos, mask)
            with driver.backward():
                out.float().logsumexp(-1).mean().backward()
            driver.check(calls=calls)
            model.zero_grad(set_to_none=True)

        driver = mg.replay_routing(model, aux_loss="own")             # verify=True, the default
        plain()
        replayed(driver)
        t = interleaved({"plain": plain, "replay": lambda: replayed(driver)}, args.repeats, device)
        driver.undo()

        # verifier on vs off: two drivers cannot be attached to one model at once, so each variant attaches its
        # own driver per round (the same attach / undo cost on both sides)
        def with_driver(verify):
            def run():
                with mg.replay_routing(model, aux_loss="own", verify=verify) as d:
                    replayed(d)
            return run

        with_driver(False)()
        tv = interleaved({"verify": with_driver(True), "noverify": with_driver(False)}, args.repeats, device)
        driver = mg.replay_routing(model, aux_loss="own")
        # the host-side part of replay on its own: record layout -> validated sequence-first targets
        conv = interleaved({"set_routes": lambda: driver.set_routes(batch)},
                           max(20, args.repeats), device)
        # the verifier's own work on one step's routing maps (the ones the dispatchers receive), alone
        verifier, expected, vmask, n = driver.verifier, driver._expected_maps, driver._verify_mask, driver._verify_replayed

        def verify_work():
            verifier.reset()
            for _ in range(calls):
                for i in range(len(expected)):
                    verifier.defer(i, expected[i], expected[i], vmask, replayed_rows=n)   # as the driver does
            verifier.report()

        alone = interleaved({"verify": verify_work}, max(50, 10 * args.repeats), device)
        driver.undo()

    result = {
        "model": "embedded:tiny_moe" if not args.model else args.model, "device": device,
        "threads": torch.get_num_threads(), "batch": B, "seq": T, "recompute": args.recompute,
        "plain_ms": t["plain"] * 1e3, "replay_ms": t["replay"] * 1e3, "ratio": t["replay"] / t["plain"],
        "ratio_median": t["replay_median"] / t["plain_median"],
        "set_routes_ms": conv["set_routes"] * 1e3, "set_routes_share": conv["set_routes"] / t["plain"],
        "replay_verify_ms": tv["verify"] * 1e3, "replay_noverify_ms": tv["noverify"] * 1e3,
        "verify_ratio": tv["verify"] / tv["noverify"], "verify_ratio_median": tv["verify_median"] / tv["noverify_median"],
        "verify_work_ms": alone["verify"] * 1e3, "verify_share": alone["verify"] / tv["noverify"],
    }
    print(f"megatron fwd+bwd{' (full recompute)' if args.recompute else ''}, {B}x{T} tokens on {device}: "
          f"plain {result['plain_ms']:.1f} ms, replay {result['replay_ms']:.1f} ms -> {result['ratio']:.3f}x "
          f"(median {result['ratio_median']:.3f}x; target <= 1.03x); set_routes alone {result['set_routes_ms']:.2f} ms "
          f"= {100 * result['set_routes_share']:.2f}% of the plain step")
    print(f"replay verifier: verify=False {result['replay_noverify_ms']:.1f} ms, verify=True {result['replay_verify_ms']:.1f} ms "
          f"-> {result['verify_ratio']:.4f}x (median {result['verify_ratio_median']:.4f}x; target <= 1.01x); its work "
          f"alone {result['verify_work_ms']:.3f} ms = {100 * result['verify_share']:.2f}% of the replayed step")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

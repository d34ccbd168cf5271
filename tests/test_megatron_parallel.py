"""Routing replay under tensor + sequence parallelism: 2 real gloo processes, a real GPTModel (TP=2, SP).

Megatron's torch-norm fallback (no Apex, no transformer-engine on CPU) refuses ``sequence_parallel``
only because it cannot mark its weights for the SP gradient all-reduce; a forward is per token and
exact, so the test builds the norms from a config copy without the flag.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_util as mu  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py


def _allow_sp_torch_norm():
    import copy

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        plain = copy.copy(config)
        object.__setattr__(plain, "sequence_parallel", False)
        return original(cls, plain, *args, **kwargs)

    torch_norm.WrappedTorchNorm.__new__ = new


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    _allow_sp_torch_norm()
    from moealign.patches import megatron as mg

    mode = mg.enable_megatron_cpu(pin_cpu=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    out = {}
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        model_parallel_cuda_manual_seed(123)
        torch.manual_seed(0)
        model = mu.build(mu.config(sequence_parallel=True, tensor_model_parallel_size=world))
        routers = mg.moe_routers(model)
        with torch.no_grad():
            for _, router in routers:
                router.weight.mul_(20)
        ids, pos, mask = mu.inputs()
        routes = mu.batch_routes(7)
        maps, handles = mu.routing_maps(model, routers)
        with torch.no_grad(), mg.RouterReplayDriver(model) as driver:
            driver.set_routes(mu.replay_batch(routes, ids))    # SP read from parallel_state
            with driver.forward():
                model(ids, pos, attention_mask=mask)
            driver.check(calls=1)
            out["maps"] = [m.clone() for m in maps]
            # negative control: the full batch's rows (no SP slice) do not match what this rank's router sees
            driver.set_routes(mu.replay_batch(routes, ids), parallel=dict(cp_size=1, cp_rank=0, sp_size=1, sp_rank=0))
            try:
                with driver.forward():
                    model(ids, pos, attention_mask=mask)
                out["unsliced_error"] = ""
            except mg.ReplayError as exc:
                out["unsliced_error"] = str(exc)
        for h in handles:
            h.remove()
    finally:
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        mode.undo()


def test_sequence_parallel_ranks_replay_their_slice(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, tempfile.mktemp(dir=tmp_path), str(tmp_path)), nprocs=world, join=True)
    routes = mu.batch_routes(7)
    s_local = mu.T // world
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(got["maps"]) == 2
        for layer, used in enumerate(got["maps"]):
            # rank r's router sees t in [r*T/2, (r+1)*T/2), sequence-first (row = t_local*B + b)
            r = routes[:, layer].reshape(mu.B, mu.T, mu.K).transpose(0, 1)[rank * s_local:(rank + 1) * s_local]
            want = torch.zeros(s_local, mu.B, mu.E, dtype=torch.bool).scatter_(-1, r, True)
            assert torch.equal(used, want.reshape(-1, mu.E))
        assert "the router saw 15 tokens, the replay targets have 30 rows" in got["unsliced_error"]

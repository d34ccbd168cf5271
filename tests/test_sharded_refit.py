"""The refit from a sharded Megatron trainer (issue 35 items 4-5): the tensors streamed from the ranks in bounded
chunks into a running vLLM engine, the weight manifest each rank digests its own pieces of, and the verification.

One vLLM engine (the embedded model, fp32, TP 1) and one sharded trainer (TP 2: every split tensor joined from two
ranks' slices) in one child process (tests/vllm_sharded_refit_child.py); the trainer starts from a changed copy of
the checkpoint, so the refit moves every weight. The stream's and the manifest's equality with the checkpoint at
TP 2 x EP 2 and EP 2 x PP 2 (expert rows, data-parallel copies, pipeline stages) run on the worlds
tests/test_megatron_sharded.py already starts. Engine-free: a piece's digest contribution for any offsets."""

from __future__ import annotations

import shutil

import pytest
import torch

from moealign._optional import probe

pytest.importorskip("megatron.core")

from moealign.embedded import embedded_model_path  # noqa: E402
from moealign.rl.manifest import WeightManifest, _piece_span, weight_manifest  # noqa: E402

from vllm_util import run_child  # noqa: E402

pytestmark = pytest.mark.heavy          # long-running (an engine and rank processes): scheduled first

VLLM = probe("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")

#: rank 1's pieces at TP 2: the last row of expert 5's up projection (the second half of each GLU half) and the last
#: input column of a row-parallel o_proj
ONE_RANK = ("model.layers.2.mlp.experts.5.up_proj.weight", (-1, 3))
NAN_AT = ("model.layers.1.self_attn.o_proj.weight", (0, -1))


def _copy(src, dst, tensors: dict) -> str:
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict:
    from safetensors.torch import load_file

    from moealign.model_config import ConfigView, read_model_config
    from moealign.patches.megatron import checkpoint as mc

    src = embedded_model_path()
    root = tmp_path_factory.mktemp("sharded_refit")
    g = torch.Generator().manual_seed(35)
    base = load_file(str(src / "model.safetensors"))
    changed = {n: (t + 1e-3 * torch.randn(t.shape, generator=g)).contiguous() for n, t in base.items()}
    one_rank = dict(changed)
    name, where = ONE_RANK
    one_rank[name] = changed[name].clone()
    one_rank[name][where] += 0.25
    with_nan = dict(changed)
    name, where = NAN_AT
    with_nan[name] = changed[name].clone()
    with_nan[name][where] = float("nan")
    paths = [_copy(src, root / d, t) for d, t in (("changed", changed), ("one_rank", one_rank),
                                                 ("with_nan", with_nan))]
    # this process's manifest of the changed weights, from the file alone (fused experts as the trainer names them)
    config = read_model_config(paths[0])
    ckpt = mc.open_hf_checkpoint(paths[0], ConfigView(**config))
    try:
        names = [n for n in ckpt.stored_names() if ".mlp.experts." not in n]
        layers = int(config["num_hidden_layers"])
        names += [f"model.layers.{i}.mlp.experts.{k}" for i in range(layers) for k in ("gate_up_proj", "down_proj")]
        snapshot = {n: ckpt.get(n) for n in names}
    finally:
        ckpt.close()
    mine = weight_manifest(snapshot, config)
    mine_path = root / "parent.manifest.json"
    mine.save(mine_path)
    out = run_child("vllm_sharded_refit_child.py", *paths, str(mine_path), str(root))
    out["mine"] = mine
    out["theirs"] = WeightManifest.load(root / "sharded.manifest.json")
    return out


@needs_vllm
def test_refit_streams_from_the_ranks_and_matches_a_single_process_refit(sharded):
    r = sharded
    assert r["split_tensors"] > 0 and r["tensors"] == 47            # TP slices joined per tensor
    assert r["refit"]["tensors"] == 3 + 4 * 9 + 4 * 16 * 3           # per-expert names of the engine's checkpoint
    assert r["refit"]["chunks"] >= 9                                  # 9.2 MB in chunks of 1 MiB
    assert r["moved"] > 1e-3                                          # the weights changed the log-probs
    assert r["verify_trainer_ok"] and r["verify_parent_manifest_ok"]
    # bitwise: what the ranks streamed is what one process refits from the checkpoint file; negative control: before
    assert r["bitwise_vs_single_process_refit"] and r["differs_from_before"]


@needs_vllm
def test_sharded_manifest_equals_the_single_process_one_and_verifies_across_processes(sharded):
    mine, theirs = sharded["mine"], sharded["theirs"]
    assert theirs.tensors == mine.tensors                             # every digest, bit for bit
    assert theirs.model_bytes == mine.model_bytes == sum(sharded["owned_bytes"])
    assert theirs.config == mine.config


@needs_vllm
def test_one_rank_changed_after_the_manifest_is_named(sharded):
    assert not sharded["stale_ok"]
    assert sharded["stale_named"] == [["model.layers.2.mlp.experts.gate_up_proj[5]", 0]]
    assert sharded["fresh_ok"] and sharded["one_rank_moved"]


@needs_vllm
def test_a_bad_value_on_one_rank_is_refused_before_any_weight_moves(sharded):
    message = sharded["nan_refused"]
    assert message is not None and "rank 1 (tp 1, pp 0, dp 0, ep 0)" in message, message
    assert "no weight had moved" in message and ("'model.layers.1.self_attn.o_proj.weight (a piece on this rank: "
                                                 "Megatron decoder.layers.1.self_attention.linear_proj.weight)'"
                                                 in message)
    assert "NaN" in message
    assert sharded["unchanged_after_refusal"]


@needs_vllm
def test_memory_is_bounded_by_a_shard_and_a_chunk(sharded):
    # per rank: its pieces of one chunk (1 MiB) and one converted mapping group, far below its shard (4.6 MB)
    shard = max(sharded["owned_bytes"])
    assert all(0 <= d <= shard for d in sharded["rank_peak_delta"]), (sharded["rank_peak_delta"], shard)


# --------------------------------------------------------------------------------------------------
# on the worlds tests/test_megatron_sharded.py starts (TP 2 x EP 2, EP 2 x PP 2): no engine
# --------------------------------------------------------------------------------------------------


def check_stream_and_manifest(trainer, chunk_bytes: int = 1 << 18) -> None:
    """Called by tests/test_megatron_sharded.py on its worlds: the tensors streamed from the ranks (chunks of 256 KiB,
    each tensor's pieces joined) equal the checkpoint's, tensor by tensor, and the manifest the ranks digest (each its
    own pieces, data-parallel copies skipped) equals the manifest of those tensors in one process, bit for bit."""
    from moealign.model_config import ConfigView, read_model_config
    from moealign.patches.megatron import checkpoint as mc

    config = read_model_config(trainer.model_path)
    ckpt = mc.open_hf_checkpoint(trainer.model_path, ConfigView(**config))
    try:
        snapshot = {}
        for name, tensor in trainer.hf_tensors(chunk_bytes=chunk_bytes):
            want = ckpt.get(name)
            assert torch.equal(tensor, want), name
            snapshot[name] = want
    finally:
        ckpt.close()
    assert len(snapshot) == 47 and set(snapshot) == set(trainer.hf_plan())
    abandoned = trainer.hf_tensors(chunk_bytes=chunk_bytes)      # a stream left after its first tensor
    next(abandoned)
    del abandoned
    sharded = weight_manifest(trainer)                           # the ranks answer the next command as ever
    assert sharded.tensors == weight_manifest(snapshot).tensors
    assert sharded.config == weight_manifest(snapshot, config).config


# --------------------------------------------------------------------------------------------------
# engine-free: a piece's contribution to the digest of its full tensor
# --------------------------------------------------------------------------------------------------


def test_pieces_digests_add_up_to_the_whole_for_any_split():
    from moealign.patches.vllm.refit import layout_digest

    g = torch.Generator().manual_seed(3)
    mask = (1 << 64) - 1
    for shape, dim, parts in [((6, 10), 0, 3), ((6, 10), 1, 2), ((10,), 0, 2), ((3, 4, 6), 1, 2), ((3, 4, 6), 0, 3),
                              ((3, 4, 6), 2, 3), ((6, 5), 1, 5)]:
        for dtype in (torch.float32, torch.bfloat16):
            full = torch.randn(shape, generator=g).to(dtype)
            total = [0, 0]
            start = 0
            for piece in full.chunk(parts, dim=dim):
                offsets = [0] * full.dim()
                offsets[dim] = start
                start += piece.shape[dim]
                lanes = _piece_span(piece.contiguous(), tuple(offsets), tuple(shape), False)[0].tolist()
                total = [(total[0] + lanes[0]) & mask, (total[1] + lanes[1]) & mask]
            assert tuple(total) == layout_digest(full), (shape, dim, dtype)
            # negative control: the pieces swapped (each at the other's offsets) do not add up to it
            if parts == 2 and full.shape[dim] % 2 == 0:
                a, b = full.chunk(2, dim=dim)
                half = a.shape[dim]
                offs = [0] * full.dim()
                offs[dim] = half
                first = _piece_span(a.contiguous(), tuple(offs), shape, False)[0].tolist()
                second = _piece_span(b.contiguous(), (0,) * full.dim(), shape, False)[0].tolist()
                swapped = [(x + y) & mask for x, y in zip(first, second)]
                assert tuple(swapped) != layout_digest(full)
    # experts: rows of the fused [E, R, C] tensor and a column split, one digest per expert
    experts = torch.randn(4, 6, 8, generator=g)
    want = layout_digest(experts, rows=True)
    got = {}
    for e0 in (0, 2):
        for c0 in (0, 4):
            piece = experts[e0:e0 + 2, :, c0:c0 + 4].contiguous()
            for i, lanes in enumerate(_piece_span(piece, (e0, 0, c0), (4, 6, 8), True).tolist()):
                old = got.get(e0 + i, (0, 0))
                got[e0 + i] = ((old[0] + lanes[0]) & mask, (old[1] + lanes[1]) & mask)
    assert [got[e] for e in range(4)] == want

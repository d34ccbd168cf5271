"""Batch normalisation over an explicit process group (real gloo processes)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moealign.correction import compute_rollout_correction_and_rejection_mask


def _batch():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(8, 10, generator=g)
    rollout = (old + torch.randn(8, 10, generator=g) * 0.3).clamp(max=0.0)  # log-probs <= 0
    mask = (torch.rand(8, 10, generator=g) > 0.3).float()
    mask[:, 0] = 1
    return old, rollout, mask


def _worker(rank, world, init_file, level, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        old, rollout, mask = _batch()
        rows = slice(rank * 4, rank * 4 + 4)
        w, _, metrics = compute_rollout_correction_and_rejection_mask(
            old[rows], rollout[rows], mask[rows], rollout_is=level, rollout_is_threshold=2.0,
            rollout_is_batch_normalize=True, process_group=dist.group.WORLD)
        torch.save({"w": w, "factor": metrics["rollout_corr/rollout_is_batch_norm_factor"]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_group_mean_equals_whole_batch(level, tmp_path):
    old, rollout, mask = _batch()
    whole_w, _, whole_m = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=level, rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    local_w, _, local_m = compute_rollout_correction_and_rejection_mask(
        old[:4], rollout[:4], mask[:4], rollout_is=level, rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    init_file = tempfile.mktemp(dir=tmp_path)
    mp.spawn(_worker, args=(2, init_file, level, str(tmp_path)), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    dist_w = torch.cat([p["w"] for p in parts])
    torch.testing.assert_close(dist_w, whole_w, rtol=1e-6, atol=1e-7)
    for p in parts:
        torch.testing.assert_close(p["factor"], whole_m["rollout_corr/rollout_is_batch_norm_factor"])
    # negative control: without the group, rank 0 normalises by its own half only
    assert not torch.allclose(local_w, whole_w[:4])

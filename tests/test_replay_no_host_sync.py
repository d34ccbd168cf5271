"""Issue 24, item 2: a replayed forward performs no host sync in moealign's code (transformers and Megatron
adapters, verifier on, every aux-loss mode). On a CPU machine the reads are caught by
``tools/_host_sync.host_syncs``: ``Tensor.item`` / ``tolist`` / ``__bool__`` / ``cpu`` / ``nonzero``, boolean-mask
indexing, ``torch.equal`` raise when moealign's code calls them. The per-forward checks now sit in device
counters read by ``check()``: a wrong token, a masked routed row, an id outside the vocabulary still raise there,
naming the row. The gpu-marked test runs the same guard with the model on CUDA."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from moealign.embedded import embedded_model_path
from moealign.errors import InputError, ReplayError
from moealign.routing_replay.protocol import ReplayBatch, check_row_tokens

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from _host_sync import HostSync, host_syncs  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    from moealign.patches import hf
    from moealign.patches.hf.loading import load_model

    model, _ = load_model(embedded_model_path(), "fp32")
    meta = hf.record_meta(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, meta.vocab_size, (2, 12), generator=g)
    am = torch.ones_like(ids)
    am[1, 9:] = 0                                              # right padding in row 1
    with torch.no_grad(), hf.capture_routes(model) as cap:
        model(input_ids=ids, attention_mask=am, use_cache=False)
        routes = cap.last_forward().reshape(2, 12, len(meta.moe_layers), meta.top_k)
    batch = ReplayBatch.padded(routes, input_ids=ids, attention_mask=am, moe_layers=meta.moe_layers)
    return model, batch


def test_guard_catches_a_sync_in_moealign_code():
    """Negative control: the guard raises on moealign's host reads and lets other code (and itself) through."""
    x = torch.arange(6)
    with host_syncs("raise"):
        assert int(torch.tensor(3)) == 3                      # a read in this test file: not moealign's
        with pytest.raises(HostSync, match="protocol.py"):
            check_row_tokens(x, x)                            # the per-forward host check the adapters used to run
    assert bool(x.any())                                      # restored outside the context
    with host_syncs("count") as counts:
        check_row_tokens(x, x)
    assert sum(counts.values()) == 1


@pytest.mark.parametrize("aux_loss", ["replayed", "warn", "own"])
def test_hf_replayed_forward_has_no_host_sync(hf_model, aux_loss):
    from moealign.patches import hf

    model, batch = hf_model
    with torch.no_grad(), hf.replay_routing(model, batch, aux_loss=aux_loss) as replay:
        with host_syncs("raise"), replay.forward():
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        with pytest.raises(HostSync):                         # check() is where the counters are read
            with host_syncs("raise"):
                replay.check(calls=1)
        replay.check(calls=1)
        assert replay.verify_report().clean


def test_hf_token_checks_raise_at_check(hf_model):
    """The checks that moved to the device keep their strength: each raises at check(), naming the row."""
    from moealign.patches import hf

    model, batch = hf_model
    other = batch.input_ids.clone()
    other[0, 3] = (other[0, 3] + 1) % model.config.vocab_size
    masked = batch.attention_mask.clone()
    masked[0, 5] = 0
    frac = batch.attention_mask.float()
    frac[0, 0] = 0.5
    cases = [(dict(input_ids=other), ReplayError, r"not running the batch .*: 1 of 21 routed rows hold other "
                                                  r"tokens \(first: row 3"),
             (dict(attention_mask=masked), ReplayError, r"1 routed rows are masked in the attention_mask .*first row 5"),
             (dict(attention_mask=frac), InputError, r"attention_mask must hold only 0 and 1 .* got 0.5 at \[0, 0\]")]
    with torch.no_grad(), hf.replay_routing(model, batch) as replay:
        for change, error, message in cases:
            kw = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
            kw.update(change)
            replay.reset_counters()
            with host_syncs("raise"):
                model(**kw)                                   # runs: the values are read by check()
            with pytest.raises(error, match=message):
                replay.check(calls=1)
        replay.reset_counters()
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        replay.check(calls=1)                                 # control: the batch itself passes
        # two forwards before one check: the bad one is named
        replay.reset_counters()
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        model(input_ids=other, attention_mask=batch.attention_mask, use_cache=False)
        with pytest.raises(ReplayError, match=r"forward 2 since the last check"):
            replay.check(calls=2)
        # an id outside the vocabulary: the CPU embedding's IndexError is reported as the InputError naming it
        bad = batch.input_ids.masked_fill(batch.attention_mask == 0, model.config.vocab_size + 3)
        with pytest.raises(InputError, match=rf"input_ids\[1, 9\] = {model.config.vocab_size + 3} is not a token"):
            model(input_ids=bad, attention_mask=batch.attention_mask, use_cache=False)


@pytest.fixture(scope="module")
def megatron_world():
    pytest.importorskip("megatron.core")
    from moealign.patches import megatron as mg

    with mg.init_single_process(seed=123, device="cpu"):
        yield mg


@pytest.mark.parametrize("aux_loss", ["warn", "replayed"])
def test_megatron_replayed_forward_has_no_host_sync(megatron_world, aux_loss):
    import megatron_util as mu

    mg = megatron_world
    model = mu.build(mu.config())
    model.train()                                             # the aux loss (and its wrapper) runs in training
    ids, pos, mask = mu.inputs()
    batch = mu.replay_batch(mu.batch_routes(3), ids)
    with mg.RouterReplayDriver(model, aux_loss=aux_loss) as driver:
        driver.set_routes(batch)
        with host_syncs("raise"), driver.forward():
            model(ids, pos, attention_mask=mask)
        driver.check(calls=1)
        assert driver.verify_report().clean and len(driver.aux_disagreement) == 2
        # a token slip still raises, at check()
        driver.reset_counters()
        driver.set_routes(batch)
        other = ids.clone()
        other[1, 2] = (other[1, 2] + 1) % mu.V
        with host_syncs("raise"), driver.forward():
            model(other, pos, attention_mask=mask)
        with pytest.raises(ReplayError, match=r"not running the batch .*: 1 of 30 routed rows hold other tokens"):
            driver.check(calls=1)


@pytest.mark.gpu
def test_hf_replayed_forward_no_sync_on_cuda():
    """On a GPU: the same guard with the model on CUDA, where each caught read would wait for the device
    (torch.cuda.set_sync_debug_mode would also flag transformers' own expert loop, which syncs in a plain forward)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moealign.patches import hf
    from moealign.patches.hf.loading import load_model

    model, _ = load_model(embedded_model_path(), "fp32")
    model = model.cuda()
    meta = hf.record_meta(model)
    ids = torch.randint(0, meta.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    with torch.no_grad(), hf.capture_routes(model) as cap:
        model(input_ids=ids.cuda(), attention_mask=am.cuda(), use_cache=False)
        routes = cap.last_forward().cpu().reshape(2, 12, len(meta.moe_layers), meta.top_k)
    batch = ReplayBatch.padded(routes, input_ids=ids, attention_mask=am, moe_layers=meta.moe_layers)
    x, xm = ids.cuda(), am.cuda()
    with torch.no_grad(), hf.replay_routing(model, batch, aux_loss="own") as replay:
        with host_syncs("raise"), replay.forward():
            model(input_ids=x, attention_mask=xm, use_cache=False)
        replay.check(calls=1)

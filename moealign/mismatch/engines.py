"""Rollout and training engines of the mismatch test, behind two small interfaces.

A rollout engine turns prompts into a :class:`~moealign.record.RolloutRecord` (log-probs, routes,
kept sets). A training engine recomputes, for a slice of a record, the logits that score each response
token and the routes it actually used, with or without routing replay. ``ROLLOUT_ENGINES`` /
``TRAIN_ENGINES`` map the names the CLI accepts to factories; later adapters (Megatron, vLLM) register
themselves here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from ..record import RecordMeta, RolloutRecord, SamplingParams
from ..routing_replay.routes import expand_routes

__all__ = [
    "DTYPES",
    "parse_dtype",
    "TrainForward",
    "RolloutEngine",
    "TrainEngine",
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "register_rollout_engine",
    "register_train_engine",
    "HFRolloutEngine",
    "HFTrainEngine",
    "MegatronTrainEngine",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class TrainForward:
    """One training-engine forward over a slice of a record, in record order.

    ``logits``: ``[n_response_tokens, V]`` float32, the logits that score each response token.
    ``tokens``: ``[n_response_tokens]`` the response token ids.
    ``routes``: ``[n_route_rows, n_layers, k]`` int64, the experts the trainer used for each recorded
    route row (rows as in the record: prompt + response minus the last token, per sample).
    """

    logits: torch.Tensor
    tokens: torch.Tensor
    routes: torch.Tensor


class RolloutEngine(Protocol):
    name: str
    dtype: str

    def generate(self, prompts: Sequence[str], *, sampling: SamplingParams, max_new_tokens: int, seed: int,
                 batch_size: int, progress: Callable[[int], None] | None = None) -> RolloutRecord: ...


class TrainEngine(Protocol):
    name: str
    dtype: str

    def meta(self) -> RecordMeta: ...

    def forward(self, record: RolloutRecord, indices: Sequence[int], *, replay: bool) -> TrainForward: ...


ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {}
TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {}


def register_rollout_engine(name: str, factory: Callable[..., RolloutEngine]) -> None:
    ROLLOUT_ENGINES[name] = factory


def register_train_engine(name: str, factory: Callable[..., TrainEngine]) -> None:
    TRAIN_ENGINES[name] = factory


def _load_hf(model_path: str, dtype: torch.dtype, device: str):
    from .._optional import require

    transformers = require("transformers", "the 'hf' engine needs transformers (pip install 'moealign[hf]')")
    logging = transformers.utils.logging
    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()   # the harness draws its own progress; restore the user's setting after
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    finally:
        if was_enabled:
            logging.enable_progress_bar()
    model.to(device).eval()
    return transformers, model


class HFRolloutEngine:
    """transformers ``generate()`` with route and kept-set recording (:mod:`moealign.patches.hf`)."""

    name = "transformers"

    def __init__(self, model_path: str, dtype: str = "bf16", device: str = "cpu"):
        transformers, self.model = _load_hf(model_path, parse_dtype(dtype), device)
        self.dtype, self.device = dtype, device
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_path))
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def generate(self, prompts, *, sampling, max_new_tokens, seed, batch_size, progress=None) -> RolloutRecord:
        from ..patches import hf

        samples, meta = [], None
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            enc = self.tokenizer(chunk, return_tensors="pt", padding=True)
            record = hf.generate_with_record(
                self.model, enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device),
                sampling=sampling, max_new_tokens=max_new_tokens, seed=seed + start,
                pad_token_id=self.tokenizer.pad_token_id)
            meta = meta or record.meta
            samples += record.samples
            if progress:
                progress(len(chunk))
        return RolloutRecord(meta, samples)


class HFTrainEngine:
    """transformers full-sequence forward (no KV cache), optionally with routing replay."""

    name = "transformers"

    def __init__(self, model_path: str, dtype: str = "fp32", device: str = "cpu"):
        _, self.model = _load_hf(model_path, parse_dtype(dtype), device)
        self.dtype, self.device = dtype, device
        pad = self.model.generation_config.pad_token_id
        self.pad_token_id = int(pad) if isinstance(pad, int) else 0

    def meta(self) -> RecordMeta:
        from ..patches import hf

        return hf.record_meta(self.model)

    def forward(self, record: RolloutRecord, indices, *, replay: bool) -> TrainForward:
        import contextlib

        from ..patches import hf

        sub = RolloutRecord(record.meta, [record.samples[i] for i in indices], validate=False)
        batch = sub.to_padded("right", self.pad_token_id)
        dev = self.device
        with contextlib.ExitStack() as stack, torch.no_grad():
            capture = stack.enter_context(hf.capture_routes(self.model))
            rp = None
            if replay:
                rp = stack.enter_context(hf.replay_routing(self.model, fix_aux_loss=False))
                # the padded batch already holds the routes: no second layout pass
                routes = expand_routes(batch.routes)
                rp.set_targets(routes.reshape(-1, *routes.shape[-2:]), batch.route_mask.reshape(-1))
            out = self.model(input_ids=batch.input_ids.to(dev), attention_mask=batch.attention_mask.to(dev),
                             use_cache=False)
            if rp is not None:
                rp.check(forwards=1)
            used = capture.last_forward()
        route_mask = batch.route_mask.reshape(-1).to(used.device)
        # logits at position p - 1 score the token at position p
        b, p = batch.response_mask.nonzero(as_tuple=True)
        logits = out.logits[b.to(dev), (p - 1).to(dev)].float()
        return TrainForward(logits=logits, tokens=batch.input_ids[b, p].to(dev), routes=used[route_mask])


class MegatronTrainEngine:
    """Megatron-core ``GPTModel`` (local spec) converted from the transformers checkpoint, in a one-process
    world (CPU: gloo and :func:`~moealign.patches.megatron.enable_megatron_cpu`); routing replay through
    Megatron's own RouterReplay (:class:`~moealign.patches.megatron.RouterReplayDriver`)."""

    name = "megatron"

    def __init__(self, model_path: str, dtype: str = "fp32", device: str = "cpu"):
        from ..patches import hf
        from ..patches import megatron as mg
        from ..patches import megatron_checkpoint as mc

        if device.startswith("cuda") != torch.cuda.is_available():
            raise ValueError(f"the megatron engine runs on cuda when CUDA is available and on cpu otherwise, "
                             f"not on {device!r}")
        self.dtype, self.device = dtype, device
        self._world = mg.init_single_process()
        try:
            _, hf_model = _load_hf(model_path, torch.float32, "cpu")
            self._meta = hf.record_meta(hf_model)
            pad = hf_model.generation_config.pad_token_id
            self.pad_token_id = int(pad) if isinstance(pad, int) else 0
            self.model = mc.build_megatron_from_hf(hf_model, params_dtype=parse_dtype(dtype))
            del hf_model
            self.model.to(device).eval()
            self.driver = mg.RouterReplayDriver(self.model, aux_loss="own")
        except BaseException:
            self._world.close()
            raise
        self._k = int(self.driver.routers[0][1].topk)

    def meta(self) -> RecordMeta:
        return self._meta

    def forward(self, record: RolloutRecord, indices, *, replay: bool) -> TrainForward:
        sub = RolloutRecord(record.meta, [record.samples[i] for i in indices], validate=False)
        batch = sub.to_padded("right", self.pad_token_id)
        B, T = batch.input_ids.shape
        dev = self.device
        # bool mask, True = masked: causal, and padded keys
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        mask = (causal[None, None] | (batch.attention_mask == 0)[:, None, None, :]).to(dev)
        maps = []
        handles = [router.register_forward_hook(lambda m, a, out: maps.append(out[1].detach()))
                   for _, router in self.driver.routers]
        try:
            with torch.no_grad():
                if replay:
                    routes = expand_routes(batch.routes)
                    self.driver.set_routes(routes.reshape(B * T, *routes.shape[-2:]), record.meta.moe_layers,
                                           batch_shape=(B, T), route_mask=batch.route_mask.reshape(-1))
                    with self.driver.forward():
                        logits = self.model(batch.input_ids.to(dev), batch.position_ids.to(dev), mask)
                    self.driver.check(calls=1)
                else:
                    logits = self.model(batch.input_ids.to(dev), batch.position_ids.to(dev), mask)
        finally:
            for h in handles:
                h.remove()
            self.driver.clear()
            self.driver.reset_counters()
        # routing maps [T*B, E] (sequence-first) -> expert ids [B*T, n_layers, k], ascending per row
        used = torch.stack([m.reshape(T, B, -1).transpose(0, 1).reshape(B * T, -1)
                            .nonzero()[:, 1].reshape(B * T, self._k) for m in maps], dim=1)
        used = used[batch.route_mask.reshape(-1).to(used.device)]
        b, p = batch.response_mask.nonzero(as_tuple=True)
        out = logits[b.to(dev), (p - 1).to(dev)].float()
        return TrainForward(logits=out, tokens=batch.input_ids[b, p].to(dev), routes=used)

    def close(self) -> None:
        if getattr(self, "driver", None) is not None:
            self.driver.undo()
            self.driver = None
        if getattr(self, "_world", None) is not None:
            self._world.close()
            self._world = None


register_rollout_engine("hf", HFRolloutEngine)
register_train_engine("hf", HFTrainEngine)
register_train_engine("megatron", MegatronTrainEngine)

"""transformers adapter, rollout side: router decisions through forward hooks (:func:`capture_routes`) and
``generate()`` with routes, kept sets and processed log-probs recorded (:func:`generate_with_record`)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ...errors import ConfigError, InputTypeError, ReplayError
from ...handle import PatchHandle
from ...record import RolloutRecord, Sample, SamplingParams
from ...routing_replay.routes import compact_routes
from .model import MoEModelInfo, describe_model, record_meta

# --------------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------------


class RouteCapture(PatchHandle):
    """Router decisions seen through forward hooks: ``calls[i]`` is the list of ``[rows, k]`` int64 ids
    of MoE layer ``i`` (index into ``info.moe_layers``), one entry per router call.

    A :class:`~moealign.handle.PatchHandle` (scope ``"instance"``): :meth:`attach` adds one forward hook per
    router, ``undo()`` removes them (what was captured stays readable)."""

    def __init__(self, info: MoEModelInfo, keep_logits: bool = False):
        super().__init__(f"route capture on {len(info.routers)} {info.family.model_type} routers", "instance")
        self.info = info
        self.keep_logits = keep_logits
        self.calls: list[list[torch.Tensor]] = [[] for _ in info.routers]
        self.logits: list[list[torch.Tensor]] = [[] for _ in info.routers]

    def _hook(self, index: int):
        def hook(module, args, output):
            self.calls[index].append(output[2].detach())
            if self.keep_logits:
                self.logits[index].append(output[0].detach())
        return hook

    def attach(self) -> "RouteCapture":
        for index, (layer, module) in enumerate(self.info.routers):
            self.add_hook(module.register_forward_hook(self._hook(index)), f"router of layer {layer}")
        return self

    def clear(self) -> None:
        for lst in self.calls + self.logits:
            lst.clear()

    @property
    def num_calls(self) -> list[int]:
        return [len(c) for c in self.calls]

    def last_forward(self) -> torch.Tensor:
        """Routes of the most recent forward as ``[rows, n_layers, k]`` int64."""
        if not all(self.calls):
            raise ReplayError(f"no router call recorded in some layers (calls per layer: {self.num_calls})")
        rows = {c[-1].shape[0] for c in self.calls}
        if len(rows) != 1:
            raise ReplayError(f"MoE layers saw different row counts in the last forward: {sorted(rows)}")
        return torch.stack([c[-1] for c in self.calls], dim=1)


@contextlib.contextmanager
def capture_routes(model: torch.nn.Module, *, keep_logits: bool = False,
                   info: MoEModelInfo | None = None) -> Iterator[RouteCapture]:
    """Record every router decision of ``model`` while the block runs (hooks removed on exit)."""
    capture = RouteCapture(info or describe_model(model), keep_logits).attach()
    try:
        yield capture
    finally:
        capture.undo()


# kept-set masks buffered before one nonzero() turns them into ids (bounded memory for large vocabularies)
KEPT_SET_FLUSH_BYTES = 64 << 20


class _KeptSetCapture:
    """The last logits processor of ``generate()``: sees the processed scores sampling uses.

    It keeps each step's processed scores (a reference: transformers does not modify them after the
    processors) and, in chunks bounded by ``flush_bytes``, turns them into the kept sets (finite entries)
    and the sampled tokens' log-probs (``log_softmax(scores)[token]``), once the tokens are known. Per
    step the capture costs one list append; the work is a few large vector ops per chunk.
    """

    def __init__(self, prompt_width: int, flush_bytes: int = 64 << 20):
        self.prompt_width = prompt_width
        self.flush_bytes = flush_bytes
        self.steps = 0
        self.logprobs: list[torch.Tensor] = []             # per chunk [B, S_c]
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []   # (counts [B, S_c], ids int32 b-major)
        self._pending: list[torch.Tensor] = []             # per step float32 [B, V], not yet flushed
        self._flushed = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        if step != self.steps:
            raise ReplayError(f"kept-set capture saw step {step} after {self.steps} steps: generate() "
                              f"did not call the logits processors once per token")
        if self._pending and len(self._pending) * self._pending[0].numel() * 4 >= self.flush_bytes:
            self._flush(input_ids)   # the tokens of every pending step are in input_ids now
        self._pending.append(scores.to(torch.float32))
        self.steps += 1
        return scores

    def _flush(self, tokens: torch.Tensor) -> None:
        if not self._pending:
            return
        scores = torch.stack(self._pending, dim=1)                        # [B, S_c, V]
        lo = self.prompt_width + self._flushed
        sampled = tokens[:, lo:lo + scores.shape[1]].to(scores.device)    # [B, S_c]
        # log_softmax over the whole (processed) vocabulary row: the reduction length is V whatever the
        # kept set's size, so a trainer computing the same log_softmax on its own logits (kept set
        # applied as -inf) gets the same bits from the same logits (a fixed tree under batch_invariant_mode)
        logp = torch.log_softmax(scores, dim=-1)
        self.logprobs.append(logp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1))
        kept = scores > float("-inf")
        self.chunks.append((kept.sum(dim=-1), kept.nonzero()[:, 2].to(torch.int32)))
        self._flushed += scores.shape[1]
        self._pending = []

    def finish(self, sequences: torch.Tensor) -> None:
        self._flush(sequences)

    def kept_sets(self, resp_lens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample, the CSR kept sets of its first ``resp_lens[b]`` steps."""
        chunks = [(c.cpu(), ids.cpu()) for c, ids in self.chunks]
        starts = [torch.cat([torch.zeros(1, dtype=torch.int64), c.sum(1).cumsum(0)]) for c, _ in chunks]
        out = []
        for b, R in enumerate(resp_lens):
            counts, ids, step0 = [], [], 0
            for (c, chunk_ids), start in zip(chunks, starts):
                n = max(0, min(c.shape[1], R - step0))
                if n:
                    counts.append(c[b, :n])
                    lo = int(start[b])
                    ids.append(chunk_ids[lo:lo + int(c[b, :n].sum())])
                step0 += c.shape[1]
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(counts).cumsum(0)])
            out.append((offsets, torch.cat(ids)))
        return out


def _append_logits_processor(model, processor) -> PatchHandle:
    """Make ``processor`` the last logits processor of ``model.generate`` (instance-level ``set_attr`` of
    ``_get_logits_processor``; a :class:`~moealign.handle.PatchHandle`, undone on ``undo()`` or ``with`` exit)."""
    original = model._get_logits_processor     # bound: the class's, or one the instance already had

    def _get_logits_processor(*args, **kwargs):
        processors = original(*args, **kwargs)
        processors.append(processor)
        return processors

    handle = PatchHandle(f"{type(processor).__name__} appended to {type(model).__name__}.generate's logits "
                         f"processors", "instance")
    handle.set_attr(model, "_get_logits_processor", _get_logits_processor)
    return handle


@contextlib.contextmanager
def _sampling_rng(generator: torch.Generator, device: torch.device) -> Iterator[None]:
    """Let ``generate()``'s sampling (``torch.multinomial`` on the default generator of ``device``) draw from
    ``generator``: the default generator is forked, set to ``generator``'s state, and after the block
    ``generator`` takes the advanced state back (as if sampling had drawn from it); the process's RNG states
    (CPU and ``device``) are as before, also on an exception."""
    if not isinstance(generator, torch.Generator):
        raise InputTypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ConfigError(f"generator is on {generator.device} but sampling runs on {device}; "
                          f"pass torch.Generator(device={str(device)!r})")
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(generator.get_state())
            yield
            generator.set_state(torch.get_rng_state())
        return
    backend = torch.get_device_module(device.type)
    index = device.index if device.index is not None else backend.current_device()
    if generator.device.index is not None and generator.device.index != index:
        raise ConfigError(f"generator is on {generator.device} but sampling runs on {device.type}:{index}")
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        backend.set_rng_state(generator.get_state(), index)
        yield
        generator.set_state(backend.get_rng_state(index))


def _response_lengths(generated: torch.Tensor, eos_ids: Sequence[int]) -> list[int]:
    if not eos_ids:
        return [generated.shape[1]] * generated.shape[0]
    is_eos = torch.isin(generated, torch.tensor(list(eos_ids), device=generated.device))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], generated.shape[1], dtype=torch.long))
    return [int(x) for x in first]


def generate_with_record(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 64,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    record_routes: bool = True,
    record_kept_sets: bool = True,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    engine: str = "transformers",
    validate: bool = False,
) -> RolloutRecord:
    """Sample with ``model.generate()`` and return a :class:`RolloutRecord`.

    ``input_ids`` / ``attention_mask`` are a left-padded prompt batch (pad positions are dropped from
    the record). Log-probs and kept sets come from the processed scores sampling used (after
    temperature, top-k, top-p, min-p and any other processor of the generation config); routes from
    the prefill and every decode step.

    Sampling draws from ``generator`` (a ``torch.Generator`` on the prompts' device; it is advanced, as any
    torch sampling function advances its generator) or, with ``seed``, from a fresh generator seeded with it
    (the same draws as ``torch.manual_seed(seed)`` then sampling); the process's global RNG is left as it
    was. With neither, sampling draws from (and advances) the global RNG.
    """
    info = describe_model(model)
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ConfigError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         f"must both be [batch, prompt_len]")
    am = attention_mask.to(torch.int64)
    if bool((am.sum(1) == 0).any()):
        raise ConfigError(f"prompt rows {(am.sum(1) == 0).nonzero().flatten().tolist()} are empty")
    if not bool((am[:, 1:] >= am[:, :-1]).all()):
        raise ConfigError("prompts must be left-padded (attention_mask zeros then ones in every row); "
                         "set tokenizer.padding_side = 'left'")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if seed is not None and generator is not None:
        raise ConfigError("pass seed or generator, not both")
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    gen_cfg = model.generation_config
    if eos_token_id is None:
        eos_token_id = gen_cfg.eos_token_id
    eos_ids = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if pad_token_id is None:
        pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)

    S0 = input_ids.shape[1]
    kept = _KeptSetCapture(S0, KEPT_SET_FLUSH_BYTES)
    with contextlib.ExitStack() as stack:
        capture = stack.enter_context(capture_routes(model, info=info)) if record_routes else None
        stack.enter_context(_append_logits_processor(model, kept))
        if generator is not None:
            stack.enter_context(_sampling_rng(generator, input_ids.device))
        with torch.no_grad():
            sequences = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                min_p=sampling.min_p if sampling.min_p > 0 else None, max_new_tokens=max_new_tokens,
                eos_token_id=eos_ids or None, pad_token_id=pad_token_id, use_cache=True,
                return_dict_in_generate=False)
    kept.finish(sequences)
    generated = sequences[:, S0:]
    steps = generated.shape[1]
    if kept.steps != steps or sum(lp.shape[1] for lp in kept.logprobs) != steps:
        raise ReplayError(f"kept-set capture saw {kept.steps} steps for {steps} generated tokens")
    resp_lens = _response_lengths(generated, eos_ids)

    routes_bt = None
    if capture is not None:
        if any(n != steps for n in capture.num_calls):
            raise ReplayError(f"expected {steps} router calls per MoE layer (prefill + {steps - 1} decode steps), "
                              f"saw {capture.num_calls}")
        B = input_ids.shape[0]
        per_layer = []
        for calls in capture.calls:
            prefill = calls[0].reshape(B, S0, -1)
            decode = [c.reshape(B, 1, -1) for c in calls[1:]]
            per_layer.append(torch.cat([prefill] + decode, dim=1))   # [B, S0 + steps - 1, k]
        routes_bt = compact_routes(torch.stack(per_layer, dim=2), info.num_experts).cpu()  # [B, S0+steps-1, n, k]

    logprobs = torch.cat(kept.logprobs, dim=1).cpu()                  # [B, steps]
    kept_sets = kept.kept_sets(resp_lens) if record_kept_sets else None

    meta = record_meta(model, engine=engine, info=info)
    samples = []
    am_cpu, seq_cpu = am.cpu(), sequences.cpu()
    for b in range(input_ids.shape[0]):
        R = resp_lens[b]
        prompt = seq_cpu[b, :S0][am_cpu[b].bool()]
        token_ids = torch.cat([prompt, seq_cpu[b, S0:S0 + R]])
        routes = None
        if routes_bt is not None:
            valid = torch.cat([am_cpu[b].bool(), torch.ones(R - 1, dtype=torch.bool)])
            routes = routes_bt[b, :S0 + R - 1][valid]   # validated and compacted once above
        kept_offsets, kept_ids = kept_sets[b] if kept_sets is not None else (None, None)
        samples.append(Sample(token_ids=token_ids, prompt_len=int(prompt.numel()), logprobs=logprobs[b, :R].clone(),
                              routes=routes, kept_offsets=kept_offsets, kept_ids=kept_ids, sampling=sampling))
    # built by construction from what generate() did; RolloutRecord.validate() (also run by save/load
    # round trips and by the tests) checks the same invariants at a cost of ~1% of a generate() call
    return RolloutRecord(meta, samples, validate=validate)

"""The record re-scored by vLLM itself: one prefill of each sample's tokens, the recorded routes forced, and the
logits at the response positions read back (what the diagnosis needs to compute the kept-set log-prob in the
trainer's arithmetic).

:func:`prefill_logits` runs :func:`~moealign.patches.vllm.replay.score_with_routes` (the routes forced and verified
in every worker) with a :class:`HiddenCapture` on the model runner of every worker (:class:`InWorkers`): each
engine step's final hidden states, their request and position. After the run, per sample, the latest hidden row of
every position ``prompt_len - 1 .. length - 2`` goes through the model's own ``compute_logits`` (the LM head and
logits processor vLLM's sampler reads; moealign's canonical LM head when the canonical patch is on), in one call per
sample, in the worker. The decode that made the record computed those logits one position per engine step, next to
other requests' rows; this prefill computes them all at once: the two paths agree only where every op is batch- and
position-invariant (the canonical forward). The diagnosis measures the difference as its own term.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import EngineError, ReplayError
from ...handle import PatchHandle
from ...record import RolloutRecord
from .replay import SAMPLE_KEY, score_with_routes
from .rollout import InWorkers

__all__ = ["HiddenCapture", "prefill_logits"]


class HiddenCapture(PatchHandle):
    """Each engine step's final hidden states in an in-process vLLM model runner (scope ``"instance"``): wraps
    ``runner._model_forward``; ``steps`` holds ``(sample per row, position per row, hidden [rows, H])``."""

    def __init__(self, runner, num_samples: int):
        super().__init__(f"hidden-state capture on {type(runner).__name__}", "instance")
        self.runner = runner
        self.num_samples = num_samples
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _sample(self, req_id: str) -> int:
        state = self.runner.requests.get(req_id)
        extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
        index = extra.get(SAMPLE_KEY)
        if not (isinstance(index, int) and 0 <= index < self.num_samples):
            raise ReplayError(f"vLLM request {req_id} names sample {index!r}, not one of {self.num_samples}")
        return index

    def _forward(self, original):
        runner = self.runner

        def _model_forward(*args, **kwargs):
            out = original(*args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            positions = kwargs.get("positions")
            if not isinstance(hidden, torch.Tensor) or not isinstance(positions, torch.Tensor):
                raise EngineError("vLLM's model forward returned no hidden-state tensor (or got no positions): the "
                                  "re-scoring cannot read its rows")
            batch = runner.input_batch
            num_reqs = int(batch.num_reqs)
            qsl = torch.as_tensor(runner.query_start_loc.np[:num_reqs + 1]).to(torch.int64)
            tokens = int(qsl[-1])
            samples = torch.tensor([self._sample(r) for r in batch.req_ids[:num_reqs]], dtype=torch.int64)
            self.steps.append((torch.repeat_interleave(samples, qsl.diff()),
                               positions[:tokens].to("cpu", torch.int64).clone(), hidden[:tokens].detach().clone()))
            return out
        return _model_forward

    def attach(self) -> "HiddenCapture":
        self.set_attr(self.runner, "_model_forward", self._forward(self.runner._model_forward),
                      f"{type(self.runner).__name__}._model_forward")
        return self

    def logits(self, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Per sample ``i``, float32 logits ``[end - start, V]`` (CPU) of positions ``spans[i] = (start, end)``: the
        latest hidden row of each position through the model's ``compute_logits``, one call per sample."""
        if not self.steps:
            raise EngineError("no vLLM engine step was seen while re-scoring")
        sample = torch.cat([s for s, _, _ in self.steps])
        pos = torch.cat([p for _, p, _ in self.steps])
        hidden = torch.cat([h for _, _, h in self.steps])
        row = torch.arange(sample.numel())
        model = self.runner.model
        out = []
        for i, (start, end) in enumerate(spans):
            wanted = torch.arange(start, end)
            mine = (sample == i).nonzero().flatten()
            # the latest row of each wanted position (a later step overwrites an earlier one)
            key = pos[mine].unsqueeze(0) == wanted.unsqueeze(1)                     # [n, rows]
            if not bool(key.any(1).all()):
                raise ReplayError(f"sample {i}: no forward row for position {int(wanted[~key.any(1)][0])}")
            last = mine[(key * (row[mine] + 1)).argmax(1)]
            with torch.no_grad():
                logits = model.compute_logits(hidden[last].to(hidden.device))
            if logits is None or tuple(logits.shape[:1]) != (end - start,):
                raise EngineError(f"sample {i}: vLLM's compute_logits returned "
                                  f"{None if logits is None else tuple(logits.shape)} for {end - start} rows")
            out.append(logits.to("cpu", torch.float32))
        return out


def _attach_capture(runner, num_samples: int) -> HiddenCapture:
    return HiddenCapture(runner, num_samples).attach()


def _read_capture(capture: HiddenCapture, spans) -> list[torch.Tensor]:
    return capture.logits(spans)


def prefill_logits(llm: Any, record: RolloutRecord, *, force: bool = True) -> tuple[list[torch.Tensor],
                                                                                     list[torch.Tensor]]:
    """``(logits, routes)`` per sample of ``record``: float32 logits ``[response_len, V]`` at the response positions
    (the distribution each response token was drawn from, before temperature and truncation) of one vLLM prefill of
    the sample's tokens, the record's routes forced (``force=False``: vLLM's own routing), and the experts that ran at
    positions ``0 .. L-2`` (int64 ``[L-1, layers, k]``; with ``force`` checked equal to the record's)."""
    spans = [(s.prompt_len - 1, s.length - 1) for s in record.samples]
    capture = InWorkers(llm, _attach_capture, (len(record),), _read_capture, (spans,))
    with capture:
        _, routes = score_with_routes(llm, record, force=force, return_routes=True)
    logits = capture.per_rank[0]
    return logits, routes

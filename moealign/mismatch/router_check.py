"""``record inspect --model``: the checkpoint's routers run on a record's tokens (transformers, float32, one forward
per micro-batch, nothing generated), their expert sets compared with the record's
(:func:`moealign.record.inspect.compare_routes`). Here, not in :mod:`moealign.record`, because it runs a model:
the record package imports no engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import RecordMismatchError
from ..record import RolloutRecord
from ..record.inspect import compare_routes
from .engines import HFTrainEngine
from ..options import check_checkpoint
from .rollout import open_engine

__all__ = ["ROUTER_BATCH", "router_check"]

#: Samples per forward of :func:`router_check`.
ROUTER_BATCH = 16


def router_check(record: RolloutRecord, model_path: str, *, device: str = "cpu",
                 batch_size: int = ROUTER_BATCH) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The checkpoint's routers run on ``record``'s tokens (transformers, float32, no generation): ``(summary,
    findings)``. ``summary``: ``{"router_agreement": fraction of recorded (row, layer) pairs whose expert set equals
    the model's own, "router_pairs": how many, "router_check": what ran or why not}``; findings ``other_model``
    (the record does not fit the checkpoint) and ``foreign_routes`` (agreement below
    ``1 - FOREIGN_FLIP_RATE``). Pass it to :func:`moealign.record.inspect.inspect_record` as
    ``router_check=lambda record: router_check(record, model_path)``."""
    summary: dict[str, Any] = {"router_agreement": None, "router_pairs": None}
    root = Path(model_path)
    if not any(root.glob("*.safetensors")) and not any(root.glob("*.bin")):
        summary["router_check"] = f"not run: {model_path} holds no weights (config only)"
        return summary, []
    check_checkpoint(model_path)
    engine = open_engine(HFTrainEngine, "record inspect --model (transformers, fp32)", model_path, "fp32", device)
    try:
        try:
            record.meta.check_matches(engine.meta(), what="--model")
        except RecordMismatchError as exc:
            summary["router_check"] = "not run: the record does not fit the checkpoint"
            return summary, [{"check": "other_model", "detail": f"the record is not of {model_path}: {exc}"}]
        own = [engine.forward(record, range(i, min(i + batch_size, len(record))), replay=False).routes.cpu()
               for i in range(0, len(record), batch_size)]
    finally:
        engine.close()
    return compare_routes(record, torch.cat(own), "the checkpoint's routers (transformers, float32)")

"""``moealign mismatch --contract``: both sides' execution contracts (:mod:`moealign.contract`), compared field by
field, without scoring anything.

The rollout side's contract is the record's (``--load-record``; a record without one is refused), else the rollout
engine's, opened as the mismatch test opens it (nothing generated); the training side's is the training engine's.
Each engine is closed as soon as its contract is taken.
"""

from __future__ import annotations

from typing import Callable

from ..contract import compare_contracts, gap_fields
from ..errors import ConfigError
from ..record import RolloutRecord
from .rollout import MismatchConfig, make_rollout_engine
from .scoring import make_train_engine

__all__ = ["run_contract_check"]


def run_contract_check(cfg: MismatchConfig, *, log: Callable[[str], None] | None = None) -> dict:
    """``{"rollout": contract, "train": contract, "fields": rows, "gaps": [field names]}`` for ``cfg``'s two sides.

    Both sides state the sampling parameters: the record's (one set for the whole record, else not stated) with
    ``load_record``, else ``cfg.sampling``."""
    log = log or (lambda msg: None)
    device = cfg.resolved_device()
    model_path = cfg.model_path()
    if cfg.load_record:
        record = RolloutRecord.load(cfg.load_record)
        if record.contract is None:
            raise ConfigError(f"--contract --load-record {cfg.load_record}: the record states no execution contract "
                              f"(it was saved without one); run --contract without --load-record to open the rollout "
                              f"engine instead")
        rollout = record.contract
        params = {s.sampling for s in record.samples}
        sampling = None
        if len(params) == 1:
            p = params.pop()
            sampling = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p}
    else:
        sampling = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p, "min_p": cfg.min_p}
        log(f"contract: opening the {cfg.rollout_engine} rollout engine ({cfg.rollout_precision}) on {device}")
        engine = make_rollout_engine(cfg, model_path, device)
        try:
            rollout = engine.contract(sampling)
        finally:
            engine.close()
        del engine
    log(f"contract: opening the {cfg.train_engine} training engine ({cfg.train_precision}) on {device}")
    trainer = make_train_engine(cfg, model_path, device)
    try:
        train = trainer.contract(sampling)
    finally:
        trainer.close()
    rows = compare_contracts(rollout, train)
    return {"rollout": rollout, "train": train, "fields": rows, "gaps": [row["field"] for row in gap_fields(rows)]}

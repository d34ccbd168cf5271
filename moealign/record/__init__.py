"""Rollout records: what flows from the rollout engine to the training engine, where records come from and go.

One :class:`RolloutRecord` holds, per sample, the token ids (prompt + response), the prompt length,
the rollout log-probs of the sampled tokens under the distribution that was actually sampled from
(after temperature and truncation), the routes, the kept sampling sets and the sampling parameters;
and, per record, :class:`RecordMeta` (engine and version, model fingerprint, MoE layer numbers,
number of experts, top-k, dtype, format version).

Conventions (vLLM's, so its ``routed_experts`` drop in):

* Route row ``i`` is the decision taken when token ``i`` was the *input*. Rows cover prompt + response
  minus the final token (the last sampled token was never forwarded): ``routes`` is
  ``[len(token_ids) - 1, len(meta.moe_layers), top_k]``.
* Routes are ``uint8`` when the model has <= 256 experts, ``int16`` above (``top_k`` bytes per token
  and layer, or twice that).
* ``meta.moe_layers`` are the decoder-layer numbers of the route table's layer axis (dense layers are
  not stored; :func:`routes_from_all_layers` converts vLLM's all-layer arrays).
* Rows without a recorded route (an engine that did not report them: a prompt prefix served from cache, a -1
  sentinel, a stitched turn's row no engine computed) are explicit: ``Sample.route_missing`` (bool, one per route
  row) marks them, their routes hold 0, and they are never replayed (the replay batch's ``route_mask`` leaves them
  out, so the router picks its own experts there and the replay verifier counts them as unrouted).
* ``Sample.route_version`` (int64, one per route row, optional) is the weight version each row's route was
  computed under (a multi-turn record stitched across versions, :mod:`moealign.record.stitch`);
  ``Sample.stale_rows()`` names the rows of an older version.
* Kept sets are CSR: ``kept_offsets`` int64 ``[response_len + 1]`` and ``kept_ids`` int32, one row per
  generated token, ids ascending.

The package, one module per concern:

* :mod:`~moealign.record.meta`: :class:`SamplingParams`, :class:`RecordMeta`, ``MIN_TEMPERATURE`` and the router
  fingerprints (:func:`router_signature`, :func:`router_samples`); the size bounds (``MAX_*``) and
  :func:`config_fingerprint` are :mod:`moealign.model_config`'s (a config.json and a record obey the same bounds);
* :mod:`~moealign.record.sample`: :class:`Sample` and its checks, :func:`routes_from_all_layers`;
* :mod:`~moealign.record.layouts`: :class:`PaddedBatch` / :class:`PackedBatch` and the routes each hands a trainer;
* :mod:`~moealign.record.rollout`: :class:`RolloutRecord`;
* :mod:`~moealign.record.io`: the safetensors file (format version, checksum, every field checked on load);
* :mod:`~moealign.record.formats`: other engines' route formats (SGLang, vLLM 0.21, TensorRT-LLM, NeMo-RL, verl,
  slime) <-> route rows;
* :mod:`~moealign.record.convert`: ``moealign record convert`` (an engine's output file -> a record, a record -> a
  framework's batch file);
* :mod:`~moealign.record.inspect`: ``moealign record inspect`` (summary, broken-capture patterns);
* :mod:`~moealign.record.stitch`: a multi-turn trajectory's turns stitched into one sample.

This package imports no engine: the router check of ``record inspect --model`` (a checkpoint's routers run on a
record's tokens) lives in :mod:`moealign.mismatch.router_check`.
"""

from ..errors import RecordError, RecordFormatError, RecordMismatchError
from ..model_config import MAX_EXPERTS, MAX_LAYERS, MAX_VOCAB, config_fingerprint
from .layouts import PackedBatch, PaddedBatch, concat_kept_sets, kept_sets_of
from .meta import (
    FORMAT_VERSION,
    MIN_TEMPERATURE,
    ROUTER_SAMPLES,
    RecordMeta,
    SamplingParams,
    router_samples,
    router_signature,
)
from .rollout import RolloutRecord, with_meta
from .sample import Sample, routes_from_all_layers

__all__ = [
    "FORMAT_VERSION",
    "MAX_LAYERS",
    "MAX_EXPERTS",
    "MAX_VOCAB",
    "MIN_TEMPERATURE",
    "RecordError",
    "RecordFormatError",
    "RecordMismatchError",
    "SamplingParams",
    "RecordMeta",
    "Sample",
    "RolloutRecord",
    "PaddedBatch",
    "PackedBatch",
    "config_fingerprint",
    "router_signature",
    "router_samples",
    "routes_from_all_layers",
    "concat_kept_sets",
    "kept_sets_of",
    "with_meta",
    "ROUTER_SAMPLES",
]

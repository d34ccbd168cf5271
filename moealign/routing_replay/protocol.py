"""The routing-replay protocol every engine adapter implements (transformers, Megatron-core, vLLM).

One protocol, one error, one aux-loss vocabulary::

    batch = record.replay_batch("padded", side="right")     # routes AND the tokens they belong to
    with adapter_replay_routing(model, aux_loss="replayed") as replay:    # hf.replay_routing / mg.replay_routing
        replay.set_routes(batch)          # hand every router its rows, in the engine's own row order
        with replay.forward():            # a forward pass that replays
            out = model(...batch.input_ids...)
        with replay.backward():           # activation recompute during backward replays the same rows
            loss.backward()
        replay.check(calls=2)             # every router consumed exactly its rows, forward + recompute
    # exit: undo(), the model is as it was

A :class:`ReplayBatch` carries the routes together with the batch they were laid out for: the token ids
(padded ``[batch, seq]`` with its attention mask, or packed ``[tokens]`` with ``cu_seqlens``), named
fields instead of positional shapes. Adapters compare the token ids the model actually runs with the
batch's (:func:`check_row_tokens`), so a padding-side slip, a transposed layout or another batch of the
same shape raises :class:`~moealign.errors.ReplayError` instead of replaying experts recorded for other
tokens. Routed rows on masked (padding) positions are refused when the batch is built.

``aux_loss`` (:data:`AUX_LOSS_MODES`): ``"replayed"`` - the load-balancing loss counts the replayed
experts (the ones that ran); ``"warn"`` - the engine's own loss is kept and the adapter measures how
often the router's own top-k differs from the replayed one (``aux_disagreement``), warning once;
``"own"`` - the engine's loss is left alone, nothing measured.

Pure torch: no engine import.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch

from .._validate import check_binary_mask, check_offsets, check_token_ids
from ..errors import ConfigError, ReplayError, RouteError
from .degenerate import find_degenerate
from .routes import validate_routes

__all__ = [
    "AUX_LOSS_MODES",
    "LAYOUTS",
    "ReplayBatch",
    "DisagreementLog",
    "ReplayCounters",
    "RoutingReplayAdapter",
    "RowTokenCheck",
    "check_aux_loss_mode",
    "check_route_ids",
    "check_row_tokens",
    "model_routes",
]

AUX_LOSS_MODES = ("replayed", "warn", "own")
LAYOUTS = ("padded", "packed")


def check_aux_loss_mode(mode: str) -> str:
    if mode not in AUX_LOSS_MODES:
        raise ConfigError(f"aux_loss must be one of {AUX_LOSS_MODES}, got {mode!r}")
    return mode


def _padding_side(attention_mask: torch.Tensor) -> str:
    """``"right"`` (ones then zeros in every row), ``"left"`` (zeros then ones), ``"none"`` (all ones)."""
    am = attention_mask
    if bool(am.all()):
        return "none"
    if bool((am[:, 1:] <= am[:, :-1]).all()):
        return "right"
    if bool((am[:, 1:] >= am[:, :-1]).all()):
        return "left"
    raise RouteError("attention_mask is neither left- nor right-padded (a row has a hole); replay needs one "
                     "contiguous run of tokens per row")


@dataclass(frozen=True)
class ReplayBatch:
    """Routes and the batch they belong to, travelling together.

    ``routes`` int64 ``[rows, n_layers, k]`` in the batch's row order (padded: row = ``b * seq_len + t``;
    packed: position in the packed row); ``route_mask`` bool ``[rows]`` marks rows with a recorded route
    (others - padding, each sample's last token - are not replayed); ``moe_layers`` names the decoder
    layer of each route column; ``input_ids`` the tokens (``[batch, seq]`` padded, ``[tokens]`` packed).
    Build with :meth:`padded` / :meth:`packed` (or ``RolloutRecord.replay_batch``).

    Every ``ReplayBatch`` is validated once, when it is built (``__post_init__``): shapes and dtypes, the
    broken-capture patterns of :func:`~moealign.routing_replay.degenerate.find_degenerate` on the routed rows
    (:class:`~moealign.errors.ReplayError` unless ``allow_degenerate``), and the facts the adapters check per
    model without touching the tensors again (host ints, read by :func:`check_route_ids` and the adapters'
    ``set_routes``): the expert-id range and duplicate rows among the routed rows, the token-id range, the
    number of routed rows. The adapters trust these facts, so the tensors must not be changed in place after
    construction (build a new batch instead).
    """

    layout: str
    routes: torch.Tensor
    route_mask: torch.Tensor
    moe_layers: tuple[int, ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    padding_side: str | None = None
    cu_seqlens: torch.Tensor | None = None
    allow_degenerate: bool = False
    # facts measured once at construction (host values; see the class docstring)
    num_replayed_rows: int = field(init=False, repr=False, compare=False, default=0)
    all_routed: bool = field(init=False, repr=False, compare=False, default=False)
    id_range: tuple[int, int] = field(init=False, repr=False, compare=False, default=(0, -1))
    duplicate_ids: bool = field(init=False, repr=False, compare=False, default=False)
    token_range: tuple[int, int] = field(init=False, repr=False, compare=False, default=(0, -1))

    def __post_init__(self) -> None:
        self._validate()

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A padded batch's ``(routes [batch, seq, n_layers, k], route_mask [batch, seq])``: what
        :meth:`padded` takes, to build a batch from another one's routes."""
        if self.layout != "padded":
            raise RouteError(f"grid() is for padded batches, this one is {self.layout}")
        B, T = self.input_ids.shape
        return self.routes.reshape(B, T, *self.routes.shape[1:]), self.route_mask.reshape(B, T)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def padded(cls, routes: torch.Tensor, *, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               moe_layers: Sequence[int], route_mask: torch.Tensor | None = None,
               allow_degenerate: bool = False) -> "ReplayBatch":
        """A padded ``[batch, seq]`` batch. ``routes`` ``[batch, seq, n_layers, k]``; ``route_mask`` ``[batch, seq]``
        (default: every attended position). Flat ``[batch*seq, ...]`` tables are refused: they do not say whether
        their rows are batch-major (transformers) or sequence-first (Megatron's ``[s*b]``), and with equal token
        rows no later check could tell the two apart."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise RouteError(f"a padded replay batch needs input_ids [batch, seq], got "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise RouteError(f"attention_mask {tuple(getattr(attention_mask, 'shape', ()))} must have the shape of "
                             f"input_ids {tuple(input_ids.shape)}")
        am = check_binary_mask(attention_mask.detach().cpu(), "attention_mask", RouteError).to(torch.bool)
        B, T = input_ids.shape
        if not isinstance(routes, torch.Tensor) or routes.dim() != 4:
            raise RouteError(f"padded routes must be [batch, seq, n_layers, k], got shape "
                             f"{tuple(getattr(routes, 'shape', ()))}: a flat [rows, ...] table does not say whether "
                             f"its rows are batch-major or sequence-first (reshape it to [batch, seq, ...] yourself)")
        if tuple(routes.shape[:2]) != (B, T):
            raise RouteError(f"routes [batch, seq] = {tuple(routes.shape[:2])} do not match input_ids {(B, T)}")
        routes = routes.reshape(B * T, *routes.shape[2:])
        mask = am if route_mask is None else route_mask
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, T):
            raise RouteError(f"route_mask {tuple(getattr(mask, 'shape', ()))} must be [batch, seq] = {(B, T)}, like "
                             f"input_ids")
        mask = mask.reshape(-1)
        batch = cls(layout="padded", routes=routes, route_mask=mask, moe_layers=tuple(moe_layers),
                    input_ids=input_ids, attention_mask=am.to(torch.int64), padding_side=_padding_side(am),
                    allow_degenerate=bool(allow_degenerate))
        return batch

    @classmethod
    def packed(cls, routes: torch.Tensor, *, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int],
               moe_layers: Sequence[int], route_mask: torch.Tensor | None = None,
               allow_degenerate: bool = False) -> "ReplayBatch":
        """A packed row (THD): ``input_ids`` ``[tokens]``, ``cu_seqlens`` ``[samples + 1]`` from 0 to ``tokens``;
        ``routes`` ``[tokens, n_layers, k]``; ``route_mask`` ``[tokens]`` (default: all)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
            raise RouteError(f"a packed replay batch needs input_ids [tokens], got "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        cu = check_offsets(cu_seqlens, "cu_seqlens", RouteError)
        if int(cu[-1]) != input_ids.numel():
            raise RouteError(f"cu_seqlens must be non-decreasing from 0 to the {input_ids.numel()} packed tokens, "
                             f"got {cu.tolist()}")
        mask = torch.ones(input_ids.numel(), dtype=torch.bool) if route_mask is None else route_mask
        batch = cls(layout="packed", routes=routes, route_mask=mask, moe_layers=tuple(moe_layers),
                    input_ids=input_ids, cu_seqlens=cu, allow_degenerate=bool(allow_degenerate))
        return batch

    def _validate(self) -> None:
        r = self.routes
        if not isinstance(r, torch.Tensor) or r.dim() != 3:
            raise RouteError(f"routes must be [rows, layers, k], got shape {tuple(getattr(r, 'shape', ()))}")
        if r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool:
            raise RouteError(f"routes must hold integer expert ids, got {r.dtype}")
        if r.shape[0] != self.input_ids.numel():
            raise RouteError(f"routes have {r.shape[0]} rows, the batch has {self.input_ids.numel()} token positions "
                             f"(input_ids {tuple(self.input_ids.shape)})")
        if len(self.moe_layers) != r.shape[1]:
            raise RouteError(f"routes have {r.shape[1]} layers but moe_layers lists {len(self.moe_layers)}")
        if len(set(self.moe_layers)) != len(self.moe_layers) or any(x < 0 for x in self.moe_layers):
            raise RouteError(f"moe_layers must be distinct non-negative layer numbers, got {list(self.moe_layers)}")
        m = self.route_mask
        if not isinstance(m, torch.Tensor) or m.shape != (r.shape[0],):
            raise RouteError(f"route_mask has shape {tuple(getattr(m, 'shape', ()))}, expected ({r.shape[0]},)")
        if m.dtype != torch.bool:
            if m.is_floating_point() or bool(((m != 0) & (m != 1)).any()):
                raise RouteError(f"route_mask must be bool (or 0/1), got {m.dtype}")
            object.__setattr__(self, "route_mask", m.to(torch.bool))
        if self.input_ids.dtype.is_floating_point:
            raise RouteError(f"input_ids must be integer token ids, got {self.input_ids.dtype}")
        for name, t in (("routes", r), ("route_mask", m), ("input_ids", self.input_ids)):
            if t.device.type == "meta":
                raise RouteError(f"{name} is on the meta device (shapes only, no values): replay needs the recorded "
                                 f"expert ids and tokens")
        r = r.to(torch.int64)
        object.__setattr__(self, "routes", r)
        if self.layout == "padded" and self.attention_mask is not None:
            T = self.input_ids.shape[1]
            masked = self.route_mask.cpu() & (self.attention_mask.cpu().reshape(-1) == 0)
            if bool(masked.any()):
                rows = masked.nonzero().flatten()
                raise RouteError(f"{rows.numel()} routed rows sit on masked (padding) positions, first row "
                                 f"{int(rows[0])} (batch {int(rows[0]) // T}, position {int(rows[0]) % T}): the routes "
                                 f"were laid out for another padding side or batch")
        self._measure()

    def _measure(self) -> None:
        """The once-per-batch work: the broken-capture patterns and the facts the adapters read (one host read)."""
        mask = self.route_mask.to(self.routes.device)
        routed = self.routes[mask]                                        # [routed rows, layers, k]
        ids = self.input_ids.reshape(-1)
        k = routed.shape[-1]
        duplicate = torch.zeros((), dtype=torch.bool, device=routed.device)
        for i in range(k - 1):
            duplicate |= (routed[..., i + 1:] == routed[..., i:i + 1]).any()
        empty = routed.new_zeros(())
        n, lo, hi, dup = torch.stack([mask.sum(), routed.min() if routed.numel() else empty,
                                      routed.max() if routed.numel() else empty - 1, duplicate.long()]).tolist()
        tlo, thi = torch.stack([ids.min(), ids.max()]).tolist() if ids.numel() else (0, -1)
        object.__setattr__(self, "num_replayed_rows", int(n))
        object.__setattr__(self, "all_routed", int(n) == self.rows)
        object.__setattr__(self, "id_range", (int(lo), int(hi)))
        object.__setattr__(self, "duplicate_ids", bool(dup))
        object.__setattr__(self, "token_range", (int(tlo), int(thi)))
        if not self.allow_degenerate and not dup and lo >= 0:
            findings = find_degenerate(routed, self.moe_layers)
            if findings:
                detail = "; ".join(f"{f['check']}: {f['detail']}" for f in findings)
                raise ReplayError(f"refusing to replay a broken route capture ({detail}); check the record with "
                                  f"`moealign record inspect` (a batch built with allow_degenerate=True skips the "
                                  f"pattern checks)")

    # ------------------------------------------------------------------ views
    @property
    def rows(self) -> int:
        return int(self.routes.shape[0])

    @property
    def row_tokens(self) -> torch.Tensor:
        """The token each route row belongs to, ``[rows]``."""
        return self.input_ids.reshape(-1)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0]) if self.layout == "padded" else int(self.cu_seqlens.numel() - 1)

    @property
    def seq_len(self) -> int | None:
        """Padded sequence length (``None`` for a packed batch)."""
        return int(self.input_ids.shape[1]) if self.layout == "padded" else None

    def layer_columns(self, model_layers: Sequence[int]) -> list[int]:
        """Column of each of the model's MoE layers in :attr:`routes`; RouteError naming missing layers."""
        missing = [layer for layer in model_layers if layer not in self.moe_layers]
        if missing:
            raise RouteError(f"the batch has no routes for the model's MoE layers {missing} (batch layers "
                             f"{list(self.moe_layers)}, model layers {list(model_layers)})")
        return [self.moe_layers.index(layer) for layer in model_layers]

    def __repr__(self) -> str:
        shape = tuple(self.input_ids.shape)
        side = f", {self.padding_side} padding" if self.layout == "padded" else ""
        return (f"ReplayBatch({self.layout} {shape}{side}, {self.num_replayed_rows}/{self.rows} rows replayed, "
                f"layers {list(self.moe_layers)}, k={self.routes.shape[2]})")


def model_routes(batch: ReplayBatch, moe_layers: Sequence[int], top_k: int, *,
                 dense_layers: Sequence[int] = ()) -> torch.Tensor:
    """What every adapter's ``set_routes`` starts with: ``batch`` must be a :class:`ReplayBatch` with routes for
    each of the model's ``moe_layers`` and ``top_k`` ids per row; returns its int64 ``[rows, len(moe_layers),
    top_k]`` columns for those layers, in the model's layer order.

    Refused (:class:`ReplayError`): routes for any of ``dense_layers`` (decoder layers this model holds and runs
    dense: a stale or shifted layer list). The record-level checks (the broken-capture patterns of
    :func:`moealign.routing_replay.degenerate.find_degenerate`, shapes, dtypes) ran when the batch was built; this
    reads no tensor value (no host sync)."""
    if not isinstance(batch, ReplayBatch):
        raise RouteError(f"set_routes takes a ReplayBatch (record.replay_batch(...) or ReplayBatch.padded / "
                         f".packed), got {type(batch).__name__}")
    cols = batch.layer_columns(moe_layers)
    if batch.routes.shape[2] != top_k:
        raise RouteError(f"replay routes have k={batch.routes.shape[2]}, the model routes top-{top_k}")
    dense = sorted(set(batch.moe_layers) & set(dense_layers))
    if dense:   # a superset of the model's MoE layers is fine (a pipeline stage holds some layers), a dense one is not
        raise ReplayError(f"refusing to replay a broken route capture (dense_layers: routes for layers {dense}, which "
                          f"the model runs dense (its MoE layers: {sorted(moe_layers)})); check the record with "
                          f"`moealign record inspect`")
    if list(cols) == list(range(batch.routes.shape[1])):
        return batch.routes
    return batch.routes[:, cols]


def check_route_ids(batch: ReplayBatch, num_experts: int, *, name: str = "replay routes") -> None:
    """Raise :class:`RouteError` unless every routed row of ``batch`` holds distinct expert ids in
    ``[0, num_experts)``: decided from the facts measured when the batch was built (no tensor read); on failure the
    table is scanned to name the first bad batch row (rows without a route may hold anything)."""
    k = batch.routes.shape[-1]
    if k > num_experts:
        raise RouteError(f"{name} has k = {k} experts per token but there are only num_experts = {num_experts} experts")
    lo, hi = batch.id_range
    if not batch.num_replayed_rows or (lo >= 0 and hi < num_experts and not batch.duplicate_ids):
        return
    routes = batch.routes
    filler = torch.arange(routes.shape[-1], dtype=routes.dtype, device=routes.device)
    validate_routes(torch.where(batch.route_mask.to(routes.device)[:, None, None], routes, filler), num_experts,
                    name=name)
    raise RouteError(f"{name}: expert ids {lo}..{hi}{' with duplicates' if batch.duplicate_ids else ''} do not fit "
                     f"[0, {num_experts})")


def check_row_tokens(expected: torch.Tensor, actual: torch.Tensor, mask: torch.Tensor | None = None, *,
                     where: str = "the model") -> None:
    """Raise :class:`ReplayError` unless the tokens ``actual`` (what the routers' rows hold, in their order)
    equal ``expected`` (the batch the routes were laid out for) on every row of ``mask``."""
    expected, actual = expected.reshape(-1), actual.reshape(-1)
    if expected.numel() != actual.numel():
        raise ReplayError(f"{where} runs {actual.numel()} token rows, the routes were laid out for "
                          f"{expected.numel()}")
    differ = expected.to(actual.device) != actual
    if mask is not None:
        differ &= mask.to(actual.device).reshape(-1)
    if bool(differ.any()):
        rows = differ.nonzero().flatten()
        r = int(rows[0])
        total = int(mask.sum()) if mask is not None else expected.numel()
        raise ReplayError(f"{where} is not running the batch the routes were laid out for: {rows.numel()} of {total} "
                          f"routed rows hold other tokens (first: row {r}, routes for token {int(expected[r])}, the "
                          f"model has token {int(actual[r])}); a padding-side, layout or batch slip")


class RowTokenCheck:
    """The per-forward token checks of a replayed forward, kept on the device (no host sync in the forward).

    :meth:`observe` is called at the start of every replayed forward with the tokens the model runs (in router row
    order) and, where the engine takes one, its attention mask. Everything known from shapes is checked at once
    (:class:`ReplayError` before any work); the values (token ids in the vocabulary, 0/1 attention mask, each routed
    row holding the batch's token, no routed row masked) are compared by a handful of device operations (the id and
    mask ranges by one ``aminmax`` each, decided on the host later) into one small int64 tensor per forward, read only
    by :meth:`check` (the adapters' ``check()``): one host read for every forward since the last :meth:`reset`. When a
    counter is non-zero, the forward's tensors (kept by reference) are checked again on the host to raise the same
    error, naming the first bad row, that the per-forward host check raised (:func:`check_row_tokens`,
    ``check_token_ids``, ``check_binary_mask``), with the forward's number.
    ``expected`` / ``mask`` are moved to the forward's device once per :meth:`set` (where the data enters).
    """

    MAX_KEPT = 256          # forwards kept for the error message between reads (their counts are always kept)

    def __init__(self, where: str, vocab_size: int | None = None):
        self.where = where
        self.vocab_size = vocab_size
        self._expected: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.reset()

    def set(self, expected: torch.Tensor, mask: torch.Tensor | None) -> None:
        """The tokens the routes were laid out for (router row order) and the rows that carry a route (None: all)."""
        self._expected, self._mask = expected.reshape(-1), None if mask is None else mask.reshape(-1)
        self._on = {}

    def clear(self) -> None:
        self._expected = self._mask = None
        self._on = {}

    def reset(self) -> None:
        """Forget the forwards observed (their counters unread)."""
        self._pending: list[tuple] = []
        self.forwards = 0

    def _expected_on(self, device: torch.device):
        got = self._on.get(device)
        if got is None:
            got = self._on[device] = (self._expected.to(device),
                                      None if self._mask is None else self._mask.to(device, torch.bool))
        return got

    def observe(self, actual: torch.Tensor, *, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, masked_rows: bool = False) -> None:
        """Queue the checks of one forward. ``actual``: the token ids of the router rows, flat, in router row order;
        ``input_ids``: the tensor the model was given (for the vocabulary check and the message; default
        ``actual``); ``attention_mask``: the model's 2-D 0/1 mask (checked to hold 0/1; with ``masked_rows``, no
        routed row may be masked: the padded layout, where routed rows are batch positions)."""
        if self._expected is None:
            return
        actual = actual.reshape(-1)
        if actual.numel() != self._expected.numel():
            raise ReplayError(f"{self.where} runs {actual.numel()} token rows, the routes were laid out for "
                              f"{self._expected.numel()}")
        input_ids = actual if input_ids is None else input_ids
        expected, mask = self._expected_on(actual.device)
        am = attention_mask if isinstance(attention_mask, torch.Tensor) else None
        # the fewest device ops (each one a kernel launch on a GPU): ranges by one aminmax, decided by check()
        names, parts = [], []
        with torch.no_grad():
            if self.vocab_size is not None and input_ids.numel():
                names += ["id_lo", "id_hi"]
                parts += [t.to(torch.int64) for t in input_ids.aminmax()]
            differ = expected != actual
            if mask is not None:
                differ &= mask
            names.append("slipped")
            parts.append(differ.sum())
            if am is not None and am.dtype != torch.bool and am.numel():
                if am.is_floating_point() or am.is_complex():
                    names.append("nonbinary")
                    parts.append(((am != 0) & (am != 1)).sum().to(actual.device))
                else:
                    names += ["am_lo", "am_hi"]
                    parts += [t.to(device=actual.device, dtype=torch.int64) for t in am.aminmax()]
            if am is not None and masked_rows:
                unattended = (am.reshape(-1) == 0).to(actual.device)
                names.append("masked")
                parts.append((unattended if mask is None else unattended & mask).sum())
            counts = torch.stack(parts)
        kept = ((self._expected, self._mask, actual, input_ids, am, masked_rows)
                if len(self._pending) < self.MAX_KEPT else None)
        self._pending.append((self.forwards, counts, kept, tuple(names)))
        self.forwards += 1

    def discard_last(self) -> None:
        """Drop the latest forward's checks (that forward raised its error already)."""
        if self._pending:
            self._pending.pop()
            self.forwards -= 1

    def check(self) -> None:
        """Read the counters of every forward since :meth:`reset` (one host read per device) and raise the first
        forward's error: :class:`~moealign.errors.InputError` for token ids outside the vocabulary or a non-0/1
        attention mask, :class:`ReplayError` for routed rows holding other tokens or masked. Clears what it read."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        from ..errors import InputError

        by_device: dict[torch.device, list[int]] = {}
        for i, (_, counts, _, _) in enumerate(pending):
            by_device.setdefault(counts.device, []).append(i)
        values: list = [None] * len(pending)
        for indices in by_device.values():
            flat = torch.cat([pending[i][1] for i in indices]).tolist()
            at = 0
            for i in indices:
                n = pending[i][1].numel()
                values[i] = dict(zip(pending[i][3], flat[at:at + n]))
                at += n
        for (forward, _, kept, _), got in zip(pending, values):
            bad_ids = int("id_lo" in got and (got["id_lo"] < 0 or got["id_hi"] >= self.vocab_size))
            slipped = got["slipped"]
            nonbinary = got.get("nonbinary", 0) or int("am_lo" in got and (got["am_lo"] < 0 or got["am_hi"] > 1))
            masked = got.get("masked", 0)
            if not (bad_ids or slipped or nonbinary or masked):
                continue
            n = f" (forward {forward + 1} since the last check)" if len(pending) > 1 else ""
            if kept is None:
                raise ReplayError(f"{self.where}{n}: token ids outside the vocabulary: {'yes' if bad_ids else 'no'}, "
                                  f"{slipped} routed rows holding other tokens than the routes were laid out for, "
                                  f"attention-mask values other than 0/1: {'yes' if nonbinary else 'no'}, {masked} "
                                  f"routed rows masked")
            expected, mask, actual, input_ids, am, _ = kept
            if bad_ids:
                check_token_ids(input_ids, "input_ids", self.vocab_size, InputError)
            if nonbinary:
                check_binary_mask(am, "attention_mask", InputError)
            if slipped:
                check_row_tokens(expected, actual, mask, where=f"{self.where}{n}")
            if masked:
                am_rows = am.reshape(-1).cpu() == 0
                hit = (mask.cpu() if mask is not None else torch.ones_like(am_rows)) & am_rows
                raise ReplayError(f"{int(hit.sum())} routed rows are masked in the attention_mask the model "
                                  f"runs with (first row {int(hit.nonzero()[0, 0])}){n}: another padding side?")
            raise ReplayError(f"{self.where}{n}: the token check counted {bad_ids + slipped + nonbinary + masked} "
                              f"bad values that the host check does not see (were the tensors changed in place "
                              f"after the forward?)")


class DisagreementLog:
    """``aux_loss="warn"``: per replayed router call, the fraction of replayed rows whose own top-k differs from the
    replayed experts, kept as 0-d device tensors (no host sync in the forward) and read into floats by
    :meth:`values` (the adapters' ``aux_disagreement``, their ``check()`` and their undo), which also calls ``warn``
    (with the first non-zero rate) once per log."""

    def __init__(self, warn):
        self._warn = warn
        self._pending: list[torch.Tensor] = []
        self._values: list[float] = []
        self._warned = False

    def add(self, rate: torch.Tensor) -> None:
        self._pending.append(rate.detach().reshape(()).to(torch.float32))

    def values(self) -> list[float]:
        if self._pending:
            pending, self._pending = self._pending, []
            by_device: dict[torch.device, list[int]] = {}
            for i, t in enumerate(pending):
                by_device.setdefault(t.device, []).append(i)
            got: list = [0.0] * len(pending)
            for indices in by_device.values():
                for i, v in zip(indices, torch.stack([pending[i] for i in indices]).tolist()):
                    got[i] = v
            self._values.extend(got)
            first = next((r for r in got if r > 0), None)
            if first is not None and not self._warned:
                self._warned = True
                self._warn(first)
        return self._values


@dataclass
class _LayerCount:
    calls: int = 0
    rows: int = 0


@dataclass
class ReplayCounters:
    """Per-router counts of replayed calls and rows, and the one balance check every adapter uses."""

    layers: tuple[int, ...]
    counts: list[_LayerCount] = field(default_factory=list)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.counts = [_LayerCount() for _ in self.layers]

    def add(self, index: int, rows: int) -> None:
        self.counts[index].calls += 1
        self.counts[index].rows += int(rows)

    def check(self, calls: int, rows_per_call: int | None) -> None:
        """Raise :class:`ReplayError` unless every router ran ``calls`` replayed calls of ``rows_per_call`` rows."""
        if not isinstance(calls, int) or isinstance(calls, bool) or calls < 0:
            raise ConfigError(f"calls must be a non-negative int, got {calls!r}")
        want = None if rows_per_call is None else calls * rows_per_call
        bad = [(layer, c) for layer, c in zip(self.layers, self.counts)
               if c.calls != calls or (want is not None and c.rows != want)]
        if bad:
            detail = ", ".join(f"layer {layer}: {c.calls} calls, {c.rows} rows" for layer, c in bad)
            raise ReplayError(f"replay counters unbalanced (expected {calls} calls of {rows_per_call} rows per MoE "
                              f"layer): {detail}")


@runtime_checkable
class RoutingReplayAdapter(Protocol):
    """What ``hf.replay_routing(model)`` and ``megatron.replay_routing(model)`` return (and vLLM's, next)."""

    moe_layers: tuple[int, ...]
    aux_loss: str

    def set_routes(self, batch: ReplayBatch) -> None: ...

    def forward(self) -> AbstractContextManager: ...

    def backward(self) -> AbstractContextManager: ...

    def check(self, calls: int = 1) -> None: ...

    def clear(self) -> None: ...

    def undo(self) -> None: ...

    def __enter__(self): ...

    def __exit__(self, *exc) -> None: ...

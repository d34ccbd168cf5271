"""Replay verification: did the experts that ran equal the experts the record asked for?

Routing replay forces each router to recorded expert ids, and the most common failure is that it silently does
nothing: a router forward swapped after the replay bound it, a wrapper that calls the original router, a kernel
path that routes on its own. Counting what the *adapter set* cannot see any of that. A :class:`ReplayVerifier`
is fed, per router and per forward, what the expert dispatcher (or the experts module) actually *received*, and
compares it with the record:

* ``ran``: the expert ids the experts received, ``[rows, k]`` (transformers' ``top_k_index``, vLLM's
  ``topk_ids``), or a boolean routing map ``[rows, num_experts]`` (Megatron's ``routing_map``);
* ``expected``: the recorded ids ``[rows, k]``, their set keys ``[rows]`` (:func:`expected_ids` with the number of
  experts: one int64 bit mask per row), or the recorded map, in the same row order;
* ``replayed_mask``: bool ``[rows]``, the rows that carry a recorded route (``ReplayBatch.route_mask`` in the
  engine's row order). The other rows (padding, filler, each sample's last token, rows the record marks missing)
  ran without a recorded route: they are counted (:attr:`VerifyReport.unrouted_fraction`), never compared.

Slot order is not part of a route: expert *sets* are compared (both sides sorted, or both as bit masks
``sum(1 << id)``, which equal exactly when the ``k`` ids that ran are the ``k`` distinct recorded ones: a sum of
``k`` powers of two has ``k`` bits set only when they are distinct; a routing map is a set).

Cheap enough to leave on in training: :meth:`ReplayVerifier.observe` only queues a handful of tensor operations on
the device of the ids (bit mask or sort, compare, masked count, the first bad row as a running minimum) into
per-router device counters; it never reads a value back to the host. :meth:`ReplayVerifier.defer` queues the call
instead and compares the calls of one forward (one per router, same rows) in one batched pass: the same counts for
about one router's kernel launches instead of one set per router (on a GPU a replayed step is launch-bound at
small batch: 8 routers cost 114 launches per step that way, about 3 ms on an H100). Counts that follow from shapes (calls, rows) and replayed-row
counts the caller already knows are plain ints. The device counters are read once, when :meth:`ReplayVerifier.report`
or :meth:`ReplayVerifier.check` is called.

Pure torch: no engine import. The engine adapters (``moealign.patches.hf.replay``, ``.megatron.replay``,
``.vllm.replay``) feed it and expose ``verify_report()``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from ..errors import ConfigError, ReplayError

__all__ = ["LayerVerifyReport", "ReplayVerifier", "VerifyReport", "expected_ids", "expected_map"]

_BIG = 1 << 62          # "no bad row" in the running minimum
_CALL_SHIFT = 32        # first bad (call, row) packed as call << 32 | row
_KEY_EXPERTS = 62       # set keys (int64 bit masks) for expert ids 0 .. 62 (sentinel id num_experts included)


def _set_keys(ids: torch.Tensor) -> torch.Tensor:
    """``sum(1 << id)`` per row, int64 (out-of-range ids contribute 0 or the sign bit: never a valid key)."""
    return torch.bitwise_left_shift(1, ids.to(torch.int64)).sum(-1)


def expected_ids(ids: torch.Tensor, num_experts: int | None = None) -> torch.Tensor:
    """The recorded ids ``[rows, k]`` (distinct per row) prepared once per ``set_routes`` for
    :meth:`ReplayVerifier.observe`: with ``num_experts <= 62`` their set keys (int64 ``[rows]``, one bit per expert:
    the cheap comparison), else each row sorted (int64 ``[rows, k]``, pass ``expected_sorted=True``). Any leading
    dims: every router's table ``[routers, rows, k]`` at once gives ``[routers, rows]`` (two ops for all routers;
    its rows, handed to :meth:`ReplayVerifier.defer` in order, are compared in place, without a stack)."""
    if num_experts is not None and int(num_experts) <= _KEY_EXPERTS:
        return _set_keys(ids).contiguous()
    return ids.to(torch.int64).sort(-1).values.contiguous()


def _bad_rows(ran: torch.Tensor, expected: torch.Tensor, replayed_mask: torch.Tensor | None, is_map: bool,
              keys: bool, expected_sorted: bool) -> torch.Tensor:
    """Bool ``[..., rows]``: replayed rows whose experts that ran differ from the record (as sets); any leading
    dims (one router's call, or a stack of routers' calls with the same rows)."""
    if keys:
        bad = _set_keys(ran) != expected
    else:
        if is_map:
            differ = ran != expected
        else:
            ran_sets = ran.sort(-1).values if ran.shape[-1] > 1 else ran
            expected_sets = expected if expected_sorted or expected.shape[-1] == 1 else expected.sort(-1).values
            differ = ran_sets != expected_sets
        bad = differ.any(-1)
    if replayed_mask is not None:
        bad.logical_and_(replayed_mask)
    return bad


def expected_map(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The recorded ids ``[rows, k]`` as a boolean routing map ``[rows, num_experts]`` (Megatron's form); any leading
    dims (every router's ``[routers, rows, k]`` at once: ``[routers, rows, num_experts]``)."""
    ids = ids.to(torch.int64)
    return torch.zeros(*ids.shape[:-1], int(num_experts), dtype=torch.bool, device=ids.device).scatter_(-1, ids, True)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``, as a view (no copy, no kernel) when they are the consecutive slices of one contiguous
    block (the adapters' ``[routers, rows, ...]`` tables, set once per ``set_routes``)."""
    t0 = tensors[0]
    if t0.is_contiguous() and t0.numel():
        ptr, off, n = t0.untyped_storage().data_ptr(), t0.storage_offset(), t0.numel()
        if all(t.is_contiguous() and t.shape == t0.shape and t.dtype == t0.dtype and t.device == t0.device
               and t.storage_offset() == off + j * n and t.untyped_storage().data_ptr() == ptr
               for j, t in enumerate(tensors)):
            return t0.as_strided((len(tensors), *t0.shape), (n, *t0.stride()), off)
    return torch.stack(tensors)


@dataclass(frozen=True)
class LayerVerifyReport:
    """One router's counts since the last reset.

    ``calls``: experts (dispatcher) calls observed; ``rows``: rows they received; ``replayed_rows``: rows with a
    recorded route; ``mismatched_rows``: replayed rows whose experts that ran differ from the record (as sets);
    ``unrouted_rows``: rows that ran without a recorded route (``rows - replayed_rows``); ``first_mismatch``:
    ``(call, row)`` of the first mismatched row (call counted from the reset, row in the engine's row order), or
    None; ``first_ran`` / ``first_expected``: the expert sets at that row when it is still known (it is kept for
    the latest call only), else None.
    """

    layer: int
    calls: int
    rows: int
    replayed_rows: int
    mismatched_rows: int
    unrouted_rows: int
    first_mismatch: tuple[int, int] | None = None
    first_ran: tuple[int, ...] | None = None
    first_expected: tuple[int, ...] | None = None

    @property
    def unrouted_fraction(self) -> float:
        return self.unrouted_rows / self.rows if self.rows else 0.0


@dataclass(frozen=True)
class VerifyReport:
    """What :meth:`ReplayVerifier.report` returns: one :class:`LayerVerifyReport` per router (the adapter's layer
    order) and the totals over them."""

    layers: tuple[LayerVerifyReport, ...]
    source: str = "the experts"

    @property
    def calls(self) -> int:
        return sum(x.calls for x in self.layers)

    @property
    def rows(self) -> int:
        return sum(x.rows for x in self.layers)

    @property
    def replayed_rows(self) -> int:
        return sum(x.replayed_rows for x in self.layers)

    @property
    def mismatched_rows(self) -> int:
        return sum(x.mismatched_rows for x in self.layers)

    @property
    def unrouted_rows(self) -> int:
        return sum(x.unrouted_rows for x in self.layers)

    @property
    def unrouted_fraction(self) -> float:
        """Rows that ran without a recorded route / rows the experts received (over every router and call)."""
        return self.unrouted_rows / self.rows if self.rows else 0.0

    @property
    def mismatch_fraction(self) -> float:
        """Mismatched rows / replayed rows."""
        return self.mismatched_rows / self.replayed_rows if self.replayed_rows else 0.0

    @property
    def clean(self) -> bool:
        """No replayed row ran other experts than recorded (says nothing about routers never observed)."""
        return self.mismatched_rows == 0

    def layer(self, layer: int) -> LayerVerifyReport:
        for x in self.layers:
            if x.layer == layer:
                return x
        raise ConfigError(f"no router of layer {layer} in this report (layers {[x.layer for x in self.layers]})")

    def to_dict(self) -> dict:
        """Plain numbers (JSON-ready): per layer and totals."""
        return {"source": self.source, "calls": self.calls, "rows": self.rows, "replayed_rows": self.replayed_rows,
                "mismatched_rows": self.mismatched_rows, "unrouted_rows": self.unrouted_rows,
                "unrouted_fraction": self.unrouted_fraction, "mismatch_fraction": self.mismatch_fraction,
                "layers": [asdict(x) for x in self.layers]}

    def check(self, router_calls: Sequence[int] | None = None) -> "VerifyReport":
        """Raise :class:`~moealign.errors.ReplayError` when the experts that ran differ from the record on any
        replayed row (naming the layers, the counts and the first bad row), or when a router replayed rows on more
        calls than its experts were observed (``router_calls``: per router, the calls that replayed rows, as the
        adapter counted them; a router replayed but its experts never seen cannot be verified). Returns ``self``."""
        bad = [x for x in self.layers if x.mismatched_rows]
        if bad:
            parts = []
            for x in bad:
                where = ""
                if x.first_mismatch is not None:
                    where = f" (first: call {x.first_mismatch[0]}, row {x.first_mismatch[1]}"
                    if x.first_ran is not None:
                        where += f": ran {list(x.first_ran)}, record {list(x.first_expected)}"
                    where += ")"
                parts.append(f"layer {x.layer}: {x.mismatched_rows} of {x.replayed_rows} rows{where}")
            raise ReplayError(f"routing replay did not apply: the experts that ran (read from {self.source}) differ "
                              f"from the record on {self.mismatched_rows} of {self.replayed_rows} replayed rows "
                              f"in layers {[x.layer for x in bad]}: " + "; ".join(parts))
        if router_calls is not None:
            if len(router_calls) != len(self.layers):
                raise ConfigError(f"router_calls has {len(router_calls)} entries for {len(self.layers)} routers")
            unseen = [(x, int(c)) for x, c in zip(self.layers, router_calls) if int(c) > x.calls]
            if unseen:
                detail = ", ".join(f"layer {x.layer}: {x.calls} of {c}" for x, c in unseen)
                raise ReplayError(f"routing replay cannot be verified: {self.source} of layers "
                                  f"{[x.layer for x, _ in unseen]} were observed on fewer calls than their routers "
                                  f"replayed rows ({detail}): the experts module or dispatcher was replaced or "
                                  f"bypassed after the replay was attached")
        return self

    def __str__(self) -> str:
        state = "clean" if self.clean else f"{self.mismatched_rows} of {self.replayed_rows} replayed rows MISMATCHED"
        return (f"replay verify ({self.source}): {state}; {len(self.layers)} routers, {self.calls} calls, "
                f"{self.rows} rows, unrouted fraction {self.unrouted_fraction:.4f}")


class ReplayVerifier:
    """Per-router device counters of what the experts ran against what the record asked for (module docstring).

    ``layers``: the decoder layer of each router (index ``i`` of :meth:`observe` is ``layers[i]``); ``source``
    names what is read, for messages (e.g. ``"Qwen3MoeExperts' top_k_index"``).
    """

    def __init__(self, layers: Sequence[int], *, source: str = "the experts"):
        self.layers = tuple(int(x) for x in layers)
        if not self.layers:
            raise ConfigError("a ReplayVerifier needs at least one router layer")
        self.source = source
        self._aranges: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.reset()

    # ------------------------------------------------------------------ counting
    def reset(self) -> None:
        """Zero every counter (device counters in place: no host sync)."""
        n = len(self.layers)
        self._calls = [0] * n
        self._rows = [0] * n
        self._replayed_host = [0] * n
        self._last: list[tuple | None] = [None] * n
        self._pending: list[tuple | None] = [None] * n          # deferred calls, not yet compared (dropped here)
        self._queued = 0                                          # how many entries of _pending are set
        if getattr(self, "_dev", None) is None:
            # per layer, on that layer's device: [replayed rows counted from a mask, mismatched rows, first bad code];
            # a row of the device's block [n, 3] (self._blocks) unless the layer moved device
            self._dev: list[torch.Tensor | None] = [None] * n
            self._views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * n
            self._blocks: dict[torch.device, torch.Tensor] = {}
            self._in_block: list[bool] = [False] * n
        for block in self._blocks.values():
            block[:, :2].zero_()
            block[:, 2].fill_(_BIG)
        for t, in_block in zip(self._dev, self._in_block):
            if t is not None and not in_block:
                t[:2].zero_()
                t[2].fill_(_BIG)

    def _counters(self, index: int, device: torch.device):
        views = self._views[index]
        if views is None or self._dev[index].device != device:
            if self._dev[index] is None:                  # first call: the layer's row of the device's block
                block = self._blocks.get(device)
                if block is None:
                    block = self._blocks[device] = torch.tensor([[0, 0, _BIG]] * len(self.layers),
                                                                dtype=torch.int64, device=device)
                t, self._in_block[index] = block[index], True
            else:                                         # a layer that moved device: carry its counts over
                t = torch.tensor([0, 0, _BIG], dtype=torch.int64, device=device)
                t.copy_(self._dev[index].to(device))
                self._in_block[index] = False
            self._dev[index] = t
            views = self._views[index] = (t[0], t[1], t[2])
        return views

    def _arange(self, rows: int, device: torch.device) -> torch.Tensor:
        key = (rows, device)
        ar = self._aranges.get(key)
        if ar is None:
            if len(self._aranges) > 64:
                self._aranges.clear()
            ar = self._aranges[key] = torch.arange(rows, dtype=torch.int64, device=device)
        return ar

    def observe(self, index: int, ran: torch.Tensor, expected: torch.Tensor,
                replayed_mask: torch.Tensor | None = None, *, replayed_rows: int | None = None,
                expected_sorted: bool = False) -> None:
        """Count one call of router ``index``'s experts.

        ``ran``: the expert ids the experts received ``[rows, k]`` (any integer dtype), or a bool routing map
        ``[rows, num_experts]``; ``expected``: the recorded ids ``[rows, k]`` (sorted per row when
        ``expected_sorted``), their set keys ``[rows]`` (see :func:`expected_ids`), or the recorded map
        (:func:`expected_map`), same rows;
        ``replayed_mask``: bool ``[rows]`` (None: every row replayed); ``replayed_rows``: its number of True
        rows when the caller knows it (else it is counted on the device). Shapes are checked here (a
        :class:`~moealign.errors.ReplayError` at once: they are known on the host); values only on the device.
        """
        self.flush()
        is_map, keys = self._check_call(index, ran, expected, replayed_mask)
        call, replayed_dev, mismatched, first = self._book(index, ran, expected, replayed_mask, replayed_rows,
                                                           is_map, keys)
        if ran.shape[0] == 0 or replayed_rows == 0:   # nothing replayed in this call: nothing to compare
            return
        with torch.no_grad():
            if replayed_dev is not None:
                replayed_dev.add_(replayed_mask.sum())
            bad = _bad_rows(ran, expected, replayed_mask, is_map, keys, expected_sorted)
            mismatched.add_(bad.sum())
            row = torch.where(bad, self._arange(ran.shape[0], ran.device), _BIG).amin()
            torch.minimum(first, row.add_(call << _CALL_SHIFT), out=first)

    def defer(self, index: int, ran: torch.Tensor, expected: torch.Tensor,
              replayed_mask: torch.Tensor | None = None, *, replayed_rows: int | None = None,
              expected_sorted: bool = False) -> None:
        """:meth:`observe`, queued: shapes are checked now, the comparison runs at the next :meth:`flush`, with the
        other routers' queued calls in one batched pass when they match (one call per router, the same rows,
        dtypes, device and mask, ids, set keys or routing maps, the replayed rows known). Flushed when every router
        has a call queued (the end of a forward), before a router's second call, and by :meth:`report` /
        :meth:`check`.
        ``ran`` is held until then: an engine must not write into it after handing it to the experts (none of
        the supported ones does; the ids are only read)."""
        self._check_call(index, ran, expected, replayed_mask)
        if self._pending[index] is not None:
            self.flush()
        self._pending[index] = (ran, expected, replayed_mask, replayed_rows, expected_sorted)
        self._queued += 1
        if self._queued == len(self.layers):
            self.flush()

    def flush(self) -> None:
        """Compare the deferred calls (:meth:`defer`); no host sync."""
        if not self._queued:                          # observe()'s path: nothing queued, nothing to scan
            return
        pending = [(i, p) for i, p in enumerate(self._pending) if p is not None]
        self._pending = [None] * len(self.layers)
        self._queued = 0
        first_i, (ran0, exp0, mask0, rows0, sorted0) = pending[0]
        device = ran0.device
        indices = [i for i, _ in pending]
        for i, p in pending:
            self._counters(i, p[0].device)
        batched = (len(pending) > 1 and indices == list(range(indices[0], indices[-1] + 1))
                   and (mask0 is None or rows0 is not None)
                   and all(self._in_block[i] and self._dev[i].device == device for i in indices)
                   and len({self._calls[i] for i in indices}) == 1
                   and all(r.shape == ran0.shape and r.dtype == ran0.dtype and r.device == device
                           and e.shape == exp0.shape and e.dtype == exp0.dtype and e.device == exp0.device
                           and m is mask0 and n == rows0 and s_ == sorted0 for _, (r, e, m, n, s_) in pending))
        if not batched:
            for i, (ran, expected, mask, rows, srt) in pending:
                self.observe(i, ran, expected, mask, replayed_rows=rows, expected_sorted=srt)
            return
        keys, is_map = exp0.dim() == 1, ran0.dtype == torch.bool
        call = self._calls[first_i]
        for i, (ran, expected, mask, rows, _) in pending:
            self._book(i, ran, expected, mask, rows, is_map, keys)
        if ran0.shape[0] == 0 or rows0 == 0:
            return
        lo, hi = indices[0], indices[-1] + 1
        block = self._blocks[device]
        with torch.no_grad():
            bad = _bad_rows(_stacked([p[0] for _, p in pending]), _stacked([p[1] for _, p in pending]),
                            mask0, is_map, keys, sorted0)                                   # [routers, rows]
            block[lo:hi, 1].add_(bad.sum(-1))
            row = torch.where(bad, self._arange(ran0.shape[0], device), _BIG).amin(-1).add_(call << _CALL_SHIFT)
            torch.minimum(block[lo:hi, 2], row, out=block[lo:hi, 2])

    def _check_call(self, index: int, ran: torch.Tensor, expected: torch.Tensor,
                    replayed_mask: torch.Tensor | None) -> tuple[bool, bool]:
        """The shape checks of one call (known on the host: a :class:`ReplayError` at once); ``(is_map, keys)``."""
        layer = self.layers[index]
        if ran.dim() != 2 or expected.dim() not in (1, 2) or ran.shape[0] != expected.shape[0]:
            raise ReplayError(f"layer {layer}: {self.source} received {tuple(ran.shape)}, the record has "
                              f"{tuple(expected.shape)} for this call (rows must match one to one)")
        is_map = ran.dtype == torch.bool
        keys = expected.dim() == 1
        if is_map != (expected.dtype == torch.bool) or (is_map and keys) or (
                not keys and ran.shape[1] != expected.shape[1]):
            raise ReplayError(f"layer {layer}: {self.source} received {tuple(ran.shape)} {ran.dtype}, the record "
                              f"{tuple(expected.shape)} {expected.dtype} ({'expert ids' if not is_map else 'a map'} "
                              f"per row on both sides, the same k)")
        rows = int(ran.shape[0])
        if replayed_mask is not None and tuple(replayed_mask.shape) != (rows,):
            raise ReplayError(f"layer {layer}: replayed_mask {tuple(replayed_mask.shape)} for {rows} rows")
        return is_map, keys

    def _book(self, index: int, ran, expected, replayed_mask, replayed_rows, is_map: bool, keys: bool):
        """The host-side counts of one call; ``(call, replayed counter to add the mask's count to or None,
        mismatched counter, first-bad counter)``."""
        rows = int(ran.shape[0])
        call = self._calls[index]
        self._calls[index] = call + 1
        self._rows[index] += rows
        replayed_dev, mismatched, first = self._counters(index, ran.device)
        if replayed_mask is None:
            self._replayed_host[index] += rows
            replayed_dev = None
        elif replayed_rows is not None:
            self._replayed_host[index] += int(replayed_rows)
            replayed_dev = None
        self._last[index] = (call, ran, expected, is_map, keys)
        return call, replayed_dev, mismatched, first

    # ------------------------------------------------------------------ reading
    def report(self) -> VerifyReport:
        """The counts since the last :meth:`reset` (reads the device counters: one host sync per device)."""
        self.flush()
        values: list[list[int]] = [[0, 0, _BIG] for _ in self.layers]
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(self._dev):
            if t is not None:
                by_device.setdefault(t.device, []).append(i)
        for device, indices in by_device.items():
            got = torch.stack([self._dev[i] for i in indices]).tolist()
            for i, v in zip(indices, got):
                values[i] = v
        out = []
        for i, layer in enumerate(self.layers):
            replayed = self._replayed_host[i] + int(values[i][0])
            code = int(values[i][2])
            first = ran_set = expected_set = None
            if int(values[i][1]) > 0 and code < _BIG:
                first = (code >> _CALL_SHIFT, code & ((1 << _CALL_SHIFT) - 1))
                ran_set, expected_set = self._sets_at(i, *first)
            out.append(LayerVerifyReport(layer=layer, calls=self._calls[i], rows=self._rows[i],
                                         replayed_rows=replayed, mismatched_rows=int(values[i][1]),
                                         unrouted_rows=self._rows[i] - replayed, first_mismatch=first,
                                         first_ran=ran_set, first_expected=expected_set))
        return VerifyReport(tuple(out), self.source)

    def _sets_at(self, index: int, call: int, row: int):
        last = self._last[index]
        if last is None or last[0] != call:
            return None, None
        _, ran, expected, is_map, keys = last
        if row >= ran.shape[0]:
            return None, None

        def as_set(x: torch.Tensor) -> tuple[int, ...]:
            x = x[row].detach().cpu()
            if x.dim() == 0:               # a set key: its bits
                key = int(x)
                return tuple(e for e in range(_KEY_EXPERTS + 1) if key >> e & 1)
            return tuple(int(e) for e in (x.nonzero().flatten() if is_map else x.to(torch.int64).sort().values))
        return as_set(ran), as_set(expected)

    def check(self, router_calls: Sequence[int] | None = None) -> VerifyReport:
        """:meth:`report`, then :meth:`VerifyReport.check` (a :class:`~moealign.errors.ReplayError` when the experts
        that ran differ from the record, or when ``router_calls`` exceed the calls observed); the report when clean."""
        return self.report().check(router_calls)

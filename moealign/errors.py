"""Every error moealign raises, in one place. They all derive from :class:`MoealignError`.

Each class keeps the built-in exception it replaces as a second base (``RouteError`` is a ``ValueError``,
``UnsupportedEngineError`` a ``RuntimeError``), so code written against the built-ins keeps working, and
``except MoealignError`` catches everything the package raises on purpose (the ``moealign`` command does
exactly that: one line on stderr, exit code 2).

=============================  =====================  =========================================================
class                          built-in base          raised for
=============================  =====================  =========================================================
ConfigError                    ValueError             an option, mode, threshold, policy or argument value
InputError                     ValueError             malformed data: shapes, NaN/Inf, empty rows, bad ids
InputTypeError                 TypeError              an argument of the wrong type
EngineError                    RuntimeError           an engine or process in a state the call cannot use
EngineTimeoutError             TimeoutError           worker processes that did not finish
UnsupportedEngineError         RuntimeError           an engine version or layout an adapter was not written for
UnsupportedModelError          (UnsupportedEngine)    a model family / layout an adapter does not know
UnsupportedConversionError     (+ ValueError)         a checkpoint the transformers <-> Megatron converter refuses
CheckpointMismatchError        ValueError             state-dict keys or shapes that do not match
ReplayError                    RuntimeError           routing replay would not apply exactly as asked
RouteError                     (Replay) + ValueError  a malformed route table or layout
ReplayConfigError              (Replay) + ValueError  an engine config in which replay would silently not apply
RefitError                     RuntimeError           a weight refit that skipped or mangled a tensor, or cannot be exact
RecordError                    ValueError             a malformed rollout record
RecordFormatError              (Record)               a record file that cannot be read as one
RecordMismatchError            (Record)               a record of another model than the one it meets
PrecisionAuditError            AssertionError         a live model that does not follow its precision policy
UnknownPolicyError             KeyError               a precision policy name nobody registered
BatchInvariantError            ValueError             inputs the batch-invariant ops cannot take
TreeReductionError             ValueError             inputs the TP-invariant tree reductions cannot take
CanonicalError                 ValueError             a model, engine op or setting the canonical forward does not cover
MissingFileError               FileNotFoundError      a file the call needs is not there
MissingDependencyError         ImportError            an optional dependency that does not import
=============================  =====================  =========================================================

Warnings (``warnings.warn``) are :class:`MoealignWarning`, a ``UserWarning``: something the call accepted for
compatibility (verl / slime parity) but that a user should know about, such as an option that has no effect.
"""

from __future__ import annotations

__all__ = [
    "MoealignError",
    "ConfigError",
    "InputError",
    "InputTypeError",
    "EngineError",
    "EngineTimeoutError",
    "UnsupportedEngineError",
    "UnsupportedModelError",
    "UnsupportedConversionError",
    "CheckpointMismatchError",
    "ReplayError",
    "RouteError",
    "ReplayConfigError",
    "RecordError",
    "RecordFormatError",
    "RecordMismatchError",
    "PrecisionAuditError",
    "UnknownPolicyError",
    "BatchInvariantError",
    "TreeReductionError",
    "CanonicalError",
    "MissingFileError",
    "RefitError",
    "MissingDependencyError",
    "MoealignWarning",
]


class MoealignError(Exception):
    """Base of every error moealign raises on purpose."""


class ConfigError(MoealignError, ValueError):
    """An option, mode, threshold, policy or argument value that is not valid."""


class InputError(MoealignError, ValueError):
    """Malformed input data: mismatched shapes, NaN/Inf, empty rows, out-of-range ids."""


class InputTypeError(MoealignError, TypeError):
    """An argument of the wrong type."""


class EngineError(MoealignError, RuntimeError):
    """An engine, process group or worker in a state the call cannot use."""


class EngineTimeoutError(MoealignError, TimeoutError):
    """Worker processes that did not finish in time."""


class UnsupportedEngineError(MoealignError, RuntimeError):
    """The installed engine version (or its layout) is outside what an adapter supports; nothing was patched."""


class UnsupportedModelError(UnsupportedEngineError):
    """The model is not a family an adapter knows (or its routers are not where expected)."""


class UnsupportedConversionError(UnsupportedModelError, ValueError):
    """A checkpoint feature the transformers <-> Megatron converter cannot express."""


class CheckpointMismatchError(MoealignError, ValueError):
    """State-dict keys or shapes that do not match the model they are loaded into."""


class ReplayError(MoealignError, RuntimeError):
    """Routing replay would not apply exactly as asked: rows missing or extra, a router that did not consume its
    targets, a batch that is not the one the routes were laid out for. The one error of the replay protocol."""


class RouteError(ReplayError, ValueError):
    """A malformed route table (shape, ids out of range, duplicates) or route layout."""


class ReplayConfigError(ReplayError, ValueError):
    """An engine configuration in which routing replay would silently not apply, or apply wrongly."""


class RefitError(MoealignError, RuntimeError):
    """A weight refit into a running rollout engine that did not (or would not) leave the engine holding exactly the
    trainer's weights: a tensor skipped or mangled (named with the worker), another architecture, an engine whose
    reload path moealign does not know."""


class RecordError(MoealignError, ValueError):
    """A rollout record that is malformed."""


class RecordFormatError(RecordError):
    """A record file that cannot be read as a record (corrupt, truncated, other format)."""


class RecordMismatchError(RecordError):
    """A record produced by another model (or engine layout) than the one it is used with."""


class PrecisionAuditError(MoealignError, AssertionError):
    """A live model that does not follow its precision policy; ``.deviations`` lists each deviation as a line."""

    def __init__(self, policy_name: str, deviations: list[str]):
        self.policy_name = policy_name
        self.deviations = list(deviations)
        lines = "\n".join(f"  - {d}" for d in self.deviations)
        super().__init__(f"model deviates from precision policy {policy_name!r} in {len(self.deviations)} "
                         f"place(s):\n{lines}")


class UnknownPolicyError(MoealignError, KeyError):
    """A precision policy name that is not registered."""

    def __str__(self) -> str:   # KeyError quotes its argument; the message reads better plain
        return str(self.args[0]) if self.args else ""


class BatchInvariantError(MoealignError, ValueError):
    """Inputs the batch-invariant ops cannot take (they never silently fall back to the stock op)."""


class TreeReductionError(MoealignError, ValueError):
    """Inputs the TP-invariant tree reductions cannot take."""


class CanonicalError(MoealignError, ValueError):
    """A model, engine op or setting the canonical forward (``--aligned``) does not cover: refused at setup,
    naming it, never a silently partial alignment."""


class MissingFileError(MoealignError, FileNotFoundError):
    """A file the call needs is not there."""


class MissingDependencyError(MoealignError, ImportError):
    """An optional dependency (an engine, safetensors, ...) that does not import; the message says what for."""


class MoealignWarning(UserWarning):
    """A call that was accepted (verl / slime parity, a compatible spelling) but does something a user should
    know about: an option without effect, an unrecognised flag that looks like one of ours."""

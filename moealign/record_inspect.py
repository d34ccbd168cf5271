"""Deprecated: moved to :mod:`moealign.record.inspect` (this path goes in the next release); the router check that
runs a checkpoint (``router_check``, ``ROUTER_BATCH``) moved to :mod:`moealign.mismatch.router_check`."""

from ._deprecated import moved_module
from .mismatch.router_check import ROUTER_BATCH, router_check
from .record import inspect as _new

moved_module(globals(), _new)
__all__ += ["ROUTER_BATCH", "router_check"]  # noqa: F821 (bound by moved_module)

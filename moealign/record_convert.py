"""Deprecated: moved to :mod:`moealign.record.convert` (this path goes in the next release)."""

from ._deprecated import moved_module
from .record import convert as _new

moved_module(globals(), _new)

"""Deprecated: moved to :mod:`moealign.record.stitch` (this path goes in the next release)."""

from ._deprecated import moved_module
from .record import stitch as _new

moved_module(globals(), _new)

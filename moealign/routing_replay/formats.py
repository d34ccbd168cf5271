"""Deprecated: moved to :mod:`moealign.record.formats` (this path goes in the next release)."""

from .._deprecated import moved_module
from ..record import formats as _new

moved_module(globals(), _new)

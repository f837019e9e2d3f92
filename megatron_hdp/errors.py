"""Errors the training job reports to the user as one line (pure)."""

from __future__ import annotations


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or parameter is NaN or infinite; raised on every rank together.

    The update or checkpoint that would have used the non-finite values was not applied or
    written, so the latest checkpoint stays the last good one.
    """

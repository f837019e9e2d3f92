"""Errors the training job reports to the user as one line (pure)."""

from __future__ import annotations


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or parameter is NaN or infinite; raised on every rank together.

    The update or checkpoint that would have used the non-finite values was not applied or
    written, so the latest checkpoint stays the last good one.
    """


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a refused folder).

    Raised on every rank together, with the same message naming the rank and the cause.
    Nothing of the failed save became the latest checkpoint: the tracker still names the
    last complete one.
    """

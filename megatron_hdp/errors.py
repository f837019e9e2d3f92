"""Errors the training job reports to the user as one line (pure)."""

from __future__ import annotations


def one_message(problems: list[str]) -> str:
    """Every refusal of one launch in one line: the one, or `N problems: (1) ...; (2) ...`.

    Both entry points report their start-up refusals so (`pretrain_hdp.py`'s
    `validation.validate_args`, the drop-in's `megatron_lm.args.check_args`), so that a
    launch is fixed in one round.
    """
    if len(problems) == 1:
        return problems[0]
    listed = "; ".join(f"({n}) {p}" for n, p in enumerate(problems, start=1))
    return f"{len(problems)} problems with this launch: {listed}"


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


class DataServiceError(RuntimeError):
    """The Ray data service failed (planner actor died, cluster gone, no answer in time).

    The message names what failed. Training stops at a step boundary; checkpoints written
    so far are intact and a resume from the latest one is exact.
    """


class JobStoppedError(RuntimeError):
    """Another rank stopped the job; the message is the note it left (its rank and cause)."""


class OutputWriteError(RuntimeError):
    """A run output (the metrics file, a step timeline) could not be written.

    The message names the file and the reason (a full disk, a folder that went away).
    """

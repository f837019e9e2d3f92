"""What a resume and a `--save` folder are checked for before start-up (pure: small JSON only).

- `check_schedule`: a resume whose learning-rate or weight-decay schedule differs from the
  checkpoint's is refused by flag name unless `--override-opt_param-scheduler` (use the new
  flags) or `--use-checkpoint-opt_param-scheduler` (keep the checkpoint's) is given, as
  Megatron-LM does; a checkpoint at or past `--train-iters` ends the job (`NothingToTrain`).
- `check_save_folder`: a `--save` folder belongs to one run. A run may write into it only
  when it resumes from it, resumes the same run from a copy that is not behind it, or is
  told to discard what is there (`--hdp-overwrite-checkpoints`); so a checkpoint folder is
  never overwritten by another run and its tracker never moves backwards.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from megatron_hdp.checkpoint_files import TRACKER, read_meta
from megatron_hdp.megatron.arguments import schedule_steps


class NothingToTrain(Exception):  # noqa: N818 - an outcome, not an error
    """The checkpoint to resume is already at or past `--train-iters`.

    Attributes:
        exit_code: 0 when the checkpoint is exactly at `--train-iters` (the job is done, e.g.
            a requeued job that had finished), 2 when it is past it (the flags are wrong).
    """

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


#: Scheduler state keys (Megatron-Core's `OptimizerParamScheduler.state_dict`) and the flags
#: that set them.
SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters (default: --train-iters)",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
    "end_wd": "--weight-decay",
    "wd_incr_steps": "(weight-decay schedule)",
    "wd_incr_style": "(weight-decay schedule)",
}


def schedule_of(args: argparse.Namespace) -> dict:
    """The scheduler settings these flags give (`OptimizerParamScheduler.state_dict` keys).

    Must agree with `engine.build_engine` for `config.optim_config(args)`; a test holds the
    two together.
    """
    return {
        "max_lr": args.lr,
        "min_lr": args.min_lr,
        "lr_warmup_steps": schedule_steps(args)[0],
        "lr_decay_steps": schedule_steps(args)[1],
        "lr_decay_style": args.lr_decay_style,
        "start_wd": args.weight_decay,
        "end_wd": args.weight_decay,
        "wd_incr_steps": 1,
        "wd_incr_style": "constant",
    }


def check_schedule(args: argparse.Namespace, meta: dict, flag: Callable[[str], str]) -> None:
    """Raise if resuming `meta`'s checkpoint with `args` would silently change or end training.

    Raises:
        NothingToTrain: The checkpoint's iteration is at or past `--train-iters`.
        ValueError: The schedule differs and neither scheduler flag says which to use.
    """
    iteration = meta["iteration"]
    if iteration >= args.train_iters:
        done = iteration == args.train_iters
        raise NothingToTrain(
            f"--load {args.load}: the checkpoint is at iteration {iteration} and --train-iters "
            f"is {args.train_iters}: "
            + (
                "training is complete, nothing to do"
                if done
                else "nothing to train; raise --train-iters to continue (with "
                "--override-opt_param-scheduler if the schedule should follow it)"
            ),
            exit_code=0 if done else 2,
        )
    saved = meta.get("schedule")
    if saved is None or args.override_opt_param_scheduler:
        return
    mine = schedule_of(args)
    changed = [key for key in mine if key in saved and saved[key] != mine[key]]
    if mine["lr_decay_style"] == saved.get("lr_decay_style") == "constant":
        changed = [key for key in changed if key != "lr_decay_steps"]  # no effect when constant
    if not changed or args.use_checkpoint_opt_param_scheduler:
        return
    detail = "; ".join(
        f"{SCHEDULE_FLAGS[key]} {mine[key]} (checkpoint: {saved[key]})" for key in changed
    )
    raise ValueError(
        f"--load {args.load}: the learning-rate schedule differs from the checkpoint's: "
        f"{detail}. Give {flag('override_opt_param_scheduler')} to use the new values or "
        f"{flag('use_checkpoint_opt_param_scheduler')} to keep the checkpoint's"
    )


def scheduler_override(args: argparse.Namespace, meta: dict | None) -> bool:
    """Whether the resumed scheduler takes these flags' values (Megatron's override).

    True with `--override-opt_param-scheduler`, and also after `check_schedule` passed
    without either flag: every difference that matters was refused there, and what is left
    (the decay length of a constant schedule) has no effect, but Megatron's own check at
    load time would still reject it.
    """
    if args.override_opt_param_scheduler:
        return True
    checked = meta is not None and "schedule" in meta
    return checked and not args.use_checkpoint_opt_param_scheduler


def holds_checkpoints(root: str | Path) -> bool:
    """True if `root` holds a tracker file or any complete `iter_*` folder."""
    root = Path(root)
    if not root.is_dir():
        return False
    if (root / TRACKER).exists():
        return True
    return any(p.is_dir() and not p.name.endswith(".partial") for p in root.glob("iter_*"))


def check_overwrite(args: argparse.Namespace) -> None:
    """ValueError if `--hdp-overwrite-checkpoints` would delete what this run resumes from."""
    if not args.hdp_overwrite_checkpoints or args.save is None:
        return
    for name, value in (("--load", args.load), ("--hdp-load-if-exists", args.hdp_load_if_exists)):
        if value is not None and Path(value).resolve() == Path(args.save).resolve():
            raise ValueError(
                f"--hdp-overwrite-checkpoints would delete the checkpoints of --save {args.save}, "
                f"which {name} resumes from; drop one of the two"
            )


def check_save_folder(args: argparse.Namespace, loaded_meta: dict | None) -> None:
    """ValueError if this run would write into another run's checkpoint folder.

    Args:
        args: The parsed flags (`--save`, `--load`, `--hdp-overwrite-checkpoints`).
        loaded_meta: The meta of the checkpoint this run resumes, None for a fresh start.
    """
    save = args.save
    if save is None:
        return
    resumes_here = [p for p in (args.load, args.hdp_load_if_exists) if p is not None]
    if any(Path(p).resolve() == Path(save).resolve() for p in resumes_here):
        return  # this job's own folder (a requeued job may find it without a tracker yet)
    if args.hdp_overwrite_checkpoints or not holds_checkpoints(save):
        return
    try:
        saved_meta = read_meta(save)
        where = f"latest iteration {saved_meta['iteration']}"
    except ValueError:
        saved_meta, where = None, "no readable tracker"
    if loaded_meta is not None and saved_meta is not None:
        same_run = saved_meta.get("run_id") is not None and saved_meta.get(
            "run_id"
        ) == loaded_meta.get("run_id")
        if same_run and saved_meta["iteration"] <= loaded_meta["iteration"]:
            return
    started = f"resumes --load {args.load}" if args.load else "starts fresh"
    raise ValueError(
        f"--save {save} already holds checkpoints of another run ({where}), and this run "
        f"{started}: writing there would overwrite them. Resume that run with --load {save}, "
        "choose an empty folder, or give --hdp-overwrite-checkpoints to delete them once "
        "this run's first checkpoint is published"
    )

"""Switching a stock Megatron-LM job to `--hdp`: its checkpoint's args, shape and data position.

Megatron-LM's own `load_checkpoint` restores what a stock checkpoint holds (model, optimizer,
iteration, consumed samples, LR schedule, RNG): the HDP model has the stock model's
parameter names (Megatron-Core's `GPTModel`, HDP's core attention has no parameters). What
a stock checkpoint lacks is HDP's data position: the stock job read packed `--seq-length`
samples of its `GPTDataset`, HDP plans documents. The rule here (`continue_stock_data`):
HDP's document stream skips as many tokens as the stock job trained,
`consumed_train_samples x --seq-length` (the checkpoint's), in HDP's own order.

`startup_problems(args)` runs before any process group (from `args.finish_args`): a
checkpoint whose model differs from this launch's is refused there, by flag, and an `--hdp`
checkpoint that lost its data-position file, instead of after the model and optimizer are
built. Reads local files only; no communication.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"

#: Megatron-LM's model flags (dest) that a checkpoint's weights fix: a change cannot load.
SHAPE_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "normalization",
    "position_embedding_type",
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def checkpoint_folder(load: str, iteration: int) -> str:
    """The folder of iteration `iteration` under `--load` (Megatron-LM's naming)."""
    return os.path.join(load, f"iter_{iteration:07d}")


def tracked_iteration(args: argparse.Namespace) -> int | None:
    """The iteration Megatron-LM's `--load` will read (`--ckpt-step`, else the tracker file).

    None where there is no checkpoint to resume or it is not an iteration ("release").
    """
    if getattr(args, "ckpt_step", None) is not None:
        return int(args.ckpt_step)
    tracker = os.path.join(args.load, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    return int(text) if text.isdigit() else None


def saved_args(args: argparse.Namespace, iteration: int) -> argparse.Namespace | None:
    """The `args` Megatron-LM stored with the checkpoint of `iteration` (None: none found).

    `torch_dist`: the checkpoint's common part; the legacy `torch` format: rank 0's
    `model_optim_rng.pt` (memory-mapped, only `args` is kept). Local files only.
    """
    import torch

    from megatron_hdp.megatron.dist_checkpoint import is_dist_checkpoint, read_common

    folder = checkpoint_folder(args.load, iteration)
    if is_dist_checkpoint(folder):
        return read_common(folder).get("args")
    for shard in ("mp_rank_00", "mp_rank_00_000"):
        path = os.path.join(folder, shard, "model_optim_rng.pt")
        if os.path.isfile(path):
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("args")
    return None


def written_by_hdp(folder_common: dict | None, ckpt_args) -> bool:
    """Whether an HDP job wrote the checkpoint (pretrain_hdp.py's `hdp` entry, or `--hdp`)."""
    return bool((folder_common or {}).get("hdp")) or bool(getattr(ckpt_args, "hdp", False))


def shape_changes(args: argparse.Namespace, ckpt_args) -> list[str]:
    """`--flag: saved -> now` for every model-shape flag that differs from the checkpoint's."""
    changes = []
    for dest in SHAPE_FLAGS:
        if not hasattr(ckpt_args, dest) or not hasattr(args, dest):
            continue
        saved, now = getattr(ckpt_args, dest), getattr(args, dest)
        if dest == "num_query_groups" and not getattr(args, "group_query_attention", False):
            continue  # not used without GQA (Megatron-LM leaves it as given)
        if saved != now:
            changes.append(f"{_flag(dest)}: {saved!r} -> {now!r}")
    return changes


def startup_problems(args: argparse.Namespace) -> list[str]:
    """Before any process group: why `--load` of this launch cannot work, one phrase each.

    A checkpoint whose model shape differs from this launch's (not checked with
    `--use-checkpoint-args`, which takes the checkpoint's shape); an `--hdp` checkpoint
    without its data-position file (a full resume only). Anything unreadable is left to
    Megatron-LM's own load.
    """
    if not getattr(args, "load", None) or getattr(args, "use_checkpoint_args", False):
        return []
    try:
        iteration = tracked_iteration(args)
        with warnings.catch_warnings():  # DCP warns that no process group exists yet
            warnings.simplefilter("ignore", UserWarning)
            ckpt_args = None if iteration is None else saved_args(args, iteration)
    except (OSError, RuntimeError, ValueError, EOFError) as err:
        logger.debug("--load %s: not read at start-up (%s)", args.load, err)
        return []
    if ckpt_args is None:
        return []
    problems = []
    changes = shape_changes(args, ckpt_args)
    if changes:
        problems.append(
            f"--load {args.load}: the model of its iteration {iteration} differs from this "
            f"launch's ({', '.join(changes)}): its weights cannot load"
        )
    lost = _lost_data_position(args, iteration, ckpt_args)
    if lost is not None:
        problems.append(
            f"--load {args.load}: its iteration {iteration} was written by an --hdp job but "
            f"its HDP data position {lost} is missing: restore the file, or load with "
            "--finetune to start the data from its first batch"
        )
    return problems


def _lost_data_position(args: argparse.Namespace, iteration: int, ckpt_args) -> str | None:
    """The data-position file an `--hdp` checkpoint should hold but does not (None: fine).

    Only for a full resume (no `--finetune`) of a checkpoint whose saved args have `--hdp`
    (`pretrain_gpt.py --hdp`'s; pretrain_hdp.py's, whose args also say `hdp`, keep the
    position in the checkpoint's `hdp` entry instead).
    """
    if getattr(args, "finetune", False) or not getattr(ckpt_args, "hdp", False):
        return None
    from megatron_hdp.megatron.dist_checkpoint import is_dist_checkpoint, read_common
    from megatron_hdp.megatron_lm.data import state_path

    folder = checkpoint_folder(args.load, iteration)
    if is_dist_checkpoint(folder) and read_common(folder).get("hdp"):
        return None  # pretrain_hdp.py's: the position is in its `hdp` entry

    path = state_path(args, args.load, iteration)
    return None if os.path.exists(path) else path


def continue_stock_data(sampler, args: argparse.Namespace, ckpt_args) -> str:
    """Start HDP's stream after the tokens the stock job trained; the line that says so.

    The stock job trained `consumed_train_samples` samples of `--seq-length` tokens (the
    checkpoint's values). HDP's training sampler skips that many input tokens of its own
    order (`TokenBudgetSampler.skip_tokens`: per stream of a blend, its token share), and
    counts `args.iteration` steps done. The documents are HDP's own epoch order, not the
    stock job's shuffled samples: some the stock job trained may come again this epoch
    and some it did not are skipped, but the fraction of the epoch consumed carries over.
    """
    samples = int(getattr(ckpt_args, "consumed_train_samples", 0) or 0)
    if samples == 0:  # Megatron-LM's own fallback for old checkpoints
        samples = int(args.iteration) * int(getattr(ckpt_args, "global_batch_size", 0) or 0)
    seq_length = int(getattr(ckpt_args, "seq_length", None) or args.seq_length)
    tokens = samples * seq_length
    skipped = sampler.skip_tokens(tokens, steps=int(args.iteration))
    units = ", ".join(str(n) for n in skipped)
    return (
        f"--hdp: {args.load} iteration {args.iteration} was written by stock Megatron-LM "
        f"(no HDP data position): model, optimizer, iteration, consumed samples and LR "
        f"schedule are its own; HDP's data continues after the {tokens} tokens it trained "
        f"({samples} samples x --seq-length {seq_length}): its document stream skips its "
        f"first {sum(sampler.state.tokens)} tokens in HDP's own order (units skipped per "
        f"stream: {units}); the documents differ from the stock job's next samples"
    )

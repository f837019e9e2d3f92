"""Train a Megatron-Core GPT with Hybrid Data Parallelism.

Launch with torchrun (gloo on CPU, NCCL on GPU, chosen by device):

    torchrun --standalone --nproc-per-node 4 pretrain_hdp.py \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 4096 \
        --train-iters 20 --lr 3e-3 --hdp-global-batch-tokens 16384

With no --data-path the job trains on the running interpreter's standard library
(built once into --data-cache-path). `--help` lists every flag.

Start-up order: flags, paths and the checkpoint to resume are validated before torch or
Megatron-Core is imported (bad input: exit status 2 and one line, in well under a second);
then the datasets are opened and checked against the checkpoint; only then does the process
group start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

from megatron_hdp.launch import setup_logging
from megatron_hdp.megatron.arguments import build_parser
from megatron_hdp.megatron.validation import (
    NothingToTrain,
    check_resume_matches,
    flag_notes,
    validate_args,
)

logger = logging.getLogger("pretrain_hdp")


# How long a node's other ranks wait before exiting with a failure: torchrun stops the
# remaining workers, printing a SIGTERM notice, as soon as the first one fails, so the rank
# that prints the message must be the first to fail.
OTHER_RANKS_WAIT_S = 30.0


def _say(parser, status: int, message: str) -> None:
    """Exit with `status`; the message is printed once per node (torchrun's local rank 0).

    On a failure the node's other ranks wait (up to `OTHER_RANKS_WAIT_S`) for torchrun to stop
    them after local rank 0 has printed and exited, so the message is the first line.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        parser.exit(status, f"{parser.prog}: {message}\n")
    if status != 0:
        _leave_process_group()  # peers blocked in a collective with this rank fail now
        time.sleep(OTHER_RANKS_WAIT_S)
    parser.exit(status)


def _leave_process_group() -> None:
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


def _service_data_config(args, cfg):
    """`cfg` for a rank of a job with --hdp-data-service ray: it holds lengths only.

    The source loaders read every token (training and evaluation); a JSONL source with no
    cached lengths index has it built once, in the cluster (`data.service.indexer`).
    """
    import dataclasses

    from megatron_hdp.data.service.address import resolve_ray_address
    from megatron_hdp.data.service.indexer import cluster_lengths
    from megatron_hdp.data.training_data import DEFAULT_CACHE

    open_args = {
        "tokenizer_type": cfg.tokenizer_type,
        "tokenizer_model": cfg.tokenizer_model,
        "cache_dir": cfg.cache_dir or DEFAULT_CACHE,
    }
    build = cluster_lengths(
        resolve_ray_address(args.hdp_ray_address),
        open_args,
        timeout_s=args.distributed_timeout_minutes * 60,
    )
    return dataclasses.replace(cfg, lengths_only=True, build_lengths=build)


def _prepare(parser, args, world_size: int):
    """Everything before the process group: validate, open the data, check the resume."""
    try:
        meta = validate_args(args, world_size)
    except NothingToTrain as done:
        _say(parser, done.exit_code, str(done))
    except ValueError as err:
        _say(parser, 2, f"error: {err}")
    for note in flag_notes(args):
        logger.info("%s", note)
    import dataclasses

    import torch

    from megatron_hdp.attention.kernels.device import DeviceFacts
    from megatron_hdp.attention.kernels.registry import resolve_kernel
    from megatron_hdp.data.training_data import build_training_data
    from megatron_hdp.errors import DataServiceError
    from megatron_hdp.megatron.config import data_config, model_config
    from megatron_hdp.megatron.mla_args import head_dims

    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        head_dim, head_dim_v = head_dims(args)  # MLA: q/k and v head dims differ
        args.hdp_attention_backend = resolve_kernel(
            args.hdp_attention_backend,
            DeviceFacts.of(device),
            dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            window=args.window_size is not None,
        )
        cfg = data_config(args, world_size)
        if args.hdp_data_service == "ray":  # the rank holds lengths, the loaders tokens
            cfg = _service_data_config(args, cfg)
        data = build_training_data(cfg)
        if meta is not None:
            check_resume_matches(
                meta,
                load=args.load,
                model=dataclasses.asdict(model_config(args, data.vocab_size)),
                data_setup=data.train.setup(),
                prefixes=data.prefixes,
                streams=data.streams,
                finetune=args.finetune,
                fingerprints=data.fingerprints,
            )
    except ValueError as err:
        _say(parser, 2, f"error: {err}")
    except DataServiceError as err:
        _say(parser, 1, f"error: {err}")
    return data


def _train(args, data) -> list[dict]:
    """Collective over the world: build the model, resume, train; returns this rank's records."""
    import torch.distributed as dist
    from tqdm import tqdm

    from megatron_hdp.distributed import failure_note
    from megatron_hdp.distributed.stall_watchdog import StallWatchdog, watchdog_store
    from megatron_hdp.distributed.stop_signal import StopSignal
    from megatron_hdp.errors import (
        CheckpointSaveError,
        DataServiceError,
        JobStoppedError,
        NonFiniteError,
        OutputWriteError,
    )
    from megatron_hdp.launch import init_distributed, megatron_device_context
    from megatron_hdp.megatron.config import model_config
    from megatron_hdp.megatron.model import model_parallel_dims
    from megatron_hdp.megatron.trainer import Trainer, runtime_for

    timeout_s = args.distributed_timeout_minutes * 60
    device = init_distributed(timeout_s=timeout_s)
    store = dist.distributed_c10d._get_default_store()
    with megatron_device_context():
        cfg = model_config(args, data.vocab_size)
        layout = model_parallel_dims(cfg, dist.get_world_size()).initialize(
            timeout_minutes=args.distributed_timeout_minutes
        )
        try:
            runtime = runtime_for(args, layout, device)
            trainer = Trainer(args, data, runtime)
            report_after_s = args.hdp_stall_report_seconds
            if report_after_s is None:
                report_after_s = timeout_s / 4
            watchdog = None
            if report_after_s > 0:
                watchdog = StallWatchdog(
                    watchdog_store(dist.distributed_c10d._get_default_store()),
                    rank=dist.get_rank(),
                    world_size=dist.get_world_size(),
                    report_after_s=report_after_s,
                    timeout_s=timeout_s,
                )
                trainer.watchdog = watchdog
                trainer.runtime.progress = watchdog.mark
            if args.exit_signal_handler:
                trainer.stop_signal = StopSignal()
            if args.load:
                trainer.resume()
            with (
                watchdog or contextlib.nullcontext(),
                trainer.stop_signal or contextlib.nullcontext(),
                tqdm(
                    total=args.train_iters,
                    initial=trainer.iteration,
                    desc="train",
                    disable=dist.get_rank() != 0 or args.no_progress_bar,
                    file=sys.stderr,
                ) as progress,
            ):
                records = trainer.train(progress)
            trainer.log_summary(records)  # rank 0, after the progress bar has closed
            return records
        except (NonFiniteError, CheckpointSaveError):
            raise  # raised on every rank together, with the same message
        except (DataServiceError, OutputWriteError) as err:  # one rank's own failure
            note = failure_note.leave(store, dist.get_rank(), str(err))
            raise type(err)(note) from err
        except Exception as err:
            note = failure_note.reason(store)
            if note is not None:  # a peer stopped first, and this collective failed with it
                raise JobStoppedError(note) from err
            lines = str(err).strip().splitlines()
            first = lines[0] if lines else ""
            failure_note.leave(
                store,
                dist.get_rank(),
                f"{type(err).__name__}: {first} (the traceback is in that rank's output)",
            )
            raise
        finally:
            layout.destroy()


def main(argv: list[str] | None = None) -> list[dict]:
    """Parse, validate, set up and train; returns the per-step records of this rank.

    Exit statuses: 2 with a one-line message for bad input (before any process group), 0
    with a message when the checkpoint to resume has already reached `--train-iters`, 1
    with a one-line message when training stops on a non-finite loss or gradient norm, when
    a checkpoint cannot be written or when the Ray data service fails (every rank stops
    with the same line; a rank whose peer stopped first gives the peer's reason).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # Also hides Megatron-Core's known missing-package warnings (launch.KNOWN_MEGATRON_WARNINGS):
    # set here, before anything imports torch or Megatron, in every rank's own interpreter.
    setup_logging(rank, level=logging.WARNING if args.hdp_validate_only else logging.INFO)
    data = _prepare(parser, args, world_size)
    if args.hdp_validate_only:
        return []
    from megatron_hdp.errors import (
        CheckpointSaveError,
        DataServiceError,
        JobStoppedError,
        NonFiniteError,
        OutputWriteError,
    )

    try:
        return _train(args, data)
    except (
        NonFiniteError,
        CheckpointSaveError,
        DataServiceError,
        JobStoppedError,
        OutputWriteError,
    ) as err:
        _say(parser, 1, f"error: {err}")


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()

"""Train a Megatron-Core GPT with Hybrid Data Parallelism.

Launch with torchrun (gloo on CPU, NCCL on GPU, chosen by device):

    torchrun --standalone --nproc-per-node 4 pretrain_hdp.py \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 4096 \
        --train-iters 20 --lr 3e-3 --hdp-global-batch-tokens 16384

With no --data-path the job trains on the running interpreter's standard library
(built once into --data-cache-path). `--help` lists every flag.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist
from tqdm import tqdm

from megatron_hdp.launch import init_distributed, megatron_device_context, setup_logging
from megatron_hdp.megatron.arguments import build_parser, validate_args
from megatron_hdp.megatron.engine import destroy_parallel_state, initialize_parallel_state
from megatron_hdp.megatron.trainer import Trainer, data_config, runtime_for
from megatron_hdp.megatron.training_data import build_training_data

logger = logging.getLogger("pretrain_hdp")


def main(argv: list[str] | None = None) -> list[dict]:
    """Parse, validate, set up and train; returns the per-step records of this rank."""
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    try:
        validate_args(args, world_size)
        data = build_training_data(data_config(args, world_size))
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    device = init_distributed()
    with megatron_device_context():
        initialize_parallel_state()
        try:
            trainer = Trainer(args, data, runtime_for(args, dist.group.WORLD, device))
            if args.load:
                trainer.resume()
            with tqdm(
                total=args.train_iters,
                initial=trainer.iteration,
                desc="train",
                disable=dist.get_rank() != 0 or args.no_progress_bar,
                file=sys.stderr,
            ) as progress:
                return trainer.train(progress)
        finally:
            destroy_parallel_state()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()

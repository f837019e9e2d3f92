"""A short multi-rank HDP training run on CPU (launch with torchrun; see scripts/demo.sh).

Data: the running interpreter's standard-library `.py` files as documents, byte-level
tokens (vocabulary 256), truncated to the pool's longest sequence, shuffled with the seed;
each step takes whole documents until its token budget is spent, so a step mixes
documents of a few hundred bytes with ones that need a ring of several ranks.
"""

from __future__ import annotations

import argparse
import logging
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hdp.batching import InMemoryTokens
from megatron_hdp.launch import init_distributed, megatron_device_context, setup_logging
from megatron_hdp.megatron.engine import (
    OptimConfig,
    build_engine,
    destroy_parallel_state,
    initialize_parallel_state,
)
from megatron_hdp.megatron.model import GPTConfig
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.scheduler import POLICIES, plan_step

logger = logging.getLogger("hdp_demo")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps to run")
    p.add_argument("--capacity", type=int, default=1024, help="tokens per rank per micro-batch")
    p.add_argument("--tokens-per-step", type=int, default=16384, help="global batch token budget")
    p.add_argument("--policy", choices=POLICIES, default="greedy", help="placement policy")
    p.add_argument("--num-layers", type=int, default=2, help="transformer layers")
    p.add_argument("--hidden-size", type=int, default=64, help="hidden size")
    p.add_argument("--num-attention-heads", type=int, default=4, help="query heads")
    p.add_argument("--num-query-groups", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=1234, help="seed for weights and data order")
    return p.parse_args(argv)


def stdlib_documents(max_len: int, seed: int) -> list[torch.Tensor]:
    """Byte tensors of the stdlib's .py files, truncated to `max_len + 1` bytes, shuffled."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()[: max_len + 1]
        if len(data) >= 2:
            docs.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).long())
    random.Random(seed).shuffle(docs)
    return docs


def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_distributed()
    rank, pool_size = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    cfg = GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        vocab_size=256,
    )
    docs = stdlib_documents(pool_size * args.capacity, args.seed)
    logger.info("%d documents, %d ranks, capacity %d", len(docs), pool_size, args.capacity)
    with megatron_device_context():
        initialize_parallel_state()
        try:
            engine = build_engine(cfg, OptimConfig(lr=args.lr), seed=args.seed)
            runtime = StepRuntime(group=dist.group.WORLD, device=device)
            cursor = 0
            for step in range(1, args.steps + 1):
                batch, tokens = [], 0
                while tokens < args.tokens_per_step:
                    doc = docs[cursor % len(docs)]
                    cursor += 1
                    batch.append(doc)
                    tokens += len(doc) - 1
                source = InMemoryTokens([d[:-1] for d in batch], [d[1:] for d in batch])
                plan = plan_step(
                    source.seqlens, pool_size=pool_size, capacity=args.capacity, policy=args.policy
                )
                start = time.perf_counter()
                result = train_step(engine, plan, source, runtime)
                elapsed = time.perf_counter() - start
                counts = plan.num_micro_batches_per_rank()
                rings = [mb.cp_size for mb in plan.micro_batches if mb.cp_size > 1]
                logger.info(
                    "step %d | loss %.4f | %d seqs, %d tokens, %.0f tokens/s | micro-batches per "
                    "rank %d-%d | rings %s | attention bytes sent (rank 0) %d",
                    step,
                    result.loss,
                    len(batch),
                    result.num_loss_tokens,
                    result.num_loss_tokens / elapsed,
                    min(counts),
                    max(counts),
                    rings,
                    result.attention_bytes_sent,
                )
        finally:
            destroy_parallel_state()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

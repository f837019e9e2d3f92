"""Run pretrain_hdp.main on forked gloo ranks (the real entry point, minus torchrun)."""

import contextlib
import os
import sys
from pathlib import Path

from tests.dist import run_ranks

REPO = Path(__file__).resolve().parents[2]

SMALL_MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--no-progress-bar",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "1",
]


def _body_main(rank, world_size, argv):
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["RANK"] = str(rank)
    import pretrain_hdp

    return pretrain_hdp.main(list(argv))


def run_pretrain(world_size: int, argv: list[str], timeout_s: float = 300) -> list[dict]:
    """Per-step records of rank 0 (all ranks are checked to agree on the losses)."""
    per_rank = run_ranks(_body_main, world_size, argv, timeout_s=timeout_s)
    for rank, steps in enumerate(per_rank[1:], start=1):
        # repr: NaN losses of a skipped step must agree too
        assert [repr(s["loss"]) for s in steps] == [repr(s["loss"]) for s in per_rank[0]], rank
    return per_rank[0]


def _body_logged(rank, world_size, argv, log_path):
    """pretrain_hdp.main with rank 0's megatron_hdp log lines also written to `log_path`."""
    import logging

    if rank == 0:
        handler = logging.FileHandler(log_path)
        logging.getLogger("megatron_hdp").addHandler(handler)
        logging.getLogger("megatron_hdp").setLevel(logging.INFO)
    return _body_main(rank, world_size, argv)


def run_pretrain_logged(world_size, argv, log_path) -> list[dict]:
    """Like `run_pretrain` (rank 0's records, losses checked to agree), logging to a file."""
    per_rank = run_ranks(_body_logged, world_size, argv, str(log_path), timeout_s=300)
    for rank, steps in enumerate(per_rank[1:], start=1):
        assert [repr(s["loss"]) for s in steps] == [repr(s["loss"]) for s in per_rank[0]], rank
    return per_rank[0]


def corpus_args(cache, *, iters, lr="1e-3", tokens=2048, extra=()):
    """A small job on the embedded corpus: 512-token context, capacity 256 (2+ ranks)."""
    return [
        *SMALL_MODEL,
        "--seq-length",
        "512",
        "--hdp-capacity",
        "256",
        "--train-iters",
        str(iters),
        "--lr",
        str(lr),
        "--hdp-global-batch-tokens",
        str(tokens),
        "--data-cache-path",
        str(cache),
        "--seed",
        "5",
        *extra,
    ]


@contextlib.contextmanager
def tiny_engine():
    """A one-layer model, its optimizer and Megatron's parallel state, on a forked rank."""
    from megatron_hdp.distributed.layout import ParallelDims
    from megatron_hdp.megatron.cpu_shim import cpu_shims
    from megatron_hdp.megatron.engine import (
        OptimConfig,
        build_engine,
    )
    from megatron_hdp.megatron.model import GPTConfig

    cfg = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32)
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            yield build_engine(cfg, OptimConfig())
        finally:
            from megatron_hdp.megatron.dist_checkpoint import close_writer_processes

            close_writer_processes()
            layout.destroy()


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The real launcher: `torchrun --standalone` running pretrain_hdp.py on `nproc` ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(REPO / "pretrain_hdp.py"),
        *argv,
    ]


def saved_tensors(folder) -> dict:
    """Every global tensor of a torch_dist checkpoint folder, by key (no process group).

    Read through torch's own `dcp_to_torch_save`, not our loader: model weights under
    Megatron's `sharded_state_dict` keys, optimizer state under `optimizer.*`.
    """
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), f"{tmp}/all.pt")
        every = torch.load(f"{tmp}/all.pt", weights_only=False)
    return {k: v for k, v in every.items() if torch.is_tensor(v)}


def saved_model(folder) -> dict:
    """The model weights of a torch_dist checkpoint folder (`saved_tensors` less optimizer)."""
    return {k: v for k, v in saved_tensors(folder).items() if not k.startswith("optimizer.")}

"""Run pretrain_hdp.main on forked gloo ranks (the real entry point, minus torchrun)."""

import os

from tests.dist import run_ranks

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

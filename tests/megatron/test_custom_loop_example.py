"""examples/custom_loop.py (the integration kit in a loop of one's own) runs on 2 ranks and
trains exactly as pretrain_hdp.py with the same flags."""

from __future__ import annotations

import importlib.util

import pytest

from tests.dist import run_ranks
from tests.e2e.harness import REPO, run_pretrain
from tests.megatron_lm.harness import SHARED, write_documents


def _body_example(rank, world_size, argv):
    spec = importlib.util.spec_from_file_location(
        "custom_loop", REPO / "examples" / "custom_loop.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(argv)


def test_custom_loop_example_equals_pretrain_hdp(tmp_path):
    prefix = tmp_path / "docs"
    write_documents(prefix)
    common = ["--data-path", str(prefix), "--global-batch-size", "8", "--hdp-capacity", "256"]
    per_rank = run_ranks(_body_example, 2, [*common, "--steps", "3"], timeout_s=240)
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) == 3
    flags = [*SHARED, *common, "--train-iters", "3", "--eval-iters", "0", "--no-progress-bar"]
    reference = [r["loss"] for r in run_pretrain(2, flags)]
    assert per_rank[0] == pytest.approx(reference, rel=1e-6)

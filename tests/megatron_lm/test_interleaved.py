"""Interleaved pipeline stages under `--hdp` (issue 47 item 5), through Megatron-LM's loop.

PP 2 x VP 2 (`--num-layers-per-virtual-pipeline-stage 1`, 4 layers) on a pool of 2
replicas (4 ranks) trains with the losses and gradient norms of `pretrain_hdp.py` on one
rank (the same model without a pipeline). HDP's replicas run uneven micro-batch counts; a
count Megatron's interleaved schedule refuses is padded with one-token micro-batches
(`schedule.interleaved_padding`), which each rank records here: the run must have padded
(10 samples of this data give each replica 11 micro-batches, padded to 12). The run
overlaps its gradient reduce and parameter gathers (distributed optimizer).
"""

from __future__ import annotations

import pytest

from megatron_hdp.megatron import schedule
from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm


def _recording_padding(path):
    stock = schedule.interleaved_padding

    def interleaved_padding(batches, *args, **kwargs):
        padded, pads = stock(batches, *args, **kwargs)
        with open(path, "a") as out:  # forked ranks append; one short line each
            out.write(f"{len(batches)} {len(padded)}\n")
        return padded, pads

    return interleaved_padding


def test_pp2_vp2_losses_equal_one_rank(trees, data, tmp_path, monkeypatch):
    _, patched = trees
    flags = [*SHARED, "--num-layers", "4", "--data-path", data, "--train-iters", "2"]
    flags += ["--global-batch-size", "10", "--eval-iters", "0", "--eval-interval", "1000"]
    record = tmp_path / "padding.txt"
    # The ranks are forked from this process: they run the recording function.
    monkeypatch.setattr(schedule, "interleaved_padding", _recording_padding(record))
    layout = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    # The chunks' reduces start in Megatron's finish; their parameter gathers in the forwards.
    layout += ["--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather"]
    ran = run_megatron_lm(
        patched / "pretrain_gpt.py",
        4,
        [*flags, *layout, "--hdp-capacity", "256", *MEGATRON_CPU, "--hdp"],
        timeout_s=240,
    )
    # One rank holds a whole 512-token sequence; the pool of 2 splits long ones in rings.
    reference = run_pretrain(1, [*flags, "--hdp-capacity", "512", "--no-progress-bar"])
    assert ran["model_chunks"] == 2
    assert [i for i, _, _ in ran["train"]] == [1, 2]
    for (_, loss, norm), want in zip(ran["train"], reference, strict=True):
        assert loss == pytest.approx(want["loss"], rel=1e-5)
        assert norm == pytest.approx(want["grad_norm"], rel=1e-5)
    counts = [tuple(map(int, line.split())) for line in record.read_text().splitlines()]
    assert counts and any(before < after for before, after in counts), counts
    # Megatron's rule for PP 2 in groups of 2 (its default): at least 2, and even.
    assert all(after >= 2 and after % 2 == 0 for _, after in counts), counts

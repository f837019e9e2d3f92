"""`pretrain_hdp.py` with interleaved pipeline stages (issue 47 item 5).

PP 2 x VP 2 (`--num-layers-per-virtual-pipeline-stage 1`, 4 layers, experts in every
layer) on a pool of 2 pipelines (4 ranks) gives the losses, MoE load-balancing losses and
gradient norms of one rank (the padding micro-batches count in no loss); its checkpoint (one
shard per model chunk, `model0` / `model1` as Megatron-LM keys them) resumes on a pool of 2
without pipelines, which continues with the one rank's losses. Each rank records how it
padded its micro-batch lists (`pipeline.interleaved_padding`): the run must have padded.
"""

import pytest

from megatron_hdp.megatron import pipeline
from tests.e2e.harness import corpus_args, run_pretrain
from tests.e2e.test_moe_job import MOE

VP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def _recording_padding(path):
    stock = pipeline.interleaved_padding

    def interleaved_padding(batches, *args, **kwargs):
        padded, pads = stock(batches, *args, **kwargs)
        with open(path, "a") as out:  # forked ranks append; one short line each
            out.write(f"{len(batches)} {len(padded)}\n")
        return padded, pads

    return interleaved_padding


def test_pp2_vp2_trains_like_one_rank_and_resumes_without_pipelines(
    corpus_cache, tmp_path, monkeypatch
):
    def job(*extra):
        experts = [*MOE, "--moe-token-dispatcher-type", "alltoall"]  # alltoall: PP's need
        return corpus_args(
            corpus_cache, iters=3, tokens=2560, extra=["--num-layers", "4", *experts, *extra]
        )

    record = tmp_path / "padding.txt"
    # The ranks are forked from this process: they run the recording function.
    monkeypatch.setattr(pipeline, "interleaved_padding", _recording_padding(record))
    reference = run_pretrain(1, job("--hdp-capacity", "512"))
    ckpt = tmp_path / "ckpt"
    first = run_pretrain(4, job(*VP, "--save", str(ckpt), "--exit-interval", "2"))
    second = run_pretrain(2, job("--load", str(ckpt)))
    assert [s["iteration"] for s in first + second] == [1, 2, 3]
    assert [s["loss"] for s in first + second] == pytest.approx(
        [s["loss"] for s in reference], rel=1e-5
    )
    assert [s["grad_norm"] for s in first] == pytest.approx(
        [s["grad_norm"] for s in reference[:2]], rel=1e-5
    )
    assert [s["moe_aux_loss"] for s in first + second] == pytest.approx(
        [s["moe_aux_loss"] for s in reference], rel=1e-5
    )
    assert all(s["moe_aux_loss"] > 0 for s in reference)
    assert any(s["max_ranks_per_sequence"] > 1 for s in first)  # rings span pipelines
    counts = [tuple(map(int, line.split())) for line in record.read_text().splitlines()]
    assert any(before < after for before, after in counts), counts
    # Megatron's rule for PP 2 in groups of 2 (its default): at least 2, and even.
    assert all(after >= 2 and after % 2 == 0 for _, after in counts), counts

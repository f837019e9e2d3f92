"""--global-batch-size, --rampup-batch-size, --train-samples and --log-throughput under --hdp,
as Megatron-LM counts them: a sample is --seq-length tokens.

The references: Megatron-LM's own counters (its consumed samples, learning rate and FLOP
function, in the run itself), the ramp worked out by hand from Megatron-Core's rule, and
pretrain_hdp.py with the same flags (the same losses).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests.e2e.harness import run_pretrain
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm
from tests.megatron_lm.test_args import BASE, _parse_and_validate

SEQ = 512
#: --global-batch-size 6 --rampup-batch-size 2 2 8: 2 increments over 8 samples, one every
#: 4 consumed samples (Megatron-Core's RampupBatchsizeNumMicroBatchesCalculator). Consumed
#: 0 -> 2, 2 -> 2, 4 -> 4, 8 -> 6 (8 is not past the ramp's 8), 14 -> 6 (past it).
#: --train-samples 20: the ramp's 4 steps consume 14, then (20 - 14) // 6 = 1 step more.
RAMPED = [2, 2, 4, 6, 6]


def _ramps() -> bool:
    from megatron_hdp.megatron_lm.args import megatron_ramps

    return megatron_ramps()


def test_ramp_and_train_samples_count_samples_of_seq_length_tokens(trees, data):
    """Each step trains whole documents up to its samples x --seq-length tokens; Megatron-LM's
    consumed samples and learning rate follow the ramp; losses equal pretrain_hdp.py's.

    megatron-core 0.19 ignores --rampup-batch-size (deprecated): there every step is 6.
    """
    _, patched = trees
    ramp = ["--rampup-batch-size", "2", "2", "8"]
    sizes = RAMPED if _ramps() else [6, 6, 6]
    flags = [*SHARED, "--data-path", data, "--global-batch-size", "6", "--train-samples", "20"]
    flags += ["--lr-decay-style", "linear", "--lr-warmup-samples", "4", "--min-lr", "1e-4"]
    flags += ["--hdp-capacity", "256", "--eval-iters", "0", "--eval-interval", "1000"]
    ran = run_megatron_lm(patched / "pretrain_gpt.py", 2, [*flags, *ramp, *MEGATRON_CPU, "--hdp"])
    steps = ran["steps"]
    assert [s["iteration"] for s in steps] == list(range(1, len(sizes) + 1))
    assert [s["consumed_samples"] for s in steps] == np.cumsum(sizes).tolist()
    for step, samples in zip(steps, sizes, strict=True):
        trained = sum(step["lengths"])
        assert samples * SEQ - SEQ < trained <= samples * SEQ, (step["iteration"], trained)
    reference = run_pretrain(2, [*flags, *(ramp if _ramps() else []), "--no-progress-bar"])
    for step, record in zip(steps, reference, strict=True):
        assert sum(u[3] for u in record["units"]) == sum(step["lengths"])
        assert record["lr"] == pytest.approx(step["lr"], rel=1e-6)
    got = [loss for _, loss, _ in ran["train"]]
    assert got == pytest.approx([r["loss"] for r in reference], rel=1e-6)


def _with_seq_length(args, length):
    one = copy.copy(args)
    one.seq_length = int(length)
    return one


def test_log_throughput_counts_the_flops_of_the_sequences_trained(trees, monkeypatch):
    """Megatron-LM's own FLOP function, applied to each trained sequence as one sample of its
    own length (attention quadratic in that length, no padding), summed."""
    from megatron.training import training

    from megatron_hdp.megatron_lm import hooks

    hooks.install_hooks()
    args = _parse_and_validate(monkeypatch, [*BASE, "--hdp", "--log-throughput"])
    args.padded_vocab_size = 384  # set when Megatron-LM builds its tokenizer
    stock = training.num_floating_point_operations.__wrapped__
    lengths = np.array([512, 37, 200, 37, 1, 350])
    monkeypatch.setattr(hooks._SCHEDULE, "trained_lengths", lengths)
    got = training.num_floating_point_operations(args, args.global_batch_size)
    want = sum(stock(_with_seq_length(args, n), 1) for n in lengths)
    assert got == pytest.approx(want, rel=1e-12)
    assert got < stock(args, len(lengths))  # stock counts 6 full --seq-length samples
    args.hdp = False  # without --hdp: stock
    assert training.num_floating_point_operations(args, 3) == stock(args, 3)

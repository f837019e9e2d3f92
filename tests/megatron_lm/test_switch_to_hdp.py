"""A running stock Megatron-LM job switched to `--hdp` with `--load` (no `--finetune`).

Stock pretrain_gpt.py (no --hdp) trains two steps on 2 ranks with the distributed optimizer
and saves (`torch_dist`); pretrain_gpt.py --hdp resumes it for steps 3 and 4. The reference
is stock Megatron-LM resuming the same checkpoint: at its first step it holds the same
weights, optimizer moments and step counts, LR schedule position and consumed samples, and
logs the same learning rates. The data follows the documented rule (docs/megatron-lm.md,
"Switching a stock job to --hdp"): HDP's stream skips the tokens the stock job trained,
consumed samples x --seq-length, in its own order; the reference for the first batch is
HDP's plain sampler drawn unit by unit.
"""

from __future__ import annotations

import argparse
import copy
import functools
import glob
import inspect
import logging
import os

import pytest
import torch

from tests.dist import run_ranks
from tests.megatron_lm.harness import MEGATRON_CPU, SHARED, run_megatron_lm

QUIET = ["--eval-iters", "0", "--eval-interval", "1000"]
DECAY = ["--lr-decay-style", "linear", "--lr-decay-iters", "4", "--lr-warmup-iters", "1"]
GLOBAL_BATCH, SEQ_LENGTH = 4, 512


def _optimizer_state(optimizer) -> list:
    """Every (parameter shard, Adam state) of this rank's optimizer(s), in their order."""
    found = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param, {})
                found.append(
                    (
                        param.detach().clone(),
                        {
                            k: v.detach().clone() if torch.is_tensor(v) else v
                            for k, v in state.items()
                        },
                    )
                )
    return found


def _body(rank, world_size, script, argv):
    """One rank of `script`, recording what its first training step starts from."""
    from megatron.core.dist_checkpointing import validation
    from megatron.training import training

    from megatron_hdp.megatron_lm import data as hdp_data
    from tests.megatron_lm.harness import _body_megatron_lm

    probe = {"lr": [], "start": None, "pristine": None, "first_batch": None, "notes": []}
    probe["key_report"] = []
    stock_report = validation.maybe_report_missing_and_unexpected_keys

    def report(missing_keys, unexpected_keys, raise_error=True):
        probe["key_report"].append((set(unexpected_keys), set(missing_keys)))
        return stock_report(missing_keys, unexpected_keys, raise_error)

    validation.maybe_report_missing_and_unexpected_keys = report
    stock_log, stock_step = training.training_log, training.train_step
    stock_init = hdp_data.TrainBatches.__init__

    @functools.wraps(stock_log)  # the harness binds its arguments by the stock signature
    def training_log(*args, **kwargs):
        given = inspect.signature(stock_log).bind(*args, **kwargs).arguments
        probe["lr"].append((given["iteration"], float(given["learning_rate"])))
        return stock_log(*args, **kwargs)

    def train_step(*args, **kwargs):
        if probe["start"] is None:
            from megatron.training import get_args

            given = inspect.signature(stock_step).bind(*args, **kwargs).arguments
            probe["start"] = {
                "optimizer": _optimizer_state(given["optimizer"]),
                "scheduler_steps": given["opt_param_scheduler"].num_steps,
                "consumed_samples": get_args().consumed_train_samples,
                "iteration": get_args().iteration,
            }
        return stock_step(*args, **kwargs)

    def init(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        probe["pristine"] = copy.deepcopy(self.sampler)
        draw = self.sampler.next_batch

        def next_batch():
            batch = draw()
            if probe["first_batch"] is None:
                probe["first_batch"] = batch
            return batch

        self.sampler.next_batch = next_batch

    class Notes(logging.Handler):
        def emit(self, record):
            probe["notes"].append(record.getMessage())

    # Without Transformer Engine or Apex (this CPU machine) Megatron-Core's distributed
    # optimizer cannot build its loading state dict before a first step (its `state_dict`
    # asserts one torch Adam `step`): stock Megatron-LM fails so on its own checkpoints. As
    # with TE's or Apex's Adam, the state is allocated first (zeros, step 0; the load
    # overwrites it), for the stock and the --hdp runs alike.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_hdp.megatron.dist_checkpoint import (
        _allocate_optimizer_state,
        _steps_kept_on_load,
    )

    stock_sharded = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, *args, **kwargs):
        if not len(self.optimizer.state):  # before a first step: only a load asks
            _allocate_optimizer_state(self)
        return stock_sharded(self, *args, **kwargs)

    # And its load copies into fp32 parameter shards, views of parameters that require
    # grad, outside `torch.no_grad()` (a float16/bf16 job copies into separate main
    # parameters): the load runs under no_grad here, for both runs alike.
    # (`load_parameter_state`: the legacy `torch` format's separate optimizer file.)
    stock_load = DistributedOptimizer.load_state_dict
    stock_load_file = DistributedOptimizer.load_parameter_state

    def load_state_dict(self, *args, **kwargs):
        with torch.no_grad():
            return stock_load(self, *args, **kwargs)

    def load_parameter_state(self, *args, **kwargs):
        # That file holds no torch Adam `step` per parameter: kept from the allocated state
        # (the step itself comes from the checkpoint's param groups).
        with torch.no_grad(), _steps_kept_on_load():
            return stock_load_file(self, *args, **kwargs)

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer.load_parameter_state = load_parameter_state
    notes = Notes(logging.INFO)
    logging.getLogger("megatron_hdp.megatron_lm").addHandler(notes)
    logging.getLogger("megatron_hdp.megatron_lm").setLevel(logging.INFO)
    training.training_log, training.train_step = training_log, train_step
    hdp_data.TrainBatches.__init__ = init
    try:
        records = _body_megatron_lm(rank, world_size, script, argv, False)
    finally:
        training.training_log, training.train_step = stock_log, stock_step
        hdp_data.TrainBatches.__init__ = stock_init
        DistributedOptimizer.sharded_state_dict = stock_sharded
        DistributedOptimizer.load_state_dict = stock_load
        DistributedOptimizer.load_parameter_state = stock_load_file
        validation.maybe_report_missing_and_unexpected_keys = stock_report
        logging.getLogger("megatron_hdp.megatron_lm").removeHandler(notes)
    return {**records, **probe}


def _run(script, argv):
    return run_ranks(_body, 2, script, list(argv), timeout_s=240)


def _expected_first_batch(pristine, tokens: int, steps: int):
    """HDP's first batch after skipping `tokens`: the plain sampler, drawn unit by unit."""
    from megatron_hdp.data.sampler import TokenBudgetSampler

    one_by_one = TokenBudgetSampler(
        pristine.datasets, pristine.weights, seed=pristine.seed, units_per_batch=1
    )
    drawn = 0
    while drawn < tokens:
        drawn += one_by_one.next_batch()[0].length
    after = copy.deepcopy(pristine)
    after.state.consumed = list(one_by_one.state.consumed)
    after.state.tokens = list(one_by_one.state.tokens)
    after.state.steps = steps
    return after.next_batch(), drawn


def _same_state(got, want):
    assert len(got) == len(want) > 0
    for (param, state), (param_want, state_want) in zip(got, want, strict=True):
        torch.testing.assert_close(param, param_want, rtol=0, atol=0)
        assert sorted(state) == sorted(state_want)
        for key, value in state.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(value, state_want[key], rtol=0, atol=0)
            else:
                assert value == state_want[key], key


def _flags(data, ckpt_format="torch_dist"):
    flags = [*SHARED, *DECAY, *MEGATRON_CPU, *QUIET, "--data-path", data, "--train-iters", "4"]
    flags += ["--global-batch-size", str(GLOBAL_BATCH), "--use-distributed-optimizer"]
    return [*flags, "--ckpt-format", ckpt_format]


@pytest.fixture(scope="module", params=["torch_dist", "torch"])
def stock_checkpoint(trees, data, tmp_path_factory, request):
    """Stock pretrain_gpt.py (no --hdp): 2 of 4 steps on 2 ranks, saved at step 2 in the
    `--ckpt-format` of the parameter: (folder, that format)."""
    stock, _ = trees
    ckpt = str(tmp_path_factory.mktemp("switch") / "stock")
    first = _run(
        stock / "pretrain_gpt.py",
        [*_flags(data, request.param), "--exit-interval", "2", "--save", ckpt]
        + ["--save-interval", "2"],
    )
    assert [i for i, _, _ in first[-1]["train"]] == [1, 2]
    return ckpt, request.param


def test_a_stock_job_switches_to_hdp_with_its_optimizer_schedule_and_position(
    trees, data, stock_checkpoint
):
    stock, patched = trees
    ckpt, ckpt_format = stock_checkpoint
    flags = _flags(data, ckpt_format)
    # On CPU Megatron-LM saves no CUDA RNG state to load. Both runs report the keys that
    # the checkpoint and the model they built do not share (`log_all`).
    resume = [*flags, "--load", ckpt, "--no-load-rng", "--dist-ckpt-strictness", "log_all"]
    want = _run(stock / "pretrain_gpt.py", resume)
    got = _run(patched / "pretrain_gpt.py", [*resume, "--hdp"])

    assert [i for i, _, _ in got[-1]["train"]] == [3, 4]  # the last rank logs the loss
    for mine, theirs in zip(got, want, strict=True):
        # The HDP model and its optimizer ask for exactly the stock model's keys.
        assert mine["key_report"] == theirs["key_report"]
        if ckpt_format == "torch_dist":
            assert mine["key_report"] == [(set(), {"rng_state"})]
        assert [i for i, _ in mine["lr"]] == [3, 4]
        assert mine["lr"] == theirs["lr"]  # the same scheduler state: exactly equal
        assert len({lr for _, lr in mine["lr"]}) == 2  # the schedule decays
        start, start_want = mine["start"], theirs["start"]
        assert start["iteration"] == start_want["iteration"] == 2
        assert start["consumed_samples"] == start_want["consumed_samples"] == 2 * GLOBAL_BATCH
        assert start["scheduler_steps"] == start_want["scheduler_steps"] == 2 * GLOBAL_BATCH
        _same_state(start["optimizer"], start_want["optimizer"])
        moments = [s["exp_avg"] for _, s in start["optimizer"] if "exp_avg" in s]
        assert moments and any(m.abs().sum() > 0 for m in moments)  # not a fresh optimizer

    # The data: the stock job trained 2 x 4 samples of 512 tokens; HDP skips that many.
    tokens = 2 * GLOBAL_BATCH * SEQ_LENGTH
    batch, skipped = _expected_first_batch(got[0]["pristine"], tokens, steps=2)
    for mine in got:
        assert mine["first_batch"] == batch
    note = [line for line in got[0]["notes"] if "stock Megatron-LM" in line]
    assert len(note) == 1 and f"after the {tokens} tokens it trained" in note[0]
    assert f"skips its first {skipped} tokens" in note[0]
    assert not [line for line in got[1]["notes"] if "stock Megatron-LM" in line]  # rank 0 only


def _validate(monkeypatch, argv) -> argparse.Namespace:
    """Megatron-LM's real parser and the hooked `validate_args`, as at start-up (rank 0 of 2)."""
    from megatron.training import arguments

    from megatron_hdp.megatron_lm.hooks import _checked_validate_args, with_hdp_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    args = arguments.parse_args(with_hdp_args(None))
    _checked_validate_args(arguments.validate_args)(args, {})
    return args


def test_a_stock_checkpoint_of_another_shape_is_refused_at_startup(
    trees, data, stock_checkpoint, monkeypatch, capsys
):
    """Before any process group: the shape stock Megatron-LM stored with its checkpoint is
    compared by flag."""
    import torch.distributed as dist

    ckpt, ckpt_format = stock_checkpoint
    argv = [*_flags(data, ckpt_format), "--load", ckpt, "--hdp"]
    with pytest.raises(SystemExit) as exit_info:
        _validate(monkeypatch, [*argv, "--ffn-hidden-size", "192"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--ffn-hidden-size: 128 -> 192" in err and "iteration 2" in err
    assert not dist.is_initialized()
    assert _validate(monkeypatch, argv).hdp_checked  # the checkpoint's shape passes


def test_an_hdp_checkpoint_without_its_data_position_is_refused_at_startup(
    trees, data, tmp_path, monkeypatch, capsys
):
    """An --hdp job's checkpoint whose data-position file was lost: refused before any
    process group, naming the file (it was refused only after the model was built); with
    --finetune (the data from its start) it passes."""
    _, patched = trees
    ckpt = str(tmp_path / "hdp")
    flags = [*_flags(data), "--hdp"]
    run_megatron_lm(
        patched / "pretrain_gpt.py",
        2,
        [*flags, "--exit-interval", "1", "--save", ckpt, "--save-interval", "1"],
        timeout_s=240,
    )
    (state,) = glob.glob(os.path.join(ckpt, "iter_0000001", "*", "train_dataloader_dprank000.pt"))
    os.remove(state)
    with pytest.raises(SystemExit) as exit_info:
        _validate(monkeypatch, [*flags, "--load", ckpt])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "written by an --hdp job" in err and state in err
    assert _validate(monkeypatch, [*flags, "--load", ckpt, "--finetune"]).hdp_checked

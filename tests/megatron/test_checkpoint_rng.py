"""Checkpoints carry Megatron's model-parallel CUDA RNG tracker states, as Megatron-LM's do.

The tracker (`megatron.core.tensor_parallel.random.CudaRNGStatesTracker`) is only seeded on
CUDA, so these tests give the real tracker states through its own `set_states` (CPU
generator states stand in for CUDA ones: the tracker stores them without looking inside)
and check that a save and a load bring back exactly each rank's states.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from tests.dist import run_ranks
from tests.e2e.harness import tiny_engine

NAMES = ("model-parallel-rng", "data-parallel-rng", "expert-parallel-rng")


def _states(seed: int) -> dict:
    """Distinct generator states, one per tracker name."""
    return {
        name: torch.Generator().manual_seed(seed * 10 + i).get_state()
        for i, name in enumerate(NAMES)
    }


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _body_round_trip(rank, world_size, folder):
    from megatron_hdp.megatron import checkpoint

    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tiny_engine() as engine:
        group = dist.group.WORLD
        try:
            mine = _states(100 + rank)  # TP ranks hold different model-parallel states
            tracker.reset()
            tracker.set_states(dict(mine))
            checkpoint.save_checkpoint(
                folder, engine, checkpoint.TrainingState(iteration=1, data_state={}), group=group
            )
            saved = torch.load(
                Path(folder) / "iter_0000001" / f"rng_rank{rank}.pt", weights_only=False
            )["cuda_tracker"]
            tracker.reset()
            tracker.set_states(_states(999))  # what a fresh start would have seeded
            checkpoint.load_checkpoint(folder, engine, group=group)
            restored = tracker.get_states()
            # The checkpoint's tensors are copies: using the tracker does not change them.
            restored[NAMES[0]].zero_()
            again = torch.load(
                Path(folder) / "iter_0000001" / f"rng_rank{rank}.pt", weights_only=False
            )["cuda_tracker"]
            return (
                _same(saved, mine),
                _same({**restored, NAMES[0]: mine[NAMES[0]]}, mine),
                (_same(again, mine)),
            )
        finally:
            tracker.reset()


@pytest.mark.parametrize("world_size", [1, 2])
def test_tracker_states_round_trip_per_rank(tmp_path, world_size):
    for saved, restored, untouched in run_ranks(
        _body_round_trip, world_size, str(tmp_path), timeout_s=60
    ):
        assert saved, "the checkpoint does not hold this rank's tracker states"
        assert restored, "load_checkpoint did not give the tracker the saved states"
        assert untouched, "the saved states share storage with the live tracker"


def _body_old_checkpoint(rank, world_size, folder):
    from megatron_hdp.megatron import checkpoint

    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tiny_engine() as engine:
        group = dist.group.WORLD
        try:
            tracker.reset()
            checkpoint.save_checkpoint(
                folder, engine, checkpoint.TrainingState(iteration=3, data_state={}), group=group
            )
            rng_file = Path(folder) / "iter_0000003" / f"rng_rank{rank}.pt"
            written = torch.load(rng_file, weights_only=False)
            empty_saved_as_none = written["cuda_tracker"] is None
            del written["cuda_tracker"]  # the layout of checkpoints from before this field
            torch.save(written, rng_file)
            torch.manual_seed(4321)
            before = torch.get_rng_state()
            seeded = _states(7)
            tracker.set_states(dict(seeded))
            state, _ = checkpoint.load_checkpoint(folder, engine, group=group)
            return (
                empty_saved_as_none,
                state.iteration,
                _same(tracker.get_states(), seeded),
                torch.equal(torch.get_rng_state(), written["torch"])
                and not torch.equal(before, written["torch"]),
            )
        finally:
            tracker.reset()


def test_checkpoint_without_tracker_states_resumes_as_before(tmp_path):
    for empty_none, iteration, kept, torch_restored in run_ranks(
        _body_old_checkpoint, 2, str(tmp_path), timeout_s=60
    ):
        assert empty_none, "an empty tracker (a CPU run) should be saved as None"
        assert iteration == 3
        assert kept, "an old checkpoint must leave the tracker's seeded states alone"
        assert torch_restored, "the other RNG states are restored as before"

"""Checkpoints carry Megatron's model-parallel CUDA RNG tracker states, as Megatron-LM's do.

The tracker (`megatron.core.tensor_parallel.random.CudaRNGStatesTracker`) is only seeded on
CUDA, so these tests give the real tracker states through its own `set_states` (CPU
generator states stand in for CUDA ones: the tracker stores them without looking inside)
and check that a save and a load bring back exactly each rank's states. The last test runs
the tracker's own `add` and `fork` with its CUDA generator calls pointed at a CPU generator,
so a resumed job's dropout draws can be compared with the uninterrupted job's.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

from tests.dist import run_ranks
from tests.e2e.harness import tiny_engine

# Taken at import, before any test applies the CPU shims.
REAL_FORK = CudaRNGStatesTracker.fork
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
            mine = _states(100 + rank)  # every rank holds different states
            tracker.reset()
            tracker.set_states(dict(mine))
            checkpoint.save_checkpoint(
                folder, engine, checkpoint.TrainingState(iteration=1, data_state={}), group=group
            )
            tracker.reset()
            tracker.set_states(_states(999))  # what a fresh start would have seeded
            checkpoint.load_checkpoint(folder, engine, group=group)
            restored = tracker.get_states()
            first = _same(restored, mine)
            # The checkpoint's states are copies: using the tracker does not change them.
            restored[NAMES[0]].zero_()
            tracker.reset()
            checkpoint.load_checkpoint(folder, engine, group=group)
            return first, _same(tracker.get_states(), mine)
        finally:
            tracker.reset()


@pytest.mark.parametrize("world_size", [1, 2])
def test_tracker_states_round_trip_per_rank(tmp_path, world_size):
    for restored, untouched in run_ranks(_body_round_trip, world_size, str(tmp_path), timeout_s=60):
        assert restored, "load_checkpoint did not give the tracker this rank's saved states"
        assert untouched, "the saved states share storage with the live tracker"


def _body_old_checkpoint(rank, world_size, folder):
    from megatron_hdp.megatron import checkpoint
    from tests.megatron.legacy_writer import write_legacy

    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tiny_engine() as engine:
        group = dist.group.WORLD
        try:
            tracker.reset()
            torch.manual_seed(1000 + rank)
            written = torch.get_rng_state()
            write_legacy(folder, engine, 3, {"at": 3})  # without tracker states
            torch.manual_seed(4321)
            seeded = _states(7)
            tracker.set_states(dict(seeded))
            state, _ = checkpoint.load_checkpoint(folder, engine, group=group)
            return (
                state.iteration,
                state.data_state,
                _same(tracker.get_states(), seeded),
                torch.equal(torch.get_rng_state(), written),
            )
        finally:
            tracker.reset()


def test_a_checkpoint_of_the_old_per_rank_format_still_resumes(tmp_path):
    for iteration, data_state, kept, torch_restored in run_ranks(
        _body_old_checkpoint, 2, str(tmp_path), timeout_s=60
    ):
        assert (iteration, data_state) == (3, {"at": 3})
        assert kept, "an old checkpoint without tracker states leaves the tracker alone"
        assert torch_restored, "the old format's per-rank RNG states are restored"


class StandInCudaGenerator:
    """Megatron's tracker's four CUDA generator calls, on a CPU generator standing in for
    the GPU's default generator (signatures copied from megatron/core/tensor_parallel/
    random.py and torch.cuda), so the tracker's real `add` and `fork` run on CPU."""

    def __init__(self, undo: list):
        from megatron.core.tensor_parallel import random as tracker_module

        self.generator = torch.Generator().manual_seed(0)
        gen = self.generator

        def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
            return gen.get_state()

        def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
            gen.set_state(new_state)

        def get_rng_state(device="cuda"):
            return gen.get_state()

        def manual_seed(seed):
            gen.manual_seed(seed)

        for owner, name, fn in (
            (tracker_module, "_get_cuda_rng_state", _get_cuda_rng_state),
            (tracker_module, "_set_cuda_rng_state", _set_cuda_rng_state),
            (torch.cuda, "get_rng_state", get_rng_state),
            (torch.cuda, "manual_seed", manual_seed),
        ):
            undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, fn)

    def draw(self, tracker, name="model-parallel-rng") -> torch.Tensor:
        """What a dropout inside `tracker.fork(name)` draws from the GPU generator.

        The tracker's own `fork` (the CPU shims, active in `tiny_engine`, replace it with a
        no-op since CPU runs have no CUDA generator).
        """
        with REAL_FORK(tracker, name):
            return torch.rand(4, generator=self.generator)


def _body_fork_resumes(rank, world_size, folder):
    from megatron_hdp.megatron import checkpoint

    undo = []
    tracker = tensor_parallel.get_cuda_rng_tracker()
    try:
        cuda = StandInCudaGenerator(undo)
        with tiny_engine() as engine:
            group = dist.group.WORLD
            tracker.reset()
            tracker.add("model-parallel-rng", 2718 + rank)  # as model_parallel_cuda_manual_seed
            tracker.add("data-parallel-rng", 1234)
            before = [cuda.draw(tracker) for _ in range(2)]
            checkpoint.save_checkpoint(
                folder, engine, checkpoint.TrainingState(iteration=2, data_state={}), group=group
            )
            straight = [cuda.draw(tracker) for _ in range(3)] + [
                cuda.draw(tracker, "data-parallel-rng")
            ]
            # A restarted job: the tracker seeded afresh, then the checkpoint loaded.
            tracker.reset()
            tracker.add("model-parallel-rng", 2718 + rank)
            tracker.add("data-parallel-rng", 1234)
            fresh = cuda.draw(tracker)
            tracker.reset()
            tracker.add("model-parallel-rng", 2718 + rank)
            tracker.add("data-parallel-rng", 1234)
            checkpoint.load_checkpoint(folder, engine, group=group)
            resumed = [cuda.draw(tracker) for _ in range(3)] + [
                cuda.draw(tracker, "data-parallel-rng")
            ]
            return before, straight, resumed, fresh
    finally:
        tracker.reset()
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


def test_dropout_draws_after_a_resume_continue_the_uninterrupted_sequence(tmp_path):
    """The tracker's own add/fork with the GPU generator replaced by a CPU one: the draws of
    a resumed job are those the uninterrupted job made, not a fresh seed's."""
    results = run_ranks(_body_fork_resumes, 2, str(tmp_path), timeout_s=60)
    for before, straight, resumed, fresh in results:
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b)
        assert not torch.equal(fresh, straight[0])  # a fresh seed would repeat step 1's draws
        assert torch.equal(fresh, before[0])
    assert not torch.equal(results[0][1][0], results[1][1][0])  # per-rank model-parallel seeds

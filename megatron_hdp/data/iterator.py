"""The Megatron-LM drop-in's data iterator (`--dataloader-type external`).

`HDPDataIterator` yields one `HDPGlobalBatch` per training step through the same
`GlobalBatchLoader` as `pretrain_hdp.py`: sampler -> plan -> this rank's tokens, prepared
`prefetch_depth` steps ahead in a background thread. `megatron.schedule.
hdp_forward_backward` consumes it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megatron_hdp.data.batching import LocalBatch, TokenSource
from megatron_hdp.data.loader import GlobalBatchLoader
from megatron_hdp.data.sampler import TokenBudgetSampler
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.plan import StepPlan


@dataclass(frozen=True)
class HDPGlobalBatch:
    """One training step's global batch: its plan and where its tokens come from.

    `local` is pool rank `rank`'s micro-batches read ahead (host tensors) and `read_error`
    a read failure to raise in the step; all None when not read ahead.
    """

    plan: StepPlan
    source: TokenSource
    local: list[LocalBatch] | None = None
    read_error: ValueError | None = None
    rank: int | None = None


class HDPDataIterator:
    """Yields one `HDPGlobalBatch` per step from a sampler over indexed datasets.

    Every rank builds the same iterator (same sampler, same seed) and so the same plans;
    no rank reads another's tokens.

    Args:
        sampler: The token-budget sampler (lengths only).
        datasets: Readers of the sampler's datasets (`IndexedDataset`s).
        pool_size: Ranks in the HDP pool.
        capacity: Tokens per rank per micro-batch.
        policy: Placement policy name (`scheduler.POLICIES`).
        cp_size: CP size of the static policy.
        cost_model: Prices micro-batches for the balanced policy (`cost.CostModel`).
        vocab_size: Refuse token ids outside the vocabulary (see `IndexedTokens`).
        pipeline_stages: Stages of each replica (PP); > 1 plans lock-step pipelines.
        pool_rank: This rank's pool rank (`ParallelLayout.pool_rank`): its tokens are read
            ahead with the plan. None: planned ahead, read in the step.
        prefetch_depth: Steps prepared ahead in a background thread (0: none).
        virtual_stages: Model chunks per stage (interleaved 1F1B): PP-Balance prices its fill.
        mtp_depth: Multi-token prediction depths (`--mtp-num-layers`; 0: none): the
            micro-batches read ahead carry their shifted targets (`LocalBatch.shifted`).
    """

    def __init__(
        self,
        sampler: TokenBudgetSampler,
        datasets: Sequence,
        *,
        pool_size: int,
        capacity: int,
        policy: str = "balanced",
        cp_size: int | None = None,
        cost_model=None,
        vocab_size: int | None = None,
        pipeline_stages: int = 1,
        pool_rank: int | None = None,
        prefetch_depth: int = 2,
        virtual_stages: int = 1,
        mtp_depth: int = 0,
    ) -> None:
        self.sampler = sampler
        self.mtp_depth = mtp_depth
        self.datasets = list(datasets)
        self.vocab_size, self.pool_rank, self.prefetch_depth = vocab_size, pool_rank, prefetch_depth
        self.plan = functools.partial(
            plan_step,
            pool_size=pool_size,
            capacity=capacity,
            policy=policy,
            cp_size=cp_size,
            cost_model=cost_model,
            pipeline_stages=pipeline_stages,
            **({"virtual_stages": virtual_stages} if virtual_stages != 1 else {}),
        )
        self._loader: GlobalBatchLoader | None = None

    def __iter__(self) -> Iterator[HDPGlobalBatch]:
        return self

    def _feed(self) -> GlobalBatchLoader:
        if self._loader is None:
            self._loader = GlobalBatchLoader(
                self.sampler,
                self.plan,
                self.datasets,
                rank=self.pool_rank,
                vocab_size=self.vocab_size,
                depth=self.prefetch_depth,
                mtp_depth=self.mtp_depth,
            )
        return self._loader

    def state_dict(self) -> dict:
        """The sampler position after the last batch handed out, for your checkpoint.

        Megatron-LM does not know an external loader's position. Batches prepared ahead
        are not counted.
        """
        if self._loader is None:
            return self.sampler.state_dict()
        return self._loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` after loading a checkpoint."""
        self.close()
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        """Stop the background thread; the sampler continues after the last batch handed out.

        Call it before saving a checkpoint you will resume from, or let the thread die with
        the job.
        """
        if self._loader is not None:
            self._loader.close()
            self._loader = None

    def __next__(self) -> HDPGlobalBatch:
        item = self._feed().next()
        if item.error is not None:
            raise item.error
        plan, source, read, _ = item.value
        local, error = read if read is not None else (None, None)
        return HDPGlobalBatch(
            plan=plan, source=source, local=local, read_error=error, rank=self.pool_rank
        )

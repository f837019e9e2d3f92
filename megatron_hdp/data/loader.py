"""The one path from the sampler to a step's plan and this rank's tokens.

`GlobalBatchLoader` is how both the training job (`megatron.trainer.Trainer`) and the
Megatron-LM drop-in (`data.iterator.HDPDataIterator`) get their batches:

    sampler (lengths)  ->  plan (every rank the same)  ->  this rank's tokens (read_local)

up to `depth` batches ahead in a background thread (`data.prefetch.Prefetcher`). With the
Ray data service the first two come from the planner actor (`service.client.RemoteBatches`)
and the tokens from the source loaders; the rest is the same code. No collective runs here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_hdp.data.batching import IndexedTokens, read_local
from megatron_hdp.data.prefetch import Prefetcher, Prepared
from megatron_hdp.data.service.client import PlannedBatch

__all__ = ["GlobalBatchLoader", "Prepared"]


class GlobalBatchLoader:
    """Plans each global batch and reads this rank's tokens, ahead of the step.

    Args:
        batches: A sampler (`TokenBudgetSampler`) or the Ray service's `RemoteBatches`.
        plan: Sequence lengths -> `StepPlan` (the same function on every rank).
        readers: One token reader per dataset of the sampler (`IndexedDataset`s).
        rank: This rank's pool rank: its micro-batches are read ahead. None: only plan
            (the consumer reads from the batch's token source itself).
        vocab_size: Refuse token ids outside the vocabulary (see `IndexedTokens`).
        depth: Batches prepared ahead (0: when asked for, no thread).
        service: The Ray data service's client when `batches` comes from it.
        annotate: Optional local work on each plan, done ahead with it (the trainer's
            cost-model predictions for the metrics file); its result is `notes`.
        mtp_depth: Multi-token prediction depths (`--mtp-num-layers`; 0: none): each local
            piece is read with the tokens after it (`batching.gather_local_batch`).

    `next()` returns a `Prepared` whose `value` is `(plan, token source, (local batches,
    read error), notes)`; a read error (a bad token, or a fetch from the Ray service that failed
    after its retries) is handed over, not raised, so that the step's all-reduce can raise
    it on every rank together.
    """

    def __init__(
        self,
        batches,
        plan: Callable,
        readers: Sequence,
        *,
        rank: int | None,
        vocab_size: int | None = None,
        depth: int = 2,
        service=None,
        annotate: Callable | None = None,
        mtp_depth: int = 0,
    ) -> None:
        if service is not None and rank is None:
            raise ValueError("the Ray data service fetches a rank's own tokens: give its rank")
        if service is not None and mtp_depth:
            raise ValueError(
                "multi-token prediction (--mtp-num-layers) reads tokens after each local piece, "
                "which the Ray data service does not fetch: use --hdp-data-service none"
            )
        self.mtp_depth = mtp_depth
        self.plan, self.readers = plan, list(readers)
        self.rank, self.vocab_size, self.service = rank, vocab_size, service
        self.annotate = annotate
        self._feed = Prefetcher(batches, self._prepare, depth)

    def _prepare(self, batch):
        if isinstance(batch, PlannedBatch):
            plan, source = batch.plan, None
        else:
            plan = self.plan([u.length for u in batch])
            source = IndexedTokens(self.readers, batch, vocab_size=self.vocab_size)
        notes = self.annotate(plan) if self.annotate is not None else None
        if self.rank is None:
            return plan, source, None, notes
        try:
            if source is None:  # fetch this rank's token ranges from the source loaders
                source = self.service.tokens(
                    batch, self.rank, read_local, vocab_size=self.vocab_size
                )
            read = (read_local(plan, source, self.rank, mtp_depth=self.mtp_depth), None)
        except Exception as err:  # raised in the step, on every rank together
            read = ([], err)
        return plan, source, read, notes

    def next(self) -> Prepared:
        """The next batch, in sampler order (its `wait_s`: how long this call blocked).

        With the Ray data service the wait is reported to its planner (scaling policy).
        """
        item = self._feed.next()
        if self.service is not None:
            self.service.note_wait(item.wait_s)
        return item

    def state_dict(self) -> dict:
        """The sampler state after the last batch handed out (what a checkpoint stores)."""
        return self._feed.state_dict()

    def close(self) -> None:
        """Stop the background thread; batches prepared ahead are dropped.

        An in-process sampler is rewound to the last batch handed out, so that it (and a
        checkpoint of it) continues exactly after the batches that were used.
        """
        self._feed.close()
        sampler = self._feed.sampler
        if hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(self._feed.state_dict())

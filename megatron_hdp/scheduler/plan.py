"""Plan types: what every rank runs in one training step.

A `StepPlan` is a plain value (tuples, ints, floats, strings). Every rank derives the same
plan from the same inputs, and `StepPlan.digest()` lets ranks check that cheaply.

Vocabulary:
- *pool*: the `pool_size` ranks of hybrid data parallelism (DP x CP of a static mesh).
- *capacity*: the most tokens one rank holds in one micro-batch.
- *ring*: the ordered tuple of pool ranks that run one micro-batch together. A ring of one
  rank is a local micro-batch (no communication).
- *order*: a global sequence number. Every rank runs its micro-batches in increasing
  `order`; since all members of a ring agree on it, no rank can wait on a ring that one of
  its members will only reach after a ring that waits on this rank (deadlock freedom).
- *lock step* (pipeline parallelism): with PP an HDP rank is a whole pipeline running
  Megatron's 1F1B schedule, whose sequence of forward and backward passes on a stage depends
  only on the number of micro-batches M. A ring must run on the same stage of all its member
  pipelines at the same time, so a plan for pipelines must be *lock-step*: every member of a
  ring runs the same number of micro-batches and holds the ring at the same position of its
  list (`lockstep_problems`). Pipelines that share a ring (transitively) then execute the
  same op sequence on every stage and behave as one wider pipeline: no deadlock.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_hdp.sharding import rank_token_counts


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch: the sequences it holds and the ring of ranks that runs it.

    Attributes:
        order: Global sequence number; all members run their micro-batches by increasing order.
        ring: Pool ranks in ring order. Length 1 means a local micro-batch.
        seq_indices: Indices into `StepPlan.seqlens`, in packing order. On a ring every
            sequence is cut into `2 * len(ring)` chunks (zigzag, see `sharding.py`).
        offload_ratio: Fraction of saved activations to move to host memory (0 = none).
        predicted_cost: The planner's cost estimate for one member of the ring.
        predicted_start: When the planner expects the ring to start (0 if it does not say).
    """

    order: int
    ring: tuple[int, ...]
    seq_indices: tuple[int, ...]
    offload_ratio: float = 0.0
    predicted_cost: float = 0.0
    predicted_start: float = 0.0

    @property
    def cp_size(self) -> int:
        """Number of ranks that run this micro-batch together."""
        return len(self.ring)

    @property
    def is_local(self) -> bool:
        """True when one rank runs the micro-batch alone (no attention communication)."""
        return len(self.ring) == 1


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The plan of one step: every micro-batch of every rank of the pool.

    Attributes:
        pool_size: Number of ranks in the HDP pool.
        capacity: Token capacity per rank per micro-batch.
        seqlens: Length of every sequence of the global batch, in batch order.
        policy: Name of the placement policy that made the plan.
        micro_batches: All micro-batches, sorted by `order`.
        num_layers: Layers per rank, needed to check the memory of offloading micro-batches
            (0 when nothing offloads).
    """

    pool_size: int
    capacity: int
    seqlens: tuple[int, ...]
    policy: str
    micro_batches: tuple[MicroBatch, ...]
    num_layers: int = 0
    _by_rank: tuple[tuple[int, ...], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        by_rank: list[list[int]] = [[] for _ in range(self.pool_size)]
        for i, mb in enumerate(self.micro_batches):
            for r in mb.ring:
                if 0 <= r < self.pool_size:
                    by_rank[r].append(i)
        object.__setattr__(self, "_by_rank", tuple(tuple(x) for x in by_rank))

    def for_rank(self, rank: int) -> tuple[MicroBatch, ...]:
        """The micro-batches `rank` runs, in the order it must run them."""
        if not 0 <= rank < self.pool_size:
            raise ValueError(f"rank {rank} is outside the pool of {self.pool_size} ranks")
        return tuple(self.micro_batches[i] for i in self._by_rank[rank])

    def num_micro_batches_per_rank(self) -> list[int]:
        """How many micro-batches each rank runs."""
        return [len(x) for x in self._by_rank]

    def total_tokens(self) -> int:
        """Tokens in the global batch."""
        return sum(self.seqlens)

    def to_dict(self) -> dict:
        """A JSON-serialisable dict; `StepPlan.from_dict` inverts it."""
        return {
            "pool_size": self.pool_size,
            "capacity": self.capacity,
            "seqlens": list(self.seqlens),
            "policy": self.policy,
            "num_layers": self.num_layers,
            "micro_batches": [
                {
                    "order": mb.order,
                    "ring": list(mb.ring),
                    "seq_indices": list(mb.seq_indices),
                    "offload_ratio": mb.offload_ratio,
                    "predicted_cost": mb.predicted_cost,
                    "predicted_start": mb.predicted_start,
                }
                for mb in self.micro_batches
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> StepPlan:
        """Rebuild a plan from `to_dict` output."""
        return cls(
            pool_size=int(data["pool_size"]),
            capacity=int(data["capacity"]),
            seqlens=tuple(int(s) for s in data["seqlens"]),
            policy=str(data["policy"]),
            num_layers=int(data.get("num_layers", 0)),
            micro_batches=tuple(
                MicroBatch(
                    order=int(m["order"]),
                    ring=tuple(int(r) for r in m["ring"]),
                    seq_indices=tuple(int(i) for i in m["seq_indices"]),
                    offload_ratio=float(m.get("offload_ratio", 0.0)),
                    predicted_cost=float(m.get("predicted_cost", 0.0)),
                    predicted_start=float(m.get("predicted_start", 0.0)),
                )
                for m in data["micro_batches"]
            ),
        )

    def to_json(self) -> str:
        """Canonical JSON text of the plan."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """A short hash of the canonical JSON; equal plans have equal digests."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def check_pool(self, pool_size: int) -> None:
        """The cheap check before a step runs: the plan is for this pool, its inputs valid.

        Raises ValueError. O(sequences); `validate()` checks every invariant, O(plan).
        """
        if pool_size != self.pool_size:
            raise ValueError(
                f"plan is for a pool of {self.pool_size} ranks, but this pool has {pool_size}"
            )
        validate_inputs(self.seqlens, self.pool_size, self.capacity)

    def validate(self, *, pool_size: int | None = None) -> None:
        """Check the plan's invariants; raise ValueError naming the first broken one.

        Checked: the plan is for `pool_size` ranks (when given); the lengths, pool size and
        capacity are valid planner inputs; every sequence is placed
        exactly once; rings hold distinct ranks inside the pool; orders are strictly
        increasing; no rank holds more than `capacity` tokens in any micro-batch.
        """
        if pool_size is not None and pool_size != self.pool_size:
            raise ValueError(
                f"plan is for a pool of {self.pool_size} ranks, but this pool has {pool_size}"
            )
        validate_inputs(self.seqlens, self.pool_size, self.capacity)
        seen = [0] * len(self.seqlens)
        last_order = None
        for mb in self.micro_batches:
            if last_order is not None and mb.order <= last_order:
                raise ValueError(f"micro-batch orders are not increasing at order {mb.order}")
            last_order = mb.order
            if not mb.ring or len(set(mb.ring)) != len(mb.ring):
                raise ValueError(f"micro-batch {mb.order} has an empty or repeating ring {mb.ring}")
            for r in mb.ring:
                if not 0 <= r < self.pool_size:
                    raise ValueError(
                        f"micro-batch {mb.order} names rank {r}, outside the pool of "
                        f"{self.pool_size}"
                    )
            if not mb.seq_indices:
                raise ValueError(f"micro-batch {mb.order} holds no sequence")
            for i in mb.seq_indices:
                if not 0 <= i < len(self.seqlens):
                    raise ValueError(f"micro-batch {mb.order} names unknown sequence {i}")
                seen[i] += 1
            if not 0.0 <= mb.offload_ratio <= 1.0:
                raise ValueError(
                    f"micro-batch {mb.order} has offload_ratio {mb.offload_ratio} outside [0, 1]"
                )
            lengths = [self.seqlens[i] for i in mb.seq_indices]
            load = max(rank_token_counts(lengths, mb.cp_size))
            resident = load
            if mb.offload_ratio > 0:
                if mb.is_local or self.num_layers <= 2:
                    raise ValueError(
                        f"micro-batch {mb.order} offloads, but only rings offload and the plan "
                        f"needs num_layers > 2 (has {self.num_layers})"
                    )
                layers = self.num_layers
                resident = load * (2 + (1 - mb.offload_ratio) * (layers - 2)) / layers
            if resident > self.capacity * (1 + 1e-9):
                raise ValueError(
                    f"micro-batch {mb.order} keeps {resident:.0f} tokens' activations on one "
                    f"rank, over the capacity {self.capacity}"
                )
        for i, n in enumerate(seen):
            if n != 1:
                raise ValueError(f"sequence {i} is placed {n} times (must be exactly once)")


def lockstep_problems(plan: StepPlan) -> list[str]:
    """Why `plan` cannot run on pipelines in lock step (empty: it can), one line per ring.

    The rule: every member of a ring runs as many micro-batches as every other member and
    holds the ring at the same position of its micro-batch list (see the module docstring).
    A pipeline cannot skip a position, so every member must also get at least one token of
    the ring's sequences (zigzag split, `sharding.rank_token_counts`).
    """
    counts = plan.num_micro_batches_per_rank()
    positions: dict[int, dict[int, int]] = {}
    for rank in range(plan.pool_size):
        for pos, mb in enumerate(plan.for_rank(rank)):
            if not mb.is_local:
                positions.setdefault(mb.order, {})[rank] = pos
    problems = []
    for mb in plan.micro_batches:
        if not mb.is_local:
            tokens = rank_token_counts([plan.seqlens[i] for i in mb.seq_indices], mb.cp_size)
            if min(tokens) == 0:
                problems.append(
                    f"ring micro-batch {mb.order}: ring {mb.ring} gets tokens {tokens}; every "
                    "member of a pipelined ring needs at least one"
                )
    for order, where in positions.items():
        if len(set(where.values())) > 1 or len({counts[r] for r in where}) > 1:
            problems.append(
                f"ring micro-batch {order}: members at positions "
                f"{dict(sorted(where.items()))} of lists of "
                f"{ {r: counts[r] for r in sorted(where)} } micro-batches (lock step needs "
                "equal positions and equal counts)"
            )
    return problems


def _as_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def validate_inputs(seqlens: Sequence[int], pool_size: int, capacity: int) -> None:
    """Raise ValueError naming the bad value if the planner inputs cannot be planned."""
    pool_size = _as_int(pool_size, "pool_size")
    if pool_size < 1:
        raise ValueError(f"pool_size must be an integer >= 1, got {pool_size!r}")
    capacity = _as_int(capacity, "capacity (tokens per rank per micro-batch)")
    if capacity <= 0:
        raise ValueError(
            f"capacity (tokens per rank per micro-batch) must be > 0, got {capacity!r}"
        )
    if len(seqlens) == 0:
        raise ValueError("the global batch holds no sequence")
    limit = pool_size * capacity
    for i, s in enumerate(seqlens):
        s = _as_int(s, f"the length of sequence {i}")
        if s <= 0:
            raise ValueError(f"sequence {i} is empty (length {s}); every sequence needs >= 1 token")
        if s > limit:
            raise ValueError(
                f"sequence {i} has {s} tokens, more than the pool holds: "
                f"{pool_size} ranks x capacity {capacity} = {limit}"
            )


def plan_from_rank_lists(
    seqlens: Sequence[int],
    pool_size: int,
    capacity: int,
    policy: str,
    micro_batches: Sequence[MicroBatch],
    *,
    num_layers: int = 0,
) -> StepPlan:
    """Build a `StepPlan` from micro-batches given in any order (sorted by `order` here)."""
    return StepPlan(
        pool_size=pool_size,
        capacity=capacity,
        seqlens=tuple(int(s) for s in seqlens),
        policy=policy,
        micro_batches=tuple(sorted(micro_batches, key=lambda m: m.order)),
        num_layers=num_layers,
    )

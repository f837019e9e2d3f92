"""Plan types: what every rank runs in one training step.

A `StepPlan` is a value held as columns (read-only numpy arrays straight from the planner
core; `MicroBatch` objects are views made on demand). Every rank derives the same plan from
the same inputs, and `StepPlan.digest()` lets ranks check that.

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
from dataclasses import dataclass

import numpy as np

from megatron_hdp.sharding import rank_token_counts

try:
    from megatron_hdp._planner import exact_int_array as _exact_int_array
except ImportError:  # without the C++ extension lengths are read in Python
    _exact_int_array = None


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


class StepPlan:
    """The plan of one step: every micro-batch of every rank of the pool, as columns.

    Micro-batch `m` (0-based, in global order) runs on
    `ring_ranks[ring_offsets[m]:ring_offsets[m + 1]]` and holds the sequences
    `seq_ids[seq_offsets[m]:seq_offsets[m + 1]]`; `order`, `offload_ratio`,
    `predicted_cost` and `predicted_start` hold one value per micro-batch. The arrays are
    read-only. `MicroBatch` objects are views made on demand: `for_rank` makes only its
    rank's, in time proportional to their number; `micro_batches` makes them all, once.

    Attributes:
        pool_size: Number of ranks in the HDP pool.
        capacity: Token capacity per rank per micro-batch.
        policy: Name of the placement policy that made the plan.
        num_layers: Layers per rank, needed to check the memory of offloading micro-batches
            (0 when nothing offloads).
        lengths: Length of every sequence of the global batch, in batch order (int64);
            `seqlens` is the same as a tuple.
    """

    COLUMNS = (
        "order",
        "ring_offsets",
        "ring_ranks",
        "seq_offsets",
        "seq_ids",
        "offload_ratio",
        "predicted_cost",
        "predicted_start",
    )

    def __init__(
        self,
        *,
        pool_size: int,
        capacity: int,
        seqlens,
        policy: str,
        order,
        ring_offsets,
        ring_ranks,
        seq_offsets,
        seq_ids,
        offload_ratio=None,
        predicted_cost=None,
        predicted_start=None,
        num_layers: int = 0,
    ) -> None:
        self.pool_size = int(pool_size)
        self.capacity = int(capacity)
        self.policy = str(policy)
        self.num_layers = int(num_layers)
        self.lengths = _frozen(seqlens, np.int64)
        self.order = _frozen(order, np.int64)
        m = len(self.order)
        self.ring_offsets = _frozen(ring_offsets, np.int64)
        self.ring_ranks = _frozen(ring_ranks, np.int64)
        self.seq_offsets = _frozen(seq_offsets, np.int64)
        self.seq_ids = _frozen(seq_ids, np.int64)
        zeros = np.zeros(m, dtype=np.float64)
        self.offload_ratio = _frozen(zeros if offload_ratio is None else offload_ratio, np.float64)
        self.predicted_cost = _frozen(
            zeros if predicted_cost is None else predicted_cost, np.float64
        )
        self.predicted_start = _frozen(
            zeros if predicted_start is None else predicted_start, np.float64
        )
        for name, offsets, flat in (
            ("ring", self.ring_offsets, self.ring_ranks),
            ("seq", self.seq_offsets, self.seq_ids),
        ):
            if len(offsets) != m + 1 or offsets[0] != 0 or offsets[-1] != len(flat):
                raise ValueError(
                    f"{name}_offsets must hold {m + 1} entries from 0 to {len(flat)}, got "
                    f"{len(offsets)} entries"
                )
        for name in ("offload_ratio", "predicted_cost", "predicted_start"):
            if len(getattr(self, name)) != m:
                raise ValueError(f"{name} must hold {m} entries, got {len(getattr(self, name))}")
        self._seqlens = None
        self._micro_batches = None
        #: With `plan_step(..., offload=True)`: what the planner chose and why
        #: (`offload_choice.OffloadDecision`); None otherwise. Not part of the plan's JSON.
        self.offload_decision = None
        self._rank_offsets, self._rank_items = _rank_index(
            self.ring_offsets, self.ring_ranks, self.pool_size
        )

    @classmethod
    def from_micro_batches(
        cls,
        seqlens: Sequence[int],
        pool_size: int,
        capacity: int,
        policy: str,
        micro_batches: Sequence[MicroBatch],
        *,
        num_layers: int = 0,
    ) -> StepPlan:
        """The plan of these micro-batches, kept in the given order."""
        rings = [mb.ring for mb in micro_batches]
        seqs = [mb.seq_indices for mb in micro_batches]
        plan = cls(
            pool_size=pool_size,
            capacity=capacity,
            seqlens=seqlens,
            policy=policy,
            order=[mb.order for mb in micro_batches],
            ring_offsets=_offsets(rings),
            ring_ranks=[r for ring in rings for r in ring],
            seq_offsets=_offsets(seqs),
            seq_ids=[i for s in seqs for i in s],
            offload_ratio=[mb.offload_ratio for mb in micro_batches],
            predicted_cost=[mb.predicted_cost for mb in micro_batches],
            predicted_start=[mb.predicted_start for mb in micro_batches],
            num_layers=num_layers,
        )
        plan._micro_batches = tuple(micro_batches)
        return plan

    def replace(self, **changes) -> StepPlan:
        """A copy with some attributes or columns replaced (`policy`, `predicted_start`...)."""
        values = {
            "pool_size": self.pool_size,
            "capacity": self.capacity,
            "seqlens": self.lengths,
            "policy": self.policy,
            "num_layers": self.num_layers,
            **{name: getattr(self, name) for name in self.COLUMNS},
        }
        unknown = set(changes) - set(values)
        if unknown:
            raise TypeError(f"StepPlan has no attribute(s) {sorted(unknown)} to replace")
        values.update(changes)
        return StepPlan(**values)

    @property
    def seqlens(self) -> tuple[int, ...]:
        """Length of every sequence of the global batch, in batch order."""
        if self._seqlens is None:
            self._seqlens = tuple(self.lengths.tolist())
        return self._seqlens

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches in the plan (all ranks)."""
        return len(self.order)

    def micro_batch(self, m: int) -> MicroBatch:
        """A view of micro-batch `m` (0-based position in the global order)."""
        if self._micro_batches is not None:
            return self._micro_batches[m]
        ro, so = self.ring_offsets, self.seq_offsets
        return MicroBatch(
            order=int(self.order[m]),
            ring=tuple(self.ring_ranks[ro[m] : ro[m + 1]].tolist()),
            seq_indices=tuple(self.seq_ids[so[m] : so[m + 1]].tolist()),
            offload_ratio=float(self.offload_ratio[m]),
            predicted_cost=float(self.predicted_cost[m]),
            predicted_start=float(self.predicted_start[m]),
        )

    @property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        """All micro-batches in global order (made once, O(plan) Python objects)."""
        if self._micro_batches is None:
            ranks, seqs = self.ring_ranks.tolist(), self.seq_ids.tolist()
            ro, so = self.ring_offsets.tolist(), self.seq_offsets.tolist()
            self._micro_batches = tuple(
                MicroBatch(
                    o, tuple(ranks[ro[m] : ro[m + 1]]), tuple(seqs[so[m] : so[m + 1]]), r, c, s
                )
                for m, (o, r, c, s) in enumerate(
                    zip(
                        self.order.tolist(),
                        self.offload_ratio.tolist(),
                        self.predicted_cost.tolist(),
                        self.predicted_start.tolist(),
                        strict=True,
                    )
                )
            )
        return self._micro_batches

    def rank_items(self, rank: int) -> np.ndarray:
        """Positions (in the global order) of the micro-batches `rank` runs, in order."""
        if not 0 <= rank < self.pool_size:
            raise ValueError(f"rank {rank} is outside the pool of {self.pool_size} ranks")
        return self._rank_items[self._rank_offsets[rank] : self._rank_offsets[rank + 1]]

    def for_rank(self, rank: int) -> tuple[MicroBatch, ...]:
        """The micro-batches `rank` runs, in the order it must run them."""
        return tuple(self.micro_batch(m) for m in self.rank_items(rank).tolist())

    def num_micro_batches_per_rank(self) -> list[int]:
        """How many micro-batches each rank runs."""
        return np.diff(self._rank_offsets).tolist()

    def ring_sizes(self) -> np.ndarray:
        """Ranks of every micro-batch's ring (int64, one per micro-batch)."""
        return np.diff(self.ring_offsets)

    def total_tokens(self) -> int:
        """Tokens in the global batch."""
        return int(self.lengths.sum())

    def __eq__(self, other) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        return (
            (self.pool_size, self.capacity, self.policy, self.num_layers)
            == (other.pool_size, other.capacity, other.policy, other.num_layers)
            and np.array_equal(self.lengths, other.lengths)
            and all(np.array_equal(getattr(self, c), getattr(other, c)) for c in self.COLUMNS)
        )

    __hash__ = None

    def __repr__(self) -> str:
        return (
            f"StepPlan(policy={self.policy!r}, pool_size={self.pool_size}, "
            f"capacity={self.capacity}, sequences={len(self.lengths)}, "
            f"micro_batches={self.num_micro_batches}, num_layers={self.num_layers})"
        )

    def to_dict(self) -> dict:
        """A JSON-serialisable dict; `StepPlan.from_dict` inverts it."""
        return {
            "pool_size": self.pool_size,
            "capacity": self.capacity,
            "seqlens": self.lengths.tolist(),
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
        return cls.from_micro_batches(
            [int(s) for s in data["seqlens"]],
            int(data["pool_size"]),
            int(data["capacity"]),
            str(data["policy"]),
            [
                MicroBatch(
                    order=int(m["order"]),
                    ring=tuple(int(r) for r in m["ring"]),
                    seq_indices=tuple(int(i) for i in m["seq_indices"]),
                    offload_ratio=float(m.get("offload_ratio", 0.0)),
                    predicted_cost=float(m.get("predicted_cost", 0.0)),
                    predicted_start=float(m.get("predicted_start", 0.0)),
                )
                for m in data["micro_batches"]
            ],
            num_layers=int(data.get("num_layers", 0)),
        )

    def to_json(self) -> str:
        """Canonical JSON text of the plan."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """A short hash of the plan's values and columns; equal plans have equal digests.

        O(plan) in numpy (no JSON text): cheap enough to compare plans every step.
        """
        h = hashlib.sha256(
            json.dumps([self.pool_size, self.capacity, self.policy, self.num_layers]).encode()
        )
        for column in (self.lengths, *(getattr(self, c) for c in self.COLUMNS)):
            h.update(len(column).to_bytes(8, "little"))
            h.update(column.astype(column.dtype.newbyteorder("<"), copy=False).tobytes())
        return h.hexdigest()[:16]

    def check_pool(self, pool_size: int) -> None:
        """The cheap check before a step runs: the plan is for this pool, its inputs valid.

        Raises ValueError. O(sequences); `validate()` checks every invariant, O(plan).
        """
        if pool_size != self.pool_size:
            raise ValueError(
                f"plan is for a pool of {self.pool_size} ranks, but this pool has {pool_size}"
            )
        validate_inputs(self.lengths, self.pool_size, self.capacity)

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


def validate_inputs(seqlens: Sequence[int], pool_size: int, capacity: int) -> np.ndarray:
    """Raise ValueError naming the bad value if the planner inputs cannot be planned.

    Returns the lengths as an int64 array.
    """
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
    lengths = _integer_array(seqlens)
    if lengths is not None:
        bad = np.nonzero((lengths <= 0) | (lengths > limit))[0]
        if len(bad) == 0:
            return lengths.astype(np.int64, copy=False)
        seqlens = [int(lengths[bad[0]])]  # the loop below names it
        offset = int(bad[0])
    else:
        offset = 0
    for i, s in enumerate(seqlens, start=offset):
        s = _as_int(s, f"the length of sequence {i}")
        if s <= 0:
            raise ValueError(f"sequence {i} is empty (length {s}); every sequence needs >= 1 token")
        if s > limit:
            raise ValueError(
                f"sequence {i} has {s} tokens, more than the pool holds: "
                f"{pool_size} ranks x capacity {capacity} = {limit}"
            )
    return np.asarray([int(x) for x in seqlens], dtype=np.int64)


def _integer_array(seqlens) -> np.ndarray | None:
    """`seqlens` as an int64 array when every entry is an integer (not a bool), else None."""
    if isinstance(seqlens, np.ndarray):
        if seqlens.ndim == 1 and seqlens.dtype.kind in "iu":
            return seqlens
        return None
    if _exact_int_array is not None:
        fast = _exact_int_array(seqlens)  # a list of exact ints in one C pass
        if fast is not None:
            return fast
    types = set(map(type, seqlens))
    if not all(t is int or (issubclass(t, np.integer)) for t in types):
        return None
    try:
        return np.asarray(seqlens, dtype=np.int64)
    except OverflowError:
        return None


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
    return StepPlan.from_micro_batches(
        seqlens,
        pool_size,
        capacity,
        policy,
        sorted(micro_batches, key=lambda m: m.order),
        num_layers=num_layers,
    )


def _frozen(values, dtype) -> np.ndarray:
    """`values` as a read-only 1-d array of `dtype` (a copy unless it already is one)."""
    array = np.asarray(values, dtype=dtype)
    if array.ndim != 1:
        raise ValueError(f"plan columns are 1-d, got an array of shape {array.shape}")
    if array.flags.writeable:
        if array is values:
            array = array.copy()
        array.setflags(write=False)
    return array


def _offsets(groups) -> np.ndarray:
    """Start offsets of `groups` laid end to end (one entry more than groups, from 0)."""
    out = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum([len(g) for g in groups], out=out[1:])
    return out


def _rank_index(ring_offsets: np.ndarray, ring_ranks: np.ndarray, pool_size: int):
    """Per rank, the positions of its micro-batches in order (CSR: offsets, positions).

    Ranks outside the pool are left out (`StepPlan.validate` names them).
    """
    owner = np.repeat(np.arange(len(ring_offsets) - 1, dtype=np.int64), np.diff(ring_offsets))
    inside = (ring_ranks >= 0) & (ring_ranks < pool_size)
    if not inside.all():
        ranks, owner = ring_ranks[inside], owner[inside]
    else:
        ranks = ring_ranks
    # numpy sorts 16-bit keys stably by radix (about 10x faster than int64 keys).
    keys = ranks.astype(np.uint16) if pool_size <= 1 << 16 else ranks
    by_rank = np.argsort(keys, kind="stable")
    offsets = np.zeros(pool_size + 1, dtype=np.int64)
    np.cumsum(np.bincount(ranks, minlength=pool_size), out=offsets[1:])
    items = owner[by_rank]
    items.setflags(write=False)
    return offsets, items

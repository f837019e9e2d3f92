"""Partitioned, parallel fetch from the Ray data service gives the in-process batches.

A local Ray (`ray.init(num_cpus=4)`, logical CPUs on any machine) runs the planner actor
and the source loaders of three sources: synthetic documents with a CPU cost per token,
raw JSONL tokenized at read time (lengths index), and raw JSONL tokenized when opened (each
loader tokenizes only its own range, so a request routed to the wrong loader fails). Loader
counts are rotated so that every source runs with 1, 2 and 3 loaders. For every step and
both pool ranks the micro-batches read through the service are bit-identical to the
in-process loader's (`read_local` over the sources opened in this process), also when a
loader is killed mid-run and its shadow takes over its range.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np
import pytest

from megatron_hdp.data.batching import IndexedTokens, read_local
from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler
from megatron_hdp.data.sources import lengths_digest, open_source, token_partition
from megatron_hdp.data.spec import parse_spec
from megatron_hdp.scheduler import plan_step

ray = pytest.importorskip("ray")

STEPS = 4
SEQ = 128
PLAN = functools.partial(plan_step, pool_size=2, capacity=SEQ, policy="greedy")
#: Loaders of (synthetic, JSONL on read, JSONL on open) per run: each source gets 1, 2, 3.
COUNTS = [(1, 2, 3), (2, 3, 1), (3, 1, 2)]


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=4,  # logical: the loaders ask for 0.25 each (9 of them at most)
        object_store_memory=100_000_000,
        include_dashboard=False,
        log_to_driver=False,
        namespace="megatron_hdp",
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The spec's sources, their in-process readers and the open arguments."""
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(11)
    words = ["alpha", "beta", "gamma", "ring", "pack", "zigzag"]
    for name in ("read", "open"):
        with open(folder / f"{name}.jsonl", "w") as out:
            for k in range(24):
                text = " ".join(words[int(i)] for i in rng.integers(0, 6, int(rng.integers(2, 40))))
                out.write(json.dumps({"text": f"{name} {k}: {text}"}) + "\n")
    spec = parse_spec(
        {
            "sources": [
                {
                    "name": "syn",
                    "synthetic": {"documents": 30, "min_tokens": 8, "max_tokens": 300, "seed": 4,
                                  "cpu_us_per_token": 2.0},
                },
                {"name": "read", "jsonl": "read.jsonl", "tokenize": "on_read"},
                {"name": "open", "jsonl": "open.jsonl"},
            ]
        },
        base=folder,
    )  # fmt: skip
    open_args = {"tokenizer_type": "ByteLevel", "tokenizer_model": None, "cache_dir": folder}
    readers = [open_source(s, **open_args) for s in spec.sources]
    return spec.sources, readers, open_args


def _sampler(readers):
    streams = [
        DatasetUnits.from_documents(np.arange(len(r)), r.sequence_lengths, max_seq_length=SEQ)
        for r in readers
    ]
    return TokenBudgetSampler(streams, [1.0, 1.0, 1.0], seed=2, tokens_per_batch=600)


def _flat(batches) -> list[bytes]:
    return [
        b.tokens.numpy().tobytes() + b.labels.numpy().tobytes() + b.loss_mask.numpy().tobytes()
        for b in batches
    ]


@pytest.fixture(scope="module")
def reference(setup):
    _, readers, _ = setup
    sampler, out = _sampler(readers), []
    for _ in range(STEPS):
        units = sampler.next_batch()
        plan = PLAN([u.length for u in units])
        out.append([_flat(read_local(plan, IndexedTokens(readers, units), r)) for r in (0, 1)])
    return out


@pytest.mark.parametrize("counts", COUNTS, ids=lambda c: "loaders-" + "-".join(map(str, c)))
def test_partitioned_fetch_is_bit_identical_to_the_in_process_loader(
    local_ray, setup, reference, counts
):
    from megatron_hdp.data.service.actors import PlannerActor
    from megatron_hdp.data.service.client import RayDataService

    sources, readers, open_args = setup
    sources = [dataclasses.replace(s, loaders=n) for s, n in zip(sources, counts, strict=True)]
    lengths = [r.sequence_lengths for r in readers]
    planner = (
        ray.remote(PlannerActor)
        .options(num_cpus=0, max_restarts=0)
        .remote(_sampler(readers), PLAN, sources, open_args, 8, lengths)
    )
    try:
        service = RayDataService(planner, timeout_s=300)
        service.check_sources([s.name for s in sources], [lengths_digest(r) for r in readers])
        for got, n, length in zip(service.bounds, counts, lengths, strict=True):
            assert got.tolist() == token_partition(length, n).tolist()
        feed = service.batches({"steps": 0})
        kill = counts == COUNTS[1]  # a loader of the JSONL-on-read source dies at step 2
        first, end = (int(b) for b in service.bounds[1][1:3]) if kill else (0, 0)
        hit, fetched = False, [0, 0, 0]
        for step in range(STEPS):
            if step == 1 and kill:
                ray.kill(service.loaders[1][1], no_restart=True)
            batch = feed.next_batch()
            hit |= step >= 1 and any(u.dataset == 1 and first <= u.doc < end for u in batch.units)
            for rank in (0, 1):
                source = service.tokens(batch, rank, read_local)
                for k, ranges in enumerate(source.datasets):
                    fetched[k] += sum(len(piece) for piece in ranges.ranges.values())
                assert _flat(read_local(batch.plan, source, rank)) == reference[step][rank], (
                    f"step {step + 1}, rank {rank}"
                )
        replaced = ray.get(planner.status.remote())["replaced"]
        assert replaced == (1 if kill else 0)
        assert hit or not kill  # the killed loader's range was read after its death
        stats = service.loader_stats()
        assert [(r["source"], r["slot"], r["role"]) for r in stats] == [
            *((s.name, slot, "loader") for s, n in zip(sources, counts) for slot in range(n)),
            *((s.name, None, "shadow") for s in sources),
        ]
        if not kill:  # every token the ranks received was counted by the loader that sent it
            for k, s in enumerate(sources):
                served = [r for r in stats if r["source"] == s.name and r["role"] == "loader"]
                assert sum(r["tokens"] for r in served) == fetched[k] > 0
                assert all(tuple(r["docs"]) == bounds for r, bounds in zip(
                    served, zip(service.bounds[k][:-1].tolist(), service.bounds[k][1:].tolist())
                ))  # fmt: skip
            syn = [r for r in stats if r["source"] == "syn" and r["tokens"] > 0]
            assert all(r["cpu_s"] >= 2e-6 * r["tokens"] for r in syn)  # its declared CPU cost
            assert all(r.get("uss", 1) > 0 and 0 <= r["busy_share"] <= 1 for r in stats)
    finally:
        ray.kill(planner, no_restart=True)


def test_a_killed_planner_is_restarted_and_resumes_from_the_ranks_sampler_state(local_ray, setup):
    """Ray restarts a killed planner (`ray.kill`, as a crash); it starts new loaders and
    resumes after the oldest batch the rank keeps: the batches and tokens that follow are
    the in-process loader's. Killed again (its one restart spent), the next request is a
    DataServiceError naming the planner, in seconds, not a hang. One source, one loader
    (Ray actors are slow to start on 2 cores)."""
    import time

    from megatron_hdp.data.service.actors import PLANNER_RESTARTS, PlannerActor
    from megatron_hdp.data.service.client import RayDataService
    from megatron_hdp.errors import DataServiceError

    sources, readers, open_args = setup
    sources, readers = sources[:1], readers[:1]
    units = DatasetUnits.from_documents(
        np.arange(30), readers[0].sequence_lengths, max_seq_length=SEQ
    )
    sampler = lambda: TokenBudgetSampler([units], [1.0], seed=3, tokens_per_batch=400)  # noqa: E731
    local, reference = sampler(), []
    for _ in range(STEPS):
        drawn = local.next_batch()
        plan = PLAN([u.length for u in drawn])
        reference.append(
            [_flat(read_local(plan, IndexedTokens(readers, drawn), r)) for r in (0, 1)]
        )
    planner = (
        ray.remote(PlannerActor)
        .options(num_cpus=0, max_restarts=PLANNER_RESTARTS)
        .remote(sampler(), PLAN, sources, open_args, 2, [readers[0].sequence_lengths])
    )  # it keeps 2 batches: the rank sends the state of the one before the last
    try:
        service = RayDataService(planner, timeout_s=240)
        feed = service.batches({"steps": 0})
        for step in range(STEPS):
            if step == 2:
                ray.kill(planner, no_restart=False)
                start = time.monotonic()
            batch = feed.next_batch()
            for rank in (0, 1):
                source = service.tokens(batch, rank, read_local)
                assert _flat(read_local(batch.plan, source, rank)) == reference[step][rank], (
                    f"step {step + 1}, rank {rank}"
                )
            if step == 2:
                recovered_s = time.monotonic() - start
        status = ray.get(planner.status.remote())
        # Resumed after a batch the rank kept (1, or 2 where the kill took effect only after
        # batch 3 was handed out), not replayed from batch 0.
        assert status["restarted"] and status["resumed_from"] in (1, 2), status
        assert recovered_s < 120, recovered_s
        ray.kill(planner, no_restart=False)  # no restart left
        with pytest.raises(ray.exceptions.RayActorError):  # ray.kill takes effect soon after
            for _ in range(300):
                ray.get(planner.status.remote())
                time.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(DataServiceError, match="planner actor, asked for batch 5: the actor"):
            feed.next_batch()
        assert time.monotonic() - start < 30
    finally:
        ray.kill(planner, no_restart=True)


def test_the_cluster_builds_a_jsonl_lengths_index_once_and_names_a_bad_line(local_ray, tmp_path):
    """`service.indexer`: the lengths a rank gets from the cluster are the file's (UTF-8
    bytes + the end of document), the index is cached for the loaders, and a malformed
    line is a ValueError naming the source and the line, as the in-process reader's."""
    from megatron_hdp.data.lengths_only import open_lengths
    from megatron_hdp.data.service.indexer import cluster_lengths

    texts = ["one", "two words", "é"]
    (tmp_path / "ok.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    spec = parse_spec(
        {"sources": [{"name": "ok", "jsonl": "ok.jsonl"}, {"name": "bad", "jsonl": "bad.jsonl"}]},
        base=tmp_path,
    )
    open_args = {"tokenizer_type": "ByteLevel", "tokenizer_model": None, "cache_dir": tmp_path}
    build = cluster_lengths("unused:1", open_args, timeout_s=120)  # Ray is joined already
    assert build(spec.sources[0]).tolist() == [len(t.encode()) + 1 for t in texts]
    assert len(list((tmp_path / "lengths").glob("*.npz"))) == 1
    with pytest.raises(ValueError, match=r"data spec source 'bad': [^']*bad\.jsonl:2"):
        open_lengths(spec.sources[1], **open_args, build=build)

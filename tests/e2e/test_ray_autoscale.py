"""Scale events of the Ray data service keep every batch bit-identical (a real local Ray).

One run of the planner actor with two scalable sources (`loaders: {min: 1, max: 2}`):
synthetic documents with a read latency (any loader can serve any document) and raw JSONL
tokenized when opened (a loader holds only its own range, so a repartition opens new
loaders and routes to them only once they are open). Two pool ranks read every batch:

1. busy: the ranks fetch back to back, so the synthetic source's loader is busy and the
   policy scales it up (its warm shadow promoted); the JSONL source is scaled up by hand
   (`PlannerActor.scale`), which repartitions it onto newly opened loaders;
2. the loader the scale-up promoted is killed; its range goes to the new shadow;
3. idle: the ranks pause between batches, so the policy scales the synthetic source down;
   the JSONL source is scaled down by hand.

Every step's micro-batches equal the in-process loader's (`read_local` over the sources
opened here), and the scaling log has each decision with its reason.
"""

from __future__ import annotations

import json
import os
import re
import time

import numpy as np
import pytest

from megatron_hdp.data.batching import IndexedTokens, read_local
from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler
from megatron_hdp.data.sources import open_source
from megatron_hdp.data.spec import parse_spec
from megatron_hdp.scheduler import plan_step

ray = pytest.importorskip("ray")

SEQ = 128


def _plan(lengths):
    return plan_step(lengths, pool_size=2, capacity=SEQ, policy="greedy")


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=4,  # logical; the loaders ask for 0.25 each
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


def _wait_dead(actor, timeout_s: float = 60.0) -> None:
    """Return once `actor` answers no more (killed); AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.stats.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.2)
    raise AssertionError(f"actor {actor} still answers {timeout_s:g} s after its kill")


def _spec(folder):
    rng = np.random.default_rng(5)
    with open(folder / "open.jsonl", "w") as out:
        for k in range(24):
            out.write(json.dumps({"text": f"doc {k}: " + "ab " * int(rng.integers(2, 40))}) + "\n")
    scalable = {"min": 1, "max": 2}
    return parse_spec(
        {
            "sources": [
                {"name": "syn", "loaders": scalable, "synthetic": {
                    "documents": 40, "min_tokens": 8, "max_tokens": 200, "seed": 3,
                    "latency_us_per_token": 150.0}},
                {"name": "open", "jsonl": "open.jsonl", "loaders": scalable},
            ],
            "data_plane": {"cpus": 2, "interval_s": 0.2, "scale_up_busy": 0.5,
                           "scale_down_busy": 0.2, "patience": 1, "cooldown": 1},
        },
        base=folder,
    )  # fmt: skip


def _sampler(readers):
    streams = [
        DatasetUnits.from_documents(np.arange(len(r)), r.sequence_lengths, max_seq_length=SEQ)
        for r in readers
    ]
    return TokenBudgetSampler(streams, [1.0, 1.0], seed=2, tokens_per_batch=600)


def _flat(batches) -> list[bytes]:
    return [
        b.tokens.numpy().tobytes() + b.labels.numpy().tobytes() + b.loss_mask.numpy().tobytes()
        for b in batches
    ]


def test_scale_ups_downs_and_a_kill_keep_the_batches_bit_identical(local_ray, tmp_path):
    from megatron_hdp.data.service.actors import PlannerActor
    from megatron_hdp.data.service.client import RayDataService

    spec = _spec(tmp_path)
    open_args = {"tokenizer_type": "ByteLevel", "tokenizer_model": None, "cache_dir": tmp_path}
    readers = [open_source(s, **open_args) for s in spec.sources]
    mine = _sampler(readers)  # the in-process loader, in step with the service
    planner = (
        ray.remote(PlannerActor)
        .options(num_cpus=0, max_restarts=0)
        .remote(_sampler(readers), _plan, spec.sources, open_args, 8,
                [r.sequence_lengths for r in readers], spec.plane)
    )  # fmt: skip
    status = lambda: ray.get(planner.status.remote())  # noqa: E731
    try:
        service = RayDataService(planner, timeout_s=300)
        feed, steps = service.batches({"steps": 0}), 0

        def step(pause: float = 0.0) -> None:
            nonlocal steps
            time.sleep(pause)
            batch, units = feed.next_batch(), mine.next_batch()
            steps += 1
            assert batch.units == units, f"step {steps}"
            for rank in (0, 1):
                got = read_local(batch.plan, service.tokens(batch, rank, read_local), rank)
                want = read_local(batch.plan, IndexedTokens(readers, units), rank)
                assert _flat(got) == _flat(want), f"step {steps}, rank {rank}"
            service.note_wait(0.01)  # reported with the next batch request

        # 1. busy: the policy scales the synthetic source up; the JSONL source by hand
        while status()["loaders"]["syn"] < 2:
            assert steps < 40, "the synthetic source was never scaled up"
            step()
        ray.get(planner.scale.remote("open", 2, "the test asks for 2"))
        while status()["loaders"]["open"] < 2:  # routed once its new loaders have opened
            assert steps < 80, "the JSONL source's new loaders never took over"
            step()
        routing = status()["routing"]
        # 2. the promoted shadow (slot 1 of syn) dies; the new shadow takes its range
        victim = service.loaders[0][1]
        ray.kill(victim, no_restart=True)
        _wait_dead(victim)  # a kill takes effect asynchronously (slowly on a loaded machine)
        for _ in range(2):
            step()
        while status()["replaced"] < 1:  # the first read that the dead loader owned replaces it
            assert steps < 100, f"the killed loader was never replaced: {status()}"
            step()
        assert status()["replaced"] == 1 and status()["routing"] > routing
        # 3. idle: the policy scales the synthetic source down; the JSONL source by hand
        ray.get(planner.scale.remote("open", 1, "the test asks for 1"))
        while status()["loaders"]["syn"] > 1 or status()["loaders"]["open"] > 1:
            assert steps < 120, f"no scale-down: {status()}"
            step(pause=0.3)
        step()
        log = ray.get(planner.scaling_log.remote())
        moves = [(d["source"], d["before"], d["after"]) for d in log["decisions"]]
        assert ("syn", 1, 2) in moves and ("syn", 2, 1) in moves
        assert ("open", 1, 2) in moves and ("open", 2, 1) in moves
        reasons = {(d["source"], d["after"]): d["reason"] for d in log["decisions"]}
        assert re.search(  # busy, or the ranks' reported wait (note_wait) attributed to it
            r"busy \d+% \(>= 50%\)|waited \d+% of their time on its reads \(>= 5%\)",
            reasons[("syn", 2)],
        )
        assert "< 20%" in reasons[("syn", 1)] and reasons[("open", 2)] == "the test asks for 2"
        assert any(s["wait"]["syn"] + s["wait"]["open"] > 0 for s in log["samples"])
        assert {s["loaders"]["syn"] for s in log["samples"]} == {1, 2}
        with pytest.raises(ray.exceptions.RayTaskError, match="takes 1 to 2 loaders, not 3"):
            ray.get(planner.scale.remote("open", 3))
    finally:
        ray.kill(planner, no_restart=True)


def test_loaders_asking_for_more_cpus_than_the_cluster_has_are_refused(local_ray):
    from megatron_hdp.data.service.client import check_cpus
    from megatron_hdp.data.spec import SourceSpec
    from megatron_hdp.errors import DataServiceError

    fits = [SourceSpec("a", 1.0, path="x", loaders=3, cpus=1.0)]  # 3 loaders + a shadow: 4
    check_cpus(fits, "local")
    wide = [SourceSpec("a", 1.0, path="x", loaders=4, cpus=1.0)]
    with pytest.raises(DataServiceError) as err:
        check_cpus(wide, "local")
    assert "ask for 5 CPUs at start" in str(err.value) and "at local has 4" in str(err.value)

"""The CPU demo shows HDP's point on its own batches (scripts/run_cpu.sh, demo_corpus.json).

What the demo's run summary reports is recomputed here from its flags, offline: the demo's
batches (its corpus, spec and token budget) planned by HDP and by the static mesh the
summary compares with, on the CPU profile. A change of flags, corpus or planner that loses
the point (short sequences on one rank, fewer ring bytes, a shorter predicted step) fails.
"""

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from megatron_hdp.data.spec import load_spec
from megatron_hdp.data.training_data import build_training_data
from megatron_hdp.megatron.arguments import build_parser, capacity_of
from megatron_hdp.megatron.config import data_config, device_profile, model_config
from megatron_hdp.megatron.model import model_shape
from megatron_hdp.report.prediction import (
    predicted_step_seconds,
    ring_attention_bytes,
    static_mesh_cp,
)
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import CostModel

REPO = Path(__file__).resolve().parents[2]
POOL = 4  # run_cpu.sh's NPROC


def launcher_words(cache: Path) -> list[str]:
    """The pretrain_hdp.py flags of scripts/run_cpu.sh with no extra arguments."""
    script = (REPO / "scripts/run_cpu.sh").read_text()
    data = re.search(r"^DATA=\((.*)\)$", script, re.M).group(1)
    block = re.search(r"^ARGS=\(\n(.*?)\n\)$", script, re.M | re.S).group(1)
    block = block.replace('"${DATA[@]}"', data).replace('"$@"', "")
    return [*shlex.split(block.replace("$OUT", "out")), "--data-cache-path", str(cache)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    args = build_parser().parse_args(launcher_words(cache))
    args.hdp_data_spec = str(REPO / args.hdp_data_spec)  # run_cpu.sh runs from the root
    return args, build_training_data(data_config(args, POOL))


def test_the_spec_s_short_sequences_are_those_that_fit_one_rank(demo):
    args, _ = demo
    spec = load_spec(args.hdp_data_spec)
    assert [s.builtin for s in spec.sources] == ["stdlib"]
    short = spec.buckets[0]
    assert short.max_tokens == capacity_of(args) == 2048 and args.seq_length == 4096
    spec.check_covers(100_000)  # longer demos than the default 30 steps run too


def widths_per_sequence(plan) -> list[tuple[int, int]]:
    """(length, ranks) of every sequence of `plan`, from its micro-batches."""
    widths = plan.ring_sizes()
    out = []
    for mb in range(len(widths)):
        for s in plan.seq_ids[plan.seq_offsets[mb] : plan.seq_offsets[mb + 1]]:
            out.append((int(plan.lengths[s]), int(widths[mb])))
    return out


def test_the_demo_s_batches_show_what_hdp_removes_and_buys(demo):
    """Its summary's comparison, from its steps: fewer ranks and bytes, a shorter step."""
    args, data = demo
    capacity = capacity_of(args)
    cfg = model_config(args, data.vocab_size)
    cost = CostModel(model_shape(cfg), device_profile("cpu"))
    cp = static_mesh_cp(args.seq_length, capacity, POOL, args.context_parallel_size)
    assert cp == 2 and args.hdp_placement == "balanced"  # the summary's "DP 2 x CP 2"
    sizes = {
        "num_layers": args.num_layers,
        "kv_dim": cost.model.kv_dim,
        "kv_element_bytes": 4,  # fp32 on CPU
        "grad_element_bytes": 4,
    }
    ours = static = ours_bytes = static_bytes = 0.0
    short = []
    for _ in range(args.train_iters):
        lengths = [u.length for u in data.train.next_batch()]
        plan = plan_step(
            lengths, pool_size=POOL, capacity=capacity, policy=args.hdp_placement, cost_model=cost
        )
        mesh = plan_step(
            lengths, pool_size=POOL, capacity=capacity, policy="static", cp_size=cp, cost_model=cost
        )
        assert set(mesh.ring_sizes().tolist()) == {cp}  # "2 for every sequence"
        ours += predicted_step_seconds(plan)
        static += predicted_step_seconds(mesh)
        ours_bytes += ring_attention_bytes(plan, **sizes)
        static_bytes += ring_attention_bytes(mesh, **sizes)
        short += [w for n, w in widths_per_sequence(plan) if n <= capacity]
    assert len(short) > 20 * args.train_iters  # many short sequences a step
    assert np.mean(np.array(short) == 1) >= 0.98  # nearly every one whole on one rank
    assert ours_bytes < 0.6 * static_bytes  # 55% less on the default 30 steps
    assert static > 1.2 * ours  # 1.27x

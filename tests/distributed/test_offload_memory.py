"""The planner's memory rule against measured saved-activation bytes, on 4 forked CPU ranks.

Two sequences of 4C tokens on a pool of 4 (C = 256): without offloading each needs the
whole pool, so they run one after the other; on the machine's calibrated CPU profile the
planner offloads instead, each on a ring of 2 with ratio 0.75 (6 layers), side by side.
The rule says a member's resident activations, `(2 + (1 - r)(l - 2)) / l * t` tokens' worth,
fit `C` tokens' worth. Measured: the bytes each rank's layers save per micro-batch without
offloading (`offload.measure.SavedBytesCounter`, its own saved-tensor hooks) give bytes
per token; the offloading run's peak resident bytes (the offload manager's accounting)
must match the rule's prediction within 5%, and the losses must match.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.data.batching import InMemoryTokens
from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.engine import OptimConfig, build_engine, offload_manager
from megatron_hdp.megatron.model import GPTConfig, model_shape
from megatron_hdp.megatron.step import StepRuntime, train_step
from megatron_hdp.offload.measure import SavedBytesCounter
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import CPU, CostModel
from megatron_hdp.scheduler.offload_rule import resident_fraction
from megatron_hdp.sharding import rank_token_counts
from tests.dist import run_ranks

C, LAYERS, POOL = 256, 6, 4
LENGTHS = [4 * C, 4 * C]
CFG = GPTConfig(
    num_layers=LAYERS, hidden_size=128, num_attention_heads=8, num_query_groups=2, vocab_size=256
)
#: results/cpu_profile.json (this machine's calibration), written out so the test is
#: self-contained: attention runs faster than the placeholder CPU profile says.
CALIBRATED = dataclasses.replace(
    CPU, name="cpu-calibrated", linear_flops=22.717e9, attention_flops=57.019e9
)


def source():
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 256, (n + 1,), generator=gen) for n in LENGTHS]
    return InMemoryTokens([t[:-1] for t in ids], [t[1:] for t in ids])


def _body(rank, world_size):
    cost_model = CostModel(model_shape(CFG), CALIBRATED)
    kw = dict(pool_size=POOL, capacity=C, policy="balanced", cost_model=cost_model)
    plain_plan = plan_step(LENGTHS, **kw)
    offload_plan = plan_step(LENGTHS, offload=True, **kw)
    with cpu_shims():
        layout = ParallelDims.of_world().initialize()
        try:
            # Without offloading: our own saved-tensor counter on the layers.
            engine = build_engine(CFG, OptimConfig(lr=1e-3), seed=7)
            counter = SavedBytesCounter(engine.model.module.decoder.layers)
            runtime = StepRuntime(group=dist.group.WORLD)
            plain = train_step(engine, plain_plan, source(), runtime)
            counter.remove()
            # With offloading: the same start, the manager's peak of resident bytes.
            engine = build_engine(CFG, OptimConfig(lr=1e-3), seed=7)
            runtime = StepRuntime(group=dist.group.WORLD)
            runtime.offload = offload_manager(
                engine, 1 << 28, torch.device("cpu"), min_offload_bytes=0
            )
            offloaded = train_step(engine, offload_plan, source(), runtime)
            stats = runtime.offload.stats()
        finally:
            layout.destroy()
    tokens_plain = [
        rank_token_counts([LENGTHS[i] for i in mb.seq_indices], mb.cp_size)[mb.ring.index(rank)]
        for mb in plain_plan.for_rank(rank)
    ]
    (mb,) = offload_plan.for_rank(rank)
    tokens = rank_token_counts([LENGTHS[i] for i in mb.seq_indices], mb.cp_size)
    return {
        "plain_peaks": counter.peaks,
        "plain_tokens": tokens_plain,
        "offload_tokens": tokens[mb.ring.index(rank)],
        "ratio": mb.offload_ratio,
        "peak_resident": stats["peak_resident_bytes"],
        "saved": stats["saved_bytes"],
        "to_host": runtime.offload.engine.bytes_to_host,
        "losses": (plain.loss, offloaded.loss),
        "offload_bytes_total": offloaded.offload_bytes_total,
        "decision": offload_plan.offload_decision.message(),
    }


def test_resident_activations_match_the_rule_within_5_percent():
    results = run_ranks(_body, POOL, timeout_s=300)
    first = results[0]
    assert first["decision"].startswith("offload: 2 of 2 rings offloaded"), first["decision"]
    assert sum(r["to_host"] for r in results) == first["offload_bytes_total"] > 0
    for r in results:
        # Without offloading each rank holds C tokens of each sequence, one at a time.
        assert r["plain_tokens"] == [C, C] and len(r["plain_peaks"]) == 2
        per_token = max(r["plain_peaks"]) / C
        assert min(r["plain_peaks"]) == pytest.approx(max(r["plain_peaks"]), rel=0.01)
        # With offloading: 2C tokens on a ring of 2 at the least ratio that fits C.
        t, ratio = r["offload_tokens"], r["ratio"]
        assert t == 2 * C and ratio == pytest.approx(0.75)
        assert r["saved"] == pytest.approx(t * per_token, rel=0.05)  # bytes grow with tokens
        predicted = float(resident_fraction(ratio, LAYERS)) * t * per_token
        assert predicted <= C * per_token * (1 + 1e-12)  # the rule: resident <= C
        assert r["peak_resident"] == pytest.approx(predicted, rel=0.05)
        assert r["peak_resident"] <= 1.05 * C * per_token
        plain_loss, offload_loss = r["losses"]
        assert offload_loss == pytest.approx(plain_loss, rel=1e-5)

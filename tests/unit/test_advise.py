"""The advisor (`python -m megatron_hdp.advise`): hand-computed steps, the simulator's own
numbers on its built-in mixes, profiles, and one-line refusals of bad input."""

import argparse
import json
from dataclasses import replace

import pytest

from megatron_hdp.advise.__main__ import main
from megatron_hdp.advise.job import memory_capacity, parse_job
from megatron_hdp.advise.lengths import cut, read_lengths_file
from megatron_hdp.advise.profiles import H100, PROFILES, profile_from_dict
from megatron_hdp.advise.report import recommended, verdict
from megatron_hdp.sim.clusters import H100_CLUSTER
from megatron_hdp.sim.distributions import GENERATORS
from megatron_hdp.sim.models import MODELS
from megatron_hdp.sim.models import memory_capacity as sim_memory_capacity
from megatron_hdp.sim.simulate import SYSTEMS

K = 1024

# A profile with round constants, every field given (priced or not).
ROUND = {
    "name": "round",
    "peak_bf16_flops": 1e14,
    "linear_efficiency": 0.5,
    "attention_efficiency": 0.25,
    "tp_efficiency": 0.8,
    "hbm_bytes": 80e9,
    "hbm_bandwidth": 1e12,
    "nvlink_bandwidth": 1e11,
    "gpus_per_node": 8,
    "network_bandwidth": 1e10,
    "network_latency": 1e-5,
    "host_link_bandwidth": 1e10,
    "host_memory_per_gpu": 1e11,
}
# A small dense model: 4 layers, h 256, 4 heads (no GQA), plain MLP of 1024, vocabulary
# 1023 + EOD = 1024 (already a multiple of 128 x TP), tied embeddings.
L, H, HEADS, FFN, V = 4, 256, 4, 1024, 1024
MODEL_FLAGS = [
    "--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
    "--ffn-hidden-size", str(FFN), "--tokenizer-type", "NullTokenizer", "--vocab-size", "1023",
]  # fmt: skip


def params() -> float:
    """Weights by hand: attention (Q, K, V, O all h x h), MLP (2 h x ffn), tied embedding."""
    return L * (4 * H * H + 2 * H * FFN) + H * V


def step_by_hand(
    s: float, k: int, *, tp: int = 1, pool: int, network: float = ROUND["network_bandwidth"]
) -> tuple[float, float]:
    """One sequence of `s` tokens on a ring of `k` replicas: (per-member time, grad sync).

    The cost model's formula (scheduler/cost.py docstring), written out here.
    """
    eff = ROUND["tp_efficiency"] if tp > 1 else 1.0
    f_lin = ROUND["peak_bf16_flops"] * ROUND["linear_efficiency"] * tp * eff
    f_att = ROUND["peak_bf16_flops"] * ROUND["attention_efficiency"] * tp * eff
    bw, lat = network * tp, ROUND["network_latency"]
    linear = 6 * params() * s / f_lin
    attention = L * 3.5 * 2 * s * s * H / f_att  # heads x head dim = h
    exposed = 0.0
    if k > 1:
        transfer = lat + 2 * (s / k) * H * 2 / bw  # K and V of s/k tokens, 2 bytes each
        forward_step = attention / (k * k) / (3.5 * L)
        backward_step = 2.5 * forward_step
        exposed = L * (
            (k - 1) * max(0, transfer - forward_step)
            + (k - 1) * max(0, 2 * transfer - backward_step)
            + transfer
        )
    sync = 2 * (pool - 1) / pool * 4 * params() / bw + 2 * (pool - 1) * lat if pool > 1 else 0
    return (linear + attention) / k + exposed, sync


def advise(tmp_path, *flags):
    """Run the advisor in-process; (exit status, report or None)."""
    out = tmp_path / "out"
    rc = main(["--out", str(out), "--no-charts", "--no-progress-bar", *flags])
    report = json.loads((out / "advise.json").read_text()) if rc == 0 else None
    return rc, report


def rows(report) -> dict:
    return {r["system"]: r for r in report["systems"]}


@pytest.fixture
def round_profile(tmp_path):
    path = tmp_path / "round.json"
    path.write_text(json.dumps(ROUND))
    return str(path)


@pytest.mark.parametrize("network", [1e10, 5e8])  # ring steps hidden / exposed
def test_one_sequence_step_by_hand(tmp_path, network):
    # 32K tokens at capacity 8K on a pool of 4: a ring of all 4 under every system.
    lengths = tmp_path / "one.txt"
    lengths.write_text("32768\n")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({**ROUND, "network_bandwidth": network}))
    rc, report = advise(
        tmp_path, "--gpus", "4", "--profile", str(profile), "--lengths-file", str(lengths),
        "--steps", "1", "--megatron", "reimpl", *MODEL_FLAGS, "--seq-length", "32768",
        "--hdp-capacity", "8192", "--hdp-global-batch-tokens", "32768",
    )  # fmt: skip
    assert rc == 0
    member, sync = step_by_hand(32768, 4, pool=4, network=network)
    assert report["job"]["static_cp"] == 4 and report["job"]["total_params"] == params()
    got = rows(report)
    for system in ("static", "megatron_dcp", "hdp_greedy", "hdp_balance"):
        assert got[system]["step_time"] == pytest.approx(member + sync, rel=1e-9), system
        assert got[system]["grad_sync"] == pytest.approx(sync, rel=1e-9)
        assert got[system]["ranks_per_seq_max"] == 4
        assert got[system]["tokens_per_s"] == pytest.approx(32768 / (member + sync), rel=1e-9)
    # Offloading picks its own ring (ByteScale Eq. 3); priced by the same formula.
    for system in ("hdp_offload", "hdp_offload_balance"):
        k = int(got[system]["ranks_per_seq_max"])
        assert 2 <= k <= 4
        member_k, _ = step_by_hand(32768, k, pool=4, network=network)
        assert got[system]["step_time"] == pytest.approx(member_k + sync, rel=1e-9), system


@pytest.mark.parametrize("tp", [1, 2])
def test_uniform_lengths_step_by_hand(tmp_path, round_profile, tp):
    # 8 sequences of exactly the capacity on 4 replicas: two whole sequences per replica.
    lengths = tmp_path / "uniform.txt"
    lengths.write_text("8192\n" * 8)
    rc, report = advise(
        tmp_path, "--gpus", str(4 * tp), "--tensor-model-parallel-size", str(tp),
        "--profile", round_profile, "--lengths-file", str(lengths), "--steps", "2",
        "--megatron", "reimpl", *MODEL_FLAGS, "--seq-length", "8192",
        "--hdp-global-batch-tokens", str(8 * 8192),
    )  # fmt: skip
    assert rc == 0
    one, sync = step_by_hand(8192, 1, tp=tp, pool=4)
    assert report["job"]["pool_size"] == 4 and report["job"]["static_cp"] == 1
    for system, row in rows(report).items():
        assert row["step_time"] == pytest.approx(2 * one + sync, rel=1e-9), system
        assert row["speedup"] == pytest.approx(1.0, rel=1e-9)
        assert row["ranks_per_seq_max"] == 1 and row["exposed_ring_mean"] == 0
    assert "does not pay" in report["verdict"]


def sim_model_flags(name: str) -> list[str]:
    """`pretrain_hdp.py` flags of one of the simulator's dense models (`sim.models`)."""
    m = MODELS[name]
    sh = m.shape
    return [
        "--num-layers", str(sh.num_layers), "--hidden-size", str(sh.hidden_size),
        "--num-attention-heads", str(sh.num_attention_heads), "--group-query-attention",
        "--num-query-groups", str(sh.num_query_groups), "--ffn-hidden-size",
        str(sh.ffn_hidden_size), "--swiglu", "--untie-embeddings-and-output-weights",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999",
        "--make-vocab-size-divisible-by", "4",  # 32000 stays 32000 up to TP 8
        "--tensor-model-parallel-size", str(m.tp), "--pipeline-model-parallel-size", str(m.pp),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name, ds, gpus",
    [*(("llama-7b", ds, 64) for ds in GENERATORS), ("llama-70b", "byted_like", 512)],
)
def test_builtin_mix_equals_the_simulator(tmp_path, name, ds, gpus):
    """The advisor on a simulator model's flags and a built-in mix gives the simulator's
    own numbers (llama-70b: PP 2, every plan through the 1F1B timeline)."""
    from megatron_hdp.sim.__main__ import run_cell

    model, context, tokens, steps = MODELS[name], 256 * K, 2 * K * K, 2
    rc, report = advise(
        tmp_path, "--gpus", str(gpus), "--profile", "H100", "--mix", ds,
        "--steps", str(steps), "--megatron", "reimpl", "--seed", "0", *sim_model_flags(name),
        "--seq-length", str(context), "--max-position-embeddings", str(context),
        "--hdp-capacity", str(8 * K), "--hdp-global-batch-tokens", str(tokens),
    )  # fmt: skip
    assert rc == 0
    assert report["job"]["total_params"] == model.total_params
    assert report["job"]["active_params"] == model.active_params
    sim_args = argparse.Namespace(
        steps=steps, seed=0, tokens=tokens, systems=list(SYSTEMS), megatron="reimpl",
        megatron_max_ranks=1024,
    )  # fmt: skip
    sim_rows, _ = run_cell(
        model, H100_CLUSTER, ds, list(GENERATORS).index(ds), context, sim_args, 8 * K, gpus
    )
    got = rows(report)
    for row in sim_rows:
        mine = got[row["system"]]
        assert mine["step_times"] == row["step_times"], row["system"]
        assert mine["tokens_per_s"] == pytest.approx(row["tokens_per_s"], rel=1e-12)
        assert mine["grad_sync"] == row["grad_sync"]
        assert mine["implementation"] == row["implementation"]


def test_named_h100_is_the_simulators_cluster():
    assert H100.cluster() == replace(H100_CLUSTER, name="H100")
    assert set(PROFILES) == {"A100-80G", "H100", "H200", "B200"}
    for p in PROFILES.values():  # dense bf16 below 3 PFLOP/s, memory 80-180 GB: datasheets
        assert 1e14 < p.peak_bf16_flops < 3e15 and 80e9 <= p.hbm_bytes <= 180e9


def test_memory_capacity_is_the_simulators_estimate():
    flags = [
        "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
        "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "11008",
        "--swiglu", "--untie-embeddings-and-output-weights", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "31999", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer", "--seq-length", "8192",
    ]  # fmt: skip
    job = parse_job(flags, gpus=1024, steps=1, capacity="job", hbm_bytes=80e9, own_data=False)
    assert memory_capacity(job, 80e9) == sim_memory_capacity(MODELS["llama-7b"], pool=512)
    mem = parse_job(flags, gpus=1024, steps=1, capacity="memory", hbm_bytes=80e9, own_data=False)
    assert mem.capacity == memory_capacity(job, 80e9) and mem.capacity_source == "memory estimate"


def test_json_profile_fields():
    assert profile_from_dict(ROUND).cluster().ib_bandwidth == 1e10
    based = profile_from_dict({"base": "h200", "linear_efficiency": 0.45}, default_name="x")
    assert based.hbm_bytes == 141e9 and based.linear_efficiency == 0.45
    bad = [
        ({**ROUND, "hbm_gb": 80}, "'hbm_gb'"),
        ({**ROUND, "network_bandwidth": "fast"}, "'network_bandwidth' = 'fast'"),
        ({**ROUND, "network_latency": -1}, "'network_latency' = -1"),
        ({**ROUND, "linear_efficiency": 1.5}, "'linear_efficiency' = 1.5"),
        ({**ROUND, "gpus_per_node": 7.5}, "'gpus_per_node' = 7.5"),
        ({k: v for k, v in ROUND.items() if k != "hbm_bytes"}, "'hbm_bytes'"),
        ({"base": "V100"}, "'V100'"),
        ([1, 2], "JSON object"),
    ]
    for data, named in bad:
        with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("'", "'")):
            profile_from_dict(data)


def test_lengths_file_and_cutting(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("# lengths\n100\n\n  7  # short\n")
    assert read_lengths_file(f).tolist() == [100, 7]
    assert cut([10, 25, 3], 10).tolist() == [10, 10, 10, 5, 3]
    for text, named in (("5\n-3\n", "line 2: '-3'"), ("5\n2.5\n", "line 2: '2.5'"), ("#\n", "no")):
        f.write_text(text)
        with pytest.raises(ValueError, match=named):
            read_lengths_file(f)


def _row(system, tps, **kw):
    base = {
        "system": system, "tokens_per_s": tps, "ranks_per_seq_token_weighted": 1.0,
        "exposed_comm": 0.1, "wait_mean": 0.0, "memory_headroom_bytes": 1e9,
    }  # fmt: skip
    return {**base, **kw}


def test_verdict_and_recommendation():
    job = {"pp": 1, "static_cp": 8, "capacity": 8192}
    rows_ = [_row("static", 100), _row("hdp_balance", 150), _row("hdp_offload_balance", 151)]
    assert recommended(rows_[1:])["system"] == "hdp_balance"  # +0.7% is not worth a flag
    text = verdict(rows_, job)
    assert text.startswith("HDP pays on this job: HDP + balance is predicted at 1.50x")
    assert "Offloading adds nothing" in text
    rows_[2]["tokens_per_s"] = 160
    assert "--hdp-offload" in verdict(rows_, job) and "+7%" in verdict(rows_, job)
    flat = [_row("static", 100), _row("hdp_balance", 101, memory_headroom_bytes=-1)]
    text = verdict(flat, job)
    assert text.startswith("HDP does not pay") and "Out of memory by the estimate: HDP" in text
    # With PP the job runs PP-Balance only: the greedy plan is not recommended however fast.
    pp = [_row("static", 100), _row("hdp_balance", 120), _row("hdp_greedy", 200)]
    assert "HDP + balance is predicted at 1.20x" in verdict(pp, {**job, "pp": 2})


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--profile", "V100"], "--profile V100"),
        (["--profile", "PROFILE"], "'hbm_gb'"),
        (["--lengths-file", "LENGTHS"], "line 2: 'x'"),
        (["--gpus", "0"], "--gpus 0"),
        (["--gpus", "6", "--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size 4"),
        (
            ["--gpus", "8", "--pipeline-model-parallel-size", "3"],
            "--pipeline-model-parallel-size 3",
        ),
        (["--systems", "static,fast"], "'fast'"),
        (
            ["--gpus", "16", "--tensor-model-parallel-size", "16", "--num-attention-heads", "16"],
            "16 exceeds the 8 GPUs of one NVLink node",
        ),
        (["--out", "FULL"], "not empty"),
        (["--hdp-capacity", "100"], "--seq-length 8192"),
    ],
)
def test_bad_input_one_line_exit_2(tmp_path, capsys, flags, named):
    (tmp_path / "bad.json").write_text(json.dumps({**ROUND, "hbm_gb": 80}))
    (tmp_path / "bad.txt").write_text("8\nx\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    subst = {"PROFILE": "bad.json", "LENGTHS": "bad.txt", "FULL": "full"}
    flags = [str(tmp_path / subst[f]) if f in subst else f for f in flags]
    base = ["--gpus", "8", "--lengths-file", str(tmp_path / "ok.txt")]
    (tmp_path / "ok.txt").write_text("100\n")
    if "--mix" in flags:
        base = base[:2]
    argv = [*base, *MODEL_FLAGS, *flags, "--seq-length", "8192", "--no-progress-bar"]
    if "--out" not in flags:
        argv += ["--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "out").exists()
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_job_flags_refused_by_the_job_parser_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--gpus", "8", *MODEL_FLAGS, "--seq-length", "64", "--recompute-activations"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--recompute-activations" in err


def test_data_path_reads_the_jobs_batches(tmp_path):
    """An indexed dataset through the job's data layer: the job's own first batches."""
    import numpy as np

    from megatron_hdp.data.indexed import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 200, size=int(n)) for n in rng.integers(50, 3000, size=200)]
    write_indexed_dataset(tmp_path / "ds", docs, vocab_size=257)
    rc, report = advise(
        tmp_path, "--gpus", "4", "--steps", "2", "--megatron", "reimpl",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "2048", "--hdp-capacity", "512", "--data-path", str(tmp_path / "ds"),
        "--save", str(tmp_path / "never"),
    )  # fmt: skip
    assert rc == 0
    assert report["data"]["source"].startswith("--data-path")
    assert report["data"]["longest"] <= 2048 and report["job"]["ignored_flags"] == ["--save"]
    # The default batch: one context per replica (4 x 2048 tokens), whole sequences.
    assert report["data"]["tokens_mean"] <= 4 * 2048
    assert not (tmp_path / "never").exists()
    # The same dataset through a data spec: only long sequences (a bucket) are drawn.
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "sources": [{"name": "a", "path": str(tmp_path / "ds"), "weight": 1.0}],
                "length_buckets": [{"name": "short", "max_tokens": 1000}, {"name": "long"}],
                "schedule": [{"until_step": 2, "weights": {"a/long": 1.0}}],
            }
        )
    )
    out = tmp_path / "spec-out"
    rc = main(
        ["--out", str(out), "--no-charts", "--no-progress-bar", "--gpus", "4", "--steps", "2",
         "--megatron", "reimpl", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "2048", "--hdp-capacity", "512",
         "--hdp-data-spec", str(spec), "--hdp-global-batch-tokens", "16384"]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "advise.json").read_text())["data"]
    assert data["source"] == f"--hdp-data-spec {spec}"
    assert data["length_p50"] > 1000 and data["tokens_mean"] <= 16384


@pytest.mark.parametrize("pp", [1, 2])
def test_pictures_and_markdown(tmp_path, pp):
    """With charts: one Gantt PNG per shown system, each named once in the markdown."""
    pytest.importorskip("matplotlib")
    lengths = tmp_path / "l.txt"
    lengths.write_text("".join(f"{n}\n" for n in (100, 3000, 9000, 20000, 500, 700)))
    out = tmp_path / "out"
    rc = main(
        ["--out", str(out), "--no-progress-bar", "--gpus", str(4 * pp), "--lengths-file",
         str(lengths), "--megatron", "reimpl", "--gantt-ranks", "4", *MODEL_FLAGS,
         "--pipeline-model-parallel-size", str(pp), "--seq-length", "32768",
         "--hdp-capacity", "8192"]
    )  # fmt: skip
    assert rc == 0
    report = json.loads((out / "advise.json").read_text())
    md = (out / "advise.md").read_text()
    assert len(report["pictures"]) == len(set(report["pictures"])) >= 3
    for name in report["pictures"]:
        assert (out / name).stat().st_size > 0 and md.count(f"]({name})") == 1
    assert report["verdict"] in md
    # A second run into the same folder is refused unless told to overwrite.
    assert report["job"]["pp"] == pp
    assert main(["--out", str(out), "--gpus", "4", "--lengths-file", str(lengths),
                 *MODEL_FLAGS, "--seq-length", "32768"]) == 2  # fmt: skip
    assert main(["--out", str(out), "--overwrite", "--no-charts", "--no-progress-bar",
                 "--gpus", "4", "--lengths-file", str(lengths), "--megatron", "reimpl",
                 *MODEL_FLAGS, "--seq-length", "32768", "--hdp-capacity", "8192"]) == 0  # fmt: skip
    assert not list(out.glob("gantt_*.png"))  # the earlier run's pictures are gone


def test_the_docs_profile_fields_and_example_match_the_code():
    """docs/advise.md lists exactly the JSON fields the loader takes; its example loads."""
    import re

    from megatron_hdp.advise.profiles import FIELDS
    from tests.unit.scripts_loader import REPO

    doc = (REPO / "docs" / "advise.md").read_text()
    section = doc[doc.index("### A JSON profile") :]
    listed = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    assert sorted(listed) == sorted(("base", *FIELDS))
    block = section[section.index("```json\n") + 8 : section.index("```\n", 10)]
    example = profile_from_dict(json.loads(block))
    assert example.linear_efficiency == 0.52 and example.hbm_bytes == H100.hbm_bytes
    readme = (REPO / "README.md").read_text()
    assert "python -m megatron_hdp.advise" in readme[: readme.index("## Quick start")]


def test_the_pure_layers_import_no_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import megatron_hdp.advise.__main__, megatron_hdp.advise.profiles\n"
        "import megatron_hdp.advise.report, megatron_hdp.advise.run, megatron_hdp.advise.job\n"
        "import megatron_hdp.advise.lengths\n"
        "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

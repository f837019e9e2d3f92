"""scripts/gpu/verify.py: its CPU mode runs every check with torch alone, and catches defects."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.unit.scripts_loader import REPO

VERIFY = REPO / "scripts" / "gpu" / "verify.py"


def _run(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, str(VERIFY), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def test_help_lists_the_sections():
    done = _run("--help")
    assert done.returncode == 0
    for section in ("env", "kernels", "ring", "speed", "offload", "train", "--cpu", "--quick"):
        assert section in done.stdout


def test_bad_arguments_are_named_and_no_cuda_is_refused_without_cpu_mode():
    done = _run("--cpu", "--sections", "kernels,warp")
    assert done.returncode == 2 and "unknown ['warp']" in done.stderr
    if not torch.cuda.is_available():
        done = _run()
        assert (
            done.returncode == 2
            and "no CUDA device here" in done.stderr
            and "--cpu" in (done.stderr)
        )


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """The CPU run in a Python where megatron and hypothesis cannot be imported."""
    folder = tmp_path_factory.mktemp("verify")
    blockers = folder / "blockers"
    for package in ("megatron", "hypothesis", "ray"):
        (blockers / package).mkdir(parents=True)
        (blockers / package / "__init__.py").write_text(
            f"raise ImportError('{package} is not installed on the GPU machine')\n"
        )
    env = dict(os.environ, PYTHONPATH=str(blockers))
    out = folder / "verify.json"
    done = _run("--cpu", "--out", str(out), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout


def test_the_cpu_mode_runs_every_section_with_torch_alone(cpu_report):
    report, stdout = cpu_report
    assert report["ok"] and report["mode"] == "cpu"
    # Megatron is named only by the train section's line saying that it was skipped.
    others = "\n".join(line for line in stdout.splitlines() if not line.startswith("train"))
    assert report["environment"]["megatron_core"] is None or "megatron" not in others
    train = report["sections"]["train"]
    assert train["ok"] is None and "megatron-core is not installed" in train["skipped"]
    assert "carry its wheel" in train["skipped"] and "megatron" in train["import_error"]
    kernels = report["sections"]["kernels"]["results"]
    assert {r["kernel"] for r in kernels} == {"torch", "math"}
    assert {r["case"] for r in kernels} >= {
        "packed_documents_gqa",
        "zigzag_half_blocks",
        "one_query_row_per_document",
        "many_tiny_documents",
    }
    assert {r["dtype"] for r in kernels} == {"float32", "bfloat16"}
    assert all(r["ok"] and r["lse_shape_ok"] for r in kernels)
    rings = report["sections"]["ring"]["results"]
    assert sorted({r["ring_size"] for r in rings}) == list(range(2, 9))
    assert all(max(r["error_vs_float64"].values()) <= r["tolerance"] for r in rings)
    speed = report["sections"]["speed"]
    assert speed["ring_steps"][0]["step_calls"] == 4
    assert all(p["pack_path_s"] > 0 and p["direct_call_s"] > 0 for p in speed["pack_path"])
    assert "kernels_bf16" in report["environment"] and report["environment"]["git_revision"]


def _checks():
    sys.path.insert(0, str(REPO / "scripts" / "gpu"))
    import common
    import kernel_checks
    import ring_checks

    return common, kernel_checks, ring_checks


def test_a_kernel_with_a_one_percent_error_fails_its_check(monkeypatch):
    common, kernel_checks, _ = _checks()
    from megatron_hdp.attention.kernels import registry

    math_kernel = registry.get_kernel("math")

    class Off:
        name = "off_by_one_percent"

        def forward(self, *args, **kwargs):
            out, lse = math_kernel.forward(*args, **kwargs)
            return out * 1.01, lse

        def backward(self, *args, **kwargs):
            return math_kernel.backward(*args, **kwargs)

        def activate(self):
            pass

    monkeypatch.setitem(registry._KERNELS, Off.name, Off())
    mode = common.cpu_mode()
    case = kernel_checks.cases(mode)["packed_documents_gqa"]
    result = kernel_checks.check_case(Off.name, mode, torch.float32, "packed", case)
    assert not result["ok"] and result["errors"]["out"] > 5e-3
    assert kernel_checks.check_case("math", mode, torch.float32, "packed", case)["ok"]


def test_a_ring_that_drops_a_block_fails_its_check(monkeypatch):
    common, _, ring_checks = _checks()
    from megatron_hdp.attention import ring

    real = ring._step_blocks

    def drop_lower_blocks(spec, device):
        return {s: b for s, b in real(spec, device).items() if s >= spec.position}

    monkeypatch.setattr(ring, "_step_blocks", drop_lower_blocks)
    result = ring_checks.run(common.cpu_mode(), lambda line: None, "torch")
    assert not result["ok"]


def test_the_cpu_run_offloads_and_its_loss_and_gradients_are_bitwise_equal(cpu_report):
    report, stdout = cpu_report
    offload = report["sections"]["offload"]
    assert offload["ok"] and offload["engine"] == "HostCopyEngine" and "offload  ratio" in stdout
    exact = offload["bitwise"]
    assert exact["reference_reproducible"] and [r["ratio"] for r in exact["ratios"]] == [0, 0.5, 1]
    for result in exact["ratios"]:
        assert result["loss_bitwise_equal"] and result["gradients_differing"] == 0
        assert result["gradients_compared"] == 1 + 12 * offload["layers"]  # input + 12 per layer
    half, full = (r["counters"] for r in exact["ratios"][1:])
    assert exact["ratios"][0]["counters"]["bytes_to_host"] == 0
    # Ratio 1 sends every row of every offloadable storage; 0.5 sends ceil(rows / 2) of each.
    assert full["bytes_to_host"] == full["offloadable_bytes"] == full["bytes_to_device"]
    assert full["bytes_to_host"] / 2 <= half["bytes_to_host"] < full["bytes_to_host"]
    assert offload["bandwidth"]["d2h_gbps"] > 0 and "memcpy" in offload["bandwidth"]["what"]
    assert offload["bandwidth"]["bytes"] == full["bytes_to_host"]
    assert [o["ratio"] for o in offload["overlap"]] == [0.5, 1] and not any(
        o["judged"] for o in offload["overlap"]
    )
    memory = offload["memory"]
    assert memory["device_skipped"] == "no device memory on CPU"
    at_zero = memory["ratios"][0]  # resident_fraction(0, l) == 1: all saved bytes stay
    assert at_zero["accounted_peak_resident_bytes"] == at_zero["predicted_resident_bytes"]
    layers = offload["layers"]
    want_full = 2 / layers * at_zero["predicted_resident_bytes"]  # Eq. 3: two layers stay
    assert memory["ratios"][2]["predicted_resident_bytes"] == pytest.approx(want_full)
    assert offload["pinned"]["engine_pinned_bytes"] == offload["pinned"]["pool_bytes"] > 0


def _flip_one_bit(fetched):
    fetched.reshape(-1).view(torch.uint8)[fetched.element_size() - 2] ^= 1
    return fetched


@pytest.mark.parametrize(
    "corrupt", [_flip_one_bit, lambda fetched: fetched.flip(0)], ids=["one_bit", "row_order"]
)
def test_an_engine_that_corrupts_what_it_fetches_fails_the_offload_check(monkeypatch, corrupt):
    common = _checks()[0]
    import offload_checks

    from megatron_hdp.offload.engines import HostCopyEngine

    real = HostCopyEngine.fetch
    monkeypatch.setattr(HostCopyEngine, "fetch", lambda self, h: corrupt(real(self, h)))
    result = offload_checks.run(common.cpu_mode(), lambda line: None, "torch")
    assert not result["ok"] and not result["bitwise"]["ok"]
    at_zero, *offloaded = result["bitwise"]["ratios"]
    assert at_zero["ok"]  # nothing was fetched at ratio 0
    assert all(not r["ok"] and r["gradients_differing"] > 0 for r in offloaded)


@pytest.fixture(scope="module")
def train_report(tmp_path_factory):
    """The CPU run of the train section, with megatron-core importable."""
    out = tmp_path_factory.mktemp("train") / "verify.json"
    done = _run("--cpu", "--sections", "train", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())["sections"]["train"]


def test_the_train_section_times_both_attentions_from_the_same_start(train_report):
    train = train_report
    assert train["ok"] is True and train["dtype"] == "float32"
    start = train["same_start"]
    assert start["ok"] and start["weights_equal"] and start["tolerance"] == 1e-5
    assert start["first_loss_hdp"] == pytest.approx(start["first_loss_megatron"], rel=1e-5)
    # Random ids over 256 tokens: the untrained model's loss is near ln(256).
    assert abs(start["first_loss_hdp"] - math.log(256)) < 0.5
    lengths = [row["sequence_length"] for row in train["attention_comparison"]]
    assert lengths == [128, 256]
    for row in train["attention_comparison"]:
        for side in ("hdp", "megatron"):
            assert row[side]["tokens_per_s"] > 0 and row[side]["mfu"] is None, row
        # One sequence per micro-batch, 256 tokens a step.
        assert row["hdp"]["micro_batches"] == row["sequences_per_step"]
        assert row["sequences_per_step"] * row["sequence_length"] == 256
    packed = train["hdp_packed"]
    assert [p["tokens"] for p in packed] == [256, 512]
    for p in packed:
        assert sum(p["documents"]) == p["tokens"] and len(p["documents"]) > 1
        assert p["micro_batches"] == 1 and p["tokens_per_s"] > 0 and p["mfu"] is None
    assert train["peak_bf16_flops"] is None and "CPU" in train["peak_note"]


def test_the_train_section_counts_the_parameters_of_the_model_it_trains(train_report):
    model = train_report["model"]
    h, layers, vocab, ffn = 64, 2, 256, 256
    kv = model["num_query_groups"] * h // model["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn  # QKV, projection, SwiGLU MLP
    norms = 2 * layers * h + h  # two RMSNorms per layer and the final one
    assert (model["hidden_size"], model["num_layers"], model["vocab_size"]) == (h, layers, vocab)
    assert model["parameters"] == layers * per_layer + 2 * vocab * h + norms
    # The FLOPs count every weight a token multiplies: all but the embedding and the norms.
    assert model["matmul_parameters_per_token"] == model["parameters"] - vocab * h - norms


def test_an_hdp_attention_off_by_a_tenth_of_a_percent_fails_the_train_check(monkeypatch):
    common, _, _ = _checks()
    import train_checks

    import megatron_hdp.megatron.core_attention as core_attention

    small = dataclasses.replace(
        train_checks.sizes(common.cpu_mode()),
        packed_tokens=(),
        compare_lengths=(128,),
        warmup=0,
        steps=1,
    )
    monkeypatch.setattr(train_checks, "sizes", lambda mode: small)
    assert train_checks.run(common.cpu_mode(), lambda line: None, "torch")["ok"]
    real = core_attention.hdp_attention
    monkeypatch.setattr(
        core_attention, "hdp_attention", lambda *args, **kw: real(*args, **kw) * 1.001
    )
    result = train_checks.run(common.cpu_mode(), lambda line: None, "torch")
    start = result["same_start"]
    assert not result["ok"] and start["weights_equal"]
    assert start["grad_norm_relative_difference"] > start["tolerance"]


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_mfu_uses_the_datasheet_peak_of_the_gpu_or_says_why_not(name, peak):
    _checks()
    import train_checks

    flops, note = train_checks.peak_of_gpu(name)
    assert flops == peak
    assert name in note and ("MFU is not computed" in note) == (peak is None)

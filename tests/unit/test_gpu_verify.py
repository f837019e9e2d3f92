"""scripts/gpu/verify.py: its CPU mode runs every check with torch alone, and catches defects."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

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
    for section in ("env", "kernels", "ring", "variants", "speed", "offload", "train", "--cpu"):
        assert section in done.stdout


def test_bad_arguments_are_named_and_no_cuda_is_refused_without_cpu_mode():
    done = _run("--cpu", "--sections", "kernels,warp")
    assert done.returncode == 2 and "unknown ['warp']" in done.stderr
    for bad in (("--budget-s", "-5"), ("--section-limit-s", "warp=3")):
        done = _run("--cpu", *bad)
        assert done.returncode == 2 and bad[0] in done.stderr
    if not torch.cuda.is_available():
        done = _run()
        assert (
            done.returncode == 2
            and "no CUDA device here" in done.stderr
            and "--cpu" in (done.stderr)
        )


def _blocked(folder, packages=("megatron", "hypothesis", "ray", "numpy")) -> dict:
    """An environment whose Python cannot import `packages` (as if not installed)."""
    blockers = folder / "blockers"
    for package in packages:
        (blockers / package).mkdir(parents=True)
        (blockers / package / "__init__.py").write_text(
            f"raise ModuleNotFoundError('{package} is not installed on the GPU machine', "
            f"name='{package}')\n"
        )
    env = dict(os.environ, PYTHONPATH=str(blockers))
    env.pop("HDP_VERIFY_FAULT", None)
    return env


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """The CPU run in a Python where megatron, hypothesis, Ray and numpy cannot be imported."""
    folder = tmp_path_factory.mktemp("verify")
    out = folder / "verify.json"
    done = _run("--cpu", "--out", str(out), env=_blocked(folder))
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout


def test_the_cpu_mode_runs_every_section_with_torch_alone(cpu_report):
    report, stdout = cpu_report
    assert report["ok"] and report["mode"] == "cpu" and report["exit_status"] == 0
    for name, section in report["sections"].items():  # each in its own process, timed
        assert section["status"] == "done" and section["seconds"] > 0, name
        assert section["estimated_s"] is None, name  # no estimate on CPU
        assert f"section  {name:8s} " in stdout, name  # its one-line summary
    parts = report["plan"]["parts"]
    sections = ["env", "kernels", "ring", "variants", "speed"]
    assert list(dict.fromkeys(p["section"] for p in parts))[:5] == sections
    assert not any(p["skipped"] for p in parts)
    # Megatron is named only by the train section's line saying that it was skipped.
    others = "\n".join(
        line for line in stdout.splitlines() if not line.startswith(("train", "section  train"))
    )
    assert re.search(r"megatron(?!_hdp)", others) is None, others
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


def test_the_cpu_run_checks_the_attention_variants_and_skips_the_window_without_numpy(cpu_report):
    report, stdout = cpu_report
    variants = report["sections"]["variants"]
    assert variants["ok"] and "needs numpy" in variants["skipped_cases"]["window"]
    runs = {(r["case"], r["path"]): r for r in variants["results"]}
    assert set(runs) == {(c, p) for c in ("sink", "mla") for p in ("pack", "ring")}
    assert all(r["kernel"] == "torch" for (case, _), r in runs.items() if case == "sink")
    assert runs["mla", "ring"]["kernel"] == "torch+pad_v" and runs["mla", "ring"]["head_dims"] == [
        24,
        16,
    ]
    assert "dsink" in runs["sink", "ring"]["errors"] and runs["sink", "ring"]["ring_size"] == 3
    assert "variants sink" in stdout


def _variant_checks():
    _checks()
    import variant_checks

    return variant_checks


@pytest.mark.parametrize("name", ["window", "sink", "mla"])
def test_each_variant_passes_as_pack_and_ring_and_fails_when_the_reference_ignores_it(
    monkeypatch, name
):
    common, variant_checks = _checks()[0], _variant_checks()
    mode = common.cpu_mode()
    case = variant_checks.cases(mode)[name]
    for k in variant_checks.RING_SIZES[name]:
        result = variant_checks.check_case(mode, name, case, k, torch.float32)
        assert result["ok"] and max(result["errors"].values()) < 1e-5, result
    real = common.reference_attention

    def without_the_variant(q, k, v, lengths_q, lengths_k, causal, scale, **_variant):
        if name == "mla":  # the softmax scale of v's head dim, not q/k's
            scale = v.shape[-1] ** -0.5
        return real(q, k, v, lengths_q, lengths_k, causal, scale)  # full causal, no sink

    monkeypatch.setattr(variant_checks, "reference_attention", without_the_variant)
    ring_size = variant_checks.RING_SIZES[name][-1]
    assert not variant_checks.check_case(mode, name, case, ring_size, torch.float32)["ok"]


def test_without_numpy_the_offload_section_runs_all_but_its_memory_figure(cpu_report):
    report, stdout = cpu_report
    offload = report["sections"]["offload"]
    assert offload["ok"] and offload["bitwise"]["ok"] and offload["bandwidth"]["d2h_gbps"] > 0
    assert "needs numpy" in offload["memory"]["skipped"] and "needs numpy" in stdout


@pytest.fixture(scope="module")
def offload_result():
    """The offload section run in this process (numpy importable)."""
    common = _checks()[0]
    import offload_checks

    return offload_checks.run(common.cpu_mode(), lambda line: None, "torch")


def test_the_cpu_run_offloads_and_its_loss_and_gradients_are_bitwise_equal(offload_result):
    offload = offload_result
    assert offload["ok"] and offload["engine"] == "HostCopyEngine"
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


def test_the_train_section_checks_hdp_attention_against_megatrons_over_steps(train_report):
    train = train_report
    assert train["ok"] is True and train["dtype"] == "float32"
    check = train["attention_check"]
    assert check["ok"] and check["weights_equal"] and check["steps"] == 20
    assert check["tolerance"] == {"loss": 1e-4, "grad_norm": 1e-5}
    assert len(check["losses_hdp"]) == len(check["losses_megatron"]) == 20
    # The repeated batch is learnt: the loss falls, so attention shapes it.
    assert check["loss_fell"] and check["losses_megatron"][-1] < 0.8 * check["losses_megatron"][0]
    assert check["max_loss_relative_difference"] <= 1e-4
    norms = check["attention_grad_norms_step1"]
    assert len(norms) == 2 * 2  # linear_qkv and linear_proj of each of the 2 layers
    assert all(n["hdp"] > 0 and n["relative_difference"] <= 1e-5 for n in norms.values())
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


def _restart_positions_mid_sequence(monkeypatch):
    """RoPE positions restarting at 0 halfway through each 128-token sequence."""
    from megatron_hdp.attention.rope import RotaryTable

    real = RotaryTable.build.__func__
    monkeypatch.setattr(
        RotaryTable, "build", classmethod(lambda cls, pos, **kw: real(cls, pos % 64, **kw))
    )


def _leak_the_next_token(monkeypatch):
    """A causal leak: each token's attention output gets a tenth of the next token's value."""
    import megatron_hdp.megatron.core_attention as core_attention

    real = core_attention.hdp_attention

    def leaking(q, k, v, spec, **kw):
        out = real(q, k, v, spec, **kw)
        ahead = v.repeat_interleave(q.shape[1] // v.shape[1], 1)[1:]
        return torch.cat([out[:-1] + 0.1 * ahead, out[-1:]])

    monkeypatch.setattr(core_attention, "hdp_attention", leaking)


def _off_by_a_tenth_of_a_percent(monkeypatch):
    import megatron_hdp.megatron.core_attention as core_attention

    real = core_attention.hdp_attention
    monkeypatch.setattr(
        core_attention, "hdp_attention", lambda *args, **kw: real(*args, **kw) * 1.001
    )


@pytest.mark.parametrize(
    "inject",
    [_restart_positions_mid_sequence, _leak_the_next_token, _off_by_a_tenth_of_a_percent],
    ids=["rope_positions_restart", "causal_leak", "output_off_by_0.1pct"],
)
def test_an_integration_error_in_hdp_attention_fails_the_train_check(monkeypatch, inject):
    common, _, _ = _checks()
    import train_checks

    mode = dataclasses.replace(common.cpu_mode(), train_packed=(), train_compare=())
    inject(monkeypatch)
    result = train_checks.run(mode, lambda line: None, "torch")
    check = result["attention_check"]
    assert not result["ok"] and check["weights_equal"] and check["loss_fell"]
    tolerance = check["tolerance"]
    assert (
        check["max_loss_relative_difference"] > tolerance["loss"]
        or check["max_grad_norm_relative_difference"] > tolerance["grad_norm"]
    )


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


def test_a_section_that_raises_hangs_or_dies_costs_only_its_own_figures(tmp_path):
    out = tmp_path / "verify.json"
    env = dict(os.environ, HDP_VERIFY_FAULT="kernels:raise,ring:hang,offload:abort")
    started = time.monotonic()
    done = _run(
        "--cpu",
        "--sections",
        "env,kernels,ring,speed,offload",
        "--section-limit-s",
        "ring=3",
        "--out",
        str(out),
        env=env,
    )
    assert time.monotonic() - started < 90  # a hang costs its 3 s limit, not the default 600 s
    assert done.returncode == 3, done.stdout + done.stderr
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert report["exit_status"] == 3 and not report["ok"]
    assert report["incomplete"] == ["kernels", "ring", "offload"]
    kernels, ring, offload = sections["kernels"], sections["ring"], sections["offload"]
    assert kernels["status"] == "crashed" and "injected fault in kernels" in kernels["error"]
    assert any("Traceback" in line for line in kernels["output_tail"])
    assert ring["status"] == "timed_out" and 3 <= ring["seconds"] < 15
    assert offload["status"] == "crashed" and "SIGABRT" in offload["error"]
    speed = sections["speed"]  # the section after the hang still ran
    assert speed["status"] == "done" and speed["pack_path"] and speed["ring_steps"]
    assert sections["env"]["status"] == "done" and report["environment"]["git_revision"]
    for line in ("section  kernels  CRASHED", "section  ring     TIMED OUT", "section  speed"):
        assert line in done.stdout


def test_a_killed_run_leaves_the_json_of_every_section_that_ended(tmp_path):
    out = tmp_path / "verify.json"
    env = dict(os.environ, HDP_VERIFY_FAULT="ring:hang")
    process = subprocess.Popen(
        [sys.executable, str(VERIFY), "--cpu", "--sections", "speed,ring", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        for line in process.stdout:  # until the section after speed hangs
            if line.startswith("ring     injected fault: hang"):
                break
        report = json.loads(out.read_text())  # written after speed, not only at the end
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    assert report["sections"]["speed"]["status"] == "done"
    assert report["sections"]["speed"]["pack_path"] and "ring" not in report["sections"]


def test_sections_run_in_spawned_processes_as_on_a_gpu(tmp_path):
    out = tmp_path / "verify.json"
    env = dict(os.environ, HDP_VERIFY_FAULT="speed:raise")
    done = _run(
        "--cpu", "--sections", "env,speed", "--_start-method", "spawn", "--out", str(out), env=env
    )
    assert done.returncode == 3, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["environment"]["kernels_bf16"]["torch"] == "runs"
    assert report["sections"]["speed"]["status"] == "crashed"


def test_a_failing_ring_member_ends_its_peers_within_seconds(monkeypatch):
    common, _, ring_checks = _checks()
    monkeypatch.setattr(ring_checks, "RECEIVE_TIMEOUT_S", 30.0)
    real = ring_checks.ThreadRingComm.exchange

    def failing(self, send, recv, tag):
        if self.me == self.ring[0]:
            raise RuntimeError("member 0 failed")
        return real(self, send, recv, tag)

    monkeypatch.setattr(ring_checks.ThreadRingComm, "exchange", failing)
    mode = common.cpu_mode()
    lengths = (64, 40, 9)
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(sum(lengths), mode.heads, mode.head_dim, generator=gen) for _ in "qd")
    k, v = (torch.randn(sum(lengths), mode.groups, mode.head_dim, generator=gen) for _ in "kv")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="member 0 failed"):
        ring_checks.run_ring("torch", lengths, 4, q, k, v, dout, mode.head_dim**-0.5)
    assert time.monotonic() - started < 5


def test_a_kernel_that_returns_the_wrong_dtype_fails_its_check(monkeypatch):
    common, kernel_checks, _ = _checks()
    from megatron_hdp.attention.kernels import registry

    math_kernel = registry.get_kernel("math")

    class Widening:
        name = "returns_float32"

        def forward(self, *args, **kwargs):
            out, lse = math_kernel.forward(*args, **kwargs)
            return out.float(), lse

        def backward(self, *args, **kwargs):
            return math_kernel.backward(*args, **kwargs)

        def activate(self):
            pass

    monkeypatch.setitem(registry._KERNELS, Widening.name, Widening())
    mode = common.cpu_mode()
    case = kernel_checks.cases(mode)["multi_head_no_gqa"]
    result = kernel_checks.check_case(Widening.name, mode, torch.bfloat16, "mha", case)
    assert max(result["errors"].values()) <= result["tolerance"]  # the values are right
    assert not result["out_dtype_ok"] and not result["ok"]


def test_the_pack_path_timing_accumulates_no_gradients(monkeypatch):
    common, _, _ = _checks()
    import speed_checks

    from megatron_hdp.attention import ring

    seen = []
    real = ring.hdp_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append((q, k, v))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(ring, "hdp_attention", recording)
    speed_checks.pack_path(common.cpu_mode(), torch.float32, "torch", 256)
    assert len(seen) == 3 + 2 and all(t.grad is None for leaves in seen for t in leaves)


#: Names that Python 3.10 lacks (verify.py must run there: requires-python >= 3.10).
PYTHON_311_ONLY = {
    ("datetime", "UTC"),
    ("typing", "Self"),
    ("typing", "LiteralString"),
    ("typing", "Never"),
    ("typing", "assert_type"),
    ("typing", "reveal_type"),
    ("enum", "StrEnum"),
    ("asyncio", "TaskGroup"),
    ("asyncio", "timeout"),
    ("hashlib", "file_digest"),
    ("builtins", "ExceptionGroup"),
    ("builtins", "BaseExceptionGroup"),
}


def test_the_gpu_scripts_use_nothing_that_python_3_10_lacks():
    """verify.py and the package it imports (`megatron_hdp`) parse and name nothing newer."""
    found = []
    paths = [*(REPO / "scripts" / "gpu").glob("*.py"), *(REPO / "megatron_hdp").rglob("*.py")]
    for path in sorted(paths):
        tree = ast.parse(path.read_text(), feature_version=(3, 10))  # no except*, no 3.11 syntax
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                pair = (node.value.id, node.attr)
            elif isinstance(node, ast.ImportFrom):
                pair = next(
                    (
                        (node.module, a.name)
                        for a in node.names
                        if (node.module, a.name) in PYTHON_311_ONLY
                    ),
                    (node.module, None),
                )
                if node.module == "tomllib":
                    found.append((path.name, "tomllib"))
            elif isinstance(node, ast.Import):
                found += [(path.name, a.name) for a in node.names if a.name == "tomllib"]
                continue
            elif isinstance(node, ast.Name):
                pair = ("builtins", node.id)
            else:
                continue
            if pair in PYTHON_311_ONLY:
                found.append((path.name, ".".join(pair)))
    assert not found, found


def test_a_variant_no_kernel_runs_here_fails_with_the_reason_and_the_others_still_run(monkeypatch):
    common, variant_checks = _checks()[0], _variant_checks()
    real = variant_checks.registry.resolve_kernel

    def no_window(name, facts, **kwargs):
        if kwargs.get("window"):
            raise ValueError("no attention kernel runs this job on cpu: torch takes no window")
        return real(name, facts, **kwargs)

    monkeypatch.setattr(variant_checks.registry, "resolve_kernel", no_window)
    result = variant_checks.run(common.cpu_mode(), lambda line: None)
    assert not result["ok"]
    window = [r for r in result["results"] if r["case"] == "window"]
    assert window and all(not r["ok"] and "takes no window" in r["error"] for r in window)
    assert all(r["ok"] for r in result["results"] if r["case"] != "window")

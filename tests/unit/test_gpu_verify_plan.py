"""scripts/gpu/plan.py: verify.py's estimate fits one H100's budget and memory by construction."""

from __future__ import annotations

import sys

import pytest

from tests.unit.scripts_loader import REPO

sys.path.insert(0, str(REPO / "scripts" / "gpu"))
import common  # noqa: E402
import plan  # noqa: E402

SECTIONS = ("env", "kernels", "ring", "variants", "speed", "offload", "train")
#: An 80 GB H100 as CUDA describes it once its context exists (about 79 GB free).
H100_80GB = plan.Device(name="NVIDIA H100 80GB HBM3", free_bytes=79.2e9)
H200 = plan.Device(name="NVIDIA H200", free_bytes=139e9)


def _plan(quick: bool, device=H100_80GB, budget_s=None) -> plan.Plan:
    return plan.make_plan(common.gpu_mode(quick), SECTIONS, device, budget_s=budget_s)


def _part(p: plan.Plan, section: str, name: str) -> plan.Part:
    (found,) = [part for part in p.parts if part.section == section and part.name.startswith(name)]
    return found


@pytest.mark.parametrize(("quick", "target_s"), [(False, 300), (True, 150)])
def test_the_estimate_on_an_80gb_h100_meets_the_targets_without_dropping_anything(quick, target_s):
    p = _plan(quick, budget_s=target_s)
    assert p.total_seconds() <= target_s
    assert not [part.skipped for part in p.parts if "dropped" in (part.skipped or "")]
    for section in SECTIONS:  # every section runs, and its estimate is its parts' plus a start
        assert p.section_seconds(section) > plan.SECTION_START_S, section
    speed = [part.size for part in p.kept("speed")]
    assert speed == ([8192, 16384, 32768] if quick else [8192, 16384, 32768, 65536])


def test_what_an_80gb_h100_cannot_hold_is_skipped_with_the_reason_not_tried():
    p = _plan(quick=False)
    packed_64k = _part(p, "train", "packed 65536")
    megatron_8k = _part(p, "train", "compare 8192")
    for part in (packed_64k, megatron_8k):
        assert part.skipped and "GB free" in part.skipped and part.peak_bytes > 0.9 * 79.2e9
    assert not _part(p, "train", "packed 16384").skipped
    assert not _part(p, "train", "compare 4096").skipped and not _part(p, "train", "check").skipped
    mode = p.apply(common.gpu_mode(False))
    assert 65536 not in mode.train_packed and mode.train_compare == (4096,)
    # An H200 holds the 64K micro-batch; Megatron's unfused scores at 8K stay too large.
    on_h200 = _plan(quick=False, device=H200)
    assert not _part(on_h200, "train", "packed 65536").skipped
    assert _part(on_h200, "train", "compare 8192").skipped


def test_the_train_memory_uses_the_cost_models_activation_bytes():
    import train_checks

    from megatron_hdp.scheduler.cost import H100, CostModel, ModelShape

    dims = train_checks.GPU_MODEL
    shape = ModelShape(
        num_layers=dims["num_layers"],
        hidden_size=dims["hidden_size"],
        num_attention_heads=dims["num_attention_heads"],
        num_query_groups=dims["num_query_groups"],
        vocab_size=dims["vocab_size"],
    )
    assert plan._matmul_parameters(dims) == shape.params_per_token
    act = CostModel(shape, H100).activation_bytes_per_token()
    assert plan._activation_bytes_per_token(dims) == act
    part = _part(_plan(quick=False), "train", "packed 65536")
    # 73 GB of activations at 64K tokens (the audit's figure), plus states and logits.
    assert act * 65536 == pytest.approx(73e9, rel=0.01)
    assert part.peak_bytes > act * 65536 + 18 * 1.0e9


def test_a_budget_drops_the_lowest_priority_parts_first():
    full = _plan(quick=False)
    p = _plan(quick=False, budget_s=0.5 * full.total_seconds())
    assert p.total_seconds() <= 0.5 * full.total_seconds()
    dropped = [part for part in p.parts if "dropped" in (part.skipped or "")]
    kept = p.kept()
    assert dropped and kept
    assert max(part.priority for part in kept) <= min(part.priority for part in dropped)
    assert {"env", "kernels", "ring", "variants"} <= {part.section for part in kept}
    # A budget too small for anything keeps env alone (it is never dropped).
    tiny = _plan(quick=False, budget_s=1)
    assert {part.kind for part in tiny.kept()} == {"env"}
    assert all("--budget-s 1" in tiny.why_not(s) for s in ("kernels", "ring", "variants", "speed"))


def test_without_its_check_the_train_section_runs_nothing():
    small = plan.Device(name="a 24 GB GPU", free_bytes=24e9)
    p = _plan(quick=True, device=small)
    assert _part(p, "train", "check").skipped and p.why_not("train")
    assert all(part.skipped for part in p.parts if part.section == "train")
    assert "GB free" in _part(p, "train", "packed 16384").skipped


def test_on_cpu_the_plan_has_no_estimates_and_skips_nothing():
    p = plan.make_plan(common.cpu_mode(), SECTIONS, plan.Device("cpu", None), budget_s=1)
    assert p.total_seconds() is None and not any(part.skipped for part in p.parts)
    assert all(part.seconds is None and part.peak_bytes is None for part in p.parts)
    assert "no time estimate" in p.lines()[0]


def test_the_printed_plan_names_every_part_its_seconds_and_memory():
    p = _plan(quick=False)
    lines = p.lines()
    assert "H100 rates, assumed, not measured" in lines[0] and "GB free" in lines[0]
    assert len(lines) == 1 + len(p.parts)
    assert any("SKIPPED" in line and "packed 65536" in line for line in lines)
    assert p.to_json()["estimated_total_s"] == pytest.approx(p.total_seconds())


def test_a_section_limit_is_three_times_its_estimate_at_least_a_minute():
    assert plan.section_limit(100.0, 600.0) == 300.0
    assert plan.section_limit(5.0, 600.0) == 60.0
    assert plan.section_limit(None, 600.0) == 600.0


def test_the_docs_state_the_plans_estimates():
    full, quick = _plan(quick=False), _plan(quick=True)
    text = (REPO / "docs" / "gpu.md").read_text()
    totals = f"**{full.total_seconds():.0f} s / {quick.total_seconds():.0f} s**"
    assert totals in text and "Nothing in it has run on a GPU yet" in text
    for section in SECTIONS:
        row = f"{full.section_seconds(section):.0f} s / {quick.section_seconds(section):.0f} s |"
        assert any(
            line.startswith(f"| `{section}` |") and line.endswith(row) for line in text.splitlines()
        ), (section, row)

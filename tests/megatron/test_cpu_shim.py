"""The CPU shim: what it patches, that it is needed, and that it cleans up."""

import pytest
import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_hdp.distributed.layout import ParallelDims
from megatron_hdp.megatron.cpu_shim import cpu_shims
from megatron_hdp.megatron.model import GPTConfig, build_gpt, transformer_config
from tests.dist import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


def test_cuda_requests_land_on_cpu_inside_and_fail_outside():
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2, device="cuda")
    with cpu_shims():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(2, device=0).device.type == "cpu"
        assert torch.cuda.current_device() == "cpu"
        torch.cuda.synchronize()
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(2, dtype=torch.int64).type() == "torch.LongTensor"
        assert torch.zeros(2).type(torch.float64).dtype == torch.float64
        x = torch.zeros(2)
        assert x.cuda() is x
    assert torch.zeros(2).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2).cuda()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def test_shims_are_restored_after_an_error():
    def patched():
        return (
            torch.cuda.current_device,
            torch.cuda.synchronize,
            torch.Tensor.type,
            torch.Tensor.cuda,
        )

    before = patched()
    with pytest.raises(KeyError), cpu_shims():
        raise KeyError("boom")
    assert patched() == before


def _body_ddp(rank, world_size, shimmed):
    cfg = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32)
    layout = ParallelDims.of_world().initialize()
    try:
        model = build_gpt(cfg)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        if shimmed:
            with cpu_shims():
                DistributedDataParallel(transformer_config(cfg), ddp, model)
            return "ok"
        try:
            DistributedDataParallel(transformer_config(cfg), ddp, model)
        except (AssertionError, RuntimeError) as err:
            return f"failed: {err}"
        return "ok"
    finally:
        layout.destroy()
        dist.barrier()


def test_megatron_ddp_needs_the_shim_on_cpu():
    assert run_ranks(_body_ddp, 1, False)[0].startswith("failed")
    assert run_ranks(_body_ddp, 1, True)[0] == "ok"

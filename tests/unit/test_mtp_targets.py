"""Multi-token prediction's shifted targets: every rank's share equals the document rolled."""

import pytest
import torch

from megatron_hdp.data.batching import InMemoryTokens, read_local
from megatron_hdp.scheduler import plan_step


def _docs(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(1, 50, (n,), generator=gen) for n in lengths]
    labels = [torch.randint(1, 50, (n,), generator=gen) for n in lengths]
    masks = [(torch.rand(n, generator=gen) < 0.7).float() for n in lengths]
    return tokens, labels, masks


def _rolled(x: torch.Tensor, k: int) -> torch.Tensor:
    """Megatron-Core's roll of one unpacked sequence, applied `k` times (zero fill)."""
    for _ in range(k):
        x = torch.roll(x, -1)
        x[-1] = 0
    return x


@pytest.mark.parametrize("pool_size", [1, 2, 3, 4])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_every_rank_holds_its_tokens_rolled_within_their_document(pool_size, depth):
    """Documents split over rings of 2-4 ranks (chunks of 1-3 tokens at the edges, so a
    chunk can be shorter than the depth), packs of short ones, a 1-token document."""
    lengths = [1, 2, 5, 7, 3, 4 * pool_size + 3, 9 * pool_size - 1]
    tokens, labels, masks = _docs(lengths, seed=pool_size * 10 + depth)
    source = InMemoryTokens(tokens, labels, masks)
    plan = plan_step(lengths, pool_size=pool_size, capacity=9, policy="greedy")
    assert pool_size == 1 or any(mb.cp_size > 1 for mb in plan.micro_batches)
    seen = 0
    for rank in range(pool_size):
        for batch in read_local(plan, source, rank, mtp_depth=depth):
            sh = batch.shifted
            assert sh.tokens.shape == (depth, batch.num_tokens)
            positions = batch.position_ids[0].tolist()
            local = batch.shard.local_doc_lengths()
            docs = [i for i, n in zip(batch.doc_ids, local) for _ in range(n)]
            for j, (doc, pos) in enumerate(zip(docs, positions)):
                for k in range(1, depth + 1):
                    want = [_rolled(t[doc].clone(), k)[pos] for t in (tokens, labels, masks)]
                    want_pos = pos + k if pos + k < lengths[doc] else 0
                    got = (sh.tokens[k - 1, j], sh.labels[k - 1, j], sh.loss_mask[k - 1, j])
                    assert [float(x) for x in got] == [float(x) for x in want], (doc, pos, k)
                    assert int(sh.position_ids[k - 1, j]) == want_pos
                seen += 1
    assert seen == sum(lengths)


def test_shifted_targets_survive_the_device_copy():
    tokens, labels, masks = _docs([6, 11], seed=3)
    plan = plan_step([6, 11], pool_size=2, capacity=6, policy="greedy")
    batch = read_local(plan, InMemoryTokens(tokens, labels, masks), 1, mtp_depth=2)[0]
    # A device other than the batch's takes the one-buffer copy path; the copy stays on CPU.
    moved = batch.to(torch.device("meta"), copy=lambda host, device: host.clone())
    assert moved is not batch
    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(getattr(moved.shifted, name), getattr(batch.shifted, name)), name


def test_a_depth_below_one_is_refused():
    from megatron_hdp.data.mtp_targets import read_shifted

    with pytest.raises(ValueError, match="MTP depth must be >= 1, got 0"):
        read_shifted([], 0, None)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--mtp-num-layers", "0"], "--mtp-num-layers must be >= 1, got 0"),
        (
            ["--mtp-num-layers", "2", "--pipeline-model-parallel-size", "2"],
            "--mtp-num-layers 2 with --pipeline-model-parallel-size 2",
        ),
        (
            ["--mtp-num-layers", "1", "--hdp-data-service", "ray"],
            "--mtp-num-layers 1 with --hdp-data-service ray",
        ),
    ],
)
def test_pretrain_hdp_refuses_what_mtp_does_not_combine_with(extra, message):
    from megatron_hdp.megatron.arguments import build_parser
    from megatron_hdp.megatron.validation import check_mtp

    required = "--num-layers 2 --hidden-size 8 --num-attention-heads 1 --seq-length 8 "
    required += "--train-iters 1 --lr 1"
    args = build_parser().parse_args([*required.split(), *extra])
    with pytest.raises(ValueError, match=message):
        check_mtp(args)
    args = build_parser().parse_args([*required.split(), "--mtp-num-layers", "3"])
    check_mtp(args)  # accepted alone
    assert (args.mtp_num_layers, args.mtp_loss_scaling_factor) == (3, 0.1)


def test_a_checkpoint_from_before_mtp_resumes_and_adding_mtp_to_it_is_named():
    """A `meta.json` without the MTP fields is a model without MTP: it resumes as it was;
    a resume that adds MTP layers names the flag; the loss weight may change."""
    import dataclasses

    from megatron_hdp.megatron.model import GPTConfig
    from megatron_hdp.megatron.validation import check_resume_matches

    def resume(saved: GPTConfig, now: GPTConfig, drop=()):
        model = {k: v for k, v in dataclasses.asdict(saved).items() if k not in drop}
        meta = {"model": model, "data": {"prefixes": ["p"], "setup": {}}}
        check_resume_matches(
            meta, load="ck", model=dataclasses.asdict(now), data_setup={}, prefixes=["p"]
        )

    old = ("mtp_num_layers", "mtp_loss_scaling_factor")
    resume(GPTConfig(), GPTConfig(), drop=old)
    mtp = GPTConfig(mtp_num_layers=2)
    with pytest.raises(ValueError, match=r"--mtp-num-layers: None -> 2"):
        resume(GPTConfig(), mtp, drop=old)
    resume(mtp, dataclasses.replace(mtp, mtp_loss_scaling_factor=0.3))

"""Multi-token prediction: each local token's next `D` tokens in its document (ops layer).

Megatron-Core's MTP module of depth `k` (`--mtp-num-layers D`, `k = 1 .. D`) combines the
main model's hidden state of position `i` with the embedding of the token at `i + k` and
predicts the label at `i + k`: its input ids, position ids, labels and loss mask are the
main model's rolled `k` places to the left *within the document*, zero past its end
(`roll_tensor` in `megatron/core/transformer/multi_token_prediction.py`). Hidden states
are combined position by position, never shifted.

On a ring, a rank holds two zigzag chunks of a document; the `D` positions after a chunk's
end live on another rank. Instead of sending them, the reader reads them: the few tokens
after each local piece (`read_shifted`), so every rank has, for each of its tokens, the
values `k` places further on for `k = 1 .. D`, and no MTP communication is needed.
Pure tensor work on the host; no collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShiftedTargets:
    """The local tokens' values `k = 1 .. depth` places further on in their documents.

    Row `k - 1` of each `[depth, T]` tensor holds depth `k`: zero (mask 0, position 0)
    where `i + k` is past the document's end, as Megatron-Core's roll fills it.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    counts: tuple[float, ...] = ()
    """The loss mask's sum at every depth, counted on the host when the batch was read."""

    @property
    def depth(self) -> int:
        """`D`, the number of MTP depths."""
        return self.tokens.shape[0]

    def loss_tokens(self) -> list[float]:
        """The loss mask's sum at every depth (host floats; no device read)."""
        return list(self.counts)

    def padded(self, pad: int) -> ShiftedTargets:
        """The same with `pad` zero columns appended (sequence-parallel / FP8 padding)."""
        if not pad:
            return self

        def p(x):
            return torch.nn.functional.pad(x, (0, pad))

        return ShiftedTargets(
            p(self.tokens), p(self.labels), p(self.loss_mask), p(self.position_ids), self.counts
        )


def read_shifted(
    pieces: Sequence[tuple[int, int, int, tuple[torch.Tensor, ...]]],
    depth: int,
    read: Callable[[int, int, int], tuple[torch.Tensor, ...]],
) -> ShiftedTargets:
    """The shifted values of a rank's local pieces, reading the tokens after each piece.

    Args:
        pieces: `(doc_length, start, length, (tokens, labels, loss_mask))` of every local
            piece in local order: positions `[start, start + length)` of a document.
        depth: `D >= 1`.
        read: `read(piece_index, start, length)` -> `(tokens, labels, loss_mask)` of
            positions `[start, start + length)` of the piece's document (the boundary
            tokens: at most `depth` positions after a piece that ends inside its document).
    """
    if depth < 1:
        raise ValueError(f"the MTP depth must be >= 1, got {depth}")
    rows: list[list[list[torch.Tensor]]] = [[[] for _ in range(depth)] for _ in range(4)]
    for index, (doc_length, start, length, values) in enumerate(pieces):
        end = start + length
        extra = min(depth, doc_length - end)
        tail = read(index, end, extra) if extra > 0 else None
        if tail is not None and any(len(t) != extra for t in tail):
            raise ValueError(
                f"reading the {extra} tokens after positions [{start}, {end}) of a document of "
                f"{doc_length} returned {[len(t) for t in tail]} values"
            )
        fields = [torch.as_tensor(v) for v in values]
        if tail is not None:
            fields = [torch.cat([f, torch.as_tensor(t).to(f.dtype)]) for f, t in zip(fields, tail)]
        positions = torch.arange(start, start + len(fields[0]), dtype=torch.int64)
        fields.append(positions)
        for k in range(1, depth + 1):
            for f, field in enumerate(fields):
                shifted = field[k : k + length]
                rows[f][k - 1].append(torch.nn.functional.pad(shifted, (0, length - len(shifted))))

    def stack(f: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.stack(
            [torch.cat(r).to(dtype) if r else torch.zeros(0, dtype=dtype) for r in rows[f]]
        )

    loss_mask = stack(2, torch.float32)
    return ShiftedTargets(
        tokens=stack(0, torch.int64),
        labels=stack(1, torch.int64),
        loss_mask=loss_mask,
        position_ids=stack(3, torch.int64),
        counts=tuple(float(x) for x in loss_mask.sum(dim=1)),
    )

"""Check a ring member's results against a whole-document reference (tests only)."""

from __future__ import annotations

import torch


def assert_pieces_match(results, reference, pieces, msg: str, tol: float = 1e-10) -> None:
    """Each `(name, tensor, i)` of `results` equals the reference rows this member holds.

    `reference[d][i]` is document d's i-th whole tensor (out, dq, dk, dv); `pieces` are the
    member's `(document, start, length)` ranges, in local order.
    """
    for name, got, i in results:
        expected = torch.cat([reference[d][i][s : s + n] for d, s, n in pieces])
        torch.testing.assert_close(got.detach(), expected, rtol=tol, atol=tol, msg=f"{name}: {msg}")

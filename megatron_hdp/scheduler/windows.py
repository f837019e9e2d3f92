"""Sliding-window attention: the flags' meaning, their checks, and its price (pure).

Megatron-Core's `window_size` `(left, right)` with `right = 0` for causal models: the query
at position i of a document sees keys j with `i - left <= j <= i` (Transformer Engine's and
flash-attn's convention; Megatron-Core's local mask `get_sliding_window_causal_mask` is
`triu(diagonal=-left) & tril(diagonal=right)`). `window_attn_skip_freq` says which layers
keep full attention (`transformer.utils.is_layer_window_attention`, layers numbered from 1):
an int N makes every N-th layer full, a list has one 1 (windowed) or 0 (full) per layer.

The price (`CostModel`): a windowed layer computes `attention_pairs(s, w)` (query, key)
pairs instead of `s^2 / 2`, and its ring carries at most `window_ring_rows` K/V rows per
member and hop instead of `s / k` (`attention.window`: after the first hop only the tails
of the chunks that later members' windows reach still travel).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_window(window_size) -> int | None:
    """The left window of Megatron's `window_size` `(left, right)`; None for None.

    ValueError naming the value for anything HDP's causal attention cannot honour: a right
    window other than 0 (future tokens), a negative left window (-1, Megatron's "infinite",
    is full causal attention: leave the window out), or not two integers.
    """
    if window_size is None:
        return None
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(
            f"--window-size {window_size!r}: expected two integers 'left,right'"
        ) from None
    if right != 0:
        raise ValueError(
            f"--window-size {left},{right}: HDP attention is causal, the right window must be 0"
        )
    if left < 0:
        raise ValueError(
            f"--window-size {left},{right}: a negative left window is full causal attention; "
            "leave --window-size out for it"
        )
    return left


def window_problems(window_size, skip_freq, *, num_layers: int) -> list[str]:
    """Why `--window-size` / `--window-attn-skip-freq` cannot run as given (empty: they can).

    Megatron-Core's meaning (`transformer.utils.is_layer_window_attention`, layers numbered
    from 1): an int N windows every layer but each N-th; a list has one 1 (windowed) or 0
    (full) per layer. Megatron would fail inside the model on an N of 0 or a list of another
    length; here they are refused at start-up, naming the value.
    """
    problems = []
    try:
        check_window(window_size)
    except ValueError as err:
        problems.append(str(err))
    if skip_freq is not None:
        if window_size is None:
            problems.append(
                f"--window-attn-skip-freq {skip_freq!r} needs --window-size (no layer is windowed)"
            )
        if isinstance(skip_freq, int) and not isinstance(skip_freq, bool):
            if skip_freq < 1:
                problems.append(f"--window-attn-skip-freq {skip_freq}: must be >= 1")
        elif isinstance(skip_freq, (list, tuple)):
            if len(skip_freq) != num_layers or any(x not in (0, 1) for x in skip_freq):
                problems.append(
                    f"--window-attn-skip-freq {list(skip_freq)}: needs one 1 (window) or 0 "
                    f"(full) per layer, {num_layers} layers"
                )
        else:
            problems.append(f"--window-attn-skip-freq {skip_freq!r}: an int or a list of 0/1")
    return problems


def windowed_layers(num_layers: int, window_size, skip_freq) -> tuple[bool, ...]:
    """Whether each layer (1 .. num_layers) attends within the window: Megatron-Core's rule."""
    if not window_size:
        return (False,) * num_layers
    if skip_freq is None:
        return (True,) * num_layers
    if isinstance(skip_freq, int):
        return tuple(layer % skip_freq != 0 for layer in range(1, num_layers + 1))
    return tuple(bool(skip_freq[layer - 1]) for layer in range(1, num_layers + 1))


def attention_pairs(s, window: int | None):
    """(query, key) pairs of causal attention over a sequence of `s` tokens (arrays too).

    `s^2 / 2` for full attention (the cost model's long-standing count); within a window of
    `w` (W = w + 1 keys per query) `s^2 / 2` up to `s = W`, then `s W - W^2 / 2` (the band).
    """
    s = np.asarray(s, dtype=np.float64)
    full = s * s / 2.0
    if window is None:
        return full
    width = float(window) + 1.0
    return np.where(s <= width, full, s * width - width * width / 2.0)


def window_ring_rows(tokens_per_member, window: int):
    """K/V rows one member sends per hop of a windowed layer's ring (arrays too).

    At most the `w + 1` last rows of each of its two zigzag chunks reach a window beyond
    them, and never more than it holds.
    """
    local = np.asarray(tokens_per_member, dtype=np.float64)
    return np.minimum(local, 2.0 * (float(window) + 1.0))


def parse_window_size(text: str) -> tuple[int, ...]:
    """Megatron-LM's `tuple_type`: "128,0" or "(128,0)" -> (128, 0)."""
    return tuple(int(i) for i in text.strip("()").split(","))


def parse_skip_freq(text: str) -> int | list[int]:
    """Megatron-LM's `moe_freq_type` for --window-attn-skip-freq: "4" or a list expression.

    A list expression holds digits, commas, brackets, parentheses, + and * only, e.g.
    "([1]*3+[0])*2"; anything else is refused (Megatron-LM's `_eval_pattern`).
    """
    text = str(text)
    if "[" not in text:
        return int(text)
    if any(c not in "0123456789,[]()+* " for c in text):
        raise ValueError(f"invalid pattern {text!r}")
    value = eval(text, {"__builtins__": {}}, {})  # noqa: S307 - digits and list operators only
    if not isinstance(value, list):
        raise ValueError(f"pattern {text!r} is not a list")
    return value


__all__: Sequence[str] = (
    "check_window",
    "window_problems",
    "windowed_layers",
    "attention_pairs",
    "window_ring_rows",
    "parse_window_size",
    "parse_skip_freq",
)

"""Packed rows (data.pack=true): several conversations in one row of at most data.max_length tokens.

Which conversations share a row is a pure function of the conversations' lengths and the row's
capacity (first-fit decreasing: the longest conversation first, each into the first row it still
fits), so a resumed run packs as the interrupted one did. A packed batch carries each token's
`document` (its conversation's place in the row, -1 on padding) and `position_ids` restarting at 0
with every conversation; the target and every head keep attention, positions and shifted targets
inside one conversation, so a packed row computes what its conversations padded one per row do,
without the padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import SpecHeadsError


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Row indices grouped into packs of at most `capacity` tokens: first-fit decreasing.

    Rows are taken longest first (ties by index) and each goes into the first pack with room for
    it, else opens a new one; a pack lists its rows in the order they went in. The first pack with
    room is found in a tree of the packs' free room (a max-tree over pack numbers), so packing a
    million rows costs a million tree descents, not a scan of every pack per row."""
    if capacity < 1:
        raise SpecHeadsError(f"data.max_length must be >= 1 to pack rows, got {capacity}")
    lengths = [int(n) for n in lengths]
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise SpecHeadsError(
            f"{len(too_long)} row(s) of up to {max(too_long)} tokens do not fit a packed row of "
            f"data.max_length={capacity}"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    # free[size + p] is the room left in pack p (-1: not opened yet); free[i] the most in i's subtree
    free = [-1] * (2 * size)
    packs: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if free[1] >= n:
            node = 1
            while node < size:  # the leftmost child with room: the first pack that fits
                node = 2 * node if free[2 * node] >= n else 2 * node + 1
            p = node - size
            packs[p].append(i)
        else:
            p = len(packs)
            packs.append([i])
            node = size + p
            free[node] = capacity
        free[node] -= n
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return packs


def pack_lengths(lengths: Sequence[int], packs: Sequence[Sequence[int]]) -> list[int]:
    """The tokens in each pack."""
    return [sum(int(lengths[i]) for i in pack) for pack in packs]


def packed_layout(lengths: Sequence[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document, position_ids) LongTensors [width] of one packed row holding conversations of
    `lengths` tokens in turn: the conversation's place in the row (-1 on the padding after them)
    and the position inside it. The padding counts positions from 0 too, a sequence of its own, so
    that a target told only the positions (transformers finds packed sequences where they restart)
    keeps it apart from the last conversation."""
    document = torch.full((width,), -1, dtype=torch.long)
    positions = torch.zeros(width, dtype=torch.long)
    start = 0
    for d, n in enumerate(lengths):
        document[start : start + n] = d
        positions[start : start + n] = torch.arange(n)
        start += n
    positions[start:] = torch.arange(width - start)
    return document, positions

"""Subgroups: the optimizer's flat fp32 state cut into pieces of about the same size.

A subgroup is a list of pieces, each a ``[start, stop)`` range of one state tensor (viewed flat),
so a subgroup may span several small tensors and a large tensor may span several subgroups. A cut
inside a tensor falls on a multiple of ``ALIGN`` elements from its start: CPU kernels vectorise
an elementwise op and finish with a scalar tail, and the two may round differently (FMA); cutting
on a multiple of every vector width keeps each element on the path it takes when the whole tensor
is updated at once, so the update stays bit-identical to one over the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 64


@dataclass(frozen=True)
class Piece:
    tensor: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Subgroup:
    index: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def partition(numels: list[int], subgroup_numel: int) -> list[Subgroup]:
    """Subgroups of at most ``subgroup_numel`` elements (rounded up to ``ALIGN``) in tensor order."""
    if subgroup_numel <= 0:
        raise ValueError(f"subgroup size must be positive, not {subgroup_numel}")
    capacity = -(-subgroup_numel // ALIGN) * ALIGN
    subgroups: list[Subgroup] = []
    pieces: list[Piece] = []
    room = capacity
    for tensor, numel in enumerate(numels):
        start = 0
        while start < numel:
            take = numel - start
            if take > room:  # cut inside the tensor: on an ALIGN boundary from its start
                take = room // ALIGN * ALIGN
            if take == 0:  # less than ALIGN left in this subgroup: close it
                subgroups.append(Subgroup(len(subgroups), tuple(pieces)))
                pieces, room = [], capacity
                continue
            pieces.append(Piece(tensor, start, start + take))
            start += take
            room -= take
            if room == 0:
                subgroups.append(Subgroup(len(subgroups), tuple(pieces)))
                pieces, room = [], capacity
    if pieces:
        subgroups.append(Subgroup(len(subgroups), tuple(pieces)))
    return subgroups


def capacity(subgroups: list[Subgroup]) -> int:
    """Elements of the largest subgroup: the size of one staging buffer."""
    return max((sg.numel for sg in subgroups), default=0)


def spread(count: int, total: int) -> frozenset[int]:
    """``count`` subgroup indices out of ``total``, evenly spaced (the model's choice of which)."""
    count = max(0, min(count, total))
    return frozenset((i * total) // count for i in range(count)) if count else frozenset()


def strided(stride: int, total: int) -> frozenset[int]:
    """Every ``stride``-th subgroup on the GPU (a fixed stride, as the Deep Optimizer States code does)."""
    if stride <= 0:
        raise ValueError(f"stride must be positive, not {stride}")
    return frozenset(range(0, total, stride))

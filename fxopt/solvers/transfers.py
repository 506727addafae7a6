"""Copies between device and host memory: what OFFLOAD is planned with, and how the simulator
times them.

OFFLOAD keeps a SAVEd value in host memory between the forward and the backward: after its last
forward use it is copied device→host (D2H), its device memory is let go once that copy completes,
and before the backward first reads it, it is copied back host→device (H2D). Whether that pays
depends on time, not only bytes: a copy takes ``bytes / bandwidth`` seconds, and a backward node
whose input is not back yet waits (the *exposed* transfer time, which the plan's cost counts).

The model, as `fxopt.solvers.schedule.simulate` applies it:

  - two channels, D2H and H2D (a GPU's copy engines: each direction has its own), each serving
    its copies one at a time, in the order they are issued, at its bandwidth (`Channel`);
  - the clock advances by each node's compute time (`Node.cost`, the cost model's seconds) and,
    in the backward, by the stalls;
  - a reload cannot start before its value's offload has completed.

`Transfers` carries the bandwidths (and an optional host memory budget) on the solver graph
(`Graph.transfers`); a graph without it offers no OFFLOAD, and every result is what it was before
OFFLOAD existed.
"""

from __future__ import annotations

import dataclasses
import math

# PCIe gen4 x16 moves 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s per direction in theory; copies
# from pinned host memory reach about 20-26 GB/s in practice. We take 20 GB/s each way, the
# conservative end, until a later slice measures the bandwidths per device (REFERENCE §6: an H100
# on PCIe gen5 measures ~35 GB/s H2D, ~53 GB/s D2H; GH200's C2C link 340-420 GB/s).
PCIE_GEN4_X16_BYTES_PER_S = 20e9


@dataclasses.dataclass(frozen=True)
class Transfers:
    """Bandwidths of the copies between device and host, in bytes per second, and the host memory
    OFFLOAD may hold at once (None: no limit). A plan whose simulated host peak exceeds
    ``host_budget`` is *over budget*, like one whose device peak exceeds the device budget: it is
    a valid program, and `fxopt.solvers.solve` never returns it."""

    d2h_bytes_per_s: float = PCIE_GEN4_X16_BYTES_PER_S
    h2d_bytes_per_s: float = PCIE_GEN4_X16_BYTES_PER_S
    host_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:  # (also rejects NaN)
                raise ValueError(f"Transfers.{name} must be positive, got {value}")
        if self.host_budget is not None and self.host_budget < 0:
            raise ValueError(f"Transfers.host_budget must be at least 0, got {self.host_budget}")

    def d2h_seconds(self, nbytes: int) -> float:
        return nbytes / self.d2h_bytes_per_s

    def h2d_seconds(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Transfers:
        return cls(**d)


# Copies that take no time: the clock of a schedule without waiting on any copy.
INSTANT = Transfers(math.inf, math.inf)


@dataclasses.dataclass(frozen=True)
class Copy:
    """One copy on a channel, in seconds from the start of the step (for a timeline's plot)."""

    channel: str  # "d2h" (offload) or "h2d" (reload)
    value: str  # the node's name
    bytes: int
    issued: float  # when the copy was asked for
    start: float  # when the channel began it: issued, or later if busy (or, for a reload, waiting on the offload)
    end: float  # when it completed
    needed: float | None = None  # a reload: when the backward first wanted the value (it waited until ``end``)

    @property
    def exposed(self) -> float:
        """Seconds the backward waited for this copy (a reload's stall; 0 for an offload)."""
        return 0.0 if self.needed is None else max(0.0, self.end - self.needed)


class Channel:
    """One direction of copies: served one at a time, in the order issued, at ``bytes_per_s``."""

    def __init__(self, name: str, bytes_per_s: float):
        self.name, self.bytes_per_s = name, bytes_per_s
        self.free_at = 0.0
        self.copies: list[Copy] = []

    def copy(self, value: str, nbytes: int, issued: float, *, not_before: float = 0.0) -> Copy:
        """Queue a copy issued at ``issued`` that may not start before ``not_before``."""
        start = max(issued, not_before, self.free_at)
        end = start + nbytes / self.bytes_per_s
        self.free_at = end
        self.copies.append(Copy(self.name, value, nbytes, issued, start, end))
        return self.copies[-1]


def host_peak_bytes(copies: list[Copy]) -> int:
    """The most host memory held at once: an offload holds its bytes from its issue (the host
    buffer is taken then) until its reload completes, or to the end of the step if none."""
    events: list[tuple[float, int, int]] = []  # (time, order, +/- bytes): at one time, frees first
    for c in copies:
        if c.channel == "d2h":
            events.append((c.issued, 1, c.bytes))
        else:
            events.append((c.end, 0, -c.bytes))
    peak = held = 0
    for _, _, delta in sorted(events):
        held += delta
        peak = max(peak, held)
    return peak

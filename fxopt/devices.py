"""Device profiles: what a device's memory and speeds are, as data (``fxopt/profiles/*.json``).

A profile is one JSON file: the memory semantics planning needs (the allocator's rounding, the
cuBLAS workspace held once the first matrix product ran, the scratch of kernels that cannot be
measured where the plan is made, as a stated conservative factor, never zero) and its speeds
(FLOP rate per dtype, memory bandwidth, host link for OFFLOAD, interconnect for collectives).
Each number carries its source in the file. ``device="H100-80GB"`` names a shipped file; a path
to a JSON file of the same fields is a user's own (`load`). No torch here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from fxopt.units import format_bytes

SHIPPED = Path(__file__).resolve().parent / "profiles"
KINDS = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One device's memory semantics and speeds (see the module's doc; the JSON's fields)."""

    name: str
    kind: str
    memory_bytes: int | None
    round_bytes: int
    cublas_workspace_bytes: int
    scratch_factor: float
    scratch_measured: bool
    flops_per_second: dict[str, float]
    memory_bandwidth_bytes_per_second: float
    host_link_bytes_per_second: float | None
    interconnect_bytes_per_second: float | None
    path: str

    def rounded(self, nbytes: int) -> int:
        """``nbytes`` as the device's allocator holds it (rounded up to its block size)."""
        return rounded_up(nbytes, self.round_bytes)

    def planning_note(self) -> str:
        """How a plan made for this profile on fake tensors counted memory (a plan's ``planned_for``)."""
        if self.scratch_measured:
            return f"planned for {self.name} on fake tensors; scratch measured on this host"
        return (f"planned for {self.name} on fake tensors: each storage rounded up to {self.round_bytes} B, "
                f"{format_bytes(self.cublas_workspace_bytes)} cuBLAS workspace resident, scratch a formula bound "
                f"(ops not known to allocate only their outputs: {self.scratch_factor:g} x their inputs and outputs), "
                "not measured; the ops as this host's torch chooses them")


def rounded_up(nbytes: int, block: int) -> int:
    """``nbytes`` as an allocator of ``block``-byte blocks holds them (0 stays 0)."""
    return -(-nbytes // block) * block if nbytes > 0 else 0


def names() -> list[str]:
    """The shipped profiles' names."""
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def load(device: str | Path | DeviceProfile) -> DeviceProfile:
    """A profile: a `DeviceProfile` as it is, a shipped profile's name, or the path of a JSON file
    with the same fields. A name that is neither is refused, naming the shipped ones."""
    if isinstance(device, DeviceProfile):
        return device
    if not isinstance(device, (str, Path)):
        raise TypeError(f"device must be a profile's name ({', '.join(names())}), the path of a profile's "
                        f"JSON or a fxopt.devices.DeviceProfile; got {type(device).__name__}")
    path = Path(device)
    if not (path.suffix == ".json" and path.exists()):
        path = SHIPPED / f"{device}.json"
        if not path.exists():
            raise ValueError(f"no device profile {str(device)!r}: the shipped ones are {', '.join(names())}; or "
                             f"give the path of a JSON file with the fields of {SHIPPED / 'H100-80GB.json'}")
    return _read(str(path.resolve()))


@functools.cache
def _read(path: str) -> DeviceProfile:
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"device profile {path}: not readable JSON ({err})") from None
    try:
        scratch = data["scratch"]
        profile = DeviceProfile(
            name=str(data["name"]), kind=str(data["kind"]), memory_bytes=data["memory_bytes"],
            round_bytes=int(data["allocator"]["round_bytes"]),
            cublas_workspace_bytes=int(data["cublas_workspace_bytes"]),
            scratch_factor=float(scratch["default_factor"]), scratch_measured=bool(scratch.get("measured", False)),
            flops_per_second={k: float(v) for k, v in data["flops_per_second"].items()},
            memory_bandwidth_bytes_per_second=float(data["memory_bandwidth_bytes_per_second"]),
            host_link_bytes_per_second=data["host_link_bytes_per_second"],
            interconnect_bytes_per_second=data["interconnect_bytes_per_second"], path=path)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"device profile {path}: missing or bad field ({err!r}); see the shipped "
                         f"{SHIPPED / 'H100-80GB.json'} for the fields") from None
    if profile.kind not in KINDS:
        raise ValueError(f"device profile {path}: kind {profile.kind!r} is not one of {', '.join(KINDS)}")
    if not profile.flops_per_second.get("float32", 0) > 0:
        raise ValueError(f"device profile {path}: flops_per_second must give a positive float32 rate (the rate "
                         "of a dtype it does not list)")
    if profile.round_bytes < 1:
        raise ValueError(f"device profile {path}: allocator.round_bytes must be at least 1")
    if not profile.scratch_measured and not profile.scratch_factor > 0:
        raise ValueError(f"device profile {path}: scratch.default_factor must be positive (scratch that cannot be "
                         "measured is never assumed zero)")
    return profile

"""The bandwidths OFFLOAD is planned with (`fxopt.solvers.transfers.Transfers`), measured per device.

A short benchmark copies a pinned host buffer to the device and back (``MEASURE_BYTES``, each
direction ``REPEATS`` times after one warm-up, on a side stream as `fxopt.ops.offload` copies) and
takes the fastest repeat of each direction: the copy engines' rate when nothing else shares the
link, which is what the simulator's channels assume. It runs once per device and machine: the
result is cached in this process and on disk, next to the plan cache (`fxopt.cache`), in a file
named after the machine and the device (the scratch measurements' key, `fxopt.analysis.scratch`);
``FXOPT_CACHE=0`` turns the disk cache off.

A device without separate memory (CPU) has nothing to measure: OFFLOAD asked for there is planned
with the documented default, `fxopt.solvers.transfers.PCIE_GEN4_X16_BYTES_PER_S` each way (useful
for tests and dry runs; it saves no memory on CPU, host and device being the same memory).
"""

from __future__ import annotations

import json
import logging
import time

import torch

from fxopt import cache
from fxopt.analysis.scratch import machine_key
from fxopt.solvers.transfers import Transfers

log = logging.getLogger("fxopt")

MEASURE_BYTES = 32 << 20  # large enough that the per-copy latency (~10 us) is under 1% of it
REPEATS = 5
_measured: dict[str, Transfers] = {}  # device name -> its bandwidths, this process


def device_transfers(device: torch.device) -> Transfers:
    """The bandwidths between ``device`` and pinned host memory: measured on CUDA (once per machine
    and device), the documented defaults elsewhere."""
    if device.type != "cuda":
        return Transfers()
    name = f"{machine_key()}-cuda{device.index or 0}"
    if name not in _measured:
        _measured[name] = _from_disk(name) or _store(name, measure(device))
    return _measured[name]


def measure(device: torch.device, nbytes: int = MEASURE_BYTES, repeats: int = REPEATS) -> Transfers:
    """Time ``repeats`` copies of ``nbytes`` each way between pinned host memory and ``device``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    best = {"d2h": float("inf"), "h2d": float("inf")}
    for k in range(repeats + 1):  # the first round warms up (stream creation, lazy init)
        for direction, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
            end.synchronize()
            if k:
                best[direction] = min(best[direction], start.elapsed_time(end) / 1e3)
    found = Transfers(d2h_bytes_per_s=nbytes / best["d2h"], h2d_bytes_per_s=nbytes / best["h2d"])
    log.info("fxopt: measured %s <-> host: %.1f GB/s to host, %.1f GB/s to device", device,
             found.d2h_bytes_per_s / 1e9, found.h2d_bytes_per_s / 1e9)
    return found


def _path():
    return cache.directory() / "bandwidth.json" if cache.enabled() else None


def _entries() -> dict:
    path = _path()
    try:
        entries = json.loads(path.read_text()) if path is not None and path.exists() else {}
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError) as err:
        log.info("fxopt: ignoring unreadable bandwidth cache %s (%s)", path, err)
        return {}


def _from_disk(name: str) -> Transfers | None:
    entry = _entries().get(name)
    try:
        return None if entry is None else Transfers(entry["d2h_bytes_per_s"], entry["h2d_bytes_per_s"])
    except (KeyError, TypeError, ValueError):
        return None


def _store(name: str, found: Transfers) -> Transfers:
    path = _path()
    if path is None:
        return found
    entries = _entries()
    entries[name] = dict(found.to_dict(), measured_at=time.time())
    entries[name].pop("host_budget", None)
    cache.write_table(path, entries, "bandwidths")
    return found

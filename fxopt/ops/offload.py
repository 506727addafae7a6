"""OFFLOAD's copies as torch.library custom ops: ``fxopt::offload`` (device → host after a value's
last forward use), ``fxopt::reload`` (host → device at the plan's reload point) and
``fxopt::wait_reload`` (the first backward reader waits for the reload), each taking the key of
the plan's `HostCopies`, the state the copies share.

    forward:  h = relu(x); h_host = fxopt.offload(h, key, slot)   # h's device memory freed once copied
              return (out, h_host)
    backward: h_1 = fxopt.reload(h_host, key, slot, device)       # issued at the reload point
              ...                                                  # compute overlaps the copy
              h_2 = fxopt.wait_reload(h_1, key, slot); g = threshold_backward(gy, h_2)

Why not torch's own ``ao::offload`` / ``ao::reload`` / ``ao::wait_tensor``
(``torch._functorch._activation_offloading.offload_ops``): they are private and changed signature
between torch releases (``ao::reload(t, device)`` became ``ao::reload(t, device, size, stride)``),
so one call site cannot serve torch >= 2.11; they share one transfer stream between both
directions, where fxopt's simulator plans a channel per direction (a GPU has a copy engine each
way); they free the device tensor in ``wait_tensor``, which makes the compute stream wait on the
copy at that point, where fxopt's plan frees it when the copy completes without stalling compute;
their pinned pool is global and keyed by shape, enabled by a context manager around the training
loop; and they raise "Accelerator expected" on CPU, where fxopt's tests run. The equivalent here is
small: `HostCopies`.

On CUDA: a copy stream per direction and device; ``non_blocking`` copies into a pinned host arena
with one slot per offloaded value, allocated at the first step and reused by every later one (no
``cudaHostAlloc`` per tensor). The device tensor an offload copies is marked used by the D2H stream
(``record_stream``), and the forward drops it right after the offload (its last use), so the caching
allocator reuses its memory once the copy completes, not before, and the compute stream never waits
for it: what the simulator models. (The allocator's ``allocated`` count, which
``torch.cuda.max_memory_allocated`` reads, drops the tensor when the forward does; its block stays
unusable until the copy completes, so the real occupancy is what the simulator predicts, and the
allocated count can read lower.) A reload allocates its device tensor on the compute stream and
fills it on the H2D stream once both the compute issued before it and the value's offload are done;
``wait_reload`` makes the compute stream wait for that copy, right before the first reader.

On CPU (and any device that is host memory) the copies are synchronous: the offload is a copy into
a host arena slot, a separate tensor, and the reload a copy out of it, so the rewritten graph runs
and is tested everywhere; it saves no memory there (host and device are the same memory).

A slot is reused by the next step's offload only after this step's reload read it (an event on the
H2D stream) or the host copy was dropped unread (its backward never ran). A second forward before
the first one's backward finds its slots busy and takes another arena: one arena per step in
flight.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_ALIGN = 64  # bytes: every slot starts aligned for any dtype (and for fast DMA)
_keys = itertools.count(1)
_runtimes: weakref.WeakValueDictionary[int, HostCopies] = weakref.WeakValueDictionary()


def extent_bytes(shape, stride, itemsize: int) -> int:
    """Bytes a tensor of this shape and stride spans from its first element (0 if empty)."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * itemsize


class _Arena:
    """One step's host memory: a slot per offloaded value. A slot is busy from its offload until
    its reload was issued (then the next offload into it waits on ``read``, the H2D copy's
    event) or its host copy died unread."""

    def __init__(self, nbytes: int, pin: bool):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.held: dict[int, weakref.ref] = {}  # slot -> its host copy, until reloaded
        self.read: dict[int, object] = {}  # slot -> event recorded after its last reload (CUDA)

    def busy(self, slot: int) -> bool:
        ref = self.held.get(slot)
        return ref is not None and ref() is not None


class HostCopies:
    """The copies of one rewritten step: the slots of its offloaded values (``slots[k]``: byte
    offset and size in an arena), the arenas (allocated at the first offload, reused after), and
    on CUDA the two copy streams and the events that order them."""

    def __init__(self, slot_bytes: list[int]):
        self.slots: list[tuple[int, int]] = []
        offset = 0
        for nbytes in slot_bytes:
            self.slots.append((offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.arena_bytes = offset
        self.arenas: list[_Arena] = []
        self.streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
        self.offloaded: dict[tuple[int, int], object] = {}  # (arena, slot) -> D2H completion event
        self.reloading: dict[int, object] = {}  # slot -> H2D completion event, until waited on
        self.key = next(_keys)
        _runtimes[self.key] = self

    # -- helpers for the ops below --------------------------------------------------------------

    def _arena_for(self, slot: int, pin: bool) -> tuple[int, _Arena]:
        for k, arena in enumerate(self.arenas):
            if not arena.busy(slot):
                return k, arena
        self.arenas.append(_Arena(self.arena_bytes, pin))
        return len(self.arenas) - 1, self.arenas[-1]

    def _arena_of(self, host: torch.Tensor) -> tuple[int, _Arena]:
        ptr = host.data_ptr()
        for k, arena in enumerate(self.arenas):
            base = arena.buffer.data_ptr()
            if base <= ptr < base + max(1, self.arena_bytes):
                return k, arena
        raise RuntimeError("fxopt: a reloaded value is not in this step's host arena")

    def _stream(self, direction: str, device: torch.device):
        key = (direction, device)
        if key not in self.streams:
            self.streams[key] = torch.cuda.Stream(device=device)
        return self.streams[key]

    def host_slot(self, arena: _Arena, slot: int, like: torch.Tensor) -> torch.Tensor:
        offset, nbytes = self.slots[slot]
        raw = arena.buffer[offset:offset + nbytes]
        return raw.view(like.dtype).as_strided(like.shape, like.stride())

    # -- the copies -----------------------------------------------------------------------------

    def offload(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        cuda = x.device.type == "cuda"
        k, arena = self._arena_for(slot, pin=cuda)
        host = self.host_slot(arena, slot, x)
        if not cuda:
            host.copy_(x)
        else:
            stream = self._stream("d2h", x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))  # x is computed
            read = arena.read.pop(slot, None)
            if read is not None:
                stream.wait_event(read)  # the last step's reload has read this slot
            with torch.cuda.stream(stream):
                host.copy_(x, non_blocking=True)
            # The allocator reuses x's block only once the D2H stream is past this copy; the
            # forward drops x right after this op (its last use).
            x.record_stream(stream)
            self.offloaded[(k, slot)] = stream.record_event()
        arena.held[slot] = weakref.ref(host)
        return host

    def reload(self, host: torch.Tensor, slot: int, device: torch.device) -> torch.Tensor:
        k, arena = self._arena_of(host)
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        if device.type != "cuda":
            out.copy_(host)
        else:
            stream = self._stream("h2d", device)
            # ``out`` was allocated on the compute stream: its block may be one that compute
            # issued before this point still uses.
            stream.wait_stream(torch.cuda.current_stream(device))
            stream.wait_event(self.offloaded.pop((k, slot)))
            with torch.cuda.stream(stream):
                out.copy_(host, non_blocking=True)
            done = stream.record_event()
            self.reloading[slot] = done
            arena.read[slot] = done
        arena.held.pop(slot, None)
        return out

    def wait(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        done = self.reloading.pop(slot, None)
        if done is not None:
            torch.cuda.current_stream(x.device).wait_event(done)
        return x


def runtime(key: int) -> HostCopies:
    try:
        return _runtimes[key]
    except KeyError:
        raise RuntimeError(f"fxopt: the offload state {key} of this step is gone") from None


@torch.library.custom_op("fxopt::offload", mutates_args=())
def offload(x: torch.Tensor, key: int, slot: int) -> torch.Tensor:
    return runtime(key).offload(x, slot)


@offload.register_fake
def _(x, key, slot):
    return x.new_empty_strided(x.shape, x.stride(), device="cpu")


@torch.library.custom_op("fxopt::reload", mutates_args=())
def reload(host: torch.Tensor, key: int, slot: int, device: torch.device) -> torch.Tensor:
    return runtime(key).reload(host, slot, device)


@reload.register_fake
def _(host, key, slot, device):
    return host.new_empty_strided(host.shape, host.stride(), device=device)


# wait_reload returns its input (so that the reader depends on the wait), which custom_op forbids:
# defined through torch.library with an aliasing schema, as torch's ao::wait_tensor is.
_lib = torch.library.Library("fxopt", "FRAGMENT")
_lib.define("wait_reload(Tensor(a) x, int key, int slot) -> Tensor(a)")


@torch.library.impl("fxopt::wait_reload", "CompositeExplicitAutograd")
def _wait_reload(x: torch.Tensor, key: int, slot: int) -> torch.Tensor:
    return runtime(key).wait(x, slot)


@torch.library.register_fake("fxopt::wait_reload")
def _(x, key, slot):
    return x


torch.fx.node.has_side_effect(torch.ops.fxopt.wait_reload.default)

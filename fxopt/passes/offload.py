"""OFFLOAD in the rewritten step: the forward copies each offloaded value to host memory after its
last forward use and saves the host copy instead; the backward copies it back at the plan's reload
point and its first reader waits for that copy (the ops: `fxopt.ops.offload`).

    schedule: saved = {h}, offloaded = {h}, reload_at = {h: 2}, backward = [g0, g1, gh, ...]
    forward:  h = relu(x); y = mm(h, w); h_host = offload(h, key, 0); return (y, h_host)
    backward: g0 = ...; g1 = ...
              h_1 = reload(h_host, key, 0, device)          # before backward[2], as planned
              h_2 = wait_reload(h_1, key, 0); gh = threshold_backward(g1, h_2)

A value also COMPRESSed travels encoded: the forward offloads its encoding (made right after the
value's last use), and the backward decodes what it reloaded, after the wait.

`split_with_recompute` (`fxopt.passes.recompute`) calls `offload_saved` on the forward it
extracted and drives the `Reloads` it returns while it builds the backward; the two share a
`fxopt.ops.offload.HostCopies`, which both modules and the backend that compiled them keep alive
(the ops find it by key).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.ops.offload import HostCopies, extent_bytes


def host_copies_for(values: list[fx.Node]) -> HostCopies:
    """The shared state for offloading ``values`` (in this order: slot k is ``values[k]``)."""
    sizes = []
    for node in values:
        val = node.meta["val"]
        sizes.append(extent_bytes(val.shape, val.stride(), val.element_size()))
    return HostCopies(sizes)


def offload_in_forward(fw_graph: fx.Graph, values: dict[str, fx.Node], after: dict[str, fx.Node],
                       copies: HostCopies, slot: dict[str, int]) -> dict[str, fx.Node]:
    """Insert ``offload(values[name])`` right after ``after[name]`` (the last node reading the value
    or a view of it, or its encoding) and make the forward save the host copy in its place.
    Returns the host copy of each name."""
    out_node = next(iter(fw_graph.find_nodes(op="output")))
    host = {}
    for name, value in values.items():
        with fw_graph.inserting_after(after[name]):
            node = fw_graph.call_function(torch.ops.fxopt.offload.default, (value, copies.key, slot[name]))
        node.meta["val"] = on_host(value.meta["val"])
        host[name] = node
    by_value = {values[name]: host[name] for name in values}
    outs = list(out_node.args[0])
    out_node.args = (tuple(by_value.get(o, o) if isinstance(o, fx.Node) else o for o in outs),)
    return host


def on_host(val):
    """A fake value like ``val``, in host memory (the offloaded copy's)."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return val
    with mode:
        return val.new_empty_strided(val.shape, val.stride(), device="cpu")


def offload_saved(fw_graph: fx.Graph, travels: dict[str, fx.Node], after: dict[str, fx.Node],
                  at: dict[int, list[str]]) -> Reloads:
    """Offload, in the forward, what travels for each offloaded value (``travels[name]``: the
    value, or its encoding), right after ``after[name]``; slot k holds the k-th in ``travels``'
    order. Returns the backward's `Reloads`, reloading before the steps ``at`` names."""
    slot = {name: k for k, name in enumerate(travels)}
    copies = host_copies_for(list(travels.values()))
    offload_in_forward(fw_graph, travels, after, copies, slot)
    return Reloads(copies, slot, at, {name: node.meta["val"] for name, node in travels.items()})


class Reloads:
    """The backward's side, for one graph being built (`begin`): `add_host_copy` takes each host
    copy's placeholder, `issue` inserts the reloads planned before a backward position, `arrive`
    inserts the wait before a value's first reader (issuing its reload there if none was planned
    earlier, which the simulator would count as exposed)."""

    def __init__(self, copies: HostCopies, slot: dict[str, int], at: dict[int, list[str]],
                 device_val: dict[str, object]):
        self.copies, self.slot, self.at = copies, slot, at
        self.device_val = device_val  # name -> fake value on the device (what a reload makes)
        self.graph: fx.Graph | None = None
        self.host: dict[str, fx.Node] = {}  # name -> its host copy (a placeholder), until reloaded
        self.inflight: dict[str, fx.Node] = {}  # name -> its reload, until waited on

    def begin(self, graph: fx.Graph) -> None:
        self.graph = graph

    def add_host_copy(self, name: str, placeholder: fx.Node) -> None:
        placeholder.meta["val"] = on_host(placeholder.meta["val"])
        self.host[name] = placeholder

    def __contains__(self, name: str) -> bool:
        return name in self.host or name in self.inflight

    def issue(self, position: int) -> None:
        for name in self.at.get(position, ()):
            if name in self.host:
                self._reload(name)

    def _reload(self, name: str) -> None:
        val = self.device_val[name]
        node = self.graph.call_function(torch.ops.fxopt.reload.default,
                                        (self.host.pop(name), self.copies.key, self.slot[name], val.device))
        node.meta = {"val": val, "autograd_backward": True}
        self.inflight[name] = node

    def arrive(self, name: str) -> fx.Node:
        """The reloaded value, once its copy is complete (a node the first reader may read)."""
        if name in self.host:
            self._reload(name)
        node = self.graph.call_function(torch.ops.fxopt.wait_reload.default,
                                        (self.inflight.pop(name), self.copies.key, self.slot[name]))
        node.meta = {"val": self.device_val[name], "autograd_backward": True}
        return node


def reload_positions(steps: int, kept: list[int], reload_at, names) -> dict[int, list[str]]:
    """Where each reload goes in the backward as generated: the plan's positions (``reload_at``,
    into a backward of ``steps`` steps) moved to the next step the generated code keeps (``kept``:
    the positions `fxopt.solvers.schedule.prune` keeps), as the simulator has it; as positions
    into the kept steps."""
    index, position = [], 0
    for p in range(steps + 1):  # index[p]: how many kept steps come before position p
        index.append(position)
        if position < len(kept) and kept[position] == p:
            position += 1
    at: dict[int, list[str]] = {}
    for value, p in reload_at:
        at.setdefault(index[p], []).append(names[value])
    return at

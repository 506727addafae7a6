"""A step of N copies of one block, captured as three and four copies and stamped out to N.

Dynamo and AOTAutograd trace every op of every copy of a transformer's block anew: on issue 27's
32-layer Llama they take 22 of the 34 CPU seconds of a plan, each layer the same ops again
(stamped: 8 s for the two captures, 1.7 s to stamp). So
where a model holds a run of `STAMP_FROM` or more identical blocks (`repeated_run`: one class, the
same parameters' shapes and dtypes, the same attributes but for their index, no hooks, nothing
shared), and fxopt only plans the step (`fxopt.plan`, `fxopt.fit`: nothing captured here runs),
the step is captured with the run cut to its first three blocks, and to its first four, and the
joint graph of all N is made from those two (`stamped_joint`):

    captured, 3 blocks:  P0 | p0 p1 p2 | P1 ‖ F0 | f0 f1 f2 | F1 | b2 b1 b0 | B1
    captured, 4 blocks:  P0 | p0 p1 p2 p3 | P1 ‖ F0 | f0 f1 f2 f3 | F1 | b3 b2 b1 b0 | B1
    stamped, N blocks:   P0 | p0 p1 … p(N-1) | P1 ‖ F0 | f0 f1 … f(N-1) | F1 | b(N-1) … b1 b0 | B1

(``p``: a block's parameters, ``f``/``b``: its forward and backward ops, each block's backward
with the gradient sums AOTAutograd adds after it; the rest is the step around the run.) The
first block and the last are the captured ones; every block between is a copy of the captured
middle block (block 1 of three), its arguments read from its own copy, from the block before
or after it, or from the step around the run, as block 1's are. Each copy is what the capture
of N blocks would give, to the name: a node's name counts the nodes of its op made before it
(``mm_37``), and its ``seq_nr`` the autograd nodes, so both grow by the same steps from block to
block (read off blocks 1 and 2 of the four) and from three blocks to four (for everything after
the run): both are affine in N and in the block (``seq_nr`` up to where autograd's process-wide
count stood at the capture: every node moves by the same). Module paths move to the copy's block
(``layers.1`` to ``layers.17``). Fake values have the template's layout on storages of the copy's
own, shared as the template's are (a view's from its op run on the copy's values).

Before stamping N, the four-block capture is stamped from the three-block one and compared with
the captured four, node by node (`check_same`): op, arguments, fake values, tags, module paths;
a block whose graph depends on its index in a way four blocks show (every other layer
different, a different first or last layer beyond what 3 blocks hold) fails it, and the step is
captured whole instead (`NotStamped`). What it cannot see: a block whose ops change with its
index only past the fourth (a Python branch on ``layer_idx > 10``). `Options.stamp` turns this
off. Not stamped: a step that runs (the graph must be the module's own).

A capture with dynamic shapes (`fxopt.plan_ahead.capture_symbolic`, `fxopt.max_batch`'s) is
stamped too, its sizes in the three-block capture's symbols. There the first block may work out
a size (a ``sym_size``) that every later block reads, and so hold nodes the middle block does
not: every copy reads such a node from the first block (``shared``), and a block's nodes are
matched to another's op by op where the two differ in length (`_matched`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import operator
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from fxopt.errors import FxoptError
from fxopt.fxgraph import graph_module
from fxopt.storage import storages

# The fewest copies stamped: below it, capturing three and four copies costs about as much as
# capturing all of them.
STAMP_FROM = 8
SHORT, LONG = 3, 4  # the blocks of the two captures; block 1 of SHORT is the copied middle block

_SUFFIX = re.compile(r"(.*)_(\d+)$")  # fx's own split of a node's name into its op and its count
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
          "_load_state_dict_pre_hooks")


class NotStamped(FxoptError):
    """The step cannot be stamped out from three and four copies of its block: captured whole."""


@dataclasses.dataclass(frozen=True)
class Run:
    """A run of identical blocks: the children ``keys`` of ``holder`` (an ``nn.ModuleList`` or
    ``nn.Sequential``), in order."""

    holder: nn.Module
    keys: tuple[str, ...]
    blocks: tuple[nn.Module, ...]

    @contextlib.contextmanager
    def cut_to(self, k: int) -> Iterator[None]:
        """While inside, ``holder`` holds the run's first ``k`` blocks only (and what else it holds)."""
        whole = self.holder._modules
        dropped = set(self.keys[k:])
        self.holder._modules = {key: m for key, m in whole.items() if key not in dropped}
        try:
            yield
        finally:
            self.holder._modules = whole


def repeated_run(model: nn.Module, least: int | None = None) -> Run | None:
    """The longest run of ``least`` (`STAMP_FROM`) or more identical blocks among the children of
    an ``nn.ModuleList`` or ``nn.Sequential`` in ``model`` (`_identical`), or None."""
    least = STAMP_FROM if least is None else least
    best: Run | None = None
    for holder in model.modules():
        if not isinstance(holder, (nn.ModuleList, nn.Sequential)):
            continue
        items = list(holder._modules.items())
        k = 0
        while k < len(items):
            end = k + 1
            while end < len(items) and type(items[end][1]) is type(items[k][1]):
                end += 1
            run = [key for key, _ in items[k:end]]
            if len(run) >= least and (best is None or len(run) > len(best.keys)) \
                    and _identical([m for _, m in items[k:end]]) and _unshared(model, [m for _, m in items[k:end]]):
                best = Run(holder, tuple(run), tuple(m for _, m in items[k:end]))
            k = end
    return best


def _identical(blocks: list[nn.Module]) -> bool:
    """Whether ``blocks`` are one block N times: the same modules, parameters and buffers (names,
    shapes, strides, dtypes, whether they require grad), the same attributes but for an int that
    counts the blocks (a ``layer_idx``), and no hooks."""
    first = blocks[0]
    for i, block in enumerate(blocks):
        mods, ref = list(block.named_modules()), list(first.named_modules())
        if [(n, type(m)) for n, m in mods] != [(n, type(m)) for n, m in ref]:
            return False
        if _tensors(block) != _tensors(first):
            return False
        for (_, m), (_, r) in zip(mods, ref):
            if any(getattr(m, h, None) for h in _HOOKS) or not _same_attributes(m, r, i):
                return False
    return True


def _tensors(block: nn.Module) -> list:
    return [(name, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
            for name, t in [*block.named_parameters(), *block.named_buffers()]]


def _same_attributes(m: nn.Module, ref: nn.Module, index: int) -> bool:
    skip = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOKS}
    mine, theirs = vars(m), vars(ref)
    return set(mine) == set(theirs) and all(_same_value(mine[k], theirs[k], index) for k in set(mine) - skip)


def _same_value(a: Any, b: Any, index: int) -> bool:
    """Whether two blocks' attribute values are the same: equal, or an int that counts the blocks
    (the block's index: the same for every block's graph, `check_same` tells), or containers and
    modules (held, not registered: transformers' kernel functions) of such values."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is int:
        return a == b or a - b == index
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], index) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y, index) for x, y in zip(a, b))
    if isinstance(a, nn.Module):
        return _tensors(a) == _tensors(b) and _same_attributes(a, b, 0) and not any(getattr(a, h, None) for h in _HOOKS)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - not comparable: not known to be the same
        return False


def _unshared(model: nn.Module, blocks: list[nn.Module]) -> bool:
    """No storage of a block's parameters and buffers is another block's or the rest's (tied weights)."""
    inside = [storages(b) for b in blocks]
    keys = [k for s in inside for k in s]
    if len(keys) != len(set(keys)):
        return False
    every = set(storages(model))
    outside = every - set(keys)
    return all(k not in outside for k in keys)


# ------------------------------------------------------------------------------ the graph's layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """A captured joint graph of ``blocks`` blocks cut into its parts (see the module): for each
    part ``P`` (placeholders), ``F`` (forward ops) and ``B`` (backward ops), the nodes before the
    run's (``around[part + "0"]``), each block's (``inside[(part, i)]``) and those after
    (``around[part + "1"]``); ``outputs``: the graph's outputs, each with the block it is a
    gradient of (None: not a block's); ``slot``: each node's (part, block or None, position)."""

    module: fx.GraphModule
    blocks: int
    around: dict[str, list[fx.Node]]
    inside: dict[tuple[str, int], list[fx.Node]]
    outputs: list[tuple[Any, int | None]]
    slot: dict[fx.Node, tuple[str, int | None, int]]


PARTS = "PFB"


def layout(joint: fx.GraphModule, num_fwd_outputs: int, blocks: list[nn.Module]) -> Layout:
    """``joint`` (a capture of the run cut to ``blocks``) cut into its parts (see `Layout`)."""
    k = len(blocks)
    ids = {str(id(b)): i for i, b in enumerate(blocks)}
    nodes = [n for n in joint.graph.nodes if n.op != "output"]
    seqs = {"P": [n for n in nodes if n.op == "placeholder"],
            "F": [n for n in nodes if n.op != "placeholder" and n.meta.get("partitioner_tag") != "is_backward"],
            "B": [n for n in nodes if n.op != "placeholder" and n.meta.get("partitioner_tag") == "is_backward"]}
    if nodes != seqs["P"] + seqs["F"] + seqs["B"]:
        raise NotStamped("the step's forward and backward ops are interleaved")

    def in_block(n: fx.Node) -> int | None:
        found = {ids[key] for key in (n.meta.get("nn_module_stack") or {}) if key in ids}
        if len(found) > 1:
            raise NotStamped(f"{n.name} runs in two blocks")
        return found.pop() if found else None

    label = {n: in_block(n) for n in seqs["F"]}
    by_seq: dict[Any, set] = {}
    for n in seqs["F"]:
        if label[n] is not None:
            by_seq.setdefault(n.meta.get("seq_nr"), set()).add(label[n])
    for n in seqs["B"]:
        seen = by_seq.get(n.meta.get("seq_nr"), set())
        if len(seen) > 1:
            raise NotStamped(f"{n.name} is the backward of two blocks")
        label[n] = next(iter(seen)) if seen else None
    for p in seqs["P"]:
        users = {label[u] for u in p.users if u in label and u.meta.get("partitioner_tag") != "is_backward"}
        label[p] = users.pop() if len(users) == 1 else None

    around: dict[str, list[fx.Node]] = {}
    inside: dict[tuple[str, int], list[fx.Node]] = {}
    for part in PARTS:
        seq, labels = seqs[part], _filled([label[n] for n in seqs[part]])
        order = range(k - 1, -1, -1) if part == "B" else range(k)
        at = _take(labels, 0, None)
        around[part + "0"] = seq[:at]
        for i in order:
            end = _take(labels, at, i)
            if end == at:
                raise NotStamped(f"block {i} has no {part} nodes where expected (at {seq[at].name if at < len(seq) else 'the end'})")
            inside[(part, i)] = seq[at:end]
            at = end
        end = _take(labels, at, None)
        if end != len(seq):
            raise NotStamped(f"the blocks' {part} nodes are not in order: {seq[end].name} of block {labels[end]} after them")
        around[part + "1"] = seq[at:end]

    out = next(iter(joint.graph.find_nodes(op="output")))
    outs = list(out.args[0])
    grads_of = [label[p] for p in seqs["P"] if p.name.startswith("primals")]
    if len(outs) != num_fwd_outputs + len(grads_of):
        raise NotStamped("the step's outputs are not its forward's and one gradient per input")
    outputs = [(o, None) for o in outs[:num_fwd_outputs]] + list(zip(outs[num_fwd_outputs:], grads_of))
    slot = {}
    for name, chunk in around.items():
        for pos, n in enumerate(chunk):
            slot[n] = (name, None, pos)
    for (part, i), chunk in inside.items():
        for pos, n in enumerate(chunk):
            slot[n] = (part, i, pos)
    return Layout(joint, k, around, inside, outputs, slot)


def _take(labels: list, at: int, value) -> int:
    """The end of the run of ``value`` in ``labels`` from ``at``."""
    while at < len(labels) and labels[at] == value:
        at += 1
    return at


def _filled(labels: list[int | None]) -> list[int | None]:
    """Labels with each None between two blocks' nodes taken as the block before it (a gradient
    sum after a block's backward, a value the step makes between two blocks)."""
    labelled = [i for i, b in enumerate(labels) if b is not None]
    out = list(labels)
    for i in range(labelled[0] + 1, labelled[-1]) if labelled else ():
        if out[i] is None:
            out[i] = out[i - 1]
    return out


# ------------------------------------------------------------------------------------ stamping


def _sig(n: fx.Node):
    return n.op, n.target if n.op != "placeholder" else _SUFFIX.sub(r"\1", n.name)


def _check_parts(short: Layout, long: Layout) -> None:
    """The two captures hold the same parts around the run, the same first block and last, and
    middle blocks of the same ops in the same order."""
    if short.blocks != SHORT or long.blocks != LONG:
        raise NotStamped("stamping reads captures of 3 and 4 blocks")
    for name, nodes in short.around.items():
        if [_sig(n) for n in nodes] != [_sig(n) for n in long.around[name]]:
            raise NotStamped(f"the step around the run differs between 3 and 4 blocks ({name})")
    for part in PARTS:
        for a, b in (((part, 0), (part, 0)), ((part, 1), (part, 1)), ((part, 1), (part, 2)),
                     ((part, SHORT - 1), (part, LONG - 1))):
            if [_sig(n) for n in short.inside[a]] != [_sig(n) for n in long.inside[b]]:
                raise NotStamped(f"block {b[1]} of {LONG} is not block {a[1]} of {SHORT} ({part})")


class _Stamper:
    """Builds the graph of N blocks (`graph`); see the module for what each copy reads."""

    def __init__(self, short: Layout, long: Layout, blocks: list[nn.Module], keys: tuple[str, ...]):
        self.short, self.long, self.blocks, self.keys = short, long, blocks, keys
        nodes = list(short.module.graph.nodes)
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)])
        if self.fake_mode is None:
            raise NotStamped("the captured step has no fake values")
        self.paths = [self._path_of(i) for i in range(SHORT)]
        self.numbers = {x: self._numbers(x) for x in nodes if x.op != "output"}
        self.owner, self.layout_of = _layouts(nodes)
        self.is_view = {x: isinstance(x.meta.get("val"), torch.Tensor) and x.meta["val"]._is_view() for x in nodes}
        self.storages: dict[tuple[fx.Node, int | None], Any] = {}  # a new node's (item's) storage
        self.own_layout: dict[tuple[fx.Node, int | None], bool] = {}  # (`_own`)
        self.aligned, self.shared = _alignment(short)
        self.moves: dict[tuple[int, int], tuple[str, str, dict]] = {}

    def _path_of(self, i: int) -> str:
        key = str(id(self.blocks[i]))
        for n in self.short.inside[("F", i)]:
            entry = (n.meta.get("nn_module_stack") or {}).get(key)
            if isinstance(entry, tuple) and len(entry) == 2 and str(entry[0]).endswith("." + self.keys[i]):
                return str(entry[0])
        raise NotStamped(f"no module path names block {i}")

    def origin(self, j: int, n: int) -> int:
        """The captured block instance ``j`` of ``n`` is a copy of."""
        return 0 if j == 0 else SHORT - 1 if j == n - 1 else 1

    # -- numbers: names' counts and seq_nr, affine in N and in the block
    def _numbers(self, x: fx.Node) -> tuple:
        """``x``'s name's op, and for its count and its ``seq_nr`` each: (the value with 3 blocks,
        its growth per block added to the run, its growth from one middle block to the next)."""
        part, block, pos = self.short.slot[x]
        if block is None:
            found = [x, self.long.around[part][pos]]
        elif block == 1:
            found = [x, self.long.inside[(part, 1)][pos], self.long.inside[(part, 2)][pos]]
        else:
            found = [x, self.long.inside[(part, 0 if block == 0 else LONG - 1)][pos]]
        split = [_SUFFIX.match(m.name).groups() if _SUFFIX.match(m.name) else (m.name, "0") for m in found]
        if len({base for base, _ in split}) != 1:
            raise NotStamped(f"{x.name}'s name is another op's in the other capture")
        seqs = [m.meta.get("seq_nr") for m in found]
        if (None in seqs) != (seqs[0] is None) or any(isinstance(v, bool) for v in seqs):
            raise NotStamped(f"{x.name} has a seq_nr in one capture only")
        return split[0][0], _affine([int(c) for _, c in split]), None if seqs[0] is None else _affine(seqs)

    # -- module paths
    def _moved(self, stack: dict | None, origin: int, j: int) -> dict | None:
        if not stack or origin == j:
            return stack
        if (origin, j) not in self.moves:
            ids = {str(id(a)): str(id(b)) for a, b in zip(self.blocks[origin].modules(), self.blocks[j].modules())}
            self.moves[(origin, j)] = (self.paths[origin], self.paths[origin][: -len(self.keys[origin])] + self.keys[j],
                                       ids)
        old, new, ids = self.moves[(origin, j)]
        out = {}
        for key, entry in stack.items():
            path, cls = entry
            if path == old or str(path).startswith(old + "."):
                path, key = new + str(path)[len(old):], ids.get(key, key)
            out[key] = (path, cls)
        return out

    # -- the graph
    def graph(self, n: int) -> fx.Graph:
        short = self.short
        g = fx.Graph()
        env: dict[tuple, fx.Node] = {}
        order: list[tuple[fx.Node, int | None]] = []
        for part in PARTS:
            order += [(x, None) for x in short.around[part + "0"]]
            for j in (range(n - 1, -1, -1) if part == "B" else range(n)):
                order += [(x, j) for x in short.inside[(part, self.origin(j, n))]]
            order += [(x, None) for x in short.around[part + "1"]]
        self.source: dict[fx.Node, fx.Node] = {}
        for x, j in order:
            new = self._node(g, x, j, n, env)
            self.source[new] = x
            part, _, pos = short.slot[x]
            env[(part, j, pos)] = new
        outs = self._outputs(n, env)
        captured = next(iter(short.module.graph.find_nodes(op="output")))
        output = g.output(type(captured.args[0])(outs))
        if "desc" in captured.meta and len(captured.meta["desc"]) == len(short.outputs):
            output.meta["desc"] = self._outputs(n, env, list(captured.meta["desc"]))
        return g

    def _lookup(self, y: fx.Node, x_origin: int | None, j: int | None, n: int, env: dict) -> fx.Node:
        part, block, pos = self.short.slot[y]
        if block is None:
            return env[(part, None, pos)]
        if j is None and block not in (0, SHORT - 1):
            raise NotStamped(f"the step around the run reads {y.name} of a middle block")
        if y in self.shared:
            return env[(part, 0, pos)]
        jy = (0 if block == 0 else n - 1) if j is None else j + block - x_origin
        there = self.origin(jy, n) if 0 <= jy < n else None
        at = pos if there == block else self.aligned.get((part, block, there), {}).get(pos)
        found = env.get((part, jy, at))
        if found is None or _sig(self.source[found]) != _sig(y):
            raise NotStamped(f"{y.name} of block {block} has no counterpart in block {jy} of {n}")
        return found

    def _node(self, g: fx.Graph, x: fx.Node, j: int | None, n: int, env: dict) -> fx.Node:
        origin = self.short.slot[x][1]
        if x.op == "get_attr" and origin is not None:
            raise NotStamped(f"block constant {x.target}")
        args = fx.node.map_arg(x.args, lambda y: self._lookup(y, origin, j, n, env))
        kwargs = fx.node.map_arg(x.kwargs, lambda y: self._lookup(y, origin, j, n, env))
        base, count, seq = self.numbers[x]
        count = _at(count, n, j)
        name = base if count == 0 else f"{base}_{count}"
        new = g.create_node(x.op, name if x.op == "placeholder" else x.target, args, kwargs, name=name)
        if new.name != name:
            raise NotStamped(f"two nodes named {name}")
        new.meta = dict(x.meta)
        if seq is not None:
            new.meta["seq_nr"] = _at(seq, n, j)
        if j is not None:
            for key in ("nn_module_stack", "fwd_nn_module_stack"):
                if key in new.meta:
                    new.meta[key] = self._moved(new.meta[key], origin, j)
        desc = new.meta.get("desc")
        if x.op == "placeholder" and dataclasses.is_dataclass(desc) and isinstance(getattr(desc, "idx", None), int) \
                and name.startswith("primals"):
            new.meta["desc"] = dataclasses.replace(desc, idx=count - 1)
        if "val" in x.meta:
            new.meta["val"] = self._value(x, new, origin, j, n, env)
        return new

    def _value(self, x: fx.Node, new: fx.Node, origin: int | None, j: int | None, n: int, env: dict):
        """``new``'s fake value: ``x``'s metadata on storages of the copy's own (those ``x``'s
        owner makes, or holds: a tensor sharing another's storage shares the copy's); a view,
        and an item taken out of a tuple, from its op run on the copy's values."""
        val = x.meta["val"]
        if x.op == "get_attr" or not _items(val):
            return val
        if x.target is operator.getitem or self.is_view[x]:
            args, kwargs = fx.node.map_arg((new.args, new.kwargs), lambda a: a.meta.get("val"))
            with self.fake_mode:
                try:
                    out = new.target(*args, **kwargs)
                except Exception as err:  # noqa: BLE001 - an op that will not run again on fake values
                    raise NotStamped(f"{x.name} does not run on the copy's values: {err}") from None
            for item, t in _items(out):
                self.storages[(new, item)] = t.untyped_storage()
            return out

        def clone(item: int | None) -> torch.Tensor:
            owner, owner_item = self.owner[(x, item)]
            nbytes, offset, shape, stride, dtype, device, requires_grad = self.layout_of[(x, item)]
            meta = _own(self.own_layout, (x, item), self.layout_of[(x, item)]) if (owner, owner_item) == (x, item) \
                else None
            if meta is not None:
                storage = meta.untyped_storage()
            else:
                if (owner, owner_item) == (x, item):
                    storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
                else:
                    storage = self.storages[(self._lookup(owner, origin, j, n, env), owner_item)]
                meta = torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, shape, stride)
            self.storages[(new, item)] = storage
            return _fake(self.fake_mode, meta, device, requires_grad)

        if isinstance(val, torch.Tensor):
            return clone(None)
        return type(val)(clone(k) if isinstance(t, torch.Tensor) else t for k, t in enumerate(val))

    def _outputs(self, n: int, env: dict, items: list | None = None) -> list:
        """The graph's outputs (or ``items``, one per output, as the outputs are): those of the
        step around the run, then each block's gradients in block order."""
        entries = self.short.outputs
        items = [o for o, _ in entries] if items is None else items
        blocks_at = [b for _, b in entries]
        first = next((i for i, b in enumerate(blocks_at) if b is not None), len(entries))
        labelled = [b for b in blocks_at[first:] if b is not None]
        last = max((i for i, b in enumerate(blocks_at) if b is not None), default=first - 1)
        if labelled != sorted(labelled) or any(b is None for b in blocks_at[first:last + 1]):
            raise NotStamped("the blocks' gradients are not together in the step's outputs")
        by_block = {b: [(o, items[i]) for i, (o, bb) in enumerate(entries) if bb == b] for b in range(SHORT)}

        def mapped(o, item, origin, j):
            if item is not o:  # (a descriptor: the same for the copy)
                return item
            return self._lookup(o, origin, j, n, env) if isinstance(o, fx.Node) else o

        out = [mapped(o, items[i], None, None) for i, (o, _) in enumerate(entries[:first])]
        for j in range(n):
            origin = self.origin(j, n)
            out += [mapped(o, item, origin, j) for o, item in by_block[origin]]
        out += [mapped(o, items[i], None, None) for i, (o, _) in enumerate(entries[last + 1:], last + 1)]
        return out


def _alignment(short: Layout) -> tuple[dict, set]:
    """Where the first or last block holds a node more or less than the middle one (a size the
    first block works out and every later one reads, in a symbolic capture): each block's nodes
    matched to each other block's by their ops' order, ``(part, block, other) -> {position:
    position}``; and the first block's nodes that a block past the next reads, the whole run's
    (every copy reads them from the first block)."""
    aligned = {(part, a, b): _matched(short.inside[(part, a)], short.inside[(part, b)])
               for part in PARTS for a in range(SHORT) for b in range(SHORT) if a != b}
    shared = {y for y in short.inside[("F", 0)] + short.inside[("B", 0)]
              if any((short.slot.get(u, (None, None))[1] or 0) >= 2 for u in y.users)}
    return aligned, shared


def _matched(a: list[fx.Node], b: list[fx.Node]) -> dict[int, int]:
    """Positions in ``a`` matched to those in ``b`` holding the same op in the same order."""
    matcher = difflib.SequenceMatcher(None, [_sig(n) for n in a], [_sig(n) for n in b], autojunk=False)
    return {i + k: j + k for i, j, size in matcher.get_matching_blocks() for k in range(size)}


def _affine(values: list[int]) -> tuple[int, int, int]:
    """(value at 3 blocks, growth per block added, growth per middle block) from the values of a
    node at 3 blocks, its counterpart at 4, and (for a middle block) the next block's at 4."""
    return values[0], values[1] - values[0], values[2] - values[1] if len(values) > 2 else 0


def _at(numbers: tuple[int, int, int], n: int, j: int | None) -> int:
    """A node's number in instance ``j`` (None: outside the run) of ``n`` blocks; the step per
    middle block counts from block 1 (the copied one)."""
    start, per_block, per_middle = numbers
    return start + (n - SHORT) * per_block + (0 if j is None or not per_middle else (j - 1) * per_middle)


def _layouts(nodes: list[fx.Node]) -> tuple[dict, dict]:
    """Each tensor's storage's owner (the (node, item) that shows it first) and its layout, by
    (node, item). (Read once: a fake tensor's metadata is slow to read, and each is stamped N/3
    times.)"""
    first: dict[StorageWeakRef, tuple[fx.Node, int | None]] = {}
    owner: dict[tuple[fx.Node, int | None], tuple[fx.Node, int | None]] = {}
    layout_of: dict[tuple[fx.Node, int | None], tuple] = {}
    for x in nodes:
        for item, t in _items(x.meta.get("val")):
            storage = t.untyped_storage()
            owner[(x, item)] = first.setdefault(StorageWeakRef(storage), (x, item))
            layout_of[(x, item)] = (storage.nbytes(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                                    t.dtype, t.device, t.requires_grad)
    return owner, layout_of


def _own(known: dict, key: tuple, layout: tuple) -> torch.Tensor | None:
    """A meta tensor of ``layout`` (a (node, item) ``key``'s) on a storage of its own, made at once
    (``empty_strided``), where that makes the storage the key's holds (its bytes, from offset 0:
    an op's output, mostly; found at its first copy and kept in ``known``); else None, and the
    copy's value is set on a storage made to its size. (Making the storage, then setting the
    layout on it, does the symbolic size arithmetic twice: most of stamping a symbolic step.)"""
    same = known.get(key)
    if same is False:
        return None
    nbytes, offset, shape, stride, dtype, _, _ = layout
    if not (type(offset) is int and offset == 0):
        known[key] = False
        return None
    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if same is None:
        same = known[key] = _same_size(meta.untyped_storage().nbytes(), nbytes)
    return meta if same else None


def _same_size(a, b) -> bool:
    """Whether two sizes are the same: equal numbers, or symbolic sizes of the same expression
    (compared as expressions: comparing the sizes themselves would add a guard)."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    return a == b


def _items(val) -> list[tuple[int | None, torch.Tensor]]:
    """The tensors of a fake value, each with its index in a tuple (None: the value itself)."""
    if isinstance(val, torch.Tensor):
        return [(None, val)]
    if isinstance(val, (list, tuple)):
        return [(k, t) for k, t in enumerate(val) if isinstance(t, torch.Tensor)]
    return []


def check_same(stamped: fx.Graph, captured: fx.Graph) -> None:
    """`NotStamped` unless ``stamped`` is ``captured`` node for node: names, ops, arguments,
    tags, module paths, fake values (shape, strides, dtype, which share storage) and ``seq_nr``
    (counted from the graph's first: autograd numbers its nodes process-wide, so two captures of
    one step differ by where the count stood)."""
    a, b = list(stamped.nodes), list(captured.nodes)
    if len(a) != len(b):
        raise NotStamped(f"stamped {len(a)} nodes where the capture has {len(b)}")
    keys_a, keys_b = _NodeKeys(a), _NodeKeys(b)
    for x, y in zip(a, b):
        if keys_a(x) != keys_b(y):
            raise NotStamped(f"stamped {x.format_node()} where the capture has {y.format_node()}")


class _NodeKeys:
    """What `check_same` compares of each node of one graph (sizes as text: a symbolic size of
    one capture is not comparable with another's)."""

    def __init__(self, nodes: list[fx.Node]):
        self.owners: dict = {}
        self.first_seq = min((n.meta["seq_nr"] for n in nodes if isinstance(n.meta.get("seq_nr"), int)), default=0)

    def __call__(self, n: fx.Node) -> tuple:
        args = fx.node.map_arg((n.args, n.kwargs), lambda m: ("node", m.name))
        seq = n.meta.get("seq_nr")
        meta = (None if seq is None else seq - self.first_seq,
                *(_plain(n.meta.get(k)) for k in ("partitioner_tag", "is_gradient_acc", "nn_module_stack",
                                                   "fwd_nn_module_stack")))
        values = []
        for _, t in _items(n.meta.get("val")):
            storage = StorageWeakRef(t.untyped_storage())
            values.append((str(tuple(t.shape)), str(t.stride()), str(t.storage_offset()), t.dtype, str(t.device), t._is_view(),
                           t.requires_grad, self.owners.setdefault(storage, n.name)))
        return n.name, n.op, str(n.target), repr(args), meta, tuple(values)


def _plain(v):
    if isinstance(v, dict):
        return tuple(v.values())  # (a module stack: its keys are the modules' ids)
    return v


def stamped_joint(short, long, run: Run) -> fx.GraphModule:
    """The joint graph of the whole ``run`` from its captures cut to `SHORT` and `LONG` blocks
    (`fxopt.capture.dynamo.CapturedStep`s), checked first on ``long`` itself (`check_same`)."""
    blocks = list(run.blocks)
    # (Called from inside a capture: tensors made on "meta" here are meta tensors, not the
    # capture's fake ones; the fake values are made in the step's own fake mode, `_Stamper`.)
    with _disable_current_modes():
        shape = (layout(short.joint, short.num_fwd_outputs, blocks[:SHORT]),
                 layout(long.joint, long.num_fwd_outputs, blocks[:LONG]))
        _check_parts(*shape)
        check_same(_Stamper(*shape, blocks[:LONG], run.keys[:LONG]).graph(LONG), long.joint.graph)
        return graph_module(short.joint, _Stamper(*shape, blocks, run.keys).graph(len(blocks)))


# torch 2.13's FakeTensor takes ``requires_grad``; before it (2.11, 2.12) the flag is set after.
_FAKE_TAKES_REQUIRES_GRAD = "requires_grad" in inspect.signature(FakeTensor.__new__).parameters


def _fake(fake_mode, meta: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
    """A fake tensor of ``meta``'s storage and layout on ``device``, requiring grad or not."""
    if _FAKE_TAKES_REQUIRES_GRAD:
        return FakeTensor(fake_mode, meta, device, requires_grad=requires_grad)
    fake = FakeTensor(fake_mode, meta, device)
    return fake.requires_grad_(True) if requires_grad else fake

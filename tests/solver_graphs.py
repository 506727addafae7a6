"""Hand-built solver graphs (no tensors) shared by the solver and schedule tests.

Each builder returns a `Graph` laid out like an AOTAutograd joint graph: placeholders first
(parameters, user inputs, then tangents), the forward, then the backward. Sizes are small
integers chosen so that hand-computed peaks are unambiguous.
"""

from __future__ import annotations

from fxopt.solvers.graph import Graph, Node


class GraphBuilder:
    """Build a `Graph` by name: ``b.fwd("h", ["x", "w"], bytes=16)`` appends a node reading x and w."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.index: dict[str, int] = {}

    def _add(self, node: Node) -> int:
        if node.name in self.index:
            raise ValueError(f"duplicate node name {node.name!r}")
        self.index[node.name] = len(self.nodes)
        self.nodes.append(node)
        return self.index[node.name]

    def _ids(self, names) -> tuple[int, ...]:
        return tuple(self.index[n] for n in names)

    def input(self, name: str, bytes: int, *, tangent: bool = False) -> int:
        return self._add(Node(name, "input", bytes=bytes, tangent=tangent))

    def fwd(self, name: str, inputs, bytes: int = 0, *, cost: float = 1.0, flops: int | None = None,
            view_of: str | None = None, recomputable: bool = True, output: bool = False,
            tensor: bool = True, workspace: int = 0, blocks: tuple[int, ...] = (), op_class: str = "") -> int:
        """A forward node. ``view_of``: the node whose storage it aliases (it then owns no bytes);
        ``blocks``, ``op_class``: what the simple policies read (`fxopt.solvers.policies`)."""
        return self._add(Node(
            name, "forward", self._ids(inputs),
            bytes=0 if view_of else bytes,
            flops=int(cost * 100) if flops is None else flops,
            cost=cost,
            storage=self.index[view_of] if view_of else None,
            recomputable=recomputable, output=output, tensor=tensor, workspace=workspace,
            blocks=blocks, op_class=op_class,
        ))

    def bwd(self, name: str, inputs, bytes: int = 0, *, output: bool = False, view_of: str | None = None,
            cost: float | None = None) -> int:
        """A backward node; ``cost``: its seconds (by default bytes / 100)."""
        return self._add(Node(
            name, "backward", self._ids(inputs),
            bytes=0 if view_of else bytes,
            flops=bytes, cost=bytes / 100 if cost is None else cost,
            storage=self.index[view_of] if view_of else None,
            output=output,
        ))

    def build(self) -> Graph:
        return Graph(tuple(self.nodes))


def ids(graph: Graph, *names: str) -> tuple[int, ...]:
    by_name = {n.name: i for i, n in enumerate(graph.nodes)}
    return tuple(by_name[n] for n in names)


def mlp2() -> Graph:
    """loss = sum(relu(x @ w1) @ w2), and its backward as autograd builds it.

    Only ``a = relu(h)`` is read by the backward (by the weight gradient of w2 and by relu's
    backward); ``o`` is forward-only and ``loss`` is the forward output.
    """
    b = GraphBuilder()
    b.input("x", 8)
    b.input("w1", 4)
    b.input("w2", 4)
    b.input("tan", 1, tangent=True)
    b.fwd("h", ["x", "w1"], 16, cost=2.0, flops=200)
    b.fwd("a", ["h"], 16, cost=1.0, flops=16)
    b.fwd("o", ["a", "w2"], 32, cost=2.0, flops=300)
    b.fwd("loss", ["o"], 1, cost=1.0, flops=32, output=True)
    b.bwd("g_o", ["tan"], 32)
    b.bwd("g_w2", ["a", "g_o"], 4, output=True)
    b.bwd("g_a", ["g_o", "w2"], 16)
    b.bwd("g_h", ["g_a", "a"], 16)
    b.bwd("g_w1", ["x", "g_h"], 4, output=True)
    return b.build()


def residual_block() -> Graph:
    """y = x + dropout(relu(x @ w1)) @ w2; loss = sum(y), with a view and a random node.

    - ``w1t = w1.t()`` is a view of a parameter: resident, free to keep.
    - ``hv = h.view(...)`` is a view of an activation: never saved, made fresh from ``h``.
    - ``mask`` is a random (non-recomputable) value: it must be saved.
    - ``x`` is read twice in the forward (matmul and residual add) and once in the backward.
    """
    b = GraphBuilder()
    b.input("x", 8)
    b.input("w1", 4)
    b.input("w2", 4)
    b.input("tan", 1, tangent=True)
    b.fwd("w1t", ["w1"], view_of="w1", cost=0.0, flops=0)
    b.fwd("h", ["x", "w1t"], 16, cost=3.0, flops=300)
    b.fwd("hv", ["h"], view_of="h", cost=0.0, flops=0)
    b.fwd("a", ["hv"], 16, cost=1.0, flops=16)
    b.fwd("mask", ["a"], 2, cost=0.5, flops=16, recomputable=False)
    b.fwd("d", ["a", "mask"], 16, cost=1.0, flops=16)
    b.fwd("o", ["d", "w2"], 8, cost=3.0, flops=300)
    b.fwd("y", ["x", "o"], 8, cost=0.5, flops=8)
    b.fwd("loss", ["y"], 1, cost=0.5, flops=8, output=True)
    b.bwd("g_y", ["tan"], 8)
    b.bwd("g_w2", ["d", "g_y"], 4, output=True)
    b.bwd("g_d", ["g_y", "w2"], 16)
    b.bwd("g_a", ["g_d", "mask"], 16)
    b.bwd("g_h", ["g_a", "hv"], 16)
    b.bwd("g_w1", ["x", "g_h"], 4, output=True)
    return b.build()


def chain_inputs(n: int, *, param: int = 4, inp: int = 8) -> GraphBuilder:
    """A builder holding a layered model's inputs: ``x`` (``inp`` bytes), the weights ``w1`` to
    ``wn`` (``param`` bytes each) and the loss's incoming gradient ``tan``."""
    b = GraphBuilder()
    b.input("x", inp)
    for k in range(1, n + 1):
        b.input(f"w{k}", param)
    b.input("tan", 1, tangent=True)
    return b


def chain(n: int, act: int = 16, param: int = 4, inp: int = 8, through_views: bool = False) -> Graph:
    """An n-layer MLP ``a_k = relu(a_{k-1} @ w_k)``, ``loss = sum(a_n)``, and its backward.

    Each layer's matmul output ``h_k`` and activation ``a_k`` are ``act`` bytes; relu's backward
    reads ``a_k``, the weight gradient reads ``a_{k-1}``. Saving everything costs about
    ``n * act``; recomputing from a few checkpoints costs flops but much less memory.
    ``through_views``: each layer's activation and its backward read ``h_k`` through a view
    (``t_k``, cost 0.5), which eager's schedule makes again in the backward, as every plan must.
    """
    b = chain_inputs(n, param=param, inp=inp)
    prev = "x"
    for k in range(1, n + 1):
        b.fwd(f"h{k}", [prev, f"w{k}"], act, cost=2.0, flops=200)
        read = f"h{k}"
        if through_views:
            b.fwd(f"t{k}", [read], cost=0.5, view_of=read)
            read = f"t{k}"
        b.fwd(f"a{k}", [read], act, cost=1.0, flops=16)
        prev = f"a{k}"
    b.fwd("loss", [prev], 1, cost=1.0, flops=16, output=True)
    b.bwd(f"g_a{n}", ["tan"], act)
    for k in range(n, 0, -1):
        b.bwd(f"g_h{k}", [f"g_a{k}", f"t{k}" if through_views else f"a{k}"], act)
        below = "x" if k == 1 else f"a{k - 1}"
        b.bwd(f"g_w{k}", [below, f"g_h{k}"], param, output=True)
        if k > 1:
            b.bwd(f"g_a{k - 1}", [f"g_h{k}", f"w{k}"], act)
    return b.build()


def diamond() -> Graph:
    """A multi-use DAG: ``p`` feeds two branches that meet again, and two backward-only values.

        p = x * w;  l = sin(p);  r = cos(p);  m = l * r;  loss = sum(m)

    The backward of sin and cos reads ``c = cos(p)`` and ``s = sin(p)``: values only the backward
    reads (backward-only), made either in the forward (and SAVEd) or in the backward from ``p``.
    """
    b = GraphBuilder()
    b.input("x", 8)
    b.input("w", 8)
    b.input("tan", 1, tangent=True)
    b.fwd("p", ["x", "w"], 16, cost=1.0, flops=16)
    b.fwd("l", ["p"], 16, cost=4.0, flops=64)
    b.fwd("r", ["p"], 16, cost=4.0, flops=64)
    b.fwd("m", ["l", "r"], 16, cost=1.0, flops=16)
    b.fwd("loss", ["m"], 1, cost=1.0, flops=16, output=True)
    b.fwd("c", ["p"], 16, cost=4.0, flops=64)  # backward-only: cos(p) for sin's backward
    b.fwd("s", ["p"], 16, cost=4.0, flops=64)  # backward-only: sin(p) for cos's backward
    b.bwd("g_m", ["tan"], 16)
    b.bwd("g_l", ["g_m", "r"], 16)
    b.bwd("g_r", ["g_m", "l"], 16)
    b.bwd("g_p1", ["g_l", "c"], 16)
    b.bwd("g_p2", ["g_r", "s"], 16)
    b.bwd("g_p", ["g_p1", "g_p2"], 16)
    b.bwd("g_w", ["g_p", "x"], 8, output=True)
    return b.build()


HAND_GRAPHS = {
    "mlp2": mlp2,
    "residual_block": residual_block,
    "chain4": lambda: chain(4),
    "chain8": lambda: chain(8),
    "diamond": diamond,
}


# ----------------------------------------------------------------- random training steps
def random_training_graph(draw, st, *, min_forward: int = 3, max_forward: int = 12) -> Graph:
    """A random joint graph shaped like autograd's: parameters and an input, a forward DAG with
    some views, random (non-recomputable) ops and tuple-returning ops, a scalar loss, and a
    backward that walks the forward in reverse, each step reading the incoming gradient and
    0-2 forward values (the op's inputs or output, as autograd's saved tensors are), plus a
    gradient output per parameter use.

    Values off the loss's path that the backward reads are backward-only; random ops are always
    put on the loss's path (see `_random_off_the_loss_path`).

    ``draw`` and ``st`` are hypothesis' ``data.draw`` and ``strategies`` (arguments, so that this
    module imports without hypothesis)."""
    x_bytes = draw(st.integers(1, 16))
    params = {f"w{k}": draw(st.integers(1, 8)) for k in range(draw(st.integers(1, 3)))}
    forward: list[dict] = []  # the forward's ops, in order
    names: list[str] = []  # forward tensor values, in order
    n_forward = draw(st.integers(min_forward, max_forward))
    while len(names) < n_forward:
        pool = ["x", *params, *names]
        k = len(forward)
        op = draw(st.sampled_from(["op", "op", "op", "op", "view", "random", "tuple"]))
        if op == "view":
            base = draw(st.sampled_from(pool))
            forward.append(dict(name=f"v{k}", inputs=[base], view_of=base, cost=0.0, reads=[]))
            names.append(f"v{k}")
        elif op == "tuple":  # e.g. native_dropout or split: a non-tensor value and its getitems
            args = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2, unique=True))
            random = draw(st.booleans())
            forward.append(dict(name=f"t{k}", inputs=args, bytes=draw(st.sampled_from([0, 4])),
                                cost=draw(st.sampled_from([1.0, 2.0])), tensor=False, recomputable=not random))
            for m in range(draw(st.integers(1, 2))):
                name = f"t{k}_{m}"
                reads = draw(st.lists(st.sampled_from(args + [name]), max_size=2, unique=True))
                forward.append(dict(name=name, inputs=[f"t{k}"], bytes=draw(st.integers(1, 32)), cost=0.0,
                                    recomputable=not random, reads=reads))
                names.append(name)
        else:
            args = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2, unique=True))
            name = f"f{k}"
            reads = draw(st.lists(st.sampled_from(args + [name]), max_size=2, unique=True))
            forward.append(dict(name=name, inputs=args, bytes=draw(st.integers(1, 32)),
                                cost=draw(st.sampled_from([0.5, 1.0, 2.0, 4.0])), recomputable=op != "random",
                                reads=reads))
            names.append(name)
    # The loss reads the last value and maybe one more; values off its path that the backward
    # reads are backward-only, the others are dead.
    loss_args = list(dict.fromkeys([names[-1]] + draw(st.lists(st.sampled_from(names), max_size=1))))
    backward = []  # (gradient of, is a view of the incoming gradient, bytes)
    for name in reversed(names):
        backward.append((name, draw(st.integers(0, 5)) == 0, draw(st.integers(1, 32))))
    g_loss_bytes = draw(st.integers(1, 32))

    def build(loss_args: list[str]) -> Graph:
        b = GraphBuilder()
        b.input("x", x_bytes)
        for p, nbytes in params.items():
            b.input(p, nbytes)
        b.input("tangent", 1, tangent=True)
        for spec in forward:
            spec = {k: v for k, v in spec.items() if k != "reads"}
            b.fwd(spec.pop("name"), spec.pop("inputs"), **spec)
        b.fwd("loss", loss_args, 1, cost=0.5, output=True)
        grad = "g_loss"
        b.bwd(grad, ["tangent"], g_loss_bytes)
        reads = {spec["name"]: spec.get("reads", []) for spec in forward}
        for name, is_view, nbytes in backward:
            saved = [r for r in reads[name] if r not in params and r != "x"]
            if is_view:
                b.bwd(f"gv_{name}", [grad], view_of=grad)
                grad = f"gv_{name}"
            else:
                b.bwd(f"g_{name}", [grad, *saved], nbytes)
                grad = f"g_{name}"
            for j in b.nodes[b.index[name]].inputs:
                p = b.nodes[j].name
                if p in params and f"g_{p}" not in b.index:  # the last use's gradient, as a weight grad
                    b.bwd(f"g_{p}", [grad, *saved], params[p], output=True)
        b.bwd("g_x", [grad], x_bytes, output=True)
        return b.build()

    graph = build(loss_args)
    off_path = _random_off_the_loss_path(graph)
    if off_path:
        graph = build(loss_args + [graph.nodes[i].name for i in sorted(off_path)])
        assert not _random_off_the_loss_path(graph)
    return graph


def _random_off_the_loss_path(graph: Graph) -> frozenset[int]:
    """Random (non-recomputable) values only the backward reads. Like a dropout mask, a random
    value in a real step feeds the forward; off its path, fxopt cannot plan some such graphs (see
    ``test_random_op_on_backward_only_value`` and ``test_random_op_on_parameter_view``)."""
    return frozenset(i for i in graph.backward_only if not graph.nodes[i].recomputable)


def with_random_lossy_codecs(draw, st, graph: Graph) -> Graph:
    """``graph`` with a quantizing codec on most of its SAVEable values that own their storage, as
    ``quantize="int8"`` offers them: a random compressed size below the value's, a codec cost
    and the codec's scratch memory (none, a byte, or up to twice the value, as the int8 codec
    measures). ``draw`` and ``st`` as for `random_training_graph`."""
    import dataclasses

    nodes = list(graph.nodes)
    for i in sorted(graph.saveable):
        node = nodes[i]
        if graph.roots[i] != i or not node.tensor or node.bytes < 2 or draw(st.integers(0, 3)) == 0:
            continue
        nodes[i] = dataclasses.replace(
            node, codec="int8/g64", compressed_bytes=draw(st.integers(1, node.bytes - 1)),
            codec_cost=draw(st.sampled_from([0.01, 0.05, 0.2])),
            codec_workspace=draw(st.sampled_from([0, 1, node.bytes, 2 * node.bytes])))
    return Graph(tuple(nodes))


def repeated_blocks(n: int, *, shared: bool = True, modules: bool = True, logits: int = 64) -> Graph:
    """A language model of ``n`` identical blocks, as a joint graph. Before the blocks: the
    embedding ``e`` of the token ids (resident) and, with ``shared``, a table ``rope`` every
    block reads (RoPE's cos and sin). Block k, from ``a{k-1}`` (``e`` for the first)::

        n{k} = norm(a, w)        16 bytes, cost 1
        u{k} = up(n, rope)       32 bytes, cost 2     (reads the table)
        s{k} = attn(u)           8 bytes, cost 6      (cannot be recomputed: a random op)
        v{k} = act(u)            32 bytes, cost 0.5
        o{k} = down(v, s)        16 bytes, cost 3
        a{k} = a + o             16 bytes, cost 0.1

    After them the head: ``logits`` (64 bytes, or ``logits``) and the loss (an output). The backward reads
    what each op's gradient needs; the residual's gradient is a sum, and each block's weight
    gradient is an output. ``modules``: record each block's values as a repeated module
    (`Node.blocks`), as the analysis does for a model's layers; without, the blocks are found
    between articulation values (then without the table, which every block reads)."""
    b = GraphBuilder()
    b.input("ids", 4)
    b.input("emb", 64)
    b.input("head", 64)
    for k in range(1, n + 1):
        b.input(f"w{k}", 8)
    b.input("tan", 1, tangent=True)
    b.fwd("e", ["ids", "emb"], 16, cost=0.5)
    if shared:
        b.fwd("rope", ["ids"], 4, cost=0.2)
    prev = "e"
    for k in range(1, n + 1):
        tag = dict(blocks=(k - 1,)) if modules else {}
        rope = ["rope"] if shared else []
        b.fwd(f"n{k}", [prev, f"w{k}"], 16, cost=1.0, **tag)
        b.fwd(f"u{k}", [f"n{k}", *rope], 32, cost=2.0, **tag)
        b.fwd(f"s{k}", [f"u{k}"], 8, cost=6.0, recomputable=False, **tag)
        b.fwd(f"v{k}", [f"u{k}"], 32, cost=0.5, **tag)
        b.fwd(f"o{k}", [f"v{k}", f"s{k}"], 16, cost=3.0, **tag)
        b.fwd(f"a{k}", [prev, f"o{k}"], 16, cost=0.1, **tag)
        prev = f"a{k}"
    b.fwd("logits", [prev, "head"], logits, cost=2.0)
    b.fwd("loss", ["logits"], 1, cost=0.1, output=True)
    b.bwd("dlogits", ["tan", "logits"], logits)
    b.bwd("dhead", ["dlogits", prev], 64, output=True)
    grad = "dlogits"
    b.bwd(f"da{n}", [grad, "head"], 16)
    grad = f"da{n}"
    for k in range(n, 0, -1):
        a_in = f"a{k - 1}" if k > 1 else "e"
        rope = ["rope"] if shared else []
        b.bwd(f"dv{k}", [grad, f"s{k}", f"v{k}"], 32)
        b.bwd(f"du{k}", [f"dv{k}", f"u{k}", *rope], 32)
        b.bwd(f"dn{k}", [f"du{k}", f"n{k}"], 16)
        b.bwd(f"dw{k}", [f"dn{k}", a_in], 8, output=True)
        b.bwd(f"dx{k}", [f"dn{k}", a_in, f"w{k}"], 16)
        b.bwd(f"g{k}", [f"dx{k}", grad], 16)
        grad = f"g{k}"
    b.bwd("demb", [grad, "ids"], 64, output=True)
    return b.build()

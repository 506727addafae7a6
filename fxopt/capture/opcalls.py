"""The eager compiler's FX code calls each aten op's builtin, not the op's Python object (issue 28).

FX writes a call of an operator overload as the overload's qualified name:

    mul = torch.ops.aten.mul.Tensor(primals_1, primals_2)

which, at every call, looks up four attributes and enters `OpOverload.__call__`, a Python frame
whose only work is ``return self._op(*args, **kwargs)``: ``_op`` is the builtin that parses the
arguments against the op's schema and dispatches. `DirectOpCodeGen` writes the same line with
that builtin, bound once where the code is made:

    aten_mul_Tensor = torch.ops.aten.mul.Tensor._op
    ...
        mul = aten_mul_Tensor(primals_1, primals_2)

The op, its arguments and the dispatcher entry are the same, so the results are the same bit for
bit; what goes is the lookups and the frame (11.8 µs a small ``mul`` took, about 1.6 ms a step on
the bench Llama's DDP step: docs/multi-device.md). The graph is not changed: its nodes keep their
OpOverload targets, so `fxopt inspect`, Inductor and every pass see what they saw; only the code
the eager compiler runs differs.

Checked per op, not assumed from torch's version (2.11 to 2.13 call the builtin this way; 2.14's
`OpOverload.__call__` first checks for a Python-object dispatcher, so there every op is called as
FX writes it, as before): an op
whose class calls otherwise (`torch._ops.TorchBindOpOverload` handles script objects first), whose
``__call__`` does more than call ``_op``, or whose ``_op`` is missing or not a builtin, is called
as FX writes it.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import _get_qualified_name


def direct_call(target: Any) -> types.BuiltinFunctionType | None:
    """The builtin that calling ``target`` amounts to, or None where it is not an aten-style op
    overload whose call is exactly ``self._op(*args, **kwargs)``."""
    if type(target) is not torch._ops.OpOverload:
        return None
    call = getattr(type(target).__call__, "__code__", None)
    if call is None or call.co_names != ("_op",):
        return None
    builtin = getattr(target, "_op", None)
    return builtin if isinstance(builtin, types.BuiltinFunctionType) else None


_BoxedCodeGen = getattr(fx.graph, "_BoxedCodeGen", None)


if _BoxedCodeGen is not None:
    class DirectOpCodeGen(_BoxedCodeGen):
        """FX's boxed calling convention (the inputs as one list, cleared once read), each op
        overload called through its builtin (see the module docstring)."""

        def _gen_python_code(self, nodes, root_module: str, namespace, **kwargs):
            code = super()._gen_python_code(nodes, root_module, namespace, **kwargs)
            src, bindings = code.src, []
            for target in dict.fromkeys(n.target for n in nodes if n.op == "call_function"):
                if direct_call(target) is None:
                    continue
                qualified = _get_qualified_name(target)
                called = f" = {qualified}("
                if called not in src:
                    continue
                schema = target._schema
                name = namespace.create_name(
                    f"{target.namespace}_{schema.name.split('::')[-1]}_{schema.overload_name or 'default'}", None)
                bindings.append(f"{name} = {qualified}._op")
                src = src.replace(called, f" = {name}(")
            if not bindings:
                return code
            # Bound in the code's own module, before the function, as FX binds its wrapped
            # functions: the code stays self-contained (a pickled GraphModule is its source and an
            # import block) and names each builtin by the op it belongs to.
            # (The line the function starts at, where this torch's PythonCode records it, moves down.)
            moved = {"_prologue_start": code._prologue_start + len(bindings)} \
                if hasattr(code, "_prologue_start") else {}
            return dataclasses.replace(code, src="\n" + "\n".join(bindings) + src, **moved)


else:
    DirectOpCodeGen = None

"""fxopt as a torch.compile backend, with both compilers, measured.

    python examples/backend.py                 # residual MLP at 50% of its eager peak
    python examples/backend.py transformer     # transformer block at the smallest budget fxopt reaches

For each compiler: the plan's budget and predicted peak, the measured peak of one training step
(profiler allocation events on CPU, CUDA allocator statistics on GPU), whether the loss and
gradients equal eager's, and the median step time.
"""

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

import fxopt

sys.path.insert(0, str(Path(__file__).parent))
from models import mlp, transformer  # noqa: E402

MiB = 2**20


def step(model, x):
    loss = model(x)
    loss = loss if loss.dim() == 0 else loss.sum()
    loss.backward()
    return loss


def step_seconds(model, x, repeats=5):
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step(model, x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(name: str) -> None:
    factory = {"mlp": mlp, "transformer": transformer}[name]
    base, (x,) = factory()
    eager = copy.deepcopy(base)
    torch.manual_seed(1)
    loss_e = step(eager, x)
    grads_e = [p.grad.clone() for p in eager.parameters()]
    eager.zero_grad(set_to_none=True)
    eager_peak = fxopt.measure_peak(step, eager, x, resident=[eager, x]).peak_bytes
    print(f"{name}: eager measured peak {eager_peak / MiB:.2f} MiB, "
          f"step {step_seconds(eager, x) * 1e3:.1f} ms")
    budget = 0.5
    for compiler in ("eager", "inductor"):
        model = copy.deepcopy(base)
        backend = fxopt.backend(budget, compiler=compiler, time_limit=30)
        compiled = torch.compile(model, backend=backend, dynamic=False)
        torch.manual_seed(1)
        try:
            loss = step(compiled, x)
        except Exception as err:  # noqa: BLE001 - Dynamo wraps what the backend raises
            inner = fxopt.capture.dynamo.unwrap_compile_error(err)
            if not isinstance(inner, fxopt.InfeasibleBudgetError):
                raise
            print(f"  {compiler}: {budget:.0%} is infeasible; using the smallest budget, "
                  f"{inner.min_budget / MiB:.2f} MiB")
            torch._dynamo.reset()
            model = copy.deepcopy(base)
            backend = fxopt.backend(inner.min_budget, compiler=compiler, time_limit=30)
            compiled = torch.compile(model, backend=backend, dynamic=False)
            torch.manual_seed(1)
            loss = step(compiled, x)
        tol = {"rtol": 1e-4, "atol": 1e-5} if compiler == "inductor" else {}
        same = all(torch.allclose(b.grad, g, **(tol or {"rtol": 1e-5, "atol": 1e-8}))
                   for g, b in zip(grads_e, model.parameters()))
        same = same and torch.allclose(loss, loss_e, **(tol or {"rtol": 1e-5, "atol": 1e-8}))
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        peak = fxopt.measure_peak(step, compiled, x, resident=[model, x]).peak_bytes
        plan = backend.plans[-1]
        print(f"  {compiler:>8}: budget {plan.budget_bytes / MiB:.2f} MiB, predicted {plan.peak_bytes / MiB:.2f}, "
              f"measured {peak / MiB:.2f} ({'within' if peak <= plan.budget_bytes else 'ABOVE'} the budget), "
              f"{'equal to' if same else 'DIFFERENT from'} eager, step {step_seconds(compiled, x) * 1e3:.1f} ms "
              f"(plan: {plan.solver}, +{plan.recompute_flops / 1e9:.3f} GFLOP)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mlp")

"""Train a model under a memory budget with fxopt.

    python examples/quickstart.py
"""

import torch

import fxopt
from fxopt.models import transformer_block

torch.manual_seed(0)
model, (x,) = transformer_block(batch=8, seq=128, dim=64, heads=4)

# 1. Plan without running: what would a budget of 80% of the eager peak cost?
plan = fxopt.plan(model, 0.8, (x,))
print(plan.summary())
plan.to_json("transformer_plan.json")  # inspect it, pin it in a test, or replay it below

# 2. Train with it. The module is used exactly like the original.
model = fxopt.optimize(model, 0.8, plan=fxopt.Plan.from_json("transformer_plan.json"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    optimizer.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")


# 3. Measure the real peak of a step (CUDA allocator statistics on GPU, profiler events on CPU).
def train_step():
    model(x).pow(2).mean().backward()


optimizer.zero_grad(set_to_none=True)
measured = fxopt.measure_peak(train_step, resident=[model, x])
print(f"measured peak {measured.peak_bytes} bytes, budget {plan.budget_bytes}, predicted {plan.peak_bytes}")
assert measured.peak_bytes <= plan.budget_bytes

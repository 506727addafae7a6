"""One rank of a pipeline test (spawned by tests/test_pipeline_runtime.py): replays a
`fxopt.PipelinePlan` on CPU with gloo, runs one step (after a step that compiles), measures its
peak, and compares its losses and gradients with the single-process eager step. Everything is
checked here; the rank writes what it found (and any failure) to ``out/rank<k>.json``."""

from __future__ import annotations

import copy
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import fxopt
from fxopt.distributed.pipeline import build_schedule, resident
from fxopt.models import gpt2_lm, lm_loss, skip_cnn


def workload(name: str):
    """(model, inputs, target, loss_fn) built the same way on every rank."""
    torch.manual_seed(0)
    if name == "gpt2":
        model, (idx,) = gpt2_lm(layers=8, dim=32, heads=2, seq=32, batch=8, vocab=128)
        return model, (idx,), torch.roll(idx, -1, 1), lm_loss
    model, (x,) = skip_cnn(batch=8, size=16, channels=8)
    return model, (x,), torch.randint(0, 10, (8,)), torch.nn.functional.cross_entropy


def eager_reference(model, inputs, target, loss_fn, microbatches: int):
    """The single-process step on the whole batch: per-microbatch losses, gradients by name."""
    ref = copy.deepcopy(model)
    loss = loss_fn(ref(*inputs), target)
    loss.backward()
    with torch.no_grad():
        chunks = [c.chunk(microbatches) for c in (*inputs, target)]
        losses = [loss_fn(ref(*[c[k] for c in chunks[:-1]]), chunks[-1][k]).item() for k in range(microbatches)]
    return losses, {n: p.grad for n, p in ref.named_parameters()}


def run(rank: int, world: int, name: str, plan_path: str, out: str, init: str) -> None:
    import time
    result: dict = {"rank": rank}
    t0 = time.perf_counter()
    try:
        torch.set_num_threads(1)  # one process per stage on a few cores
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init}")
        model, inputs, target, loss_fn = workload(name)
        plan = fxopt.PipelinePlan.from_json(plan_path)
        losses_ref, grads_ref = eager_reference(model, inputs, target, loss_fn, plan.microbatches)
        result["t_ref"] = time.perf_counter() - t0
        schedule = build_schedule(plan, model, loss_fn)
        result["t_build"] = time.perf_counter() - t0
        first, last = rank == 0, rank == world - 1

        def step():
            losses: list = []
            args = inputs if first else ()
            schedule.step(*args, **({"target": target, "losses": losses} if last else {}), return_outputs=False)
            return losses

        step()  # compiles the stage
        result["t_first"] = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        peak = fxopt.measure_peak(step, resident=[resident(schedule), inputs if first else (),
                                                  target if last else ()])
        result["t_second"] = time.perf_counter() - t0
        if os.environ.get("FXOPT_PP_DEBUG"):
            tl = fxopt.measure.measure_timeline(step, resident=[resident(schedule), inputs if first else (),
                                                                target if last else ()])
            k = max(range(len(tl.live_bytes)), key=lambda i: tl.live_bytes[i])
            result["timeline"] = [tl.start_bytes, tl.live_bytes[max(0, k - 30):k + 5], k, len(tl.live_bytes)]
            result["plan_peak"] = plan.stages[rank].plan.peak_bytes
            result["plan_saved"] = plan.stages[rank].plan.timeline().saved_bytes
            result["fixed"] = plan.stages[rank].fixed_bytes
            result["held"] = plan.stages[rank].held_bytes
            from fxopt.measure import profile_cpu_memory
            model.zero_grad(set_to_none=True)
            with profile_cpu_memory() as prof:
                step()
            evs = list(prof.profiler.kineto_results.events())
            mem = sorted([e for e in evs if e.name() == "[memory]"], key=lambda e: e.start_ns())
            ops = [e for e in evs if e.name() != "[memory]"]
            live, best, trace = 0, (0, 0), []
            for k, e in enumerate(mem):
                live += e.nbytes()
                trace.append(live)
                if live > best[0]:
                    best = (live, k)
            window = []
            for e in mem[max(0, best[1] - 40):best[1] + 3]:
                t = e.start_ns()
                inner = [o for o in ops if o.start_ns() <= t <= o.start_ns() + o.duration_ns()]
                inner.sort(key=lambda o: o.duration_ns())
                window.append((e.nbytes(), [o.name() for o in inner[:3]]))
            result["window"] = window[-8:]
            tpeak = mem[best[1]].start_ns()
            result["before_peak"] = [(o.name(), o.start_ns() < tpeak) for o in sorted(ops, key=lambda o: o.start_ns())
                                     if o.name() in ("CompiledFunction", "CompiledFunctionBackward")]
            result["profiled_peak"] = best[0]
            import gc, collections
            st = schedule._stage
            orig = st.backward_one_chunk
            seen = {}
            def spy(k, *a, **kw):
                if k == 1:
                    gc.collect()
                    c = collections.Counter()
                    for o in gc.get_objects():
                        if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter):
                            try:
                                c[(tuple(o.shape), o.untyped_storage().data_ptr())] += 1
                            except Exception:
                                pass
                    seen["t"] = collections.Counter(sh for sh, _ in c)
                return orig(k, *a, **kw)
            st.backward_one_chunk = spy
            model.zero_grad(set_to_none=True)
            step()
            result["alive_at_B1"] = sorted(seen["t"].items(), key=str)
        stage = schedule._stage.submod
        names = dict(model.named_parameters())
        mine = {n for n, p in names.items() if any(p is q for q in stage.parameters())}
        for n in mine:
            torch.testing.assert_close(names[n].grad, grads_ref[n], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=n: f"rank {rank}: grad of {n}: {m}")
        if last:
            torch.testing.assert_close(torch.tensor([l.item() for l in peak.result]), torch.tensor(losses_ref))
        result.update(peak=peak.peak_bytes, budget=plan.budget_bytes, predicted=plan.stages[rank].peak_bytes,
                      params=len(mine), ok=True)
        if peak.peak_bytes > plan.budget_bytes:
            raise AssertionError(f"rank {rank}: measured peak {peak.peak_bytes} > budget {plan.budget_bytes}")
    except BaseException:  # noqa: BLE001 - the parent reads the failure from the file
        result.update(ok=False, error=traceback.format_exc())
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()

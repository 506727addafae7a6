"""Breadth: every `transformers` architecture we could build from a small config, trained one step
through `fxopt.optimize` the way people call them (``model(**batch).loss.backward()``, labels
passed in, padding masks), at half its activations and, where that is out of reach, at the
smallest budget fxopt names.

    python -m benchmarks.hf_breadth [--models gpt_neo,opt] [--out benchmarks/results/hf_breadth]

Per architecture (random weights, nothing downloaded, dropout off so gradients compare exactly):

- the eager step's measured peak (`fxopt.measure_peak`, parameters, inputs and gradients counted);
- the budget: ``resident + (eager - resident) / 2`` (resident: parameters, buffers, inputs), in
  bytes; where no plan fits it, the error's ``min_budget``, planned again (up to `TRIES` budgets:
  `attempts` says how many it took);
- fxopt's plans (solver, predicted peak, recompute FLOPs, graph size; more than one plan where
  Dynamo splits the step at a graph break, or captures it again at the second call because the
  model changed what its guards read: HF's classifiers set ``config.problem_type`` at the first
  call), the measured peak of a second step, loss and every gradient against
  eager's (``torch.testing.assert_close``), and the wall time of the first call (capture + plan).

A row is ``ok`` when the measured peak is within the budget and loss and gradients equal eager's;
anything else is the row's error, and the run goes on. These are not the models the test suite
checks (`benchmarks.hf_zoo`): they are the ones it does not. Writes ``<out>.json`` after every
row and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fxopt
from benchmarks.harness import meta_line, mib, run_rows
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT

BATCH, SEQ, VOCAB, HIDDEN = 4, 64, 256, 64
TRIES = 3  # budgets tried: half the activations, then what each error names

Batch = dict[str, Any]


def _transformers():
    import transformers

    return transformers


def _ids(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a padding mask (the last quarter of the last sequence padded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, -SEQ // 4:] = 0
    return ids, mask


def causal_lm(config: str, model: str, **cfg) -> Callable[[], tuple[torch.nn.Module, Batch]]:
    def build():
        t = _transformers()
        ids, mask = _ids()
        labels = ids.clone()
        labels[mask == 0] = -100
        return getattr(t, model)(getattr(t, config)(**cfg)), {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return build


def classifier(config: str, model: str, *, per_token: bool = False, **cfg) -> Callable[[], tuple[torch.nn.Module, Batch]]:
    def build():
        t = _transformers()
        ids, mask = _ids()
        g = torch.Generator().manual_seed(1)
        labels = torch.randint(0, 2, (BATCH, SEQ) if per_token else (BATCH,), generator=g)
        return getattr(t, model)(getattr(t, config)(**cfg)), {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return build


def seq2seq(config: str, model: str, **cfg) -> Callable[[], tuple[torch.nn.Module, Batch]]:
    def build():
        t = _transformers()
        ids, mask = _ids()
        labels = _ids(seed=1)[0][:, : SEQ // 2].contiguous()
        return getattr(t, model)(getattr(t, config)(**cfg)), {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return build


def image_classifier(config: str, model: str, image: int = 32, **cfg) -> Callable[[], tuple[torch.nn.Module, Batch]]:
    def build():
        t = _transformers()
        g = torch.Generator().manual_seed(0)
        batch = {"pixel_values": torch.randn(BATCH, 3, image, image, generator=g),
                 "labels": torch.randint(0, 2, (BATCH,), generator=g)}
        return getattr(t, model)(getattr(t, config)(num_labels=2, **cfg)), batch
    return build


def clip():
    t = _transformers()
    cfg = t.CLIPConfig(text_config=dict(num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=2,
                                        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ),
                       vision_config=dict(num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=2,
                                          intermediate_size=128, image_size=32, patch_size=8), projection_dim=32)
    ids, mask = _ids()
    g = torch.Generator().manual_seed(0)
    return t.CLIPModel(cfg), {"input_ids": ids, "attention_mask": mask,
                              "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g), "return_loss": True}


def wav2vec2_ctc():
    t = _transformers()
    cfg = t.Wav2Vec2Config(num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=2, intermediate_size=128,
                           vocab_size=32, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                           num_feat_extract_layers=2, mask_time_prob=0.0, layerdrop=0.0, num_conv_pos_embeddings=16)
    g = torch.Generator().manual_seed(0)
    return t.Wav2Vec2ForCTC(cfg), {"input_values": torch.randn(BATCH, 4000, generator=g),
                                   "labels": torch.randint(1, 32, (BATCH, 20), generator=g)}


def vit_mae():
    t = _transformers()
    cfg = t.ViTMAEConfig(num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=2, intermediate_size=128,
                         image_size=32, patch_size=8, decoder_num_hidden_layers=1, decoder_hidden_size=32,
                         decoder_intermediate_size=64, decoder_num_attention_heads=2)
    g = torch.Generator().manual_seed(0)
    return t.ViTMAEForPreTraining(cfg), {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g)}


TEXT = dict(num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=2, intermediate_size=256, vocab_size=VOCAB,
            max_position_embeddings=2 * SEQ)
DECODER = dict(TEXT, num_key_value_heads=1, use_cache=False)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
HALVES = dict(encoder_layers=1, decoder_layers=1, d_model=HIDDEN, encoder_attention_heads=2, decoder_attention_heads=2,
              encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
              dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)

ARCHITECTURES: dict[str, Callable[[], tuple[torch.nn.Module, Batch]]] = {
    # decoders
    "gpt_neo": causal_lm("GPTNeoConfig", "GPTNeoForCausalLM", num_layers=2, hidden_size=HIDDEN, num_heads=2,
                         vocab_size=VOCAB, max_position_embeddings=2 * SEQ, window_size=16, use_cache=False,
                         attention_types=[[["global", "local"], 1]], embed_dropout=0.0, attention_dropout=0.0,
                         resid_dropout=0.0),
    "gptj": causal_lm("GPTJConfig", "GPTJForCausalLM", n_layer=2, n_embd=HIDDEN, n_head=2, vocab_size=VOCAB,
                      n_positions=2 * SEQ, rotary_dim=8, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": causal_lm("OPTConfig", "OPTForCausalLM", num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=2,
                     ffn_dim=256, vocab_size=VOCAB, max_position_embeddings=2 * SEQ, word_embed_proj_dim=HIDDEN,
                     use_cache=False, dropout=0.0, attention_dropout=0.0),
    "falcon": causal_lm("FalconConfig", "FalconForCausalLM", num_hidden_layers=2, hidden_size=HIDDEN,
                        num_attention_heads=2, vocab_size=VOCAB, use_cache=False, hidden_dropout=0.0, attention_dropout=0.0),
    "phi": causal_lm("PhiConfig", "PhiForCausalLM", **TEXT, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0),
    "phi3": causal_lm("Phi3Config", "Phi3ForCausalLM", **DECODER, pad_token_id=0),
    "gemma": causal_lm("GemmaConfig", "GemmaForCausalLM", **DECODER, head_dim=32),
    "gemma2": causal_lm("Gemma2Config", "Gemma2ForCausalLM", **DECODER, head_dim=32),
    "gpt_neox": causal_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", **TEXT, use_cache=False),
    "bloom": causal_lm("BloomConfig", "BloomForCausalLM", n_layer=2, hidden_size=HIDDEN, n_head=2, vocab_size=VOCAB,
                       use_cache=False),
    "stablelm": causal_lm("StableLmConfig", "StableLmForCausalLM", **DECODER),
    "starcoder2": causal_lm("Starcoder2Config", "Starcoder2ForCausalLM", **DECODER, residual_dropout=0.0,
                            embedding_dropout=0.0),
    "olmo": causal_lm("OlmoConfig", "OlmoForCausalLM", **DECODER),
    "qwen3": causal_lm("Qwen3Config", "Qwen3ForCausalLM", **DECODER, head_dim=32),
    "granite": causal_lm("GraniteConfig", "GraniteForCausalLM", **DECODER),
    "mixtral": causal_lm("MixtralConfig", "MixtralForCausalLM", **DECODER, num_local_experts=4, num_experts_per_tok=2),
    "xlnet": causal_lm("XLNetConfig", "XLNetLMHeadModel", n_layer=2, d_model=HIDDEN, n_head=2, d_inner=128,
                       vocab_size=VOCAB, dropout=0.0),
    "mamba": causal_lm("MambaConfig", "MambaForCausalLM", num_hidden_layers=2, hidden_size=HIDDEN, vocab_size=VOCAB,
                       state_size=8, use_cache=False),
    # encoders
    "roberta": classifier("RobertaConfig", "RobertaForSequenceClassification", **TEXT, **NO_DROPOUT),
    "distilbert": classifier("DistilBertConfig", "DistilBertForSequenceClassification", n_layers=2, dim=HIDDEN,
                             n_heads=2, hidden_dim=128, vocab_size=VOCAB, max_position_embeddings=2 * SEQ,
                             dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0),
    "albert": classifier("AlbertConfig", "AlbertForTokenClassification", per_token=True, **TEXT, embedding_size=32,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0),
    "electra": classifier("ElectraConfig", "ElectraForSequenceClassification", **TEXT, **NO_DROPOUT, embedding_size=32),
    "deberta_v2": classifier("DebertaV2Config", "DebertaV2ForSequenceClassification", **TEXT, **NO_DROPOUT),
    "modernbert": classifier("ModernBertConfig", "ModernBertForSequenceClassification", **TEXT, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
    "mpnet": classifier("MPNetConfig", "MPNetForSequenceClassification", **TEXT, **NO_DROPOUT),
    "funnel": classifier("FunnelConfig", "FunnelForSequenceClassification", block_sizes=[1, 1], d_model=HIDDEN,
                         n_head=2, d_head=16, d_inner=128, vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                         activation_dropout=0.0),
    "bigbird": classifier("BigBirdConfig", "BigBirdForSequenceClassification", **TEXT, **NO_DROPOUT,
                          attention_type="original_full"),
    "longformer": classifier("LongformerConfig", "LongformerForSequenceClassification",
                             **dict(TEXT, max_position_embeddings=2 * SEQ + 2), **NO_DROPOUT, attention_window=16),
    "squeezebert": classifier("SqueezeBertConfig", "SqueezeBertForSequenceClassification", **TEXT, **NO_DROPOUT,
                              embedding_size=HIDDEN, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=1, intermediate_groups=2,
                              output_groups=2),
    "convbert": classifier("ConvBertConfig", "ConvBertForSequenceClassification", **TEXT, **NO_DROPOUT),
    # encoder-decoders
    "mbart": seq2seq("MBartConfig", "MBartForConditionalGeneration", **HALVES),
    "pegasus": seq2seq("PegasusConfig", "PegasusForConditionalGeneration", **HALVES),
    "marian": seq2seq("MarianConfig", "MarianMTModel", **HALVES, decoder_vocab_size=VOCAB, pad_token_id=0,
                      decoder_start_token_id=0, eos_token_id=1, bos_token_id=2),
    "mt5": seq2seq("MT5Config", "MT5ForConditionalGeneration", num_layers=1, num_decoder_layers=1, d_model=HIDDEN,
                   d_kv=16, num_heads=2, d_ff=128, vocab_size=VOCAB, use_cache=False, decoder_start_token_id=0,
                   dropout_rate=0.0),
    # vision, audio, multimodal
    "beit": image_classifier("BeitConfig", "BeitForImageClassification", num_hidden_layers=2, hidden_size=HIDDEN,
                             num_attention_heads=2, intermediate_size=128, image_size=32, patch_size=8, **NO_DROPOUT),
    "dinov2": image_classifier("Dinov2Config", "Dinov2ForImageClassification", num_hidden_layers=2, hidden_size=HIDDEN,
                               num_attention_heads=2, mlp_ratio=2, image_size=32, patch_size=8, **NO_DROPOUT),
    "regnet": image_classifier("RegNetConfig", "RegNetForImageClassification", embedding_size=16,
                               hidden_sizes=[16, 32], depths=[1, 1], groups_width=8),
    "mobilevit": image_classifier("MobileViTConfig", "MobileViTForImageClassification", image=64, image_size=64,
                                  hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0),
    "efficientnet": image_classifier("EfficientNetConfig", "EfficientNetForImageClassification", image_size=32,
                                     width_coefficient=0.25, depth_coefficient=0.2, hidden_dim=320, dropout_rate=0.0,
                                     drop_connect_rate=0.0),
    "segformer": image_classifier("SegformerConfig", "SegformerForImageClassification", num_encoder_blocks=2,
                                  depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                                  patch_sizes=[7, 3], strides=[4, 2], hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, drop_path_rate=0.0, classifier_dropout_prob=0.0),
    "mobilenet_v2": image_classifier("MobileNetV2Config", "MobileNetV2ForImageClassification", image_size=32,
                                     depth_multiplier=0.25, classifier_dropout_prob=0.0),
    "levit": image_classifier("LevitConfig", "LevitForImageClassification", image=64, image_size=64,
                              hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1],
                              key_dim=[8, 8, 8], drop_path_rate=0),
    "vit_mae": vit_mae,
    "clip": clip,
    "wav2vec2_ctc": wav2vec2_ctc,
}


def _step(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    loss = model(**batch).loss
    loss.backward()
    return loss


def _measured(model: torch.nn.Module, batch: Batch) -> tuple[int, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    peak = fxopt.measure_peak(_step, model, batch, resident=[model, batch])
    return peak.peak_bytes, peak.result


def _grads_equal(eager: torch.nn.Module, optimized: torch.nn.Module) -> str | None:
    for (name, a), (_, b) in zip(eager.named_parameters(), optimized.named_parameters()):
        if (a.grad is None) != (b.grad is None):
            return f"grad of {name}: present in one step only"
        if a.grad is not None:
            try:
                torch.testing.assert_close(b.grad, a.grad)
            except AssertionError as err:
                return f"grad of {name}: {str(err).splitlines()[0]}"
    return None


def _resident(model: torch.nn.Module, batch: Batch) -> int:
    tensors = [*model.parameters(), *model.buffers(), *(v for v in batch.values() if isinstance(v, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


def bench(name: str, time_limit: float) -> dict[str, Any]:
    """One architecture's row (see the module docstring)."""
    torch.manual_seed(0)
    model, batch = ARCHITECTURES[name]()
    model.train()
    eager = copy.deepcopy(model)
    eager_peak, _ = _measured(eager, batch)
    budget = _resident(model, batch) + (eager_peak - _resident(model, batch)) // 2
    row: dict[str, Any] = {"model": name, "class": type(model).__name__, "eager_peak": eager_peak, "half_budget": budget}
    t0 = time.perf_counter()
    # As a user would: the budget the error names, again while it names a larger one (a step in
    # pieces names what the piece that failed needs beside the earlier ones as planned, which a
    # larger budget changes).
    for attempt in range(1, TRIES + 1):
        try:
            optimized = fxopt.optimize(copy.deepcopy(model), budget, time_limit=time_limit)
            _measured(optimized, batch)
            break
        except fxopt.InfeasibleBudgetError as err:
            if attempt == TRIES:
                raise
            row["half"] = "infeasible"
            budget = err.min_budget
    row["attempts"] = attempt
    row["first_call_s"] = time.perf_counter() - t0
    measured, loss_o = _measured(optimized, batch)
    _, loss_e = _measured(eager, batch)
    plans = optimized.step_plans or optimized.plans  # (a step in pieces: the plans its last call ran with)
    row.update(budget=budget, measured=measured, plans=len(plans),
               nodes=sum(len(p.graph.nodes) for p in plans), predicted=max(p.peak_bytes for p in plans),
               recompute_flops=sum(p.recompute_flops for p in plans), solver="+".join(sorted({p.solver for p in plans})))
    problems = [] if measured <= budget else [f"measured {measured} B over the budget {budget} B"]
    if not torch.allclose(loss_o, loss_e):
        problems.append(f"loss {loss_o.item()} != eager's {loss_e.item()}")
    if (grads := _grads_equal(eager, optimized)) is not None:
        problems.append(grads)
    row["status"] = "ok" if not problems else "; ".join(problems)
    return row


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    ok = sum(r.get("status") == "ok" for r in rows)
    lines = ["# Breadth: transformers architectures through fxopt.optimize", "",
             meta_line(result["meta"]), "",
             f"**{ok} of {len(rows)} architectures ok** (measured peak within the budget, loss and every gradient "
             "equal to eager's). Budget: half the activations (`half`), or fxopt's smallest where that is "
             "infeasible (`min`). Peaks in MiB, measured.", "",
             "| model | class | eager | budget | measured | predicted | nodes | plans | extra GFLOP | solver | first call s | status |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r.get('class', '')} | {mib(r.get('eager_peak'))} | | | | | | | | | {r['error']} |")
            continue
        which = "min" if r.get("half") == "infeasible" else "half"
        lines.append(f"| {r['model']} | {r['class']} | {mib(r['eager_peak'])} | {mib(r['budget'])} ({which}) | "
                     f"{mib(r['measured'])} | {mib(r['predicted'])} | {r['nodes']} | {r['plans']} | "
                     f"{r['recompute_flops'] / 1e9:.3f} | {r['solver']} | {r['first_call_s']:.1f} | {r['status']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated names (default: all)")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help="fxopt's time_limit, a safety stop in seconds (default fxopt's): counted effort decides the plan")
    parser.add_argument("--out", default="benchmarks/results/hf_breadth")
    args = parser.parse_args(argv)
    names = args.models.split(",") if args.models else list(ARCHITECTURES)
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(ARCHITECTURES)}")
    out = Path(args.out)
    run_rows("python -m benchmarks.hf_breadth " + shlex.join(argv or sys.argv[1:]), names,
             lambda name: bench(name, args.time_limit), out, markdown,
             brief=lambda row: row.get("status", row.get("error")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

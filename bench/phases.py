"""The two phases of a PODS step measured apart (paper §1, Fig. 1; Algorithm 1 lines 1 and 4):

  asymmetry  generation vs update seconds over rollouts per step: generation of n rollouts runs in parallel and
             grows slowly with n, the update grows with the rows trained on, the cost PODS cuts (m < n).
  memory     peak GPU memory per phase of one setting-(a) PODS step (4-bit + LoRA r=64 + checkpointing), with
             4-bit generation run eagerly and from the bf16 merged copy (engine/), and what the engine holds.

Generation: sampling.sample_completions (the decode engine) with full-length completions (no EOS ids) and the
trainer's generation settings; the update: update.fill_logprobs + update.update_policy on a synthetic kept batch of
the same shape (common.run_update), with preset (a)'s update settings. Simplification: one prompt per step
(setting (a) has one), random weights.
"""

from pathlib import Path

import torch

from run import config
import engine
import policy
import update
from bench import common
from bench.common import GIB, print_header, print_row

ASYMMETRY_COLUMNS = ["precision", "rollouts", "generate_s", "generate_ms_per_token", "update_s", "update_ms_per_token",
                     "generate_peak_gib", "update_peak_gib"]
DESCRIPTION = __doc__.split("\n\n")[0]
MEMORY_COLUMNS = ["precision", "phase", "seconds", "peak_gib", "peak_reserved_gib", "engine_held_gib"]


def bench_asymmetry(argv):
    args = common.parse_args("asymmetry", argv, {"precisions": "bf16"}, DESCRIPTION)
    shapes, device, trainer = args.shapes, args.device, args.trainer
    settings = config.update_settings(trainer)
    rows, warmups = [], []
    for precision in common.runnable_precisions(args):
        model = common.build_policy(args.model, tiny=args.tiny, device=device, precision=precision, args=trainer,
                                       seed=args.seed)
        optimizer = update.make_optimizer(model, trainer.learning_rate, trainer.weight_decay, trainer.optimizer)
        vocab_size = policy.hf_model(model).config.vocab_size
        prompt_ids = common.random_prompts(vocab_size, 1, shapes.prompt_tokens, args.seed)
        # Warm-up, timed apart: every generation bucket (CUDA graphs / compilation), kernels, optimizer state.
        stats = common.engine_stats()
        _, warm_s = common.timed(lambda: [
            common.generate(model, prompt_ids, rollouts, shapes.completion_tokens, trainer, args.seed)
            for rollouts in sorted({min(r, trainer.rollout_batch_size) for r in shapes.rollouts})] + [
            common.run_update(model, optimizer, shapes.micro_batch_size, shapes, settings, args.seed)], device)
        warmups.append({"precision": precision, "warmup_s": warm_s,
                        "graph_warmup_s": engine.STATS.warmup_s - stats.warmup_s})
        print(f"{precision}: warm-up {warm_s:.1f} s (engine graph recording / compilation "
              f"{warmups[-1]['graph_warmup_s']:.1f} s)")
        print_header(ASYMMETRY_COLUMNS)
        for rollouts in shapes.rollouts:
            common.reset_peak(device)
            _, generate_s = common.timed(lambda: common.generate(
                model, prompt_ids, rollouts, shapes.completion_tokens, trainer, args.seed), device)
            generate_peak = common.phase_peak_gib(device)
            common.reset_peak(device)
            _, update_s = common.timed(lambda: common.run_update(
                model, optimizer, rollouts, shapes, settings, args.seed), device)
            rows.append({"precision": precision, "rollouts": rollouts, "generate_s": generate_s,
                         "generate_ms_per_token": 1e3 * generate_s / (rollouts * shapes.completion_tokens),
                         "update_s": update_s, "update_ms_per_token": 1e3 * update_s / (
                             rollouts * (shapes.prompt_tokens + shapes.completion_tokens)),
                         "generate_peak_gib": generate_peak, "update_peak_gib": common.phase_peak_gib(device)})
            print_row(rows[-1], ASYMMETRY_COLUMNS)
        model = optimizer = None  # free the GPU memory before the next precision
        engine.release()
        common.free(device)
    print("(PODS premise: generate_s grows slower than update_s with the rollouts; the step benchmark times whole "
          "steps: python -m bench step)")
    plot_path = Path(args.plot) if args.plot else args.out_dir / "bench_asymmetry.png"
    plot_asymmetry(rows, plot_path, title=f"{args.model}{' (tiny, CPU smoke)' if args.tiny else ''}")
    result = {"args": vars(args), "rows": rows, "warmups": warmups, "plot": str(plot_path)}
    common.save_json(args.out_dir, "asymmetry", result)
    return result


def held_bytes(value):
    """Bytes of every tensor in a (nested) list / tuple / dict."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(held_bytes(item) for item in items)


def engine_held_gib(model, generation_copy=None):
    """What the decode engine keeps for `model` between calls: merged weight copies and KV buffers (GiB)."""
    cached = engine.engine_for(model, generation_copy, refresh_weights=False)
    return (held_bytes([weight for _, weight in cached.copies]) + held_bytes(cached.buffers)) / GIB


def plot_asymmetry(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for precision in dict.fromkeys(row["precision"] for row in rows):
        mine = [row for row in rows if row["precision"] == precision]
        x = [row["rollouts"] for row in mine]
        axis.plot(x, [row["generate_s"] for row in mine], "o-", label=f"generation ({precision})")
        axis.plot(x, [row["update_s"] for row in mine], "s--", label=f"update ({precision})")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("rollouts per step")
    axis.set_ylabel("time per step (s)")
    axis.set_title(f"Generation vs policy update: {title}")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"plot: {path}")


def analytic_memory(name, shapes, n, m):
    """Memory arithmetic for the full-size config (meaningful on any machine): bf16 weights, the generation
    KV cache of n rows, the bf16 merged generation copy of the adapted projections, and the fp32 logits of one
    update micro-batch."""
    from transformers import AutoModelForCausalLM

    model_config = common.real_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    parameters = sum(p.numel() for p in model.parameters())
    projections = sum(module.weight.numel() for key, module in model.named_modules()
                      if key.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"))
    tokens = shapes.prompt_tokens + shapes.completion_tokens
    return {"model": name, "parameters_b": parameters / 1e9, "weights_bf16_gib": 2 * parameters / GIB,
            "kv_cache_gib": common.kv_cache_bytes(model_config, n, tokens) / GIB,
            "generation_copy_bf16_gib": 2 * projections / GIB,
            "logits_fp32_gib": 4 * shapes.micro_batch_size * (shapes.completion_tokens + 1) * model_config.vocab_size
            / GIB, "rows_generated": n, "rows_updated": m}


def bench_memory(argv):
    args = common.parse_args("memory", argv, {"precisions": "4bit"}, DESCRIPTION)
    shapes, device, trainer = args.shapes, args.device, args.trainer
    settings = config.update_settings(trainer)
    precisions = common.runnable_precisions(args) or ["fp32" if device.type == "cpu" else "bf16"]
    if args.precisions == ["4bit"] and "4bit" not in precisions:
        print(f"note: running the phases in {precisions[0]} instead")
    phases = []
    print_header(MEMORY_COLUMNS)

    def measure(precision, phase, fn, model=None, generation_copy=None):
        common.reset_peak(device)
        value, seconds = common.timed(fn, device)
        phases.append({"precision": precision, "phase": phase, "seconds": seconds,
                       "peak_gib": common.phase_peak_gib(device),
                       "peak_reserved_gib": common.phase_peak_gib(device, reserved=True),
                       "engine_held_gib": None if model is None else engine_held_gib(model, generation_copy)})
        print_row(phases[-1], MEMORY_COLUMNS)
        return value

    for precision in precisions:
        model = measure(precision, "load", lambda: common.build_policy(
            args.model, tiny=args.tiny, device=device, precision=precision, args=trainer, seed=args.seed))
        optimizer = update.make_optimizer(model, trainer.learning_rate, trainer.weight_decay, trainer.optimizer)
        prompt_ids = common.random_prompts(policy.hf_model(model).config.vocab_size, 1, shapes.prompt_tokens,
                                           args.seed)
        # 4-bit: generation from the quantized modules (no copy) vs from a bf16 merged copy; the trainer's default
        # (generation_copy=None) is the first for 4-bit, the second otherwise.
        copies = (False, True) if precision == "4bit" else (None,)
        for copy in copies:
            label = {False: "4-bit modules", True: "bf16 merged copy", None: "merged copy"}[copy]
            measure(precision, f"generate n={shapes.pods_n} ({label})", lambda: common.generate(
                model, prompt_ids, shapes.pods_n, shapes.completion_tokens, trainer, args.seed,
                generation_copy=copy), model, copy)
            if copy is False:
                engine.release(model)  # measure the copy's generation on its own
        measure(precision, f"update m={shapes.pods_m} (fill_logprobs + update_policy)", lambda: common.run_update(
            model, optimizer, shapes.pods_m, shapes, settings, args.seed), model, copies[-1])
        model = optimizer = None  # free the GPU memory before the next precision
        engine.release()
        common.free(device)
    for precision in precisions:
        peaks = [p["peak_gib"] for p in phases if p["precision"] == precision]
        if None in peaks:
            print(f"{precision}: whole-step peak n/a on {device.type} (CUDA allocator statistics only)")
            continue
        print(f"{precision}: whole-step peak {max(peaks):.2f} GiB ({common.verdict(max(peaks) <= args.budget_gib)}"
              f" vs {args.budget_gib} GiB; the engine's weight copy and KV buffers stay held into the update)")
    estimate = analytic_memory(args.model, common.SETTING_A, common.SETTING_A.pods_n, common.SETTING_A.pods_m)
    print(f"\n## Analytic, full-size {args.model} in setting (a) (arithmetic, not a measurement)")
    print_header(list(estimate))
    print_row(estimate, list(estimate))
    result = {"args": vars(args), "phases": phases, "analytic": estimate}
    common.save_json(args.out_dir, "memory", result)
    return result

"""Model-shape benchmarks of the PODS premise (paper §1 and Fig. 1): generation scales with the number of
rollouts while the policy update is memory-bound, so generating n rollouts and training on m < n is cheap.

  asymmetry  generation vs update time over rollouts per step (Fig. 1), then the step time of GRPO-PODS
             (n=64, m=16) vs GRPO (n=16, m=16) in setting (a) shapes (512 + 512 tokens, LoRA r=64), bf16 / 4-bit
  decode     time per decode step at batch 64 vs the memory-bandwidth bound and vs plain model.generate()
  memory     peak GPU memory per phase of one setting-(a) PODS step (4-bit + LoRA r=64 + checkpointing)

Models are built from the shipped configs (model_configs/, config values of Qwen2.5-3B-Instruct and
Llama-3.2-3B-Instruct) with random weights: speed and memory do not depend on the weights. Completions have
a forced length (EOS ignored). On CPU (or with --tiny) a 2-layer model of the same architecture and toy
shapes is used so CI runs every code path; its figures are smoke figures, not the paper's. Peak memory is
CUDA's max_memory_allocated per phase; on CPU it is reported as n/a (no per-phase allocator statistics).
"""

import argparse
import atexit
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import models
from grpo_loss import grpo_loss, token_logprobs
from pods import downsample
from sampling import generation_config_for, resolve_cache_implementation, sample_completions

CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
MODEL_CONFIGS = {"qwen2.5-3b": "qwen2.5-3b-instruct.json", "llama-3.2-3b": "llama-3.2-3b-instruct.json"}
TINY_VOCAB = 1024
GIB = 2 ** 30
# Vendor peak DRAM bandwidth (bytes/s), matched in order against torch.cuda.get_device_name().
SPEC_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                  ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
                  ("L40S", 864e9), ("L4", 300e9), ("A10G", 600e9), ("RTX 4090", 1008e9))


@dataclass(frozen=True)
class Shapes:
    prompt_tokens: int
    completion_tokens: int
    lora_rank: int
    rollouts: tuple
    pods_n: int
    pods_m: int
    grpo_n: int
    grpo_m: int
    decode_batch: int
    micro_batch_size: int
    rollout_batch_size: int


SETTING_A = Shapes(512, 512, 64, (8, 16, 32, 64, 128, 256, 512), 64, 16, 16, 16, 64, 4, 256)
TINY = Shapes(8, 8, 4, (2, 4, 8), 8, 2, 2, 2, 8, 2, 8)


# ---------------------------------------------------------------- arithmetic (unit-tested by hand)

def kv_cache_bytes(config, batch, tokens, bytes_per_element=2):
    """Bytes of keys + values for `batch` rows of `tokens` positions: layers * 2 * kv_heads * head_dim."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * tokens * batch * bytes_per_element


def decode_bound_s(weight_bytes, kv_bytes, bandwidth_bytes_per_s):
    """Lower bound on one decode step: every weight and every cached key/value is read once from DRAM."""
    return (weight_bytes + kv_bytes) / bandwidth_bytes_per_s


def weight_bytes(model):
    """Bytes of all parameters and buffers as stored (NF4 weights count their packed uint8 storage)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def spec_bandwidth(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bandwidth for key, bandwidth in SPEC_BANDWIDTH if key in name), None)


def measured_bandwidth(device, size_bytes=None, repeats=5):
    """Device copy bandwidth (read + write bytes / s) of one large tensor copy: a practical ceiling."""
    size_bytes = size_bytes or (GIB if device.type == "cuda" else 16 * 2 ** 20)
    source = torch.empty(size_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    _, elapsed_s = timed(lambda: [target.copy_(source) for _ in range(repeats)], device)
    return 2 * size_bytes * repeats / elapsed_s


# ---------------------------------------------------------------- models and phases

def real_config(name):
    from transformers import AutoConfig

    values = json.loads((CONFIG_DIR / MODEL_CONFIGS[name]).read_text())
    return AutoConfig.for_model(**{k: v for k, v in values.items() if not k.startswith("_")})


_RANDOM_CHECKPOINTS = {}


def _random_checkpoint(name, device):
    """Random bf16 weights saved once per process, so 4-bit goes through the real models.load_policy path."""
    if name not in _RANDOM_CHECKPOINTS:
        from transformers import AutoModelForCausalLM

        folder = tempfile.mkdtemp(prefix=f"pods_random_{name}_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(real_config(name), dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        _RANDOM_CHECKPOINTS[name] = folder
    return _RANDOM_CHECKPOINTS[name]


def build_policy(name, *, tiny, device, precision, lora_rank, seed=0):
    """The policy as train.py holds it: LoRA (lora_rank > 0) + gradient checkpointing; bf16, fp32 or 4-bit."""
    torch.manual_seed(seed)
    if tiny:
        model = models.tiny_random_model(real_config(name).model_type, vocab_size=TINY_VOCAB, seed=seed)
        model = model.to(device=device, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    elif precision == "4bit":
        return models.load_policy(_random_checkpoint(name, device), dtype=torch.bfloat16, device=str(device),
                                  load_in_4bit=True, lora_rank=lora_rank, gradient_checkpointing=True)
    else:
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(real_config(name), dtype=torch.bfloat16)
    return models.prepare_for_training(model, lora_rank=lora_rank, gradient_checkpointing=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device, reserved=False):
    """Peak CUDA memory since reset_peak; None on CPU (no per-phase allocator statistics there)."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_reserved(device) if reserved else torch.cuda.max_memory_allocated(device)) / GIB


def random_prompts(model, rows, tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (rows, tokens), generator=generator)


def generate_phase(model, prompt_ids, n, shapes, seed, cache_implementation=None):
    eos = 2  # any id: EOS is ignored, every completion has exactly completion_tokens tokens
    completion_ids, _, _ = sample_completions(
        model, prompt_ids, torch.ones_like(prompt_ids), n, shapes.completion_tokens, [eos], eos,
        temperature=1.0, rollout_batch_size=shapes.rollout_batch_size, seed=seed,
        cache_implementation=cache_implementation, ignore_eos=True)
    return completion_ids


def backward_phase(model, prompt_ids, completion_ids, micro_batch_size, seed=0):
    """Forward + backward of the GRPO loss over all rows, micro-batched as train.py does (each micro-batch
    loss scaled by its share of rows); old log-probs = detached current ones (one update per batch)."""
    model.train()
    device = next(model.parameters()).device
    rows, completion_tokens = completion_ids.shape
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1).to(device)
    advantages = torch.randn(rows, generator=torch.Generator().manual_seed(seed)).to(device)
    for start in range(0, rows, micro_batch_size):
        ids = input_ids[start:start + micro_batch_size]
        logprobs = token_logprobs(model, ids, torch.ones_like(ids), completion_tokens)
        loss, _ = grpo_loss(logprobs, logprobs.detach(), advantages[start:start + micro_batch_size],
                            torch.ones_like(logprobs))
        (loss * len(ids) / rows).backward()


def make_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)


def optimizer_phase(optimizer):
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def pods_step(model, optimizer, n, m, shapes, seed, prompts=1):
    """One step of Algorithm 1: generate n per prompt, score (random rewards: time is what matters here),
    keep m by max-variance down-sampling, update on the m. Returns per-phase seconds and peak GiB."""
    device = next(model.parameters()).device
    prompt_ids = random_prompts(model, prompts, shapes.prompt_tokens, seed)
    record = {}
    reset_peak(device)
    completion_ids, record["generate_s"] = timed(lambda: generate_phase(model, prompt_ids, n, shapes, seed), device)
    record["generate_peak_gib"] = peak_gib(device)
    rewards = torch.randint(0, 2, (prompts, n), generator=torch.Generator().manual_seed(seed)).float()
    keep, record["select_s"] = timed(lambda: downsample(rewards, m, "max_variance"), device)
    rows = (torch.arange(prompts)[:, None] * n + keep).reshape(-1)
    reset_peak(device)
    _, record["update_s"] = timed(lambda: (backward_phase(model, prompt_ids.repeat_interleave(m, 0),
                                                          completion_ids[rows], shapes.micro_batch_size),
                                           optimizer_phase(optimizer)), device)
    record["update_peak_gib"] = peak_gib(device)
    record["step_s"] = record["generate_s"] + record["select_s"] + record["update_s"]
    return record


# ---------------------------------------------------------------- command line

def parse_args(name, argv, defaults):
    parser = argparse.ArgumentParser(prog=f"bench.py {name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_CONFIGS), default="qwen2.5-3b")
    parser.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    parser.add_argument("--tiny", action="store_true", help="2-layer model, toy shapes (always on for CPU)")
    parser.add_argument("--precisions", default=defaults["precisions"], help="comma list of bf16, fp32, 4bit")
    parser.add_argument("--rollouts", default=None, help="comma list of rollouts per step (asymmetry)")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--completion-tokens", type=int, default=None)
    parser.add_argument("--lora-rank", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--rollout-batch-size", type=int, default=None, help="generation chunk (memory bound)")
    parser.add_argument("--batch", type=int, default=None, help="decode batch (decode)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="device DRAM bandwidth, GB/s (decode)")
    parser.add_argument("--budget-gib", type=float, default=40.0, help="memory target (memory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench_out", help="JSON results (and the plot) go here")
    parser.add_argument("--plot", default=None, help="PNG path (asymmetry; default <out-dir>/bench_asymmetry.png)")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.tiny = args.tiny or args.device.type == "cpu"
    shapes = TINY if args.tiny else SETTING_A
    overrides = {"prompt_tokens": args.prompt_tokens, "completion_tokens": args.completion_tokens,
                 "lora_rank": args.lora_rank, "micro_batch_size": args.micro_batch_size,
                 "rollout_batch_size": args.rollout_batch_size, "decode_batch": args.batch,
                 "rollouts": tuple(int(r) for r in args.rollouts.split(",")) if args.rollouts else None}
    args.shapes = replace(shapes, **{k: v for k, v in overrides.items() if v is not None})
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for precision in args.precisions:
        if precision not in ("bf16", "fp32", "4bit"):
            raise ValueError(f"unknown precision {precision!r} (bf16, fp32, 4bit)")
    args.out_dir = Path(args.out_dir)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    label = "CPU smoke figures (tiny model, toy shapes), not the paper's" if args.device.type == "cpu" else \
        f"{torch.cuda.get_device_name(args.device)}{', tiny model' if args.tiny else ''}"
    print(f"# bench {name}: {args.model}, {label}; shapes {asdict(args.shapes)}")
    return args


def runnable_precisions(args):
    """4-bit needs CUDA (bitsandbytes); on CPU those rows are skipped with a note, and bf16 runs in fp32
    on CPU unless --tiny is used on a GPU (CPU bf16 matmuls are emulated and only measure the emulation)."""
    kept = []
    for precision in args.precisions:
        if precision == "4bit" and args.device.type != "cuda":
            print("note: 4bit rows skipped (bitsandbytes NF4 needs CUDA)")
            continue
        kept.append("fp32" if precision == "bf16" and args.device.type == "cpu" else precision)
    return list(dict.fromkeys(kept))


def print_table(rows, columns):
    def cell(value):
        if value is None:
            return "n/a"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(cell(row.get(column)) for column in columns) + " |")


def save_json(args, name, result):
    path = args.out_dir / f"bench_{name}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"results: {path}")


def free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_asymmetry(argv):
    args = parse_args("asymmetry", argv, {"precisions": "bf16,4bit"})
    shapes, device = args.shapes, args.device
    rows, steps = [], []
    for precision in runnable_precisions(args):
        model = build_policy(args.model, tiny=args.tiny, device=device, precision=precision,
                             lora_rank=shapes.lora_rank, seed=args.seed)
        optimizer = make_optimizer(model)
        # Warm up (kernels, allocator, optimizer state); on CUDA also compile / record CUDA graphs for every
        # generation shape, including those of the step comparison, before anything is timed.
        warm = device.type == "cuda"
        pods_step(model, optimizer, 2, 2, shapes, args.seed)
        for rollouts in sorted(set(shapes.rollouts) | ({shapes.pods_n, shapes.grpo_n} if warm else set())):
            prompt_ids = random_prompts(model, 1, shapes.prompt_tokens, args.seed)
            if warm:
                generate_phase(model, prompt_ids, rollouts, shapes, args.seed)
            reset_peak(device)
            completion_ids, generate_s = timed(
                lambda: generate_phase(model, prompt_ids, rollouts, shapes, args.seed), device)
            generate_peak = peak_gib(device)
            reset_peak(device)
            _, update_s = timed(lambda: (backward_phase(model, prompt_ids.expand(rollouts, -1), completion_ids,
                                                        shapes.micro_batch_size), optimizer_phase(optimizer)), device)
            if rollouts in shapes.rollouts:
                rows.append({"precision": precision, "rollouts": rollouts, "generate_s": generate_s,
                             "generate_ms_per_token": 1e3 * generate_s / (rollouts * shapes.completion_tokens),
                             "update_s": update_s, "update_ms_per_token": 1e3 * update_s / (
                                 rollouts * (shapes.prompt_tokens + shapes.completion_tokens)),
                             "generate_peak_gib": generate_peak, "update_peak_gib": peak_gib(device)})
        for label, n, m in (("GRPO-PODS", shapes.pods_n, shapes.pods_m), ("GRPO", shapes.grpo_n, shapes.grpo_m)):
            steps.append({"precision": precision, "method": f"{label} n={n} m={m}",
                          **pods_step(model, optimizer, n, m, shapes, args.seed)})
        steps[-2]["vs_grpo"] = steps[-2]["step_s"] / steps[-1]["step_s"]
        del model, optimizer
        free(device)
    print("\n## Generation vs update time per step (Fig. 1)")
    print_table(rows, ["precision", "rollouts", "generate_s", "generate_ms_per_token", "update_s",
                       "update_ms_per_token", "generate_peak_gib", "update_peak_gib"])
    print(f"\n## Step time, GRPO-PODS vs GRPO (target: PODS step <= 1.5x GRPO step)")
    print_table(steps, ["precision", "method", "generate_s", "select_s", "update_s", "step_s", "vs_grpo",
                        "generate_peak_gib", "update_peak_gib"])
    for step in steps:
        if "vs_grpo" in step:
            print(f"{step['precision']}: PODS/GRPO step time = {step['vs_grpo']:.2f}x "
                  f"({'PASS' if step['vs_grpo'] <= 1.5 else 'FAIL'} vs 1.5x)")
    plot_path = Path(args.plot) if args.plot else args.out_dir / "bench_asymmetry.png"
    plot_asymmetry(rows, plot_path, title=f"{args.model}{' (tiny, CPU smoke)' if args.tiny else ''}")
    result = {"args": vars(args), "rows": rows, "steps": steps, "plot": str(plot_path)}
    save_json(args, "asymmetry", result)
    return result


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


def decode_step_s(run, new_tokens, device):
    """Seconds per decode step: (time for new_tokens - time for 1 token) / (new_tokens - 1), after a warm-up
    (compilation, CUDA-graph recording) so only steady-state decoding is measured."""
    run(new_tokens)
    _, full_s = timed(lambda: run(new_tokens), device)
    _, prefill_s = timed(lambda: run(1), device)
    return max(full_s - prefill_s, 0.0) / (new_tokens - 1)


def logit_agreement(model, prompt_ids, steps, pad_id):
    """Greedy logits of the fast path (static cache, compiled on CUDA) vs the dynamic path, compared per row up
    to its first differing token (after that the two continue from different prefixes)."""
    logits = {}
    for cache in ("dynamic", "static"):
        config = generation_config_for(steps, 0.0, 1.0, [pad_id], pad_id, cache, prompt_ids.shape[1] + steps, True)
        config.update(output_logits=True, return_dict_in_generate=True)
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                 generation_config=config)
        logits[cache] = (torch.stack(out.logits, 1).float().cpu(), out.sequences[:, prompt_ids.shape[1]:].cpu())
    (dyn_logits, dyn_tokens), (sta_logits, sta_tokens) = logits["dynamic"], logits["static"]
    same_prefix = (dyn_tokens == sta_tokens).long().cumprod(1).bool()
    valid = torch.cat([torch.ones_like(same_prefix[:, :1]), same_prefix[:, :-1]], 1)  # step t sees equal prefixes
    diff = (dyn_logits - sta_logits).abs().amax(-1)[valid]
    return {"max_abs_logit_diff": float(diff.max()), "logit_std": float(dyn_logits.std()),
            "tokens_equal_frac": float((dyn_tokens == sta_tokens).float().mean())}


def bench_decode(argv):
    args = parse_args("decode", argv, {"precisions": "bf16"})
    shapes, device = args.shapes, args.device
    bandwidth_spec = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else spec_bandwidth(device)
    bandwidth_copy = measured_bandwidth(device)
    bandwidth = bandwidth_spec or bandwidth_copy
    print(f"bandwidth: spec {bandwidth_spec and bandwidth_spec / 1e9} GB/s, measured copy {bandwidth_copy / 1e9:.1f}"
          f" GB/s; the bound uses {'spec' if bandwidth_spec else 'measured copy'}")
    rows, checks, weights, kv_bytes = [], [], [], None
    for precision in runnable_precisions(args):
        model = build_policy(args.model, tiny=args.tiny, device=device, precision=precision,
                             lora_rank=shapes.lora_rank, seed=args.seed)
        batch, new_tokens = shapes.decode_batch, shapes.completion_tokens
        prompt_ids = random_prompts(model, batch, shapes.prompt_tokens, args.seed)
        mean_context = shapes.prompt_tokens + new_tokens / 2
        bytes_per_kv = 2 if precision != "fp32" else 4
        kv_bytes = kv_cache_bytes(model.config, batch, mean_context, bytes_per_kv)
        weights.append(weight_bytes(model))
        bound_s = decode_bound_s(weights[-1], kv_bytes, bandwidth)
        on_device = prompt_ids.to(device)
        model.eval()

        def plain_generate(tokens):  # transformers defaults: dynamic cache, no compile; length forced
            with torch.no_grad():
                return model.generate(input_ids=on_device, attention_mask=torch.ones_like(on_device), do_sample=True,
                                      max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=2)

        def ours(cache):
            return lambda tokens: sample_completions(
                model, prompt_ids, torch.ones_like(prompt_ids), 1, tokens, [2], 2, rollout_batch_size=batch,
                seed=args.seed, cache_implementation=cache, ignore_eos=True)

        auto = resolve_cache_implementation(model, None)
        paths = {"generate() defaults": plain_generate, "sampling.py dynamic": ours("dynamic"),
                 "sampling.py static": ours("static")}
        measured = {label: decode_step_s(run, new_tokens, device) for label, run in paths.items()}
        for label, step_s in measured.items():
            rows.append({"precision": precision, "path": label, "batch": batch, "step_ms": 1e3 * step_s,
                         "tokens_per_s": batch / step_s if step_s else None, "bound_ms": 1e3 * bound_s,
                         "x_bound": step_s / bound_s,
                         "speedup_vs_default": measured["generate() defaults"] / step_s if step_s else None,
                         "auto": label == f"sampling.py {auto}"})
        checks.append({"precision": precision, **logit_agreement(model, on_device, min(16, new_tokens), 2)})
        del model
        free(device)
    print("\n## Decode step time (mean context = prompt + new/2) vs the bandwidth bound")
    print_table(rows, ["precision", "path", "auto", "batch", "step_ms", "tokens_per_s", "bound_ms", "x_bound",
                       "speedup_vs_default"])
    print("\ntargets: sampling.py default path (auto = static + compile on CUDA) <= 2x bound and >= 3x faster "
          "than generate() defaults")
    for row in rows:
        if row["auto"]:
            print(f"{row['precision']}: {row['x_bound']:.2f}x bound "
                  f"({'PASS' if row['x_bound'] <= 2 else 'FAIL'}), {row['speedup_vs_default']:.2f}x vs default "
                  f"({'PASS' if row['speedup_vs_default'] >= 3 else 'FAIL'})")
    print("\n## Same logits: greedy static(+compile) vs dynamic cache, compared up to the first differing token")
    print_table(checks, ["precision", "max_abs_logit_diff", "logit_std", "tokens_equal_frac"])
    result = {"args": vars(args), "bandwidth_spec": bandwidth_spec, "bandwidth_copy": bandwidth_copy,
              "weight_bytes": weights, "kv_bytes": kv_bytes, "rows": rows, "logit_checks": checks}
    save_json(args, "decode", result)
    return result


def analytic_memory(name, shapes, n, m):
    """Memory arithmetic for the full-size config (meaningful on any machine): bf16 weights, the generation
    KV cache of n rows, and the fp32 logits of one update micro-batch."""
    from transformers import AutoModelForCausalLM

    config = real_config(name)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    tokens = shapes.prompt_tokens + shapes.completion_tokens
    return {"model": name, "parameters_b": parameters / 1e9, "weights_bf16_gib": 2 * parameters / GIB,
            "kv_cache_gib": kv_cache_bytes(config, n, tokens) / GIB,
            "logits_fp32_gib": 4 * shapes.micro_batch_size * (shapes.completion_tokens + 1) * config.vocab_size / GIB,
            "rows_generated": n, "rows_updated": m}


def bench_memory(argv):
    args = parse_args("memory", argv, {"precisions": "4bit"})
    shapes, device = args.shapes, args.device
    precisions = runnable_precisions(args) or ["fp32" if device.type == "cpu" else "bf16"]
    if args.precisions == ["4bit"] and device.type != "cuda":
        print(f"note: running the phases in {precisions[0]} instead")
    phases = []

    def measure(precision, phase, fn):
        reset_peak(device)
        value, seconds = timed(fn, device)
        phases.append({"precision": precision, "phase": phase, "seconds": seconds, "peak_gib": peak_gib(device),
                       "peak_reserved_gib": peak_gib(device, reserved=True)})
        return value

    for precision in precisions:
        model = measure(precision, "load", lambda: build_policy(
            args.model, tiny=args.tiny, device=device, precision=precision, lora_rank=shapes.lora_rank, seed=args.seed))
        optimizer = make_optimizer(model)
        prompt_ids = random_prompts(model, 1, shapes.prompt_tokens, args.seed)
        completion_ids = measure(precision, f"generate n={shapes.pods_n}",
                                 lambda: generate_phase(model, prompt_ids, shapes.pods_n, shapes, args.seed))
        keep = downsample(torch.rand(1, shapes.pods_n), shapes.pods_m, "max_variance")[0]
        measure(precision, f"update fwd+bwd m={shapes.pods_m}", lambda: backward_phase(
            model, prompt_ids.expand(shapes.pods_m, -1), completion_ids[keep], shapes.micro_batch_size))
        measure(precision, "optimizer step", lambda: optimizer_phase(optimizer))
        del model, optimizer
        free(device)
    print(f"\n## Peak memory per phase of one PODS step (n={shapes.pods_n}, m={shapes.pods_m}, "
          f"{shapes.prompt_tokens}+{shapes.completion_tokens} tokens, LoRA r={shapes.lora_rank}, checkpointing)")
    print_table(phases, ["precision", "phase", "seconds", "peak_gib", "peak_reserved_gib"])
    verdicts = {}
    for precision in precisions:
        peaks = [p["peak_gib"] for p in phases if p["precision"] == precision]
        if None in peaks:
            print(f"{precision}: whole-step peak n/a on {device.type} (CUDA allocator statistics only)")
            continue
        verdicts[precision] = max(peaks)
        print(f"{precision}: whole-step peak {max(peaks):.2f} GiB "
              f"({'PASS' if max(peaks) <= args.budget_gib else 'FAIL'} vs {args.budget_gib} GiB)")
    estimate = analytic_memory(args.model, SETTING_A, SETTING_A.pods_n, SETTING_A.pods_m)
    print(f"\n## Analytic, full-size {args.model} in setting (a) (arithmetic, not a measurement)")
    print_table([estimate], list(estimate))
    result = {"args": vars(args), "phases": phases, "whole_step_peak_gib": verdicts, "analytic": estimate}
    save_json(args, "memory", result)
    return result


COMMANDS = {"asymmetry": bench_asymmetry, "decode": bench_decode, "memory": bench_memory}


def main(name, argv=None):
    """Entry point used by bench.py: `python bench.py asymmetry|decode|memory [options]`."""
    if name not in COMMANDS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {sorted(COMMANDS)}")
    return COMMANDS[name](list(argv or []))

"""Decode step time against the memory-bandwidth bound (paper §1: PODS assumes generating rollouts is cheap).

One decode step at batch 64 must read every weight and the batch's KV cache once, so (weight bytes + KV bytes) /
DRAM bandwidth bounds it from below. This times sampling.sample_completions, the trainer's generation path, with
the LoRA adapter (r=64, its B matrices randomised as after some training) attached as in training:

  generate() defaults       HF generate with a dynamic cache (backend "hf"): the reference, and the 4-bit path
                            of train.py before the decode engine
  engine, LoRA unmerged     the decode engine (engine/) calling the peft modules (what merging saves)
  engine, merged copy       the engine over the merged bf16 copy (the default; for 4-bit: generation_copy=True)
  engine, 4-bit modules     4-bit only: the engine calling the bitsandbytes + peft modules, eager (its default)

Seconds per step = (time of a call with T new tokens - time of a call with 1) / (T - 1), best of --repeats, after
a first call whose time (CUDA-graph recording / compilation, cuBLAS start-up) is printed apart. A greedy check
follows: the engine's tokens vs HF generate's, and whether each engine token is the argmax of the full model's
logits on the same prefix (teacher forcing), with the largest logit gap where it is not.

The decode step's kernels (--parts kernels; --kernels reference,fused): the merged-copy engine with the plain
PyTorch step (engine.decode.KERNELS "reference": separate projections, HF norms and rotary, SDPA under a mask, the
sampler in ~25 kernels: the step as it was) against the fused one ("fused": engine/ops.py, Triton on CUDA) at batch
16 and 64: ms per step, the bandwidth it reaches ((weights + KV cache) / step time), CUDA kernels per step and
their summed time (the profiler, over one eager step of the same shapes as the recorded graph), the greedy check,
and which ops ran fused (a fused op failing its run-time check runs its reference, said in one warning line);
then PODS's generation, 64 rollouts of one 200-token prompt to 512 tokens through the trainer's sampling path.
Last (--parts lengths), finished rows: EOS forced at lengths drawn uniformly from 100-512 tokens (GSM8K
completions' range) through engine.generate's forced_lengths, the engine dropping finished rows every CHECK_EVERY
steps vs never; the work (row-steps) against the ideal sum of lengths. --parts paths: the table above.
"""

import argparse
import contextlib

import torch

import engine
import engine.ops
import policy
import sampling
from bench import common
from bench.common import EOS, GIB, NO_EOS, print_header, print_row, timed, verdict
from engine.decode import CHECK_EVERY

COLUMNS = ["precision", "path", "batch", "context", "step_ms", "tokens_per_s", "bound_ms", "x_bound", "vs_generate",
           "first_call_s", "graph_warmup_s", "graphs"]
CHECK_COLUMNS = ["precision", "rows", "steps", "tokens_equal_hf_frac", "engine_is_argmax_frac", "max_logit_gap",
                 "logit_std"]
LENGTH_COLUMNS = ["precision", "rows", "prompt", "lengths", "rows_dropped", "seconds", "row_steps", "x_ideal_work",
                  "speedup"]
# (prompt tokens, shortest, longest completion) of the finished-rows check; tiny: toy shapes for the code path.
LENGTHS = {False: (200, 100, 512), True: (4, 2, 48)}
HF = dict(backend="hf")
UNMERGED, MERGED = dict(backend="engine", generation_copy=False), dict(backend="engine", generation_copy=True)
PATHS = {"bf16": (("generate() defaults", HF), ("engine, LoRA unmerged", UNMERGED),
                  ("engine, merged copy", dict(backend="engine"))),
         "4bit": (("generate() defaults", HF), ("engine, 4-bit modules (default)", dict(backend="engine")),
                  ("engine, bf16 merged copy", MERGED))}
PATHS["fp32"] = PATHS["bf16"]
KERNEL_COLUMNS = ["precision", "kernels", "batch", "context", "step_ms", "bound_ms", "x_bound", "bandwidth_gbs",
                  "kernels_per_step", "kernel_ms_per_step", "tokens_equal_hf_frac", "engine_is_argmax_frac",
                  "max_logit_gap", "fused_ops"]
GENERATION_COLUMNS = ["precision", "kernels", "rollouts", "prompt", "new_tokens", "seconds", "ms_per_step"]
EXACTNESS_COLUMNS = ["model", "rows", "steps", "greedy_tokens_equal", "sampled_tokens_equal", "logprob_max_diff",
                     "fused_ops"]
PARTS, KERNEL_MODES = ("paths", "kernels", "lengths"), ("reference", "fused")
SMALL_BATCH = {False: 16, True: 2}            # the kernels part's second batch
PODS_GENERATION = {False: (200, 512), True: (4, 8)}   # prompt tokens, new tokens; rollouts: the shapes' pods_n
TARGET_FUSED_X_BOUND, TARGET_SMALL_BATCH, TARGET_PODS_S = 2.0, 0.8, 2.0   # fused: <= 2x the bound at batch 64,
# a batch-16 step <= 0.8x a batch-64 step (the weights are read either way), PODS 64 x 512 generation <= 2 s
TARGET_X_BOUND, TARGET_VS_GENERATE = 3.0, 4.0   # engine (merged) <= 3x the bound, >= 4x faster than generate()
TODAY_4BIT_STEP_MS, TARGET_4BIT_SPEEDUP = 145.0, 5.0   # 4-bit generation before the engine: ~145 ms per step
# Vendor peak DRAM bandwidth (bytes/s), matched in order against torch.cuda.get_device_name().
SPEC_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                  ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
                  ("L40S", 864e9), ("L4", 300e9), ("A10G", 600e9), ("RTX 4090", 1008e9))


def decode_bound_s(weight_bytes, kv_bytes, bandwidth_bytes_per_s):
    """Lower bound on one decode step: every weight and every cached key/value is read once from DRAM."""
    return (weight_bytes + kv_bytes) / bandwidth_bytes_per_s


def weight_bytes(model, bytes_per_element=None):
    """Bytes of the base model's parameters and buffers (LoRA adapters excluded: a merged decode reads only the
    base shapes), as stored or at `bytes_per_element`; 4-bit weights count their dense (unpacked) shape."""
    total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if "lora_" in name:
            continue
        shape = getattr(getattr(tensor, "quant_state", None), "shape", None)
        count = torch.Size(shape).numel() if shape is not None else tensor.numel()
        total += count * (bytes_per_element or tensor.element_size())
    return total


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


def perturb_adapters(model, seed, std=0.01):
    """Random LoRA B matrices (peft starts them at 0): the merged copy then differs from the base weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def completions(model, prompt_ids, new_tokens, temperature, top_p, seed, **path):
    """One full-length completion per prompt row through sampling.sample_completions, on the backend of `path`."""
    settings = sampling.GenerationSettings(max_new_tokens=new_tokens, temperature=temperature, top_p=top_p,
                                           rollout_batch_size=len(prompt_ids), **path)
    return sampling.sample_completions(model, prompt_ids, torch.ones_like(prompt_ids), 1, NO_EOS, EOS, settings,
                                       seed)[0]


def step_seconds(run, new_tokens, device, repeats):
    """(seconds per decode step or None below timer resolution, first call s, its graph warm-up s, its graphs)."""
    stats = common.engine_stats()
    _, first_s = timed(lambda: run(new_tokens), device)
    graph_warmup_s, graphs = engine.STATS.warmup_s - stats.warmup_s, common.new_graphs(stats)
    run(1)  # the short call's own shapes warmed too
    estimates = []
    for _ in range(repeats):
        _, full_s = timed(lambda: run(new_tokens), device)
        _, short_s = timed(lambda: run(1), device)
        estimates.append((full_s - short_s) / (new_tokens - 1))
    return (min(estimates) if min(estimates) > 0 else None), first_s, graph_warmup_s, graphs


def greedy_check(model, prompt_ids, steps, rows, precision, engine_path):
    """Engine greedy tokens vs HF generate's (equal up to rounding), and teacher-forced: is each engine token the
    argmax of the full (unmerged) model's logits on the engine's own prefix; the largest gap where it is not."""
    ids = prompt_ids[:rows]
    tokens = {name: completions(model, ids, steps, 0.0, 1.0, 0, **path)
              for name, path in (("engine", engine_path), ("hf", HF))}
    device = next(model.parameters()).device
    with torch.no_grad(), policy.dropout_off(model):
        full = torch.cat([ids, tokens["engine"]], 1).to(device)
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), use_cache=False,
                       logits_to_keep=steps + 1).logits[:, :-1].float()
    chosen = logits.gather(-1, tokens["engine"].to(device)[..., None])[..., 0]
    gap = logits.amax(-1) - chosen
    return {"precision": precision, "rows": rows, "steps": steps,
            "tokens_equal_hf_frac": float((tokens["engine"] == tokens["hf"]).float().mean()),
            "engine_is_argmax_frac": float((gap == 0).float().mean()), "max_logit_gap": float(gap.max()),
            "logit_std": float(logits.std())}


def decode_options(argv):
    """(parts, kernel modes, the other options): --parts and --kernels, the options of this benchmark alone."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--kernels", default=",".join(KERNEL_MODES))
    known, rest = parser.parse_known_args(argv)
    parts, modes = (tuple(item.strip() for item in value.split(",") if item.strip())
                    for value in (known.parts, known.kernels))
    if not parts or set(parts) - set(PARTS):
        raise ValueError(f"--parts takes a comma list of {', '.join(PARTS)}, got {known.parts!r}")
    if not modes or set(modes) - set(KERNEL_MODES):
        raise ValueError(f"--kernels takes a comma list of {', '.join(KERNEL_MODES)}, got {known.kernels!r}")
    return parts, modes, rest


def bench_decode(argv):
    parts, modes, argv = decode_options(argv)
    args = common.parse_args("decode", argv, {"precisions": "bf16,4bit"}, __doc__.split("\n\n")[0] +
                             f" Also --parts (default {','.join(PARTS)}) and --kernels (default "
                             f"{','.join(KERNEL_MODES)}).")
    args.parts, args.kernels = parts, modes
    shapes, device, trainer = args.shapes, args.device, args.trainer
    batch, width, new_tokens = shapes.decode_batch, shapes.decode_prompt_tokens, shapes.decode_new_tokens
    if new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (a step time is a difference of two calls), got {new_tokens}")
    bandwidth_spec = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else spec_bandwidth(device)
    bandwidth_copy = measured_bandwidth(device)
    bandwidth = bandwidth_spec or bandwidth_copy
    context = width + new_tokens // 2
    print(f"bandwidth: spec {bandwidth_spec and bandwidth_spec / 1e9} GB/s, measured copy {bandwidth_copy / 1e9:.1f}"
          f" GB/s; the bound uses {'spec' if bandwidth_spec else 'measured copy'}. Batch {batch}, prompt {width} + "
          f"{new_tokens} new tokens (mean context {context}), T = {trainer.temperature}, best of {args.repeats}")
    rows, checks, weights, kv_bytes, length_rows, kernel_rows, generation_rows = [], [], [], None, [], [], []
    print_header(COLUMNS)
    for precision in common.runnable_precisions(args):
        model = common.build_policy(args.model, tiny=args.tiny, device=device, precision=precision, args=trainer,
                                    seed=args.seed)
        perturb_adapters(model, args.seed)
        model_config = policy.hf_model(model).config
        prompt_ids = common.random_prompts(model_config.vocab_size, batch, width, args.seed)
        kv_bytes = common.kv_cache_bytes(model_config, batch, context, 4 if precision == "fp32" else 2)
        weights.append(weight_bytes(model, 2 if precision == "4bit" else None))  # 4-bit: the bf16 copy
        bound_s = decode_bound_s(weights[-1], kv_bytes, bandwidth)
        generate_s = None
        for path, kwargs in PATHS[precision] if "paths" in parts else ():
            def run(tokens, kwargs=kwargs):
                return completions(model, prompt_ids, tokens, trainer.temperature, trainer.top_p, args.seed, **kwargs)

            step_s, first_s, graph_warmup_s, graphs = step_seconds(run, new_tokens, device, args.repeats)
            generate_s = step_s if path == "generate() defaults" else generate_s
            rows.append({"precision": precision, "path": path, "batch": batch, "context": context,
                         "step_ms": step_s and 1e3 * step_s, "tokens_per_s": step_s and batch / step_s,
                         "bound_ms": 1e3 * bound_s, "x_bound": step_s and step_s / bound_s,
                         "vs_generate": generate_s / step_s if generate_s and step_s else None,
                         "first_call_s": first_s, "graph_warmup_s": graph_warmup_s, "graphs": graphs})
            print_row(rows[-1], COLUMNS)
        if "paths" in parts:
            checks.append(greedy_check(model, prompt_ids, min(16, new_tokens), min(8, batch), precision,
                                       PATHS[precision][-1][1]))
        if precision != "4bit" and "kernels" in parts:
            kernel_rows += kernels_part(model, prompt_ids, precision, args, weights[-1], bandwidth)
            generation_rows += pods_generation(model, precision, args)
        if precision != "4bit" and "lengths" in parts:
            length_rows = dropped_rows_check(model, prompt_ids, LENGTHS[args.tiny], precision, args.seed, device)
        model = None  # free the GPU memory before the next precision
        engine.release()
        common.free(device)
    if "paths" in parts:
        print_targets(rows, args.tiny)
        print("\n## Greedy check: engine vs HF generate tokens; engine tokens vs the full model's argmax (teacher "
              "forced)")
        print_header(CHECK_COLUMNS)
        for check in checks:
            print_row(check, CHECK_COLUMNS)
    exactness = device_exactness(args) if "kernels" in parts else []
    if kernel_rows:
        print_kernel_targets(kernel_rows, generation_rows, args.tiny)
    result = {"args": vars(args), "bandwidth_spec": bandwidth_spec, "bandwidth_copy": bandwidth_copy,
              "weight_bytes": weights, "kv_bytes": kv_bytes, "rows": rows, "checks": checks, "kernels": kernel_rows,
              "generation": generation_rows, "exactness": exactness, "lengths": length_rows,
              "fused_ops_disabled": dict(engine.ops.DISABLED)}
    common.save_json(args.out_dir, "decode", result)
    return result


def dropped_rows_check(model, prompt_ids, lengths, precision, seed, device):
    """Completions of uneven length: EOS forced at lengths uniform in [shortest, longest] (engine.generate's
    forced_lengths); the engine with finished rows dropped (every CHECK_EVERY steps) vs never dropped.
    x_ideal_work = row-steps / sum of the lengths (1.0: each row decoded exactly its own length; rows x longest
    without dropping)."""
    width, shortest, longest = lengths
    ids = prompt_ids[:, -width:].to(device)
    rows = ids.shape[0]
    forced = torch.randint(shortest, longest + 1, (rows,), generator=torch.Generator().manual_seed(seed))
    print(f"\n## Finished rows: {rows} rows, {width}-token prompts, EOS forced at lengths {shortest}-{longest} "
          f"(mean {forced.float().mean():.0f})")
    print_header(LENGTH_COLUMNS)

    def run(check_every):
        with policy.dropout_off(model):
            return engine.generate(model, ids, torch.ones_like(ids), torch.arange(rows), longest, [EOS], EOS,
                                   temperature=1.0, seed=seed, max_rows=rows, forced_lengths=forced,
                                   check_every=check_every)

    run(CHECK_EVERY)  # records this cache length's graphs (every row bucket) before timing
    result, never_s = [], None
    for dropped, check_every in ((False, longest + 1), (True, CHECK_EVERY)):
        before = common.engine_stats()
        seconds = min(timed(lambda: run(check_every), device)[1] for _ in range(2))   # best of 2
        row_steps = (engine.STATS.row_steps - before.row_steps) // 2
        never_s = seconds if not dropped else never_s
        result.append({"precision": precision, "rows": rows, "prompt": width, "lengths": f"{shortest}-{longest}",
                       "rows_dropped": dropped, "seconds": seconds, "row_steps": row_steps,
                       "x_ideal_work": row_steps / float(forced.sum()), "speedup": never_s / seconds})
        print_row(result[-1], LENGTH_COLUMNS)
    return result


def print_targets(rows, tiny):
    print(f"\ntargets: engine (merged) <= {TARGET_X_BOUND:g}x the bound and >= {TARGET_VS_GENERATE:g}x faster than "
          f"generate() defaults; 4-bit: >= {TARGET_4BIT_SPEEDUP:g}x faster than {TODAY_4BIT_STEP_MS:g} ms per step"
          + (" (tiny model: verdicts for the code path only, the targets are for the full-size model)" if tiny else ""))
    for row in rows:
        if row["path"] not in ("engine, merged copy", "engine, bf16 merged copy"):
            continue
        if row["step_ms"] is None:
            print(f"{row['precision']}: n/a (step time below the timer's resolution)")
        elif row["precision"] == "4bit":
            speedup = TODAY_4BIT_STEP_MS / row["step_ms"]
            print(f"4bit: {speedup:.2f}x faster than {TODAY_4BIT_STEP_MS:g} ms per step "
                  f"({verdict(speedup >= TARGET_4BIT_SPEEDUP)}), {row['vs_generate'] or 0:.2f}x vs "
                  f"generate() on the 4-bit model here")
        else:
            x_bound, vs = row["x_bound"], row["vs_generate"]
            print(f"{row['precision']}: {x_bound:.2f}x bound ({verdict(x_bound <= TARGET_X_BOUND)}), "
                  f"{vs or 0:.2f}x vs generate() defaults ({verdict(bool(vs) and vs >= TARGET_VS_GENERATE)})")


@contextlib.contextmanager
def kernel_sets(modes):
    """Yields the kernel sets `modes` to loop over: at each one the engines are released, so the next call builds
    its engine with that set (engine.decode.KERNELS); the setting before is restored on leaving."""
    saved = engine.decode.KERNELS

    def each():
        for mode in modes:
            engine.release()
            engine.decode.KERNELS = mode
            yield mode

    try:
        yield each()
    finally:
        engine.decode.KERNELS = saved
        engine.release()


def kernels_part(model, prompt_ids, precision, args, weights, bandwidth):
    """The merged-copy engine with each kernel set of args.kernels at batch 16 and 64: step time, bound, bandwidth
    reached, CUDA kernels per step, the greedy check, the ops that ran fused."""
    shapes, device, trainer = args.shapes, args.device, args.trainer
    width, new_tokens = shapes.decode_prompt_tokens, shapes.decode_new_tokens
    context, model_config = width + new_tokens // 2, policy.hf_model(model).config
    print(f"\n## Decode step's kernels ({precision}): the plain PyTorch step (reference) vs the fused one, merged copy")
    print_header(KERNEL_COLUMNS)
    result = []
    with kernel_sets(args.kernels) as modes:
        for mode in modes:
            for batch in sorted({min(SMALL_BATCH[args.tiny], shapes.decode_batch), shapes.decode_batch}):
                ids = prompt_ids[:batch]

                def run(tokens, ids=ids):
                    return completions(model, ids, tokens, trainer.temperature, trainer.top_p, args.seed,
                                       backend="engine")

                step_s = step_seconds(run, new_tokens, device, args.repeats)[0]
                kv_bytes = common.kv_cache_bytes(model_config, batch, context, 4 if precision == "fp32" else 2)
                bound_s = decode_bound_s(weights, kv_bytes, bandwidth)
                kernels, kernel_ms = profiled_step(model, ids, trainer, device)
                check = greedy_check(model, prompt_ids, min(16, new_tokens), min(8, batch), precision,
                                     dict(backend="engine")) if batch == shapes.decode_batch else {}
                fused = engine.engine_for(model, refresh_weights=False).kernels.fused
                result.append({"precision": precision, "kernels": mode, "batch": batch, "context": context,
                               "step_ms": step_s and 1e3 * step_s, "bound_ms": 1e3 * bound_s,
                               "x_bound": step_s and step_s / bound_s,
                               "bandwidth_gbs": step_s and (weights + kv_bytes) / step_s / 1e9,
                               "kernels_per_step": kernels, "kernel_ms_per_step": kernel_ms,
                               **{key: check.get(key) for key in ("tokens_equal_hf_frac", "engine_is_argmax_frac",
                                                                  "max_logit_gap")},
                               "fused_ops": ",".join(sorted(fused)) or "none"})
                print_row(result[-1], KERNEL_COLUMNS)
    return result


def profiled_step(model, ids, trainer, device, steps=3):
    """(CUDA kernels per decode step, their summed ms) over `steps` eager steps of len(ids) rows reading the whole
    bucketed cache: the kernels the recorded graph replays; (None, None) off CUDA (the CPU's figure: bench census)."""
    if device.type != "cuda":
        return None, None
    rows, width = ids.shape
    with torch.no_grad(), policy.dropout_off(model):
        engine.generate(model, ids.to(device), torch.ones_like(ids).to(device), torch.arange(rows), 2, [], EOS,
                        temperature=trainer.temperature, top_p=trainer.top_p, max_rows=rows, capture=False)
        eager = engine.engine_for(model, refresh_weights=False, capture=False)
        state = next(state for (size, *_), (state, _) in eager.states.items() if size == rows)
        state.attend_len = state.shared_len = 0
        state.scalars["slot"].fill_(width - 1)
        state.scalars["step"].fill_(0)
        eager.step(eager, state)
        torch.cuda.synchronize(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            for _ in range(steps):
                eager.step(eager, state)
            torch.cuda.synchronize(device)
    kernels = [event for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA
               and not any(word in event.name.lower() for word in ("memcpy", "memset"))]
    return len(kernels) / steps, sum(getattr(event, "device_time_total", 0.0) for event in kernels) / steps / 1e3


def pods_generation(model, precision, args):
    """PODS's generation (setting (a): 64 rollouts of one 200-token prompt, 512 new tokens, no EOS) through the
    trainer's sampling path (common.generate), with each kernel set: seconds, best of 2 after a first call."""
    prompt_tokens, new_tokens = PODS_GENERATION[args.tiny]
    rollouts = args.shapes.pods_n
    prompt = common.random_prompts(policy.hf_model(model).config.vocab_size, 1, prompt_tokens, args.seed + 1)
    print(f"\n## PODS generation ({precision}): {rollouts} rollouts of one {prompt_tokens}-token prompt, {new_tokens} "
          "new tokens")
    print_header(GENERATION_COLUMNS)
    result = []
    with kernel_sets(args.kernels) as modes:
        for mode in modes:
            def run():
                return common.generate(model, prompt, rollouts, new_tokens, args.trainer, args.seed)

            run()   # records this cache length's graphs
            seconds = min(timed(run, args.device)[1] for _ in range(2))
            result.append({"precision": precision, "kernels": mode, "rollouts": rollouts, "prompt": prompt_tokens,
                           "new_tokens": new_tokens, "seconds": seconds, "ms_per_step": 1e3 * seconds / new_tokens})
            print_row(result[-1], GENERATION_COLUMNS)
    return result


def device_exactness(args, rows=6, steps=12):
    """The fused step against the plain one on this device, in float32 where both should agree to rounding: a
    2-layer Qwen2 with a LoRA adapter (merged copy), greedy and sampled tokens and the sampler's log-probs."""
    trainer = common.trainer_args(args.device, tiny=True, lora_rank=4)
    model = common.build_policy(args.model, tiny=True, device=args.device, precision="fp32", args=trainer,
                                seed=args.seed)
    perturb_adapters(model, args.seed, std=0.1)
    ids = common.random_prompts(policy.hf_model(model).config.vocab_size, rows, 9, args.seed).to(args.device)
    outputs = {}
    with kernel_sets(KERNEL_MODES) as modes:
        for mode in modes:
            with policy.dropout_off(model):
                for temperature in (0.0, 1.0):
                    outputs[mode, temperature] = engine.generate(
                        model, ids, torch.ones_like(ids), torch.arange(rows), steps, [], EOS,
                        temperature=temperature, seed=args.seed, return_logprobs=True)
        fused = engine.engine_for(model, refresh_weights=False).kernels.fused
    row = {"model": "2-layer qwen2 fp32 + LoRA", "rows": rows, "steps": steps,
           **{f"{name}_tokens_equal": bool(torch.equal(outputs["reference", t][0], outputs["fused", t][0]))
              for name, t in (("greedy", 0.0), ("sampled", 1.0))},
           "logprob_max_diff": max(float((outputs["reference", t][1] - outputs["fused", t][1]).abs().max())
                                   for t in (0.0, 1.0)),
           "fused_ops": ",".join(sorted(fused)) or "none"}
    print(f"\n## The fused step against the plain one on {args.device.type}, float32 (equal up to rounding)")
    print_header(EXACTNESS_COLUMNS)
    print_row(row, EXACTNESS_COLUMNS)
    return [row]


def print_kernel_targets(rows, generation, tiny):
    """The fused step against its targets, and against the reference step of the same run."""
    print(f"\ntargets (fused): <= {TARGET_FUSED_X_BOUND:g}x the bound at the largest batch, a small-batch step <= "
          f"{TARGET_SMALL_BATCH:g}x a large-batch one, PODS generation <= {TARGET_PODS_S:g} s"
          + (" (tiny model: verdicts for the code path only)" if tiny else ""))
    for precision in dict.fromkeys(row["precision"] for row in rows):
        step = {(row["kernels"], row["batch"]): row["step_ms"] for row in rows if row["precision"] == precision}
        fused = sorted(batch for mode, batch in step if mode == "fused")
        if not fused or any(step["fused", batch] is None for batch in fused):
            print(f"{precision}: n/a (no fused row, or a step below the timer's resolution)")
            continue
        large = next(row for row in rows if row["precision"] == precision and row["kernels"] == "fused"
                     and row["batch"] == fused[-1])
        ratio = step["fused", fused[0]] / step["fused", fused[-1]]
        print(f"{precision}: {large['x_bound']:.2f}x the bound at batch {fused[-1]} "
              f"({verdict(large['x_bound'] <= TARGET_FUSED_X_BOUND)}), {large['bandwidth_gbs']:.4g} GB/s; batch "
              f"{fused[0]} / {fused[-1]} = {ratio:.2f} ({verdict(ratio <= TARGET_SMALL_BATCH)})"
              + "".join(f"; {step['reference', batch] / step['fused', batch]:.2f}x faster than the reference at "
                        f"batch {batch}" for batch in fused if step.get(("reference", batch))))
        for row in generation:
            if row["precision"] == precision and row["kernels"] == "fused":
                print(f"{precision}: PODS generation {row['seconds']:.2f} s "
                      f"({verdict(row['seconds'] <= TARGET_PODS_S)})")

"""Whole training steps (paper Algorithm 1; the step-time comparison behind Fig. 1 and Table 1): the real
train.train_step (generate -> score -> down-sample -> update) for GRPO-PODS 64/16 and GRPO 16/16 in setting (a)
shapes, on the Qwen2.5-3B architecture with random bf16 weights built on the device.

A tokenizer must exist without network: the SmolLM2 tokenizer of the offline demo package, saved once with
`python -m bench save-tokenizer DIR` (3.5 MB) and passed as --tokenizer DIR; the model's vocabulary is resized to
its 49152 tokens (Qwen2.5's is 151936: the LM head and the update's log-softmax are ~3x cheaper than the real
model's, everything else is the real shape). Prompts are synthetic chat prompts of a chosen token width.

Simplifications: random weights almost never emit EOS, so completions run to --completion-tokens (512, the
preset's limit; the printed mean length shows it); rewards are graded for real but are all near zero.
Per step it prints generate / reward / select / update / step seconds, the engine's CUDA graphs recorded and
graphs compiled during the step (recompiles after warm-up), and the peak memory; then the steady-state medians,
the PODS/GRPO ratio and the targets. --vary-widths draws a new prompt width every step (20 steps of PODS).
"""

import argparse
import random
import statistics
from pathlib import Path

import torch

import data
import engine
import models
import train
import update
from bench import common
from bench.common import print_header, print_row

METHODS = {"pods": ("GRPO-PODS", 64, 16), "grpo": ("GRPO", 16, 16)}
TINY_METHODS = {"pods": ("GRPO-PODS", 8, 2), "grpo": ("GRPO", 2, 2)}
TARGET_STEP_S = {"pods": 6.0, "grpo": 4.5}
TARGET_RATIO = 1.35
COLUMNS = ["method", "step", "phase", "prompt_tokens", "mean_length", "generate_s", "reward_s", "select_s", "update_s",
           "step_s", "new_graphs", "graph_warmup_s", "peak_gib"]
FILLER = "apples"  # one token per repetition in the SmolLM2 tokenizer (the width is measured, not assumed)


def save_tokenizer(argv):
    """`python -m bench save-tokenizer DIR`: the offline demo model's tokenizer, saved to DIR for a GPU machine."""
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m bench save-tokenizer", description=save_tokenizer.__doc__)
    parser.add_argument("folder")
    folder = Path(parser.parse_args(argv).folder)
    models.load_tokenizer(models.SMOLLM2_ALIAS).save_pretrained(folder)
    size = sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
    print(f"saved the SmolLM2 tokenizer to {folder} ({size / 2 ** 20:.1f} MB); pass --tokenizer {folder}")
    return folder


def load_step_tokenizer(folder):
    if folder is not None:
        if not (Path(folder) / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"--tokenizer {folder}: no tokenizer there (make one with `python -m bench "
                                    "save-tokenizer DIR` where the offline demo package is installed)")
        return models.load_tokenizer(str(folder))
    try:
        return models.load_tokenizer(models.SMOLLM2_ALIAS)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"no tokenizer: pass --tokenizer DIR, made with `python -m bench save-tokenizer DIR` "
                                f"where the offline demo package is installed ({error})") from None


def synthetic_examples(tokenizer, count, width, seed, system_prompt=data.SYSTEM_PROMPT):
    """`count` chat prompts (the system prompt, if any, + a filler question) of about `width` tokens (at least the
    template's own; the paper's system prompt alone is ~110 tokens), as data.Example."""
    examples = []
    for index in range(count):
        def render(words):
            question = f"Question {seed}.{index}: {' '.join([FILLER] * words)}"
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            messages.append({"role": "user", "content": question})
            return data.render_prompts(tokenizer, [messages])[0], messages

        words = 1
        for _ in range(4):  # converge on the width (filler words are ~1 token each)
            tokens = len(tokenizer(render(words)[0], add_special_tokens=False)["input_ids"])
            if tokens == width:
                break
            words = max(1, words + width - tokens)
        text, messages = render(words)
        examples.append(data.Example(text=text, prompt=messages, answer=str(seed)))
    return examples


def parse_args(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=None,
                        help="folder made by `python -m bench save-tokenizer` (default: the demo package's, "
                             "if installed)")
    parser.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    parser.add_argument("--tiny", action="store_true", help="2-layer model, toy shapes (always on for CPU)")
    parser.add_argument("--methods", default="pods,grpo", help="comma list of pods, grpo")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per method (default 5; --vary-widths 19)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt width (default 200; tiny 48)")
    parser.add_argument("--completion-tokens", type=int, default=None, help="default 512 (setting (a)); tiny 8")
    parser.add_argument("--vary-widths", action="store_true", help="a new prompt width each step (PODS only)")
    parser.add_argument("--min-width", type=int, default=None, help="--vary-widths range (default 120..448)")
    parser.add_argument("--max-width", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench_out")
    args = parser.parse_args(argv)
    args.device = common.pick_device(args.device)
    args.tiny = args.tiny or args.device.type == "cpu"
    args.methods = ["pods"] if args.vary_widths else [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in args.methods:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r} (pods, grpo)")
    args.steps = args.steps if args.steps is not None else 19 if args.vary_widths else 5
    args.prompt_tokens = args.prompt_tokens or (48 if args.tiny else 200)
    args.completion_tokens = args.completion_tokens or (8 if args.tiny else 512)
    args.min_width = args.min_width or (40 if args.tiny else 120)
    args.max_width = args.max_width or (64 if args.tiny else 448)
    for name in ("steps", "prompt_tokens", "completion_tokens", "min_width"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_steps < 0 or args.max_width < args.min_width:
        raise ValueError("need --warmup-steps >= 0 and --max-width >= --min-width")
    return args


def method_args(args, method):
    """The trainer's flags for one method: preset (a) (--baseline for GRPO), n and m (toy ones when tiny)."""
    _, n, m = (TINY_METHODS if args.tiny else METHODS)[method]
    flags = ["-n", str(n), "-m", str(m), "--max-completion-tokens", str(args.completion_tokens),
             "--seed", str(args.seed)]
    if args.tiny:
        flags += ["--micro-batch-size", "2", "--rollout-batch-size", "8"]
    return common.trainer_args(args.device, tiny=args.tiny, lora_rank=4 if args.tiny else 64,
                               flags=flags + (["--baseline"] if method == "grpo" else []))


def timed_step(model, tokenizer, optimizer, examples, trainer, step):
    """One train.train_step, with its wall time, engine graphs recorded / compiled, their seconds and peak memory."""
    device = torch.device(trainer.device)
    stats = common.engine_stats()
    common.reset_peak(device)
    (metrics, _), step_s = common.timed(
        lambda: train.train_step(model, tokenizer, optimizer, [examples], train.step_settings(trainer), step), device)
    return {"generate_s": metrics["generate_s"], "reward_s": metrics["reward_s"], "select_s": metrics["select_s"],
            "update_s": metrics["update_s"], "step_s": step_s, "mean_length": metrics["completions/mean_length"],
            "new_graphs": common.new_graphs(stats), "graph_warmup_s": engine.STATS.warmup_s - stats.warmup_s,
            "peak_gib": common.phase_peak_gib(device)}


def bench_step(argv):
    args = parse_args(argv)
    tokenizer = load_step_tokenizer(args.tokenizer)
    label = common.device_label(args.device, args.tiny)
    print(f"# bench step: qwen2.5-3b architecture, vocabulary {len(tokenizer)} (SmolLM2 tokenizer), {label}; "
          f"completions {args.completion_tokens} tokens, {args.warmup_steps} warm-up + {args.steps} timed steps")
    first = method_args(args, args.methods[0])
    token_ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    model, build_s = common.timed(lambda: common.build_policy(
        "qwen2.5-3b", tiny=args.tiny, device=args.device, precision="bf16" if first.bf16 else "fp32", args=first,
        seed=args.seed, vocab_size=len(tokenizer), token_ids=token_ids), args.device)
    print(f"model built in {build_s:.1f} s")
    widths = random.Random(args.seed)
    rows = []
    print_header(COLUMNS)
    for method in args.methods:
        trainer = method_args(args, method)
        optimizer = update.make_optimizer(model, trainer.learning_rate, trainer.weight_decay, trainer.optimizer)
        for step in range(1, args.warmup_steps + args.steps + 1):
            width = widths.randint(args.min_width, args.max_width) if args.vary_widths else args.prompt_tokens
            examples = synthetic_examples(tokenizer, trainer.prompts_per_step, width, args.seed + step,
                                          None if args.tiny else data.SYSTEM_PROMPT)
            rows.append({"method": METHODS[method][0] + f" {trainer.num_rollouts}/{trainer.update_size}", "step": step,
                         "phase": "warm-up" if step <= args.warmup_steps else "steady",
                         "prompt_tokens": len(tokenizer(examples[0].text, add_special_tokens=False)["input_ids"]),
                         **timed_step(model, tokenizer, optimizer, examples, trainer, step)})
            print_row(rows[-1], COLUMNS)
        del optimizer
    summary = summarize(rows, args)
    result = {"args": vars(args), "build_s": build_s, "rows": rows, "summary": summary}
    common.save_json(args.out_dir, "step_widths" if args.vary_widths else "step", result)
    return result


def summarize(rows, args):
    """Steady-state medians per method, warm-up seconds, recompiles after warm-up, the PODS/GRPO ratio, targets."""
    summary = {}
    tiny = " (tiny model: verdicts for the code path only)" if args.tiny else ""
    print(f"\n## Steady state (median over {args.steps} steps after {args.warmup_steps} warm-up){tiny}")
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method]
        steady = [row for row in mine if row["phase"] == "steady"]
        medians = {key: statistics.median(row[key] for row in steady)
                   for key in ("generate_s", "update_s", "step_s")} if steady else {}
        recompiles = sum(row["new_graphs"] for row in steady)
        summary[method] = dict(medians, warmup_s=sum(row["step_s"] for row in mine if row["phase"] == "warm-up"),
                               graph_warmup_s=sum(row["graph_warmup_s"] for row in mine), recompiles=recompiles)
        key = "pods" if method.startswith("GRPO-PODS") else "grpo"
        line = ", ".join(f"{name} {value:.2f} s" for name, value in medians.items())
        target = f" ({common.verdict(medians['step_s'] <= TARGET_STEP_S[key])} vs <= {TARGET_STEP_S[key]:g} s)" \
            if medians else ""
        print(f"{method}: {line or 'no steady steps'}{target}; warm-up steps {summary[method]['warmup_s']:.1f} s "
              f"(graph recording / compilation {summary[method]['graph_warmup_s']:.1f} s); graphs recorded or "
              f"compiled after warm-up: {recompiles} ({common.verdict(recompiles == 0)} vs 0)")
    pods = next((v for k, v in summary.items() if k.startswith("GRPO-PODS") and "step_s" in v), None)
    grpo = next((v for k, v in summary.items() if not k.startswith("GRPO-PODS") and "step_s" in v), None)
    if pods and grpo:
        ratio = pods["step_s"] / grpo["step_s"]
        summary["ratio"] = ratio
        print(f"PODS/GRPO step time = {ratio:.2f}x ({common.verdict(ratio <= TARGET_RATIO)} vs <= {TARGET_RATIO}x)")
    if args.vary_widths:
        widths = sorted({row["prompt_tokens"] for row in rows})
        print(f"prompt widths over the run: {widths[0]}..{widths[-1]} tokens ({len(widths)} distinct)")
    return summary

"""Each distinct token computed once (prefix.py): the demo's update with prefix sharing off and on, interleaved in one
run, and the ratios.

The demo's policy (SmolLM2-135M + LoRA r=16, fp32) trains on its own arithmetic prompts (one-shot chat template,
the demo's system prompt: every prompt starts with the same ~85 tokens) through update.fill_logprobs +
update.update_policy with the demo's update settings (config.update_settings, micro-batches of 16), in two shapes:
  PODS 16/4     4 prompts x 4 kept rows  (16 rows, one micro-batch of 4 prompts)
  GRPO-GA 16/16 4 prompts x 16 rows      (64 rows, each micro-batch one prompt)
Completions are random tokens of the full --completion-tokens (the demo's limit, 32), advantages random, both fixed
by --seed: every mode trains on the same rows from the same weights (restored before each run), so the loss must
agree, which is printed. Modes: off (every row runs its prompt in full), groups (each distinct prompt once: the prefix
level switched off here, a benchmark-only knob) and on (--prefix-sharing on: groups + the prefix every prompt of the
step shares once, across micro-batches). `tokens` counts the tokens the model's forward passes take in (prompt tokens
once per call); `update_s` is wall-clock time (the targets: on / off <= 0.4 for PODS 16/4, <= 0.3 for GRPO-GA 16/16),
`cpu_s` this process's CPU time, steadier on a shared machine. Compare the ratios of one run, whose modes alternate in
each repeat (medians over the repeats after a warm-up).

--tiny: a 2-layer random model, 2 prompts, 4 completion tokens (the code path only; tests/test_bench.py).
Part functions (`update_part`) each print and return their rows, so other parts can join this entry.
"""

import argparse
import contextlib
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from run import config
import data
import models
import policy
from engine import prefix
import update
from bench import common
from bench.common import print_header, print_row

SHAPES = {"PODS 16/4": (4, 4), "GRPO-GA 16/16": (4, 16)}   # (prompts, kept rows per prompt)
TINY_SHAPES = {"PODS 16/4": (2, 2), "GRPO-GA 16/16": (2, 4)}
TARGETS = {"PODS 16/4": 0.4, "GRPO-GA 16/16": 0.3}          # update time, on / off
MODES = ("off", "groups", "on")
COLUMNS = ["shape", "mode", "repeat", "rows", "tokens", "update_s", "cpu_s", "loss"]


def parse_args(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m bench prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer random model, toy shapes (the code path only)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each mode and shape (interleaved)")
    parser.add_argument("--completion-tokens", type=int, default=None, help="default 32 (the demo's); tiny 4")
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench_out")
    parser.add_argument("--from-json", help="no timing: the summary of a saved run (its bench_prefix.json), "
                        "recomputed from its rows")
    parser.add_argument("--presets", action="store_true", help="no timing: the expected saving of the paper's presets "
                        "(a)-(d), from their prompt lengths and completion lengths (`preset_savings`)")
    args = parser.parse_args(argv)
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not args.modes or any(mode not in MODES for mode in args.modes):
        raise ValueError(f"--modes: a comma list of {', '.join(MODES)}, got {','.join(args.modes)!r}")
    args.completion_tokens = args.completion_tokens or (4 if args.tiny else 32)
    if args.repeats < 1 or args.completion_tokens < 1:
        raise ValueError("--repeats and --completion-tokens must be >= 1")
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    return args


def demo_trainer(args, mode):
    """The demo preset's flags as train.py resolves them, with --prefix-sharing for `mode`."""
    return config.parse_args(["--preset", "demo", "--device", "cpu", "--eval-samples", "0", "--seed", str(args.seed),
                              "--max-completion-tokens", str(args.completion_tokens),
                              "--prefix-sharing", "off" if mode == "off" else "on"])


def demo_prompts(tokenizer, count, trainer):
    """`count` of the demo's training prompts, tokenized as sampling.generate_rollouts does: [count, Tp], mask."""
    examples = data.build_prompt_set(trainer.dataset, "train", tokenizer, num_rows=max(count, 8), seed=trainer.seed,
                                     one_shot=trainer.one_shot, system_prompt=trainer.system_prompt)[:count]
    encoded = tokenizer([e.text for e in examples], padding=True, padding_side="left", add_special_tokens=False,
                        return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


def kept_batch(prompt_ids, prompt_mask, rows_per_prompt, completion_tokens, vocab_size, seed):
    """An UpdateBatch of rows_per_prompt full-length random completions of each prompt, in prompt order."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.arange(len(prompt_ids)).repeat_interleave(rows_per_prompt)
    completion_ids = torch.randint(3, vocab_size, (len(rows), completion_tokens), generator=generator)
    return update.UpdateBatch(prompt_ids[rows], prompt_mask[rows], completion_ids, torch.ones_like(completion_ids),
                              torch.randn(len(rows), generator=generator), torch.ones(len(rows), dtype=torch.bool))


@contextlib.contextmanager
def groups_only(mode):
    """Mode "groups": prefix.completion_logprobs without the prefix level (neither a micro-batch's nor the step's),
    for this block (benchmark-only)."""
    real, real_step = prefix.completion_logprobs, update._step_prefix
    if mode == "groups":
        prefix.completion_logprobs = functools.partial(real, shared_prefix=False)
        update._step_prefix = lambda *args: None
    try:
        yield
    finally:
        prefix.completion_logprobs, update._step_prefix = real, real_step


@contextlib.contextmanager
def counted_tokens(model):
    """A list that collects the number of tokens each forward pass of `model` takes in, for the block."""
    tokens = []
    hook = policy.hf_model(model).get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: tokens.append(inputs[0].numel()))
    try:
        yield tokens
    finally:
        hook.remove()


def timed_update(model, weights, batch_of, trainer, mode):
    """fill_logprobs + update_policy (the demo's optimizer) from `weights` in `mode` -> (wall seconds, CPU seconds of
    this process, loss, tokens)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in weights:
                parameter.copy_(weights[name])
    optimizer = update.make_optimizer(model, trainer.learning_rate, trainer.weight_decay, trainer.optimizer)
    settings = config.update_settings(trainer)
    batches = [batch_of()]
    with groups_only(mode), counted_tokens(model) as tokens:
        def run():
            update.fill_logprobs(model, batches, settings)
            return update.update_policy(model, optimizer, batches, settings)
        cpu_start = time.process_time()
        metrics, seconds = common.timed(run, torch.device("cpu"))
    return seconds, time.process_time() - cpu_start, metrics.loss, sum(tokens)


def update_part(args, model, tokenizer):
    """The update with prefix sharing off / groups / on, every shape, modes interleaved -> {rows, ratios}."""
    shapes = TINY_SHAPES if args.tiny else SHAPES
    trainers = {mode: demo_trainer(args, mode) for mode in args.modes}
    prompt_ids, prompt_mask = demo_prompts(tokenizer, max(p for p, _ in shapes.values()), trainers[args.modes[0]])
    lengths = prompt_mask.sum(1)
    shared = prefix.common_prefix_length(prompt_ids, prompt_mask)
    print(f"## update: prompts of {int(lengths.min())}-{int(lengths.max())} tokens, {shared} shared by all; "
          f"completions {args.completion_tokens} tokens; micro-batches of {trainers[args.modes[0]].micro_batch_size}")
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    vocab_size = policy.hf_model(model).config.vocab_size
    rows = []
    print_header(COLUMNS)
    for repeat in range(args.repeats + 1):   # repeat 0: warm-up, not counted
        for shape, (count, per_prompt) in shapes.items():
            batch_of = functools.partial(kept_batch, prompt_ids[:count], prompt_mask[:count], per_prompt,
                                         args.completion_tokens, vocab_size, args.seed)
            for mode in args.modes:
                seconds, cpu_s, loss, tokens = timed_update(model, weights, batch_of, trainers[mode], mode)
                rows.append({"shape": shape, "mode": mode, "repeat": repeat, "rows": count * per_prompt,
                             "tokens": tokens, "update_s": seconds, "cpu_s": cpu_s, "loss": loss})
                print_row(rows[-1], COLUMNS)
    return {**update_summary(rows, shapes, args.modes, args.tiny), "rows": rows, "shared_prefix_tokens": shared}


def update_summary(rows, shapes, modes, tiny=False):
    """The medians and ratios of the timed rows (repeat > 0) per shape, printed and returned: {ratios, cpu_ratios};
    from a saved run too (`--from-json`)."""
    ratios, cpu_ratios = {}, {}
    for shape in shapes:
        def median(key, mode):
            return statistics.median(row[key] for row in rows
                                     if row["shape"] == shape and row["mode"] == mode and row["repeat"] > 0)
        timed = {mode: median("update_s", mode) for mode in modes}
        losses = [row["loss"] for row in rows if row["shape"] == shape]
        agree = max(losses) - min(losses) <= 1e-4 * max(1.0, max(abs(loss) for loss in losses))
        line = [f"{shape}: median update " + ", ".join(f"{mode} {value:.2f} s" for mode, value in timed.items())]
        if "off" in timed:
            ratios[shape] = {mode: timed[mode] / timed["off"] for mode in timed if mode != "off"}
            cpu_ratios[shape] = {mode: median("cpu_s", mode) / median("cpu_s", "off") for mode in ratios[shape]}
            line += [f"{mode}/off {ratio:.2f}x (CPU time {cpu_ratios[shape][mode]:.2f}x)"
                     for mode, ratio in ratios[shape].items()]
            if "on" in ratios[shape]:
                verdict = common.verdict(ratios[shape]["on"] <= TARGETS[shape])
                line.append(f"target on/off <= {TARGETS[shape]}x: {verdict}"
                            + (" (tiny model: the code path only)" if tiny else ""))
        line.append(f"losses agree: {common.verdict(agree)}")
        print("; ".join(line))
    return {"ratios": ratios, "cpu_ratios": cpu_ratios}


def demo_policy(args):
    """The demo's policy as train.py loads it (LoRA r=16, alpha 32, fp32 on CPU), or a 2-layer random one (--tiny)."""
    trainer = demo_trainer(args, "on")
    torch.manual_seed(args.seed)
    if args.tiny:
        return models.prepare_for_training(models.tiny_random_model("llama", seed=args.seed),
                                           **{k: v for k, v in config.model_options(trainer).items()
                                              if k != "load_in_4bit"}).train()
    return models.load_policy(trainer.model, dtype=torch.float32, device="cpu", **config.model_options(trainer)).train()


PRESET_COMPLETION_TOKENS = (128, 256, 512)  # completion lengths of the table (the presets allow 512)


def common_prefix(rows):
    """The number of leading tokens every row of `rows` (lists of token ids) shares."""
    length = min(map(len, rows))
    for index in range(length):
        if len({row[index] for row in rows}) > 1:
            return index
    return length


def preset_savings(tokenizer, presets="abcd", num_prompts=64):
    """Rows: for each paper preset, what prefix sharing saves, from token counts alone (no model, no GPU): the
    preset's training prompts (its dataset, system prompt and template, rendered by `tokenizer`) give the mean prompt
    length P and the prefix L all of them share; a step trains m rows of each prompt (prompts_per_step of them), so
    the update computes m (P + C) tokens per prompt in full and P + m C with each distinct prompt once (the shared
    prefix across prompts too, when a step has several); a held-out evaluation of N prompts prefills N P tokens in
    full and L + N (P - L) with the shared prefix. C: completion lengths of PRESET_COMPLETION_TOKENS."""
    rows = []
    for name in presets:
        preset = config.PRESETS[name]
        examples = data.build_prompt_set(preset["dataset"], "train", tokenizer, num_rows=num_prompts, seed=0,
                                         one_shot=preset["one_shot"],
                                         max_prompt_tokens=preset["max_prompt_tokens"],
                                         **({"system_prompt": preset["system_prompt"]} if "system_prompt" in preset
                                            else {}))
        ids = [tokenizer(example.text, add_special_tokens=False)["input_ids"] for example in examples]
        p_mean, shared = sum(map(len, ids)) / len(ids), common_prefix(ids)
        m, prompts = preset["update_size"], preset["prompts_per_step"]
        row = {"preset": name, "dataset": preset["dataset"], "m": m, "prompts_per_step": prompts,
               "prompt_tokens": round(p_mean, 1), "shared_prefix_tokens": shared,
               "eval_prefill_on_off": round((shared / preset["eval_samples"] + p_mean - shared) / p_mean, 3)}
        for c in PRESET_COMPLETION_TOKENS:
            distinct = (shared + prompts * (p_mean - shared)) / prompts if prompts > 1 else p_mean
            row[f"update_on_off_C{c}"] = round((distinct + m * c) / (m * (p_mean + c)), 3)
        rows.append(row)
    return rows


def bench_prefix(argv):
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        modes, tiny = saved["args"]["modes"], saved["args"]["tiny"]
        print(f"# bench prefix, from {args.from_json}: {len(saved['update']['rows'])} timed rows, modes "
              f"{', '.join(modes)}, {saved['args']['num_threads'] or 'default'} threads")
        return update_summary(saved["update"]["rows"], TINY_SHAPES if tiny else SHAPES, modes, tiny)
    tokenizer = models.load_tokenizer(models.SMOLLM2_ALIAS)
    if args.presets:
        rows = preset_savings(tokenizer)
        print("# bench prefix --presets: tokens computed with prefix sharing / without, the paper's presets (prompts "
              "rendered with the SmolLM2 tokenizer and chat template, a stand-in for Qwen2.5's and Llama 3.2's)")
        print_header(list(rows[0]))
        for row in rows:
            print_row(row, list(row))
        common.save_json(args.out_dir, "prefix_presets", {"rows": rows})
        return {"presets": rows}
    model = demo_policy(args)
    print(f"# bench prefix: {'tiny random llama' if args.tiny else 'SmolLM2-135M'} + LoRA r=16, fp32, CPU, "
          f"{torch.get_num_threads()} threads; modes {', '.join(args.modes)} interleaved, {args.repeats} repeats "
          "after a warm-up (shared machines: read the ratios of one run)")
    result = {"args": {k: v for k, v in vars(args).items()}, "update": update_part(args, model, tokenizer)}
    common.save_json(args.out_dir, "prefix", result)
    return result

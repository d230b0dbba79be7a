"""Held-out evaluation: answer, format and joint accuracy of sampled completions.

Paper §4 / Appendix A.2-A.4: test accuracy is measured by sampling completions at temperature 0.9 and
averaging over 5 repeats; the reported curves are accuracy against wall-clock training time. evaluate()
is the measurement (train.py calls it for its periodic held-out accuracy); the command line evaluates one
checkpoint, every checkpoint of a run, or a base model, and writes the results as JSON.

Simplifications: one device; a completion is graded on its text alone (rewards.accuracy_rewards /
format_rewards, batched), so "both" means answer-correct *and* well-formatted; a prompt ending in the
"<think>\n" prefill has it put back in front of the completion before grading (rewards.graded_completion).
Temperature 0 means greedy decoding: all samples of a prompt would be identical, so K and R collapse to 1
(said in one line). Prompts come from data.build_prompt_set with the run's settings (config.json), and the run
folder is read through checkpoint.py. By default a checkpoint is evaluated as its run evaluated its policy (its
held-out sample, temperature and batch, one repeat: about one of its evaluations' time per checkpoint); the
paper's protocol is --repeats 5 --temperature 0.9. Each (dataset, split, template) has its results file.

    python eval.py --checkpoint runs/demo                  # every checkpoint of a run -> runs/demo/eval_test.json
    python eval.py --checkpoint runs/demo/checkpoints/step_000020 --repeats 5 --temperature 0.9 --out paper.json
    python eval.py --checkpoint runs/pens --eval-dataset other.csv --question-field q --answer-field a
                                                           # every row of a second file -> eval_other_all.json
    python eval.py --model smollm2-135m-offline --dataset arithmetic --out base.json
    python eval.py --preset demo                           # the demo's base model, as a demo run evaluates its policy

A checkpoint written by several processes (dcp/) is evaluated with `python -m multigpu eval` and the same flags.

    python eval.py rollouts runs/demo --step 5 --prompt 0   # one prompt's logged rollouts: what PODS kept
    python eval.py rollouts runs/demo --eval                # the newest evaluation's logged completions
"""

import json
import math
import re
import sys
import time
import warnings
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lazy import lazy_module
from run import cpu_memory, threads

CPU_AT_START = threads.sample()  # the other work the imports run beside: the thread count is chosen from it

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): --help and the flags need none


@dataclass
class EvalResult:
    accuracy: float               # fraction of samples whose final answer is correct
    format_accuracy: float        # fraction with the <think>...</think><answer>...</answer> format
    both_accuracy: float          # correct and well-formatted
    mean_completion_length: float  # tokens, up to and including the first EOS
    num_samples: int
    elapsed_s: float
    grader_timeouts: int = 0      # samples scored incorrect because their answer comparison timed out twice


def _check_args(prompts, answers, samples_per_prompt, repeats, temperature):
    if len(prompts) == 0:
        raise ValueError("evaluate: no prompts given")
    if len(prompts) != len(answers):
        raise ValueError(f"evaluate: {len(prompts)} prompts but {len(answers)} answers")
    if samples_per_prompt < 1 or repeats < 1:
        raise ValueError(f"evaluate: samples_per_prompt ({samples_per_prompt}) and repeats ({repeats}) must be >= 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"evaluate: temperature must be >= 0 (0 = greedy), got {temperature}")


def evaluate_repeats(model, tokenizer, prompts, answers, settings, *, samples_per_prompt=1, repeats=1, seed=0,
                     progress=False, samples_out=None, check_sampler=True, answer_kind=None, reward_report=None):
    """One EvalResult per repeat (the command line reports their mean and std; evaluate() pools them). settings:
    sampling.GenerationSettings (train.py passes its run's, so held-out evaluation reuses its decode graphs).
    samples_out: a list that receives every graded completion of the first repeat ({prompt, answer, completion,
    correct, formatted}, in prompt order). check_sampler: score the first chunk's tokens with the model itself (the
    sampler check, one extra forward pass); train.py turns it off once its own training steps check every step.
    reward_report: a RewardReport that scores every completion with the run's reward functions of one's own
    (each sample of samples_out gets their values, "rewards").

    Prompts are generated in chunks of rollout_batch_size // K prompts (K samples each, so about rollout_batch_size
    rows per generate call). Chunk c of repeat r uses seed + 100_003 * r + c, so results do not depend on
    `progress` and a repeat is reproducible on its own."""
    import rewards
    import sampling

    temperature, batch_size = settings.temperature, settings.rollout_batch_size
    _check_args(prompts, answers, samples_per_prompt, repeats, temperature)
    sampling.check_settings(settings)
    if temperature == 0 and (samples_per_prompt > 1 or repeats > 1):
        warnings.warn("temperature 0 is greedy decoding: every sample would be identical, so "
                      f"samples_per_prompt={samples_per_prompt} and repeats={repeats} are reduced to 1")
        samples_per_prompt = repeats = 1
    prompts_per_chunk = max(1, batch_size // samples_per_prompt)
    chunk_starts = range(0, len(prompts), prompts_per_chunk)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=repeats * len(prompts) * samples_per_prompt, desc="eval", unit="sample")
    results = []
    for repeat in range(repeats):
        start_time = time.perf_counter()
        correct, formatted, both, total_tokens, count, timed_out = 0, 0, 0, 0, 0, 0
        for chunk_index, start in enumerate(chunk_starts):
            chunk_prompts = list(prompts[start:start + prompts_per_chunk])
            chunk_seed = seed + 100_003 * repeat + chunk_index
            rollouts = sampling.generate_rollouts(model, tokenizer, chunk_prompts, samples_per_prompt, settings,
                                                  seed=chunk_seed)
            # The guard of train.py without an update pass: the first chunk's tokens scored by the model itself;
            # a gap no correct sampler reaches falls back to HF generate() (sampling.after_gap) and redoes it.
            if check_sampler and repeat == chunk_index == 0 and rollouts.backend != "hf" and sampling.after_gap(
                    model, measure_sampler_gap(model, rollouts, temperature, prefix_sharing=settings.prefix_sharing),
                    rollouts.backend, settings.backend, "evaluation"):
                rollouts = sampling.generate_rollouts(model, tokenizer, chunk_prompts, samples_per_prompt, settings,
                                                      seed=chunk_seed)
            rows = [start + row // samples_per_prompt for row in range(len(rollouts.texts))]  # row i*K+j
            # A prompt that ends in the think prefill (data.render_prompts(prefill_think=True)) made the
            # model's output start after "<think>\n": grade prefill + generated text.
            texts = [rewards.graded_completion(text, prompts[i].endswith(rewards.THINK_PREFILL))
                     for i, text in zip(rows, rollouts.texts)]
            with rewards.timeouts_counted() as timeouts:
                is_correct = rewards.accuracy_rewards(None, texts, [answers[i] for i in rows],
                                                      answer_kind=answer_kind)  # --answer-kind, as in training
            timed_out += len(timeouts.positions)
            is_formatted = rewards.format_rewards(None, texts)
            own = reward_report(rows, rollouts.texts, [ids[:n] for ids, n in zip(rollouts.completion_ids.tolist(),
                                rollouts.lengths.tolist())], repeat).per_func if reward_report else {}
            if samples_out is not None and repeat == 0:
                samples_out.extend({"prompt": prompts[i], "answer": answers[i], "completion": text, "correct": a > 0,
                                    "formatted": f > 0, **({"rewards": {name: None if math.isnan(values[k]) else
                                                                        float(values[k]) for name, values in own.items()}}
                                                           if own else {})}
                                   for k, (i, text, a, f) in enumerate(zip(rows, texts, is_correct, is_formatted)))
            correct += sum(a > 0 for a in is_correct)
            formatted += sum(f > 0 for f in is_formatted)
            both += sum(a > 0 and f > 0 for a, f in zip(is_correct, is_formatted))
            total_tokens += int(rollouts.lengths.sum())
            count += len(rollouts.texts)
            if bar is not None:
                bar.update(len(rollouts.texts))
        results.append(EvalResult(correct / count, formatted / count, both / count, total_tokens / count,
                                  count, time.perf_counter() - start_time, timed_out))
    if bar is not None:
        bar.close()
    return results


def measure_sampler_gap(model, rollouts, temperature, micro_batch_size=8, prefix_sharing=True, rows_checked=8):
    """The policy.SamplerGap of `rollouts` against `model` (one no-grad forward pass, micro-batched):
    the sampler check of evaluation, which has no update pass to read the trainer's log-probs from. Greedy rollouts
    are compared at temperature 1, as the sampler records them. rows_checked: that many rows spread evenly over the
    chunk, its first and last included (None: every row): a faulty sampler moves the mean gap of any row, and the
    demo's first evaluation checks 8 of its 64 rows, an eighth of the ~4 s all of them took on 2 cores.
    prefix_sharing: each distinct prompt and the prefix the rows share computed once (prefix.py, as in the update;
    its own code, not the sampler's, so a fault of the sampler's shared prefix still shows)."""
    import policy
    from engine import prefix

    device, gap = next(model.parameters()).device, policy.SamplerGap()
    count = len(rollouts.prompt_index)
    picked = torch.arange(count) if rows_checked is None or rows_checked >= count else \
        torch.linspace(0, count - 1, rows_checked).round().long().unique()
    with torch.no_grad(), policy.dropout_off(model):
        logprobs = prefix.logprobs_function(model, prefix_sharing)
        for start in range(0, len(picked), micro_batch_size):
            part = picked[start:start + micro_batch_size]
            own = rollouts.prompt_index[part]   # the rows' prompts
            mask = rollouts.completion_mask[part]
            width = max(1, int(mask.sum(1).max()))
            ids = torch.cat([rollouts.prompt_ids[own], rollouts.completion_ids[part, :width]], 1)
            attention = torch.cat([rollouts.prompt_mask[own], mask[:, :width]], 1)
            trainer = logprobs(model, ids.to(device), attention.to(device), width,
                               temperature if temperature > 0 else 1.0)
            gap = gap + policy.SamplerGap.of(trainer, rollouts.sampler_logprobs[part, :width],
                                             mask[:, :width].to(device))
    return gap


def evaluate(model, tokenizer, prompts, answers, settings, *, samples_per_prompt=1, repeats=1, seed=0,
             progress=False, samples_out=None, check_sampler=True, answer_kind=None):
    """Accuracy over all prompts x samples x repeats (repeats have equal size, so this is their mean)."""
    return _pool(evaluate_repeats(model, tokenizer, prompts, answers, settings, samples_per_prompt=samples_per_prompt,
                                  repeats=repeats, seed=seed, progress=progress, samples_out=samples_out,
                                  check_sampler=check_sampler, answer_kind=answer_kind))


def _pool(per_repeat):
    mean = lambda name: sum(getattr(r, name) for r in per_repeat) / len(per_repeat)  # noqa: E731
    return EvalResult(mean("accuracy"), mean("format_accuracy"), mean("both_accuracy"),
                      mean("mean_completion_length"), sum(r.num_samples for r in per_repeat),
                      sum(r.elapsed_s for r in per_repeat), sum(r.grader_timeouts for r in per_repeat))


def mean_and_std(values):
    """(mean, sample std) of repeats' values (std 0 for one; (None, 0.0) for none)."""
    mean = sum(values) / len(values) if values else None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def summarize_repeats(per_repeat):
    """{metric: {"mean", "std", "per_repeat"}} for the results file; std is the sample std (0 for R=1)."""
    summary = {}
    for name in ("accuracy", "format_accuracy", "both_accuracy", "mean_completion_length"):
        values = [getattr(r, name) for r in per_repeat]
        mean, std = mean_and_std(values)
        summary[name] = {"mean": mean, "std": std, "per_repeat": values}
    summary["num_samples"] = sum(r.num_samples for r in per_repeat)
    summary["grader_timeouts"] = sum(r.grader_timeouts for r in per_repeat)  # scored incorrect, unverified
    summary["eval_s"] = sum(r.elapsed_s for r in per_repeat)
    return summary


# ---------------------------------------------------------------- command line: which model(s) to evaluate

def load_results(path, eval_config):
    """Existing results keyed by checkpoint name; refuses to mix results measured under other settings: other rows
    (dataset, fields, template, held-out part, a data file's SHA-256), prompts or sampling."""
    from compare import read_json_object

    if not path.is_file():
        return {"config": eval_config, "results": {}}
    saved = read_json_object(path)
    config = saved.get("config", {})
    if "max_new_tokens" in config:  # files written before max_completion_tokens was the one key
        config.setdefault("max_completion_tokens", config.pop("max_new_tokens"))
    if config != eval_config:
        differing = sorted(k for k in set(eval_config) | set(config) if config.get(k) != eval_config.get(k))
        older = " (not recorded by the eval.py that wrote it)" if set(eval_config) - set(config) else ""
        raise ValueError(f"{path} holds results measured with other settings ({', '.join(differing)}){older}; "
                         "pass --out with a new file name")
    return saved


def load_adapter(base, folder, base_name):
    """The LoRA adapter in `folder` on `base` (the model named base_name); an adapter of another model is one
    ValueError line naming both, not peft's list of size mismatches."""
    import models

    with models.quiet_peft():
        from peft import PeftModel

        try:
            return PeftModel.from_pretrained(base, str(folder))
        except RuntimeError as error:
            if "size mismatch" not in str(error):
                raise
    try:
        trained = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        trained = None
    raise ValueError(f"--checkpoint {folder.parent}: its adapter does not fit {base_name} (its layers' shapes differ)"
                     f"{f'; it was trained on {trained}' if trained else ''}: give --base-model the model the run "
                     "trained, or check the run's config.json") from None


def build_parser():
    """eval.py's flags (docs/evaluation.md's table names each)."""
    from run import config
    import data

    parser = config.OneLineParser(prog="eval.py", description=__doc__.split("\n\n")[0],
                                  epilog="A training run's logged rollouts: python eval.py rollouts RUN [--step S] "
                                         "[--prompt I] [--eval] (python eval.py rollouts --help).")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--checkpoint", help="a checkpoint dir (adapter/ + config.json) or a run dir: "
                                            "evaluates every checkpoint in <run>/checkpoints/")
    where.add_argument("--model", help="a base model (Hub id, folder, GGUF or smollm2-135m-offline), no adapter")
    parser.add_argument("--preset", choices=sorted(config.PRESETS),
                        help="evaluate --model (default: the preset's) as a run of this train.py preset evaluates its "
                             "policy: its prompts, held-out sample, temperature, lengths, batch and dtype")
    parser.add_argument("--base-model", help="override the base model named in the checkpoint's config.json")
    parser.add_argument("--dataset", help=f"a registered dataset ({', '.join(data.DATASETS)}), a .jsonl / .csv / "
                        ".parquet file or a Hub id (default: the run's, config.json, with its fields, template and "
                        "held-out rows; else gsm8k)")
    parser.add_argument("--question-field", help="your own rows' question column (default: the run's, else question)")
    parser.add_argument("--answer-field", help="your own rows' answer column (default: the run's, else answer)")
    parser.add_argument("--prompt-template", help="the user turn, a text or a file, {question} and any column "
                        "(default: the run's)")
    parser.add_argument("--eval-dataset", help="every row of this file or Hub id's test split, results in "
                        "eval_<name>_all.json (default: the run's held-out rows)")
    parser.add_argument("--eval-fraction", type=float, help="the fraction of --dataset held out (default: the run's)")
    parser.add_argument("--answer-kind", choices=data.ANSWER_KINDS, help="default: the run's, else told by the answer")
    parser.add_argument("--data-dir", help="folder with the dataset files (default: the run's, else "
                                           "$PODS_DATA_DIR or ../shared/data, else the Hugging Face Hub)")
    parser.add_argument("--split", default="test", choices=("train", "test"))
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="default: the run's held-out sample (its --eval-samples), else the whole split")
    parser.add_argument("--samples-per-prompt", "-k", type=int, default=1)
    parser.add_argument("--repeats", "-r", type=int, default=1, help="the authors used 5 (at temperature 0.9)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="default: the run's --eval-temperature, else 0.9 (the authors'); 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-completion-tokens", "--max-new-tokens", type=int, default=None,
                        help="default: the run's, else 256")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows (prompts x samples) per generate call (default: the run's --rollout-batch-size, "
                             "else 64)")
    parser.add_argument("--backend", choices=("engine", "hf"), help="as train.py's: engine (no fallback) or hf; "
                        "default: the decode engine, falling back to generate() when it fails or samples off-policy")
    parser.add_argument("--prefix-sharing", choices=("on", "off"), default="on",
                        help="compute the tokens every prompt of a generation call starts with once (on, the default: "
                             "the same completions, log-probs equal to rounding) or once per prompt (off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: the model's own")
    parser.add_argument("--out", help="results JSON (default: <run>/eval_<split>.json for the run's held-out rows, "
                        "eval_<dataset>[-<template>]_<split>.json for others; without --checkpoint in this folder)")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="torch CPU threads; 0 = as many as other work leaves free at the start, at most one per core")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def parse_args(argv):
    from run import config
    import models

    parser = build_parser()
    args = parser.parse_args(argv)  # --help, a mistyped flag or value: answered before torch loads (the device)
    if args.preset and args.checkpoint:
        parser.error("--preset is for --model: a checkpoint is evaluated with its own run's settings (config.json)")
    if args.preset:  # the preset's model; its evaluation settings as a run's (run_settings); flags given still win
        preset = config.PRESETS[args.preset]
        parser.set_defaults(model=preset["model"])
        args = parser.parse_args(argv)
    if not (args.checkpoint or args.model):
        parser.error("one of the arguments --checkpoint --model --preset is required")
    problem = flag_problem(args)
    if problem:
        parser.error(problem)
    args.device = args.device or models.default_device()
    if args.preset and args.dtype is None:  # the dtype the preset's policy generates in
        bf16 = config.resolved_bf16(preset.get("bf16", False), args.device)
        args.dtype = str(models.compute_dtypes(bf16, preset.get("lora_rank", 0))[0]).removeprefix("torch.")
    return args


def flag_problem(args):
    """The one line naming the first flag whose value cannot be evaluated with, or None."""
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-completion-tokens", args.max_completion_tokens),
                        ("--samples-per-prompt", args.samples_per_prompt), ("--repeats", args.repeats),
                        ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.num_threads < 0:
        return f"--num-threads must be >= 0 (0 = what the machine has free), got {args.num_threads}"
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        return f"--temperature must be >= 0 (0 = greedy), got {args.temperature}"
    if args.eval_fraction is not None and not 0 < args.eval_fraction < 1:
        return f"--eval-fraction must be in (0, 1), got {args.eval_fraction:g}"
    if not 0 < args.top_p <= 1:
        return f"--top-p must be in (0, 1], got {args.top_p}"
    import data

    if args.dataset and args.dataset not in data.DATASET_READERS and data.own_kind(args.dataset) is None:
        return (f"--dataset {args.dataset!r}: not a registered dataset ({', '.join(data.DATASETS)}), a .jsonl / .csv "
                "/ .parquet file or a Hub id (owner/name)")
    if args.eval_dataset and data.own_kind(args.eval_dataset) is None:
        return f"--eval-dataset {args.eval_dataset!r}: expected a .jsonl / .csv / .parquet file or a Hub id"
    return None


def run_settings(args, checkpoints):
    """Model and prompt settings: explicit flags, else the run's config.json (or the --preset's values), else
    defaults (those of train.py, so the prompts are rendered exactly as in training). Sizes not given are the run's
    held-out evaluation's (--num-prompts: its eval_samples, --temperature: its eval_temperature, --batch-size: its
    rollout_batch_size): a checkpoint is evaluated as its run evaluated it, in about the time of one of its
    evaluations. Another dataset (--dataset), or every row of a file (--eval-dataset), gets its own results file
    (`results_name`); a file the run trained on must be as it was then."""
    from run import checkpoint
    from run import config
    import data

    run_config = checkpoint.read_run_config(checkpoints[0]) if checkpoints else config.PRESETS.get(args.preset, {})
    run_source = data.DataSource(
        run_config.get("dataset") or "gsm8k", run_config.get("question_field") or "question",
        run_config.get("answer_field") or "answer", data.read_template(run_config.get("prompt_template")),
        run_config.get("eval_dataset"), run_config.get("eval_fraction"), run_config.get("answer_kind"),
        run_config.get("split_rule", data.RANKED_SPLIT if checkpoints else data.SPLIT_RULE))
    run_source = dataclasses.replace(run_source, answer_kind=data.answer_kind_of(run_source))
    whole_file = args.eval_dataset is not None and args.eval_dataset != run_source.eval_dataset
    if whole_file and args.split != "test":
        raise ValueError("--eval-dataset evaluates every row of its file: leave out --split")
    dataset = args.eval_dataset if whole_file else args.dataset or run_source.dataset
    runs_rows = not whole_file and (dataset == run_source.dataset or (  # the run's own rows, split as it split them
        data.own_kind(dataset) == "file" and Path(dataset).resolve() == Path(run_source.dataset).resolve()))
    dataset = run_source.dataset if runs_rows else dataset
    template = data.read_template(args.prompt_template) if args.prompt_template is not None else \
        run_source.prompt_template
    if template is not None:
        reader = data.DATASET_READERS.get(dataset)
        data.check_template(template, reader and reader.columns, dataset)
    source = data.DataSource(
        dataset, args.question_field or run_source.question_field, args.answer_field or run_source.answer_field,
        template, args.eval_dataset if whole_file else run_source.eval_dataset if runs_rows else None,
        args.eval_fraction if args.eval_fraction is not None else run_source.eval_fraction if runs_rows else None,
        args.answer_kind or run_source.answer_kind, run_source.split_rule if runs_rows else data.SPLIT_RULE)
    source = dataclasses.replace(source, answer_kind=data.answer_kind_of(source))
    if checkpoints:
        check_trained_files(run_config, source)
    own = source == run_source
    settings = {"model": args.model or args.base_model or run_config.get("model"), "dataset": dataset,
                "source": source, "split": "all" if whole_file else args.split,
                "name": results_name(source, "all" if whole_file else args.split, own), "own": own,
                "data_dir": args.data_dir or run_config.get("data_dir"),
                "one_shot": bool(run_config.get("one_shot", False)) and dataset in data.DATASET_READERS,
                "system_prompt": data.system_prompt_of(run_config.get("system_prompt")),
                "prefill_think": bool(run_config.get("prefill_think", False)),
                "max_completion_tokens": args.max_completion_tokens or run_config.get("max_completion_tokens") or 256}
    if not settings["model"]:
        raise ValueError("the checkpoint's config.json names no base model: pass --base-model")
    if args.num_prompts is None and runs_rows:  # the run's held-out sample (none evaluated: the whole split)
        args.num_prompts = run_config.get("eval_samples") or None
    if args.temperature is None:
        args.temperature = 0.9 if run_config.get("eval_temperature") is None else run_config["eval_temperature"]
    if args.batch_size is None:
        args.batch_size = run_config.get("rollout_batch_size") or 64
    return settings


class RewardReport:
    """The reward report: the functions of one's own of `settings` (rewards.RewardSettings.functions) on held-out
    completions of `examples` (data.Examples), called as in training (rewards.score_texts); their mean over the
    completions each applies to, per repeat, and the mean of what they gave log_metric."""

    def __init__(self, examples, settings):
        self.examples, self.settings = examples, settings
        self.sums, self.logged = {}, {}  # repeat -> name -> [sum, count]; metric -> [values]

    def __call__(self, rows, texts, completion_ids, repeat=0):
        """Completion texts[k] (ungraded, as generated) of examples[rows[k]] scored; counted into `repeat`."""
        import rewards

        result = rewards.score_texts(self.examples, rows, texts, completion_ids, self.settings, registered=False)
        for name, values in result.per_func.items():
            applied = values[~values.isnan()]
            total = self.sums.setdefault(repeat, {}).setdefault(name, [0.0, 0])
            total[0], total[1] = total[0] + float(applied.sum()), total[1] + len(applied)
        for _, name, value in result.logged_metrics:
            self.logged.setdefault(name, []).append(value)
        return result

    def summary(self):
        """{"rewards": {name: {"mean", "std", "per_repeat"}}, "logged_metrics": {name: mean}} (None: no completion
        the function applies to); std is the sample std over repeats (0 for one)."""
        names = dict.fromkeys(name for repeat in self.sums.values() for name in repeat)
        report = {}
        for name in names:
            per_repeat = [total / count if count else None for total, count in
                          (self.sums[repeat].get(name, (0.0, 0)) for repeat in sorted(self.sums))]
            mean, std = mean_and_std([value for value in per_repeat if value is not None])
            report[name] = {"mean": mean, "std": std, "per_repeat": per_repeat}
        return {"rewards": report, "logged_metrics": {name: sum(v) / len(v) for name, v in self.logged.items()}}


def reward_report(functions, examples, settings, run_config, progress):
    """The rewards.RewardReport of a checkpoint (progress: its step) for the run's reward functions of one's own,
    called as in training: the run's prefill and time limit, a TRL trainer_state at the checkpoint's step and the
    run's --max-steps; None without such functions."""
    import rewards
    from grading import trl_call

    if not functions:
        return None
    step = (progress or {}).get("step") or 0
    return RewardReport(examples, rewards.RewardSettings(
        prefill_think=settings["prefill_think"], functions=tuple(functions),
        function_timeout_s=run_config.get("reward_function_timeout_s", trl_call.DEFAULT_TIMEOUT_S),
        trainer_state=trl_call.trainer_state(step, 0.0, run_config.get("max_steps") or 0)))


def check_trained_files(run_config, source):
    """A file the run trained on (its config.json's data_files) that the evaluation reads must be as it was: its
    held-out rows, and the rows the run trained on, may differ otherwise (one ValueError line)."""
    import data

    reading = {str(Path(name).resolve()) for name in (source.dataset, source.eval_dataset)
               if name and data.own_kind(name) == "file"}
    for role, recorded in (run_config.get("data_files") or {}).items():
        if recorded["path"] in reading and data.file_sha256(recorded["path"]) != recorded["sha256"]:
            raise ValueError(f"{recorded['path']} changed since the run trained on it (its config.json records "
                             f"another SHA-256 for its {role}): its held-out rows may differ; restore the file, or "
                             "evaluate a copy of it under another name (its results go to a file of their own)")


def results_name(source, split, own):
    """The results file of an evaluation, one per (dataset, split, template): eval_<split>.json for the run's own
    held-out rows; else eval_<the file's stem or the Hub id's name>[-<template's SHA-256, 8 hex>]_<split>.json, the
    template's part for a template other than the question alone (split "all": every row of an --eval-dataset
    file). Its config records the rest (fields, files' SHA-256, sampling): a file measured otherwise is refused."""
    import hashlib

    import data

    if own:
        return f"eval_{split}.json"
    name = source.eval_dataset if split == "all" else source.dataset
    name = Path(name).stem if data.own_kind(name) == "file" else name.split("/")[-1]
    if source.prompt_template not in (None, "{question}"):
        name += "-" + hashlib.sha256(source.prompt_template.encode()).hexdigest()[:8]
    name = re.sub(r"[^\w.-]+", "-", name)
    return f"eval_{name}_{split}.json"


def show_rollouts(argv):
    """`python eval.py rollouts RUN`: print the completions log of a training step (one prompt's n rollouts sorted
    by reward, the kept ones marked with their advantages) or of an evaluation; returns the printed lines. A run
    that has logged no training step yet (train.py logs every --log-completions-interval steps) says so and shows
    its newest evaluation's completions, if any."""
    from run import checkpoint
    from run import completions
    from run import config

    parser = config.OneLineParser(prog="eval.py rollouts", description="Show a run's logged rollouts: one prompt's "
                                  "n rollouts sorted by reward, the kept ones marked with their advantages.")
    parser.add_argument("run", help="a run folder (train.py --output-dir)")
    parser.add_argument("--step", type=int, help="a logged step (default: the newest)")
    parser.add_argument("--prompt", type=int, default=0, help="which prompt of the step (0 = the first)")
    parser.add_argument("--eval", action="store_true", help="the evaluation's logged completions instead")
    parser.add_argument("--width", type=int, default=100, help="characters of each completion shown")
    args = parser.parse_args(argv)
    run = Path(args.run)
    if not (run / checkpoint.METRICS_FILE).is_file():
        raise ValueError(f"{args.run} is not a run folder (no {checkpoint.METRICS_FILE}): give the --output-dir of "
                         "a train.py run")
    if args.width < 10:
        raise ValueError(f"--width must be >= 10, got {args.width}")
    kind = "eval_step" if args.eval else "step"
    logged = sorted(completions.logged_files(run, kind))
    if args.step is not None and args.step not in logged:
        what = "evaluation completions" if args.eval else "training rollouts"
        raise ValueError(f"--step {args.step}: {args.run} has no {what} logged at that step; "
                         + (f"logged at steps {', '.join(map(str, logged))}" if logged else "none logged yet"))
    lines = []
    if not logged:
        interval = checkpoint.read_run_config(run).get("log_completions_interval") \
            if (run / "config.json").is_file() else None
        every = f"--log-completions-interval {interval}" if interval else "--log-completions-interval"
        evaluations = sorted(completions.logged_files(run, "eval_step"))
        if interval == 0 or args.eval or not evaluations:
            line = (f"{args.run}: no completions logged: the run has --log-completions-interval 0 (never)"
                    if interval == 0 else f"{args.run}: nothing logged yet (" + (
                        "each held-out evaluation logs a sample of its completions" if args.eval else
                        f"train.py logs a step's rollouts every {every} steps") + ")")
            print(line)
            return [line]
        lines.append(f"{args.run}: no training step's rollouts logged yet (train.py logs them every {every} "
                     "steps); its newest evaluation's completions instead:")
        kind, args.eval = "eval_step", True
    step, rows = completions.read_completions(run, args.step, kind)
    if not args.eval:
        count = sum(row["type"] == "prompt" for row in rows)
        if not 0 <= args.prompt < count:
            raise ValueError(f"--prompt {args.prompt}: step {step} has prompts 0-{count - 1}")
    lines += [f"{args.run}: {'evaluation at ' if args.eval else ''}step {step}"]
    lines += completions.eval_table(rows, args.width) if args.eval else \
        completions.rollout_table(rows, args.prompt, args.width)
    print("\n".join(lines))
    return lines


def main(argv=None, load_sharded=None):
    """The command line. load_sharded(path, base model, dtype, device) -> model: how a checkpoint written by several
    processes (dcp/) is read (`python -m multigpu eval` passes it); None: such a checkpoint is refused."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["rollouts"]:
        return show_rollouts(argv[1:])
    args = parse_args(argv)
    from run import checkpoint, config
    import data
    import models
    from run import runfolder
    import sampling

    if args.checkpoint and not Path(args.checkpoint).exists():
        raise ValueError(f"--checkpoint {args.checkpoint}: no such file or folder")
    try:
        checkpoints = checkpoint.find_checkpoints(args.checkpoint) if args.checkpoint else []
    except ValueError as error:
        raise ValueError(f"--checkpoint: {error}") from None
    problems = {path: runfolder.checkpoint_problem(path) for path in checkpoints}  # a file empty or cut short
    for path in [path for path in checkpoints if problems[path]]:
        print(f"skipping {path}: {problems[path]}", file=sys.stderr)
    checkpoints = [path for path in checkpoints if not problems[path]]
    if args.checkpoint and not checkpoints:
        raise ValueError(f"--checkpoint {args.checkpoint}: no readable checkpoint (each skipped one is named above)")
    sharded = [path for path in checkpoints if checkpoint.is_sharded(path)]
    if sharded and load_sharded is None:
        raise ValueError(f"{sharded[0]} was written by several processes (dcp/): evaluate it with "
                         "python -m multigpu eval and the same flags")
    settings = run_settings(args, checkpoints)
    data.check_data_source(settings["dataset"], settings["data_dir"], splits=(args.split,), source=settings["source"])
    if args.temperature == 0 and (args.samples_per_prompt > 1 or args.repeats > 1):  # said once, in one line
        print(f"eval.py: temperature 0 is greedy decoding: every sample would be the same, so --samples-per-prompt "
              f"{args.samples_per_prompt} and --repeats {args.repeats} are 1", file=sys.stderr)
        args.samples_per_prompt = args.repeats = 1
    try:
        models.check_model_source(settings["model"])  # a missing local model: one line, before anything loads
    except (ValueError, OSError) as error:
        named_by = "--model" if args.model else "--base-model" if args.base_model else \
            "the model named in the run's config.json (another: --base-model)"
        raise ValueError(f"{named_by}: {error}") from None
    name = settings["name"]  # one results file per dataset, split and template
    out_path = Path(args.out) if args.out else (
        checkpoint.run_dir_of(args.checkpoint) / name if args.checkpoint else Path(name))
    source = settings["source"]  # what decides the rows and their prompts, the files' SHA-256 included
    eval_config = {"model": settings["model"], "dataset": settings["dataset"], "split": settings["split"],
                   "num_prompts_requested": args.num_prompts, "samples_per_prompt": args.samples_per_prompt,
                   "repeats": args.repeats, "temperature": args.temperature, "top_p": args.top_p,
                   "max_completion_tokens": settings["max_completion_tokens"], "seed": args.seed,
                   "one_shot": settings["one_shot"], "prefill_think": settings["prefill_think"],
                   "system_prompt": settings["system_prompt"],
                   **{key: getattr(source, key) for key in ("question_field", "answer_field", "prompt_template",
                                                            "eval_dataset", "eval_fraction", "answer_kind",
                                                            "split_rule")},
                   "data_files": data.own_files(source)}
    run_config = checkpoint.read_run_config(checkpoints[0]) if checkpoints else {}
    # The reward report: the run's own functions, on the run's own rows (another file need not have their columns).
    own_functions, notes = config.recorded_reward_functions(run_config) if settings["own"] else ([], [])
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if own_functions:
        eval_config["reward_functions"] = {own.name: own.sha256 for own in own_functions}
    saved = load_results(out_path, eval_config)
    todo = [path for path in checkpoints if path.name not in saved["results"]]
    # Each checkpoint's step and training time, read first: a trainer_state.pt that is not plain data (it could run
    # code when unpickled) is refused before any model loads (checkpoint.load_state_file).
    progress = {path: checkpoint.checkpoint_progress(path) for path in todo}
    if checkpoints and not todo:
        print(f"all {len(checkpoints)} checkpoints already in {out_path}")
        return saved
    dtype = getattr(torch, args.dtype) if args.dtype else None
    threads.choose(args.num_threads, args.device, since=CPU_AT_START)  # 0: what the machine has free (run/threads.py)
    cpu_memory.keep_freed_memory(args.device)  # on a CPU a chunk reuses the pages the chunk before freed
    tokenizer = models.load_tokenizer(settings["model"])
    try:
        # seed 0: the fixed held-out sample train.py evaluates on (the sampling seed is separate).
        examples = data.build_prompt_set(settings["dataset"], "test" if settings["split"] == "all" else args.split,
                                         tokenizer, data_dir=settings["data_dir"],
                                         num_rows=args.num_prompts, seed=0, one_shot=settings["one_shot"],
                                         system_prompt=settings["system_prompt"],
                                         prefill_think=settings["prefill_think"], source=settings["source"])
    except data.HubUnavailable as error:  # the user's situation, one line (see __main__)
        raise ValueError(str(error)) from error
    prompts, answers = [e.text for e in examples], [e.answer for e in examples]
    longest = max(data.prompt_token_counts(prompts, tokenizer))
    base = None
    for path in todo or [None]:
        if path is not None and checkpoint.is_sharded(path):  # written under torchrun: LoRA merged, one process
            model = load_sharded(path, settings["model"], dtype or torch.float32, args.device)
        elif path is not None and (path / "model").is_dir():  # full fine-tuning checkpoint
            model = models.load_policy(str(path / "model"), dtype=dtype, device=args.device)
        else:
            base = base or models.load_policy(settings["model"], dtype=dtype, device=args.device)
            model = base
            if path is not None:
                model = load_adapter(base, path / "adapter", settings["model"])
        generation = sampling.GenerationSettings(settings["max_completion_tokens"], args.temperature, args.top_p,
                                                 args.batch_size, backend=args.backend,
                                                 prefix_sharing=args.prefix_sharing == "on")
        models.check_generation_fits(model, args.batch_size, longest + generation.max_new_tokens,
                                     f"--batch-size (now {args.batch_size}) or --max-completion-tokens (now "
                                     f"{generation.max_new_tokens})")
        report = reward_report(own_functions, examples, settings, run_config, progress.get(path))
        per_repeat = evaluate_repeats(model, tokenizer, prompts, answers, generation,
                                      samples_per_prompt=args.samples_per_prompt, repeats=args.repeats,
                                      seed=args.seed, progress=not args.no_progress,
                                      answer_kind=settings["source"].answer_kind, reward_report=report)
        name = path.name if path is not None else "base"
        entry = {"checkpoint": str(path) if path else settings["model"],
                 **progress.get(path, {"step": 0, "elapsed_s": 0.0}),
                 "num_prompts": len(prompts), **summarize_repeats(per_repeat), **(report.summary() if report else {})}
        saved["results"][name] = entry
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(saved, indent=1))  # after every checkpoint: a crash loses one at most
        spread = f" ± {entry['accuracy']['std']:.4f}" if len(per_repeat) > 1 else " (1 repeat: no spread)"
        print(f"{name}: accuracy {entry['accuracy']['mean']:.4f}{spread} "
              f"format {entry['format_accuracy']['mean']:.4f} both {entry['both_accuracy']['mean']:.4f} "
              f"length {entry['mean_completion_length']['mean']:.1f} ({entry['num_samples']} samples) -> {out_path}")
        if report:
            print("  rewards of the run's own functions: " + ", ".join(
                f"{name} {value['mean']:.4f}" if value["mean"] is not None else f"{name} (applies to none)"
                for name, value in entry["rewards"].items()))
        if model is not base:
            if hasattr(model, "unload"):
                base = model.unload()  # strip the LoRA layers: the plain base model for the next adapter
            del model
    return saved


if __name__ == "__main__":
    try:
        main()
    except Exception as error:
        import sampling  # imported here: --help and a mistyped flag are answered before torch loads

        if not isinstance(error, (ValueError, OSError, sampling.SamplerError)):  # flags, paths, data, the disk, no
            raise                                                                # fallback of the decode engine
        sys.exit(f"eval.py: error: {error}")

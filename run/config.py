"""What a training run is: the command-line flags grouped by concern over a preset (presets.py: the paper's
settings (a)-(f) and the CPU demo, and their GRPO baselines), and every check that can be made before a model or a
dataset is loaded.

Importing this module loads no torch (the registries it reads import it at first use, lazy.py), and `parse_args`
makes the checks that need none first: `--help`, a mistyped flag or a value out of range are answered in well under a
second; the checks of the device, the run folder, the data and the model source come after.

Precedence: flags > the resumed run's config.json > --baseline > your own rows' settings (presets.OWN_ROWS, with a
--dataset of your own) > the preset (`parse_args`); `value_sources` records which gave each value.

Simplification: the learning rate is constant (as in the authors' single-GPU config; their multi-GPU recipe
uses a cosine schedule with 10% warm-up).
"""

import argparse
import dataclasses
import importlib.util
import json
import math
import re
import sys
import time
import warnings
from pathlib import Path

import data
from grading import trl_call
import grpo_loss
import models
import pods
import rewards
from run.presets import BASELINES, PRESETS, own_rows_settings

# The choices of flags whose modules load torch: written here so that --help needs none of them (a test keeps each
# equal to its module's: sampling.BACKENDS, update.OPTIMIZERS, report.REPORT_TO, dynamic_sampling.METRICS).
BACKENDS = ("engine", "hf")
PRESET_KEYS = {key for preset in PRESETS.values() for key in preset}  # --help: their default is "from --preset"
OPTIMIZERS = ("adamw", "adamw8bit")
REPORT_TO = ("none", "tensorboard", "wandb")
DYNAMIC_SAMPLING_METRICS = ("total", "accuracy")
MAX_GENERATION_ROUNDS = 100  # --max-generation-rounds is refused above (DAPO's, verl's default: 10)
DEFAULT_REWARD_WEIGHTS = ",".join(f"{name}={weight:g}" for name, weight in rewards.DEFAULT_REWARD_WEIGHTS.items())
LOSS_FLAGS = [option for option in dataclasses.fields(grpo_loss.LossSettings) if option.metadata["help"]]


def _dest(option):
    """The argparse destination of a LossSettings field's flag, e.g. "loss_aggregation" for `aggregation`."""
    return grpo_loss.flag_name(option).removeprefix("--").replace("-", "_")


POSITIVE_INTS = ("num_rollouts", "update_size", "prompts_per_step", "grad_accum_steps", "updates_per_batch",
                 "max_completion_tokens", "max_prompt_tokens", "rollout_batch_size", "micro_batch_size",
                 "max_generation_rounds")
NON_NEGATIVE = ("max_steps", "max_time_s", "keep_checkpoints", "eval_interval", "eval_interval_s", "eval_samples",
                "eval_temperature", "num_threads", "weight_decay", "kl_coef", "lora_rank", "log_completions_interval",
                "reward_function_timeout_s")
# What a run IS: a resume that changes these is refused (compare.py would credit the earlier steps to the new method).
# Others may change: RECORDED_AT_RESUME (optimizer settings, the budget, bf16) into config.json "changes" and the
# metrics; intervals, logging, memory and speed silently (--prefix-sharing too: the same update, computed once per
# prompt). A key the run's config.json lacks (a run older than the option) is compared as the option's default,
# what the run ran with.
RUN_IDENTITY = ("preset", "baseline", "seed", "model", "lora_rank", "lora_alpha", "lora_target_modules",
                "dataset", "question_field", "answer_field", "prompt_template", "eval_dataset", "eval_fraction",
                "answer_kind", "num_train_rows", "one_shot", "prefill_think", "system_prompt", "max_prompt_tokens",
                "rule", "num_rollouts", "update_size", "prompts_per_step", "grad_accum_steps", "updates_per_batch",
                "advantage_normalization", "scale_rewards", "selection_scope", "drop_zero_variance", "reward_weights",
                "reward_options", "dynamic_sampling", "dynamic_sampling_metric", "max_generation_rounds", "optimizer",
                "temperature", "top_p", "max_completion_tokens", "eval_samples", "eval_temperature", "load_in_4bit") + \
    tuple(_dest(option) for option in LOSS_FLAGS)  # every loss option
# bf16 changes the policy's numerics, not the method: a run moved to other hardware may need to change it.
RECORDED_AT_RESUME = ("learning_rate", "weight_decay", "max_grad_norm", "max_steps", "max_time_s", "bf16")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows each flag's default after its help: its value, or "from --preset" (with the demo preset's value)
    for the flags a preset sets; a help text that already says its default is left as it is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.dest in PRESET_KEYS:
            demo = PRESETS["demo"].get(action.dest, action.default)
            return f"{text} (default: from --preset; the demo's: {_shown(demo)})"
        return text if action.default is None else f"{text} (default: {_shown(action.default)})"


def _shown(value):
    """A default as --help writes it: on/off for a switch, '' for an empty string."""
    return {True: "on", False: "off", "": "''"}.get(value, value) if isinstance(value, (bool, str)) else value


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (what is wrong, and where the flags are listed), not the usage text. A
    negative number, also in scientific notation (`--lr -1e-3`) or -inf/-nan, is a value, not a flag: the range
    checks then name what is wrong with it. No flag is taken by a prefix of its name (`--num-rollout 4` is refused,
    not read as --num-rollouts): a typo never starts a run."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **dict(kwargs, allow_abbrev=False))
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$",
                                                   re.IGNORECASE)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (python {self.prog} --help lists the flags)\n")


def build_parser():
    parser = OneLineParser(prog="train.py", description="Train an LLM with GRPO or GRPO-PODS.",
                           formatter_class=DefaultsHelpFormatter,
                           epilog="--print-config prints every value a run would use (null: the flag's own default, "
                                  "as described above).")
    add = parser.add_argument_group("preset").add_argument
    add("--preset", choices=sorted(PRESETS), default="demo",
        help="paper setting (a)-(d), (e)/(f) (full parameter, 8 GPUs: torchrun -m multigpu) or the CPU demo")
    add("--baseline", action="store_true", help="switch the preset to its GRPO baseline (n = m, rule none)")
    add = parser.add_argument_group("model").add_argument
    add("--model", help=f"Hub id, local folder/.gguf, or {models.SMOLLM2_ALIAS!r} (the offline demo model: "
        "SmolLM2-135M-Instruct quantised to 4 bits, Q4_1, de-quantised to float32)")
    add("--lora-rank", type=int, default=0, help="LoRA rank r; 0 = full fine-tuning")
    add("--lora-alpha", type=int, help="LoRA alpha (the adapter's scale is alpha / r)")
    add("--lora-target-modules", default=",".join(models.DEFAULT_LORA_TARGETS),
        help="comma-separated names of the projections LoRA adapts; auto: every linear projection inside the decoder "
             "blocks, named from the model (Phi-3's fused qkv_proj and gate_up_proj included)")
    add("--load-in-4bit", action="store_true", help="bitsandbytes NF4 base weights (QLoRA), CUDA only")
    add("--bf16", action=argparse.BooleanOptionalAction, default=False,
        help="bfloat16 compute (LoRA: bf16 frozen base weights; full fine-tuning: fp32 weights + bf16 autocast); "
             "the demo preset: on where the device computes bf16 natively (a CPU with AVX-512 BF16 or AMX, a CUDA "
             "GPU with bf16), else off")
    add("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
        help="recompute each layer's activations in the backward pass instead of keeping them: less memory, "
             "~1/3 more update time")
    add("--prefix-sharing", choices=("on", "off"), default="on",
        help="each distinct token computed once: generation and evaluation run the prefix every prompt shares once; "
             "the update runs each distinct prompt once for all its rollouts, and the shared prefix once (the same "
             "completions, loss and gradients, to float rounding; off: every row runs its prompt in full)")
    add("--device", help="cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu)")
    add = parser.add_argument_group("data").add_argument
    add("--dataset", help=f"a registered dataset ({', '.join(data.DATASETS)}: docs/rewards_and_data.md), your own "
        "rows as a .jsonl / .csv / .parquet file, or a Hub dataset id (owner/name)")
    add("--question-field", default="question", help="your own rows: the column holding the question")
    add("--answer-field", default="answer", help="your own rows: the column holding the ground-truth answer")
    add("--prompt-template", help="the user turn, a text or a file holding it, with {question} and any other column "
        "by name, e.g. 'Solve: {question}' (default: the question; chemistry: its instruction, then the question)")
    add("--eval-dataset", help="your own rows: the held-out rows' file or Hub id (default: --eval-fraction of "
        "--dataset's rows)")
    add("--eval-fraction", type=float, help=f"your own rows: the fraction held out, chosen by a stable hash of each "
        f"row (default: {data.DEFAULT_EVAL_FRACTION:g} of a file; a Hub id's own test split)")
    add("--answer-kind", choices=data.ANSWER_KINDS, help="what the accuracy reward compares: a number, a LaTeX "
        "expression (math-verify) or a choice letter A-D (default: the dataset's; your own rows: told by the answer)")
    add("--data-dir", help="folder with the dataset files (default: $PODS_DATA_DIR, else ../shared/data, else the Hub)")
    add("--num-train-rows", type=int,
        help="use this many training rows (arithmetic: the synthetic set size; default: every row)")
    add("--one-shot", action=argparse.BooleanOptionalAction, default=False, help="one worked example in the prompt")
    add("--prefill-think", action="store_true", help="end the prompt with '<think>\\n' (scored as completion)")
    add("--max-prompt-tokens", type=int,
        help="training prompts longer than this many tokens are dropped (held-out prompts are kept)")
    add("--system-prompt", help="the system turn of every prompt; '' = none (unset: the paper's think/answer "
        "instruction, data.SYSTEM_PROMPT)")
    add = parser.add_argument_group("PODS / GRPO").add_argument
    add("--num-rollouts", "-n", type=int, help="rollouts generated per prompt (n)")
    add("--update-size", "-m", type=int, help="rollouts per prompt kept for the update (m <= n)")
    add("--rule", choices=list(pods.RULES), help="down-sampling rule (pods.RULES); 'none' (m = n) is plain GRPO")
    add("--advantage-normalization", choices=pods.NORMALIZE_MODES, default="selected",
        help="selected: stats of the m kept rewards (paper); group: stats of all n")
    add("--scale-rewards", choices=pods.SCALE_MODES, default="group",
        help="divide advantages by the group std (paper), the batch std (TRL 'batch') or nothing (Dr. GRPO)")
    add("--selection-scope", choices=pods.SELECTION_SCOPES, default="prompt",
        help="prompt: m per prompt (paper); batch: m x P from each rollout batch of P prompts, balanced across "
             f"prompts ({' or '.join(pods.batch_scope_rules())} only, pods.select_across_prompts)")
    add("--drop-zero-variance", action=argparse.BooleanOptionalAction, default=False,
        help="leave prompts whose n rewards are all equal out of the update (counted: num_zero_variance_dropped)")
    add("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=False,
        help="DAPO: set groups with all-equal rewards aside, draw more prompts until --prompts-per-step have a spread")
    add("--dynamic-sampling-metric", choices=DYNAMIC_SAMPLING_METRICS, default="total",
        help="the reward that must vary within a group: the weighted total (what the advantages use) or accuracy")
    add("--max-generation-rounds", type=int, default=10, help="--dynamic-sampling: generation rounds per rollout "
        f"batch at most (<= {MAX_GENERATION_ROUNDS})")
    add("--reward-weights", default="",
        help=f"name=weight for the reward terms whose weight changes; the others keep theirs "
             f"({DEFAULT_REWARD_WEIGHTS}, the paper's; weight 0 logs a reward without training on it)")
    add("--reward-options", default="",
        help="term.option=value,... for the reward terms with options of their own (rewards.REWARD_TERMS)")
    add("--reward-function", action="append", default=[], metavar="FILE.py:NAME[=WEIGHT]",
        help="a reward function of your own, called as TRL's GRPOTrainer calls it (prompts, completions as assistant "
             "messages, completion_ids, every dataset column, trainer_state, log_extra, log_metric, by keyword; "
             "returns a number or None per completion), weight 1 unless given; repeatable (default: none)")
    add("--reward-function-timeout-s", type=float, default=trl_call.DEFAULT_TIMEOUT_S,
        help="seconds one call of a --reward-function function may take (it scores a rollout batch); past it the run "
             "stops in one line naming the function; 0 = no limit")
    add("--prompts-per-step", type=int, help="prompts per rollout batch (P): P x n rollouts are generated")
    add("--grad-accum-steps", type=int, default=1, help="rollout batches per optimizer step (GRPO-GA)")
    add("--updates-per-batch", "--mu", type=int, default=1, help="optimizer steps per rollout batch (mu)")
    for option in LOSS_FLAGS:  # the loss options, from grpo_loss.LossSettings
        kind = option.metadata["argparse"] or dict(action=argparse.BooleanOptionalAction)  # a bool: --x / --no-x
        add(grpo_loss.flag_name(option), default=option.default, help=option.metadata["help"], **kind)
    add = parser.add_argument_group("optimizer").add_argument
    add("--learning-rate", "--lr", type=float, help="AdamW learning rate, constant")
    add("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    add("--max-grad-norm", type=float, default=1.0, help="gradient norm clipped to this (<= 0: off)")
    add("--optimizer", choices=OPTIMIZERS, default="adamw",
        help="adamw: torch's AdamW; adamw8bit: bitsandbytes' 8-bit AdamW (CUDA)")
    add = parser.add_argument_group("generation").add_argument
    add("--temperature", type=float, help="sampling temperature of the rollouts (> 0)")
    add("--top-p", type=float, default=1.0, help="nucleus sampling of the rollouts: keep the most likely tokens "
        "up to this probability mass (1 = off)")
    add("--backend", choices=BACKENDS, help="engine: the decode engine, any failure or log-prob gap an "
        "error; hf: generate(); default: the engine, falling back when it fails (docs/generation.md)")
    add("--generation-copy", action=argparse.BooleanOptionalAction, default=None,
        help="decode from a copy of the weights with LoRA merged in (plain GEMMs, CUDA graphs); default: on, except "
             "with --load-in-4bit, where the bf16 copy costs ~2 bytes per base parameter (5.5 GB for a 3B model)")
    add("--max-completion-tokens", type=int, help="tokens generated per rollout at most (a longer one is cut: "
        "truncated)")
    add("--rollout-batch-size", type=int, help="sequences per generate call (bounds generation's memory)")
    add("--micro-batch-size", type=int, help="sequences per forward/backward (bounds the update's memory)")
    add = parser.add_argument_group("run").add_argument
    add("--seed", type=int, default=0, help="seeds LoRA's initialisation, the prompt order, sampling and the random "
        "rule: a run is reproducible, and resumes exactly")
    add("--num-threads", type=int, default=0,
        help="CPU threads for torch; 0 = as many as other work leaves free, at most one per core, measured at the start "
             "and over every step (run/threads.py); on CUDA 0 is torch's default")
    add("--max-steps", type=int, default=0, help="training steps at most; 0 = no step limit")
    add("--max-time-s", type=float, default=0.0,
        help="training wall-clock budget (evaluation excluded): no step starts that would likely end past it; "
             "0 = no time limit")
    add("--checkpoint-interval-s", type=float, help="seconds of training between checkpoints (one also at the end); "
        "< 0 = never")
    add("--keep-checkpoints", type=int, default=0, help="keep only the newest K checkpoints (0 = all)")
    add("--eval-interval", type=int, help="held-out evaluation every K steps (also at step 0 and the end)")
    add("--eval-interval-s", type=float, default=0.0,
        help="also a held-out evaluation after the step whose training seconds (evaluation excluded) cross each "
             "multiple of S: the same cadence on the clock for methods of different step times (0 = off; give "
             "--eval-interval 0 for this cadence alone). Follows from the run's training seconds: a resume keeps it")
    add("--eval-samples", type=int, help="held-out prompts (fixed sample of the test split); 0 = no eval")
    add("--eval-temperature", type=float, help="sampling temperature of the held-out evaluation; 0 = greedy")
    add("--log-completions-interval", type=int,
        help="every K-th step, write each rollout (prompt, completion, rewards, kept or not, advantage) to "
             "<out>/completions/, and each evaluation a sample of its graded completions (default: --eval-interval; "
             "0 = never); view them with python eval.py rollouts RUN")
    add("--output-dir", help="default: runs/<preset>-<method>-s<seed>-<time>")
    add("--resume", action="store_true",
        help="continue the run in --output-dir from its newest readable checkpoint; budget, logging and optimizer "
             "flags given now win, flags that change what the run is are refused (docs/training.md, section 5)")
    add("--progress", action=argparse.BooleanOptionalAction, default=True,
        help="a progress bar: training seconds against --max-time-s (else steps against --max-steps) with its ETA; "
             "reward: the step's mean total reward, acc: the latest held-out accuracy")
    add("--print-config", action="store_true",
        help="print every resolved value (preset, --baseline, flags; as config.json holds them) and exit")
    add("--report-to", choices=REPORT_TO, default="none",
        help="also send the metrics.jsonl lines, same names, to TensorBoard (<out>/tensorboard) or Weights & Biases")
    add = parser.add_argument_group("several GPUs (torchrun -m multigpu)").add_argument
    add("--dist-timeout-s", type=float, default=1800.0,
        help="seconds a collective may wait before the run ends with an error (must exceed one process's "
             "generation)")
    return parser


def parse_args(argv=None, restarted=False, refusal=None):
    """Resolved, checked flags: flags > the resumed run's config > --baseline > the preset. Raises ValueError or
    FileNotFoundError (one line each) for anything wrong, before any model or data is loaded. restarted: a launcher
    started this run again (torchrun --max-restarts): it resumes from its latest checkpoint, or starts over.
    refusal(args): a caller's own line refusing the resolved values, or None, asked before the checks that load
    torch (the TRL demo's)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    first = parser.parse_args(argv)  # --help, an unknown flag, a bad choice or number: answered before any import
    if first.output_dir:
        from run import runfolder  # torch, safetensors: a run folder's checkpoints
    checkpointed = first.output_dir and runfolder.newest_checkpoint(first.output_dir, readable=False)[0]
    if not first.resume and restarted and checkpointed:
        argv, first.resume = argv + ["--resume"], True
    if first.output_dir:
        runfolder.check_output_dir(first.output_dir)
    if first.resume and not (first.output_dir and (Path(first.output_dir) / "config.json").is_file()):
        raise ValueError("--resume needs --output-dir of an existing run (with config.json)")
    saved = runfolder.read_config(first.output_dir) if first.resume else {}
    # A resumed run keeps its preset (config.json records what the run is; another --preset is refused below).
    given = given_flags(argv)
    preset = first.preset if "preset" in given or saved.get("preset") not in PRESETS else saved["preset"]
    layers = {f"preset {preset}": dict(PRESETS[preset], preset=preset)}  # each later one over the ones before
    if (first.dataset or saved.get("dataset") or PRESETS[preset].get("dataset")) not in data.DATASET_READERS:
        layers["your own rows (presets.OWN_ROWS)"] = own_rows_settings(preset)  # not the preset dataset's settings
    if first.baseline or saved.get("baseline") is True:  # a resumed baseline's keys its config.json lacks: too
        layers["--baseline"] = dict(BASELINES[preset], rule="none")
    defaults = {key: value for layer in layers.values() for key, value in layer.items()}
    dests = {action.dest for action in parser._actions}
    parser.set_defaults(**defaults)
    unrecorded = vars(parser.parse_args([]))  # a flag the run's config.json lacks (older than it) had its default
    layers["the resumed run"] = {k: v for k, v in saved.items() if k in dests and k not in ("resume", "preset")}
    defaults.update(layers["the resumed run"])
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if saved and first.reward_function:  # given again: these functions, not the run's and these appended to them
        args.reward_function = first.reward_function
    args.value_sources = value_sources(parser, layers, given, saved.get("value_sources") or {})
    # One's own rows are split by data.SPLIT_RULE; a resumed run by the rule it started with (older runs: ranked).
    args.split_rule = saved.get("split_rule", data.RANKED_SPLIT) if first.resume else data.SPLIT_RULE
    if args.__dict__.pop("print_config"):  # before the checks: nothing needs to be at hand to see the values
        resolve_device(args)
        resolve_defaults(args)  # as config.json will hold them, with the run's label and folder
        print(json.dumps(dict(vars(args), label=method_label(args), output_dir=str(run_dir(args))), indent=1))
        parser.exit()
    check_values(args)  # no torch yet: a value out of range is refused at once
    problem = refusal and refusal(args)
    if problem:
        raise ValueError(problem)
    resolve_device(args)
    unrecorded["bf16"] = resolved_bf16(unrecorded["bf16"], args.device)
    check_args(args, restarted)
    if args.resume:
        from run import runfolder
        saved = dict({key: unrecorded[key] for key in RUN_IDENTITY + RECORDED_AT_RESUME}, **saved)
        _check_reward_terms(args, saved)
        _check_data_files(args, saved)
        _check_reward_functions(args, saved)
        weights = saved["reward_weights"]  # older runs saved the flag's text: the terms then unknown, parsed now
        saved["reward_weights"] = parse_reward_weights(weights) if isinstance(weights, str) else \
            {**{name: 0.0 for name in args.reward_weights}, **weights}  # a term the run did not record weighed 0
        if isinstance(saved["reward_options"], str):
            saved["reward_options"] = parse_reward_options(saved["reward_options"])
    args.changes = runfolder.resume_changes(args, saved, RUN_IDENTITY, RECORDED_AT_RESUME) if args.resume else []
    return args


def given_flags(argv):
    """The destinations of the flags on the command line (aliases and --flag=value included)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def value_sources(parser, layers, given, recorded):
    """{each flag's destination: where its value comes from}: "flag" (given now), the last of `layers` (name:
    {destination: value}; "the resumed run": its config.json, with the source it recorded) that sets it, or "default"
    (the parser's); --print-config and config.json show them."""
    sources = {action.dest: "default" for action in parser._actions if action.dest not in ("help", "print_config")}
    for name, layer in layers.items():
        sources.update({key: name for key in layer if key in sources})
    resumed = "the resumed run"
    for key in set(layers.get(resumed, ())) & set(sources):  # as the run recorded it (older runs: config.json)
        before = recorded.get(key, "config.json")
        sources[key] = before if before.startswith(resumed) else f"{resumed}: {before}"
    sources.update({key: "flag" for key in given if key in sources})
    return sources


def parse_args_or_exit(prog, argv=None):
    """parse_args for a command line: a wrong flag, value, folder or data source ends the process with the one line
    `prog: error: ...` (exit status 1), as argparse's own errors do (status 2)."""
    try:
        return parse_args(argv)
    except (ValueError, OSError, data.HubUnavailable) as error:
        sys.exit(f"{prog}: error: {error}")


def resolve_device(args):
    """--device (default: cuda where torch sees a GPU, else cpu) and --bf16 as the run records them (imports torch)."""
    args.device = args.device or models.default_device()
    args.bf16 = resolved_bf16(args.bf16, args.device)


def resolved_bf16(value, device):
    """--bf16 as a run records it: the demo preset's "auto" is whether `device` computes bf16 natively
    (models.native_bf16); a flag given is kept."""
    return models.native_bf16(device) if value == "auto" else bool(value)


def reward_terms(weights, options):
    """{term: {"weight", "options"}} of every registered reward term, resolved (its options' defaults included):
    what config.json records, so that a resume sees a term registered, or an option's default changed, since."""
    return {name: {"weight": weights[name], "options": {**term.options, **options.get(name, {})}}
            for name, term in rewards.REWARD_TERMS.items()}


def parse_reward_weights(spec):
    """"format=0.1" (or the dict a config.json holds) -> {name: weight} of every registered reward term: the named
    ones changed, the others at their default weight (rewards.DEFAULT_REWARD_WEIGHTS). An unknown name is an error."""
    weights = dict(rewards.DEFAULT_REWARD_WEIGHTS)
    items = spec.items() if isinstance(spec, dict) else (item.partition("=")[::2] for item in spec.split(",") if item)
    for name, value in items:
        name = name.strip()
        if name not in rewards.REWARD_FUNCS:
            raise ValueError(f"unknown reward function {name!r} in --reward-weights; "
                             f"expected names from {sorted(rewards.REWARD_FUNCS)}")
        try:
            weights[name] = float(value) if value != "" else 1.0
        except (TypeError, ValueError):
            raise ValueError(f"--reward-weights: weight of {name!r} is not a number: {value!r}") from None
        if not math.isfinite(weights[name]):  # nan or inf would reach the loss and config.json
            raise ValueError(f"--reward-weights: weight of {name!r} is not a number: {value!r} (it must be finite)")
    return weights


def parse_reward_options(spec):
    """"term.option=value,..." (or the dict a config.json holds) -> {term: {option: value}}, each value of its
    default's type; an unknown term or option, or a value of the wrong type, is an error."""
    items = ((f"{term}.{key}", value) for term, given in spec.items() for key, value in given.items()) \
        if isinstance(spec, dict) else (item.partition("=")[::2] for item in spec.split(",") if item)
    options = {}
    for key, value in items:
        term, _, option = key.strip().partition(".")
        known = rewards.REWARD_TERMS[term].options if term in rewards.REWARD_TERMS else {}
        if option not in known:
            raise ValueError(f"--reward-options: no option {key.strip()!r}; reward terms' options: "
                             f"{[f'{t.name}.{o}' for t in rewards.REWARD_TERMS.values() for o in t.options]}")
        kind = type(known[option])
        try:
            parsed = {"true": True, "false": False}[str(value).lower()] if kind is bool else value
            options.setdefault(term, {})[option] = kind(parsed)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"--reward-options: {key.strip()} needs a {kind.__name__}, got {value!r}") from None
    return options


def _check_reward_terms(args, saved):
    """A resume's reward terms against those its run recorded (config.json "reward_terms"; older runs: the terms of
    their resolved "reward_weights"): a term registered since, with a weight, or a recorded term's option whose value
    is now another (a changed default), is refused in one ValueError line naming the flag that keeps the run as it
    was. Weights given anew are refused with the other flags (runfolder.resume_changes)."""
    recorded = saved.get("reward_terms")
    if recorded is None and isinstance(saved.get("reward_weights"), dict):
        recorded = {name: {"weight": weight} for name, weight in saved["reward_weights"].items()}
    if not isinstance(recorded, dict):
        return  # the run's terms are unknown: its weights are compared as parsed now
    unknown = [name for name, term in recorded.items() if name not in args.reward_terms and term.get("weight")]
    if unknown:
        raise ValueError(f"--resume: the run in {args.output_dir} trained on reward terms {unknown}, which are no "
                         "longer registered (rewards.REWARD_TERMS); it cannot continue as it is")
    new = [name for name, term in args.reward_terms.items() if name not in recorded and term["weight"] != 0]
    if new:
        zero = ",".join(f"{name}=0" for name in new)
        raise ValueError(f"--resume: reward terms {new} did not exist when the run in {args.output_dir} started; "
                         f"continue it without them (--reward-weights {zero}) or start a new run in another "
                         "--output-dir")
    changed = [(name, option, value, args.reward_terms[name]["options"].get(option))
               for name, term in recorded.items() if name in args.reward_terms
               for option, value in term.get("options", {}).items()
               if args.reward_terms[name]["options"].get(option) != value]
    if changed:
        given = ",".join(f"{name}.{option}={value}" for name, option, value, _ in changed)
        now = ", ".join(f"{name}.{option} {value!r} -> {current!r}" for name, option, value, current in changed)
        raise ValueError(f"--resume: reward options differ from those the run in {args.output_dir} started with "
                         f"({now}); continue it with --reward-options {given} or start a new run in another "
                         "--output-dir")


def resolve_defaults(args):
    """The values whose default depends on other flags, resolved as the run uses them (and config.json holds them):
    --log-completions-interval (default: --eval-interval), the reward weights and options parsed, once, into dicts
    (every registered term's weight), and every term's resolved weight and options (`reward_terms`). --print-config
    prints them so too."""
    sources = args.value_sources
    if args.log_completions_interval is None:
        args.log_completions_interval = args.eval_interval
        sources["log_completions_interval"] = f"--eval-interval ({sources['eval_interval']})"
    args.reward_weights = parse_reward_weights(args.reward_weights)
    args.reward_options = parse_reward_options(args.reward_options)
    args.reward_terms = reward_terms(args.reward_weights, args.reward_options)  # recorded in config.json
    if args.prompt_template and Path(args.prompt_template).is_file():  # a file: its text is what the run uses
        sources["prompt_template"] += f" (the file {args.prompt_template})"
        args.prompt_template = data.read_template(args.prompt_template)
    reader = data.DATASET_READERS.get(args.dataset)
    if args.answer_kind is None and reader and reader.answer_kind and not args.resume:  # a resumed run keeps its own
        args.answer_kind, sources["answer_kind"] = reader.answer_kind, f"dataset {args.dataset}"
    _own_eval_samples(args)
    args.reward_function = list(dict.fromkeys(args.reward_function or []))  # a resume given its specs again
    record_files(args)


def _own_eval_samples(args):
    """With a file of one's own and --eval-samples not given (nor recorded by the resumed run): every held-out row
    where the file holds fewer than the preset's count (a row it cannot read is left to the checks)."""
    source = args.value_sources["eval_samples"]
    if not args.eval_samples or source.startswith(("flag", "the resumed run")) or data.own_kind(args.dataset) != "file":
        return
    try:
        count = len(data.read_own_rows(data_source(args), "test"))
    except (ValueError, OSError):
        return
    if count < args.eval_samples:
        args.value_sources["eval_samples"] = f"{source}: every held-out row ({count}), at most {args.eval_samples}"
        args.eval_samples = count


def record_files(args):
    """What config.json records of the files a run reads besides its model, so that a resume refuses a changed one:
    `data_files` ({role: {"path", "sha256"}} of one's own rows) and `reward_functions` ({name: {"path", "sha256",
    "weight"}} of --reward-function). A file not there is left out here: the checks refuse it."""
    present = [name if name and Path(name).is_file() else None for name in (args.dataset, args.eval_dataset)]
    args.data_files = data.own_files(data.DataSource(present[0], eval_dataset=present[1]))
    args.reward_functions = {}
    for spec in args.reward_function:
        try:
            path, name, weight = parse_reward_function(spec)
        except ValueError:
            continue  # refused by check_values
        if Path(path).is_file():
            args.reward_functions[name] = {"path": str(Path(path).resolve()), "sha256": data.file_sha256(path),
                                           "weight": weight}


def check_values(args):
    """The errors of flag values and combinations, and of the reward weights (resolve_defaults): none needs torch."""
    resolve_defaults(args)
    for action in build_parser()._actions:  # NaN passes every `x < 0` test below; no flag gives infinity a meaning
        value = getattr(args, action.dest, None)
        if action.type is float and value is not None and not math.isfinite(value):
            raise ValueError(f"{action.option_strings[0]} must be a finite number, got {value}")
    for name in POSITIVE_INTS:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in NON_NEGATIVE:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.update_size > args.num_rollouts:
        raise ValueError(f"--update-size m = {args.update_size} must be <= --num-rollouts n = {args.num_rollouts}")
    if args.rule == "none" and args.update_size != args.num_rollouts:
        raise ValueError(f"rule 'none' (plain GRPO) trains on every rollout: needs m == n, got m = "
                         f"{args.update_size}, n = {args.num_rollouts}; pick a PODS rule or set m = n")
    for flag, value, ok, bound in (("--learning-rate", args.learning_rate, args.learning_rate > 0, "> 0"),
                                   ("--temperature", args.temperature, args.temperature > 0, "> 0"),
                                   ("--clip-eps", args.clip_eps, args.clip_eps > 0, "> 0"),
                                   ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
                                   ("--is-clip", args.is_clip, args.is_clip >= 1, ">= 1")):
        if not ok:
            raise ValueError(f"{flag} must be {bound}, got {value:g}")
    for name in ("num_train_rows", "lora_alpha"):  # optional counts
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _check_variant_flags(args)
    _check_data_flags(args)
    for spec in args.reward_function:
        path, name, _ = parse_reward_function(spec)
        if not Path(path).is_file():
            raise FileNotFoundError(f"--reward-function {spec!r}: file not found: {path}")
    if not args.dist_timeout_s > 0:
        raise ValueError(f"--dist-timeout-s must be > 0, got {args.dist_timeout_s}")
    _check_dynamic_sampling(args)
    if args.report_to not in REPORT_TO:  # a resumed run's config.json value is not checked by argparse
        raise ValueError(f"--report-to must be one of {REPORT_TO}, got {args.report_to!r}")


def check_args(args, restarted=False):
    """The errors that need the machine (device, sinks) or the files: the run folder, the data and the model source
    (check_values first; `args.device` resolved)."""
    from run import report
    from run import runfolder

    report.check_report_to(args.report_to)
    _check_device_flags(args)
    runfolder.check_run_dir(args, restarted)
    _check_data(args)
    names = [load_reward_function(spec).name for spec in args.reward_function]  # imports each file
    if len(set(names)) < len(names):
        raise ValueError(f"--reward-function: two functions named {[n for n in names if names.count(n) > 1][0]!r}")
    models.check_model_source(args.model, args.max_prompt_tokens, args.max_completion_tokens)  # nothing loaded
    if args.bf16 and not str(args.device).startswith("cuda") and not models.native_bf16(args.device):
        warnings.warn("--bf16 on a CPU without bf16 instructions (AVX-512 BF16, AMX): allowed, but slower than "
                      "float32 (--no-bf16)")


def _check_device_flags(args):
    import torch

    cuda = str(args.device).startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: torch sees no CUDA device here; use --device cpu")
    if args.kl_coef > 0 and args.lora_rank <= 0:
        raise ValueError("incompatible flags: --kl-coef > 0 needs a LoRA adapter (--lora-rank > 0), whose "
                         "disabled state is the reference policy; without LoRA there is no reference model")
    from engine import gpu_paths

    # CUDA, or the GPU a test emulates (engine/gpu_paths.py: bitsandbytes runs on a CPU too)
    gpu = str(args.device).split(":")[0] in gpu_paths.DEVICE_TYPES
    if args.load_in_4bit and (not gpu or args.lora_rank <= 0):
        raise ValueError("incompatible flags: --load-in-4bit needs a CUDA device and --lora-rank > 0")
    if args.optimizer == "adamw8bit" and (not gpu or importlib.util.find_spec("bitsandbytes") is None):
        raise ValueError("--optimizer adamw8bit needs bitsandbytes and a CUDA device; use --optimizer adamw")


def _check_dynamic_sampling(args):
    """--dynamic-sampling needs groups that can have a spread, and a bound on the rounds looking for them."""
    if args.max_generation_rounds > MAX_GENERATION_ROUNDS:
        raise ValueError(f"--max-generation-rounds must be <= {MAX_GENERATION_ROUNDS}, got "
                         f"{args.max_generation_rounds}: a step that finds too few groups with a spread trains on "
                         "what it has after that many rounds")
    if not args.dynamic_sampling:
        return
    if args.num_rollouts < 2:
        raise ValueError(f"--dynamic-sampling with --num-rollouts {args.num_rollouts}: a group of one rollout never "
                         "has a reward spread, so every group would be set aside; use -n >= 2")
    if args.dynamic_sampling_metric == "total" and not any(args.reward_weights.values()):
        raise ValueError("--dynamic-sampling with every --reward-weights weight 0: the weighted total is 0 for every "
                         "rollout, so no group can have a spread; give a reward a weight or use "
                         "--dynamic-sampling-metric accuracy")


def inert_loss_options(args):
    """The loss options set away from their default whose `needs` field is at its default: they do nothing (e.g.
    --is-clip without --importance-sampling-correction)."""
    fields = {option.name: option for option in dataclasses.fields(grpo_loss.LossSettings)}
    return [option for option in LOSS_FLAGS if option.metadata["needs"]
            and getattr(args, _dest(option)) != option.default
            and getattr(args, _dest(fields[option.metadata["needs"]])) == fields[option.metadata["needs"]].default]


def _check_variant_flags(args):
    correction = args.importance_sampling_correction  # a resumed run's config.json value is not checked by argparse
    if correction in grpo_loss.REMOVED_IS_CORRECTIONS:
        raise ValueError(f"--importance-sampling-correction {grpo_loss.REMOVED_IS_CORRECTIONS[correction]}")
    if correction not in grpo_loss.IS_CORRECTIONS:
        raise ValueError(f"--importance-sampling-correction must be one of {grpo_loss.IS_CORRECTIONS}, got "
                         f"{correction!r}")
    fields = {option.name: option for option in dataclasses.fields(grpo_loss.LossSettings)}
    for option in inert_loss_options(args):
        needed = fields[option.metadata["needs"]]
        warnings.warn(f"{grpo_loss.flag_name(option)} {getattr(args, _dest(option))} does nothing with "
                      f"{grpo_loss.flag_name(needed)} {needed.default} (left out of the method label)")
    if args.clip_eps_high is not None and not args.clip_eps_high >= args.clip_eps:
        # Clip-higher (DAPO) widens the upper bound only; a narrower one clips the ratio of every improving token.
        raise ValueError(f"--clip-eps-high {args.clip_eps_high} must be >= --clip-eps {args.clip_eps} (clip-higher "
                         "only widens the upper clip; leave it unset for the symmetric clip)")
    if args.updates_per_batch == 1:  # the ratio is exactly 1: an option acting on it alone changes nothing
        inert = [f"{grpo_loss.flag_name(option)} {getattr(args, _dest(option))}" for option in LOSS_FLAGS
                 if option.metadata["ratio_only"] and getattr(args, _dest(option)) not in (None, option.default)]
        if inert:
            warnings.warn(f"{', '.join(inert)} cannot act with --updates-per-batch 1 (the ratio is exactly 1); "
                          "it acts with --mu > 1")
    if args.selection_scope == "batch" and args.rule not in pods.batch_scope_rules():
        raise ValueError(f"incompatible flags: --selection-scope batch balances a rule across prompts; it needs "
                         f"--rule {' or '.join(pods.batch_scope_rules())}, got --rule {args.rule}")


def _check_data(args):
    """The dataset is readable: synthetic, files in the data folder (data.default_data_dir) or its Hub source; one's
    own file read and every row checked, its path and SHA-256 recorded (args.data_files, config.json)."""
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir {args.data_dir} is not a folder")
    source = data_source(args)
    counts = data.check_data_source(args.dataset, args.data_dir, source=source,
                                     splits=("train", "test") if args.eval_samples else ("train",))
    for split, asked in (("train", args.num_train_rows), ("test", args.eval_samples)):
        if asked and split in (counts or {}) and asked > counts[split]:
            raise ValueError(data.too_many_rows(asked, split, args.dataset, counts[split]))


def _check_data_flags(args):
    """The data flags that act on one's own rows only are refused with a registered dataset (they would do
    nothing); a template's placeholders must be names; the held-out fraction a fraction."""
    own = args.dataset not in data.DATASET_READERS
    if not own:
        given = [flag for flag, value, default in (("--question-field", args.question_field, "question"),
                                                   ("--answer-field", args.answer_field, "answer"),
                                                   ("--eval-dataset", args.eval_dataset, None),
                                                   ("--eval-fraction", args.eval_fraction, None)) if value != default]
        if given:
            raise ValueError(f"{', '.join(given)} shape your own rows (a file or Hub id as --dataset); "
                             f"{args.dataset} is a registered dataset with its own fields and held-out split")
    elif data.own_kind(args.dataset) is None:
        raise ValueError(f"--dataset {args.dataset!r}: not a registered dataset ({', '.join(data.DATASETS)}), "
                         "a .jsonl / .csv / .parquet file or a Hub id (owner/name)")
    elif args.one_shot:
        raise ValueError("--one-shot has a worked example for the registered datasets only; with your own rows, "
                         "write an example into --prompt-template (--no-one-shot)")
    if args.eval_fraction is not None and not 0 < args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {args.eval_fraction:g}")
    if args.eval_dataset and args.eval_fraction is not None:
        raise ValueError("--eval-dataset and --eval-fraction both name the held-out rows: give one")
    if args.prompt_template is not None:  # a stray brace, no placeholder, a column the registered rows lack: one line
        reader = data.DATASET_READERS.get(args.dataset)
        data.check_template(args.prompt_template, reader and reader.columns, args.dataset)


def reward_settings(args):
    """The rewards.RewardSettings of the flags: the registered terms' weights and options, --prefill-think,
    --answer-kind, the --reward-function functions (loaded), their time limit, and for them a TRL trainer_state of
    the run's --max-steps (train.py keeps its step and epoch current)."""
    functions = tuple(load_reward_function(spec) for spec in args.reward_function or [])
    return rewards.RewardSettings(args.reward_weights, args.reward_options, args.prefill_think, args.answer_kind,
                                  functions, args.reward_function_timeout_s,
                                  trl_call.trainer_state(max_steps=args.max_steps) if functions else None)


def _check_reward_functions(args, saved):
    """A resume trains on the functions of one's own its run started with, unchanged (name, file SHA-256, weight)."""
    recorded, now = saved.get("reward_functions") or {}, args.reward_functions
    if json.dumps(recorded, sort_keys=True) == json.dumps(now, sort_keys=True):
        return
    changed = sorted(name for name in set(recorded) | set(now) if recorded.get(name) != now.get(name))
    said = "; ".join(f"{name}: {_reward_function_said(recorded.get(name))} -> {_reward_function_said(now.get(name))}"
                     for name in changed)
    raise ValueError(f"--resume: the run in {args.output_dir} started with other --reward-function functions ({said}); "
                     "restore them or start a new run in another --output-dir")


def _reward_function_said(entry):
    return "absent" if not entry else f"{Path(entry['path']).name} sha256 {entry['sha256'][:12]} weight {entry['weight']:g}"


def data_source(args):
    """The data flags as a data.DataSource."""
    return data.DataSource(args.dataset, args.question_field, args.answer_field, args.prompt_template,
                           args.eval_dataset, args.eval_fraction, args.answer_kind, args.split_rule)


def _check_data_files(args, saved):
    """A resume reads the files its run started with: a file of one's own rows changed since is refused."""
    for role, recorded in (saved.get("data_files") or {}).items():
        now = (args.data_files.get(role) or {}).get("sha256")
        if now != recorded.get("sha256"):
            raise ValueError(f"--resume: {recorded.get('path')} (--{role.replace('_', '-')}) changed since the run "
                             f"in {args.output_dir} started (sha256 {recorded.get('sha256', '')[:12]} -> "
                             f"{(now or 'absent')[:12]}); restore it or start a new run in another --output-dir")


# The method label names what a run optimises (compare.py groups runs by it): the rule and n/m, then each flag below
# whose value differs from the preset's default, in this order, worded by its entry ("" adds nothing); then any
# other loss option (grpo_loss.LossSettings) as "flag value".
LABEL_FLAGS = {
    "loss_aggregation": lambda value, args: f"{value} loss",
    "scale_rewards": lambda value, args: f"{value} std",
    "selection_scope": lambda value, args: f"{value} scope",
    "clip_eps_high": lambda value, args: f"clip-high {value:g}" if value != args.clip_eps else "",
    "mask_truncated": lambda value, args: "truncated masked" if value else "",
    "drop_zero_variance": lambda value, args: "zero-variance dropped" if value else "",
    "dynamic_sampling": lambda value, args: f"dynamic sampling ({args.dynamic_sampling_metric})" if value else "",
    "advantage_normalization": lambda value, args: f"{value} normalization",
    "clip_eps": lambda value, args: f"clip {value:g}",
    "kl_coef": lambda value, args: f"kl {value:g}",
    "reward_weights": lambda value, args: "rewards " + ",".join(
        f"{name}={weight:g}" for name, weight in value.items() if weight != rewards.DEFAULT_REWARD_WEIGHTS.get(name)),
    "reward_function": lambda value, args: "own rewards " + ",".join(spec.rpartition(":")[2] for spec in value)
    if value else "",
    "reward_options": lambda value, args: "reward options " + ",".join(
        f"{term}.{key}={option}" for term, given in value.items() for key, option in given.items()),
}


def preset_defaults(preset):
    """Every flag's value when none is given for `preset` (reward weights and options parsed)."""
    parser = build_parser()
    parser.set_defaults(**PRESETS[preset])
    defaults = parser.parse_args([])
    return dict(vars(defaults), reward_weights=parse_reward_weights(defaults.reward_weights),
                reward_options=parse_reward_options(defaults.reward_options))


def method_label(args):
    """"PODS max_variance 16/4", plus every flag of LABEL_FLAGS (and loss option) that differs from the preset's
    default: e.g. "PODS max_variance 16/4 + token loss, clip-high 0.28"."""
    if args.rule == "none":
        label = f"GRPO{'-GA' if args.grad_accum_steps > 1 else ''} {args.num_rollouts}/{args.update_size}"
    else:
        label = f"PODS {args.rule} {args.num_rollouts}/{args.update_size}"
    defaults = preset_defaults(args.preset if args.preset in PRESETS else "demo")
    words = dict(LABEL_FLAGS)
    inert = {_dest(option) for option in inert_loss_options(args)}  # they do nothing: the same method
    for option in LOSS_FLAGS:
        words.setdefault(_dest(option), lambda value, args, flag=grpo_loss.flag_name(option): f"{flag[2:]} {value}")
    for name in inert:
        words.pop(name, None)
    variants = [describe(getattr(args, name), args) for name, describe in words.items()
                if getattr(args, name) != defaults[name]]
    variants = [variant for variant in variants if variant]
    return label + (" + " + ", ".join(variants) if variants else "")


def run_dir(args):
    """The run folder: --output-dir, else runs/<preset>-<pods|grpo>-s<seed>-<time>."""
    method = "grpo" if args.rule == "none" else "pods"
    return Path(args.output_dir or f"runs/{args.preset}-{method}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}")


# ------------------------------------------------------------------ --reward-function FILE.py:NAME[=WEIGHT]

def parse_reward_function(spec):
    """"FILE.py:NAME[=WEIGHT]" -> (path, name, weight); a malformed spec is one ValueError line."""
    where, _, weight = spec.rpartition("=") if "=" in spec.rpartition(":")[2] else (spec, "", "")
    path, _, name = where.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"--reward-function {spec!r}: expected FILE.py:NAME or FILE.py:NAME=WEIGHT")
    try:
        value = float(weight) if weight else 1.0
    except ValueError:
        raise ValueError(f"--reward-function {spec!r}: the weight {weight!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"--reward-function {spec!r}: the weight must be finite")
    return path, name, value


_REWARD_FILES = {}  # (resolved path, SHA-256) -> its module: a file is imported once per process


def load_reward_function(spec):
    """The OwnReward of a --reward-function spec: the file imported (once per process and content), NAME a function
    taking **kwargs (it receives every dataset column by name). Everything wrong is one ValueError line naming the
    spec."""
    import hashlib
    import importlib.util
    import inspect
    from pathlib import Path

    path, name, weight = parse_reward_function(spec)
    if not Path(path).is_file():
        raise ValueError(f"--reward-function {spec!r}: file not found: {path}")
    if name in rewards.REWARD_TERMS:
        raise ValueError(f"--reward-function {spec!r}: {name!r} is a registered reward term; name yours otherwise "
                         "(--reward-weights changes a registered term's weight)")
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    key = (str(Path(path).resolve()), digest)
    if key not in _REWARD_FILES:
        module_spec = importlib.util.spec_from_file_location(f"reward_file_{Path(path).stem}_{digest[:8]}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as error:  # noqa: BLE001  the user's file: one line, whatever it raised
            raise ValueError(f"--reward-function {spec!r}: importing {path} raised {type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''}") from None
        _REWARD_FILES[key] = module
    module = _REWARD_FILES[key]
    func = getattr(module, name, None)
    if not callable(func):
        found = sorted(key for key, value in vars(module).items() if inspect.isfunction(value))
        raise ValueError(f"--reward-function {spec!r}: {path} has no function {name!r} (functions: {found})")
    kinds = [parameter.kind for parameter in inspect.signature(func).parameters.values()]
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        raise ValueError(f"--reward-function {spec!r}: {name} must take **kwargs, as TRL's reward functions do "
                         "(it is called with prompts, completions, completion_ids and every dataset column by name)")
    return rewards.OwnReward(name, func, weight, str(Path(path).resolve()), digest)


def recorded_reward_functions(run_config):
    """(the OwnRewards a run's config.json records, loaded, and a line for each it cannot load as the run trained
    with it: its file gone or changed since, SHA-256). eval.py's reward report."""
    loaded, notes = [], []
    for name, entry in (run_config.get("reward_functions") or {}).items():
        path = Path(entry["path"])
        problem = "is gone" if not path.is_file() else "changed since the run trained with it (SHA-256)" \
            if data.file_sha256(path) != entry["sha256"] else None
        if problem:
            notes.append(f"the run's reward function {name!r}: {path} {problem}; it is left out of the reward report")
        else:
            loaded.append(load_reward_function(f"{path}:{name}={entry['weight']}"))
    return loaded, notes


def model_options(args):
    """models.load_policy's options from the flags (besides the model, its dtype and device)."""
    return dict(load_in_4bit=args.load_in_4bit, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                gradient_checkpointing=args.gradient_checkpointing,
                lora_target_modules=tuple(args.lora_target_modules.split(",")))


def generation_settings(args, **overrides):
    """The flags of generation as sampling.GenerationSettings (overrides: e.g. the evaluation's temperature). On
    CUDA one KV-cache length for every call (longest prompt + completion), so training and evaluation share one set
    of recorded decode graphs; elsewhere nothing is recorded and each call attends over its own prompts' length."""
    import sampling

    cuda = str(args.device).startswith("cuda")
    settings = dict(max_new_tokens=args.max_completion_tokens, temperature=args.temperature, top_p=args.top_p,
                    rollout_batch_size=args.rollout_batch_size, generation_copy=args.generation_copy,
                    backend=args.backend, prefix_sharing=args.prefix_sharing == "on",
                    cache_tokens=args.max_prompt_tokens + args.max_completion_tokens if cuda else 0)
    return sampling.GenerationSettings(**dict(settings, **overrides))


def loss_settings(args):
    """The flags of the loss as grpo_loss.LossSettings: each field from the flag of its name."""
    return grpo_loss.LossSettings(**{option.name: getattr(args, _dest(option))
                                     for option in dataclasses.fields(grpo_loss.LossSettings)})


def update_settings(args):
    """The flags of the update phase as update.UpdateSettings."""
    import update

    return update.UpdateSettings(
        micro_batch_size=args.micro_batch_size, temperature=args.temperature, updates_per_batch=args.updates_per_batch,
        max_grad_norm=args.max_grad_norm, autocast_dtype=models.compute_dtypes(args.bf16, args.lora_rank)[1],
        loss=loss_settings(args), prefix_sharing=args.prefix_sharing == "on")

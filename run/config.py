"""What a training run is: the command-line flags grouped by concern over a preset (presets.py: the paper's
settings (a)-(f) and the CPU demo, and their GRPO baselines), and every check that can be made before a model or a
dataset is loaded.

Each concern's flags live in their own file, with their checks and the settings record they make: flags_model.py
(the model, LoRA, precision, the device), flags_data.py (the dataset and the prompt), flags_pods.py (rollouts, the
down-sampling rule, advantages), flags_rewards.py (reward terms and one's own reward functions), flags_update.py (the
batch, every loss option, the optimizer), flags_generation.py (sampling and batch sizes), flags_run.py (budget,
checkpoints, evaluation, logging, several GPUs). This module assembles them into one parser (`build_parser`), resolves
a run's values over the preset and the resumed run (`parse_args`), and names the method (`method_label`).

Importing this module loads no torch (the registries it reads import it at first use, lazy.py), and `parse_args`
makes the checks that need none first: `--help`, a mistyped flag or a value out of range are answered in well under a
second; the checks of the device, the run folder, the data and the model source come after.

Precedence: flags > the resumed run's config.json > --baseline > your own rows' settings (presets.OWN_ROWS, with a
--dataset of your own) > the preset (`parse_args`); `value_sources` records which gave each value.

Simplification: the learning rate is constant (as in the authors' single-GPU config; their multi-GPU recipe
uses a cosine schedule with 10% warm-up).
"""

import argparse
import importlib.util
import json
import math
import re
import sys
import time
import warnings
from pathlib import Path

import data
import models
import policy
import rewards
from run import flags_data, flags_generation, flags_model, flags_pods, flags_rewards, flags_run, flags_update
from run.presets import BASELINES, PRESETS, own_rows_settings
# What callers read from here: the choices written for --help, the loss flags, the settings records, the reward
# functions of one's own.
from run.flags_data import data_source  # noqa: F401
from run.flags_generation import BACKENDS, generation_settings  # noqa: F401
from run.flags_model import model_options, resolve_device, resolved_bf16  # noqa: F401
from run.flags_pods import DYNAMIC_SAMPLING_METRICS, MAX_GENERATION_ROUNDS  # noqa: F401
from run.flags_rewards import (load_reward_function, parse_reward_options, parse_reward_weights,  # noqa: F401
                               recorded_reward_functions, reward_settings)
from run.flags_run import REPORT_TO  # noqa: F401
from run.flags_update import (LOSS_FLAGS, OPTIMIZERS, flag_dest, inert_loss_options, loss_settings,  # noqa: F401
                               update_settings)

PRESET_KEYS = {key for preset in PRESETS.values() for key in preset}  # --help: their default is "from --preset"
# The flags' concerns: each declares the ranges of its flags (POSITIVE_INTS: >= 1 where given, NON_NEGATIVE, RANGES:
# (flag, destination, test, what it must be)), checked before each concern's own checks (check_values).
CONCERNS = (flags_model, flags_data, flags_pods, flags_rewards, flags_update, flags_generation, flags_run)


def _declared(name):
    return tuple(entry for concern in CONCERNS for entry in getattr(concern, name, ()))


POSITIVE_INTS, NON_NEGATIVE, RANGES = (_declared(name) for name in ("POSITIVE_INTS", "NON_NEGATIVE", "RANGES"))

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
    tuple(flag_dest(option) for option in LOSS_FLAGS)  # every loss option
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
    """train.py's parser: each concern's flags in their group, the groups in --help's order."""
    parser = OneLineParser(prog="train.py", description="Train an LLM with GRPO or GRPO-PODS.",
                           formatter_class=DefaultsHelpFormatter,
                           epilog="--print-config prints every value a run would use (null: the flag's own default, "
                                  "as described above).")
    add = parser.add_argument_group("preset").add_argument
    add("--preset", choices=sorted(PRESETS), default="demo",
        help="paper setting (a)-(d), (e)/(f) (full parameter, 8 GPUs: torchrun -m multigpu) or the CPU demo")
    add("--baseline", action="store_true", help="switch the preset to its GRPO baseline (n = m, rule none)")
    flags_model.add_flags(parser.add_argument_group("model"))
    flags_data.add_flags(parser.add_argument_group("data"))
    method = parser.add_argument_group("PODS / GRPO")
    flags_pods.add_flags(method)
    flags_rewards.add_flags(method)
    flags_update.add_flags(method)
    flags_update.add_optimizer_flags(parser.add_argument_group("optimizer"))
    flags_generation.add_flags(parser.add_argument_group("generation"))
    flags_run.add_flags(parser.add_argument_group("run"))
    flags_run.add_multigpu_flags(parser.add_argument_group("several GPUs (torchrun -m multigpu)"))
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
        flags_rewards.check_reward_terms(args, saved)
        flags_data.check_data_files(args, saved)
        flags_rewards.check_reward_functions(args, saved)
        flags_rewards.saved_as_parsed(args, saved)
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


def resolve_defaults(args):
    """The values whose default depends on other flags, resolved as the run uses them (and config.json holds them):
    --log-completions-interval (default: --eval-interval), the reward weights and options parsed, once, into dicts
    (every registered term's weight), and every term's resolved weight and options (flags_rewards.reward_terms), the
    data values (flags_data.resolve_defaults), the files read (`record_files`). --print-config prints them so too."""
    flags_run.resolve_defaults(args)
    flags_rewards.resolve_defaults(args)
    flags_data.resolve_defaults(args)
    record_files(args)


def record_files(args):
    """What config.json records of the files a run reads besides its model, so that a resume refuses a changed one:
    `data_files` ({role: {"path", "sha256"}} of one's own rows) and `reward_functions` ({name: {"path", "sha256",
    "weight"}} of --reward-function). A file not there is left out here: the checks refuse it."""
    args.data_files = flags_data.own_files(args)
    args.reward_functions = flags_rewards.own_functions(args)


def check_values(args):
    """The errors of flag values and combinations, and of the reward weights (resolve_defaults): none needs torch.
    The ranges each concern declares, then its own checks."""
    resolve_defaults(args)
    for action in build_parser()._actions:  # NaN passes every `x < 0` test below; no flag gives infinity a meaning
        value = getattr(args, action.dest, None)
        if action.type is float and value is not None and not math.isfinite(value):
            raise ValueError(f"{action.option_strings[0]} must be a finite number, got {value}")
    for name in POSITIVE_INTS:  # None: a flag without a default, not given
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in NON_NEGATIVE:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for flag, name, ok, bound in RANGES:
        if not ok(getattr(args, name)):
            raise ValueError(f"{flag} must be {bound}, got {getattr(args, name):g}")
    for check in (flags_data.check_values, flags_pods.check_values, flags_rewards.check_values,
                  flags_update.check_values, flags_run.check_values):
        check(args)


def check_args(args, restarted=False):
    """The errors that need the machine (device, sinks) or the files: the run folder, the data and the model source
    (check_values first; `args.device` resolved)."""
    from run import report
    from run import runfolder

    report.check_report_to(args.report_to)
    _check_device_flags(args)
    runfolder.check_run_dir(args, restarted)
    flags_data.check_data(args)
    flags_rewards.check_functions(args)
    models.check_model_source(args.model, args.max_prompt_tokens, args.max_completion_tokens)  # nothing loaded
    if args.bf16 and not str(args.device).startswith("cuda") and not policy.native_bf16(args.device):
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


# The method label names what a run optimises (compare.py groups runs by it): the rule and n/m, then each flag below
# whose value differs from the preset's default, in this order, worded by its entry ("" adds nothing); then any
# other loss option (loss_options.LossSettings) as "flag value".
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
    inert = {flag_dest(option) for option in inert_loss_options(args)}  # they do nothing: the same method
    for option in LOSS_FLAGS:
        flag = flags_update.loss_flag(option)
        words.setdefault(flag_dest(option), lambda value, args, flag=flag: f"{flag[2:]} {value}")
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

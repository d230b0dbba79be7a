"""train.py's flags of the run around the steps (the "run" and "several GPUs" groups; run/config.py assembles the
parser): the seed, threads, the budget, checkpoints, the held-out evaluation, logging and the run folder, the
collectives' time limit; the values resolved from them (`resolve_defaults`) and their checks (`check_values`)."""

import argparse

# The choices of --report-to, written here so that --help needs no torch (a test keeps them equal to
# report.REPORT_TO).
REPORT_TO = ("none", "tensorboard", "wandb")
NON_NEGATIVE = ("max_steps", "max_time_s", "keep_checkpoints", "eval_interval", "eval_interval_s", "eval_samples",
                "eval_temperature", "num_threads", "log_completions_interval")


def add_flags(group):
    """The run's flags, in --help's order."""
    add = group.add_argument
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


def add_multigpu_flags(group):
    """The flags of several processes (torchrun -m multigpu)."""
    add = group.add_argument
    add("--dist-timeout-s", type=float, default=1800.0,
        help="seconds a collective may wait before the run ends with an error (must exceed one process's "
             "generation)")


def resolve_defaults(args):
    """--log-completions-interval as the run uses it (default: --eval-interval)."""
    sources = args.value_sources
    if args.log_completions_interval is None:
        args.log_completions_interval = args.eval_interval
        sources["log_completions_interval"] = f"--eval-interval ({sources['eval_interval']})"


def check_values(args):
    """The collectives' time limit positive; --report-to one of its choices (a resumed run's config.json value is not
    checked by argparse)."""
    if not args.dist_timeout_s > 0:
        raise ValueError(f"--dist-timeout-s must be > 0, got {args.dist_timeout_s}")
    if args.report_to not in REPORT_TO:  # a resumed run's config.json value is not checked by argparse
        raise ValueError(f"--report-to must be one of {REPORT_TO}, got {args.report_to!r}")

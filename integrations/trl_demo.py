"""The offline demo of train.py run through TRL's GRPOTrainer with PODS (integrations/trl_pods.py), on the CPU.

    python -m integrations.trl_demo --max-steps 10              # PODS 16/4, as `python train.py --max-steps 10`
    python -m integrations.trl_demo --max-steps 10 --baseline   # GRPO 4/4
    python compare.py runs/trl-demo-* runs/demo-*               # both kinds of run folder side by side

It takes train.py's flags that it maps onto TRL (`--help` lists them; config.parse_args resolves them: same presets,
seeds and budget) and loads what train.py loads (run/loop.py's load: the SmolLM2-135M GGUF model with the same LoRA
initialisation, the addition prompts, the held-out prompts, the same AdamW); the held-out evaluation is train.py's
own (run/loop.py's evaluate_heldout, same schedule, same fixed sample and seeds). TRL does the rest: generation
(transformers' generate on all rows of the step at once), scoring with the project's reward functions (the weighted
sum, --reward-options, the completion token ids), and the update (TRL's loss; sequence aggregation = loss_type
"grpo"). The run folder (runs/trl-<preset>-<pods|grpo>-s<seed>-<time>) holds config.json and a metrics.jsonl with
train.py's keys (generate_s, reward_s, select_s, update_s, step_s, elapsed_s, reward; eval/accuracy ...), so
compare.py reads it; --max-time-s ends training as in train.py (no step starts that would likely end past it).
Differences from train.py that remain: TRL draws its own prompt order and sampling seeds; the update runs all kept
rows of a step as one micro-batch when they fit --micro-batch-size (as the demo's do); no checkpoints and no
completions logs are written (so no --resume).

Every other train.py flag is refused in one line before anything loads, whether given or set by the preset to a
value other than train.py's default: the refusals come from train.py's parser (`refusal`), so a flag added to
train.py is refused here until it is mapped (MAPPED) or honoured at the values TRL can run (LIMITED).
"""

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

from run import config  # the flags, parsed and checked before the modules below that load torch
import data
import loss_options
import models
import rewards
from run import checkpoint, report, runfolder
from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): --help and the refusals need none
train = lazy_module("train", globals())
loop = lazy_module("run.loop", globals())  # train.py's loading and held-out evaluation
heldout = lazy_module("eval", globals())  # eval.evaluate: the held-out measurement train.py's loop runs

PROG = "python -m integrations.trl_demo"
LOSS_TYPES = {"sequence": "grpo", "token": "dapo", "fixed": "dr_grpo"}  # --loss-aggregation -> TRL's loss_type
UNLIMITED_STEPS = 2 ** 40  # TRL's max_steps when --max-steps is 0: --max-time-s (or nothing) ends the run

# train.py's flags this demo honours at any value train.py accepts (combinations: `unsupported_combination`).
MAPPED = frozenset((
    "preset", "baseline",
    "model", "lora_rank", "lora_alpha", "lora_target_modules", "gradient_checkpointing",  # loop.load; TRL
    "dataset", "data_dir", "num_train_rows", "one_shot", "prefill_think", "max_prompt_tokens", "system_prompt",
    "num_rollouts", "update_size", "rule", "advantage_normalization", "scale_rewards",  # PODSConfig
    "reward_weights", "reward_options", "reward_function", "reward_function_timeout_s",  # the reward function
    "answer_kind",  # (reward_function)
    "question_field", "answer_field", "prompt_template", "eval_dataset", "eval_fraction",  # loop.load's data
    "prompts_per_step", "loss_aggregation", "mask_truncated",  # PODSConfig
    "learning_rate", "weight_decay", "optimizer", "max_grad_norm",  # loop.load's optimizer (constant rate); TRL
    "bf16",  # loop.load's weights; TRL's autocast where train.py autocasts (full fine-tuning)
    "temperature", "top_p", "max_completion_tokens", "rollout_batch_size", "micro_batch_size",
    "seed", "num_threads", "max_steps", "max_time_s", "eval_interval", "eval_interval_s", "eval_samples",
    "eval_temperature",
    "output_dir", "report_to",  # report.open_metrics sends the metrics lines
))
# Flags honoured at some values only: dest -> (accepts(value), the values in words, the demo's value when the command
# line gives none (None: the preset's or train.py's default, which must then be accepted)).
LIMITED = {
    "device": (lambda value: value == "cpu", "cpu", "cpu"),
    "backend": (lambda value: value in (None, "hf"), "hf (training: TRL generates with transformers' generate; "
                "unset: the held-out evaluation runs on train.py's default backend)", None),
    "checkpoint_interval_s": (lambda value: value < 0, "< 0: the demo writes no checkpoints", -1.0),
    "log_completions_interval": (lambda value: value == 0, "0: the demo writes no completions logs", 0),
}
# Why some refused flags cannot be mapped (the refusal adds it; any other flag: "not mapped onto TRL by this demo").
WHY = {
    "resume": "it writes no checkpoints, so a run cannot be continued: start a new run in another --output-dir",
    "keep_checkpoints": "it writes no checkpoints",
    "importance_sampling_correction": "TRL corrects only vLLM's sampling, which the CPU demo does not use",
    "dynamic_sampling": "TRL has no DAPO refill of zero-spread groups",
    "kl_coef": "TRL's KL term (beta) is not checked against train.py's here, so the demo runs TRL with beta = 0",
    "progress": "it prints a line per step, no bar",
    **{loss_options.flag_name(option).removeprefix("--").replace("-", "_"):
       "it acts on the ratio pi / pi_old alone, which is exactly 1 with the one update per rollout batch this demo runs "
       "(--updates-per-batch is not mapped onto TRL)"
       for option in dataclasses.fields(loss_options.LossSettings) if option.metadata["ratio_only"]},
}


def _one_line_errors(parser):
    """The parser's errors as one line naming this command (config.OneLineParser's, with this program's name)."""
    parser.prog = PROG
    parser.error = lambda message: parser.exit(2, f"trl_demo: error: {message} ({PROG} --help lists the flags it "
                                                  "honours)\n")
    return parser


def demo_parser():
    """train.py's parser with only the flags this demo honours (MAPPED, LIMITED): its --help and its value checks."""
    parser = _one_line_errors(config.build_parser())
    parser.description = ("Train with GRPO or GRPO-PODS through TRL's GRPOTrainer (integrations/trl_pods.py), with the "
                          "train.py flags listed here; the others are refused.")
    parser.epilog = "Defaults not shown here come from --preset, as in train.py."
    for group in parser._action_groups:
        for action in list(group._group_actions):
            if action.dest != "help" and action.dest not in MAPPED | set(LIMITED):
                group._remove_action(action)
                for option in action.option_strings:
                    del parser._option_string_actions[option]
            elif action.dest in LIMITED:
                action.help = f"this demo: only {LIMITED[action.dest][1]}"
    return parser


def _given(argv):
    """The destinations of the train.py flags on the command line (abbreviations and --flag=value included)."""
    parser = _one_line_errors(config.build_parser())
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def refused_flag(given):
    """The one line refusing the first train.py flag on the command line (`given`: their destinations) that this demo
    does not map, or None."""
    for action in config.build_parser()._actions:
        if action.dest in given and action.dest not in MAPPED | set(LIMITED):
            why = ": " + WHY[action.dest] if action.dest in WHY else ""
            return f"{action.option_strings[0]} is not mapped onto TRL by this demo{why}"
    return None


def refusal(args, given=()):
    """The one line refusing resolved flags (config.parse_args) this demo cannot run, or None: a LIMITED flag at a
    value TRL does not run, an unmapped flag (a preset's) other than train.py's default, a combination
    (unsupported_combination). given: the flags on the command line (the others are named as the preset's)."""
    for action in config.build_parser()._actions:
        name, flag = action.dest, (action.option_strings or [action.dest])[0]
        if name == "help" or name in MAPPED:
            continue
        value = getattr(args, name, action.default)
        origin = "" if name in given else f"--preset {args.preset} sets "
        if name in LIMITED:
            accepts, words, _ = LIMITED[name]
            if not accepts(value):
                return f"{origin}{flag} {value} is not mapped onto TRL by this demo (only {words})"
        elif value != action.default:
            why = ": " + WHY[name] if name in WHY else ""
            return f"{origin}{flag} {value}, which is not mapped onto TRL by this demo{why}"
    return unsupported_combination(args)


def unsupported_combination(args):
    """The one line refusing mapped flags whose combination TRL's batch layout or loss cannot run, or None."""
    rows, kept_rows = args.prompts_per_step * args.num_rollouts, args.prompts_per_step * args.update_size
    if kept_rows % args.micro_batch_size:
        return (f"the kept rows of a step ({args.prompts_per_step} x {args.update_size}) must be a multiple of "
                f"--micro-batch-size (now {args.micro_batch_size})")
    if rows % (kept_rows // args.micro_batch_size):  # TRL splits the generated rows as it splits the kept ones
        return (f"the {rows} rows a step generates (--prompts-per-step x --num-rollouts) must split into as many "
                f"equal parts as the kept rows make micro-batches ({kept_rows // args.micro_batch_size}): change "
                "--micro-batch-size")
    if args.rollout_batch_size < rows:
        return (f"--rollout-batch-size {args.rollout_batch_size} is less than the {rows} rows of a step, which TRL "
                f"generates in one call (--prompts-per-step x --num-rollouts): raise it to {rows}")
    return None


def _flag_and_value(name, value):
    """The command-line words that set train.py's flag `name` to `value` (a boolean: --name or --no-name)."""
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, str(value)]


def parse_args(argv=None):
    """The resolved flags (config.parse_args) of a run this demo can map onto TRL; a flag it cannot map is refused
    (ValueError, one line) before anything is loaded or written. --help lists the flags it honours."""
    argv = list(sys.argv[1:] if argv is None else argv)
    known, unknown = demo_parser().parse_known_args(argv)  # --help; bad values of the flags it honours
    given = _given(argv)
    problem = refused_flag(given)
    if problem:
        raise ValueError(problem)
    if unknown:
        demo_parser().error(f"unrecognized arguments: {' '.join(unknown)}")
    metrics = Path(str(known.output_dir)) / checkpoint.METRICS_FILE
    if known.output_dir and metrics.is_file() and metrics.stat().st_size > 0:  # before train.py's advice to resume
        raise ValueError(f"{known.output_dir} already holds a run, which this demo cannot continue (it writes no "
                         f"checkpoints): pass another --output-dir, or delete {metrics} to start it over")
    defaults = [item for name, (_, _, value) in LIMITED.items() if name not in given and value is not None
                for item in _flag_and_value(name, value)]
    with warnings.catch_warnings(record=True) as said:  # shown only for a run that is not refused
        warnings.simplefilter("always")
        args = config.parse_args(argv + defaults, refusal=lambda flags: refusal(flags, given))  # before torch loads
    problem = refusal(args, given)
    if problem:
        raise ValueError(problem)
    for warning in said:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return args


def trl_config(args, run_dir):
    """PODSConfig with the demo's settings: one generation per optimizer step, --micro-batch-size kept rows a pass."""
    from integrations.trl_pods import PODSConfig

    kept_rows = args.prompts_per_step * args.update_size
    micro_batches = kept_rows // args.micro_batch_size
    return PODSConfig(
        output_dir=str(run_dir / "trl"), use_cpu=True, report_to="none", seed=args.seed,
        num_generations=args.num_rollouts, num_generations_kept=args.update_size,
        downsampling_rule=args.rule, advantage_normalization=args.advantage_normalization,
        scale_rewards=args.scale_rewards, beta=0.0, epsilon=args.clip_eps, num_iterations=1,
        loss_type=LOSS_TYPES[args.loss_aggregation], epsilon_high=args.clip_eps_high or args.clip_eps,
        # train.py's precision: its loader gives the weights their dtype; TRL autocasts where train.py does
        bf16=models.compute_dtypes(args.bf16, args.lora_rank)[1] is torch.bfloat16,
        mask_truncated_completions=args.mask_truncated, temperature=args.temperature, top_p=args.top_p, top_k=0,
        max_completion_length=args.max_completion_tokens,
        # transformers' own name: `gradient_checkpointing` is a deprecated alias (a FutureWarning at every start)
        activation_checkpointing=args.gradient_checkpointing, gradient_checkpointing=None,
        # the generation batch is one step's prompts x n rows; it splits into `micro_batches` update passes
        per_device_train_batch_size=args.prompts_per_step * args.num_rollouts // micro_batches,
        gradient_accumulation_steps=micro_batches, max_grad_norm=args.max_grad_norm,
        max_steps=args.max_steps or UNLIMITED_STEPS, logging_steps=1, save_strategy="no", disable_tqdm=True,
        log_level="warning")


def reward_function(args):
    """The project's weighted reward (rewards.compute_rewards: --reward-weights, --reward-options, the token ids of
    each completion, EOS included, as train.py gives them, and every --reward-function of one's own called as TRL
    calls it: the chat messages as prompts, each completion as an assistant message, the dataset's columns by name,
    and TRL's own trainer_state, log_extra and log_metric) as one TRL reward function of the dataset's columns. What
    the functions log goes to TRL's log_extra / log_metric, and each function's mean to log_metric as train.py's
    metrics line names it (rewards/NAME/mean)."""
    settings = config.reward_settings(args)

    def demo_reward(prompts, completions, answer, messages, completion_ids=None, trainer_state=None, log_extra=None,
                    log_metric=None, **kwargs):
        graded = [rewards.graded_completion(text, args.prefill_think) for text in completions]
        columns = {key: value for key, value in kwargs.items() if key not in rewards.RESERVED_KEYWORDS}
        result = rewards.compute_rewards(messages, graded, answer, **rewards.terms_of(settings),
                                         completion_ids=completion_ids, columns=columns, trainer_state=trainer_state)
        for column, values in result.logged_columns.items() if log_extra else ():
            log_extra(column, values)
        for function, name, value in result.logged_metrics if log_metric else ():
            log_metric(name, value)
        for name, value in result.metrics().items() if log_metric else ():
            if name.startswith("rewards/"):
                log_metric(name, value)
        return result.total.tolist()
    return demo_reward


def dataset_rows(examples):
    """TRL's dataset of train.py's prompts (data.Examples): the rendered prompt text (train.py's, prefill included), the
    answer, the chat messages (what the rewards get as prompts) and every other column of the rows by its name."""
    return [{**{key: value for key, value in (e.columns or {}).items() if key not in ("prompt", "answer", "messages")},
             "prompt": e.text, "answer": e.answer, "messages": e.prompt} for e in examples]


def timed_trainer_class():
    """PODSGRPOTrainer that adds up its generation, scoring and selection seconds (train.py's phases) and hands
    each step's logged metrics to `after_log`."""
    from integrations.trl_pods import PODSGRPOTrainer

    class TimedTrainer(PODSGRPOTrainer):
        phase_s = dict.fromkeys(report.PHASE_KEYS[:3], 0.0)
        after_log = None

        def _timed(self, key, call, *args):
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.phase_s[key] += time.perf_counter() - start

        def _generate(self, prompts):
            return self._timed("generate_s", super()._generate, prompts)

        def _calculate_rewards(self, *args):
            return self._timed("reward_s", super()._calculate_rewards, *args)

        def _downsample(self, *args):
            return self._timed("select_s", super()._downsample, *args)

        def log(self, logs, start_time=None):
            super().log(logs, start_time)  # TRL adds its step metrics to `logs`
            if self.after_log and "train_runtime" not in logs:
                self.after_log(logs)

    return TimedTrainer


def step_logger(trainer, args, tokenizer, eval_set, write):
    """(TrainerCallback timing each step, the run's checkpoint.TrainerState, evaluate()). The callback stops training
    as train.py does with --max-time-s: no step starts that would likely end past it (the last step's time taken as
    the next one's). The trainer's after_log then writes train.py's metrics line of the step (update_s = the rest of
    the step, optimizer included) and runs the held-out evaluation every --eval-interval steps (after the step's
    timing: elapsed_s excludes it) every --eval-interval steps or --eval-interval-s training seconds, as train.py
    (loop.evaluation_due)."""
    from transformers import TrainerCallback

    state = checkpoint.TrainerState()

    class StepTimer(TrainerCallback):
        def on_step_begin(self, trl_args, trl_state, control, **kwargs):
            self.start = time.perf_counter()
            trainer.phase_s.update(dict.fromkeys(trainer.phase_s, 0.0))

        def on_step_end(self, trl_args, trl_state, control, **kwargs):
            step_s = time.perf_counter() - self.start
            state.step, state.elapsed_s = trl_state.global_step, state.elapsed_s + step_s
            self.phases = dict(trainer.phase_s, update_s=step_s - sum(trainer.phase_s.values()), step_s=step_s)
            if args.max_time_s and state.elapsed_s + step_s > args.max_time_s:
                control.should_training_stop = True  # TRL still logs this step, then ends training

    timer = StepTimer()

    def evaluate():
        loop.evaluate_heldout(trainer.model, tokenizer, eval_set, args, state, write, train.ONE_PROCESS,  # prints
                              heldout.evaluate)

    def after_log(logs):
        line = {"type": "train", "step": state.step, "elapsed_s": state.elapsed_s, **timer.phases,
                **{key: value for key, value in logs.items() if isinstance(value, (int, float))}}
        write(line)
        print(f"step {state.step}: reward {line.get('reward', float('nan')):.3f}, generate {line['generate_s']:.1f} s, "
              f"update {line['update_s']:.1f} s, step {line['step_s']:.1f} s", flush=True)
        if eval_set and loop.evaluation_due(args, state.step, state.elapsed_s - line["step_s"], state.elapsed_s):
            evaluate()

    trainer.after_log = after_log
    return timer, state, evaluate


def run(args):
    """The demo through TRL (args: parse_args), holding its folder's lock; returns the run folder."""
    problem = refusal(args)
    if problem:
        raise ValueError(problem)
    method = "grpo" if args.rule == "none" else "pods"
    run_dir = Path(args.output_dir or f"runs/trl-{args.preset}-{method}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    # peft and TRL import bitsandbytes, whose CPU kernel probe logs a line, and call what transformers deprecated:
    # quiet as train.py's loading is (the demo runs on the CPU: no 4-bit weights, no 8-bit Adam)
    with runfolder.folder_lock(run_dir), models.quiet_peft():
        return _run(args, run_dir)


def _run(args, run_dir):
    from transformers.trainer_callback import PrinterCallback

    label = "TRL " + config.method_label(args)
    print(report.start_line(label, args, run_dir), flush=True)
    run_config = dict(vars(args), label=label, output_dir=str(run_dir))
    checkpoint.write_text_atomic(run_dir / "config.json", json.dumps(run_config, indent=1, allow_nan=False))
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    tokenizer, train_set, eval_set, model, optimizer = loop.load(args, train.ONE_PROCESS)
    import datasets

    dataset = datasets.Dataset.from_list(dataset_rows(train_set))
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    trainer = timed_trainer_class()(model=model, reward_funcs=reward_function(args), args=trl_config(args, run_dir),
                                    train_dataset=dataset, processing_class=tokenizer,
                                    optimizers=(optimizer, constant))
    trainer.remove_callback(PrinterCallback)
    with report.open_metrics(run_dir, args.report_to, run_config=run_config) as (log, write):
        timer, state, evaluate = step_logger(trainer, args, tokenizer, eval_set, write)
        trainer.add_callback(timer)
        if eval_set:
            evaluate()
        trainer.train()
        if eval_set and state.evaluated_step != state.step:
            evaluate()
    print("\n".join(report.finish_lines(run_dir, args, state.step, state.elapsed_s)))
    return run_dir


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, data.HubUnavailable) as error:  # one line, as train.py's (OSError: the disk)
        sys.exit(f"trl_demo: error: {error}")
    except RuntimeError as error:  # a failed step or sampler: their modules are loaded by then
        import sampling
        import update

        if not isinstance(error, (update.TrainingError, sampling.SamplerError)):
            raise
        sys.exit(f"trl_demo: error: {error}")

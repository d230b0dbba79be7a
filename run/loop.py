"""train.py's loop around the step (paper §4's protocol: a fixed held-out set evaluated during training; the budget
in steps or in training seconds): `train` holds the run folder, `run` loads the prompts and the policy (`load`),
continues from the newest checkpoint (`resume`) or starts, then steps, logs, evaluates (`evaluate_heldout`,
`evaluation_due`) and checkpoints until the budget ends or a signal stops it. Not the method: train.train_step is,
which train.py hands in with the rest of what the loop runs (run/ imports no command).
Simplification: one process's loop; several processes (multigpu/) run this same loop through the seams of
train.OneProcess.
"""

import contextlib
import json
import signal
import sys
import time
import warnings

import torch
from tqdm import tqdm

import data
import models
import policy
import sampling
import update
from grading import trl_call
from run import checkpoint, completions, config, cpu_memory, report, runfolder, signals, threads
from variants import dynamic_sampling

NONFINITE_STOP = 3  # consecutive steps whose update was skipped


def train(args, processes, *, train_step, step_settings, round_strategy, evaluate, cpu_at_start):
    """The training run described by `args` (config.parse_args), holding its folder's lock; returns the run folder.
    What it runs is handed in by train.py (run/ imports no command): processes (train.OneProcess: the seams of several
    processes); train_step(model, tokenizer, optimizer, rounds, settings, step, make_round, processes) -> (the step's
    metrics, its rounds); step_settings(args) -> what every step reads, built once after loading;
    round_strategy(args, processes, draw, say) -> the step's make_round; evaluate: eval.evaluate, the held-out
    measurement; cpu_at_start: threads.sample() before train.py's imports (the thread count is chosen from it)."""
    run_dir = config.run_dir(args)
    with contextlib.ExitStack() as held:
        held.enter_context(runfolder.removed_if_left_empty(run_dir))  # left after the lock is given back
        with runfolder.disk_full_at_start(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            if processes.is_main:
                held.enter_context(runfolder.folder_lock(run_dir))  # one writer
        return run(args, run_dir, processes, train_step=train_step, step_settings=step_settings,
                   round_strategy=round_strategy, evaluate=evaluate, cpu_at_start=cpu_at_start)


def run(args, run_dir, processes, *, train_step, step_settings, round_strategy, evaluate, cpu_at_start):
    """The run in its folder: load, resume or start, then step, log, evaluate and checkpoint until the budget ends
    (the arguments after run_dir: `train`'s)."""
    label = config.method_label(args)
    cpu_threads = threads.choose(args.num_threads, args.device, since=cpu_at_start)
    if processes.is_main:
        print(report.start_line(label, args, run_dir, cpu_threads), flush=True)
        if report.own_rows_line(args):
            print(report.own_rows_line(args), flush=True)
    tokenizer, train_set, eval_set, model, optimizer = load(args, processes)
    cpu_memory.keep_freed_memory(args.device)  # on a CPU a step reuses the pages the step before freed
    if processes.is_main:
        print(models.trainable_line(model), flush=True)
    state = resume(run_dir, model, optimizer, args, processes) if args.resume else checkpoint.TrainerState()
    changed_now = args.changes[-1] if args.changes and args.changes[-1]["step"] is None else None
    if changed_now:  # what this resume changed (config.RECORDED_AT_RESUME), at the step it continues from
        changed_now["step"] = state.step
    run_config = dict(vars(args), label=label, output_dir=str(run_dir))
    if processes.is_main:  # strict JSON: config.parse_args lets no NaN or inf through
        with runfolder.disk_full_at_start(run_dir):
            checkpoint.write_text_atomic(run_dir / "config.json", json.dumps(run_config, indent=1, allow_nan=False))
    saved = (state.step, state.evaluated_step) if args.resume else None  # what the newest checkpoint holds
    start_step = state.step  # evaluations check the sampler until this process's own steps do (evaluate_heldout)
    step_s, accuracy, stop = state.last_step_s, None, None  # a resume foresees its next step as the uninterrupted run
    stuck = 0  # steps in a row that gave the update nothing to learn from (report.learning_signal)
    last_checkpoint_s = state.elapsed_s

    def draw(count):
        """The next `count` training examples of the seeded prompt order (exact resume: state.position is saved)."""
        indices, state.position = checkpoint.next_prompt_indices(len(train_set), count, args.seed, state.position)
        return [train_set[i] for i in indices]

    settings = step_settings(args)  # what every step reads, built once
    make_round = round_strategy(args, processes, draw, lambda line: processes.is_main and tqdm.write(
        f"step {state.step + 1}: {line}", file=sys.stderr))

    def save():
        nonlocal saved, last_checkpoint_s
        state.metrics_bytes = log.tell()  # a resume cuts the log back to this size
        state.sampler_fallback = sampling.fallback_of(model)  # a resume does not go back to an engine it left
        with runfolder.disk_full_said(run_dir, runfolder.checkpoint_bytes(model, optimizer)):
            processes.save_checkpoint(run_dir, state.step, model, optimizer, state, run_config, args.keep_checkpoints)
        saved, last_checkpoint_s = (state.step, state.evaluated_step), state.elapsed_s

    def signalled_stop():  # the signal that reached some process (every process stops at the same point), or None
        return signalled.get("signal", signal.SIGTERM) if processes.total(len(signalled)) else None

    with report.open_metrics(run_dir, args.report_to, keep_bytes=state.metrics_bytes if args.resume else 0,
                             first_step=state.step + 1 if args.resume else 0, run_config=run_config,
                             enabled=processes.is_main) as (log, write), signals.stop_on_signal() as signalled, \
            contextlib.ExitStack() as closing:
        if changed_now:
            write(dict(type="resume", **changed_now))
        if eval_set and state.step == 0 and state.evaluated_step != 0:  # a stop after it saved it already
            if processes.is_main:
                print(f"evaluating {len(eval_set)} held-out prompts at step 0 ...", flush=True)
            accuracy = evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes, evaluate)
        bar = closing.enter_context(report.progress_bar(args, state, label, args.progress and processes.is_main))
        # A step is not started when it would probably end past --max-time-s.
        while not (args.max_steps and state.step >= args.max_steps) and \
                not (args.max_time_s and state.elapsed_s + step_s > args.max_time_s):
            stop = signalled_stop()
            if stop is not None:
                break
            step_start, before_s, cpu_at_step = time.perf_counter(), state.elapsed_s, threads.sample()
            trl_call.advance(settings.rewards.trainer_state, state.step, state.position, len(train_set))  # TRL's view
            rounds = [draw(args.prompts_per_step) for _ in range(args.grad_accum_steps)]  # G prompt lists
            with signals.cuda_oom_hint(args, "the training step"), report.peak_memory_measured(args.device):
                metrics, scored = train_step(model, tokenizer, optimizer, rounds, settings, state.step + 1,
                                             make_round, processes)
            if args.dynamic_sampling:
                metrics.update(dynamic_sampling.step_metrics(scored, sum(map(len, rounds))))
            metrics.update(report.learning_signal(metrics))  # "cannot_learn": nothing to learn from, and why
            stuck = stuck + 1 if "cannot_learn" in metrics else 0
            metrics["num_threads"] = cpu_threads.count  # what the step ran with; the next may run with other
            changed = threads.adjust(cpu_threads, cpu_at_step, "the step")  # a line when the count changes
            notes = report.step_notes(metrics, args, stuck, first=state.step == start_step) + [changed] * bool(changed)
            for line in notes if processes.is_main else []:
                tqdm.write(f"step {state.step + 1}: {line}", file=sys.stderr)  # above the progress bar
            step_s = processes.agree(time.perf_counter() - step_start)
            write(report.record_step(state, metrics, step_s))
            if state.step == start_step + 1 and processes.is_main and (eta := report.eta_line(args, state, step_s)):
                tqdm.write(eta)  # above the progress bar: the machine's pace, at once
            if args.log_completions_interval and state.step % args.log_completions_interval == 0:
                write(completions.completions_record(state.step, scored))  # what PODS kept, and with what advantage
            if state.nonfinite_streak >= NONFINITE_STOP:
                raise update.TrainingError(
                    f"{NONFINITE_STOP} steps in a row (up to step {state.step}) had a non-finite loss or gradient "
                    "norm; none of them changed the weights. Stopping: lower --learning-rate or --max-grad-norm.")
            if eval_set and evaluation_due(args, state.step, before_s, state.elapsed_s):
                accuracy = evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes, evaluate,
                                            check_sampler=False)  # this step's update checked the sampler
            if args.checkpoint_interval_s >= 0 and state.elapsed_s - last_checkpoint_s >= args.checkpoint_interval_s:
                save()
            report.show_progress(bar, args, state, metrics["reward"], accuracy)
        bar.close()
        stop = stop or signalled_stop()  # a signal during the last step: stopped as during any other
        if eval_set and state.evaluated_step != state.step and stop is None:
            evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes, evaluate,
                             check_sampler=state.step == start_step)
            stop = signalled_stop()  # ... or during the final evaluation
        if (args.checkpoint_interval_s >= 0 or stop) and saved != (state.step, state.evaluated_step):
            save()  # the final state, unless saved already
    if stop is not None:
        if processes.is_main:
            print(f"stopped by {signal.Signals(stop).name} after step {state.step}, saved in {run_dir}; continue "
                  f"with --output-dir {run_dir} --resume", file=sys.stderr)
        raise signals.Stopped(128 + stop)
    if processes.is_main:
        fallback = sampling.fallback_reason(model)   # the run left the decode engine: its last line says why
        print("\n".join(report.finish_lines(run_dir, args, state.step, state.elapsed_s)
                        + ([f"  note: the decode engine was left: {fallback}"] if fallback else [])))
    return run_dir


def load(args, processes):
    """(tokenizer, training prompts, held-out prompts (long ones kept, as eval.py does), policy, optimizer)."""
    tokenizer = models.load_tokenizer(args.model)
    common = dict(data_dir=args.data_dir, one_shot=args.one_shot, prefill_think=args.prefill_think,
                  system_prompt=data.system_prompt_of(args.system_prompt), source=config.data_source(args))
    train_set = data.build_prompt_set(args.dataset, "train", tokenizer, num_rows=args.num_train_rows,
                                      max_prompt_tokens=args.max_prompt_tokens, **common)
    if args.prompts_per_step > len(train_set):  # a step would repeat prompts (a typo's count: fill the memory)
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} exceeds the {len(train_set)} training prompts")
    eval_set = data.build_prompt_set(args.dataset, "test", tokenizer, num_rows=args.eval_samples,
                                     **common) if args.eval_samples else []
    torch.manual_seed(args.seed)  # LoRA initialisation; right here, as imports above may draw random numbers
    model = processes.load_policy(args)
    model.train()  # checkpointing acts in training mode; dropout is off where it would run (sampling, update)
    # held-out prompts are not cut to --max-prompt-tokens: the longest of them may be longer
    held_out_tokens = data.prompt_token_counts([e.text for e in eval_set], tokenizer)
    check_held_out_fits(eval_set, held_out_tokens, args, policy.hf_model(model).config)
    longest = max([args.max_prompt_tokens] + held_out_tokens)
    models.check_generation_fits(model, args.rollout_batch_size, longest + args.max_completion_tokens,
                                 f"--rollout-batch-size (now {args.rollout_batch_size}) or --max-completion-tokens "
                                 f"(now {args.max_completion_tokens})")
    optimizer = update.make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)
    return tokenizer, train_set, eval_set, model, optimizer


def check_held_out_fits(eval_set, tokens, args, model_config):
    """Held-out prompts are kept whatever their length (eval.py's too), so one whose tokens and a completion exceed
    the model's positions is refused, naming its file and question (no flag could make it fit)."""
    limit = getattr(model_config, "max_position_embeddings", None)
    over = [i for i, count in enumerate(tokens) if limit and count + args.max_completion_tokens > limit]
    if over:
        where = f"--eval-dataset {args.eval_dataset}" if args.eval_dataset else f"--dataset {args.dataset}"
        question = " ".join(eval_set[over[0]].columns.get("question", "").split())
        question = question[:60] + ("..." if len(question) > 60 else "")
        raise ValueError(f"{where}: a held-out row's prompt is {tokens[over[0]]} tokens, which with "
                         f"--max-completion-tokens {args.max_completion_tokens} exceed the model's {limit} positions "
                         f"(question {question!r}; {len(over)} such rows): shorten or remove them")


def evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes, measure, check_sampler=True):
    """Held-out accuracy of the current policy by `measure` (eval.evaluate, the measurement, which train.py passes in:
    run/ imports no command), logged (fixed sample and seed: runs are compared paired). check_sampler: eval.py's
    check of 8 rows of the first chunk (a forward pass; all 64 of the demo's took ~4 s on 2 cores); run() makes it
    only before this process's first training step, as every step's update checks the sampler after."""
    examples, first_chunk, chunk = processes.eval_share(eval_set, args.rollout_batch_size)
    settings = config.generation_settings(args, temperature=args.eval_temperature, rollout_batch_size=chunk)
    samples = []  # graded completions, for the completions log
    with processes.full_weights(model), signals.cuda_oom_hint(args, "evaluation"):
        result = measure(model, tokenizer, [e.text for e in examples], [e.answer for e in examples],
                         settings, seed=first_chunk, samples_out=samples, check_sampler=check_sampler,
                         answer_kind=args.answer_kind)
    result = processes.merged(result)
    if processes.is_main:
        tqdm.write(report.eval_line(state.step, result))  # above the progress bar
    if args.log_completions_interval:
        write(completions.eval_completions_record(state.step, samples[:completions.EVAL_COMPLETIONS_LOGGED]))
    state.evaluated_step = state.step
    write({"type": "eval", "step": state.step, "elapsed_s": state.elapsed_s, "eval/accuracy": result.accuracy,
           "eval/format_accuracy": result.format_accuracy, "eval/both_accuracy": result.both_accuracy,
           "eval/mean_completion_length": result.mean_completion_length, "eval/num_samples": result.num_samples,
           "eval/grader_timeouts": result.grader_timeouts, "eval/eval_s": result.elapsed_s})
    return result.accuracy


def evaluation_due(args, step, before_s, after_s):
    """Whether the step that took the training seconds from before_s to after_s ends with an evaluation: every
    --eval-interval steps, or (--eval-interval-s S) when it crossed a multiple of S. Both come from the run's state,
    so a resumed run keeps the cadence of the run it continues."""
    by_step = args.eval_interval and step % args.eval_interval == 0
    by_time = args.eval_interval_s and after_s // args.eval_interval_s > before_s // args.eval_interval_s
    return bool(by_step or by_time)


def resume(run_dir, model, optimizer, args, processes):
    """The TrainerState of the run's newest readable checkpoint, with model, optimizer and RNG restored."""
    path, skipped = runfolder.newest_checkpoint(run_dir)
    if path is None:
        raise ValueError(f"--resume: no readable checkpoint in {run_dir}: " + "; ".join(why for _, why in skipped))
    state = checkpoint.TrainerState.from_saved(processes.load_checkpoint(path, model, optimizer))
    update.set_hyperparameters(optimizer, args.learning_rate, args.weight_decay)  # this run's flags win
    if state.sampler_fallback and args.backend is None:  # the engine the run left stays left (--backend: as asked)
        backend, why = state.sampler_fallback
        with warnings.catch_warnings():  # one line, below, instead of fall_back's warning
            warnings.simplefilter("ignore")
            sampling.fall_back(model, backend, why)
    if processes.is_main:
        for passed, why in skipped:
            print(f"passed over {passed}: {why}", file=sys.stderr)
        restored = checkpoint.check_metrics_log(run_dir, path, state.metrics_bytes)  # cut or deleted: restored
        if restored:
            print(restored, file=sys.stderr)
        print(f"resumed {path} (step {state.step}, {state.elapsed_s:.0f} s of training)")
        if state.sampler_fallback and args.backend is None:
            print(f"generating with {sampling.BACKEND_NAMES[state.sampler_fallback[0]]}, as before the checkpoint: "
                  f"{state.sampler_fallback[1]}")
    return state

"""Train an LLM with GRPO or GRPO-PODS (paper Algorithm 1, §3.1-3.2) on one device.

    python train.py                          # offline CPU demo: SmolLM2-135M learns addition, PODS 16/4
    python train.py --baseline               # its GRPO baseline (n = m = 4)
    python train.py --preset a [--baseline]  # paper setting (a): Qwen2.5-3B-Instruct on GSM8K, PODS 64/16

One step (`train_step`): n rollouts per prompt -> rewards -> keep m per prompt by the rule, advantages over the kept
ones -> clipped GRPO update. The run (`train`): load, then step, log, evaluate and checkpoint until the budget ends.
Simplifications: a constant learning rate; rule-based rewards only; our own decode engine or HF generate (no vLLM).
Several GPUs (settings (e), (f)): `torchrun ... -m multigpu` runs this same loop through the seams of `OneProcess`.
Flags: config.py; presets: presets.py; the run folder and its checkpoints: checkpoint.py; more in docs/training.md.
"""

import os
import sys

from run import config  # the flags; importing it loads no torch

if __name__ == "__main__":  # the flags parsed and checked before the imports below, which take seconds
    if "RANK" in os.environ:  # started by torchrun
        sys.exit("train.py: error: train.py runs one process; under torchrun run the multigpu package instead, "
                 "e.g. torchrun --nproc-per-node 8 -m multigpu --preset e")
    ARGS = config.parse_args_or_exit("train.py")

import contextlib
import json
import signal
import threading
import time
import warnings
from dataclasses import dataclass

import torch
from tqdm import tqdm

from run import checkpoint
from run import completions
import data
from variants import dynamic_sampling
import eval as heldout
from grading import grader
import models
import pods
from run import report
import rewards
from engine import rollout_check
from run import runfolder
import sampling
import update

NONFINITE_STOP = 3  # consecutive steps whose update was skipped
SELECTION_STREAM = 0x5E1EC7  # the random rule's seeds: derived_seed(batch seed, this, first chunk), no chunk's seed


class Stopped(SystemExit):
    """The run stopped on SIGTERM or SIGINT after checkpointing its last completed step; exit status 128 + signal."""


class OneProcess:
    """The seams where a run on several processes (multigpu/: torchrun + FSDP2) differs from this one-process run.
    multigpu fills each in; here each does nothing, so the loop reads as if they were not there."""
    is_main = True  # the process that writes the run folder and prints

    def load_policy(self, args):
        """The policy the flags describe (multigpu: loaded on the CPU, then sharded with FSDP2)."""
        return models.load_policy(args.model, dtype=models.compute_dtypes(args.bf16, args.lora_rank)[0],
                                  device=args.device, **config.model_options(args))

    def share(self, examples, rows_per_example, chunk_rows, sizes=None):
        """(this process's examples of a rollout batch, the index of its first generation chunk); sizes: how many
        each process takes, in process order (None: as many each)."""
        return examples, 0

    def counts(self, value):
        """Every process's value, in process order: the groups with a spread each holds (--dynamic-sampling)."""
        return [value]

    def eval_share(self, examples, chunk_prompts):
        """(this process's held-out examples, the index of its first chunk, prompts per chunk)."""
        return examples, 0, chunk_prompts

    def full_weights(self, model):
        """The block generates (multigpu: the full weights gathered once for it)."""
        return contextlib.nullcontext()

    def total(self, value):
        """A number summed over processes: the loss normaliser and the loss (update.update_policy), stop signals."""
        return value

    def merged(self, record):
        """A step's (scored rounds, update metrics, costs), or an evaluation result, of every process as one."""
        return record

    def agree(self, value):
        """Process 0's value: the step time that the budget, evaluation and checkpoint decisions follow."""
        return value

    def save_checkpoint(self, run_dir, step, model, optimizer, state, run_config, keep_last):
        with models.quiet_loading():  # no "Writing model shards" bar at every checkpoint of full fine-tuning
            return checkpoint.save_checkpoint(run_dir, step, model, optimizer, state, run_config, keep_last)

    def load_checkpoint(self, path, model, optimizer):
        return checkpoint.load_checkpoint(path, model, optimizer)


@contextlib.contextmanager
def cuda_oom_hint(args, phase):
    """Re-raise CUDA OOM naming the flags that bound the memory of each phase."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        raise update.TrainingError(f"CUDA out of memory during {phase}. Lower --rollout-batch-size (now "
                                   f"{args.rollout_batch_size}) for generation/evaluation or --micro-batch-size (now "
                                   f"{args.micro_batch_size}) for the update; --gradient-checkpointing and "
                                   "--load-in-4bit also help.") from error


@contextlib.contextmanager
def stop_on_signal():
    """SIGTERM (a cluster preempting the job) or SIGINT (Ctrl-C) asks the run to stop at the next step boundary: the
    yielded dict gets the signal's number; a second signal exits at once (the last checkpoint stays intact). The
    previous handlers come back afterwards. Outside the main thread no handler can be set: nothing is caught."""
    requested = {}

    def handler(signum, frame):
        if requested:
            raise SystemExit(128 + signum)
        requested["signal"] = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint (again: stop now)",
              file=sys.stderr, flush=True)

    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ------------------------------------------------------------------------------------------ one step

def score(rollouts, examples, args):
    """(rewards.RewardResult, [P, n] weighted rewards) of every rollout; a prefilled "<think>\\n" is graded too."""
    rows = rollouts.prompt_index.tolist()
    completion_ids = [ids[:length] for ids, length in zip(rollouts.completion_ids.tolist(), rollouts.lengths.tolist())]
    result = rewards.compute_rewards([examples[i].prompt for i in rows],
                                     [data.graded_completion(text, args.prefill_think) for text in rollouts.texts],
                                     [examples[i].answer for i in rows], weights=args.reward_weights,
                                     options=args.reward_options, completion_ids=completion_ids)
    n = len(rows) // len(examples) if examples else args.num_rollouts  # none: a refill only other processes needed
    return result, result.total.view(len(examples), n)


@dataclass
class Generated:
    """One generation round of a rollout batch: P prompts x n rollouts, scored."""
    examples: list                  # [P] data.Example
    rollouts: sampling.Rollouts
    rewards: torch.Tensor           # [P, n] weighted total
    per_func: dict                  # reward function -> [P*n] (NaN: not applicable)
    first_chunk: int                # this process's first generation chunk (its rollouts' seeds)
    filtered: torch.Tensor = None   # [P] bool: no reward spread, set aside by --dynamic-sampling; None: none
    set_aside: torch.Tensor = None  # [P] bool: a spread, but left out to even out the processes' rows; None: none
    grader_timeouts: torch.Tensor = None  # [P*n] bool: accuracy scored 0 for want of a verdict; None: none

    def __post_init__(self):
        for name in ("filtered", "set_aside"):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(self.rewards.shape[0], dtype=torch.bool))
        if self.grader_timeouts is None:
            self.grader_timeouts = torch.zeros(self.rewards.numel(), dtype=torch.bool)

    @property
    def entered(self):
        """[P] bool: the groups the selection rule sees."""
        return ~(self.filtered | self.set_aside)


def generate_and_score(model, tokenizer, examples, args, seed, costs, processes, sizes=None):
    """n rollouts per prompt of this process's share of `examples` (sizes: processes.share), scored: a Generated."""
    examples, first_chunk = processes.share(examples, args.num_rollouts, args.rollout_batch_size, sizes)
    with report.timed(costs, "generate_s"), cuda_oom_hint(args, "generation"):  # n rollouts per prompt
        rollouts = sampling.generate_rollouts(model, tokenizer, [e.text for e in examples], args.num_rollouts,
                                              config.generation_settings(args), seed, first_chunk) if examples \
            else dynamic_sampling.no_rollouts()  # a --dynamic-sampling refill only other processes needed
    with report.timed(costs, "reward_s"):
        result, reward_matrix = score(rollouts, examples, args)
    return Generated(examples, rollouts, reward_matrix, result.per_func, first_chunk,
                     grader_timeouts=result.grader_timeouts)


def train_step(model, tokenizer, optimizer, rounds, args, step, processes=OneProcess(), draw=None):
    """One training step on `rounds`: G lists of data.Example (G = --grad-accum-steps, usually 1), each generated,
    scored and down-sampled, then one update (mu optimizer steps) on every kept rollout -> (the step's metrics, its
    report.ScoredRounds: every rollout with its rewards, whether it was kept and its advantage). The update's
    log-probs check the sampler's before the optimizer step (rollout_check.check: off-policy engine rollouts are not
    trained on, and generation switches to HF). With --dynamic-sampling, `draw(count)` gives the next `count`
    examples of the prompt order for the refills."""
    costs = dict.fromkeys(report.PHASE_KEYS, 0.0)
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    if args.dynamic_sampling and draw is None:
        raise ValueError("train_step with --dynamic-sampling needs draw(count), the next examples of the prompt order")

    def say(line):  # above the progress bar, from the main process
        if processes.is_main:
            tqdm.write(f"step {step}: {line}", file=sys.stderr)

    settings = config.update_settings(args)
    scored, batches, batch_rounds, backends = [], [], [], set()
    with processes.full_weights(model):
        for round_index, examples in enumerate(rounds):
            seed = sampling.derived_seed(args.seed, step, round_index)  # a resumed step draws what it drew before
            generated = [generate_and_score(model, tokenizer, examples, args, seed, costs, processes)]
            rewards_seen = generated[0].rewards
            if args.dynamic_sampling:  # DAPO: groups without a spread set aside, more prompts drawn in their place
                def more(missing, refill_round, seed=seed):  # `missing`: each process's groups still lacking
                    return generate_and_score(model, tokenizer, draw(sum(missing)), args,
                                              sampling.derived_seed(seed, refill_round), costs, processes, missing)
                generated = dynamic_sampling.refill(generated[0], more, len(generated[0].examples),
                                                    args.dynamic_sampling_metric, args.max_generation_rounds,
                                                    processes.counts, say)
                rewards_seen = dynamic_sampling.entered_rewards(generated)
            backends.update(part.rollouts.backend for part in generated if part.examples)
            with report.timed(costs, "select_s"):  # PODS: keep m of n, advantages over the kept subset (§3.2)
                kept, advantages, dropped = pods.select(
                    rewards_seen, args.update_size, args.rule, normalize=args.advantage_normalization,
                    scale_rewards=args.scale_rewards, scope=args.selection_scope,
                    drop_zero_variance=args.drop_zero_variance,
                    generator=torch.Generator().manual_seed(selection_seed(seed, generated[0].first_chunk)))
            if args.dynamic_sampling:  # the kept rows mapped back onto each round, joined into one update batch
                part_batches = dynamic_sampling.kept_batches(generated, kept, advantages)
                batches.append(dynamic_sampling.join([batch for batch, _ in part_batches], tokenizer.pad_token_id or 0))
            else:
                batches.append(update.kept_batch(generated[0].rollouts, kept, advantages))
                part_batches = [(batches[-1], update.kept_rows(kept, args.num_rollouts))]
            batch_rounds.append([])
            for part, (batch, kept_rows) in zip(generated, part_batches):
                batch_rounds[-1].append(report.ScoredRound.of(part.rollouts, part.examples, part.rewards,
                                                              part.per_func, kept_rows, batch.advantages, dropped,
                                                              part.filtered, part.set_aside, part.grader_timeouts))
                dropped = 0  # counted once per rollout batch
            scored += batch_rounds[-1]
    # Rollouts of the decode engine are checked before the optimizer step: off-policy ones are not trained on.
    engine_made = processes.total(int(any(backend != "hf" for backend in backends))) > 0
    with report.timed(costs, "update_s"), cuda_oom_hint(args, "the update"):  # the clipped GRPO loss, mu steps
        update.fill_logprobs(model, batches, settings)
        result = update.update_policy(model, optimizer, batches, settings, sum_over_processes=processes.total,
                                      max_sampler_gap=rollout_check.LOGPROB_GAP_LIMIT if engine_made else None)
    for rounds_of_batch, ratios in zip(batch_rounds, result.sampler_ratios or []):  # for the completions log
        for scored_round, part in zip(rounds_of_batch, ratios.split([len(s.kept_rows) for s in rounds_of_batch])):
            scored_round.sampler_ratios[scored_round.kept_rows] = part
    costs["peak_mem_gib"] = update.peak_memory_gib(args.device)
    scored, result, costs = processes.merged((scored, result, costs))
    metrics = report.step_metrics(scored, result, optimizer, costs, args.mask_truncated)
    if args.dynamic_sampling:
        metrics.update(dynamic_sampling.step_metrics(scored, sum(map(len, rounds))))
    if metrics["rewards/grader_timeouts"]:  # possibly wrong rewards, said where the run is watched
        say(f"{metrics['rewards/grader_timeouts']} completions scored accuracy 0 because their answer comparison "
            f"timed out twice ({rewards.VERIFY_TIMEOUT_S:g} s, then {grader.RETRY_FACTOR}x, of the grader's CPU "
            "time): rewards/grader_timeouts")
    if result.rows == 0:  # the update_rows 0 of its metrics line, said where the run is watched
        say("trained nothing: " + ("no group had a reward spread within --max-generation-rounds" if
                                   args.dynamic_sampling else "every prompt was dropped") + " (no optimizer step)")
    # Did the rollouts come from the policy? The update's log-probs against the sampler's (rollout_check.py).
    metrics["sampler/engine"] = float("hf" not in backends)
    fast = next((backend for backend in sorted(backends) if backend != "hf"), "hf")
    if result.sampler_gap is not None and (fallback := rollout_check.check(model, result.sampler_gap, fast,
                                                                           args.backend, f"step {step}",
                                                                           result.sampler_rejected)):
        metrics["sampler/fallback"] = fallback
    return metrics, scored


def selection_seed(batch_seed, first_chunk):
    """The seed of the random rule's generator for a rollout batch: a stream of its own, apart from every generation
    chunk's (sampling.derived_seed(batch_seed, chunk)) and refill round's, yet fixed by the batch (a resume redraws
    it)."""
    return sampling.derived_seed(batch_seed, SELECTION_STREAM, first_chunk)


# ------------------------------------------------------------------------------------------ the run

def load(args, processes):
    """(tokenizer, training prompts, held-out prompts (long ones kept, as eval.py does), policy, optimizer)."""
    tokenizer = models.load_tokenizer(args.model)
    common = dict(data_dir=args.data_dir, one_shot=args.one_shot, prefill_think=args.prefill_think,
                  system_prompt=data.system_prompt_of(args.system_prompt))
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
    longest = max([args.max_prompt_tokens] + data.prompt_token_counts([e.text for e in eval_set], tokenizer))
    sampling.check_generation_fits(model, args.rollout_batch_size, longest + args.max_completion_tokens,
                                   f"--rollout-batch-size (now {args.rollout_batch_size}) or --max-completion-tokens "
                                   f"(now {args.max_completion_tokens})")
    optimizer = update.make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)
    return tokenizer, train_set, eval_set, model, optimizer


def evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes, check_sampler=True):
    """Held-out accuracy of the current policy, logged (fixed sample and seed: runs are compared paired).
    check_sampler: eval.py's check of the first chunk (a forward pass, ~14 s for 64 demo prompts on 2 cores); run()
    makes it only before this process's first training step, as every step's update checks the sampler after."""
    examples, first_chunk, chunk = processes.eval_share(eval_set, args.rollout_batch_size)
    settings = config.generation_settings(args, temperature=args.eval_temperature, rollout_batch_size=chunk)
    samples = []  # graded completions, for the completions log
    with processes.full_weights(model), cuda_oom_hint(args, "evaluation"):
        result = heldout.evaluate(model, tokenizer, [e.text for e in examples], [e.answer for e in examples],
                                  settings, seed=first_chunk, samples_out=samples, check_sampler=check_sampler)
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


def train(args, processes=OneProcess()):
    """The training run described by `args` (config.parse_args), holding its folder's lock; returns the run folder."""
    run_dir = config.run_dir(args)
    with contextlib.ExitStack() as held:
        with runfolder.disk_full_at_start(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            if processes.is_main:
                held.enter_context(runfolder.folder_lock(run_dir))  # one writer
        return run(args, run_dir, processes)


def run(args, run_dir, processes):
    """The run in its folder: load, resume or start, then step, log, evaluate and checkpoint until the budget ends."""
    label = config.method_label(args)
    if processes.is_main:
        print(report.start_line(label, args, run_dir), flush=True)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    tokenizer, train_set, eval_set, model, optimizer = load(args, processes)
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
    last_checkpoint_s = state.elapsed_s

    def draw(count):
        """The next `count` training examples of the seeded prompt order (exact resume: state.position is saved)."""
        indices, state.position = checkpoint.next_prompt_indices(len(train_set), count, args.seed, state.position)
        return [train_set[i] for i in indices]

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
                             enabled=processes.is_main) as (log, write), stop_on_signal() as signalled, \
            contextlib.ExitStack() as closing:
        if changed_now:
            write(dict(type="resume", **changed_now))
        if eval_set and state.step == 0 and state.evaluated_step != 0:  # a stop after it saved it already
            if processes.is_main:
                print(f"evaluating {len(eval_set)} held-out prompts at step 0 ...", flush=True)
            accuracy = evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes)
        bar = closing.enter_context(report.progress_bar(args, state, label, args.progress and processes.is_main))
        # A step is not started when it would probably end past --max-time-s.
        while not (args.max_steps and state.step >= args.max_steps) and \
                not (args.max_time_s and state.elapsed_s + step_s > args.max_time_s):
            stop = signalled_stop()
            if stop is not None:
                break
            step_start, before_s = time.perf_counter(), state.elapsed_s
            rounds = [draw(args.prompts_per_step) for _ in range(args.grad_accum_steps)]  # G prompt lists
            metrics, scored = train_step(model, tokenizer, optimizer, rounds, args, state.step + 1, processes, draw)
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
                accuracy = evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes,
                                            check_sampler=False)  # this step's update checked the sampler
            if args.checkpoint_interval_s >= 0 and state.elapsed_s - last_checkpoint_s >= args.checkpoint_interval_s:
                save()
            report.show_progress(bar, args, state, metrics["reward"], accuracy)
        bar.close()
        stop = stop or signalled_stop()  # a signal during the last step: stopped as during any other
        if eval_set and state.evaluated_step != state.step and stop is None:
            evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes,
                             check_sampler=state.step == start_step)
            stop = signalled_stop()  # ... or during the final evaluation
        if (args.checkpoint_interval_s >= 0 or stop) and saved != (state.step, state.evaluated_step):
            save()  # the final state, unless saved already
    if stop is not None:
        if processes.is_main:
            print(f"stopped by {signal.Signals(stop).name} after step {state.step}, saved in {run_dir}; continue "
                  f"with --output-dir {run_dir} --resume", file=sys.stderr)
        raise Stopped(128 + stop)
    if processes.is_main:
        fallback = sampling.fallback_reason(model)   # the run left the decode engine: its last line says why
        print("\n".join(report.finish_lines(run_dir, args, state.step, state.elapsed_s)
                        + ([f"  note: the decode engine was left: {fallback}"] if fallback else [])))
    return run_dir


def main(argv=None):
    return train(config.parse_args(argv))


if __name__ == "__main__":
    try:
        train(ARGS)
    except (ValueError, OSError, update.TrainingError, data.HubUnavailable,
            sampling.SamplerError) as error:  # one line (OSError: the disk)
        sys.exit(f"train.py: error: {error}")

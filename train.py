"""Train an LLM with GRPO or GRPO-PODS (paper Algorithm 1, §3.1-3.2) on one device.

    python train.py                          # offline CPU demo: SmolLM2-135M learns addition, PODS 16/4
    python train.py --baseline               # its GRPO baseline (n = m = 4)
    python train.py --preset a [--baseline]  # paper setting (a): Qwen2.5-3B-Instruct on GSM8K, PODS 64/16

One step (`train_step`): n rollouts per prompt -> rewards -> keep m per prompt by the rule, advantages over the kept
ones -> clipped GRPO update. The run (`train`): load, then step, log, evaluate and checkpoint until the budget ends.
Simplifications: a constant learning rate; rule-based rewards only; our own decode engine or HF generate (no vLLM).
Several GPUs (settings (e), (f)): `torchrun ... -m multigpu` runs this same loop through the seams of `OneProcess`.
The run around the step (flags, presets, checkpoints, the run folder, the metrics line): run/; more in docs/training.md.
"""

import os
import sys

from run import config  # the flags; importing it loads no torch
from run import threads

CPU_AT_START = threads.sample()  # the other work the imports below run beside: the thread count is chosen from it

if __name__ == "__main__":  # the flags parsed and checked before the imports below, which take seconds
    if "RANK" in os.environ:  # started by torchrun
        sys.exit("train.py: error: train.py runs one process; under torchrun run the multigpu package instead, "
                 "e.g. torchrun --nproc-per-node 8 -m multigpu --preset e")
    ARGS = config.parse_args_or_exit("train.py")

import contextlib
import json
import math
import signal
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

import data
import eval as heldout
import models
import pods
import rewards
import sampling
import update
from engine import rollout_check
from grading import trl_call
from run import checkpoint, completions, report, runfolder, signals
from run.loop import evaluate_heldout, evaluation_due, load, resume  # the loop's parts around the step
from run.metrics import PHASE_KEYS, step_metrics
from stopwatch import timed
from variants import dynamic_sampling

NONFINITE_STOP = 3  # consecutive steps whose update was skipped
SELECTION_STREAM = 0x5E1EC7  # the random rule's seeds: derived_seed(batch seed, this, first chunk), no chunk's seed


class OneProcess:
    """The seams where a run on several processes (multigpu/: torchrun + FSDP2) differs from this one-process run.
    multigpu fills each in; here each does nothing, so the loop reads as if they were not there."""
    is_main = True  # the process that writes the run folder and prints

    def load_policy(self, args):
        """The policy the flags describe (multigpu: loaded on the CPU, then sharded with FSDP2)."""
        return models.load_policy(args.model, dtype=models.compute_dtypes(args.bf16, args.lora_rank)[0],
                                  device=args.device, **config.model_options(args))

    def rounds(self, make_round):
        """The round strategy of this process (multigpu: each process generates its share of the prompts)."""
        return make_round

    def counts(self, value):
        """Every process's value, in process order: the groups with a spread each holds (--dynamic-sampling)."""
        return [value]

    def eval_share(self, examples, chunk_prompts):
        """(this process's held-out examples, the index of its first chunk, prompts per chunk)."""
        return examples, 0, chunk_prompts

    def full_weights(self, model):
        """The block generates: a step's rounds, an evaluation (multigpu: the full weights gathered once for it)."""
        return contextlib.nullcontext()

    def total(self, value):
        """A number summed over processes: the loss normaliser and the loss (update.update_policy), stop signals."""
        return value

    def merged(self, record):
        """A step's (rounds, update metrics, costs), or an evaluation result, of every process as one."""
        return record

    def agree(self, value):
        """Process 0's value: the step time that the budget, evaluation and checkpoint decisions follow."""
        return value

    def save_checkpoint(self, run_dir, step, model, optimizer, state, run_config, keep_last):
        with models.quiet_loading():  # no "Writing model shards" bar at every checkpoint of full fine-tuning
            return checkpoint.save_checkpoint(run_dir, step, model, optimizer, state, run_config, keep_last)

    def load_checkpoint(self, path, model, optimizer):
        return checkpoint.load_checkpoint(path, model, optimizer)


ONE_PROCESS = OneProcess()


# ------------------------------------------------------------------------------------------ one step

@dataclass(frozen=True)
class StepSettings:
    """Everything a training step reads, built once per run from the flags (`step_settings`)."""
    seed: int
    num_rollouts: int                       # n
    generation: sampling.GenerationSettings
    rewards: rewards.RewardSettings
    select: pods.SelectSettings             # m, the rule, the advantages' normalisation
    update: update.UpdateSettings           # micro-batches, mu, the loss's options
    device: str = "cpu"


@dataclass
class Round:
    """One generation round: P prompts x n rollouts, filled as the step goes (rewards, then the rows PODS kept and
    their advantages, then each kept row's sampler ratio from the update). The metrics line and the completions log
    read it."""
    examples: list                  # [P] data.Example
    rollouts: sampling.Rollouts     # row i*n + j: rollout j of prompt i
    rewards: torch.Tensor           # [P, n] weighted total: what the selection rule sees
    per_func: dict                  # reward term -> [P*n] (NaN: not applicable)
    grader_timeouts: torch.Tensor | None  # [P*n] bool: accuracy scored 0, its comparison timed out twice
    first_chunk: int = 0            # this process's first generation chunk (its rollouts' seeds)
    kept_rows: torch.Tensor = None  # [R] rows trained on
    advantages: torch.Tensor = None  # [P*n] the advantage the loss used (NaN: not kept)
    zero_variance_dropped: int = 0  # prompts left out by --drop-zero-variance
    sampler_ratios: torch.Tensor = None  # [P*n] a kept row's mean pi / pi_sampler over its tokens (NaN: not kept)
    logged_columns: list = None     # [P*n] {column: value} the reward functions gave log_extra
    logged_metrics: list = None     # (function, name, value) the reward functions gave log_metric
    marks: dict = None              # name -> [P] bool, on each prompt's row of the completions log (--dynamic-sampling)

    def __post_init__(self):
        num_prompts, n = self.rewards.shape
        self.kept_rows = torch.zeros(0, dtype=torch.long) if self.kept_rows is None else self.kept_rows
        if self.grader_timeouts is None:  # a reward function of no answer comparison
            self.grader_timeouts = torch.zeros(num_prompts * n, dtype=torch.bool)
        for name in ("advantages", "sampler_ratios"):
            if getattr(self, name) is None:
                setattr(self, name, torch.full((num_prompts * n,), math.nan))
        self.logged_columns = self.logged_columns or [{} for _ in range(num_prompts * n)]
        self.logged_metrics, self.marks = self.logged_metrics or [], self.marks or {}

    @property
    def prompts(self):
        return [e.text for e in self.examples]

    @property
    def answers(self):
        return [e.answer for e in self.examples]

    @property
    def lengths(self):  # [P*n] completion tokens
        return self.rollouts.lengths

    @property
    def truncated(self):  # [P*n] bool: no EOS within the budget
        return self.rollouts.truncated

    @property
    def texts(self):  # [P*n] completions
        return self.rollouts.texts

    @property
    def prompt_tokens(self):  # tokens of the P prompts, x n (each rollout re-reads its prompt)
        return int(self.rollouts.prompt_mask.sum()) * self.rewards.shape[1]

    @property
    def backends(self):  # the backend that generated the rollouts (none: no prompt)
        return [self.rollouts.backend] if self.examples else []

    @property
    def parts(self):
        """The generation rounds this round is made of: itself."""
        return [self]

    def keep(self, kept, advantages, zero_variance_dropped=0):
        """Record pods.select's choice: kept [P, m] indices, a [P, n] mask or a row list [R], advantages one per kept
        rollout ([P, m] or [R]), or [P, n] read at the mask."""
        self.kept_rows = update.kept_rows(kept, self.rewards.shape[1])
        kept_advantages = advantages[kept] if kept.dtype == torch.bool else advantages
        self.advantages[self.kept_rows] = kept_advantages.flatten().float().cpu()
        self.zero_variance_dropped = zero_variance_dropped

    def update_batch(self):
        """The kept rollouts as an update.UpdateBatch."""
        return update.kept_batch(self.rollouts, self.kept_rows, self.advantages[self.kept_rows])

    def record_sampler_ratios(self, ratios):
        """The update's [R] mean pi / pi_sampler of each kept row, for the completions log."""
        self.sampler_ratios[self.kept_rows] = ratios


def rollout_round(model, tokenizer, examples, settings, seed, costs, sizes=None, first_chunk=0):
    """PODS's generation and rewards: n rollouts per prompt of `examples`, scored, as a Round (sizes: see
    OneProcess.rounds; one process generates every example)."""
    with timed(costs, "generate_s"):  # n rollouts per prompt (the decode engine, or HF generate())
        rollouts = sampling.generate_rollouts(model, tokenizer, [e.text for e in examples], settings.num_rollouts,
                                              settings.generation, seed, first_chunk)
    with timed(costs, "reward_s"):  # accuracy, format and tag count, weighted (paper Appendix A.1)
        return scored_round(examples, rollouts, settings, first_chunk)


def scored_round(examples, rollouts, settings, first_chunk=0):
    """The Round of `rollouts` (n per prompt of `examples`, none for none) with their rewards (settings: a
    StepSettings)."""
    scores = rewards.score_rollouts(rollouts, examples, settings.rewards)
    logged_columns = [{column: values[row] for column, values in scores.logged_columns.items()}
                      for row in range(len(rollouts.texts))]
    return Round(examples, rollouts, scores.total.view(len(examples), settings.num_rollouts), scores.per_func,
                 scores.grader_timeouts, first_chunk, logged_columns=logged_columns,
                 logged_metrics=scores.logged_metrics)


def train_step(model, tokenizer, optimizer, rounds, settings, step, make_round=rollout_round, processes=ONE_PROCESS):
    """One training step on `rounds`: G lists of data.Example (G = --grad-accum-steps, usually 1), each generated,
    scored and down-sampled, then one update (mu optimizer steps) on every kept rollout -> (the step's metrics, its
    Rounds). settings: a StepSettings. make_round: the round strategy (`rollout_round`; --dynamic-sampling and
    several processes wrap it: `round_strategy`). The update checks the sampler's log-probs before its optimizer
    step: off-policy engine rollouts are not trained on, and generation switches to HF (engine/rollout_check.py)."""
    costs, made = dict.fromkeys(PHASE_KEYS, 0.0), []
    with processes.full_weights(model):  # several processes: the weights gathered once for all the step's rounds
        for index, examples in enumerate(rounds):
            seed = sampling.derived_seed(settings.seed, step, index)  # a resumed step draws what it drew before
            round_ = make_round(model, tokenizer, examples, settings, seed, costs)  # n rollouts per prompt, scored
            with timed(costs, "select_s"):  # PODS: keep m of n, advantages over the kept subset (§3.2)
                generator = torch.Generator().manual_seed(selection_seed(seed, round_.first_chunk))
                round_.keep(*pods.select(round_.rewards, **vars(settings.select), generator=generator))
            made.append(round_)
    with timed(costs, "update_s"):  # the clipped GRPO loss, mu optimizer steps
        batches = [round_.update_batch() for round_ in made]
        update.fill_logprobs(model, batches, settings.update)
        result = update.update_policy(model, optimizer, batches, settings.update, sum_over_processes=processes.total,
                                      max_sampler_gap=rollout_check.LOGPROB_GAP_LIMIT)
    for round_, ratios in zip(made, result.sampler_ratios or []):  # for the completions log
        round_.record_sampler_ratios(ratios)
    costs["peak_mem_gib"] = update.peak_memory_gib(settings.device)
    scored, result, costs = processes.merged(([part for round_ in made for part in round_.parts], result, costs))
    metrics = step_metrics(scored, result, optimizer, costs, settings.update.loss.mask_truncated)
    # Did the rollouts come from the policy? The update's log-probs against the sampler's: else fall back to HF.
    metrics.update(sampling.after_step(model, result, scored, settings.generation.backend, f"step {step}"))
    return metrics, scored


def selection_seed(batch_seed, first_chunk):
    """The seed of the random rule's generator for a rollout batch: a stream of its own, apart from every generation
    chunk's (sampling.derived_seed(batch_seed, chunk)) and refill round's, yet fixed by the batch (a resume redraws
    it)."""
    return sampling.derived_seed(batch_seed, SELECTION_STREAM, first_chunk)


def step_settings(args):
    """The StepSettings of the flags, built once per run."""
    return StepSettings(
        seed=args.seed, num_rollouts=args.num_rollouts, generation=config.generation_settings(args),
        rewards=config.reward_settings(args),
        select=pods.SelectSettings(args.update_size, args.rule, args.advantage_normalization, args.scale_rewards,
                                   args.selection_scope, args.drop_zero_variance),
        update=config.update_settings(args), device=args.device)


def round_strategy(args, processes=ONE_PROCESS, draw=None, say=None):
    """The loop's round strategy, chosen once: `rollout_round`, each process's share of it (several processes), and
    with --dynamic-sampling refilled with `draw(count)`, the next examples of the prompt order, until the groups
    with a spread are enough (say(line): a note above the progress bar)."""
    make_round = processes.rounds(rollout_round)
    if not args.dynamic_sampling:
        return make_round
    return dynamic_sampling.refilling(make_round, draw, args.dynamic_sampling_metric, args.max_generation_rounds,
                                      processes.counts, say)


# ------------------------------------------------------------------------------------------ the run

def train(args, processes=OneProcess()):
    """The training run described by `args` (config.parse_args), holding its folder's lock; returns the run folder."""
    run_dir = config.run_dir(args)
    with contextlib.ExitStack() as held:
        held.enter_context(runfolder.removed_if_left_empty(run_dir))  # left after the lock is given back
        with runfolder.disk_full_at_start(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            if processes.is_main:
                held.enter_context(runfolder.folder_lock(run_dir))  # one writer
        return run(args, run_dir, processes)


def run(args, run_dir, processes):
    """The run in its folder: load, resume or start, then step, log, evaluate and checkpoint until the budget ends."""
    label = config.method_label(args)
    cpu_threads = threads.choose(args.num_threads, args.device, since=CPU_AT_START)
    if processes.is_main:
        print(report.start_line(label, args, run_dir, cpu_threads), flush=True)
        if report.own_rows_line(args):
            print(report.own_rows_line(args), flush=True)
    tokenizer, train_set, eval_set, model, optimizer = load(args, processes)
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
            accuracy = evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes, heldout.evaluate)
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
                accuracy = evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes, heldout.evaluate,
                                            check_sampler=False)  # this step's update checked the sampler
            if args.checkpoint_interval_s >= 0 and state.elapsed_s - last_checkpoint_s >= args.checkpoint_interval_s:
                save()
            report.show_progress(bar, args, state, metrics["reward"], accuracy)
        bar.close()
        stop = stop or signalled_stop()  # a signal during the last step: stopped as during any other
        if eval_set and state.evaluated_step != state.step and stop is None:
            evaluate_heldout(model, tokenizer, eval_set, args, state, write, processes, heldout.evaluate,
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


def main(argv=None):
    return train(config.parse_args(argv))


if __name__ == "__main__":
    try:
        train(ARGS)
    except (ValueError, OSError, update.TrainingError, data.HubUnavailable,
            sampling.SamplerError) as error:  # one line (OSError: the disk)
        sys.exit(f"train.py: error: {error}")

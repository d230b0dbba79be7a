"""Train an LLM with GRPO or GRPO-PODS (paper Algorithm 1, §3.1-3.2) on one device or several: the run loop.

One step (`train_step`): n rollouts per prompt (sampling.py) -> rewards (rewards.py) -> keep m per prompt by the
rule, advantages over the kept subset (pods.py; rule "none", m = n: plain GRPO) -> update (update.py). The run
(`train`): load -> for each step: train_step -> log -> evaluate -> checkpoint. Flags, presets and their checks:
config.py; the run folder (checkpoints, metrics.jsonl, config.json): checkpoint.py.

    python train.py                          # offline CPU demo: SmolLM2-135M on synthetic addition, PODS
    python train.py --baseline               # the same with its GRPO baseline (n = m)
    python train.py --preset a [--baseline]  # paper setting (a): Qwen2.5-3B-Instruct, GSM8K, n=64, m=16
    torchrun --nproc-per-node 8 train.py --preset e --output-dir runs/e [--baseline]   # (e), (f): 8 GPUs

Several processes (torchrun, distributed.py): FSDP2 shards the policy; each rank takes P / W prompts of every
rollout batch, generates (full weights gathered once per step), scores and down-samples them alone; the loss is
normalised over all ranks' kept rows: the one-process update of the global batch. Rank 0 writes the run folder;
held-out evaluation is split by generation chunks and pooled; checkpoints are sharded (checkpoint_dcp.py); ranks
restarted by torchrun --max-restarts resume from the latest checkpoint.

Variants (flags, default = the paper): --loss-aggregation, --scale-rewards, --clip-eps-high, --mask-truncated,
--drop-zero-variance, --selection-scope batch (cross-prompt max-variance); see config.py, pods.select, update.py.
Logging: <out>/metrics.jsonl (TRL names; held-out accuracy against training time, the paper's plots), and with
--report-to the same lines in TensorBoard or W&B (report.py); checkpoints every --checkpoint-interval-s s of
training, resumable exactly (--resume). A step whose update is not finite is skipped and counted
(`skipped_steps`); NONFINITE_STOP such steps in a row stop the run.
Simplifications: our own decode engine or HF generate (no vLLM), constant learning rate, no reward-model rewards.
--grad-accum-steps G (GRPO-GA) accumulates G rollout batches of --prompts-per-step prompts into one update.
"""

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import checkpoint
import checkpoint_dcp
import config
import data
import distributed
import eval as heldout
import models
import pods
import report
import rewards
import sampling
import update

NONFINITE_STOP = 3  # consecutive steps whose update was skipped
SINGLE = distributed.DistContext()  # one process, no process group


@contextlib.contextmanager
def timed(times, key):
    start = time.perf_counter()
    yield
    times[key] += time.perf_counter() - start


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


# ------------------------------------------------------------------------------------------ one step

def score(rollouts, examples, args):
    """([P, n] weighted rewards, per-function values) of every rollout; a prefilled "<think>\\n" is graded too."""
    rows = rollouts.prompt_index.tolist()
    result = rewards.compute_rewards([examples[i].prompt for i in rows],
                                     [data.graded_completion(text, args.prefill_think) for text in rollouts.texts],
                                     [examples[i].answer for i in rows], weights=args.reward_weights)
    return result.total.view(len(examples), -1), result.per_func


def train_step(model, tokenizer, optimizer, rounds, args, step, ctx=SINGLE):
    """One training step on `rounds`: G lists of data.Example (G = --grad-accum-steps, usually 1; under torchrun
    this rank's share of each), each generated, scored and down-sampled, then one update (mu optimizer steps) on
    every kept rollout. Returns the metrics of the global batch."""
    times = dict.fromkeys(report.PHASE_KEYS, 0.0)
    scored, batches = [], []
    with distributed.full_weights_for_generation(model):  # FSDP: gathered once for the step's rollouts
        for round_index, examples in enumerate(rounds):
            seed = checkpoint.step_seed(args.seed, step, round_index)
            with timed(times, "generate_s"), cuda_oom_hint(args, "generation"):
                rollouts = sampling.generate_rollouts(
                    model, tokenizer, [e.text for e in examples], args.num_rollouts, args.max_completion_tokens,
                    temperature=args.temperature, top_p=args.top_p, rollout_batch_size=args.rollout_batch_size,
                    seed=seed, first_chunk=distributed.first_chunk(ctx, len(examples) * args.num_rollouts,
                                                                   args.rollout_batch_size),
                    **config.generation_options(args))
            with timed(times, "reward_s"):
                reward_matrix, per_func = score(rollouts, examples, args)
            with timed(times, "select_s"):  # PODS: keep m of n; advantages over the kept subset (paper §3.2)
                kept, advantages, dropped = pods.select(
                    reward_matrix, args.update_size, args.rule, normalize=args.advantage_normalization,
                    scale_rewards=args.scale_rewards, scope=args.selection_scope,
                    drop_zero_variance=args.drop_zero_variance,
                    generator=torch.Generator().manual_seed(distributed.rank_seed(seed, ctx.rank)))
                batches.append(update.kept_batch(rollouts, kept, advantages))
            kept_rows = update.kept_rows(kept, args.num_rollouts)
            scored.append(report.ScoredRound.of(rollouts, reward_matrix, per_func, kept_rows, dropped))
    settings = config.update_settings(args)
    with timed(times, "update_s"), cuda_oom_hint(args, "the update"):
        update.fill_logprobs(model, batches, settings)
        denominator = distributed.global_count(update.loss_denominator(batches, settings)) if ctx.enabled else None
        result = update.update_policy(model, optimizer, batches, settings, global_denominator=denominator)
    scored, result, times = report.merge_ranks(distributed.all_gather((scored, result, times)))
    return report.step_metrics(scored, result, optimizer, times, args.mask_truncated)


# ------------------------------------------------------------------------------------------ the run

def load(args, ctx=SINGLE):
    """(tokenizer, training prompts, held-out prompts (long ones kept, as eval.py does), policy, optimizer). Under
    torchrun: loaded on the CPU (bf16 with --bf16: shard_model makes fp32 masters layer by layer), then sharded."""
    tokenizer = models.load_tokenizer(args.model)
    common = dict(data_dir=args.data_dir, one_shot=args.one_shot, prefill_think=args.prefill_think,
                  system_prompt=args.system_prompt or data.SYSTEM_PROMPT)
    train_set = data.build_prompt_set(args.dataset, "train", tokenizer, num_rows=args.num_train_rows,
                                      max_prompt_tokens=args.max_prompt_tokens, **common)
    eval_set = data.build_prompt_set(args.dataset, "test", tokenizer, num_rows=args.eval_samples,
                                     **common) if args.eval_samples else []
    torch.manual_seed(args.seed)  # LoRA initialisation; right here, as imports above may draw random numbers
    dtype = torch.bfloat16 if ctx.enabled and args.bf16 else models.compute_dtypes(args.bf16, args.lora_rank)[0]
    model = models.load_policy(args.model, dtype=dtype,
                               device="cpu" if ctx.enabled else args.device, load_in_4bit=args.load_in_4bit,
                               lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                               gradient_checkpointing=args.gradient_checkpointing,
                               lora_target_modules=tuple(args.lora_target_modules.split(",")))
    model = distributed.shard_model(model, ctx, mixed_precision=args.bf16)  # one process: unchanged
    model.train()  # checkpointing acts in training mode; dropout is off where it would run (sampling, update)
    optimizer = update.make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)
    return tokenizer, train_set, eval_set, model, optimizer


def evaluate_heldout(model, tokenizer, eval_set, args, state, write, ctx=SINGLE):
    """Held-out accuracy of the current policy, logged (fixed sample and seed: runs are compared paired). Under
    torchrun each rank evaluates whole chunks of the sample (distributed.eval_share), pooled by sample count."""
    start, stop, first_chunk, chunk = distributed.eval_share(len(eval_set), args.rollout_batch_size, ctx)
    share = eval_set[start:stop]
    with distributed.full_weights_for_generation(model), cuda_oom_hint(args, "evaluation"):
        result = heldout.evaluate(model, tokenizer, [e.text for e in share], [e.answer for e in share],
                                  temperature=args.eval_temperature, max_new_tokens=args.max_completion_tokens,
                                  batch_size=chunk, seed=first_chunk, **config.generation_options(args)) \
            if share else heldout.EvalResult(0.0, 0.0, 0.0, 0.0, 0, 0.0)
    pooled = distributed.pooled_over_ranks(dataclasses.asdict(result), "num_samples", max_keys=("elapsed_s",))
    state.evaluated_step = state.step
    write({"type": "eval", "step": state.step, "elapsed_s": state.elapsed_s,  # eval/accuracy, ..., eval/num_samples
           **{f"eval/{key}": value for key, value in pooled.items() if key != "elapsed_s"},
           "eval/eval_s": pooled["elapsed_s"]})
    return pooled["accuracy"]


def save(run_dir, model, optimizer, state, log, run_config, args, ctx):
    state.metrics_bytes = distributed.agree(log.tell())  # a resume cuts the log back to this size (rank 0's)
    checkpoint_dcp.save_run_checkpoint(run_dir, state.step, model, optimizer, state, run_config, ctx,
                                       keep_last=args.keep_checkpoints)


def resume(run_dir, model, optimizer, args, ctx):
    """The TrainerState of the run's latest checkpoint, with model, optimizer and RNG restored."""
    path = checkpoint.latest_checkpoint(run_dir)
    state = checkpoint.TrainerState.from_saved(checkpoint_dcp.load_run_checkpoint(path, model, optimizer, ctx))
    update.set_hyperparameters(optimizer, args.learning_rate, args.weight_decay)  # this run's flags win
    if ctx.is_main:
        print(f"resumed {path} (step {state.step}, {state.elapsed_s:.0f} s of training)")
    return state


def train(args):
    """The training run described by `args` (config.parse_args); returns the run directory."""
    ctx = distributed.init_from_env(args.device, timeout_s=args.dist_timeout_s)
    method = "grpo" if args.rule == "none" else "pods"
    run_dir = Path(distributed.agree(
        args.output_dir or f"runs/{args.preset}-{method}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"))
    run_dir.mkdir(parents=True, exist_ok=True)
    run_config = dict(vars(args), label=config.method_label(args), output_dir=str(run_dir))
    if ctx.is_main:
        (run_dir / "config.json").write_text(json.dumps(run_config, indent=1))
    args.device = str(ctx.device)  # torchrun: this rank's GPU
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    tokenizer, train_set, eval_set, model, optimizer = load(args, ctx)

    # What a resume restores, the same on every rank: stop, evaluation and checkpoint follow from it (and rank 0's
    # step time), so the ranks decide alike. The loop's own bookkeeping stays local.
    state = resume(run_dir, model, optimizer, args, ctx) if args.resume else checkpoint.TrainerState()
    last_checkpoint_s, step_s, accuracy = state.elapsed_s, 0.0, None
    with report.open_metrics(run_dir, args.report_to, keep_bytes=state.metrics_bytes if args.resume else 0,
                             first_step=state.step + 1 if args.resume else 0, run_config=run_config,
                             enabled=ctx.is_main) as (log, write):
        if eval_set and state.step == 0:
            accuracy = evaluate_heldout(model, tokenizer, eval_set, args, state, write, ctx)
        bar = tqdm(total=args.max_steps or None, initial=state.step, disable=not (args.progress and ctx.is_main),
                   desc=config.method_label(args))
        # A step is not started when it would probably end past --max-time-s.
        while not (args.max_steps and state.step >= args.max_steps) and \
                not (args.max_time_s and state.elapsed_s + step_s > args.max_time_s):
            step_start = time.perf_counter()
            if torch.device(args.device).type == "cuda":
                torch.cuda.reset_peak_memory_stats(args.device)
            rounds = []  # G = --grad-accum-steps prompt lists, from the seeded order (exact resume)
            for _ in range(args.grad_accum_steps):
                indices, state.position = checkpoint.next_prompt_indices(len(train_set), args.prompts_per_step,
                                                                         args.seed, state.position)
                rounds.append([train_set[i] for i in distributed.shard_prompts(indices, ctx)])
            metrics = train_step(model, tokenizer, optimizer, rounds, args, state.step + 1, ctx)
            step_s = distributed.agree(time.perf_counter() - step_start)
            line = report.record_step(state, metrics, step_s, args.device)
            write(dict(line, peak_mem_gib=distributed.max_over_ranks(line["peak_mem_gib"])))  # the fullest GPU
            if state.nonfinite_streak >= NONFINITE_STOP:
                raise update.TrainingError(
                    f"{NONFINITE_STOP} steps in a row (up to step {state.step}) had a non-finite loss or gradient "
                    "norm; none of them changed the weights. Stopping: lower --learning-rate or --max-grad-norm.")
            if eval_set and args.eval_interval and state.step % args.eval_interval == 0:
                accuracy = evaluate_heldout(model, tokenizer, eval_set, args, state, write, ctx)
            if args.checkpoint_interval_s >= 0 and state.elapsed_s - last_checkpoint_s >= args.checkpoint_interval_s:
                save(run_dir, model, optimizer, state, log, run_config, args, ctx)
                last_checkpoint_s = state.elapsed_s
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward']:.2f}", acc="-" if accuracy is None else f"{accuracy:.2f}",
                            t=f"{state.elapsed_s:.0f}s")
        bar.close()
        if eval_set and state.evaluated_step != state.step:
            evaluate_heldout(model, tokenizer, eval_set, args, state, write, ctx)
        if args.checkpoint_interval_s >= 0 and distributed.agree(log.tell() != state.metrics_bytes):
            save(run_dir, model, optimizer, state, log, run_config, args, ctx)  # the final state, unless saved
    if ctx.is_main:
        print(f"done: {state.step} steps, {state.elapsed_s:.0f} s of training -> {run_dir}")
    return run_dir


def main(argv=None):
    return train(config.parse_args(argv))


if __name__ == "__main__":
    if distributed.launched_by_torchrun():
        distributed.run_main(main)  # an error ends every rank; torchrun names the rank that failed
    else:
        try:
            main()
        except (ValueError, FileNotFoundError, update.TrainingError, data.HubUnavailable) as error:  # one line
            sys.exit(f"train.py: error: {error}")

"""The offline demo of train.py run through TRL's GRPOTrainer with PODS (integrations/trl_pods.py), on the CPU.

    python -m integrations.trl_demo --max-steps 10              # PODS 16/4, as `python train.py --max-steps 10`
    python -m integrations.trl_demo --max-steps 10 --baseline   # GRPO 4/4
    python compare.py runs/trl-demo-* runs/demo-*               # both kinds of run folder side by side

It takes train.py's flags (config.parse_args: same presets, seeds and budget) and loads what train.py loads
(train.load: the SmolLM2-135M GGUF model with the same LoRA initialisation, the addition prompts, the held-out
prompts, the same AdamW); the held-out evaluation is train.py's own (train.evaluate_heldout, same schedule, same
fixed sample and seeds). TRL does the rest: generation (transformers' generate on all rows of the step at once),
scoring with the project's reward functions, and the update (TRL's loss; sequence aggregation = loss_type "grpo").
The run folder (runs/trl-<preset>-<pods|grpo>-s<seed>-<time>) holds config.json and a metrics.jsonl with train.py's
keys (generate_s, reward_s, select_s, update_s, step_s, elapsed_s, reward; eval/accuracy ...), so compare.py reads
it. Differences from train.py that remain: TRL draws its own prompt order and sampling seeds; the update runs all
kept rows of a step as one micro-batch when they fit --micro-batch-size (as the demo's do). Flags this mapping does
not carry over to TRL are refused in one line. No checkpoints are written (TRL's save_strategy="no").
"""

import json
import sys
import time
from pathlib import Path

import torch

import checkpoint
import config
import data
import report
import rewards
import train

LOSS_TYPES = {"sequence": "grpo", "token": "dapo", "fixed": "dr_grpo"}  # --loss-aggregation -> TRL's loss_type


def unsupported_flag(args):
    """The one line refusing a flag whose meaning this TRL mapping does not reproduce, or None."""
    fixed = dict(grad_accum_steps=1, updates_per_batch=1, selection_scope="prompt", drop_zero_variance=False,
                 kl_coef=0.0, resume=False, device="cpu", load_in_4bit=False, report_to="none")
    for name, value in fixed.items():
        if getattr(args, name) != value:
            flag = "--" + name.replace("_", "-")
            return f"{flag} {getattr(args, name)} is not mapped onto TRL by this demo (only {value})"
    if (args.prompts_per_step * args.update_size) % args.micro_batch_size:
        return (f"the kept rows of a step ({args.prompts_per_step} x {args.update_size}) must be a multiple of "
                f"--micro-batch-size (now {args.micro_batch_size})")
    return None


def trl_config(args, run_dir):
    """PODSConfig with the demo's settings: one generation per optimizer step, --micro-batch-size kept rows a pass."""
    from integrations.trl_pods import PODSConfig

    kept_rows = args.prompts_per_step * args.update_size
    micro_batches = kept_rows // args.micro_batch_size
    return PODSConfig(
        output_dir=str(run_dir / "trl"), use_cpu=True, bf16=False, report_to="none", seed=args.seed,
        num_generations=args.num_rollouts, num_generations_kept=args.update_size,
        downsampling_rule=args.rule, advantage_normalization=args.advantage_normalization,
        scale_rewards=args.scale_rewards, loss_type=LOSS_TYPES[args.loss_aggregation], beta=0.0,
        epsilon=args.clip_eps, epsilon_high=args.clip_eps_high or args.clip_eps, num_iterations=1,
        mask_truncated_completions=args.mask_truncated, temperature=args.temperature, top_p=args.top_p, top_k=0,
        max_completion_length=args.max_completion_tokens, gradient_checkpointing=args.gradient_checkpointing,
        # the generation batch is one step's prompts x n rows; it splits into `micro_batches` update passes
        per_device_train_batch_size=args.prompts_per_step * args.num_rollouts // micro_batches,
        gradient_accumulation_steps=micro_batches, max_grad_norm=args.max_grad_norm,
        max_steps=args.max_steps, logging_steps=1, save_strategy="no", disable_tqdm=True, log_level="warning")


def reward_function(args):
    """The project's weighted reward (rewards.compute_rewards), as a TRL reward function of the dataset's columns."""
    def demo_reward(prompts, completions, answer, messages, **kwargs):
        graded = [data.graded_completion(text, args.prefill_think) for text in completions]
        return rewards.compute_rewards(messages, graded, answer, weights=args.reward_weights).total.tolist()
    return demo_reward


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
    """(TrainerCallback timing each step, the run's checkpoint.TrainerState). The trainer's after_log then writes
    train.py's metrics line of the step (update_s = the rest of the step, optimizer included) and runs the held-out
    evaluation every --eval-interval steps (after the step's timing: elapsed_s excludes it)."""
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

    timer = StepTimer()

    def evaluate():
        accuracy = train.evaluate_heldout(trainer.model, tokenizer, eval_set, args, state, write, train.OneProcess())
        print(f"step {state.step}: held-out accuracy {accuracy:.3f}", flush=True)

    def after_log(logs):
        line = {"type": "train", "step": state.step, "elapsed_s": state.elapsed_s, **timer.phases,
                **{key: value for key, value in logs.items() if isinstance(value, (int, float))}}
        write(line)
        print(f"step {state.step}: reward {line.get('reward', float('nan')):.3f}, generate {line['generate_s']:.1f} s, "
              f"update {line['update_s']:.1f} s, step {line['step_s']:.1f} s", flush=True)
        if eval_set and args.eval_interval and state.step % args.eval_interval == 0:
            evaluate()

    trainer.after_log = after_log
    return timer, state, evaluate


def run(args):
    """The demo through TRL; returns the run folder."""
    problem = unsupported_flag(args)
    if problem:
        raise ValueError(problem)
    from transformers.trainer_callback import PrinterCallback

    method = "grpo" if args.rule == "none" else "pods"
    run_dir = Path(args.output_dir or f"runs/trl-{args.preset}-{method}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    run_config = dict(vars(args), label="TRL " + config.method_label(args), output_dir=str(run_dir))
    (run_dir / "config.json").write_text(json.dumps(run_config, indent=1))
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    tokenizer, train_set, eval_set, model, optimizer = train.load(args, train.OneProcess())
    import datasets

    dataset = datasets.Dataset.from_list([{"prompt": e.text, "answer": e.answer, "messages": e.prompt}
                                          for e in train_set])
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    trainer = timed_trainer_class()(model=model, reward_funcs=reward_function(args), args=trl_config(args, run_dir),
                                    train_dataset=dataset, processing_class=tokenizer,
                                    optimizers=(optimizer, constant))
    trainer.remove_callback(PrinterCallback)
    with report.open_metrics(run_dir, run_config=run_config) as (log, write):
        timer, state, evaluate = step_logger(trainer, args, tokenizer, eval_set, write)
        trainer.add_callback(timer)
        if eval_set:
            evaluate()
        trainer.train()
        if eval_set and state.evaluated_step != state.step:
            evaluate()
    print(f"done: {state.step} steps, {state.elapsed_s:.0f} s of training -> {run_dir}")
    return run_dir


def main(argv=None):
    return run(config.parse_args(argv))


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"trl_demo: error: {error}")

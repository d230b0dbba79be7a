"""Train an LLM with GRPO or GRPO-PODS on one device (paper Algorithm 1, §3.1-3.2).

One step (`train_step`, read it top to bottom): prompts -> n rollouts each (inference phase) -> rewards
(accuracy + format + tag count) -> down-sample to m per prompt with the chosen rule (PODS; rule "none" with
m = n is plain GRPO) -> advantages over the kept subset -> reference log-probs (only when KL beta > 0: the
LoRA adapter switched off is the reference policy) and old log-probs (only when mu > 1) -> clipped loss,
backward in micro-batches -> grad clip -> optimizer step. Logging: <out>/metrics.jsonl (TRL metric names)
and <out>/config.json; periodic held-out accuracy against training wall-clock time (the paper's plots);
checkpoints every --checkpoint-interval-s seconds of training time, resumable exactly (--resume).

    python train.py                          # offline CPU demo: SmolLM2-135M on synthetic addition, PODS
    python train.py --baseline               # the same with its GRPO baseline (n = m)
    python train.py --preset a [--baseline]  # paper setting (a): Qwen2.5-3B-Instruct, GSM8K, n=64, m=16

Simplifications: one device, Hugging Face generate (no vLLM), constant learning rate (the authors' code uses
a 1% warm-up), no reward-model rewards. --grad-accum-steps G (GRPO-GA) accumulates G rollout batches of
--prompts-per-step prompts into one optimizer step.
"""

import argparse
import contextlib
import json
import math
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import checkpoint
import grpo_loss
import models
import pods

# Paper Appendix hyper-parameter table, plus the authors' released single-GPU config (YixuanEvenXu/pods,
# config/train.yaml: 1 prompt per step, temperature 0.9, AdamW betas 0.9/0.99, checkpoints every 1800 s).
PAPER_COMMON = dict(lora_rank=64, lora_alpha=64, lora_target_modules=",".join(models.DEFAULT_LORA_TARGETS),
                    weight_decay=0.1, max_grad_norm=1.0, max_prompt_tokens=512, max_completion_tokens=512,
                    bf16=True, gradient_checkpointing=True, optimizer="adamw", rule="max_variance",
                    prompts_per_step=1, temperature=0.9, kl_coef=0.0, one_shot=False,
                    checkpoint_interval_s=1800.0, max_time_s=6 * 3600.0, eval_interval=50, eval_samples=200,
                    eval_temperature=0.9, rollout_batch_size=64, micro_batch_size=4)
# Demo: a short system prompt (prompt tokens dominate CPU time) that spells out the format (base model:
# 86% well-formatted vs 13% with a vaguer one, so RL works on the answers from the first step).
DEMO_SYSTEM_PROMPT = "Reply in the format <think>\n...\n</think>\n<answer>\n...\n</answer>"
PRESETS = {
    # One thread: on the shared 2-core machine two torch threads ran 1.5-5x slower (spinning OpenMP workers).
    "demo": dict(model=models.SMOLLM2_ALIAS, dataset="arithmetic", one_shot=True, num_rollouts=16,
                 update_size=4, rule="max_variance", prompts_per_step=4, learning_rate=5e-4, lora_rank=16,
                 lora_alpha=32, system_prompt=DEMO_SYSTEM_PROMPT, temperature=1.0, max_prompt_tokens=256,
                 max_completion_tokens=32, rollout_batch_size=64, micro_batch_size=16, eval_samples=100,
                 eval_interval=5, eval_temperature=0.9, max_time_s=600.0, checkpoint_interval_s=120.0,
                 num_threads=1),
    "a": dict(PAPER_COMMON, model="Qwen/Qwen2.5-3B-Instruct", dataset="gsm8k", num_rollouts=64, update_size=16,
              learning_rate=5e-6),
    "b": dict(PAPER_COMMON, model="meta-llama/Llama-3.2-3B-Instruct", dataset="gsm8k", num_rollouts=64,
              update_size=16, learning_rate=2e-6, kl_coef=0.04),
    "c": dict(PAPER_COMMON, model="Qwen/Qwen2.5-3B-Instruct", dataset="math", num_rollouts=32, update_size=8,
              learning_rate=5e-6),
    "d": dict(PAPER_COMMON, model="Qwen/Qwen2.5-3B-Instruct", dataset="chemistry", num_rollouts=64,
              update_size=16, learning_rate=5e-6),
}
# --baseline: the matching GRPO run, n = m, as in the paper's comparisons: (a) 16/16, (b) 8/8, (c) 16/16,
# (d) 16/16. (The authors' scripts/plot.py also has GRPO 16/16 runs for (b) and 8/8 for (c): pass -n/-m.)
BASELINES = {"demo": 4, "a": 16, "b": 8, "c": 16, "d": 16}
TIMING_KEYS = ("elapsed_s", "generate_s", "reward_s", "select_s", "update_s", "step_s", "peak_mem_gib")


def build_parser():
    import data

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument_group("preset").add_argument
    add("--preset", choices=sorted(PRESETS), default="demo", help="paper setting (a)-(d) or the CPU demo")
    add("--baseline", action="store_true", help="switch the preset to its GRPO baseline (n = m, rule none)")
    add = parser.add_argument_group("model").add_argument
    add("--model", help=f"Hub id, local folder/.gguf, or {models.SMOLLM2_ALIAS!r} (offline demo model)")
    add("--lora-rank", type=int, default=0, help="0 = full fine-tuning")
    add("--lora-alpha", type=int)
    add("--lora-target-modules", default=",".join(models.DEFAULT_LORA_TARGETS), help="comma-separated")
    add("--load-in-4bit", action="store_true", help="bitsandbytes NF4 base weights (QLoRA), CUDA only")
    add("--bf16", action=argparse.BooleanOptionalAction, default=False, help="bfloat16 weights (CUDA)")
    add("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add = parser.add_argument_group("data").add_argument
    add("--dataset", choices=data.DATASETS)
    add("--data-dir", help="folder with the dataset files (default: ../shared/data or $PODS_DATA_DIR)")
    add("--num-train-rows", type=int, help="use this many training rows (arithmetic: the synthetic set size)")
    add("--one-shot", action=argparse.BooleanOptionalAction, default=False, help="one worked example in the prompt")
    add("--prefill-think", action="store_true", help="end the prompt with '<think>\\n' (scored as completion)")
    add("--max-prompt-tokens", type=int, help="longer prompts are dropped")
    add("--system-prompt", help="default: the paper's think/answer instruction (data.SYSTEM_PROMPT)")
    add = parser.add_argument_group("PODS / GRPO").add_argument
    add("--num-rollouts", "-n", type=int, help="rollouts generated per prompt (n)")
    add("--update-size", "-m", type=int, help="rollouts per prompt kept for the update (m <= n)")
    add("--rule", choices=pods.RULES, help="down-sampling rule; 'none' (m = n) is plain GRPO")
    add("--advantage-normalization", choices=pods.NORMALIZE_MODES, default="selected",
        help="selected: stats of the m kept rewards (paper); group: stats of all n")
    add("--reward-weights", default="accuracy=1,format=1,tag_count=1", help="name=weight,... (paper: 1/1/1)")
    add("--prompts-per-step", type=int)
    add("--grad-accum-steps", type=int, default=1, help="rollout batches per optimizer step (GRPO-GA)")
    add("--updates-per-batch", "--mu", type=int, default=1, help="optimizer steps per rollout batch (mu)")
    add("--clip-eps", type=float, default=0.2)
    add("--kl-coef", type=float, default=0.0, help="KL beta (needs LoRA: the reference is the adapter switched off)")
    add = parser.add_argument_group("optimizer").add_argument
    add("--learning-rate", "--lr", type=float)
    add("--weight-decay", type=float, default=0.0)
    add("--max-grad-norm", type=float, default=1.0, help="gradient clipping (<= 0: off)")
    add("--optimizer", choices=("adamw", "adamw8bit"), default="adamw")
    add = parser.add_argument_group("generation").add_argument
    add("--temperature", type=float)
    add("--top-p", type=float, default=1.0)
    add("--max-completion-tokens", type=int)
    add("--rollout-batch-size", type=int, help="sequences per generate call (memory bound of generation)")
    add("--micro-batch-size", type=int, help="sequences per forward/backward (memory bound of the update)")
    add = parser.add_argument_group("run").add_argument
    add("--seed", type=int, default=0)
    add("--num-threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    add("--max-steps", type=int, default=0, help="0 = no step limit")
    add("--max-time-s", type=float, default=0.0,
        help="training wall-clock budget (evaluation excluded): no step starts that would likely end past it")
    add("--checkpoint-interval-s", type=float, help="seconds of training between checkpoints; <0 = never")
    add("--keep-checkpoints", type=int, default=0, help="keep only the newest K (0 = all)")
    add("--eval-interval", type=int, help="held-out evaluation every K steps (also at step 0 and the end)")
    add("--eval-samples", type=int, help="held-out prompts (fixed sample of the test split); 0 = no eval")
    add("--eval-temperature", type=float, help="0 = greedy")
    add("--output-dir", help="default: runs/<preset>-<method>-s<seed>-<time>")
    add("--resume", action="store_true", help="continue the run in --output-dir from its latest checkpoint")
    add("--progress", action=argparse.BooleanOptionalAction, default=True, help="tqdm bar")
    return parser


def parse_args(argv=None):
    """Flags override the resumed run's config, which overrides --baseline, which overrides the preset."""
    parser = build_parser()
    first = parser.parse_args(argv)
    defaults = dict(PRESETS[first.preset])
    if first.baseline:
        defaults.update(num_rollouts=BASELINES[first.preset], update_size=BASELINES[first.preset], rule="none")
    if first.resume:
        if not first.output_dir or not (Path(first.output_dir) / "config.json").is_file():
            raise ValueError("--resume needs --output-dir of an existing run (with config.json)")
        saved = json.loads((Path(first.output_dir) / "config.json").read_text())
        dests = {action.dest for action in parser._actions}
        defaults.update({k: v for k, v in saved.items() if k in dests and k not in ("resume", "preset")})
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args):
    """Every error we can see before loading a model (flags only, plus the model path / package)."""
    import data

    if args.update_size > args.num_rollouts:
        raise ValueError(f"--update-size m = {args.update_size} must be <= --num-rollouts n = {args.num_rollouts}")
    if args.rule == "none" and args.update_size != args.num_rollouts:
        raise ValueError(f"rule 'none' (plain GRPO) trains on every rollout: needs m == n, got m = "
                         f"{args.update_size}, n = {args.num_rollouts}; pick a PODS rule or set m = n")
    for name in ("num_rollouts", "update_size", "prompts_per_step", "grad_accum_steps", "updates_per_batch",
                 "max_completion_tokens", "max_prompt_tokens", "rollout_batch_size", "micro_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.learning_rate > 0 or not args.temperature > 0 or args.kl_coef < 0 or args.clip_eps <= 0:
        raise ValueError("need --learning-rate > 0, --temperature > 0, --kl-coef >= 0 and --clip-eps > 0")
    if args.dataset not in data.DATASETS:
        raise ValueError(f"unknown dataset {args.dataset!r}; expected one of {data.DATASETS}")
    if args.kl_coef > 0 and args.lora_rank <= 0:
        raise ValueError("incompatible flags: --kl-coef > 0 needs a LoRA adapter (--lora-rank > 0), whose "
                         "disabled state is the reference policy; without LoRA there is no reference model")
    cuda = str(args.device).startswith("cuda")
    if args.load_in_4bit and (not cuda or args.lora_rank <= 0):
        raise ValueError("incompatible flags: --load-in-4bit needs a CUDA device and --lora-rank > 0")
    if args.optimizer == "adamw8bit":
        import importlib.util

        if not cuda or importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("--optimizer adamw8bit needs bitsandbytes and a CUDA device; use --optimizer adamw")
    if args.bf16 and not cuda:
        warnings.warn("--bf16 on CPU: allowed, but slow and less precise than float32 (--no-bf16)")
    weights = reward_weights(args.reward_weights)
    if not weights:
        raise ValueError("--reward-weights names no reward function")
    if args.resume and args.output_dir is None:
        raise ValueError("--resume needs --output-dir")
    models.check_model_source(args.model)  # missing local path or demo package -> clear error, nothing loaded


def reward_weights(spec):
    import rewards

    weights = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in rewards.REWARD_FUNCS:
            raise ValueError(f"unknown reward function {name!r} in --reward-weights; "
                             f"expected names from {sorted(rewards.REWARD_FUNCS)}")
        weights[name.strip()] = float(value or 1.0)
    return weights


def method_label(args):
    if args.rule == "none":
        return f"GRPO{'-GA' if args.grad_accum_steps > 1 else ''} {args.num_rollouts}/{args.update_size}"
    return f"PODS {args.rule} {args.num_rollouts}/{args.update_size}"


# ------------------------------------------------------------------------------------------ one step

@dataclass
class UpdateBatch:
    """The kept rollouts of one rollout batch: prompt part (left padded) and completion part (right)."""
    prompt_ids: torch.Tensor       # [B, Tp]
    prompt_mask: torch.Tensor      # [B, Tp]
    completion_ids: torch.Tensor   # [B, C]
    completion_mask: torch.Tensor  # [B, C], 1 up to and including the first EOS
    advantages: torch.Tensor       # [B]


def micro_batches(batch, size, device):
    """(input_ids, attention_mask, completion_mask) slices of at most `size` rows, with padding columns that
    no row of the slice needs cut off (left of the prompts, right of the completions)."""
    for start in range(0, len(batch.advantages), size):
        rows = slice(start, start + size)
        prompt_width = int(batch.prompt_mask[rows].sum(1).max())
        completion_width = max(1, int(batch.completion_mask[rows].sum(1).max()))
        completion_mask = batch.completion_mask[rows, :completion_width]
        input_ids = torch.cat([batch.prompt_ids[rows, -prompt_width:], batch.completion_ids[rows, :completion_width]], 1)
        attention_mask = torch.cat([batch.prompt_mask[rows, -prompt_width:], completion_mask], 1)
        yield input_ids.to(device), attention_mask.to(device), completion_mask.to(device), rows


@contextlib.contextmanager
def cuda_oom_hint(args, phase):
    """Re-raise CUDA OOM naming the flags that bound the memory of each phase."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        raise RuntimeError(f"CUDA out of memory during {phase}. Lower --rollout-batch-size (now "
                           f"{args.rollout_batch_size}) for generation/evaluation or --micro-batch-size (now "
                           f"{args.micro_batch_size}) for the update; --gradient-checkpointing and --load-in-4bit "
                           f"also help.") from error


def train_step(model, tokenizer, optimizer, rounds, args, step):
    """One optimizer step (mu of them when mu > 1) on `rounds`: G lists of examples {"text", "prompt",
    "answer"} (G = --grad-accum-steps, usually 1). Returns the step's metrics (TRL names)."""
    import rewards
    import sampling

    device, n, m = torch.device(args.device), args.num_rollouts, args.update_size
    times = dict.fromkeys(("generate_s", "reward_s", "select_s", "update_s"), 0.0)
    batches, scored = [], []
    for round_index, examples in enumerate(rounds):
        seed = checkpoint.step_seed(args.seed, step, round_index)
        # 1. Inference phase: n rollouts per prompt (row i*n + j = rollout j of prompt i).
        start = time.perf_counter()
        with cuda_oom_hint(args, "generation"):
            rollouts = sampling.generate_rollouts(
                model, tokenizer, [e["text"] for e in examples], n, args.max_completion_tokens,
                temperature=args.temperature, top_p=args.top_p, rollout_batch_size=args.rollout_batch_size, seed=seed)
        times["generate_s"] += time.perf_counter() - start
        # 2. Rewards (accuracy + format + tag count) -> [P, n]. A prefilled "<think>\n" is scored too.
        start = time.perf_counter()
        rows = rollouts.prompt_index.tolist()
        prefix = rewards.THINK_PREFILL if args.prefill_think else ""
        result = rewards.compute_rewards([examples[i]["prompt"] for i in rows], [prefix + t for t in rollouts.texts],
                                         [examples[i]["answer"] for i in rows], weights=reward_weights(args.reward_weights))
        reward_matrix = result.total.view(len(examples), n)
        times["reward_s"] += time.perf_counter() - start
        # 3. PODS: keep m of the n rollouts per prompt; advantages over the kept subset (paper §3.2).
        start = time.perf_counter()
        kept = pods.downsample(reward_matrix, m, args.rule, generator=torch.Generator().manual_seed(seed))  # [P, m]
        advantages = pods.selected_advantages(reward_matrix, kept, normalize=args.advantage_normalization)
        kept_rows = (torch.arange(len(examples))[:, None] * n + kept).flatten()
        prompt_rows = rollouts.prompt_index[kept_rows]
        batches.append(UpdateBatch(rollouts.prompt_ids[prompt_rows], rollouts.prompt_mask[prompt_rows],
                                   rollouts.completion_ids[kept_rows], rollouts.completion_mask[kept_rows],
                                   advantages.flatten().float()))
        times["select_s"] += time.perf_counter() - start
        scored.append((reward_matrix, reward_matrix.gather(1, kept), result.per_func, rollouts))

    # 4. Update phase: mu optimizer steps on the kept rollouts, each accumulated over micro-batches.
    start = time.perf_counter()
    total_rows = sum(len(b.advantages) for b in batches)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_sum, grad_norms, token_sums, token_count = 0.0, [], {}, 0
    with cuda_oom_hint(args, "the update"):
        ref_logprobs, old_logprobs = [], []  # once, without gradients; only when needed
        with torch.no_grad():
            for batch in batches:
                for input_ids, attention_mask, completion_mask, _ in micro_batches(batch, args.micro_batch_size, device):
                    width = completion_mask.shape[1]
                    if args.kl_coef > 0:
                        with model.disable_adapter():  # LoRA off = the reference policy, no second model
                            ref_logprobs.append(grpo_loss.token_logprobs(model, input_ids, attention_mask, width,
                                                                         args.temperature))
                    if args.updates_per_batch > 1:
                        old_logprobs.append(grpo_loss.token_logprobs(model, input_ids, attention_mask, width,
                                                                     args.temperature))
        for _ in range(args.updates_per_batch):
            optimizer.zero_grad(set_to_none=True)
            micro_index = 0
            for batch in batches:
                for input_ids, attention_mask, completion_mask, rows in micro_batches(batch, args.micro_batch_size, device):
                    logprobs = grpo_loss.token_logprobs(model, input_ids, attention_mask, completion_mask.shape[1],
                                                        args.temperature)
                    # mu == 1: pi_old = pi (ratio 1), so no extra forward pass for the old log-probs.
                    old = old_logprobs[micro_index] if old_logprobs else logprobs.detach()
                    ref = ref_logprobs[micro_index] if ref_logprobs else None
                    loss, metrics = grpo_loss.grpo_loss(logprobs, old, batch.advantages[rows].to(device),
                                                        completion_mask, args.clip_eps, ref, args.kl_coef)
                    # Scaled so the accumulated gradient equals the gradient of one batch of all kept rows.
                    scaled = loss * (logprobs.shape[0] / total_rows)
                    scaled.backward()
                    loss_sum += scaled.item()
                    count = int(completion_mask.sum())
                    token_count += count
                    for key, value in metrics.items():  # token means -> token-weighted over micro-batches
                        token_sums[key] = token_sums.get(key, 0.0) + value * count
                    micro_index += 1
            clip = args.max_grad_norm if args.max_grad_norm > 0 else math.inf
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
            optimizer.step()
    times["update_s"] = time.perf_counter() - start

    # 5. Metrics (TRL names where they exist), over all n rollouts; "reward_selected" over the kept ones.
    rewards_all = torch.cat([s[0] for s in scored])
    lengths = torch.cat([s[3].lengths for s in scored]).float()
    metrics = {"reward": float(rewards_all.mean()), "reward_std": float(rewards_all.std(dim=1).mean()),
               "reward_selected": float(torch.cat([s[1].flatten() for s in scored]).mean()),
               "frac_reward_zero_std": float((rewards_all.std(dim=1) == 0).float().mean())}
    for name in scored[0][2]:
        metrics[f"rewards/{name}/mean"] = float(torch.cat([s[2][name] for s in scored]).nanmean())
    metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()),
                    "completions/clipped_ratio": float(torch.cat([s[3].truncated for s in scored]).float().mean())})
    metrics.update({key: value / max(token_count, 1) for key, value in token_sums.items()})
    step_tokens = sum(int(s[3].prompt_mask.sum()) * n + int(s[3].lengths.sum()) for s in scored)
    metrics.update({"loss": loss_sum / args.updates_per_batch, "grad_norm": sum(grad_norms) / len(grad_norms),
                    "learning_rate": optimizer.param_groups[0]["lr"], "step_tokens": step_tokens,
                    "update_rows": total_rows, **times})
    return metrics


# ------------------------------------------------------------------------------------------ the run

def load_examples(args, tokenizer, split, num_rows):
    """[{"text": rendered prompt, "prompt": chat messages, "answer"}] of one split; over-long prompts dropped
    (the held-out sample keeps them, as eval.py does)."""
    import data

    dataset = data.load_split(args.dataset, split, data_dir=args.data_dir, num_rows=num_rows, seed=0,
                              one_shot=args.one_shot, system_prompt=args.system_prompt or data.SYSTEM_PROMPT)
    prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
    texts = data.render_prompts(tokenizer, prompts, prefill_think=args.prefill_think)
    kept = range(len(texts))
    if split == "train":
        kept, dropped = data.filter_long_prompts(texts, tokenizer, args.max_prompt_tokens)
        if dropped:
            print(f"dropped {dropped} training prompts longer than {args.max_prompt_tokens} tokens")
        if not kept:
            raise ValueError(f"every training prompt is longer than --max-prompt-tokens {args.max_prompt_tokens}")
    return [{"text": texts[i], "prompt": prompts[i], "answer": answers[i]} for i in kept]


def evaluate_heldout(model, tokenizer, eval_set, args, step, elapsed_s):
    """Held-out accuracy of the current policy (fixed sample and seed, so runs are compared paired)."""
    import eval as heldout

    with cuda_oom_hint(args, "evaluation"):
        result = heldout.evaluate(model, tokenizer, [e["text"] for e in eval_set], [e["answer"] for e in eval_set],
                                  temperature=args.eval_temperature, max_new_tokens=args.max_completion_tokens,
                                  batch_size=args.rollout_batch_size, seed=0)
    return {"type": "eval", "step": step, "elapsed_s": elapsed_s, "eval/accuracy": result.accuracy,
            "eval/format_accuracy": result.format_accuracy, "eval/both_accuracy": result.both_accuracy,
            "eval/mean_completion_length": result.mean_completion_length, "eval/num_samples": result.num_samples,
            "eval/eval_s": result.elapsed_s}


def make_optimizer(model, args):
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=args.learning_rate, betas=(0.9, 0.99), weight_decay=args.weight_decay)  # authors' betas
    if args.optimizer == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def peak_memory_gib(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # process peak RSS (KiB on Linux)


def train(args):
    """The training run described by `args` (from parse_args); returns the run directory."""
    from tqdm import tqdm

    method = "grpo" if args.rule == "none" else "pods"
    run_dir = Path(args.output_dir or f"runs/{args.preset}-{method}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
    metrics_path = run_dir / "metrics.jsonl"
    if not args.resume and metrics_path.exists() and metrics_path.stat().st_size > 0:
        raise ValueError(f"{run_dir} already holds a run: pass --resume to continue it or another --output-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = dict(vars(args), label=method_label(args), output_dir=str(run_dir),
                  max_new_tokens=args.max_completion_tokens)  # key eval.py reads
    (run_dir / "config.json").write_text(json.dumps(config, indent=1))

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    tokenizer = models.load_tokenizer(args.model)
    train_set = load_examples(args, tokenizer, "train", args.num_train_rows)
    eval_set = load_examples(args, tokenizer, "test", args.eval_samples) if args.eval_samples else []
    torch.manual_seed(args.seed)  # LoRA initialisation; right here, as imports above may draw random numbers
    model = models.load_policy(args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32,
                               device=args.device, load_in_4bit=args.load_in_4bit, lora_rank=args.lora_rank,
                               lora_alpha=args.lora_alpha,
                               lora_target_modules=tuple(args.lora_target_modules.split(",")),
                               gradient_checkpointing=args.gradient_checkpointing)
    model.train()
    optimizer = make_optimizer(model, args)

    state = dict(step=0, elapsed_s=0.0, position=(0, 0), num_tokens=0, metrics_bytes=0, last_eval_step=-1)
    if args.resume:
        path = checkpoint.latest_checkpoint(run_dir)
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
        state.update(checkpoint.load_checkpoint(path, model, optimizer))
        with open(metrics_path, "r+") as handle:  # drop lines written after that checkpoint
            handle.truncate(state["metrics_bytes"])
        print(f"resumed {path} (step {state['step']}, {state['elapsed_s']:.0f} s of training)")
    else:
        metrics_path.write_text("")
    log = open(metrics_path, "a")

    def write(line):
        log.write(json.dumps(line) + "\n")
        log.flush()

    def save():
        state["metrics_bytes"] = log.tell()
        checkpoint.save_checkpoint(run_dir, state["step"], model, optimizer, dict(state), config,
                                   keep_last=args.keep_checkpoints)
        state["last_checkpoint_s"] = state["elapsed_s"]

    def maybe_evaluate():
        if eval_set and state["last_eval_step"] != state["step"]:
            line = evaluate_heldout(model, tokenizer, eval_set, args, state["step"], state["elapsed_s"])
            write(line)
            state["last_eval_step"] = state["step"]
            return line["eval/accuracy"]
        return None

    state["last_checkpoint_s"] = state["elapsed_s"]
    accuracy = maybe_evaluate() if state["step"] == 0 else None
    bar = tqdm(total=args.max_steps or None, initial=state["step"], disable=not args.progress, desc=method_label(args))
    step_s = 0.0  # a step is not started when it would probably end past --max-time-s
    while not (args.max_steps and state["step"] >= args.max_steps) and \
            not (args.max_time_s and state["elapsed_s"] + step_s > args.max_time_s):
        step_start = time.perf_counter()
        if torch.device(args.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        rounds = []
        for _ in range(args.grad_accum_steps):
            indices, state["position"] = checkpoint.next_prompt_indices(len(train_set), args.prompts_per_step,
                                                                        args.seed, state["position"])
            rounds.append([train_set[i] for i in indices])
        metrics = train_step(model, tokenizer, optimizer, rounds, args, state["step"] + 1)
        state["step"] += 1
        step_s = time.perf_counter() - step_start
        state["elapsed_s"] += step_s
        state["num_tokens"] += metrics.pop("step_tokens")
        write({"type": "train", "step": state["step"], "elapsed_s": state["elapsed_s"], **metrics,
               "num_tokens": state["num_tokens"], "step_s": step_s, "peak_mem_gib": peak_memory_gib(args.device)})
        if args.eval_interval and state["step"] % args.eval_interval == 0:
            accuracy = maybe_evaluate()
        if args.checkpoint_interval_s >= 0 and \
                state["elapsed_s"] - state["last_checkpoint_s"] >= args.checkpoint_interval_s:
            save()
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", acc="-" if accuracy is None else f"{accuracy:.2f}",
                        t=f"{state['elapsed_s']:.0f}s")
    bar.close()
    maybe_evaluate()
    if args.checkpoint_interval_s >= 0 and log.tell() != state["metrics_bytes"]:
        save()  # the final state, unless the last checkpoint already is it
    log.close()
    print(f"done: {state['step']} steps, {state['elapsed_s']:.0f} s of training -> {run_dir}")
    return run_dir


def main(argv=None):
    return train(parse_args(argv))


if __name__ == "__main__":
    try:
        parsed = parse_args()
    except (ValueError, FileNotFoundError) as error:  # bad flags: a message, not a traceback
        sys.exit(f"train.py: error: {error}")
    train(parsed)

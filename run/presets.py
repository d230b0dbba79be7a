"""The paper's settings (a)-(f) and the CPU demo as named presets, and the GRPO baseline each is compared with.

Paper Appendix, hyper-parameter table, plus the authors' released single-GPU config (YixuanEvenXu/pods,
config/train.yaml: 1 prompt per step, temperature 0.9, AdamW betas 0.9/0.99, checkpoints every 1800 s).
Settings (e), (f) are the table's multi-GPU full-parameter runs (torchrun -m multigpu). Each preset is a dict of
train.py flag values (the parser's names); config.parse_args applies one, then --baseline, then the flags given.
"""

import models

PAPER_COMMON = dict(lora_rank=64, lora_alpha=64, lora_target_modules=",".join(models.DEFAULT_LORA_TARGETS),
                    weight_decay=0.1, max_grad_norm=1.0, max_prompt_tokens=512, max_completion_tokens=512,
                    bf16=True, gradient_checkpointing=True, optimizer="adamw", rule="max_variance",
                    prompts_per_step=1, temperature=0.9, kl_coef=0.0, one_shot=False,
                    checkpoint_interval_s=1800.0, max_time_s=6 * 3600.0, eval_interval=50, eval_samples=200,
                    eval_temperature=0.9, rollout_batch_size=64, micro_batch_size=16)
# micro_batch_size 16: the kept rows of a step (m = 16) in one forward and backward, the fewest kernels; with
# --gradient-checkpointing the update replays in its backward only what 40 GiB of GPU memory need (update.py: in
# setting (a), 29 of the 36 MLPs; python -m bench census).
# Demo: a short system prompt (prompt tokens dominate CPU time) that spells out the format (base model:
# 86% well-formatted vs 13% with a vaguer one, so RL works on the answers from the first step). Its budget is 16
# steps, not seconds: what it learns is then the same on every CPU (2-core VMs took 5-24 s a step: BENCHMARKS), and
# only the time differs; the held-out accuracy is greedy, one answer per prompt with no sampling noise (at
# temperature 0.9 one evaluation of 100 prompts swung by +-0.1). lr 3e-4: over 3 seeds, at 5e-4 the greedy accuracy
# stood at 0.47-0.65 at step 16 and moved by up to 0.13 over steps 16-24; at 3e-4 at 0.60-0.66, moving by <= 0.05.
DEMO_SYSTEM_PROMPT = "Reply in the format <think>\n...\n</think>\n<answer>\n...\n</answer>"
PRESETS = {
    "demo": dict(model=models.SMOLLM2_ALIAS, dataset="arithmetic", one_shot=True, num_rollouts=16,
                 update_size=4, rule="max_variance", prompts_per_step=4, learning_rate=3e-4, lora_rank=16,
                 lora_alpha=32, system_prompt=DEMO_SYSTEM_PROMPT, temperature=1.0, max_prompt_tokens=256,
                 max_completion_tokens=32, rollout_batch_size=64, micro_batch_size=16, eval_samples=100,
                 eval_interval=8, eval_temperature=0.0, max_steps=16, max_time_s=0.0, checkpoint_interval_s=120.0,
                 bf16="auto"),  # bf16 where the CPU has bf16 instructions: the same curve per step, sooner
    "a": dict(PAPER_COMMON, model="Qwen/Qwen2.5-3B-Instruct", dataset="gsm8k", num_rollouts=64, update_size=16,
              learning_rate=5e-6),
    "b": dict(PAPER_COMMON, model="meta-llama/Llama-3.2-3B-Instruct", dataset="gsm8k", num_rollouts=64,
              update_size=16, learning_rate=2e-6, kl_coef=0.04),
    "c": dict(PAPER_COMMON, model="Qwen/Qwen2.5-3B-Instruct", dataset="math", num_rollouts=32, update_size=8,
              learning_rate=5e-6),
    "d": dict(PAPER_COMMON, model="Qwen/Qwen2.5-3B-Instruct", dataset="chemistry", num_rollouts=64,
              update_size=16, learning_rate=5e-6),
    # (e), (f): full parameter on 8 GPUs, 4 GA steps of rollout batch 128 -> update batch 32 (effective n = 512,
    # m = 128), 512 prompt + 1536 completion tokens (the authors generated at most 1024). One prompt per GPU and
    # rollout batch, so a prompt's selection needs no communication (the authors: 4 prompts per GA step).
    "e": dict(PAPER_COMMON, model="Qwen/Qwen2.5-3B-Instruct", dataset="gsm8k", lora_rank=0, learning_rate=2e-5,
              num_rollouts=128, update_size=32, grad_accum_steps=4, prompts_per_step=8, max_completion_tokens=1536,
              micro_batch_size=4),
}
PRESETS["f"] = dict(PRESETS["e"], model="Qwen/Qwen2.5-7B-Instruct", learning_rate=1.5e-5)
# Your own rows (--dataset FILE or Hub id) with a preset: its worked example is its own dataset's, so none; with the
# demo, its task settings are its sums' (32 completion tokens: a sum and its tags; a one-line format instruction for a
# 135M model; 100 held-out sums), so these replace them: 256 tokens, room for the reasoning of a GSM8K-length word
# problem; the paper's think/answer instruction (data.SYSTEM_PROMPT, as the registered datasets get); every held-out
# row up to 100 (config.parse_args caps it at the file's held-out rows). A flag given wins; --print-config says where
# each value came from, and a run that cannot learn with them says so at its first step (run/report.py).
OWN_ROWS = {"demo": dict(max_completion_tokens=256, system_prompt=None, eval_samples=100)}


def own_rows_settings(preset):
    """The settings your own rows take instead of `preset`'s (OWN_ROWS, and no one-shot example)."""
    return dict(OWN_ROWS.get(preset, {}), one_shot=False)


# --baseline: the matching GRPO run, n = m (rule none), as in the paper's comparisons: (a) 16/16, (b) 8/8, (c) 16/16,
# (d) 16/16; (e), (f): GRPO-GA, 16 GA steps of 32/32, the same effective n = 512 as PODS. (The authors'
# scripts/plot.py also has GRPO 16/16 runs for (b) and 8/8 for (c): pass -n/-m.)
BASELINES = {preset: dict(num_rollouts=n, update_size=n) for preset, n in
             {"demo": 4, "a": 16, "b": 8, "c": 16, "d": 16}.items()}
BASELINES.update({preset: dict(num_rollouts=32, update_size=32, grad_accum_steps=16) for preset in "ef"})

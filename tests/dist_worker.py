"""The multi-process scenarios of test_distributed.py, and the same steps in one process (imported by the
tests) as the reference the 2-process results must equal.

    python tests/dist_worker.py OUT_DIR

launches 2 CPU ranks with torch's elastic launcher, what `torchrun --standalone --nproc-per-node 2
--max-restarts 1` runs, except that the ranks are forked from this process once its imports are done: a
fresh interpreter per rank and attempt would cost more than the scenarios themselves. Attempt 0 ("train"):
full-parameter steps 1-2 with a sharded checkpoint after step 1, a LoRA step, a mixed-precision step; then
rank 1 SIGKILLs itself. The launcher restarts both ranks; attempt 1 ("resume"): load the checkpoint, redo
step 2, save; then rank 1 raises while rank 0 waits in a collective, which ends the run.
"""

import copy
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from run import checkpoint  # noqa: E402
from multigpu import distributed, sharded_checkpoint  # noqa: E402
import grpo_loss  # noqa: E402
import policy  # noqa: E402
import models  # noqa: E402
import update  # noqa: E402

VOCAB = 512
ROWS = 8  # kept rows of the global batch (4 per rank)
LEARNING_RATE = 1e-3


def assert_states_close(actual, expected, where=""):
    """Nested state dicts equal up to float rounding (reduction order differs across 1 and 2 processes)."""
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: keys differ: {set(actual) ^ set(expected)}"
        for key in expected:
            assert_states_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_states_close(a, e, f"{where}[{i}]")
    elif torch.is_tensor(expected):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where}: {m}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def global_batch(step, rows=ROWS, prompt_len=6, completion_len=5, shared_prompts=False):
    """Random kept rollouts of one step: left-padded prompts, completions of 1..C tokens, advantages.
    shared_prompts: rows come in pairs of one prompt, and every prompt starts with the same 2 tokens."""
    g = torch.Generator().manual_seed(1000 + step)
    prompt_ids = torch.randint(3, VOCAB, (rows, prompt_len), generator=g)
    prompt_mask = (torch.arange(prompt_len) >= (torch.arange(rows) % 3)[:, None]).long()
    if shared_prompts:
        pairs = torch.arange(rows) // 2 * 2
        prompt_ids, prompt_mask = prompt_ids[pairs], prompt_mask[pairs]
        first = prompt_mask.long().argmax(1)   # each prompt's first real token
        for offset in range(2):
            prompt_ids[torch.arange(rows), first + offset] = 7 + offset
    prompt_ids = torch.where(prompt_mask.bool(), prompt_ids, 2)
    lengths = torch.randint(1, completion_len + 1, (rows,), generator=g)
    completion_mask = (torch.arange(completion_len) < lengths[:, None]).long()
    completion_ids = torch.randint(3, VOCAB, (rows, completion_len), generator=g)
    advantages = torch.randn(rows, generator=g)
    return dict(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                attention_mask=torch.cat([prompt_mask, completion_mask], 1),
                completion_mask=completion_mask, advantages=advantages)


def build(ctx, lora=False, mixed_precision=False, learning_rate=LEARNING_RATE):
    """Tiny policy with gradient checkpointing (as presets (e), (f)), sharded over the ranks, and AdamW."""
    model = models.tiny_random_model("llama", vocab_size=VOCAB, seed=0)
    torch.manual_seed(1)  # adapter initialisation, identical on every rank
    model = models.prepare_for_training(model, lora_rank=4 if lora else 0, lora_alpha=8, gradient_checkpointing=True)
    if lora:
        for name, param in model.named_parameters():  # B = 0 at init would leave A's gradient zero
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(2))
    model = distributed.shard_model(model, ctx, mixed_precision=mixed_precision)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=(0.9, 0.99), weight_decay=0.1)
    return model, optimizer


def train_step(model, optimizer, batch, ctx, micro_batch_size=2, kl_coef=0.0):
    """One GRPO step on this rank's rows, the loss normalised by the kept rows of all ranks; global loss.
    kl_coef > 0 (LoRA): reference log-probs with the adapter switched off."""
    rows = distributed.rank_slice(range(len(batch["advantages"])), ctx.rank, ctx.world_size)
    total_rows = distributed.global_count(len(rows))
    width = batch["completion_mask"].shape[1]
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for start in range(0, len(rows), micro_batch_size):
        part = rows[start:start + micro_batch_size]
        inputs = (model, batch["input_ids"][part], batch["attention_mask"][part], width)
        ref_logprobs = None
        if kl_coef > 0:
            with torch.no_grad(), model.disable_adapter():
                ref_logprobs = policy.token_logprobs(*inputs)
        logprobs = policy.token_logprobs(*inputs)
        loss, _ = grpo_loss.grpo_loss(logprobs, logprobs.detach(), batch["advantages"][part],
                                      batch["completion_mask"][part], ref_logprobs=ref_logprobs, kl_coef=kl_coef)
        scaled = loss * (len(part) / total_rows)
        scaled.backward()
        loss_sum += scaled.item()
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    optimizer.step()
    return distributed.all_reduce_metrics({"loss": loss_sum, "grad_norm": grad_norm}, sum_keys=("loss",))


def update_step(ctx, prefix_sharing=True):
    """update.update_policy, as train.py calls it on several processes (the loss summed over ranks), on this rank's
    rows of a batch whose prompts repeat and share a prefix, with gradient checkpointing: prefix sharing on (each
    distinct prompt once; one process: the shared prefix once too) or off. -> loss, gradient norm, the state after."""
    model, _ = build(ctx)
    # plain SGD: the weights move by the gradient itself (AdamW's first step, g / |g|, would blow up the rounding of
    # near-zero gradient entries into differences of the whole learning rate)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    batch = global_batch(3, shared_prompts=True)
    rows = distributed.rank_slice(range(ROWS), ctx.rank, ctx.world_size)
    prompt_len = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
    kept = update.UpdateBatch(batch["input_ids"][rows, :prompt_len], batch["attention_mask"][rows, :prompt_len],
                              batch["input_ids"][rows, prompt_len:], batch["completion_mask"][rows],
                              batch["advantages"][rows], torch.zeros(len(rows), dtype=torch.bool))
    settings = update.UpdateSettings(micro_batch_size=4, prefix_sharing=prefix_sharing)
    metrics = update.update_policy(model, optimizer, [kept], settings, distributed.global_count)
    return {"loss": metrics.loss, "grad_norm": metrics.grad_norm, "state": full_state(model, optimizer)}


def full_state(model, optimizer):
    """Unsharded model and optimizer state (on rank 0; collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    # Copies: some entries (the optimizer's step counters) are the live tensors, which later steps change.
    return copy.deepcopy({"model": model_state, "optimizer": optimizer_state})


def greedy(model, rows, max_new_tokens):
    """Greedy continuations (exactly max_new_tokens) of prompts `rows` of a fixed batch."""
    batch = global_batch(0, completion_len=1)
    prompt_ids, prompt_mask = batch["input_ids"][rows, :-1], batch["attention_mask"][rows, :-1]
    with torch.no_grad():
        return model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, do_sample=False)


def generate_rows(model, ctx, max_new_tokens):
    """Greedy continuations of this rank's prompts inside full_weights_for_generation, and the number of
    FSDP all-gathers the generation itself issued (must be 0: ranks decode different numbers of steps)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    rows = distributed.rank_slice(range(ROWS), ctx.rank, ctx.world_size)
    calls = []
    original = _fsdp_param_group.foreach_all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    with distributed.full_weights_for_generation(model):
        _fsdp_param_group.foreach_all_gather = counting
        try:
            tokens = greedy(model, rows, max_new_tokens)
        finally:
            _fsdp_param_group.foreach_all_gather = original
    return tokens, len(calls)


def mixed_precision_step(ctx):
    """A 1e-5 step with bf16 compute: the dtypes FSDP keeps, and how many master weights moved."""
    model, optimizer = build(ctx, mixed_precision=True, learning_rate=1e-5)
    batch = global_batch(1)
    sharded = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    before = [p.detach().clone() for p in sharded]
    seen = {}
    hook = model.lm_head.register_forward_hook(lambda m, i, out: seen.update(compute=out.dtype))
    train_step(model, optimizer, batch, ctx)
    hook.remove()
    moved = sum(int((p.detach() != b).sum()) for p, b in zip(sharded, before))
    total = sum(b.numel() for b in before)
    state_dtypes = {v.dtype for s in optimizer.state.values() for v in s.values() if v.dim() > 0}
    return {"param_dtypes": sorted({str(p.dtype) for p in sharded}), "compute_dtype": str(seen["compute"]),
            "optimizer_dtypes": sorted(str(d) for d in state_dtypes), "moved_fraction": moved / total}


def run_train(ctx, out):
    torch.manual_seed(100 + ctx.rank)  # rank-specific global RNG: the checkpoint must restore each one
    results = {}
    model, optimizer = build(ctx)
    # Unequal decoding lengths per rank: a collective inside generation would hang or fail here.
    torch.save(generate_rows(model, ctx, 3 + 2 * ctx.rank), out / f"generated_rank{ctx.rank}.pt")
    results["step1"] = train_step(model, optimizer, global_batch(1), ctx)
    results["state1"] = full_state(model, optimizer)
    sharded_checkpoint.save_sharded_checkpoint(out / "run", 1, model, optimizer,
                                               checkpoint.TrainerState(position=(0, 8)),
                                               {"model": "tiny", "lora_rank": 0}, ctx)
    torch.save(torch.rand(3), out / f"draw_rank{ctx.rank}.pt")  # the next draw of this rank's RNG
    results["step2"] = train_step(model, optimizer, global_batch(2), ctx)
    lora_model, lora_optimizer = build(ctx, lora=True)
    results["lora_step1"] = train_step(lora_model, lora_optimizer, global_batch(1), ctx, kl_coef=0.1)
    results["lora_generated"] = generate_rows(lora_model, ctx, 3)[0]  # peft's generate skips FSDP's hooks
    results["lora_state1"] = full_state(lora_model, lora_optimizer)
    results["mixed_precision"] = mixed_precision_step(ctx)
    results["update_step"] = update_step(ctx)
    if ctx.is_main:
        torch.save(results, out / "train.pt")
        (out / "run" / "checkpoints" / ".tmp_step_000002_crashed").mkdir()  # a save cut short by the kill
    distributed.barrier()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies mid-run; the launcher ends rank 0, blocked below
    distributed.barrier()
    (out / "train_survived_the_kill").touch()  # never reached


def run_resume(ctx, out):
    model, optimizer = build(ctx)
    path = checkpoint.latest_checkpoint(out / "run")
    state = sharded_checkpoint.load_sharded_checkpoint(path, model, optimizer, ctx)
    results = {"checkpoint": path.name, "position": state["position"], "draw": torch.rand(3),
               "attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}
    results["draws_match_all_ranks"] = distributed.all_ranks(
        torch.equal(results["draw"], torch.load(out / f"draw_rank{ctx.rank}.pt")))
    extremes = distributed.all_reduce_metrics({"rank_min": ctx.rank, "rank_max": ctx.rank, "ranks": 1},
                                              sum_keys=("ranks",), min_keys=("rank_min",), max_keys=("rank_max",))
    results["rank_extremes"] = extremes
    results["state1"] = full_state(model, optimizer)
    results["step2"] = train_step(model, optimizer, global_batch(2), ctx)
    results["state2"] = full_state(model, optimizer)
    sharded_checkpoint.save_sharded_checkpoint(out / "run", 2, model, optimizer, {"position": (0, 16)},
                                               {"model": "tiny", "lora_rank": 0}, ctx)
    if ctx.is_main:
        torch.save(results, out / "resume.pt")
    distributed.barrier()
    if ctx.rank == 1:
        (out / "raised_at.txt").write_text(repr(time.time()))
        raise RuntimeError("boom on purpose")
    distributed.barrier()  # rank 0 waits for a peer that never comes


def scenario(out):
    ctx = distributed.init_from_env(device="cpu", timeout_s=60)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    (run_train if attempt == 0 else run_resume)(ctx, out)
    distributed.shutdown()


def rank_main(out):
    # A forked rank inherits the launcher's signal handlers, which only raise once Python runs again: a rank
    # blocked in a collective would ignore the launcher's SIGTERM. Back to the defaults of a fresh process.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    distributed.run_main(scenario, Path(out))


def launch(out):
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    torch.set_num_threads(1)
    import peft  # noqa: F401 (the imports a rank needs, done once before forking)
    models.tiny_random_model("llama", vocab_size=VOCAB)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=1, start_method="fork")
    elastic_launch(config, rank_main)(str(out))


if __name__ == "__main__":
    launch(Path(sys.argv[1]))

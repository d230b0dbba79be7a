"""integrations/trl_pods.py: TRL's GRPOTrainer trains on exactly the rows and advantages pods.py chooses, its loss on
them equals grpo_loss (a cross-check of both), the normaliser counts kept tokens, a run learns, m = n is TRL's
GRPOTrainer step for step, and unsupported settings are refused. A tiny random Qwen2 with a character tokenizer
built in memory, on the CPU, offline."""

import copy
import os
import types

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
trl_pods = pytest.importorskip("integrations.trl_pods", exc_type=ImportError)

import grpo_loss  # noqa: E402
import policy  # noqa: E402
import pods  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHARS = "0123456789+= abcdefghijklmnopqrstuvwxyz"
N, M = 4, 2  # generations per prompt, kept per prompt
PROMPTS_PER_BATCH = 2
LOSS_AGGREGATIONS = {"grpo": "sequence", "dapo": "token", "dr_grpo": "fixed"}  # TRL loss_type -> grpo_loss


def char_tokenizer():
    """One token per character, <pad> = 0, <eos> = 1; decoding joins the characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def tiny_qwen2(seed=0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(CHARS) + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
                         bos_token_id=None, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def dataset(rows=8):
    import datasets

    return datasets.Dataset.from_list([{"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)} for i in range(rows)])


def char_reward(prompts, completions, answer, **kwargs):
    """Varies between texts, so a random model's completions get distinct rewards (and ties are possible)."""
    char_reward.last_completions = list(completions)
    return [float(sum(map(ord, text)) % 7) for text in completions]


def settings(tmp_path, **overrides):
    return dict(dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=N,
                     per_device_train_batch_size=N * PROMPTS_PER_BATCH, max_completion_length=8, max_steps=2,
                     learning_rate=1e-2, seed=0, save_strategy="no", logging_steps=1, disable_tqdm=True,
                     temperature=1.0), **overrides)


def pods_trainer(tmp_path, model=None, **overrides):
    args = trl_pods.PODSConfig(**settings(tmp_path, num_generations_kept=M, **overrides))
    return trl_pods.PODSGRPOTrainer(model=model or tiny_qwen2(), reward_funcs=char_reward, args=args,
                                    train_dataset=dataset(), processing_class=char_tokenizer())


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A PODS trainer and one generation batch as TRL scored it (before the selection): (trainer, batch, rewards
    per function, the reward function's completions)."""
    trainer = pods_trainer(tmp_path_factory.mktemp("trl"))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; _compute_loss reads it
    inputs = [row for row in dataset(PROMPTS_PER_BATCH) for _ in range(N)]
    batch = GRPOTrainer._generate_and_score_completions(trainer, inputs)
    return trainer, batch, trainer._pods_rewards_per_func, char_reward.last_completions


def downsample(scored, rule="max_variance", normalize="selected", scale_rewards="group"):
    trainer, batch, rewards_per_func, _ = scored
    trainer.args.downsampling_rule, trainer.args.advantage_normalization = rule, normalize
    trainer.scale_rewards = scale_rewards
    trainer._pods_rewards_per_func = rewards_per_func
    return trainer._downsample(dict(batch), N * PROMPTS_PER_BATCH)


@pytest.mark.parametrize("rule, normalize, scale_rewards", [
    ("max_variance", "selected", "group"), ("random", "selected", "group"), ("percentile", "selected", "group"),
    ("max_reward", "selected", "group"), ("max_variance", "group", "group"), ("max_variance", "selected", "batch"),
    ("max_variance", "selected", "none")])
def test_trained_rows_and_advantages_are_pods_selection(scored, rule, normalize, scale_rewards):
    trainer, full, _, completions = scored
    kept_batch = downsample(scored, rule, normalize, scale_rewards)
    rewards = torch.tensor(char_reward(None, completions, None)).view(PROMPTS_PER_BATCH, N)
    assert torch.equal(trainer.last_selection.rewards, rewards)  # selected on what the reward function returned
    generator = torch.Generator().manual_seed(trainer.args.seed * 1_000_003 + trainer._step)
    expected = pods.downsample(rewards, M, rule, generator=generator).sort(dim=-1).values
    if rule == "max_variance":
        assert torch.equal(expected, pods.max_variance_indices(rewards, M).sort(dim=-1).values)
    assert torch.equal(trainer.last_selection.kept, expected)
    rows = (expected + torch.arange(PROMPTS_PER_BATCH)[:, None] * N).flatten()
    width = kept_batch["completion_ids"].shape[1]
    assert torch.equal(kept_batch["completion_ids"], full["completion_ids"][rows, :width])
    assert not full["completion_mask"][rows, width:].any()  # only padding was trimmed
    first = full["prompt_ids"].shape[1] - kept_batch["prompt_ids"].shape[1]
    assert torch.equal(kept_batch["prompt_ids"], full["prompt_ids"][rows, first:])
    assert not full["prompt_mask"][rows, :first].any()
    advantages = pods.selected_advantages(rewards, expected, normalize, scale_rewards=scale_rewards)
    torch.testing.assert_close(kept_batch["advantages"], advantages.flatten())
    assert int(kept_batch["num_items_in_batch"]) == int(kept_batch["completion_mask"].sum())
    assert kept_batch["completion_ids"].shape[0] == M * PROMPTS_PER_BATCH


def test_normaliser_counts_only_kept_tokens(scored):
    trainer, full, _, _ = scored
    kept_batch = downsample(scored)
    rows = (trainer.last_selection.kept + torch.arange(PROMPTS_PER_BATCH)[:, None] * N).flatten()
    assert int(kept_batch["num_items_in_batch"]) == int(full["completion_mask"][rows].sum())
    assert int(full["num_items_in_batch"]) == int(full["completion_mask"].sum())  # TRL's count covers all n


@pytest.mark.parametrize("loss_type", sorted(LOSS_AGGREGATIONS))
def test_trl_loss_on_the_kept_batch_equals_grpo_loss(scored, loss_type):
    """TRL's _compute_loss and this project's grpo_loss, same rows, tokens and aggregation: value and gradient."""
    trainer, _, _, _ = scored
    kept_batch = downsample(scored)
    trainer.loss_type = loss_type
    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    trl_loss = trainer._compute_loss(model, kept_batch)
    trl_grads = torch.autograd.grad(trl_loss, params)
    input_ids = torch.cat([kept_batch["prompt_ids"], kept_batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([kept_batch["prompt_mask"], kept_batch["completion_mask"]], dim=1)
    logprobs = policy.token_logprobs(model, input_ids, attention_mask, kept_batch["completion_ids"].shape[1],
                                     temperature=trainer.temperature)
    ours, _ = grpo_loss.grpo_loss(logprobs, logprobs.detach(), kept_batch["advantages"], kept_batch["completion_mask"],
                                  aggregation=LOSS_AGGREGATIONS[loss_type],
                                  max_completion_tokens=trainer.args.max_completion_length)
    our_grads = torch.autograd.grad(ours, params)
    torch.testing.assert_close(trl_loss, ours, rtol=1e-5, atol=1e-6)
    assert any(float(g.abs().max()) > 1e-4 for g in our_grads)  # a gradient that could differ
    for trl_grad, our_grad in zip(trl_grads, our_grads):
        torch.testing.assert_close(trl_grad, our_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("level, loss_type, epsilon_high, options", [
    ("sequence", "grpo", 0.2, dict(importance_sampling_level="sequence")),
    ("sequence", "dapo", 0.2, dict(importance_sampling_level="sequence", aggregation="token")),
    ("token", "cispo", 1.3, dict(policy_loss="cispo", aggregation="token", clip_eps=1.0, clip_eps_high=0.3)),
    ("sequence", "cispo", 1.05, dict(policy_loss="cispo", importance_sampling_level="sequence", aggregation="token",
                                     clip_eps=1.0, clip_eps_high=0.05))])
def test_trls_gspo_and_cispo_on_stale_log_probs_equal_grpo_loss(scored, monkeypatch, level, loss_type, epsilon_high,
                                                                  options):
    """TRL 1.16's own _compute_loss with importance_sampling_level / loss_type="cispo" (its weight clamped at
    epsilon_high, no lower bound: pods' clip_eps 1 and clip_eps_high = epsilon_high - 1) against grpo_loss, on old
    log-probs 0.3-noisy per token and per row, so that the ratios differ from 1 and the clip binds: value and
    gradient."""
    trainer, _, _, _ = scored
    kept_batch = downsample(scored)
    model = trainer.model
    input_ids = torch.cat([kept_batch["prompt_ids"], kept_batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([kept_batch["prompt_mask"], kept_batch["completion_mask"]], dim=1)
    width = kept_batch["completion_ids"].shape[1]
    with torch.no_grad():
        current = policy.token_logprobs(model, input_ids, attention_mask, width, temperature=trainer.temperature)
    noise = torch.Generator().manual_seed(1)
    old = current + 0.3 * torch.randn(current.shape, generator=noise) + 0.3 * torch.randn(len(current), 1,
                                                                                          generator=noise)
    kept_batch["old_per_token_logps"] = old
    for name, value in (("loss_type", loss_type), ("importance_sampling_level", level),
                        ("epsilon_high", epsilon_high)):
        monkeypatch.setattr(trainer, name, value)
    params = [p for p in model.parameters() if p.requires_grad]
    trl_grads = torch.autograd.grad(trainer._compute_loss(model, kept_batch), params)
    trl_loss = trainer._compute_loss(model, kept_batch)
    logprobs = policy.token_logprobs(model, input_ids, attention_mask, width, temperature=trainer.temperature)
    ours, metrics = grpo_loss.grpo_loss(logprobs, old, kept_batch["advantages"], kept_batch["completion_mask"],
                                        **options)
    assert metrics["clip_ratio/region_mean"] > 0  # the clip binds somewhere
    our_grads = torch.autograd.grad(ours, params)
    torch.testing.assert_close(trl_loss.detach(), ours.detach(), rtol=1e-5, atol=1e-6)
    for trl_grad, our_grad in zip(trl_grads, our_grads):
        torch.testing.assert_close(trl_grad, our_grad, rtol=1e-4, atol=1e-6)
    plain, _ = grpo_loss.grpo_loss(logprobs, old, kept_batch["advantages"], kept_batch["completion_mask"],
                                   aggregation=options.get("aggregation", "sequence"))
    assert abs(float(plain) - float(ours)) > 1e-4  # the option changes the loss of this batch


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_training_changes_the_weights_and_logs_pods_metrics(tmp_path):
    model = tiny_qwen2()
    before = weights(model)  # the 4 kept rows of each generation in 2 micro-batches of 2 (steps_per_generation 2)
    trainer = pods_trainer(tmp_path, model=model, per_device_train_batch_size=N, gradient_accumulation_steps=2)
    trainer.train()
    assert trainer.args.steps_per_generation == 2 and trainer._buffered_inputs[0]["completion_ids"].shape[0] == M
    after = weights(trainer.model)
    assert any(not torch.equal(before[name], after[name]) for name in before)
    logged = [line for line in trainer.state.log_history if "pods/kept_reward_mean" in line]
    assert len(logged) == 2 and all(0.0 <= line["pods/frac_zero_variance_groups"] <= 1.0 for line in logged)
    selection = trainer.last_selection  # the last step's: what its metrics line reports
    kept_rewards = selection.rewards.gather(-1, selection.kept)
    assert logged[-1]["pods/kept_reward_mean"] == pytest.approx(float(kept_rewards.mean()))
    assert bool((kept_rewards.std(dim=-1) >= selection.rewards.std(dim=-1) - 1e-6).all())  # max-variance per prompt


def test_keeping_all_generations_is_trl_grpo_step_for_step(tmp_path):
    initial = tiny_qwen2()
    grpo = GRPOTrainer(model=copy.deepcopy(initial), reward_funcs=char_reward, args=GRPOConfig(**settings(
        tmp_path / "grpo")), train_dataset=dataset(), processing_class=char_tokenizer())
    grpo.train()
    args = trl_pods.PODSConfig(**settings(tmp_path / "pods", num_generations_kept=N))
    pods_run = trl_pods.PODSGRPOTrainer(model=copy.deepcopy(initial), reward_funcs=char_reward, args=args,
                                        train_dataset=dataset(), processing_class=char_tokenizer())
    pods_run.train()
    grpo_losses = [line["loss"] for line in grpo.state.log_history if "loss" in line]
    pods_losses = [line["loss"] for line in pods_run.state.log_history if "loss" in line]
    assert len(grpo_losses) == 2 and grpo_losses == pytest.approx(pods_losses, rel=1e-5, abs=1e-6)
    grpo_weights, pods_weights = weights(grpo.model), weights(pods_run.model)
    assert any(not torch.equal(grpo_weights[name], w) for name, w in weights(initial).items())
    for name, value in grpo_weights.items():  # Adam moves every weight by ~lr = 1e-2 a step; float32 vs float64
        torch.testing.assert_close(pods_weights[name], value, rtol=1e-4, atol=1e-5)  # advantages differ by 1e-7


def test_only_the_tested_trl_release_is_accepted():
    trl_pods.check_trl_version(trl_pods.TESTED_TRL_VERSION + ".7")
    with pytest.raises(ImportError, match=r"pip install 'trl==1\.16\.\*'"):
        trl_pods.check_trl_version("1.17.0")


UNKNOWN_RULE = "not_" + "_or_".join(pods.RULES)  # derived from the registry: never a registered rule


@pytest.mark.parametrize("overrides, message", [
    (dict(num_generations_kept=N + 1), "num_generations_kept = 5 must be"),
    (dict(downsampling_rule=UNKNOWN_RULE), f"downsampling_rule = '{UNKNOWN_RULE}'"),
    (dict(downsampling_rule="none"), "'none' keeps every completion"),
    (dict(advantage_normalization="kept"), "advantage_normalization = 'kept'"),
    (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation"),
    (dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations_kept=1),
     "do not split into steps_per_generation = 2"),
])
def test_unsupported_configs_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        trl_pods.PODSConfig(**settings(tmp_path, **dict(dict(num_generations_kept=M), **overrides)))
    assert "\n" not in str(error.value)


def test_a_prompt_group_spanning_processes_is_refused():
    args = types.SimpleNamespace(num_generations=8, num_generations_kept=4, downsampling_rule="max_variance",
                                 advantage_normalization="selected", scale_rewards="group",
                                 multi_objective_aggregation="sum_then_normalize", generation_batch_size=8,
                                 world_size=2, steps_per_generation=1)
    assert "would span processes" in trl_pods.unsupported_setting(args)
    args.generation_batch_size = 16
    assert trl_pods.unsupported_setting(args) is None


@pytest.mark.parametrize("make, message", [
    (lambda tmp: dict(args=GRPOConfig(**settings(tmp))), "needs args=PODSConfig"),
    (lambda tmp: dict(tools=[len]), "tools is not supported"),
    (lambda tmp: dict(train_dataset=dataset().add_column("image", [None] * 8)), "vision inputs"),
])
def test_unsupported_trainer_inputs_are_refused_before_loading(tmp_path, make, message):
    kwargs = dict(model="not-loaded", reward_funcs=char_reward, train_dataset=dataset(),
                  args=trl_pods.PODSConfig(**settings(tmp_path, num_generations_kept=M)))
    with pytest.raises(ValueError, match=message):
        trl_pods.PODSGRPOTrainer(**dict(kwargs, **make(tmp_path)))


def test_a_completion_without_any_reward_is_refused():
    with pytest.raises(ValueError, match="got None from every reward function"):
        trl_pods.weighted_rewards(torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")]]),
                                  torch.ones(2))
    torch.testing.assert_close(trl_pods.weighted_rewards(torch.tensor([[1.0, float("nan")]]), torch.tensor([2.0, 1.0])),
                               torch.tensor([2.0]))


@pytest.mark.slow  # a fresh interpreter importing TRL (~10 s)
def test_the_vendored_files_alone_import(tmp_path):
    """What the module's docstring tells a TRL user to copy is all it needs: trl_pods.py, pods.py and
    lazy.py."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for name in ("integrations/trl_pods.py", "pods.py", "lazy.py"):
        shutil.copy(root / name, tmp_path)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", "import trl_pods, pods; print(pods.__file__)"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()).parent == tmp_path  # the copy, not the repository's

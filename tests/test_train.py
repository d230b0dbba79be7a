"""train.py, one step end to end on a tiny random model: every rule, mu > 1, beta > 0, micro-batching = one batch,
the kept rows and their advantages, the selection variants (zero-variance prompts dropped, batch scope, an empty
update). Whole runs: test_train_run.py; flags and presets: test_config.py; the update itself: test_update.py."""

import contextlib
import math

import pytest
import torch

from run import config, report
import data
import models
import pods
import rewards
import sampling
import train
import update
from run_helpers import fake_compute_rewards

pytestmark = pytest.mark.usefixtures("varied_rewards")


# ------------------------------------------------------------------------------------------ one step

def step_args(**overrides):
    args = config.parse_args(["--model", models.SMOLLM2_ALIAS, "-n", "4", "-m", "2", "--max-completion-tokens", "6",
                             "--micro-batch-size", "3", "--learning-rate", "0.05"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


EXAMPLES = [data.Example(text="What is 2 + 3?", prompt=[], answer="5"),
            data.Example(text="Add 10 and 7, then say hi:", prompt=[], answer="17")]


def make_optimizer(model, args):
    return update.make_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer)


@pytest.fixture
def lora_model(tiny_model):
    torch.manual_seed(0)
    return models.prepare_for_training(tiny_model, lora_rank=4, lora_alpha=8)


@pytest.mark.parametrize("rule", pods.RULES)
def test_every_rule_runs_one_step(rule, lora_model, smollm2_tokenizer):
    args = step_args(rule=rule, update_size=4 if rule == "none" else 2)
    optimizer = make_optimizer(lora_model, args)
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, optimizer, [EXAMPLES],
                                  train.step_settings(args), step=1)
    assert metrics["update_rows"] == 2 * args.update_size
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/char_sum/mean", "completions/mean_length",
                "completions/clipped_ratio", "clip_ratio/region_mean", "kl", "loss", "grad_norm", "learning_rate",
                "generate_s", "reward_s", "select_s", "update_s"):
        assert math.isfinite(metrics[key]), key
    assert metrics["grad_norm"] > 0  # varied rewards -> non-zero advantages -> a gradient reached LoRA


def test_micro_batches_give_the_full_batch_gradient(lora_model, smollm2_tokenizer):
    frozen = torch.optim.SGD([p for p in lora_model.parameters() if p.requires_grad], lr=0.0)
    grads = []
    for micro in (8, 3, 1):
        train.train_step(lora_model, smollm2_tokenizer, frozen, [EXAMPLES],
                         train.step_settings(step_args(update_size=4, rule="none",
                                                                                       micro_batch_size=micro)), step=1)
        grads.append(torch.cat([p.grad.flatten() for p in lora_model.parameters() if p.requires_grad]))
    assert grads[0].abs().max() > 0
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], rtol=1e-4, atol=1e-7)


def test_mu_above_one_uses_old_logprobs_and_kl_uses_adapter_off(lora_model, smollm2_tokenizer):
    args = step_args(updates_per_batch=3, kl_coef=0.05)
    optimizer = make_optimizer(lora_model, args)
    lora_b = [p.detach().clone() for name, p in lora_model.named_parameters() if "lora_B" in name]
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, optimizer, [EXAMPLES],
                                  train.step_settings(args), step=1)
    # Update 1 has pi = pi_old = pi_ref (LoRA B starts at 0); updates 2-3 moved away from both.
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-6) and metrics["kl"] > 0
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "clip_ratio/region_mean"))
    after = [p for name, p in lora_model.named_parameters() if "lora_B" in name]
    assert any(not torch.equal(b, a) for b, a in zip(lora_b, after))


def test_grad_accum_rounds_use_every_round(lora_model, smollm2_tokenizer):
    args = step_args(grad_accum_steps=2)
    optimizer = make_optimizer(lora_model, args)
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, optimizer, [EXAMPLES, EXAMPLES[:1]],
                                  train.step_settings(args), step=1)
    assert metrics["update_rows"] == 3 * args.update_size


class GatherCounted(train.OneProcess):
    """The several-process seam of full_weights, counted: how often a step gathers the weights for generation."""

    def __init__(self):
        self.entered, self.inside = 0, False

    @contextlib.contextmanager
    def full_weights(self, model):
        self.entered, self.inside = self.entered + 1, True
        try:
            yield
        finally:
            self.inside = False


def test_a_step_gathers_the_weights_once_for_all_its_rounds(lora_model, smollm2_tokenizer, monkeypatch):
    """Several processes gather the full weights for generation (an all-gather of every layer): once per step,
    around every --grad-accum-steps round (and refill), released before the update, whose FSDP passes reshard."""
    processes, generated_inside, updated_inside = GatherCounted(), [], []
    real_generate, real_update = sampling.generate_rollouts, update.update_policy
    monkeypatch.setattr(sampling, "generate_rollouts",
                        lambda *a, **k: generated_inside.append(processes.inside) or real_generate(*a, **k))
    monkeypatch.setattr(update, "update_policy",
                        lambda *a, **k: updated_inside.append(processes.inside) or real_update(*a, **k))
    args = step_args(grad_accum_steps=3)
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args),
                                  [EXAMPLES, EXAMPLES[:1], EXAMPLES], train.step_settings(args), 1,
                                  processes=processes)
    assert processes.entered == 1 and generated_inside == [True, True, True] and updated_inside == [False]
    assert metrics["update_rows"] == 5 * args.update_size


def test_step_trains_on_the_kept_rows_with_kept_subset_advantages(lora_model, smollm2_tokenizer, monkeypatch):
    """Two prompts, n = 4, m = 2: the update gets rollout i*n + kept[i, j] of prompt i (not i*m + j), with
    advantages normalised over the m kept rewards (paper §3.2), not over all n."""
    seen = {}
    real_generate, real_update = sampling.generate_rollouts, update.update_policy

    def spy_generate(*args, **kwargs):
        seen["rollouts"] = real_generate(*args, **kwargs)
        return seen["rollouts"]

    def spy_update(model, optimizer, batches, settings, **kwargs):
        seen["batches"] = batches
        return real_update(model, optimizer, batches, settings, **kwargs)

    monkeypatch.setattr(sampling, "generate_rollouts", spy_generate)
    monkeypatch.setattr(update, "update_policy", spy_update)
    args = step_args()
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args), [EXAMPLES],
                                  train.step_settings(args),
                                  step=1)
    rollouts, [batch] = seen["rollouts"], seen["batches"]
    reward_matrix = fake_compute_rewards(None, rollouts.texts, None).total.view(2, 4)
    kept = pods.max_variance_indices(reward_matrix, 2)
    kept_std = reward_matrix.gather(1, kept).std(dim=1).mean()  # what max-variance maximises, logged
    assert metrics["reward_std_selected"] == pytest.approx(float(kept_std))
    assert metrics["reward_std_selected"] >= metrics["reward_std"] - 1e-6  # kept: the widest spread of the group
    rows = [i * 4 + int(j) for i in range(2) for j in kept[i]]
    assert torch.equal(batch.completion_ids, rollouts.completion_ids[rows])
    assert torch.equal(batch.prompt_ids, rollouts.prompt_ids[[0, 0, 1, 1]])
    expected = pods.group_advantages(reward_matrix.gather(1, kept)).flatten()
    torch.testing.assert_close(batch.advantages, expected)
    over_all_n = pods.group_advantages(reward_matrix).gather(1, kept).flatten()
    assert (expected - over_all_n).abs().max() > 1e-3  # the two normalisations differ here


def rewards_constant_for_answer(answer):
    """fake_compute_rewards, but every rollout of the prompts whose answer is `answer` gets 0.5 (zero variance)."""
    def compute(prompts, completions, answers, **kwargs):
        result = fake_compute_rewards(prompts, completions, answers)
        total = torch.where(torch.tensor([a == answer for a in answers]), 0.5, result.total)
        return rewards.RewardResult(total=total, per_func={"char_sum": total})
    return compute


def test_batch_scope_trains_on_the_rows_of_the_cross_prompt_mask(lora_model, smollm2_tokenizer, monkeypatch):
    """P = 2, n = 4, m = 2, prompt 0 with all-equal rewards: batch scope gives its 2 slots to prompt 1, whose
    rollouts are rows 4..7 (i*n + j); advantages are prompt 1's over its kept rewards."""
    seen = {}
    real_generate, real_update = sampling.generate_rollouts, update.update_policy
    monkeypatch.setattr(rewards, "compute_rewards", rewards_constant_for_answer("5"))
    monkeypatch.setattr(sampling, "generate_rollouts",
                        lambda *args, **kwargs: seen.setdefault("rollouts", real_generate(*args, **kwargs)))

    def spy_update(model, optimizer, batches, settings, **kwargs):
        seen["batches"] = batches
        return real_update(model, optimizer, batches, settings, **kwargs)

    monkeypatch.setattr(update, "update_policy", spy_update)
    args = step_args(selection_scope="batch", scale_rewards="batch")
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args), [EXAMPLES],
                                  train.step_settings(args), 1)
    rollouts, [batch] = seen["rollouts"], seen["batches"]
    reward_matrix = rewards_constant_for_answer("5")(None, rollouts.texts, ["5"] * 4 + ["17"] * 4).total.view(2, 4)
    keep = pods.select_across_prompts(reward_matrix, 2)
    assert keep.sum(1).tolist() == [0, 4] and metrics["update_rows"] == 4 and metrics["num_zero_variance_dropped"] == 0
    assert torch.equal(batch.completion_ids, rollouts.completion_ids[4:8])
    expected = pods.masked_advantages(reward_matrix, keep, scale_rewards="batch")[keep]
    torch.testing.assert_close(batch.advantages, expected)


def test_a_step_whose_prompts_are_all_dropped_takes_no_optimizer_step(lora_model, smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(rewards, "compute_rewards", lambda prompts, completions, answers, **kwargs:
                        rewards.RewardResult(total=torch.ones(len(completions)), per_func={}))
    args = step_args(drop_zero_variance=True, loss_aggregation="token", weight_decay=0.1)
    optimizer = make_optimizer(lora_model, args)
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, optimizer, [EXAMPLES],
                                  train.step_settings(args), step=1)
    assert (metrics["num_zero_variance_dropped"], metrics["update_rows"], metrics["optimizer_steps"]) == (2, 0, 0)
    assert "reward_selected" not in metrics and all(math.isfinite(v) for v in metrics.values())
    assert not optimizer.state and metrics["frac_reward_zero_std"] == 1.0


def test_a_step_that_trains_nothing_says_so(lora_model, smollm2_tokenizer, monkeypatch):
    """update_rows 0 in the metrics line is also said in one line where the run is watched (the loop prints the
    step's notes on stderr, above the bar)."""
    monkeypatch.setattr(rewards, "compute_rewards", lambda prompts, completions, answers, **kwargs:
                        rewards.RewardResult(total=torch.ones(len(completions)), per_func={}))
    args = step_args(drop_zero_variance=True)
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args), [EXAMPLES],
                                  train.step_settings(args), step=3)
    assert report.step_notes(metrics) == ["trained nothing: every prompt was dropped (no optimizer step)"]
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args), [EXAMPLES],
                                  train.step_settings(step_args()), step=4)
    assert report.step_notes(metrics) == []


def test_a_step_whose_grader_timed_out_counts_it_and_says_so(lora_model, smollm2_tokenizer, monkeypatch):
    """Accuracy 0 for want of a verdict is a possibly wrong reward: counted (rewards/grader_timeouts, the completions
    log's grader_timeout) and said in one line; a step without one says nothing."""
    def two_timed_out(prompts, completions, answers, **kwargs):
        timed_out = torch.zeros(len(completions), dtype=torch.bool)
        timed_out[[1, 6]] = True
        return rewards.RewardResult(total=torch.arange(len(completions), dtype=torch.float32), per_func={},
                                    grader_timeouts=timed_out)

    monkeypatch.setattr(rewards, "compute_rewards", two_timed_out)
    args = step_args()
    metrics, scored = train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args), [EXAMPLES],
                                       train.step_settings(args), step=3)
    assert metrics["rewards/grader_timeouts"] == 2
    assert scored[0].grader_timeouts.nonzero().flatten().tolist() == [1, 6]
    [note] = report.step_notes(metrics)
    assert note.startswith("2 completions scored accuracy 0 because their answer comparison timed out twice")
    monkeypatch.undo()
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args), [EXAMPLES],
                                  train.step_settings(args), step=4)
    assert metrics["rewards/grader_timeouts"] == 0 and report.step_notes(metrics) == []


def test_groups_of_one_rollout_count_as_zero_std(lora_model, smollm2_tokenizer):
    """-n 1: a group's std is NaN (one value), yet all its rewards are equal: frac_reward_zero_std is 1, not 0."""
    args = step_args(num_rollouts=1, update_size=1, rule="none")
    metrics, _ = train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args), [EXAMPLES],
                                  train.step_settings(args),
                                  step=1)
    assert metrics["frac_reward_zero_std"] == 1.0 and metrics["reward_std"] == 0.0


def test_a_default_step_does_not_enter_dynamic_sampling(lora_model, smollm2_tokenizer, monkeypatch):
    """Without --dynamic-sampling a step calls nothing of dynamic_sampling.py: a reader of the default step never
    needs that file (every function of it here raises)."""
    from variants import dynamic_sampling

    def entered(*args, **kwargs):
        raise AssertionError("a default step entered dynamic_sampling.py")

    for name, value in vars(dynamic_sampling).items():
        if callable(value) and getattr(value, "__module__", None) == "dynamic_sampling":
            monkeypatch.setattr(dynamic_sampling, name, entered)
    for extra in ({}, {"selection_scope": "batch"}, {"grad_accum_steps": 2}):
        args = step_args(**extra)
        metrics, scored = train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args),
                                           [EXAMPLES] * args.grad_accum_steps, train.step_settings(args), step=1)
        assert metrics["update_rows"] == 2 * 2 * args.grad_accum_steps and len(scored) == args.grad_accum_steps
        assert not any(part.marks for part in scored)  # no group marked: every one entered the selection


def test_the_random_rules_generator_has_a_stream_of_its_own(lora_model, smollm2_tokenizer, monkeypatch):
    """The selection generator of --rule random is seeded apart from every generation chunk of its rollout batch
    (sampling.derived_seed(batch seed, first chunk + chunk)) and every refill round: before, it reused chunk 0's."""
    seen = {"generate": [], "select": []}
    real_generate, real_select = sampling.generate_rollouts, pods.select

    def spy_generate(model, tokenizer, texts, n, settings, seed, first_chunk=0, **kwargs):
        seen["generate"].append((seed, first_chunk))
        return real_generate(model, tokenizer, texts, n, settings, seed, first_chunk, **kwargs)

    def spy_select(*args, generator=None, **kwargs):
        seen["select"].append(generator.initial_seed())
        return real_select(*args, generator=generator, **kwargs)

    monkeypatch.setattr(sampling, "generate_rollouts", spy_generate)
    monkeypatch.setattr(pods, "select", spy_select)
    args = step_args(rule="random", rollout_batch_size=2)   # 2 prompts x 4 rollouts: 4 chunks of 2 rows
    train.train_step(lora_model, smollm2_tokenizer, make_optimizer(lora_model, args), [EXAMPLES],
                     train.step_settings(args), step=5)
    [(seed, first_chunk)], [selection] = seen["generate"], seen["select"]
    chunk_seeds = {sampling.derived_seed(seed, first_chunk + chunk) for chunk in range(1000)}
    refill_seeds = {sampling.derived_seed(seed, refill) for refill in range(1, 101)}
    assert selection not in chunk_seeds | refill_seeds | {seed}
    assert seed == sampling.derived_seed(args.seed, 5, 0) and selection == train.selection_seed(seed, first_chunk)

"""The registry of reward terms (rewards.REWARD_TERMS): every registered term is checked by the parametrised test
here, and a term with its own options reaches training by name alone (--reward-weights, --reward-options)."""

import argparse
import math
import warnings

import pytest
import torch

from run import config
import rewards
import sampling

COMPLETIONS = ["<think>\n1 + 1\n</think>\n<answer>\n2\n</answer>", "the answer is 3", ""]
COMPLETION_IDS = [[5, 6, 7, 8, 9, 10], [11, 12], []]


@pytest.mark.parametrize("name", rewards.REWARD_TERMS)
def test_every_registered_term_scores_each_completion_with_its_defaults(name):
    term = rewards.REWARD_TERMS[name]
    assert term.name == name and term.summary and rewards.REWARD_FUNCS[name] is term.func
    assert rewards.DEFAULT_REWARD_WEIGHTS[name] == term.weight and math.isfinite(term.weight)
    result = rewards.compute_rewards(["q"] * 3, COMPLETIONS, ["2"] * 3, {name: term.func},
                                     completion_ids=COMPLETION_IDS)
    values = result.per_func[name]
    assert values.shape == (3,) and values.dtype == torch.float32
    torch.testing.assert_close(result.total, term.weight * torch.nan_to_num(values, nan=0.0))
    # Its options parse from the command line at their defaults' types.
    spec = ",".join(f"{name}.{key}={value}" for key, value in term.options.items())
    assert config.parse_reward_options(spec) == ({name: term.options} if term.options else {})


@pytest.fixture
def too_long_term():
    """A term as a user adds one: its own two options, default weight 0, reading the completion token ids."""
    @rewards.register_reward("too_long", 0.0, "-penalty per token past max_tokens", max_tokens=4, penalty=0.5)
    def too_long_rewards(prompts, completions, completion_ids, max_tokens, penalty, **kwargs):
        if completion_ids is None:  # outside training: not applicable
            return [None] * len(completions)
        return [-penalty * max(0, len(ids) - max_tokens) for ids in completion_ids]

    yield rewards.REWARD_TERMS["too_long"]
    for registry in (rewards.REWARD_TERMS, rewards.REWARD_FUNCS, rewards.DEFAULT_REWARD_WEIGHTS):
        registry.pop("too_long")


def test_a_term_with_options_reaches_the_run_by_name(too_long_term):
    result = rewards.compute_rewards(["q"] * 3, COMPLETIONS, ["2"] * 3, completion_ids=COMPLETION_IDS)
    assert result.per_func["too_long"].tolist() == [-1.0, 0.0, 0.0]  # logged at weight 0, not in the total
    assert result.total.tolist() == rewards.compute_rewards(["q"] * 3, COMPLETIONS, ["2"] * 3, weights={
        "too_long": 0.0}).total.tolist()
    changed = rewards.compute_rewards(["q"] * 3, COMPLETIONS, ["2"] * 3, weights={"too_long": 2.0},
                                      options={"too_long": {"penalty": 1.5}}, completion_ids=COMPLETION_IDS)
    assert changed.per_func["too_long"].tolist() == [-3.0, 0.0, 0.0]
    assert changed.total[0] == result.total[0] - 6.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = config.parse_args(["--reward-weights", "too_long=2", "--reward-options", "too_long.penalty=1.5"])
    assert args.reward_weights == dict(rewards.DEFAULT_REWARD_WEIGHTS, too_long=2.0)
    assert args.reward_options == {"too_long": {"penalty": 1.5}}
    assert config.method_label(args) == ("PODS max_variance 16/4 + rewards too_long=2, "
                                         "reward options too_long.penalty=1.5")
    for spec, message in (("too_long.cap=3", "no option 'too_long.cap'"), ("too_long.max_tokens=2.5", "needs a int"),
                          ("too_lonng.penalty=1", "no option 'too_lonng.penalty'")):
        with pytest.raises(ValueError, match=message):
            config.parse_args(["--reward-options", spec])


def test_scoring_passes_each_completions_token_ids(too_long_term):
    rollouts = sampling.Rollouts(
        prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_mask=torch.ones(1, 2, dtype=torch.long),
        completion_ids=torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 0, 0, 0, 0]]),
        completion_mask=torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0]]), texts=COMPLETIONS[:2],
        lengths=torch.tensor([6, 2]), truncated=torch.tensor([True, False]), prompt_index=torch.tensor([0, 0]))
    example = argparse.Namespace(prompt=[], answer="2")
    settings = rewards.RewardSettings(dict(rewards.DEFAULT_REWARD_WEIGHTS), {"too_long": {"max_tokens": 1}})
    result = rewards.score_rollouts(rollouts, [example], settings)
    assert result.per_func["too_long"].tolist() == [-2.5, -0.5] and result.total.shape == (2,)

"""A reward of one's own, in TRL's signature: 1 when the completion names the row's unit (the dataset's "unit" column),
minus a little for length; None (not applicable) for a row without a unit."""


def says_the_unit(prompts, completions, completion_ids, unit, **kwargs):
    rewards = []
    for completion, ids, row_unit in zip(completions, completion_ids or [None] * len(completions), unit):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        length_penalty = 0.001 * len(ids) if ids is not None else 0.0
        rewards.append(None if not row_unit else float(row_unit in text) - length_penalty)
    return rewards

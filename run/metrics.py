"""One training step's metrics line (paper §4's reward and accuracy curves, under TRL's names: reward, reward_std,
frac_reward_zero_std, completions/..., clip_ratio/..., loss, grad_norm; plus this trainer's counters and phase
timings, measured with stopwatch.timed). Where the line goes (metrics.jsonl, TensorBoard, W&B): report.py."""

from lazy import lazy_module

torch = lazy_module("torch", globals())  # imported at first use (lazy.py): commands parse flags without it

PHASE_KEYS = ("generate_s", "reward_s", "select_s", "update_s")  # a step's phases, timed by train.train_step


def step_metrics(scored, result, optimizer, costs, mask_truncated=False):
    """Metrics over all n rollouts per prompt of every train.Round; "reward_selected" over the kept ones
    (absent when nothing was kept); num_truncated_masked: kept rows whose loss --mask-truncated zeroed."""
    rewards_all = torch.cat([s.rewards for s in scored])
    kept_rewards = torch.cat([s.rewards.flatten()[s.kept_rows] for s in scored])
    lengths = torch.cat([s.lengths for s in scored]).float()
    group_std = rewards_all.std(dim=1) if rewards_all.shape[1] > 1 else torch.zeros(len(rewards_all))  # -n 1: 0
    kept_std = [rewards.std() for s in scored for rewards in kept_groups(s) if len(rewards) > 1]
    metrics = {"reward": float(rewards_all.mean()), "reward_std": float(group_std.mean()),
               "reward_min": float(rewards_all.min()), "reward_max": float(rewards_all.max()),
               **({"reward_selected": float(kept_rewards.mean())} if len(kept_rewards) else {}),
               # what max-variance maximises: the spread of the kept rewards within each prompt
               **({"reward_std_selected": float(torch.stack(kept_std).mean())} if kept_std else {}),
               # all n rewards equal (a group of one rollout too, whose std is NaN)
               "frac_reward_zero_std": float((rewards_all.amax(dim=1) == rewards_all.amin(dim=1)).float().mean())}
    for name in scored[0].per_func:
        metrics[f"rewards/{name}/mean"] = float(torch.cat([s.per_func[name] for s in scored]).nanmean())
    metrics["rewards/grader_timeouts"] = sum(int(s.grader_timeouts.sum()) for s in scored)  # accuracy 0, unverified
    metrics.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()), "completions/clipped_ratio":
                    float(torch.cat([s.truncated for s in scored]).float().mean())})
    metrics.update(result.token_means)
    if result.sampler_gap is not None:  # the sampler's log-probs against the update's (rollout_check.py)
        metrics.update(result.sampler_gap.metrics())
    step_tokens = sum(s.prompt_tokens + int(s.lengths.sum()) for s in scored)
    masked = sum(int(s.truncated[s.kept_rows].sum()) for s in scored) if mask_truncated else 0
    metrics.update(loss=result.loss, grad_norm=result.grad_norm, learning_rate=optimizer.param_groups[0]["lr"],
                   step_tokens=step_tokens, update_rows=result.rows, optimizer_steps=result.optimizer_steps,
                   num_zero_variance_dropped=sum(s.zero_variance_dropped for s in scored), num_truncated_masked=masked,
                   step_skipped=result.skipped_steps, **costs)
    metrics.update(logged_metrics(scored, metrics))
    return metrics


def logged_metrics(scored, metrics):
    """{name: mean of the step's values} of what the reward functions gave log_metric (TRL: the mean over the
    logging step), under TRL's name; a name the step's line has already is one ValueError line naming the function."""
    values = {}
    for function, name, value in (entry for s in scored for entry in s.logged_metrics):
        if name in metrics:
            raise ValueError(f"reward function {function!r} logged {name!r} with log_metric, a name the step's metrics "
                             "line has already: log it under another name")
        values.setdefault(name, []).append(value)
    return {name: sum(logged) / len(logged) for name, logged in values.items()}


def kept_groups(scored_round):
    """[each prompt's kept rewards] of a train.Round (prompts with none kept: empty)."""
    num_prompts, n = scored_round.rewards.shape
    kept = scored_round.kept_rows
    return [scored_round.rewards.flatten()[kept[kept // n == i]] for i in range(num_prompts)]

"""dynamic_sampling.py and --dynamic-sampling in train.py: which groups have no spread (total or accuracy), the refill
rounds and their bound, the selection's result mapped back onto each round; one step on a tiny model (the flags from
the command line reach the update, no kept group without a spread, the batch refilled to --prompts-per-step groups,
the bound honoured and logged, batch scope and grad accumulation); whole runs (label, metrics, the completions log
marking the filtered groups, a crash mid-step then --resume equal to the uninterrupted run)."""

import itertools
import json

import pytest
import torch

from run import completions
from run import config
import data
from variants import dynamic_sampling
import eval as eval_module
import models
import pods
import rewards
import sampling
import train
import update
from run_helpers import TIMING, every_third_constant, fake_compute_rewards, read_lines, tiny_argv

pytestmark = pytest.mark.usefixtures("varied_rewards")


# ------------------------------------------------------------------------------------------ the pure parts

def test_without_spread_follows_the_metric():
    total = torch.tensor([[1.0, 2.0, 3.0], [1.5, 1.5, 1.5], [0.0, 1.0, 0.0]])
    accuracy = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, float("nan")])
    per_func = {"accuracy": accuracy}
    assert dynamic_sampling.without_spread(total, per_func).tolist() == [False, True, False]
    # accuracy: group 2 differs in format only (its NaN counts as 0, as in the total)
    assert dynamic_sampling.without_spread(total, per_func, "accuracy").tolist() == [False, True, True]
    with pytest.raises(ValueError, match="needs the accuracy reward"):
        dynamic_sampling.without_spread(total, {}, "accuracy")
    with pytest.raises(ValueError, match="must be one of"):
        dynamic_sampling.without_spread(total, per_func, "format")


def fake_round(group_rewards):
    """A train.Round with rewards [P, n] and no rollouts (refill looks at the rewards only)."""
    group_rewards = torch.tensor(group_rewards, dtype=torch.float32)
    return train.Round([None] * len(group_rewards), None, group_rewards, {}, None)


@pytest.mark.parametrize("max_rounds, asked, missing", [(10, [2, 1, 1], 0), (3, [2, 1], 1), (1, [], 2)])
def test_refill_draws_what_is_missing_until_full_or_out_of_rounds(max_rounds, asked, missing):
    queue = [[[0.0, 1.0], [1.0, 1.0]], [[0.5, 0.5]], [[0.0, 0.25]]]  # the rounds' rewards after the first
    calls = []

    def generate(missing, index):
        calls.append((missing[0], index))
        return fake_round(queue.pop(0)[:missing[0]])

    rounds = dynamic_sampling.refill(fake_round([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]), generate, 3, "total",
                                     max_rounds)
    assert [count for count, _ in calls] == asked and [index for _, index in calls] == list(range(1, len(asked) + 1))
    assert len(rounds) == len(asked) + 1 <= max_rounds
    assert [part.marks["filtered"].tolist() for part in rounds] == \
        [[True, True, False], [False, True], [True], [False]][:len(rounds)]
    assert 3 - dynamic_sampling.entered(rounds) == missing
    assert dynamic_sampling.Refilled(rounds).rewards.tolist() == [[0.0, 1.0], [0.0, 1.0], [0.0, 0.25]][:3 - missing]


def test_with_several_processes_every_process_refills_its_own_share_and_all_stop_alike():
    """Process 0 of two (2 groups each): the other process's counts (1, then 2) come from counts(); both missing
    lists are passed on (the prompts drawn are their sum), and the rounds continue while either lacks a group. Out of
    rounds, each keeps as many groups as the poorer has (even_out)."""
    other = iter([1, 2, 2])
    calls = []

    def generate(missing, index):
        calls.append(missing)
        return fake_round([[0.0, 1.0]] if index == 1 else [[1.0, 1.0]])

    counts = (lambda value: [value, next(other)])
    rounds = dynamic_sampling.refill(fake_round([[0.0, 0.0], [0.0, 1.0]]), generate, 2, "total", 10, counts)
    assert calls == [[1, 1]] and dynamic_sampling.entered(rounds) == 2
    other = iter([0, 0])
    rounds = dynamic_sampling.refill(fake_round([[0.0, 1.0], [0.0, 1.0]]), generate, 2, "total", 2, counts)
    # the other process has none: every group here is set aside to even out the rows, though each has a spread
    assert [part.marks["filtered"].tolist() for part in rounds] == [[False, False], [False]]
    assert [part.marks["set_aside"].tolist() for part in rounds] == [[True, True], [True]]
    assert dynamic_sampling.entered(rounds) == 0


def test_rounds_that_keep_finding_no_spread_say_so_and_end_at_the_bound():
    """Every ROUNDS_BETWEEN_NOTES rounds without a full batch, a line says how many rounds ran and how many groups
    have a spread; the rounds stop at max_rounds (config refuses more than MAX_GENERATION_ROUNDS)."""
    lines, calls = [], []

    def generate(missing, index):
        calls.append(index)
        return fake_round([[1.0, 1.0]] * missing[0])

    rounds = dynamic_sampling.refill(fake_round([[1.0, 1.0], [0.0, 0.0]]), generate, 2, "total", 25, say=lines.append)
    assert len(rounds) == 25 and calls == list(range(1, 25)) and dynamic_sampling.entered(rounds) == 0
    assert lines == [f"dynamic sampling: {count} generation rounds so far and 0 of 2 groups with a spread; at most 25 "
                     "rounds (--max-generation-rounds), then the step trains on what it has" for count in (10, 20)]
    assert dynamic_sampling.ROUNDS_BETWEEN_NOTES == 10 and config.MAX_GENERATION_ROUNDS == 100


def test_groups_set_aside_to_even_out_the_processes_are_not_counted_as_filtered():
    """Two processes, rounds out: this one holds 2 groups with a spread, the other 1, so even_out leaves one of ours
    out. It has a spread: frac_filtered (groups without one) stays 0 and frac_set_aside counts it; the completions
    log marks it set aside, not filtered, and the viewer says why."""
    rounds = dynamic_sampling.refill(fake_round([[0.0, 1.0], [1.0, 0.0]]), None, 2, "total", 1,
                                     counts=lambda value: [value, 1])
    assert rounds[0].marks["filtered"].tolist() == [False, False]
    assert rounds[0].marks["set_aside"].tolist() == [False, True]
    assert dynamic_sampling.Refilled(rounds).rewards.tolist() == [[0.0, 1.0]]
    metrics = dynamic_sampling.step_metrics(rounds, 2)
    assert metrics["dynamic_sampling/frac_filtered"] == 0.0 and metrics["dynamic_sampling/frac_set_aside"] == 0.5
    assert metrics["dynamic_sampling/groups_missing"] == 1
    rollouts = rollouts_of(2, 2)
    examples = [data.Example(text=f"q{i}", prompt=[], answer=str(i)) for i in range(2)]
    scored = train.Round(examples, rollouts, rounds[0].rewards, {}, None, marks=rounds[0].marks)
    scored.keep(torch.tensor([[0]]), torch.tensor([[0.5]]))  # the one group that entered: its first rollout
    prompts = [row for row in completions.completions_record(1, [scored])["rows"] if row["type"] == "prompt"]
    assert [(row["filtered"], row["set_aside"]) for row in prompts] == [(False, False), (False, True)]
    lines = completions.rollout_table(completions.completions_record(1, [scored])["rows"], 1)
    assert "to even out the processes' rows" in lines[1] and "no reward spread" not in lines[1]


def test_join_pads_prompts_left_and_completions_right():
    short = update.UpdateBatch(torch.tensor([[7]]), torch.tensor([[1]]), torch.tensor([[5]]), torch.tensor([[1]]),
                               torch.tensor([0.5]), torch.tensor([True]))
    long = update.UpdateBatch(torch.tensor([[8, 9]]), torch.tensor([[1, 1]]), torch.tensor([[3, 4, 2]]),
                              torch.tensor([[1, 1, 1]]), torch.tensor([-0.5]), torch.tensor([False]))
    joined = dynamic_sampling.join([short, long], pad_id=2)
    assert joined.prompt_ids.tolist() == [[2, 7], [8, 9]] and joined.prompt_mask.tolist() == [[0, 1], [1, 1]]
    assert joined.completion_ids.tolist() == [[5, 2, 2], [3, 4, 2]]
    assert joined.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert joined.advantages.tolist() == [0.5, -0.5] and joined.truncated.tolist() == [True, False]
    assert dynamic_sampling.join([short], pad_id=2) is short


def rollouts_of(num_prompts, n):
    """Rollouts whose completion row r holds the token r: a kept row is recognisable in the batch."""
    rows = num_prompts * n
    prompt_ids = torch.arange(num_prompts)[:, None].repeat(1, 2)
    return sampling.Rollouts(prompt_ids, torch.ones(num_prompts, 2, dtype=torch.long),
                             torch.arange(rows)[:, None], torch.ones(rows, 1, dtype=torch.long), [""] * rows,
                             torch.ones(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.bool),
                             torch.arange(num_prompts).repeat_interleave(n))


@pytest.mark.parametrize("scope", ["prompt", "batch"])
def test_refilled_rounds_train_on_the_entered_groups_rows_only(scope):
    first, second = fake_round([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]]), fake_round([[3.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    for part in (first, second):
        part.rollouts = rollouts_of(2, 3)
        dynamic_sampling.mark(part, "total")  # the groups without a spread: filtered
    refilled = dynamic_sampling.Refilled([first, second])
    refilled.keep(*pods.select(refilled.rewards, 2, "max_variance", scope=scope)[:2])
    (batch_one, rows_one), (batch_two, rows_two) = [(part.update_batch(), part.kept_rows) for part in refilled.parts]
    assert rows_one.tolist() == batch_one.completion_ids.flatten().tolist() and set(rows_one.tolist()) <= {0, 1, 2}
    assert rows_two.tolist() == batch_two.completion_ids.flatten().tolist() and set(rows_two.tolist()) <= {0, 1, 2}
    expected = pods.masked_advantages(torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]),
                                      torch.tensor([[r in rows_one.tolist() for r in range(3)],
                                                    [r in rows_two.tolist() for r in range(3)]]))
    torch.testing.assert_close(torch.cat([batch_one.advantages, batch_two.advantages]),
                               torch.cat([expected[0][rows_one], expected[1][rows_two]]))
    alone = fake_round([[0.0, 1.0, 2.0], [3.0, 1.0, 1.0]])  # one round, nothing set aside: update.kept_batch's
    alone.rollouts = rollouts_of(2, 3)
    kept, advantages, _ = pods.select(alone.rewards, 2, "max_variance", scope=scope)
    alone.keep(kept, advantages)
    batch, rows = alone.update_batch(), alone.kept_rows
    direct = update.kept_batch(alone.rollouts, kept, advantages)
    assert torch.equal(rows, update.kept_rows(kept, 3)) and torch.equal(batch.completion_ids, direct.completion_ids)
    assert torch.equal(batch.advantages, direct.advantages)


# ------------------------------------------------------------------------------------------ one step

EXAMPLES = [data.Example(text="What is 2 + 3?", prompt=[], answer="5"),
            data.Example(text="Add 10 and 7, then say hi:", prompt=[], answer="17"),
            data.Example(text="Say nothing.", prompt=[], answer="0")]


def graded(prompts, completions, answers, **kwargs):
    """From the completion text (a random model's rollouts would all score 0 under the real rewards): answer "5"
    varies in accuracy and format, "17" in format only, "0" in neither."""
    char_sum = fake_compute_rewards(None, completions, None).total
    is_five = torch.tensor([answer == "5" for answer in answers])
    constant = torch.tensor([answer == "0" for answer in answers])
    accuracy = torch.where(is_five, (char_sum * 100).remainder(2), 0.0)
    formatted = torch.where(constant, 0.5, char_sum)
    return rewards.RewardResult(total=accuracy + formatted, per_func={"accuracy": accuracy, "format": formatted})


def run_step(model, tokenizer, argv, monkeypatch, rounds=None, pool=EXAMPLES):
    """train_step with the flags `argv` on `rounds` (default: EXAMPLES), refills drawn from the cycle of `pool`:
    (args, metrics, scored rounds, {the rollouts of each generation round, the batches the update received, the
    examples each refill drew})."""
    seen = {"rollouts": [], "batches": None, "drawn": []}
    real_generate, real_update = sampling.generate_rollouts, update.update_policy

    def spy_update(model, optimizer, batches, settings, **kwargs):
        seen["batches"] = batches
        return real_update(model, optimizer, batches, settings, **kwargs)

    monkeypatch.setattr(sampling, "generate_rollouts",
                        lambda *a, **k: seen["rollouts"].append(real_generate(*a, **k)) or seen["rollouts"][-1])
    monkeypatch.setattr(update, "update_policy", spy_update)
    monkeypatch.setattr(rewards, "compute_rewards", graded)
    args = config.parse_args(["--model", models.SMOLLM2_ALIAS, "--device", "cpu", "-n", "4", "-m", "2",
                              "--max-completion-tokens", "4", "--micro-batch-size", "8", "--learning-rate", "0.01",
                              "--seed", "3", "--dynamic-sampling", *argv])
    pool = itertools.cycle(pool)

    def draw(count):
        seen["drawn"].append([next(pool) for _ in range(count)])
        return seen["drawn"][-1]

    lora = models.prepare_for_training(model, lora_rank=4, lora_alpha=8)
    optimizer = update.make_optimizer(lora, args.learning_rate)
    rounds = rounds or [EXAMPLES]
    metrics, scored = train.train_step(lora, tokenizer, optimizer, rounds, train.step_settings(args), 2,
                                       train.round_strategy(args, draw=draw))
    metrics.update(dynamic_sampling.step_metrics(scored, sum(map(len, rounds))))  # as the loop (run/loop.py) does
    return args, metrics, scored, seen


def expected_update(args, seen, prompts):
    """What the update must receive, recomputed here: each round's rewards from its texts, the groups whose rewards
    (total or accuracy) vary, pods.select called directly on those, the kept rows of each round."""
    parts, entered = [], []
    for rollouts, examples in zip(seen["rollouts"], prompts):
        result = graded(None, rollouts.texts, [examples[i].answer for i in rollouts.prompt_index.tolist()])
        values = (result.per_func["accuracy"] if args.dynamic_sampling_metric == "accuracy" else result.total)
        values = values.view(len(examples), -1)
        spread = values.amax(1) != values.amin(1)
        parts.append((rollouts, spread))
        entered.append(result.total.view(len(examples), -1)[spread])
    first_seed = sampling.derived_seed(args.seed, 2, 0)
    kept, advantages, _ = pods.select(torch.cat(entered), args.update_size, args.rule, scope=args.selection_scope,
                                      generator=torch.Generator().manual_seed(train.selection_seed(first_seed, 0)))
    if kept.dtype == torch.bool:  # batch scope: a mask; the paper's scope: m indices per group, in the rule's order
        kept, advantages = [row.nonzero().squeeze(1) for row in kept], [a[k] for a, k in zip(advantages, kept)]
    expected, start = [], 0
    for rollouts, spread in parts:
        groups = spread.nonzero().squeeze(1).tolist()
        rows = [g * 4 + int(j) for i, g in enumerate(groups) for j in kept[start + i]]
        part_advantages = [float(a) for i in range(len(groups)) for a in advantages[start + i]]
        completions = [rollouts.completion_ids[r, :int(rollouts.completion_mask[r].sum())].tolist() for r in rows]
        expected.append((completions, part_advantages, spread))
        start += len(groups)
    return expected


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("argv", [[], ["--dynamic-sampling-metric", "accuracy"], ["--selection-scope", "batch"]])
def test_the_flags_arrive_at_the_update_and_no_kept_group_lacks_a_spread(argv, tiny_model, smollm2_tokenizer,
                                                                         monkeypatch):
    """--dynamic-sampling and its metric, from the command line: the groups without a spread in the metric are set
    aside, refills draw as many prompts as are missing until --prompts-per-step groups have a spread, and the update
    receives exactly pods.select over those groups (the rows and advantages recomputed here)."""
    args, metrics, scored, seen = run_step(tiny_model, smollm2_tokenizer, argv, monkeypatch)
    prompts = [EXAMPLES, *seen["drawn"]]
    expected = expected_update(args, seen, prompts)
    assert len(expected) == len(scored) == metrics["dynamic_sampling/generation_rounds"] > 1
    [batch] = seen["batches"]  # one update batch: every round's kept rows, round by round
    trained = [ids[:int(mask.sum())].tolist() for ids, mask in zip(batch.completion_ids, batch.completion_mask)]
    assert trained == [row for completions, _, _ in expected for row in completions]
    torch.testing.assert_close(batch.advantages, torch.tensor([a for _, advantages, _ in expected for a in advantages]))
    for (_, _, spread), part in zip(expected, scored):
        assert torch.equal(part.marks["filtered"], ~spread)  # logged as set aside: exactly the groups without a spread
    entered = sum(int((~part.marks["filtered"]).sum()) for part in scored)
    assert entered == 3 and metrics["dynamic_sampling/groups_missing"] == 0  # refilled to --prompts-per-step
    assert [len(d) for d in seen["drawn"]] == [3 - sum(int((~p.marks["filtered"]).sum()) for p in scored[:i + 1])
                                              for i in range(len(seen["drawn"]))]  # only what is missing
    generated = sum(len(part.marks["filtered"]) for part in scored)
    assert metrics["dynamic_sampling/groups_generated"] == generated
    assert metrics["dynamic_sampling/frac_filtered"] == pytest.approx(1 - entered / generated)
    assert metrics["update_rows"] == 3 * 2 and metrics["grad_norm"] > 0
    filtered_answers = {part.answers[i] for part in scored
                        for i in part.marks["filtered"].nonzero().squeeze(1).tolist()}
    assert "0" in filtered_answers and ("17" in filtered_answers) == (args.dynamic_sampling_metric == "accuracy")


@pytest.mark.usefixtures("one_torch_thread")
def test_the_round_bound_is_honoured_and_logged_and_grad_accum_refills_each_batch(tiny_model, smollm2_tokenizer,
                                                                                  monkeypatch):
    nothing = [EXAMPLES[2]] * 2  # answer "0": never a spread, so no refill can fill the batch
    args, metrics, scored, seen = run_step(tiny_model, smollm2_tokenizer, ["--max-generation-rounds", "3",
                                                                          "--grad-accum-steps", "2"],
                                           monkeypatch, rounds=[nothing, EXAMPLES[:2]], pool=nothing)
    assert [len(part.marks["filtered"]) for part in scored[:3]] == [2, 2, 2]  # batch 1: 3 rounds, nothing entered
    assert scored[0].marks["filtered"].all() and scored[1].marks["filtered"].all() and scored[2].marks["filtered"].all()
    assert len(seen["rollouts"]) == metrics["dynamic_sampling/generation_rounds"] == len(scored)
    missing_second = 2 - sum(int((~part.marks["filtered"]).sum()) for part in scored[3:])
    assert metrics["dynamic_sampling/groups_missing"] == 2 + missing_second
    assert metrics["update_rows"] == 2 * (2 - missing_second) > 0  # trains on what there is


# ------------------------------------------------------------------------------------------ whole runs

DYNAMIC_ARGV = ["--dynamic-sampling", "--max-steps", "4", "--eval-samples", "0", "--log-completions-interval", "1"]


@pytest.fixture(scope="module")
def dynamic_run(tiny_model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rewards, "compute_rewards", every_third_constant)
        return train.main(tiny_argv(tiny_model_dir, tmp_path_factory.mktemp("dynamic") / "run", *DYNAMIC_ARGV))


def test_a_run_logs_the_refills_and_marks_the_filtered_groups(dynamic_run):
    saved = json.loads((dynamic_run / "config.json").read_text())
    assert saved["label"] == "PODS max_variance 4/2 + dynamic sampling (total)" and saved["max_generation_rounds"] == 10
    steps = read_lines(dynamic_run, "train")
    filtered_in_all = []
    for line in steps:
        _, rows = completions.read_completions(dynamic_run, line["step"])
        prompts = [row for row in rows if row["type"] == "prompt"]
        kept = {row["prompt_id"] for row in rows if row["type"] == "rollout" and row["kept"]}
        filtered = [row for row in prompts if row["filtered"]]
        assert all(int(row["answer"]) % 3 == 0 and row["prompt_id"] not in kept for row in filtered)
        assert all(int(row["answer"]) % 3 for row in prompts if not row["filtered"])
        assert len(prompts) - len(filtered) == len(kept) == 2  # refilled to --prompts-per-step
        # the refills' sampler log-probs joined row for row: the update's log-probs match them on every kept row
        assert all(row["sampler_ratio"] == pytest.approx(1, abs=1e-3) for row in rows if row.get("kept"))
        assert line["sampler/logprob_diff_max"] < 1e-3
        assert line["dynamic_sampling/groups_generated"] == len(prompts) and line["update_rows"] == 4
        assert line["dynamic_sampling/frac_filtered"] == pytest.approx(len(filtered) / len(prompts))
        assert line["dynamic_sampling/groups_missing"] == 0 and line["dynamic_sampling/generation_rounds"] >= 1
        filtered_in_all += [(line["step"], row["prompt_id"]) for row in filtered]
    assert filtered_in_all  # the run did set groups aside; the viewer says so
    step, prompt_id = filtered_in_all[0]
    lines = eval_module.main(["rollouts", str(dynamic_run), "--step", str(step), "--prompt", str(prompt_id)])
    assert "4 rollouts, 0 kept (*), set aside by --dynamic-sampling (no reward spread), by reward:" in lines


def test_a_crash_mid_step_after_a_refill_then_resume_equals_the_uninterrupted_run(dynamic_run, tiny_model_dir,
                                                                                  tmp_path, monkeypatch):
    """The refills advance the prompt cursor inside the step; a crash there (after the last checkpoint) and --resume
    draw the same prompts and refills again: every metrics line (timings aside) and completions file are equal."""
    monkeypatch.setattr(rewards, "compute_rewards", every_third_constant)
    crash_step = next(line["step"] for line in read_lines(dynamic_run, "train")
                      if line["step"] > 1 and line["dynamic_sampling/generation_rounds"] > 1)
    calls, real_step, real_generate = {"step": 0, "generated": 0}, train.train_step, sampling.generate_rollouts

    def step(*args):
        calls.update(step=args[5], generated=0)
        return real_step(*args)

    def generate(*args, **kwargs):
        calls["generated"] += 1
        if calls["step"] == crash_step and calls["generated"] == 2:  # a refill, the cursor already moved
            raise RuntimeError("crash on purpose")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(sampling, "generate_rollouts", generate)
    run_dir = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="crash on purpose"):
        train.main(tiny_argv(tiny_model_dir, run_dir, *DYNAMIC_ARGV))
    monkeypatch.setattr(sampling, "generate_rollouts", real_generate)
    train.main(["--output-dir", str(run_dir), "--resume", "--no-progress"])

    def comparable(run):
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
                for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert comparable(run_dir) == comparable(dynamic_run)
    logs = [{p.name: p.read_text() for p in (run / completions.COMPLETIONS_DIR).iterdir()}
            for run in (run_dir, dynamic_run)]
    assert logs[0] == logs[1] and len(logs[0]) == 4

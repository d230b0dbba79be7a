"""Rewards (paper Appendix A.1): extraction order, math-verify equivalence, letters, format and tag count,
the TRL-shaped batch API, time limits on adversarial input, and sweeps over the real datasets.
The grader's worker machinery itself (pool, kill at the deadline, verdict cache) is in test_grader.py."""

import json
import math
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grading import grader
import rewards
from rewards import (accuracy_reward, compute_rewards, extract_final_answer, format_reward, grade_accuracy,
                     tag_count_reward)


def formatted(answer, thinking="some reasoning"):
    return f"<think>\n{thinking}\n</think>\n<answer>\n{answer}\n</answer>"


def read_rows(data_dir, relative):
    with open(data_dir / relative, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# ------------------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize("completion, expected", [
    ("<answer>1</answer> then <answer> 2 </answer> \\boxed{3} 4", "2"),  # last answer block wins
    ("no block: \\boxed{3} and \\boxed{\\frac{1}{2}} 7", "\\frac{1}{2}"),  # then the last \boxed
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),  # nested braces
    ("so the total is \\boxed 5.", "5"),  # unbraced form
    ("we get 3 apples, then 1,250.5 apples", "1,250.5"),  # then the last number
    ("<answer>unclosed 5 and 6", "6"),  # an unclosed block is no block
    ("\\boxed{unclosed 7 and 8", "8"),  # nor is an unclosed box
    ("nothing numeric here", None),
    ("", None),
])
def test_extract_final_answer_follows_the_fallback_order(completion, expected):
    assert extract_final_answer(completion) == expected


# ---------------------------------------------------------------------------------------- equivalence
EQUIVALENT = [  # (ground truth, prediction inside the answer block)
    ("72", "72"), ("72", "The answer is 72."), ("72", "\\boxed{72}"), ("72", "$72$"), ("72", "72."),
    ("1000", "1,000"), ("1000", "$1,000"), ("1000", "\\$1,000"), ("18", "$18.00"), ("5", "5 cm"),
    ("5", "5 dollars"), ("-3", "\u22123"), ("0.5", "\\frac{1}{2}"), ("\\frac{1}{2}", "1/2"),
    ("\\frac{1}{2}", "0.5"), ("\\frac{1}{2}", "\\dfrac{1}{2}"), ("\\frac12", "\\tfrac{1}{2}"),
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"), ("[1, 2)", "[1,2)"),
    ("\\text{Evelyn}", "Evelyn"), ("\\text{Evelyn}", "\\text{Evelyn}"), ("30\\%", "30"), ("30", "30\\%"),
    ("90^\\circ", "90"), ("90", "90\u00b0"), ("x^2 + 1", "1 + x^2"), ("\\sqrt{2}", "\\sqrt2"),
    ("\\$32,\\!348", "32348"), ("23{,}000", "23000"), ("2\\sqrt{3}", "$2\\sqrt{3}$"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"), ("\\text{(C)}", "\\text{(C)}"),
]
NOT_EQUIVALENT = [
    ("72", "73"), ("72", "7.2"), ("1000", "1,001"), ("\\frac{1}{2}", "\\frac{1}{3}"), ("\\frac12", "0.6"),
    ("(3, \\frac{\\pi}{2})", "(3, \\pi)"), ("[1, 2)", "[1, 2]"), ("\\text{Evelyn}", "Adam"), ("x^2 + 1", "x^2"),
    ("5", ""), ("5", "five"), ("72", "72 apples and 3 oranges"), ("12", "1 2"),
]


@pytest.mark.parametrize("gold, prediction", EQUIVALENT)
def test_equivalent_answers_score_one(gold, prediction):
    assert accuracy_reward(formatted(prediction), gold) == 1.0


@pytest.mark.parametrize("gold, prediction", NOT_EQUIVALENT)
def test_different_answers_score_zero(gold, prediction):
    assert accuracy_reward(formatted(prediction), gold) == 0.0


def test_fast_number_path_agrees_with_math_verify():
    """The sympy-free path for plain numbers must give math-verify's verdict."""
    pairs = [("72", p) for p in ("72", "72.0", "072", "72.", "$72", "\\boxed{72}", "71", "-72", "7,200",
                                 "The answer is 72", "72 dollars", "**72**")]
    pairs += [("1234567", "1,234,567"), ("-3", "-3"), ("0.25", ".25"), ("10", "10.5")]
    for gold, prediction in pairs:
        fast = rewards._grade_cheaply(formatted(prediction), gold)[0]
        assert fast is not None, prediction  # really took the fast path
        assert fast == float(grader._math_verify_equal(gold, prediction)), (gold, prediction)


@pytest.mark.parametrize("prediction", ["B", "(B)", "B.", "B) benzene", "The answer is B", "**B**",
                                        "\\boxed{B}", "Answer: (B)", "$B$", "\\text{B}", "option B"])
def test_multiple_choice_accepts_the_letter_forms(prediction):
    assert accuracy_reward(formatted(prediction), "B") == 1.0
    assert accuracy_reward(formatted(prediction), "C") == 0.0


def test_multiple_choice_edge_cases():
    assert accuracy_reward("After thinking, the answer is D.", "D") == 1.0  # no tags: "answer is X"
    assert accuracy_reward("A long explanation that never picks", "A") == 0.0  # a leading "A" is no pick
    assert accuracy_reward(formatted("A reasonable choice is C, so the answer is C"), "C") == 1.0
    assert accuracy_reward(formatted("Because of the salt"), "B") == 0.0  # "B" inside a word
    assert accuracy_reward(formatted("the answer is a mixture"), "A") == 0.0  # lowercase article
    assert accuracy_reward(formatted("4"), "4") == 1.0  # a numeric GSM8K answer is no letter


# --------------------------------------------------------------------------------- format, tag count
@pytest.mark.parametrize("completion, expected", [
    (formatted("72"), 1.0),
    ("  " + formatted("72") + "\n", 1.0),  # whitespace at the two ends is ignored
    ("<think>\n\n</think>\n<answer>\n\n</answer>", 1.0),  # empty parts are allowed, as in the regex
    ("<think>\n</think>\n<answer>\n72\n</answer>", 0.0),  # needs a newline on each side of the reasoning
    ("<think>x</think>\n<answer>\n72\n</answer>", 0.0),
    ("<think>\nx\n</think><answer>\n72\n</answer>", 0.0),
    ("<think>\nx\n</think>\n<answer>\n72</answer>", 0.0),
    (formatted("72") + " trailing text", 0.0),
    ("preamble " + formatted("72"), 0.0),
    (formatted("72") + "\n<answer>\n73\n</answer>", 0.0),  # each tag exactly once
    ("<answer>\n72\n</answer>\n<think>\nx\n</think>", 0.0),  # order matters
    ("<think>\nx\n</think>\n<answer>\n72\n</answer>".replace("\n", "\r\n"), 0.0),
    ("", 0.0),
])
def test_format_reward(completion, expected):
    assert format_reward(completion) == expected


@pytest.mark.parametrize("completion, expected", [
    (formatted("72"), 1.0),
    ("<think>\nx\n</think>\n", 0.5),
    ("<think>\nx\n</think>\n<answer>\n72", 0.75),  # truncated before the closing tag
    ("<think>\nx\n</think>\n<think>\ny\n</think>\n<answer>\n72\n</answer>", 0.5),  # doubled tags count 0
    ("<think>x</think><answer>72</answer>", 0.0),
    ("", 0.0),
])
def test_tag_count_reward(completion, expected):
    assert tag_count_reward(completion) == expected


# ------------------------------------------------------------------------------------ TRL-shaped API
def test_trl_shaped_functions_accept_strings_and_chat_messages():
    completions = [formatted("72"), [{"role": "assistant", "content": formatted("5")}], "no tags 72"]
    answers = ["72", "6", "72"]
    prompts = ["q"] * 3
    assert rewards.accuracy_rewards(prompts, completions, answers, trainer_state=None) == [1.0, 0.0, 1.0]
    assert rewards.format_rewards(prompts, completions, answer=answers) == [1.0, 1.0, 0.0]
    assert rewards.tag_count_rewards(prompts, completions) == [1.0, 1.0, 0.0]


def test_compute_rewards_weights_and_user_functions():
    completions = [formatted("72"), "no tags 72", formatted("9")]
    answers = ["72", "72", "72"]
    result = compute_rewards(["q"] * 3, completions, answers)
    assert torch.equal(result.per_func["accuracy"], torch.tensor([1.0, 1.0, 0.0]))
    assert torch.allclose(result.total, torch.tensor([3.0, 1.0, 2.0]))
    assert result.metrics()["rewards/format/mean"] == pytest.approx(2 / 3)

    def length_penalty(prompts, completions, answer, **kwargs):  # a user function: None = not applicable
        return [None if "no tags" in c else -0.5 for c in completions]

    funcs = {**rewards.REWARD_FUNCS, "length": length_penalty}
    result = compute_rewards(["q"] * 3, completions, answers, funcs, {"accuracy": 1.0, "format": 0.1,
                                                                       "tag_count": 0.1, "length": 2.0})
    assert torch.allclose(result.total, torch.tensor([1.2 - 1.0, 1.0, 0.2 - 1.0]))
    assert torch.isnan(result.per_func["length"][1])
    with pytest.raises(ValueError, match=r"no weight for reward functions \['length'\]"):
        compute_rewards(["q"] * 3, completions, answers, funcs)
    with pytest.raises(ValueError, match="unknown reward functions"):
        compute_rewards(["q"], ["x"], ["1"], weights={**rewards.DEFAULT_REWARD_WEIGHTS, "acuracy": 1.0})
    with pytest.raises(ValueError, match="returned 1 values for 3"):
        compute_rewards(["q"] * 3, completions, answers, {"bad": lambda **kw: [0.0]}, {"bad": 1.0})
    with pytest.raises(ValueError, match="one prompt and one answer per completion"):
        compute_rewards(["q"], completions, answers)
    with pytest.raises(ValueError, match="'answer' column"):
        rewards.accuracy_rewards(["q"], ["x"], None)


# -------------------------------------------------------------------------------- adversarial input
def _adversarial_cases():
    towers = ["9^9^9^9", "10**10**10**10", "9^{9^{9^{9}}}", "2^{2^{2^{2^{2^{2}}}}}", "(10^{10})^{10^{10}}",
              "10^{10^{10}}", "2**2**2**2**2**2", "9^{9^9}", "10^{123456789}", "123456789^{987654321}",
              "99999!", "(10^{10})!", "\\frac{10^{10^{10}}}{3}", "e^{e^{e^{e^{10}}}}", "1e100000000",
              "10**100000000", "\\sqrt[10^{10}]{2}", "\\sum_{i=1}^{10^{12}} i", "\\prod_{k=1}^{10^9} k",
              "\\binom{10^{12}}{10^6}", "\\lim_{x \\to \\infty} x^x", "\\int_0^\\infty e^{-x^2} dx",
              "x^{x^{x^{x^{x}}}}", "\\frac{1}{0}", "0/0", "\\infty - \\infty", "\\log(0)", "1/0 + 1",
              "\\frac{\\frac{\\frac{\\frac{1}{2}}{3}}{4}}{5}", "((((((1))))))", "\\sqrt{\\sqrt{\\sqrt{-1}}}",
              "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}^{10^{9}}", "i^{i^{i^{i}}}", "0^0",
              "\\zeta(1)", "\\Gamma(-1)", "10^{-10^{10}}", "\\tan(\\pi/2)", "1" * 999, "9" * 400 + "!"]
    nested = ["{" * 10_000 + "}" * 10_000, "{" * 10_000, "}" * 10_000, "(" * 10_000 + ")" * 10_000,
              "\\frac{" * 3000, "\\boxed{" * 5000, "\\sqrt{" * 2000 + "2" + "}" * 2000, "[" * 10_000,
              "\\left(" * 2000, "x^{" * 3000 + "2" + "}" * 3000]
    huge = ["x" * 1_000_000, "1" * 1_000_000, "<answer>" * 100_000, "</answer>" * 100_000,
            "\\boxed{" + "1" * 999_990 + "}", "<think>\n" + "a" * 1_000_000 + "\n</think>\n<answer>\n5\n</answer>",
            "<answer>\n" + "9" * 500_000 + "\n</answer>", "\n</think>\n<answer>\n" * 50_000,
            "1,2" * 300_000, "\\boxed{\\boxed{" * 100_000]
    tags = ["<answer>", "</answer>", "<answer></answer>", "</answer><answer>", "<answer>5", "5</answer>",
            "<think>", "</think>", "<think><answer>5</think></answer>", "<answer><answer>5</answer>",
            "<answer>\\boxed{</answer>}", "<ANSWER>5</ANSWER>", "<answer >5</answer >", "<answer>\x00</answer>",
            "<think>\n<think>\n</think>\n</think>", "<<answer>>5<</answer>>"]
    unicode = ["", " ", "\n", "\x00", "\ufeff5", "\u202e5\u202c", "\U0001f600", "5\u0301", "\u0665",
               "\u00bd", "\u221e", "\u2212\u221e", "\ud7ff", "\u200b5\u200b", "\uff15", "\u2155", "\t\r\x0b\x0c",
               "\\u0000", "\u00e9\u00e8", "\u2028\u2029", "\U000e0001", "\ufffd" * 1000]
    latex_junk = ["\\", "\\\\", "$", "$$", "\\$", "{", "}", "\\frac", "\\frac{", "\\frac{1}{", "\\boxed{}",
                  "\\boxed", "\\left(", "\\right)", "^", "_", "&", "%", "#", "~", "\\begin{matrix}",
                  "\\end{pmatrix}", "\\text{", "\\sqrt[", "1e", "--5", "5..", ",", ".", "-", "1/", "/1"]
    cases = [(case, "5") for case in towers + nested + huge + tags + unicode + latex_junk]
    cases += [(formatted(case), "5") for case in towers + latex_junk]
    cases += [(formatted("5"), gold) for gold in towers[:12] + nested[:4] + ["", "\x00", "{" * 10_000]]
    cases += [(formatted("B"), "B" * 1_000_000), (formatted("B"), "\u0042\u0301")]
    return cases


ADVERSARIAL = _adversarial_cases()
# A legitimate comparison that takes sympy ~0.1-0.3 s of CPU: surely past a tiny limit of the CPU-time timer, where a
# cheap pair may finish before the timer's first tick.
SLOW_GOLD = "(x+2)^{20}"
SLOW_PREDICTION = " + ".join(f"{c} x^{{{20 - k}}}" if k < 20 else str(c)
                             for k, c in enumerate(math.comb(20, k) * 2 ** k for k in range(21)))


def test_adversarial_inputs_never_raise_and_are_graded_within_the_graders_limits():
    """Each case ends within the grader's wall limits whatever the load (a comparison gets VERIFY_TIMEOUT_S, then
    RETRY_FACTOR times that, of CPU time, and is killed after WALL_FACTOR times either in wall time), and the cheap
    pre-filters keep all but a few cases away from sympy's worst."""
    assert len(ADVERSARIAL) >= 100
    assert accuracy_reward(formatted("x^{2}"), "x^2") == 1.0  # the grader server starts once per process
    limit_s = (1 + grader.RETRY_FACTOR) * (grader.WALL_FACTOR * rewards.VERIFY_TIMEOUT_S + grader.KILL_GRACE_S)
    worst_s, worst_case, timed_out = 0.0, None, 0
    for completion, gold in ADVERSARIAL:
        for grade in (lambda: accuracy_reward(completion, gold), lambda: format_reward(completion),
                      lambda: tag_count_reward(completion)):
            start = time.perf_counter()
            with rewards.timeouts_counted() as timeouts:
                score = grade()
            elapsed_s = time.perf_counter() - start
            timed_out += len(timeouts.positions)
            assert 0.0 <= score <= 1.0
            if elapsed_s > worst_s:
                worst_s, worst_case = elapsed_s, completion[:60]
    assert worst_s <= limit_s, f"slowest case {worst_case!r} took {worst_s:.2f} s"
    assert timed_out <= 2, f"{timed_out} of {len(ADVERSARIAL)} cases reached sympy and timed out twice"


@pytest.mark.parametrize("answer", ["(10^{10})!", "\\binom{10^{12}}{10^6}", "\\binom{123456}{2}",
                                    "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}^{10^{9}}", "x^{10^{9}}",
                                    "9^{9^9}", "10^{1234567}", "123456!"])
def test_numbers_no_answer_needs_are_graded_zero_without_sympy(answer, monkeypatch):
    """Powers, factorials and binomials of numbers that would hold a grading worker to its limit twice: refused up
    front (rewards.pathological), as prediction and as gold; sympy is never asked."""
    monkeypatch.setattr(rewards.grader, "verify_pairs", lambda *a, **k: pytest.fail("sympy was asked"))
    assert rewards.pathological(answer)
    assert accuracy_reward(formatted(answer), "5") == 0.0 and accuracy_reward(formatted("5"), answer) == 0.0


@pytest.mark.parametrize("answer", ["\\binom{5}{2}", "\\binom{n^2}{2}", "(n+1)!", "(n^2)!", "5!", "x^{2^n}",
                                    "2^{10}", "10^{12}", "\\frac{10!}{2^{5}}", "(x^2+1)^{3}"])
def test_answers_of_the_usual_size_are_not_refused(answer):
    assert not rewards.pathological(answer)
    assert accuracy_reward(formatted(answer), answer) == 1.0


def test_adversarial_batch_off_the_main_thread():
    """math-verify's own timeout (signal.alarm) fails off the main thread; ours must not."""
    completions = [c for c, _ in ADVERSARIAL[:60]] + [formatted("\\frac{2}{4}")]
    answers = [g for _, g in ADVERSARIAL[:60]] + ["\\frac12"]
    box = {}
    worker = threading.Thread(target=lambda: box.update(scores=rewards.accuracy_rewards(None, completions,
                                                                                        answers)))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert box["scores"][-1] == 1.0 and all(s in (0.0, 1.0) for s in box["scores"])


def test_non_string_inputs_score_zero():
    for completion, answer in [(None, "5"), (5, "5"), (formatted("5"), None), (b"<answer>5</answer>", "5"),
                               ({"x": 1}, "5"), (formatted("5"), ["5"])]:
        assert accuracy_reward(completion, answer) == 0.0
        if not isinstance(completion, str):
            assert format_reward(completion) == 0.0 and tag_count_reward(completion) == 0.0


def test_a_busy_machine_does_not_turn_a_correct_answer_into_zero(monkeypatch):
    """16 busy processes on the cores (a shared workstation, a GPU box's data loaders): the grader's limit is its
    worker's CPU time, so both comparisons are decided in the first round (no time-out, no retry) and score 1."""
    pairs = [(formatted("\\left( 3, \\frac{\\pi}{2} \\right)"), "(3, \\frac{\\pi}{2})"), (formatted("x^{2}"), "x^2")]
    assert accuracy_reward(formatted("\\frac{6}{8}"), "\\frac34") == 1.0  # the grader server and a worker are up
    with grader._cache_lock:
        grader._verdict_cache.clear()
    rounds, verify = [], grader._verify_in_workers
    monkeypatch.setattr(grader, "_verify_in_workers",
                        lambda *args: rounds.append(verify(*args)) or rounds[-1])
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(16)]
    try:
        time.sleep(1.0)  # every spinner running
        with rewards.timeouts_counted() as timeouts:
            scores = grade_accuracy([c for c, _ in pairs], [g for _, g in pairs])
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert scores == [1.0, 1.0]
    assert rounds == [[True, True]] and timeouts.positions == set()


def test_verify_timeout_s_is_read_at_call_time(monkeypatch):
    """`rewards.VERIFY_TIMEOUT_S = 2.0` on a busy machine must reach the grader without a restart."""
    seen_timeouts_s, verify_pairs = [], grader.verify_pairs

    def recording_verify_pairs(pairs, timeout_s, num_workers=0):
        seen_timeouts_s.append(timeout_s)
        return verify_pairs(pairs, timeout_s, num_workers)

    monkeypatch.setattr(grader, "verify_pairs", recording_verify_pairs)
    completion, gold = formatted(SLOW_PREDICTION), SLOW_GOLD  # ~0.1-0.3 s of sympy: surely past a tiny limit
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 1e-6)
    assert accuracy_reward(completion, gold) == 0.0  # timed out, so not cached
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 5.0)
    assert accuracy_reward(completion, gold) == 1.0
    assert seen_timeouts_s == [1e-6, 5.0]
    assert accuracy_reward(completion, gold, timeout_s=1e-6) == 1.0  # a verdict, once had, is cached


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=st.text(max_size=300),
       gold=st.one_of(st.text(max_size=20), st.sampled_from(["5", "B", "\\frac12"])))
def test_fuzz_arbitrary_text_never_raises(completion, gold):
    for text in (completion, formatted(completion)):
        assert accuracy_reward(text, gold) in (0.0, 1.0)
        assert format_reward(text) in (0.0, 1.0)
        assert tag_count_reward(text) in (0.0, 0.25, 0.5, 0.75, 1.0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prediction=st.text(alphabet="0123456789+-*/^{}()[]\\frac sqrt,.$!x", max_size=40))
def test_fuzz_math_like_text_never_raises(prediction):
    assert accuracy_reward(formatted(prediction), "\\frac{1}{2}") in (0.0, 1.0)


# ------------------------------------------------------------------------------------------ real data
def test_every_gsm8k_test_solution_in_target_format_scores_one(data_dir):
    rows = read_rows(data_dir, "gsm8k/test.jsonl")
    assert len(rows) == 1319
    completions, wrong, golds = [], [], []
    for row in rows:
        reasoning, final = row["answer"].split("####")
        gold = final.strip().replace(",", "")
        reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()
        completions.append(formatted(final.strip(), reasoning))
        wrong.append(formatted(str(int(gold) + 1), reasoning))
        golds.append(gold)
    assert grade_accuracy(completions, golds) == [1.0] * len(rows)
    assert grade_accuracy(wrong, golds) == [0.0] * len(rows)
    assert all(format_reward(c) == 1.0 and tag_count_reward(c) == 1.0 for c in completions)


def test_every_math500_answer_matches_its_own_solution(data_dir):
    rows = read_rows(data_dir, "math/test500.jsonl")
    assert len(rows) == 500
    solutions = [row["solution"] for row in rows]  # graded by their last \boxed{}
    golds = [row["answer"] for row in rows]
    scores = grade_accuracy(solutions, golds, timeout_s=10.0)  # generous: the test machine may be busy
    assert [row["unique_id"] for row, s in zip(rows, scores) if s != 1.0] == []
    shifted = [golds[(i + 1) % 500] for i in range(0, 500, 5)]  # another problem's answer (100 rows)
    scores = grade_accuracy([formatted(g) for g in shifted], golds[::5], timeout_s=10.0)
    same = [g == s for g, s in zip(golds[::5], shifted)]  # a few problems share answers
    assert sum(scores) >= sum(same) and sum(scores) <= sum(same) + 3


def test_chemistry_letters(data_dir):
    rows = read_rows(data_dir, "chemistry/l3_mcq.jsonl")
    golds = [row["answer"] for row in rows]
    others = ["ABCD"[("ABCD".index(g) + 1) % 4] for g in golds]
    assert grade_accuracy([formatted(g) for g in golds], golds) == [1.0] * len(rows)
    assert grade_accuracy([formatted(f"The answer is ({g}).") for g in golds], golds) == [1.0] * len(rows)
    assert grade_accuracy([formatted(o) for o in others], golds) == [0.0] * len(rows)
    assert accuracy_reward(formatted(rows[0]["choices"]["ABCD".index(golds[0])]), golds[0]) == 0.0

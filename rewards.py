"""Rule-based rewards of the PODS paper (Appendix A.1): accuracy, format and tag count, summed with weights.

accuracy: the last `<answer>` block, else the last `\\boxed{}`, else the last number (the authors' grader's order),
compared with the ground truth by math-verify, or as a letter A-D. format: the completion is exactly
`<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>`. tag count: 0.25 per tag present exactly once (open-r1's).
Grading never hangs or raises: fast paths decide most items without sympy and score 0 on inputs that can stall it;
the rest go to math-verify workers (grading/grader.py), and an item timed out twice scores 0 and is counted.
Simplification: completions longer than MAX_COMPLETION_CHARS are graded on their tail. The terms are a registry,
`REWARD_TERMS`, filled by `@register_reward`: train.py computes every registered term.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from numbers import Real
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Callable

from grading import grader, trl_call

if TYPE_CHECKING:  # torch is imported where it is used: grading alone does not need it
    import torch

VERIFY_TIMEOUT_S = 0.5  # worker CPU (not wall) seconds per comparison, a MATH one takes ~5 ms; read at call time
THINK_PREFILL = "<think>\n"  # what data.render_prompts(prefill_think=True) appends to the prompt
MAX_COMPLETION_CHARS = 100_000  # longer completions: only the tail (where the answer is) is graded
MAX_ANSWER_CHARS = 1_000  # longest MATH answer is 159 characters; longer "answers" score 0
MAX_NESTING_DEPTH = 8  # deeper brackets score 0: MATH answers nest <= 3; each level costs the parser ~0.1 s

logger = logging.getLogger(__name__)
_counting = threading.local()  # .counters: this thread's open `timeouts_counted` records
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
# Possessive `\s*+` keeps these linear on long runs of spaces.
_ANSWER_PREFIX = re.compile(r"^(?:the\s++)?(?:final\s++)?answer\s*+(?:is|:)\s*+:?\s*+", re.IGNORECASE)
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")
_UNIT_WORDS = re.compile(r"(?:\s+[A-Za-z]+\.?)+")
_LETTER_AT_START = re.compile(r"^(?:(?i:option|choice)\s*)?\(?([A-D])\)?(?=$|[\s.:,)\]])")
_LETTER_ANSWER_IS = re.compile(r"(?i:answer)\s*+(?:(?i:is)\s*+)?(?::\s*+)?(?:(?i:option)\s*+)?"
                               r"\(?([A-D])\)?(?![A-Za-z])")
# Towers (9^9^9, (10^{10})^{10^{10}}), powers of powers (M^{10^{9}}, e^{e^{e^{x}}}), exponents of 6+ digits and
# factorials or binomials of huge numbers: no MATH answer has one, and each can hold a grading worker to its limit.
_POWER_TOWER = re.compile(r"\d\s*[})]*\s*(?:\^|\*\*)\s*[{(]*\s*[-+]?\d+(?:\.\d+)?\s*(?:\^|\*\*)\s*[{(]*\s*[-+]?\d"
                          r"|\^\s*\{\s*[-+]?\d+\s*(?:\^|\*\*)\s*\{?\s*[-+]?\d"
                          r"|\^\s*\{[^{}]*\^\s*\{[^{}]*\^")
_HUGE_EXPONENT = re.compile(r"(?:\^|\*\*)\s*[{(]?\s*[-+]?\d{6,}|\d[eE][-+]?\d{6,}|\d{5,}\s*!"
                            r"|\([^()]*\d\s*\^[^()]*\)\s*!|\{[^{}]*\d\s*\^[^{}]*\}\s*!"
                            r"|\\[dt]?binom\s*\{[^{}]*(?:\d\s*\^|\d{5,})")
_LATEX_REPLACEMENTS = (("\u2212", "-"), ("\u00b0", "^\\circ"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                       ("{,}", ","), ("\\!", ""), ("\\,", ""))  # unicode minus/degree; MATH's `32,\!348`


def _last_tag_block(text, open_tag, close_tag):
    end = text.rfind(close_tag)
    start = text.rfind(open_tag, 0, end) if end >= 0 else -1
    return None if start < 0 else text[start + len(open_tag):end]


def _braced_content(text, open_pos):
    """Content of the `{...}` group opening at text[open_pos], or None if it does not close within MAX_ANSWER_CHARS."""
    depth = 0
    for match in re.finditer(r"[{}]", text[open_pos:open_pos + MAX_ANSWER_CHARS + 2]):
        depth += 1 if match.group() == "{" else -1
        if depth == 0:
            return text[open_pos + 1:open_pos + match.start()]
    return None


def last_boxed_content(text):
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}`, or `\\boxed 5` -> "5" (of the last 16 at most)."""
    end = len(text)
    for _ in range(16):
        start = max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))
        if start < 0:
            return None
        end = start
        after = re.match(r"\\(?:boxed|fbox)(\s*)", text[start:start + 16])
        position = start + after.end()
        if text.startswith("{", position):
            content = _braced_content(text, position)
        elif after.group(1):  # unbraced form `\boxed 2`; `\boxed.` ends a sentence
            content = re.match(r"[^\s${}]*", text[position:position + MAX_ANSWER_CHARS]).group().rstrip(".,;")
        else:
            content = None  # e.g. `\boxeddot`
        if content and content.strip():
            return content.strip()
    return None


def extract_final_answer(completion):
    """Last <answer> block, else last \\boxed{}, else last number; None when the text has none."""
    if not isinstance(completion, str):
        return None
    text = completion[-MAX_COMPLETION_CHARS:]
    block = _last_tag_block(text, "<answer>", "</answer>")
    if block is not None:
        return block.strip()
    boxed = last_boxed_content(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _unwrap(text):
    """Strip whitespace, markdown bold, `$`, a trailing period and one \\boxed/\\text wrapper (repeatedly)."""
    for _ in range(4):
        before = text
        text = text.strip().strip("*").strip().removesuffix(".").strip()
        if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
            text = text.strip("$")
        wrapper = re.match(r"\\(?:boxed|text|textbf|mathrm)\s*\{", text)
        if wrapper and _braced_content(text, wrapper.end() - 1) == text[wrapper.end():-1]:
            text = text[wrapper.end():-1]
        if text == before:
            break
    return text


def plain_number(text, allow_words=False):
    """Fraction for '1,234', '$72', '72.', '72 dollars' (allow_words), 'The answer is 72'; else None."""
    text = _unwrap(_ANSWER_PREFIX.sub("", _unwrap(text))).removeprefix("\\$").removeprefix("$").strip()
    match = _PLAIN_NUMBER.match(text)
    if not match:
        return None
    rest = text[match.end():]
    if rest and not (allow_words and _UNIT_WORDS.fullmatch(rest)):
        return None
    return Fraction(match.group().replace(",", "").rstrip("."))


def choice_letter(text, whole_completion=False):
    """'B', '(B)', 'B.', 'B) text', '**B**', '\\boxed{B}', 'The answer is B' -> 'B'. In a whole completion
    (no <answer> block, no \\boxed) only 'answer is B' or a bare letter counts, not a leading 'A ...'."""
    text = _unwrap(text.replace("**", ""))
    said = list(_LETTER_ANSWER_IS.finditer(text[-MAX_ANSWER_CHARS:]))
    if said:
        return said[-1].group(1)
    match = _LETTER_AT_START.match(text)
    return match.group(1) if match and (not whole_completion or len(text) <= 3) else None


def _nesting_depth(text):
    depth = deepest = 0
    for char in re.findall(r"[{}()\[\]]", text):
        depth = depth + 1 if char in "{([" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def pathological(text):
    """Inputs that can stall sympy inside C code (huge integers) or its recursion: graded 0 up front."""
    return (len(text) > MAX_ANSWER_CHARS or bool(_POWER_TOWER.search(text))
            or bool(_HUGE_EXPONENT.search(text)) or _nesting_depth(text) > MAX_NESTING_DEPTH)


def normalize_latex(text):
    for old, new in _LATEX_REPLACEMENTS:
        text = text.replace(old, new)
    return text.strip()


def _grade_cheaply(completion, answer, answer_kind=None):
    """(score, None) when decided without sympy, else (None, (gold, prediction)) for math-verify. answer_kind
    "choice" compares letters, "number"/"latex" never do (None: a gold letter A-D is a choice)."""
    if not isinstance(completion, str) or not isinstance(answer, (str, int, float)):
        return 0.0, None
    gold = str(answer).strip()
    prediction = extract_final_answer(completion)
    if answer_kind == "choice" or (answer_kind is None and len(gold) == 1 and gold in "ABCD"):
        text = prediction if prediction is not None else completion[-MAX_COMPLETION_CHARS:]
        return float(choice_letter(text, whole_completion=prediction is None) == gold), None
    if not prediction or not gold or pathological(prediction) or pathological(gold):
        return 0.0, None
    gold, prediction = normalize_latex(gold), normalize_latex(prediction)
    gold_number = plain_number(gold)
    predicted_number = None if gold_number is None else plain_number(prediction, allow_words=True)
    if predicted_number is not None:
        return float(predicted_number == gold_number), None
    return None, (gold, prediction)


@dataclass
class GraderTimeouts:
    """Positions (in each grade_accuracy call's list) scored 0 because their comparison timed out twice."""
    positions: set = field(default_factory=set)


@contextlib.contextmanager
def timeouts_counted():
    """Collect what this thread's grade_accuracy calls score 0 for want of a verdict: reported, not hidden."""
    count = GraderTimeouts()
    counters = _counting.__dict__.setdefault("counters", [])
    counters.append(count)
    try:
        yield count
    finally:
        counters.remove(count)


def grade_accuracy(completions, answers, num_workers=0, timeout_s=None, answer_kind=None):
    """Accuracy (1.0/0.0) of each completion against its ground truth, math-verify on max(1, num_workers) processes.
    Never raises on model output; an item timed out twice scores 0, is counted (`timeouts_counted`), is not cached."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    timeout_s = VERIFY_TIMEOUT_S if timeout_s is None else timeout_s  # read at call time: settable
    scores, slow = [], {}
    for completion, answer in zip(completions, answers):
        try:
            score, item = _grade_cheaply(completion, answer, answer_kind)
        except Exception:  # noqa: BLE001  a grader bug must not stop training
            logger.exception("grading failed; scoring 0")
            score, item = 0.0, None
        scores.append(score)
        if item is not None:
            slow.setdefault(item, []).append(len(scores) - 1)
    if slow:
        verdicts = grader.verify_pairs(list(slow), timeout_s, num_workers)  # cached, never raises
        for item, verdict in zip(slow, verdicts):
            for position in slow[item]:
                scores[position] = float(verdict is True)
        timed_out = [position for item, verdict in zip(slow, verdicts) if verdict == "timeout"
                     for position in slow[item]]
        for count in getattr(_counting, "counters", []):
            count.positions.update(timed_out)
    return [float(score or 0.0) for score in scores]


def accuracy_reward(completion: str, answer: str, *, timeout_s: float | None = None) -> float:
    """1.0 if the completion's final answer equals the ground truth, else 0.0 (also on any failure)."""
    return grade_accuracy([completion], [answer], timeout_s=timeout_s)[0]


def format_reward(completion: str) -> float:
    """1.0 iff completion.strip() is `<think>\\n{A}\\n</think>\\n<answer>\\n{B}\\n</answer>`, each tag exactly once
    (A, B may be empty); the ends' whitespace is ignored, as decoded text can carry some."""
    text = completion.strip() if isinstance(completion, str) else ""
    if not (text.startswith("<think>\n") and text.endswith("\n</answer>")):
        return 0.0
    if any(text.count(tag) != 1 for tag in ("<think>", "</think>", "<answer>", "</answer>")):
        return 0.0
    separator = "\n</think>\n<answer>\n"
    middle = text.find(separator)  # A = text[8:middle], B = text[middle + 19:-10]; the regex's bounds
    return float(middle >= len("<think>\n") and middle + len(separator) <= len(text) - len("\n</answer>"))


def tag_count_reward(completion: str) -> float:
    """0.25 for each of `<think>\\n`, `\\n</think>\\n`, `\\n<answer>\\n`, `\\n</answer>` occurring exactly once."""
    if not isinstance(completion, str):
        return 0.0
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return 0.25 * sum(completion.count(tag) == 1 for tag in tags)


@dataclass
class RewardTerm:
    """func(prompts, completions, answer, completion_ids, num_workers, **options) -> list[float | None], called by
    keyword (take **kwargs); weight: its default weight (0: logged only); options: name -> default, --reward-options."""
    name: str
    func: Callable
    weight: float = 1.0
    options: dict = field(default_factory=dict)
    summary: str = ""  # one line of markdown: the table of terms in docs/rewards_and_data.md


REWARD_TERMS: dict[str, RewardTerm] = {}  # name -> term, in registration order
REWARD_FUNCS: dict[str, Callable] = {}  # name -> function: the TRL view of REWARD_TERMS (reward_funcs)
DEFAULT_REWARD_WEIGHTS: dict[str, float] = {}  # name -> default weight (the paper: 1/1/1; authors' code 1/.1/.1)


def register_reward(name: str, weight: float = 1.0, summary: str = "", **options):
    """Decorator: add a TRL-shaped reward function to the registry as `name`, with its default weight and options."""
    def add(func):
        REWARD_TERMS[name] = RewardTerm(name, func, float(weight), dict(options), summary)
        REWARD_FUNCS[name], DEFAULT_REWARD_WEIGHTS[name] = func, float(weight)
        return func
    return add


def completion_text(completion):
    """Text of a completion given as a string or as TRL conversational messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)):
        return "".join(m.get("content") or "" if isinstance(m, dict) else str(m) for m in completion)
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    return ""


@register_reward("accuracy", 1.0, "1 if the final answer equals the ground truth (math-verify), else 0")
def accuracy_rewards(prompts, completions, answer, num_workers=0, timeout_s=None, answer_kind=None,
                     **kwargs) -> list[float]:
    """TRL reward function; `answer`: the ground truths' column; answer_kind: --answer-kind (None: from the answer)."""
    if answer is None:
        raise ValueError("the accuracy reward needs the dataset's 'answer' column (one per completion)")
    return grade_accuracy([completion_text(c) for c in completions], list(answer), num_workers, timeout_s, answer_kind)


@register_reward("format", 1.0,
                 "1 if the completion is exactly `<think>\\n…\\n</think>\\n<answer>\\n…\\n</answer>`, else 0")
def format_rewards(prompts, completions, answer=None, **kwargs) -> list[float]:
    return [format_reward(completion_text(c)) for c in completions]


@register_reward("tag_count", 1.0, "0.25 for each of `<think>\\n`, `\\n</think>\\n`, `\\n<answer>\\n`, "
                 "`\\n</answer>` occurring exactly once: 0, 0.25, 0.5, 0.75 or 1")
def tag_count_rewards(prompts, completions, answer=None, **kwargs) -> list[float]:
    return [tag_count_reward(completion_text(c)) for c in completions]


@dataclass
class RewardResult:
    total: torch.Tensor  # [N] float32, weighted sum over functions (NaN entries of a function skipped)
    per_func: dict = field(default_factory=dict)  # name -> [N] float32
    grader_timeouts: torch.Tensor | None = None  # [N] bool: the answer comparison timed out twice, scored 0
    logged_columns: dict = field(default_factory=dict)  # column -> [N] values a function gave log_extra
    logged_metrics: list = field(default_factory=list)  # (function, name, value) a function gave log_metric

    def metrics(self) -> dict[str, float]:
        """TRL-named means: "reward" and "rewards/<fn>/mean"."""
        out = {"reward": float(self.total.mean())}
        out.update((f"rewards/{name}/mean", float(values.nanmean())) for name, values in self.per_func.items())
        if self.grader_timeouts is not None:
            out["rewards/grader_timeouts"] = int(self.grader_timeouts.sum())
        return out


@dataclass(frozen=True)
class OwnReward:
    """A reward function of one's own (--reward-function FILE.py:NAME=WEIGHT): TRL's signature, loaded from its file."""
    name: str
    func: Callable
    weight: float
    path: str
    sha256: str


@dataclass(frozen=True)
class RewardSettings:
    """What scoring a round reads besides the rollouts, from the flags, built once per run; trainer_state: the
    transformers.TrainerState the run keeps current for one's own functions, as TRL's trainer does (None: fresh)."""
    weights: dict | None = None
    options: dict | None = None
    prefill_think: bool = False
    answer_kind: str | None = None
    functions: tuple = ()  # OwnReward
    function_timeout_s: float = trl_call.DEFAULT_TIMEOUT_S
    trainer_state: object = None


def graded_completion(completion_text, prefill_think):
    """The text the rewards grade: a prefilled prompt ended in THINK_PREFILL, which the completion lacks."""
    return THINK_PREFILL + completion_text if prefill_think else completion_text


# Keywords compute_rewards gives the functions itself: a dataset column of one of these names is not passed on.
RESERVED_KEYWORDS = ("prompts", "completions", "completion_ids", "answer", "num_workers", "timeout_s", "answer_kind",
                     "trainer_state", "log_extra", "log_metric")


def score_rollouts(rollouts, examples, settings) -> RewardResult:
    """Each rollout (row i*n + j: rollout j of examples[i]) scored by every registered term and own function."""
    completion_ids = [ids[:length] for ids, length in zip(rollouts.completion_ids.tolist(), rollouts.lengths.tolist())]
    return score_texts(examples, rollouts.prompt_index.tolist(), rollouts.texts, completion_ids, settings)


def score_texts(examples, rows, texts, completion_ids, settings, registered=True) -> RewardResult:
    """Completion texts[k] of examples[rows[k]] scored as `score_rollouts` does (registered=False: by one's own
    functions alone, as eval.py does); each function also gets the rows' dataset columns by name, as in TRL."""
    names = dict.fromkeys(key for example in examples for key in getattr(example, "columns", {}))
    columns = {key: [examples[i].columns.get(key) for i in rows] for key in names if key not in RESERVED_KEYWORDS}
    return compute_rewards([examples[i].prompt for i in rows],
                           [graded_completion(text, settings.prefill_think) for text in texts],
                           [examples[i].answer for i in rows], **terms_of(settings, registered),
                           completion_ids=completion_ids, columns=columns, trainer_state=settings.trainer_state)


def terms_of(settings, registered=True):
    """compute_rewards' keyword arguments for a RewardSettings (registered=False: one's own functions only)."""
    options = dict(settings.options or {})
    if settings.answer_kind:
        options["accuracy"] = {**options.get("accuracy", {}), "answer_kind": settings.answer_kind}
    terms, weights = (REWARD_FUNCS, settings.weights or {}) if registered else ({}, {})
    return dict(reward_funcs={**terms, **{own.name: own.func for own in settings.functions}},
                weights={**weights, **{own.name: own.weight for own in settings.functions}},
                options=options, function_timeout_s=settings.function_timeout_s)


def _checked_values(name, values, count, prompts):
    """A function's values as a float32 tensor (None: NaN), as TRL converts them; anything else (wrong count, NaN, a
    non-number, beyond float32) is one ValueError naming the function and the first bad completion."""
    import torch

    if not isinstance(values, (list, tuple)) and not hasattr(values, "tolist"):
        raise ValueError(f"reward function {name!r} returned {type(values).__name__}, not a list of {count} numbers")
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) != count:
        raise ValueError(f"reward function {name!r} returned {len(values)} values for {count} completions")

    def refused(row, value, why="a reward is a finite number or None"):
        start = completion_text(prompts[row][-1] if isinstance(prompts[row], list) and prompts[row]
                                else prompts[row])[:60]
        return ValueError(f"reward function {name!r} returned {value!r} for completion {row} of {count} "
                          f"(prompt {start!r}): {why}")

    numbers = []
    for row, value in enumerate(values):
        number = value.item() if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 else value  # numpy, torch
        if number is not None and not (isinstance(number, Real) and not isinstance(number, bool)
                                       and math.isfinite(number)):
            raise refused(row, value)
        numbers.append(float("nan") if number is None else float(number))
    tensor = torch.tensor(numbers, dtype=torch.float32)
    overflow = torch.isinf(tensor).nonzero()
    if len(overflow):
        row = int(overflow[0])
        raise refused(row, values[row], "beyond float32's range (3.4e38), in which rewards are computed")
    return tensor


def compute_rewards(prompts, completions, answers, reward_funcs=None, weights=None, num_workers=0, *, options=None,
                    completion_ids=None, columns=None, trainer_state=None,
                    function_timeout_s=trl_call.DEFAULT_TIMEOUT_S) -> RewardResult:
    """Every reward function on every completion, and their weighted sum (paper: 1/1/1).

    reward_funcs: name -> function (None: every registered term). A registered term gets, by keyword, prompts, the
    completion texts, answer, completion_ids, num_workers, the columns and its options (options[name] over its
    defaults); one's own is called as TRL calls it (grading/trl_call.py), within function_timeout_s. None from a
    function is NaN in per_func, 0 in total. weights: name -> weight (0: logged, not summed); a registered term not
    named keeps its default, one's own needs one, a weight for no function is a ValueError. So is a function of one's
    own that raises, times out or exits, wrong values from any (`_checked_values`) or a total beyond float32."""
    import torch

    reward_funcs = REWARD_FUNCS if reward_funcs is None else reward_funcs
    weights = {**{name: DEFAULT_REWARD_WEIGHTS[name] for name in reward_funcs if name in REWARD_TERMS},
               **(weights or {})}
    unknown, unweighted = set(weights) - set(reward_funcs), set(reward_funcs) - set(weights)
    if unknown:
        raise ValueError(f"weights given for unknown reward functions {sorted(unknown)}; "
                         f"functions are {sorted(reward_funcs)}")
    if unweighted:
        raise ValueError(f"no weight for reward functions {sorted(unweighted)}: give each a weight "
                         "(0.0 to log it without adding it to the total)")
    if len(answers) != len(completions) or len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers: "
                         "give one prompt and one answer per completion")
    options, columns = options or {}, columns or {}
    own_calls = [name for name in reward_funcs if name not in REWARD_TERMS]
    if own_calls:  # what TRL passes besides the columns
        log = trl_call.RewardLog(len(completions))
        trl_kwargs = {"prompts": list(prompts), "completions": trl_call.trl_completions(prompts, completions),
                      "completion_ids": completion_ids, **columns, "answer": list(answers),
                      "trainer_state": trl_call.trainer_state() if trainer_state is None else trainer_state}
    per_func, total = {}, torch.zeros(len(completions), dtype=torch.float32)
    with timeouts_counted() as timeouts:
        for name, func in reward_funcs.items():
            if name in own_calls:
                log_extra, log_metric = log.for_function(name)
                values = trl_call.call(name, func, dict(trl_kwargs, log_extra=log_extra, log_metric=log_metric),
                                       function_timeout_s)
            else:
                own = {**REWARD_TERMS[name].options, **options.get(name, {})}
                try:
                    values = func(prompts=list(prompts), completions=list(completions), answer=list(answers),
                                  completion_ids=completion_ids, num_workers=num_workers,
                                  **{key: value for key, value in columns.items() if key not in own}, **own)
                except Exception as error:
                    error.add_note(f"(in reward function {name!r})")
                    raise
            per_func[name] = _checked_values(name, values, len(completions), prompts)
            total += weights[name] * torch.nan_to_num(per_func[name], nan=0.0)
    beyond = torch.isinf(total).nonzero()
    if len(beyond):
        row = int(beyond[0])
        terms = ", ".join(f"{name} {float(values[row]):g} x weight {weights[name]:g}"
                          for name, values in per_func.items())
        raise ValueError(f"the weighted total reward of completion {row} of {len(completions)} is beyond float32's "
                         f"range (3.4e38): {terms}")
    timed_out = torch.zeros(len(completions), dtype=torch.bool)
    timed_out[sorted(timeouts.positions)] = True
    return RewardResult(total=total, per_func=per_func, grader_timeouts=timed_out,
                        logged_columns=log.columns if own_calls else {},
                        logged_metrics=log.metrics if own_calls else [])


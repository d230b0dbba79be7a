"""Reading the final answer out of a completion, and the cheap comparisons that decide most answers without sympy
(the accuracy reward of rewards.py, paper Appendix A.1).

The final answer is the content of the last `<answer>...</answer>` block, else the last `\\boxed{...}`, else the last
number in the text (the fallback order of the authors' grader). Fast paths: multiple-choice letters, plain numbers
compared exactly as fractions; pre-filters flag inputs able to stall sympy in C code (`9^9^9^9`, deep nesting,
over-long answers) so they score 0 up front. Every scan is bounded: a 10^6-character text stays cheap.
Simplification: completions longer than MAX_COMPLETION_CHARS are read on their tail.
"""

import re
from fractions import Fraction

MAX_COMPLETION_CHARS = 100_000  # longer completions: only the tail (where the answer is) is graded
MAX_ANSWER_CHARS = 1_000  # longest MATH answer is 159 characters; longer "answers" score 0
MAX_NESTING_DEPTH = 8  # deeper brackets score 0: MATH answers nest <= 3; each level costs the parser ~0.1 s

# ---------------------------------------------------------------------------------------- extraction
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def _last_tag_block(text, open_tag, close_tag):
    end = text.rfind(close_tag)
    start = text.rfind(open_tag, 0, end) if end >= 0 else -1
    return None if start < 0 else text[start + len(open_tag):end]


def _braced_content(text, open_pos):
    """Content of the `{...}` group opening at text[open_pos], or None if it does not close within
    MAX_ANSWER_CHARS (bounded scan: an unclosed brace in a 10^6-character text stays cheap)."""
    depth = 0
    for match in re.finditer(r"[{}]", text[open_pos:open_pos + MAX_ANSWER_CHARS + 2]):
        depth += 1 if match.group() == "{" else -1
        if depth == 0:
            return text[open_pos + 1:open_pos + match.start()]
    return None


def last_boxed_content(text):
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` (nested braces), or `\\boxed 5` -> "5".
    Looks at the last 16 occurrences at most, so a text full of unclosed boxes stays cheap."""
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


# ---------------------------------------------------------------------------------------- fast paths
# Possessive `\s*+` keeps these linear on long runs of spaces.
_ANSWER_PREFIX = re.compile(r"^(?:the\s++)?(?:final\s++)?answer\s*+(?:is|:)\s*+:?\s*+", re.IGNORECASE)
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")
_UNIT_WORDS = re.compile(r"(?:\s+[A-Za-z]+\.?)+")
_LETTER_AT_START = re.compile(r"^(?:(?i:option|choice)\s*)?\(?([A-D])\)?(?=$|[\s.:,)\]])")
_LETTER_ANSWER_IS = re.compile(r"(?i:answer)\s*+(?:(?i:is)\s*+)?(?::\s*+)?(?:(?i:option)\s*+)?"
                               r"\(?([A-D])\)?(?![A-Za-z])")


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
    text = _unwrap(_ANSWER_PREFIX.sub("", _unwrap(text)))
    text = text.removeprefix("\\$").removeprefix("$").strip()
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


# Numeric towers (9^9^9, 10**10**10, (10^{10})^{10^{10}}), any three nested exponent groups (e^{e^{e^{x}}}),
# exponents of 6+ digits (10^{1234567}, 1e1234567) and factorials of 5+ digits: numbers no answer needs.
_POWER_TOWER = re.compile(r"\d\s*[})]*\s*(?:\^|\*\*)\s*[{(]*\s*[-+]?\d+(?:\.\d+)?\s*(?:\^|\*\*)\s*[{(]*\s*[-+]?\d"
                          r"|\^\s*\{[^{}]*\^\s*\{[^{}]*\^")
_HUGE_EXPONENT = re.compile(r"(?:\^|\*\*)\s*[{(]?\s*[-+]?\d{6,}|\d[eE][-+]?\d{6,}|\d{5,}\s*!")


def pathological(text):
    """Inputs that can stall sympy inside C code (huge integers) or its recursion: graded 0 up front."""
    return (len(text) > MAX_ANSWER_CHARS or bool(_POWER_TOWER.search(text))
            or bool(_HUGE_EXPONENT.search(text)) or _nesting_depth(text) > MAX_NESTING_DEPTH)


_LATEX_REPLACEMENTS = (("\u2212", "-"), ("\u00b0", "^\\circ"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                       ("{,}", ","), ("\\!", ""), ("\\,", ""))  # unicode minus/degree; MATH's `32,\!348`


def normalize_latex(text):
    for old, new in _LATEX_REPLACEMENTS:
        text = text.replace(old, new)
    return text.strip()

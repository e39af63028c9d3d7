"""The real-model demo's task family, "word problems with a calculator tool", and its success-based reward.

A Task is an agent that uses a tool, in two completions:

1. the user (system prompt + one worked example) asks a word problem; the model is to write a calculator call in
   plain text, ``CALL calc(17*23)``;
2. the agent parses the first such call, evaluates it with a safe arithmetic evaluator (`evaluate`) and sends the
   result back as the next user message (``RESULT: 391``; a missing or malformed call gets a message that says so);
3. the model gives the final answer, ``ANSWER: 391``.

The reward measures task SUCCESS: the final answer (second completion) is the right number (`score`). The only
partial credit is for the step that leads to success: a calculator call whose value is the right number
(`TOOL_CREDIT`). A well-formed call with a wrong expression, a well-formed final answer with a wrong number, or any
amount of text earns nothing.

Anti-gaming rules, each with a unit test (tests/unit/test_calculator_family.py):
- the final answer must hold exactly one ``ANSWER:`` and it must be followed by one integer; two ANSWER lines
  ("ANSWER: 390 ANSWER: 391") or a list after it ("ANSWER: 390, 391") fail, so guessing several numbers never pays;
- the answer is read from the second completion only: a right number in the first completion does not count;
- a calculator call earns its credit only when its value equals the right answer, and only the first call is run
  (writing several calls hoping one is right gets the first one's value);
- the evaluator accepts integers, + - * / and parentheses only, at most 64 characters and no powers, so a call can
  neither hang the agent nor smuggle text.

Train and held-out prompts never overlap: a problem belongs to the held-out split when a hash of its operand pair
says so (`split_of`), so no operand pair (and hence no question or answer) of the held-out set is ever trained on.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = (
    "You solve math word problems with a calculator. First reply with only a calculator call, like "
    "CALL calc(12*34). Then the user gives you the RESULT. Then reply with only ANSWER: and the number."
)
# Two worked examples in the conversation: what a 135M instruct model copies best is a shown exchange.
EXAMPLE = (
    {"role": "user", "content": "A shelf holds 14 books. How many books are on 6 shelves?"},
    {"role": "assistant", "content": "CALL calc(14*6)"},
    {"role": "user", "content": "RESULT: 84"},
    {"role": "assistant", "content": "ANSWER: 84"},
    {"role": "user", "content": "A shop had 215 pens and sold 32. How many pens are left?"},
    {"role": "assistant", "content": "CALL calc(215-32)"},
    {"role": "user", "content": "RESULT: 183"},
    {"role": "assistant", "content": "ANSWER: 183"},
)
NO_CALL = "RESULT: no calculator call found. Reply with only ANSWER: and the number."
TOOL_CREDIT = 0.3  # a calculator call whose value is the right answer (the step that leads to success)
HELD_OUT_SHARE = 5  # one operand pair in five is held out

# (question template, operation): the operands are a, b.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("A box holds {a} apples. How many apples are in {b} boxes?", "*"),
    ("A ticket costs {a} dollars. How much do {b} tickets cost?", "*"),
    ("A bus has {a} seats. How many seats do {b} buses have?", "*"),
    ("Each bag has {a} candies. How many candies are in {b} bags?", "*"),
    ("A farm has {a} cows and buys {b} more. How many cows does it have now?", "+"),
    ("A library had {a} books and gave away {b}. How many books are left?", "-"),
)

CALL_RE = re.compile(r"CALL\s*calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)", re.IGNORECASE)
ANSWER_RE = re.compile(r"ANSWER\s*:", re.IGNORECASE)
INT_RE = re.compile(r"-?\d[\d,]*")
MAX_EXPR_CHARS = 64
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


@dataclass(frozen=True)
class Problem:
    question: str
    a: int
    b: int
    op: str
    answer: int
    split: str  # "train" or "held-out"


@dataclass(frozen=True)
class Score:
    success: bool
    reward: float
    tool_value: float | None  # what the first calculator call evaluated to (None: no valid call)
    final: int | None  # the parsed final answer (None: malformed)
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "reward": self.reward, "tool_value": self.tool_value, "final": self.final,
                "reason": self.reason}


def split_of(a: int, b: int) -> str:
    """The split of an operand pair: a stable hash (not Python's salted `hash`), one pair in `HELD_OUT_SHARE`."""
    digest = hashlib.sha256(f"{a},{b}".encode()).digest()
    return "held-out" if digest[0] % HELD_OUT_SHARE == 0 else "train"


def _answer(a: int, b: int, op: str) -> int:
    return a * b if op == "*" else a + b if op == "+" else a - b


def problems(split: str, count: int, seed: int) -> list[Problem]:
    """`count` distinct problems of `split`, drawn reproducibly from `seed`. Multiplications use a two-digit and a
    one-digit operand (the model cannot multiply in its head but can copy them into a call); additions and
    subtractions use two- and three-digit operands."""
    if split not in ("train", "held-out"):
        raise ValueError(f"unknown split {split!r}")
    rng = random.Random(f"calculator-family/{split}/{seed}")
    out: list[Problem] = []
    seen: set[tuple[int, int, int]] = set()
    while len(out) < count:
        t = rng.randrange(len(TEMPLATES))
        template, op = TEMPLATES[t]
        if op == "*":
            a, b = rng.randint(12, 99), rng.randint(3, 9)
        else:
            a, b = rng.randint(120, 999), rng.randint(11, 99)
        if split_of(a, b) != split or (t, a, b) in seen:
            continue
        seen.add((t, a, b))
        out.append(Problem(template.format(a=a, b=b), a, b, op, _answer(a, b, op), split))
    return out


def first_messages(problem: Problem) -> list[dict[str, str]]:
    """The conversation of the first completion: system prompt, the worked example, the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": problem.question}]


def evaluate(expr: str) -> float:
    """Value of an arithmetic expression of integers, + - * / and parentheses; ValueError for anything else."""
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expr.replace("x", "*").replace("×", "*"), mode="eval")
    except SyntaxError as exc:
        raise ValueError("not an arithmetic expression") from exc

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ValueError("only integers, + - * / and parentheses")

    return walk(tree)


def tool_call(text: str) -> tuple[float | None, str]:
    """(value, message for the model) of the first calculator call in `text`; value None when none is valid."""
    match = CALL_RE.search(text)
    if match is None:
        return None, NO_CALL
    try:
        value = evaluate(match.group(1).strip())
    except ValueError as exc:
        return None, f"RESULT: error ({exc}). Reply with only ANSWER: and the number."
    shown = int(value) if float(value).is_integer() else round(value, 4)
    return value, f"RESULT: {shown}"


def final_answer(text: str) -> tuple[int | None, str]:
    """(number, reason) of a final answer: exactly one ANSWER: followed by exactly one integer."""
    marks = ANSWER_RE.findall(text)
    if len(marks) != 1:
        return None, "no ANSWER:" if not marks else "several ANSWER:"
    after = ANSWER_RE.split(text, maxsplit=1)[1]
    numbers = INT_RE.findall(after)
    if len(numbers) != 1:
        return None, "no number after ANSWER:" if not numbers else "several numbers after ANSWER:"
    return int(numbers[0].replace(",", "")), "ok"


def score(problem: Problem, answers: list[str]) -> Score:
    """Success and shaped reward of one Task from its completions' text (first: the call, last: the answer)."""
    if len(answers) < 2:
        return Score(False, 0.0, None, None, "fewer than two completions")
    tool_value, _ = tool_call(answers[0])
    final, why = final_answer(answers[-1])
    success = final is not None and final == problem.answer
    tool_right = tool_value is not None and tool_value == problem.answer
    reward = 1.0 if success else TOOL_CREDIT if tool_right else 0.0
    reason = "right answer" if success else why if final is None else "wrong answer"
    return Score(success, reward, tool_value, final, reason)

"""The calculator task family's reward: success only for the right final answer, partial credit only for a
calculator call that leads to it, and the gaming attempts a policy could find (several answers, answers in the
wrong turn, several calls, non-arithmetic calls) earn nothing extra. The split never overlaps."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.demo import calculator_family as calc

PROBLEM = calc.Problem("A box holds 17 apples. How many apples are in 23 boxes?", 17, 23, "*", 391, "train")


def test_right_call_and_right_answer_is_success():
    s = calc.score(PROBLEM, ["CALL calc(17*23)", "ANSWER: 391"])
    assert s.success and s.reward == 1.0 and s.final == 391 and s.tool_value == 391


def test_right_answer_without_the_tool_is_still_success():
    # Success is the final answer; how it was found is not graded beyond that.
    s = calc.score(PROBLEM, ["I know this one.", "ANSWER: 391."])
    assert s.success and s.reward == 1.0


def test_right_call_but_wrong_final_answer_earns_only_the_tool_credit():
    s = calc.score(PROBLEM, ["CALL calc(17 * 23)", "ANSWER: 390"])
    assert not s.success and s.reward == calc.TOOL_CREDIT and s.reason == "wrong answer"


@pytest.mark.parametrize("call, credit", [
    ("CALL calc(17+23)", 0.0), ("CALL calc(17*24)", 0.0), ("CALL calc(391*1) ", calc.TOOL_CREDIT),
    ("CALL calc(23*17)", calc.TOOL_CREDIT), ("CALL calc 17*23", 0.0),
])
def test_a_call_earns_credit_only_when_its_value_is_right(call, credit):
    s = calc.score(PROBLEM, [call, "ANSWER: 12"])
    assert not s.success and s.reward == credit


def test_well_formed_but_wrong_everything_earns_nothing():
    s = calc.score(PROBLEM, ["CALL calc(17+23)", "ANSWER: 40"])
    assert not s.success and s.reward == 0.0


@pytest.mark.parametrize("final, reason", [
    ("391", "no ANSWER:"),
    ("The answer is 391 apples.", "no ANSWER:"),
    ("ANSWER: three hundred ninety-one", "no number after ANSWER:"),
    ("", "no ANSWER:"),
])
def test_malformed_final_answers_fail(final, reason):
    s = calc.score(PROBLEM, ["CALL calc(17*23)", final])
    assert not s.success and s.final is None and s.reason == reason
    assert s.reward == calc.TOOL_CREDIT  # the call was still the right step


@pytest.mark.parametrize("final", [
    "ANSWER: 390 ANSWER: 391",          # two answers
    "ANSWER: 390\nANSWER: 391",
    "ANSWER: 390, 391, 392",            # a list of guesses
    "ANSWER: 391 or maybe 392",
    "answer: 1 Answer: 391",
])
def test_guessing_several_numbers_never_pays(final):
    s = calc.score(PROBLEM, ["CALL calc(17+23)", final])
    assert not s.success and s.reward == 0.0


def test_answer_in_the_first_turn_does_not_count():
    s = calc.score(PROBLEM, ["ANSWER: 391", "ok"])
    assert not s.success and s.reward == 0.0


def test_only_the_first_call_is_run():
    # Writing several calls hoping one is right gets the first one's value only.
    value, message = calc.tool_call("CALL calc(1+1) CALL calc(17*23)")
    assert value == 2 and message == "RESULT: 2"
    s = calc.score(PROBLEM, ["CALL calc(1+1) CALL calc(17*23)", "ANSWER: 2"])
    assert s.reward == 0.0


def test_single_completion_is_no_task():
    s = calc.score(PROBLEM, ["ANSWER: 391"])
    assert not s.success and s.reward == 0.0


@pytest.mark.parametrize("expr", [
    "__import__('os').system('true')", "2**100000", "17*23; 1", "abs(-3)", "1/0", "x" * 65, "1.5*2", "'391'",
])
def test_the_evaluator_refuses_anything_but_integer_arithmetic(expr):
    with pytest.raises(ValueError):
        calc.evaluate(expr)


def test_tool_messages_for_missing_and_bad_calls():
    assert calc.tool_call("I will think about it.") == (None, calc.NO_CALL)
    value, message = calc.tool_call("CALL calc(2**8)")
    assert value is None and message.startswith("RESULT: error")
    assert calc.tool_call("call Calc( (12+3) * 4 )") == (60, "RESULT: 60")
    assert calc.tool_call("CALL calc(7/2)") == (3.5, "RESULT: 3.5")


def test_train_and_held_out_never_overlap_and_are_reproducible():
    train = calc.problems("train", 400, seed=0) + calc.problems("train", 400, seed=1)
    held = calc.problems("held-out", 64, seed=0)
    assert {(p.a, p.b) for p in train}.isdisjoint({(p.a, p.b) for p in held})
    assert {p.question for p in train}.isdisjoint({p.question for p in held})
    assert all(p.split == "train" for p in train) and all(p.split == "held-out" for p in held)
    assert calc.problems("held-out", 64, seed=0) == held
    assert len({p.question for p in held}) == 64
    for p in train[:50] + held:
        assert p.answer == calc.evaluate(f"{p.a}{p.op}{p.b}")


def test_first_messages_show_the_protocol():
    msgs = calc.first_messages(PROBLEM)
    assert msgs[0]["role"] == "system" and msgs[-1] == {"role": "user", "content": PROBLEM.question}
    shown = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert any(calc.tool_call(t)[0] is not None for t in shown)
    assert any(calc.final_answer(t)[0] is not None for t in shown)

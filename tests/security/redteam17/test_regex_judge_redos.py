"""F4: RegexJudge matches the agent's answer with Python's backtracking ``re`` in the
engine's judge thread pool (and the rollout worker's process), unbounded: an answer
crafted against the trainer's pattern (nested quantifiers are common in answer-extraction
patterns) backtracks exponentially, and ``re`` never releases the GIL while matching, so
one episode's verdict freezes every episode, the worker's trainer API and its heartbeat
work. A judge must return (e.g. a 0 verdict saying the match ran out of time, flagged)
within a bounded time whatever the answer is.

Run in a subprocess so a hang here is a failure, not a hung suite."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r"""
from dsec.rl.judges import JudgeContext, RegexJudge
j = RegexJudge(r"^(\w+\s?)+$", field="answer")
ctx = JudgeContext(answer="a" * 40 + "!", transcript=[])
print(j.judge(ctx).reward)
"""


def test_a_crafted_answer_cannot_hang_a_regex_judge() -> None:
    try:
        r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, timeout=15, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("RegexJudge was still matching a 41-character answer after 15 s "
                    "(catastrophic backtracking; the GIL is held meanwhile)")
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert r.stdout.strip() == b"0.0"

"""The answer template, in one place: SFT, sampling and evaluation all build prompts here.

The spec (第一阶段 1.1) asks the policy to answer as::

    <think>reasoning</think><answer>final answer</answer>

Coding tasks (:mod:`grpo_pipeline.coding`) share the format, with the complete code inside
``<answer>`` (optionally fenced); pass ``task="coding"`` (:func:`task_of` gives it from a
prompt row's ``tests``).

The instruction goes in the system message; the question is the user message; the
model's chat template renders both and opens the assistant turn.
"""

from __future__ import annotations

from typing import Any

SYSTEM_PROMPT = (
    "Solve the math problem. First reason step by step inside <think> </think>, "
    "then give only the final answer inside <answer> </answer>."
)
CODING_SYSTEM_PROMPT = (
    "Solve the programming task in Python. First reason step by step inside <think> </think>, "
    "then give only the complete code (the function and the imports it needs) inside <answer> </answer>."
)
SYSTEM_PROMPTS = {"math": SYSTEM_PROMPT, "coding": CODING_SYSTEM_PROMPT}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


def system_prompt(task: str = "math") -> str:
    """The instruction for a task kind: ``"math"`` or ``"coding"`` (same think/answer format)."""
    if task not in SYSTEM_PROMPTS:
        msg = f"Unknown task {task!r}. Supported tasks are: {list(SYSTEM_PROMPTS)}"
        raise ValueError(msg)
    return SYSTEM_PROMPTS[task]


def task_of(tests: object) -> str:
    """The task kind of a prompt row from its ``tests`` value: ``"coding"`` when it has tests."""
    return "math" if tests is None else "coding"


def messages(question: str, *, task: str = "math") -> list[dict[str, str]]:
    """Chat messages for one problem."""
    return [{"role": "system", "content": system_prompt(task)}, {"role": "user", "content": question}]


def render_prompt(tokenizer: Any, question: str, *, task: str = "math") -> str:
    """The prompt text the policy continues: chat template with the assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        msg = "tokenizer has no chat_template. Hint: import the model with the `base` stage, which adds one"
        raise ValueError(msg)
    return tokenizer.apply_chat_template(messages(question, task=task), tokenize=False, add_generation_prompt=True)


def demonstration(solution: str | None, answer: str) -> str:
    """The SFT target completion for a problem: its worked steps and its reference answer."""
    think = (solution or "").strip()
    return f"{THINK_OPEN}{think}{THINK_CLOSE}{ANSWER_OPEN}{answer.strip()}{ANSWER_CLOSE}"

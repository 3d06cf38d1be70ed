"""The answer template, in one place: SFT, sampling and evaluation all build prompts here.

The spec (第一阶段 1.1) asks the policy to answer as::

    <think>reasoning</think><answer>final answer</answer>

The instruction goes in the system message; the question is the user message; the
model's chat template renders both and opens the assistant turn.
"""

from __future__ import annotations

from typing import Any

SYSTEM_PROMPT = (
    "Solve the math problem. First reason step by step inside <think> </think>, "
    "then give only the final answer inside <answer> </answer>."
)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


def messages(question: str) -> list[dict[str, str]]:
    """Chat messages for one problem."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def render_prompt(tokenizer: Any, question: str) -> str:
    """The prompt text the policy continues: chat template with the assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        msg = "tokenizer has no chat_template. Hint: import the model with the `base` stage, which adds one"
        raise ValueError(msg)
    return tokenizer.apply_chat_template(messages(question), tokenize=False, add_generation_prompt=True)


def demonstration(solution: str | None, answer: str) -> str:
    """The SFT target completion for a problem: its worked steps and its reference answer."""
    think = (solution or "").strip()
    return f"{THINK_OPEN}{think}{THINK_CLOSE}{ANSWER_OPEN}{answer.strip()}{ANSWER_CLOSE}"

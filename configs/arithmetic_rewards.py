"""Reward functions for configs/grpo_stdlib.py's sums, as TRL calls them: keyword arguments
`prompts` and `completions` (lists of strings, one per completion) and each other field of
the prompt's .jsonl line (here `answer`), one value per completion; a float per completion
back. Name them in `grpo.rewards` as 'configs/arithmetic_rewards.py:correct'."""


def digits(prompts, completions, **fields):
    """The share of the completion's characters that are digits: a partial credit that a
    model which answers in words earns nothing of."""
    del prompts, fields
    return [sum(c.isdigit() for c in text) / len(text) if text else 0.0 for text in completions]


def correct(prompts, completions, answer, **fields):
    """1 where the completion is the sum, up to surrounding spaces; else 0."""
    del prompts, fields
    return [float(text.strip() == expected) for text, expected in zip(completions, answer)]


def close(prompts, completions, answer, **fields):
    """Partial credit for a number near the sum: 1 - |number - sum| / 10, down to 0 at 10
    away; 0 for a completion that is not a number."""
    del prompts, fields
    scores = []
    for text, expected in zip(completions, answer):
        text = text.strip()
        scores.append(max(0.0, 1 - abs(int(text) - int(expected)) / 10) if text.isdigit() else 0.0)
    return scores

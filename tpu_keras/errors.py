"""Exceptions that end a run with one line instead of a traceback.

Entry points print a `UserError` as one line and exit non-zero without a
traceback: the message itself must say what to change. `Preempted` is not a
mistake: the run saved and asks to be started again (exit code 42).
"""

import difflib


class UserError(Exception):
    """A mistake in the config, flags or environment, explained in one line."""


class Preempted(Exception):
    """The run got SIGTERM and saved a checkpoint at `step`; the same command resumes it."""

    EXIT_CODE = 42  # TensorFlow's own "preempted, restart me" code on TPUs

    def __init__(self, step: int):
        super().__init__(f"saved a checkpoint at step {step} after SIGTERM; run the same "
                         "command again to resume")
        self.step = step


def first_line(error, limit: int | None = 200) -> str:
    """The first line of an exception's message (at most `limit` characters; None: all of
    it), or its type's name: what a one-line error quotes of a library's own words."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def closest(name, candidates):
    """Returns ' (did you mean X?)' for the nearest candidate, or ''."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""

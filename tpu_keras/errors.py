"""Errors that mean "the user asked for something that cannot work".

Entry points print a `UserError` as one line and exit non-zero without a
traceback: the message itself must say what to change.
"""

import difflib


class UserError(Exception):
    """A mistake in the config, flags or environment, explained in one line."""


def closest(name, candidates):
    """Returns ' (did you mean X?)' for the nearest candidate, or ''."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""

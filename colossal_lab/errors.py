"""The one exception for bad user input: what the CLI turns into one line and exit status 2.

Every command of ``python -m colossal_lab`` catches `UsageError` once, at its dispatch,
and ends with ``python -m colossal_lab CMD: error: <the message's first line>``, as
argparse does for its own errors. Anything else is a bug and keeps its traceback (exit
status 1), so a user's mistake is never confused with ours. It subclasses ValueError:
code that checks its arguments the ordinary way stays correct for library callers.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Input that cannot work: a value out of range, a path that cannot be written, a
    checkpoint that cannot be resumed. The message says what to change."""

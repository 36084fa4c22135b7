"""User-facing errors.

Contract: every error a user can cause (bad path, bad parameter, bad file) is raised as
`SpecDecodeError` with a message that names what to fix. The CLI prints the message, without
a traceback, and exits with status 2.
"""


class SpecDecodeError(Exception):
    """An error caused by the user's input; the message says how to fix it."""

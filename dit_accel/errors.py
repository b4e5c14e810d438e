"""Errors a user can cause, reported as one line that says what to do."""


class UserError(Exception):
    """A problem with the user's input or machine (bad path, block out of range, budget too small...).

    The CLI prints `error: <message>` and exits with status 2, without a traceback. The message is one
    line and ends with what to do about it.
    """

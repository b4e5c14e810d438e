"""Errors a user can cause, reported as one line that says what to do."""


class UserError(Exception):
    """A problem with the user's input or machine (bad path, block out of range, budget too small...).

    The CLI prints `error: <message>` and exits with status 2, without a traceback. The message is one
    line and ends with what to do about it.
    """


class Terminated(BaseException):
    """The process got SIGTERM (a job scheduler, `kill`, torchrun stopping its workers).

    Raised by the CLI's signal handler in the main thread, it unwinds like Ctrl-C's KeyboardInterrupt, so
    every `finally` runs and a staged run folder is removed (`run_dir.StagedRun`). A BaseException,
    as KeyboardInterrupt is, so an `except Exception` on the way does not swallow it.
    """


def first_line(exc: BaseException) -> str:
    """An error's first non-empty line, at most 200 characters: what a one-line report quotes of a library's error."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:200]

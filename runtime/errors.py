"""The one exception type for errors a user causes and can fix."""


class UserError(ValueError):
    """A bad flag or config value, a missing or malformed file, a workdir that does not fit:
    the message says what to do. train.py and decode.py print it as one line (no
    traceback) and exit with status 1."""

"""The one exception type for user-caused training errors."""


class TrainingError(ValueError):
    """A user error (bad config value, missing workdir or checkpoint); the message says the fix."""

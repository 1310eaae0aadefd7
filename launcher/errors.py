"""Why a rank could not start, as the operator reads it."""


class StartupError(RuntimeError):
    """A rank cannot join the world, or the world is not the one its config describes.
    The message says what was awaited or what differs."""

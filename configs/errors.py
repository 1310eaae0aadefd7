"""The one exception type for a configuration that cannot run."""


class ConfigError(ValueError):
    """A configuration mistake, raised before any rank starts. The message names the
    file, the dotted key and the numbers involved."""

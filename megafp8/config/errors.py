"""The one exception type for bad user input: its message says what to change."""


class ConfigError(ValueError):
    """A setting, a file or a combination of them that cannot work; the message names the fix."""

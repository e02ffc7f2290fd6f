"""The one exception every layer can import cheaply: a bad config value, shown as one line."""


class ConfigError(ValueError):
    """A bad config value. `str(err)` is the one-line message shown to the user: it names the key and the
    rule; the CLI prints it and exits 2 before any actor starts."""

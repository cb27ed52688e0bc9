"""``ConfigError``: a setting the engine cannot run with.

Its own module so that the modules ``shared/config.py`` reads from (the model's config,
LoRA adapters) can raise it without importing the configuration back.
"""


class ConfigError(ValueError):
    """A setting has a value the engine cannot run with; the message names it."""

"""The library's error base class: every refusal kvoffload raises on purpose (bad input, a plan that
does not fit, a damaged checkpoint) derives from it, so the CLI can print its message on one line."""


class KVOffloadError(Exception):
    """A clear, user-facing refusal; the message names the problem and what to change."""


class AccuracyWarning(UserWarning):
    """A configuration that runs but is known to lose accuracy against `full` on held-out data (the measured
    loss is in the message and in BENCHMARKS.md); the CLI prints it on one line."""


def warn_accuracy(message: str):
    """Warns once per distinct message (Python's default filter) with AccuracyWarning."""
    import warnings

    warnings.warn(message, AccuracyWarning, stacklevel=3)

"""The library's error base class: every refusal kvoffload raises on purpose (bad input, a plan that
does not fit, a damaged checkpoint) derives from it, so the CLI can print its message on one line."""


class KVOffloadError(Exception):
    """A clear, user-facing refusal; the message names the problem and what to change."""

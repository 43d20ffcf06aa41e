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


class GenerationInputError(KVOffloadError, ValueError):
    """Prompts, token ids or lengths that generation cannot take."""


class ServeError(KVOffloadError, ValueError):
    """A serving request or configuration the scheduler cannot take (a prompt past the context or the cache,
    bad sampling values, a policy that cannot run under continuous batching); the server answers it with a
    4xx. `limit` names the limit a request exceeded, where one did."""

    def __init__(self, message: str, limit: str | None = None, status: int = 400):
        super().__init__(message)
        self.limit, self.status = limit, status


class InvalidResultError(KVOffloadError, ValueError):
    """A run's output that would be garbage (non-finite numbers, nothing evaluated): refused before it is
    written, so no file ever holds a result that looks like one and is not."""


class ArgumentRangeError(KVOffloadError, ValueError):
    """A command-line or library number outside the range it takes."""


def check_range(name: str, value, low=None, high=None, *, integer: bool = False, low_open: bool = False):
    """value as given, or one ArgumentRangeError naming `name` when it is not a finite number (an integer
    where integer=True) within [low, high] (low excluded with low_open)."""
    import math

    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (not integer or float(value).is_integer())
    ok = ok and (low is None or value > low or (value == low and not low_open))
    ok = ok and (high is None or value <= high)
    if not ok:
        what = "an integer" if integer else "a finite number"
        if low is not None and high is not None:
            what += f" in {'(' if low_open else '['}{low}, {high}]"
        elif low is not None:
            what += f" {'>' if low_open else '>='} {low}"
        raise ArgumentRangeError(f"{name} must be {what}, got {value!r}")
    return value


def check_finite_result(what: str, values, then: str = "nothing written") -> None:
    """Refuses (InvalidResultError) a result holding NaN or inf: `what` names it, `then` what happens (and
    what to change)."""
    import numpy as np

    arr = np.asarray(values, np.float64)
    bad = int(arr.size - np.isfinite(arr).sum())
    if bad:
        raise InvalidResultError(f"{what} holds {bad} non-finite value(s) of {arr.size}; {then}")


# The errors a user can cause (bad input, a missing or unwritable file, a damaged checkpoint, a plan that
# does not fit): printed as one line with exit code 2; anything else is a bug and keeps its traceback.
USER_ERRORS = (KVOffloadError, ValueError, OSError)
_MAX_MESSAGE = 600


def one_line(e: BaseException) -> str:
    """An exception's message on one line (storage layers put dumps in theirs), cut to a readable length."""
    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, KeyError) and e.args:
        msg = str(e.args[0])
    if len(msg) > _MAX_MESSAGE:
        msg = msg[:_MAX_MESSAGE] + " ... (--debug shows all)"
    return msg

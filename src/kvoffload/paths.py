"""Output paths checked before any work: a results file, a trace, a profile or a checkpoint folder that cannot
be written fails at the start, in one line, rather than after minutes of work whose answer is then lost."""

from __future__ import annotations

import os

from kvoffload.errors import KVOffloadError


class OutputPathError(KVOffloadError, ValueError):
    """An output file or folder that cannot be created or written."""


def check_output_dir(directory: str | os.PathLike, what: str = "", error=OutputPathError) -> str:
    """Refuses (error) a folder that cannot be created or written: a path under a file, an existing file, a
    read-only or virtual file system. Creates what is missing and writes a probe file, then undoes both, so
    nothing is left behind. Returns the absolute path."""
    directory = os.path.abspath(os.fspath(directory))
    label = f"{what} " if what else ""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise error(f"{label}{directory}: exists and is not a directory")
    created, d = [], directory
    while not os.path.exists(d):
        created.append(d)
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise error(f"cannot create {label}{directory}: {d} is not a directory")
    try:
        for c in reversed(created):
            os.mkdir(c)
        probe = os.path.join(directory, f".kvoffload-write-test-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise error(f"cannot write to {label}{directory}: {e.strerror or e}") from e
    finally:
        for c in created:
            try:
                os.rmdir(c)
            except OSError:
                pass
    return directory


def check_output_file(path: str | os.PathLike, what: str = "", error=OutputPathError) -> str:
    """Refuses (error) a file that could not be written later: its folder as check_output_dir, the path an
    existing folder, or an existing file without write permission. Returns the absolute path."""
    path = os.path.abspath(os.fspath(path))
    label = f"{what} " if what else ""
    if os.path.isdir(path):
        raise error(f"{label}{path}: is a directory; give a file name")
    parent = os.path.dirname(path)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise error(f"cannot create {label}{path}: {parent} is not a directory")
    check_output_dir(parent, what, error)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise error(f"cannot write to {label}{path}: permission denied")
    return path

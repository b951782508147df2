"""One exception type for bad input; entry points turn it into one line and a non-zero exit."""

from __future__ import annotations

import errno
import functools
import os
import sys

# the errors of a write the disk cannot hold: the writes are atomic (specheads.atomic), so what they
# leave is the old file or none, and the entry point can end in one line
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class SpecHeadsError(Exception):
    """A problem with the user's input (config, data, files), not a bug in specheads."""


def one_line_errors(main):
    """Wrap an entry point: known input errors, and a disk that fills during a write, print one
    line and exit 2.

    HYDRA_FULL_ERROR=1 or SPECHEADS_DEBUG=1 re-raises with the full traceback.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except SpecHeadsError as err:
            if debugging():
                raise
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        except OSError as err:
            if err.errno not in DISK_FULL or debugging():
                raise
            print(f"error: {disk_full_line(err)}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def first_line(err: BaseException) -> str:
    """An exception's first line of text (its type's name when it has none): what a one-line
    error quotes of a library's multi-line message."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def debugging() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("SPECHEADS_DEBUG") == "1"


def disk_full_line(err: OSError) -> str:
    """The one line of a write the disk could not hold."""
    where = f" writing {err.filename}" if err.filename else ""
    return (
        f"the disk is full{where} ({os.strerror(err.errno)}): nothing half-written was kept; free space "
        "(or point the output elsewhere) and run the same command again, which resumes"
    )

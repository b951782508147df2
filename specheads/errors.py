"""One exception type for bad input; entry points turn it into one line and a non-zero exit."""

from __future__ import annotations

import functools
import os
import sys


class SpecHeadsError(Exception):
    """A problem with the user's input (config, data, files), not a bug in specheads."""


def one_line_errors(main):
    """Wrap an entry point: known input errors print one line and exit 2.

    HYDRA_FULL_ERROR=1 or SPECHEADS_DEBUG=1 re-raises with the full traceback.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except SpecHeadsError as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("SPECHEADS_DEBUG") == "1":
                raise
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapper

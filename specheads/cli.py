"""Entry-point plumbing shared by the @hydra.main scripts.

Hydra reports a bad override (unknown key, wrong type, missing config option) in several lines.
`run_hydra_main` turns those composition errors into one line and exit status 2, like any other
bad input; errors raised while the job itself runs keep their usual reporting.
HYDRA_FULL_ERROR=1 leaves Hydra's own reporting untouched.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from .errors import one_line_errors

_FULL_ERROR = "HYDRA_FULL_ERROR"
_state = {"composing": True, "user_full_error": None}


def strip_launcher_args(argv: list[str]) -> list[str]:
    """The `deepspeed` launcher appends --local_rank=N, which Hydra would reject: move it to the env."""
    kept = []
    args = iter(argv)
    for arg in args:
        if arg.startswith("--local_rank"):
            value = arg.split("=", 1)[1] if "=" in arg else next(args, "0")
            os.environ.setdefault("LOCAL_RANK", value)
        else:
            kept.append(arg)
    return kept


def job(task: Callable) -> Callable:
    """Put under @hydra.main: marks the end of composition (and restores the caller's environment)."""

    @functools.wraps(task)
    def wrapper(*args, **kwargs):
        if _state["composing"] and _state["user_full_error"] is not None:
            _restore_env()
        _state["composing"] = False
        return task(*args, **kwargs)

    return wrapper


def _restore_env() -> None:
    if _state["user_full_error"] == "":
        os.environ.pop(_FULL_ERROR, None)
    else:
        os.environ[_FULL_ERROR] = _state["user_full_error"]
    _state["user_full_error"] = None


def config_error_line(err: BaseException) -> str:
    """One line from a Hydra/OmegaConf composition error."""
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    lines = str(cause).strip().splitlines() or [type(cause).__name__]
    message = lines[0].strip()
    full_key = getattr(cause, "full_key", None)
    if full_key and full_key not in message:
        message += f" ({full_key})"
    # A missing group option lists the available ones, one per tab-indented line.
    for i, line in enumerate(lines):
        if line.startswith("Available options"):
            options = []
            for option in lines[i + 1 :]:
                if not option.startswith("\t"):
                    break
                if not option.strip().endswith("_schema"):
                    options.append(option.strip())
            message += f"; available: {', '.join(options)}"
            break
    return message


def run_hydra_main(main: Callable[[], None], argv: list[str] | None = None) -> None:
    """Call a @hydra.main function (whose task is wrapped in `job`) with one-line config errors."""
    sys.argv = strip_launcher_args(sys.argv if argv is None else argv)
    _state["composing"] = True
    if os.environ.get(_FULL_ERROR) == "1":
        main()
        return
    # With HYDRA_FULL_ERROR set, Hydra raises composition errors instead of printing its report;
    # `job` puts the caller's value back before the task runs.
    _state["user_full_error"] = os.environ.get(_FULL_ERROR, "")
    os.environ[_FULL_ERROR] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        if not _state["composing"]:
            raise
        print(f"error: {config_error_line(err)}", file=sys.stderr)
        sys.exit(2)
    finally:
        if _state["user_full_error"] is not None:
            _restore_env()


def hydra_command(name: str, config_name: str, conf_dir: str | os.PathLike, task: Callable) -> Callable[[], None]:
    """A @hydra.main function over conf_dir/config_name.yaml whose job is `task(cfg)`, with `job`
    and one-line errors around it: the one construction behind every command, whichever conf/ it
    reads (a checkout's, or the one installed in the package). Hydra names a job after the module
    of its task function; `name` keeps the names the scripts gave ("train", "infer", ...)."""
    import hydra

    def run(cfg):
        return task(cfg)

    run.__module__ = name
    run.__qualname__ = run.__name__ = name
    main = hydra.main(config_path=str(Path(conf_dir).resolve()), config_name=config_name, version_base=None)
    return main(job(one_line_errors(run)))

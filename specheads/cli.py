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

from .errors import SpecHeadsError, one_line_errors

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


def check_output_path(path: str | os.PathLike, key: str, directory: bool = True) -> Path:
    """`path` (the value of `key`), refused in one line where no write can succeed: a directory
    output that exists as a file, a file output that exists as a directory, or either under an
    existing file. Entry points call this before any work, so that a long run does not end in a
    traceback at its first write."""
    given = Path(path)
    where = given.expanduser()
    if directory and where.exists() and not where.is_dir():
        raise SpecHeadsError(f"{key}={given} is a file; give a directory (new or existing)")
    if not directory and where.is_dir():
        raise SpecHeadsError(f"{key}={given} is a directory; give a file path")
    for parent in where.parents:
        if parent.exists():
            if not parent.is_dir():
                raise SpecHeadsError(f"{key}={given} lies under {parent}, which is a file, not a directory")
            break
    return where


def require_group(argv: list[str], group: str, conf_dir: str | os.PathLike) -> None:
    """Exit 2 with one line when `group.key=value` is given but `group=NAME` is not, in a config
    whose defaults leave the group null (infer.py and export take the target from the head's
    config.json): OmegaConf cannot set a field of a node that does not exist, and would fail
    with an assertion about a NoneType root."""
    keys = [(arg.partition("=")[0].lstrip("+~"), arg) for arg in argv[1:] if not arg.startswith("-")]
    fields = [arg for key, arg in keys if key.startswith(group + ".")]
    if fields and not any(key == group for key, _ in keys):
        options = sorted(p.stem for p in (Path(conf_dir) / group).glob("*.yaml"))
        print(
            f"error: {fields[0]} needs {group}=NAME before it (without one the target comes from the head's "
            f"config.json, whose fields cannot be overridden one by one); NAME is one of {', '.join(options)}",
            file=sys.stderr,
        )
        sys.exit(2)


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


def run_hydra_main(main: Callable[[], None], argv: list[str] | None = None, run_dir_key: str | None = None) -> None:
    """Call a @hydra.main function (whose task is wrapped in `job`) with one-line config errors.

    `run_dir_key`: the config key that hydra.run.dir interpolates (train.py: output_dir). Hydra
    creates that directory before the task runs, so a value that is a file is reported here."""
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
    except (FileExistsError, NotADirectoryError) as err:
        if not _state["composing"] or run_dir_key is None or not err.filename:
            raise
        try:
            check_output_path(err.filename, run_dir_key)
        except SpecHeadsError as refused:
            print(f"error: {refused}", file=sys.stderr)
            sys.exit(2)
        raise
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

"""The Hugging Face Hub side: load a head by Hub id, publish an exported directory.

resolve_head_path works offline from the local HF cache (HF_HUB_OFFLINE=1): snapshot_download
then resolves refs/main to a cached snapshot without any network call.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import SpecHeadsError, first_line

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def looks_like_hub_id(value: str) -> bool:
    return bool(HUB_ID.match(value)) and not value.startswith((".", "/", "~"))


def resolve_head_path(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local directory for a head: an existing path as is, else a Hub id ("org/name[@rev]")
    fetched with huggingface_hub.snapshot_download (or found in the local cache when offline)."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    text = str(path_or_id)
    repo_id, _, rev = text.partition("@")
    if not looks_like_hub_id(repo_id):
        raise SpecHeadsError(f"head {text} does not exist (neither a local path nor a Hub id org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, revision=rev or revision))
    except HFValidationError as err:
        raise SpecHeadsError(f"head {text}: {first_line(err)}") from None
    except Exception as err:  # offline cache miss, unknown repo or revision, HTTP errors
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise SpecHeadsError(
            f"cannot get head {text} from the Hugging Face Hub{hint}: {type(err).__name__}: {first_line(err)}"
        ) from None


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
) -> str:
    """Create the repo if needed and upload the whole folder in one commit.

    Args:
        folder: the directory to upload (an export with its README.md model card).
        repo_id: the Hub repository, org/name.
        private: create the repository as private.
        commit_message: the commit's message; None = "Upload draft head (NAME)".
        token: a Hub token; None = the one huggingface_hub finds.

    Returns:
        The commit's URL.
    """
    from huggingface_hub import HfApi

    if not looks_like_hub_id(repo_id):
        raise SpecHeadsError(f"repo_id must look like org/name, got {repo_id!r}")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            commit_message=commit_message or f"Upload draft head ({Path(folder).name})",
        )
    except Exception as err:
        raise SpecHeadsError(f"upload to {repo_id} failed: {type(err).__name__}: {first_line(err)}") from None
    return str(getattr(info, "commit_url", None) or f"https://huggingface.co/{repo_id}")

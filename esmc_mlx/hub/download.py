"""Downloads through huggingface_hub (honours HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, the cache)."""

from __future__ import annotations

from pathlib import Path

from ..errors import HubError

CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.md", "*.txt", "*.png", "*.pth"]


def download_checkpoint(repo_id: str, revision: str | None = None) -> tuple[Path, str | None]:
    """Fetch a model repo into the HF cache; return (local directory, resolved commit).

    Raises HubError when the repo does not exist, is gated or private without a token, or
    cannot be reached (offline mode or network down) and is not already cached.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    try:
        local = Path(snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_PATTERNS))
    except hf_errors.RepositoryNotFoundError:
        raise HubError(f"{repo_id}: no such model repo on the Hub (or it is private and no token is set)") from None
    except hf_errors.RevisionNotFoundError:
        raise HubError(f"{repo_id}: revision {revision!r} not found") from None
    except hf_errors.GatedRepoError:
        raise HubError(f"{repo_id}: gated repo; accept its terms on the Hub and log in (hf auth login)") from None
    except hf_errors.LocalEntryNotFoundError:
        raise HubError(
            f"{repo_id}: not in the local cache and the Hub cannot be reached (HF_HUB_OFFLINE is set "
            "or the network is down)"
        ) from None
    except hf_errors.HfHubHTTPError as e:
        raise HubError(f"{repo_id}: download failed: {e}") from None
    commit = local.name if len(local.name) == 40 else None  # snapshots/<commit sha>
    return local, commit

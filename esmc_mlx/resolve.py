"""What the user typed -> a local checkpoint: aliases, local paths, and Hub downloads through
huggingface_hub (honours HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE and the cache).

One vocabulary of sources for every command: ``esmc-convert``, ``load``, ``embed``, ``score``
and ``validate --reference`` all resolve through ``resolve``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from .errors import ConvertError, HubError

ALIASES = {
    "300M": "biohub/ESMC-300M",
    "600M": "biohub/ESMC-600M",
    "6B": "biohub/ESMC-6B",
    # ESMFold2 on its ESMC-6B backbone: 48 folding blocks, optional MSA input; Fast: 24, single sequence
    "ESMFold2": "biohub/ESMFold2",
    "ESMFold2-Fast": "biohub/ESMFold2-Fast",
}
PACKAGED = Path(__file__).resolve().parent / "data"
LOCAL_ALIASES = {"tiny": PACKAGED / "esmc-tiny"}  # ships inside the package, works offline
SAE_ALIASES = {"tiny": PACKAGED / "esmc-tiny-sae"}  # an SAE on esmc-tiny's layer 4, also packaged

CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.md", "*.txt", "*.png", "*.pth"]


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str | None = None, what: str = "the model"):
    """huggingface_hub's exceptions inside the block as one HubError that says what to do: a
    missing, gated or private repo, a missing revision, offline mode or no network with the
    files not cached (``what`` names them), an interrupted download."""
    from huggingface_hub import constants, is_offline_mode
    from huggingface_hub import errors as hf_errors

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        yield
    except hf_errors.GatedRepoError:
        raise HubError(f"{repo_id}: gated repo; accept its terms on the Hub and log in (hf auth login)") from None
    except hf_errors.RepositoryNotFoundError:
        raise HubError(f"{repo_id}: no such model repo on the Hub (or it is private and no token is set)") from None
    except hf_errors.RevisionNotFoundError:
        raise HubError(f"{repo_id}: revision {revision!r} not found") from None
    except hf_errors.LocalEntryNotFoundError as e:  # IncompleteSnapshotError is one too
        incomplete = isinstance(e, getattr(hf_errors, "IncompleteSnapshotError", ()))
        cached = f"{what} is {'only partly' if incomplete else 'not'} in the local cache"
        if is_offline_mode():
            raise HubError(
                f"{where}: offline mode is on (HF_HUB_OFFLINE is set) and {cached} "
                f"({constants.HF_HUB_CACHE}). Download it once with the network on, or unset HF_HUB_OFFLINE."
            ) from None
        raise HubError(
            f"{where}: cannot reach the Hub at {constants.ENDPOINT} and {cached} "
            f"({constants.HF_HUB_CACHE}). Check the network (and HF_ENDPOINT), then try again."
        ) from None
    except hf_errors.EntryNotFoundError:  # (after its subclass LocalEntryNotFoundError)
        raise HubError(f"{where}: the repo holds no {what}") from None
    except hf_errors.HfHubHTTPError as e:
        raise HubError(f"{repo_id}: download failed: {e}") from None
    except Exception as e:  # the HTTP client's own errors: the network failed mid-download
        if type(e).__module__.split(".")[0] not in ("httpx", "httpx2", "requests", "urllib3"):
            raise
        raise HubError(
            f"{where}: the download from {constants.ENDPOINT} was interrupted ({type(e).__name__}: {e}). "
            "Run the same command again: finished files are kept in the cache."
        ) from None


def download_checkpoint(
    repo_id: str, revision: str | None = None, patterns: list[str] | None = None
) -> tuple[Path, str | None]:
    """Fetch a model repo into the HF cache; return (local directory, resolved commit).
    ``patterns``: the files to fetch (default: a checkpoint's, ``CHECKPOINT_PATTERNS``).

    Works offline (HF_HUB_OFFLINE=1) when the snapshot is completely in the cache. Raises HubError
    when the repo does not exist, is gated or private without a token, or cannot be reached
    (offline mode or network down) and is not completely cached.
    """
    from huggingface_hub import snapshot_download

    with hub_errors(repo_id, revision):
        local = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns or CHECKPOINT_PATTERNS))
    if not local.is_dir():  # the client returns a path it never made when no file matched
        raise HubError(
            f"{repo_id}: the repo holds no model files on {revision or 'main'} (no config.json, weights or .pth)"
        )
    commit = local.name if len(local.name) == 40 else None  # snapshots/<commit sha>
    return local, commit


def download_file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """One file of a Hub repo, fetched into the HF cache (or read from it); HubError as
    ``download_checkpoint``'s, or naming a file the repo does not hold."""
    from huggingface_hub import hf_hub_download

    with hub_errors(repo_id, revision, filename):
        return Path(hf_hub_download(repo_id, filename, revision=revision))


@dataclasses.dataclass
class Source:
    """A resolved checkpoint: where its files are and what it was called."""

    path: Path  # a directory, or a .pth file
    id: str  # what provenance records: repo id, alias target or local path
    revision: str | None = None

    @property
    def is_pth(self) -> bool:
        return self.path.is_file() and self.path.suffix in (".pth", ".pt", ".bin")


def resolve(source: str, revision: str | None = None) -> Source:
    """Turn an alias, Hub repo id, local directory or ``.pth`` path into a ``Source``.

    Raises ConvertError for an unknown alias, a missing path, or a repo the Hub cannot give.
    """
    if not isinstance(source, str) or not source.strip():
        # Path("") is the current directory: an unset shell variable ($MODEL) would read
        # whatever model or checkpoint the current directory holds
        raise ConvertError(f"{source!r} names no model: give an alias, a local path or a Hub repo id")
    if source.startswith("esmc-mlx/") and source.removeprefix("esmc-mlx/") in LOCAL_ALIASES:
        source = source.removeprefix("esmc-mlx/")  # the id provenance records for a bundled model
    repo_id = ALIASES.get(source) or ALIASES.get(source.upper())
    path = Path(source).expanduser()
    local = source in LOCAL_ALIASES or (repo_id is None and path.exists())
    if local and revision is not None:  # it would be ignored: say so instead
        raise ConvertError(f"revision {revision!r}: {source} is local, and a revision names a version of a Hub repo")
    if source in LOCAL_ALIASES:
        return Source(LOCAL_ALIASES[source], f"esmc-mlx/{source}")
    if repo_id is None and path.exists():
        return Source(path.resolve(), str(path.resolve()))
    if repo_id is None and path.is_symlink():  # exists() follows the link: a dangling one reads as absent
        raise ConvertError(f"{source}: a link to {os.readlink(path)}, which does not exist")
    looks_like_repo = (
        source.count("/") == 1
        and not source.startswith((".", "/", "~"))
        and not source.endswith((".pth", ".pt", ".safetensors"))
    )
    if repo_id is None and not looks_like_repo:
        if (
            source.startswith((".", "/", "~"))
            or "/" in source
            or path.suffix in (".pth", ".pt", ".bin", ".safetensors")
        ):
            raise ConvertError(f"{source}: no such file or directory")
        known = ", ".join([*ALIASES, *LOCAL_ALIASES])
        raise ConvertError(
            f"{source!r} is not a model alias ({known}), an existing local path, or a Hub repo id (org/name)"
        )
    try:
        local, commit = download_checkpoint(repo_id or source, revision)
    except HubError as e:
        if repo_id is None and path.parent.is_dir() and str(path.parent) not in ("", "."):
            # "models/esmc" with a local models/ folder: most likely a path with a typo
            raise HubError(f"{source}: no such file or directory here, and not a model on the Hub ({e})") from None
        raise
    return Source(local, repo_id or source, commit)


def local_copy(source: str) -> Path | None:
    """Where what ``source`` names already lies on this machine, found without the network: a
    packaged model's folder (``tiny``), or the folder of a Hub repo (an alias's or ``org/name``)
    in the HF cache, every revision under it. None when there is none (a local path is itself)."""
    if not isinstance(source, str) or not source or Path(source).expanduser().exists():
        return None
    name = source.removeprefix("esmc-mlx/")
    if name in LOCAL_ALIASES:
        return LOCAL_ALIASES[name]
    repo_id = ALIASES.get(source) or ALIASES.get(source.upper()) or source
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")) or not all(repo_id.split("/")):
        return None
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    return folder if folder.is_dir() else None

"""The one repo-id check: huggingface_hub's own validator, plus the ORG/NAME form a model repo
of ours needs (the Hub also accepts a bare legacy "name")."""

from __future__ import annotations

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..errors import HubError


def check_repo_id(repo_id: str) -> None:
    """Raise HubError unless ``repo_id`` is a valid Hub repo id of the form ORG/NAME."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"{repo_id!r} is not a Hub repo id: {e}") from None
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise HubError(f"{repo_id!r} is not a Hub repo id: use ORG/NAME (letters, digits, '-', '_', '.')")


def is_repo_id(text: str | None) -> bool:
    try:
        check_repo_id(text)
    except HubError:
        return False
    return True

"""Hugging Face Hub I/O: downloading sources, publishing artifacts with a model card."""

from .card import read_validation, render_card
from .download import download_checkpoint
from .push import PushResult, check_push_access, push_artifact
from .repo_id import check_repo_id

__all__ = ["PushResult", "check_push_access", "check_repo_id", "download_checkpoint", "push_artifact",
           "read_validation", "render_card"]

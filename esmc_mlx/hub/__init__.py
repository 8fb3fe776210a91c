"""Hugging Face Hub publishing: the model card and one atomic push (downloads live in
``esmc_mlx.resolve``)."""

from .card import read_validation, render_card
from .push import PushResult, check_push_access, push_artifact
from .repo_id import check_repo_id

__all__ = ["PushResult", "check_push_access", "check_repo_id", "push_artifact", "read_validation", "render_card"]

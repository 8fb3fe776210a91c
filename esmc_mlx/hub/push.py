"""Publish an artifact directory to the Hub: every check first, then one commit with its model card.

1. Local, no network: the directory is a complete artifact; its validation passed (or
   ``allow_unvalidated``); the model card renders.
2. Access, read-only requests: not offline; a token exists (HF_TOKEN or ``hf auth login``); the Hub
   accepts it; it is not read-only; the namespace is the user's or one of their organizations.
3. Create the repo (or find it); create the branch that ``revision`` names if it is new.
4. Upload the LFS files (weights, plots) one by one, several at a time; each is retried, and a file
   that still fails is named.
5. One commit: README.md, config, weights, tokenizer, validation/, and the deletion of weight shards
   and validation files the repo holds but this artifact does not (so a re-push never mixes shards).

Nothing is committed unless every file is uploaded, so a failure leaves the repo as it was. A
branch created in step 3 is deleted again; so is a repo, unless part of the upload reached it: then
it stays empty (no commit) so that running the push again resumes, and the error says so.

All Hub traffic goes through ``huggingface_hub`` (HfApi.whoami / create_repo / create_branch /
preupload_lfs_files / create_commit), which honours HF_ENDPOINT, HF_TOKEN or the stored login,
HF_HUB_OFFLINE and, when hf_xet is installed, uploads through Xet storage.

Why not ``upload_folder`` / ``upload_large_folder``: ``upload_folder`` is ``create_commit`` over the
folder's files, but reports a failure as one error for the whole folder, and we must name the files
that did not upload and retry only those. ``upload_large_folder`` (gone from huggingface_hub 2.x,
whose ``upload_folder`` took over its resumable Xet pipeline) commits in several parts and cannot
open a pull request or set a commit message: a failed run would leave a half-published repo. An
artifact has a handful of files (the 6B in bf16 is about 20), far below one commit's limits, and a
re-run after a failure skips every object already uploaded.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ..errors import HubError
from ..artifact import human_size, precision_label
from .card import MARKER, Validation, base_model_of, read_validation, render_card

ATTEMPTS = 3  # tries per file upload and for the commit (the client also retries each request)
RETRY_WAITS = (5.0, 20.0)  # seconds before the 2nd and the 3rd attempt
UPLOAD_WORKERS = 4
# Paths a push owns in the repo: deleted there when the artifact no longer has them.
OWNED_PATTERNS = ("model*.safetensors", "model.safetensors.index.json", "validation/*")
SKIPPED_NAMES = {"__pycache__", ".DS_Store", ".git", ".cache", ".ipynb_checkpoints"}
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@dataclasses.dataclass
class PushResult:
    """What a push did (or, for a dry run, would do)."""

    repo_id: str
    url: str
    revision: str
    files: list[tuple[str, int]]  # (path in repo, bytes)
    deletions: list[str]
    card: str
    card_generated: bool  # False: a hand-written README.md was kept
    validation: Validation
    dry_run: bool = False
    created: bool = False  # the repo was (would be) created by this push
    commit_oid: str | None = None
    commit_url: str | None = None
    pr_url: str | None = None
    unchanged: bool = False  # the repo already held exactly this artifact: no commit
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def summary(self) -> str:
        size = f"{len(self.files)} files, {human_size(self.total_bytes)}"
        where = self.repo_id + (f" (branch {self.revision})" if self.revision != "main" else "")
        if self.dry_run:
            lines = [f"Dry run: nothing was uploaded. A push would {'create' if self.created else 'update'} {where}:"]
            lines += [f"  + {path} ({human_size(n)})" for path, n in self.files]
            lines += [f"  - {path} (in the repo, not in the artifact)" for path in self.deletions]
        elif self.unchanged:
            lines = [f"Nothing to push: {where} already holds this artifact (commit {self.commit_oid[:12]})."]
        elif self.pr_url:
            lines = [f"Opened a pull request on {where}: {self.pr_url}", f"  commit {self.commit_oid}, {size}"]
        else:
            lines = [f"{'Created' if self.created else 'Updated'} {where}: {self.url}",
                     f"  commit {self.commit_oid}, {size}" + (f", {len(self.deletions)} stale files removed"
                                                              if self.deletions else "")]
        lines.append(f"  validation: {self.validation.headline()}")
        lines.append("  model card: " + ("generated README.md" if self.card_generated else "your README.md (kept)"))
        lines += [f"  note: {n}" for n in self.notes]
        if not self.dry_run and not self.pr_url:
            lines.append(f'  load it: esmc_mlx.load("{self.repo_id}")')
        return "\n".join(lines)


# --- checks ---------------------------------------------------------------------------------------
def check_repo_id(repo_id: str) -> None:
    if not REPO_ID.match(repo_id or ""):
        raise HubError(f"{repo_id!r} is not a Hub repo id: use ORG/NAME (letters, digits, '-', '_', '.')")


def artifact_files(model_dir: Path) -> list[tuple[str, int]]:
    """The files a push uploads, as (posix path relative to the directory, size); checks that the
    weights the index names are all there. Hidden files and caches are left out."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise HubError(f"{model_dir}: no such directory")
    if not (model_dir / "config.json").is_file():
        raise HubError(f"{model_dir}: no config.json; is this an esmc-mlx output directory?")
    if not list(model_dir.glob("model*.safetensors")):
        raise HubError(f"{model_dir}: no model*.safetensors weights; is this an esmc-mlx output directory?")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise HubError(f"{index}: not a readable safetensors index ({e})") from None
        missing = sorted(s for s in shards if not (model_dir / s).is_file())
        if missing:
            raise HubError(f"{model_dir}: incomplete artifact, the index names missing shards: {', '.join(missing)}")
    files = []
    for path in sorted(model_dir.rglob("*")):
        rel = path.relative_to(model_dir)
        if path.is_file() and not any(p in SKIPPED_NAMES or p.startswith(".") for p in rel.parts):
            files.append((rel.as_posix(), path.stat().st_size))
    return files


def check_validation(model_dir: Path, repo_id: str, allow_unvalidated: bool) -> Validation:
    """The artifact's validation; raises HubError when it is missing or failed, unless allowed."""
    validation = read_validation(model_dir)
    if validation.passed or allow_unvalidated:
        return validation
    try:
        meta = json.loads((Path(model_dir) / "config.json").read_text()).get("esmc_mlx") or {}
    except (OSError, json.JSONDecodeError):
        meta = {}
    reference = base_model_of(meta) or (meta.get("source") or {}).get("id") or "SOURCE"
    anyway = f"esmc-mlx push {model_dir} {repo_id} --allow-unvalidated"
    if validation.state == "failed":
        report = Path(model_dir) / "validation" / "report.md"
        raise HubError(
            f"refusing to push {model_dir}: {validation.problem}.\n"
            f"See {report if report.exists() else Path(model_dir) / 'validation' / 'report.json'}. "
            f"To publish it anyway (its model card will say that validation FAILED):\n  {anyway}"
        )
    raise HubError(
        f"refusing to push {model_dir}: it is not validated ({validation.problem}).\n"
        f"Validate it first:\n  esmc-mlx validate {model_dir} --reference {reference}\n"
        f"or publish it anyway (its model card will say \"not validated\"):\n  {anyway}"
    )


@dataclasses.dataclass
class Access:
    """Who is pushing, established with read-only requests."""

    api: object  # huggingface_hub.HfApi bound to the token
    user: str
    role: str | None  # the token's role: "write", "read", "fineGrained" or None when not reported
    orgs: dict[str, str | None]  # organization -> role in it


def check_push_access(repo_id: str, token: str | None = None) -> Access:
    """Everything about the token and the namespace that can be known without writing anything.

    Raises HubError when offline mode is on, no token is set, the Hub rejects the token, the token is
    read-only, or ``repo_id``'s namespace is neither the user's nor one of their organizations (saying
    whose repo it is when it exists). ``esmc-convert --upload-repo`` calls it before converting.
    """
    from huggingface_hub import HfApi, constants, get_token

    check_repo_id(repo_id)
    if constants.HF_HUB_OFFLINE:
        raise HubError(f"cannot push to {repo_id}: offline mode is on (HF_HUB_OFFLINE is set). "
                       "Unset it, or set HF_HUB_OFFLINE=0, to publish.")
    token = token or get_token()
    tokens_url = f"{constants.ENDPOINT}/settings/tokens"
    if not token:
        raise HubError(f"cannot push to {repo_id}: no Hugging Face token. Log in with `hf auth login` or set "
                       f"HF_TOKEN to a token with write access ({tokens_url}).")
    api = HfApi(token=token)
    try:
        me = api.whoami()
    except Exception as e:
        status, message = _http_status(e)
        if status == 401:
            raise HubError(f"cannot push to {repo_id}: the Hub rejected the token (401 Unauthorized: invalid or "
                           f"expired). Log in again with `hf auth login` or set HF_TOKEN ({tokens_url}).") from None
        raise HubError(f"cannot push to {repo_id}: {_network_or_http(e, 'checking the token')}") from None
    user = me.get("name") or "?"
    role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
    orgs = {o.get("name"): o.get("roleInOrg") for o in me.get("orgs") or [] if isinstance(o, dict)}
    if role == "read":
        raise HubError(f"cannot push to {repo_id}: the token of {user} is read-only. Create a token with write "
                       f"access ({tokens_url}) and log in with it (`hf auth login`) or set HF_TOKEN.")
    namespace, name = repo_id.split("/")
    if namespace != user and namespace not in orgs:
        exists = _exists(api, repo_id)
        whose = (f"{repo_id} already exists and belongs to {namespace!r}" if exists
                 else f"{namespace!r} is not your user name")
        member = f" or one of your organizations ({', '.join(sorted(orgs))})" if orgs else ""
        raise HubError(f"cannot push to {repo_id} as {user}: {whose}, and you can only write under {user!r}"
                       f"{member}. Push to {user}/{name}, or ask an admin of {namespace!r} for write access.")
    if namespace in orgs and orgs[namespace] == "read":
        raise HubError(f"cannot push to {repo_id}: {user} has the read role in {namespace!r}; ask one of its "
                       "admins for write access.")
    return Access(api, user, role, orgs)


# --- push -------------------------------------------------------------------------------------------
def push_artifact(
    model_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    dry_run: bool = False,
    allow_unvalidated: bool = False,
    token: str | None = None,
) -> PushResult:
    """Publish the artifact ``model_dir`` to the model repo ``repo_id`` in one commit.

    Writes README.md (the generated model card) into ``model_dir`` unless a hand-written one is
    there (no esmc-mlx marker line). ``revision`` is the branch to commit to (created from main if
    new); ``create_pr`` opens a pull request against it instead. ``private`` applies when the repo
    is created. ``dry_run`` makes every check, including the read-only Hub ones, and returns what a
    push would upload, without writing anything anywhere.

    Raises HubError, before any upload, for an incomplete artifact, a missing or failed validation
    (unless ``allow_unvalidated``), offline mode, a missing, invalid or read-only token, a namespace
    the user cannot write to, or a repo they cannot write to; after uploads start, for files that
    still fail after retries (named in the message) or a commit the Hub refuses. On failure nothing
    is committed; a branch this call created is deleted again, and so is a repo it created unless
    part of the upload reached it (then the repo stays, empty, so that running the push again
    resumes; the message says which).
    """
    from .._version import __version__

    model_dir = Path(model_dir)
    check_repo_id(repo_id)
    branch = revision or "main"
    files = artifact_files(model_dir)
    validation = check_validation(model_dir, repo_id, allow_unvalidated)
    readme = model_dir / "README.md"
    generated = not (readme.is_file() and MARKER not in readme.read_text(errors="replace"))
    card = render_card(model_dir, repo_id) if generated else readme.read_text(errors="replace")
    _check_card(card, readme)
    if generated and not any(path == "README.md" for path, _ in files):
        files = sorted([*files, ("README.md", len(card.encode()))])

    access = check_push_access(repo_id, token)
    api = access.api
    exists, is_private = _repo_visibility(api, repo_id)
    head = _branch_head(api, repo_id, branch) if exists else None
    if revision and create_pr and head is None:
        raise HubError(f"cannot open a pull request against {repo_id}@{branch}: no such branch")
    local = {path for path, _ in files}
    remote = _remote_files(api, repo_id, head) if head else []
    deletions = sorted(p for p in remote if p not in local and any(fnmatch.fnmatch(p, pat) for pat in OWNED_PATTERNS))
    result = PushResult(repo_id, _repo_url(repo_id, branch), branch, files, deletions, card, generated, validation,
                        dry_run=dry_run, created=not exists)
    if not generated:
        result.notes.append("README.md has no esmc-mlx marker line, so it was published as written")
    if not validation.passed:
        result.notes.append(f"published with --allow-unvalidated: validation {validation.headline()}")
    if exists and private and is_private is False:
        result.notes.append(f"{repo_id} exists and is public; --private only applies when a push creates the repo "
                            "(change the visibility in the repo's settings)")
    if exists and head is None and not create_pr:
        result.notes.append(f"branch {branch} is new: it starts from main")
    if dry_run:
        return result

    if generated:
        readme.write_text(card)
    created_repo = created_branch = False
    try:
        if not exists:
            created_repo = _create_repo(api, repo_id, private, access)
            result.created = created_repo
        if head is None and branch != "main":
            _call(lambda: api.create_branch(repo_id, branch=branch), repo_id, access, f"creating branch {branch}")
            created_branch = True
        if head is None:
            head = _branch_head(api, repo_id, branch)
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        additions = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(model_dir / p)) for p, _ in files]
        deletes = [CommitOperationDelete(path_in_repo=p) for p in deletions]
        _upload(api, repo_id, additions, branch, create_pr, access)
        config = json.loads((model_dir / "config.json").read_text())
        meta = config.get("esmc_mlx") or {}
        message = commit_message or (f"{'Update' if exists else 'Upload'} {repo_id.split('/')[1]}: "
                                     f"ESMC {precision_label(config)} for MLX (esmc-mlx {__version__})")
        description = "\n".join(filter(None, [
            f"Converted with: `{meta['command']}`" if meta.get("command") else None,
            f"Validation: {validation.headline()}",
            f"Pushed with esmc-mlx {__version__}",
        ]))
        info = _commit(api, repo_id, deletes + additions, message, description, branch, create_pr, head, access)
    except KeyboardInterrupt:  # leave everything as it is: nothing is committed, a re-run resumes
        raise
    except BaseException as error:
        resumable = isinstance(error, Unfinished) and error.resumable
        state = _after_failure(api, repo_id, branch, exists, created_repo, created_branch and not created_repo,
                               resumable)
        if isinstance(error, HubError):
            raise HubError(f"{error}\n{state}") from None
        raise
    result.commit_oid, result.commit_url = info.oid, info.commit_url
    result.pr_url = getattr(info, "pr_url", None)
    result.unchanged = info.oid == head and not result.pr_url
    return result


# --- steps ------------------------------------------------------------------------------------------
def _check_card(card: str, readme: Path) -> None:
    from huggingface_hub import ModelCard

    try:
        ModelCard(card, ignore_metadata_errors=False)
    except Exception as e:
        raise HubError(f"{readme}: the model card does not parse ({e}); fix or delete it") from None


def _exists(api, repo_id: str) -> bool:
    try:
        return bool(api.repo_exists(repo_id))
    except Exception:
        return False


def _repo_visibility(api, repo_id: str) -> tuple[bool, bool | None]:
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        info = api.repo_info(repo_id)
    except RepositoryNotFoundError:
        return False, None
    except Exception as e:
        raise HubError(f"cannot push to {repo_id}: {_network_or_http(e, 'looking the repo up')}") from None
    return True, getattr(info, "private", None)


def _branch_head(api, repo_id: str, branch: str) -> str | None:
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        return api.repo_info(repo_id, revision=branch).sha
    except RevisionNotFoundError:
        return None
    except Exception as e:
        raise HubError(f"cannot push to {repo_id}: {_network_or_http(e, f'looking up branch {branch}')}") from None


def _remote_files(api, repo_id: str, commit: str) -> list[str]:
    from huggingface_hub.hf_api import RepoFile

    try:
        return [f.path for f in api.list_repo_tree(repo_id, recursive=True, revision=commit) if isinstance(f, RepoFile)]
    except Exception as e:
        raise HubError(f"cannot push to {repo_id}: {_network_or_http(e, 'listing its files')}") from None


def _create_repo(api, repo_id: str, private: bool, access: Access) -> bool:
    """Create the repo; False when it appeared meanwhile (409)."""
    try:
        api.create_repo(repo_id, private=private, exist_ok=False)
        return True
    except Exception as e:
        status, message = _http_status(e)
        if status == 409:
            return False
        if status in (401, 403):
            raise HubError(f"the Hub refused to create {repo_id} for {access.user} ({status}: {message}). "
                           f"The token needs write access to {repo_id.split('/')[0]!r}; fine-grained tokens "
                           "need the repo-creation permission for that namespace.") from None
        raise HubError(f"cannot create {repo_id}: {_network_or_http(e, 'creating the repo')}") from None


class Unfinished(HubError):
    """Uploads or the commit failed; ``resumable``: some data reached the Hub, and a re-run of the
    same push skips it (uploaded LFS objects belong to the repo until a commit uses them)."""

    def __init__(self, message: str, resumable: bool = False):
        super().__init__(message)
        self.resumable = resumable


def _upload(api, repo_id: str, additions: list, branch: str, create_pr: bool, access: Access) -> None:
    """Upload every LFS file (a no-op for small files, which travel inside the commit), several at
    a time, each retried ATTEMPTS times. Raises Unfinished naming the files that never made it."""
    # hf_xet parallelizes inside each file and shares one session: hand it one file at a time.
    workers = 1 if _xet_in_use() else UPLOAD_WORKERS
    pending, failures = list(additions), {}
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(RETRY_WAITS[min(attempt - 1, len(RETRY_WAITS) - 1)])
        failures, fatal = {}, None
        with ThreadPoolExecutor(max_workers=min(workers, len(pending))) as pool:
            futures = {pool.submit(api.preupload_lfs_files, repo_id, [op], revision=branch, create_pr=create_pr): op
                       for op in pending}
            for future in as_completed(futures):
                op = futures[future]
                try:
                    future.result()
                except Exception as e:
                    if _permanent(e):
                        fatal = fatal or (op, e)
                    failures[op.path_in_repo] = e
        if fatal:
            op, e = fatal
            raise Unfinished(_explain(e, repo_id, access, f"uploading {op.path_in_repo}"))
        pending = [op for op in pending if op.path_in_repo in failures]
        if not pending:
            return
    sizes = {op.path_in_repo: op.upload_info.size for op in additions}
    failed = "\n".join(f"  {p} ({human_size(sizes[p])}): {_root_cause(e)}" for p, e in sorted(failures.items()))
    uploaded = [op.path_in_repo for op in additions if op._upload_mode == "lfs" and op._is_uploaded]
    done = f"; {len(uploaded)} other large file{'s' if len(uploaded) != 1 else ''} did upload" if uploaded else ""
    raise Unfinished(f"upload to {repo_id} failed after {ATTEMPTS} attempts; these files were not uploaded:\n"
                     f"{failed}\nNothing was committed{done}.", resumable=bool(uploaded))


def _xet_in_use() -> bool:
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return bool(is_xet_available())


def _commit(api, repo_id: str, operations: list, message: str, description: str, branch: str, create_pr: bool,
            head: str | None, access: Access):
    prs_before = _pr_refs(api, repo_id) if create_pr else None
    last = None
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(RETRY_WAITS[min(attempt - 1, len(RETRY_WAITS) - 1)])
        try:
            return api.create_commit(
                repo_id, operations=operations, commit_message=message, commit_description=description,
                revision=branch, create_pr=create_pr, parent_commit=None if create_pr else head)
        except Exception as e:
            status, _ = _http_status(e)
            if status == 412:
                raise Unfinished(f"{repo_id}@{branch} changed while this push ran (someone else committed). "
                                 "Nothing was committed.", resumable=True) from None
            if _permanent(e):
                raise Unfinished(_explain(e, repo_id, access, "committing") + " Nothing was committed.") from None
            last = e
            landed = _landed(api, repo_id, branch, head, message, prs_before)
            if landed is not None:  # the Hub committed, the answer was lost on the way back
                return landed
    raise Unfinished(f"the commit to {repo_id} failed after {ATTEMPTS} attempts ({_root_cause(last)}). Every file "
                     "was uploaded, but nothing was committed.", resumable=True)


def _pr_refs(api, repo_id: str) -> dict[str, str]:
    try:
        refs = api.list_repo_refs(repo_id, include_pull_requests=True)
        return {r.ref: r.target_commit for r in refs.pull_requests or []}
    except Exception:
        return {}


def _landed(api, repo_id: str, branch: str, head: str | None, message: str, prs_before: dict[str, str] | None):
    """The commit this push made if the Hub has it although the request failed (the answer was lost),
    else None. ``prs_before``: the pull-request refs before the commit, or None when not opening one."""
    from huggingface_hub import constants
    from huggingface_hub.hf_api import CommitInfo

    try:
        if prs_before is None:
            sha = api.repo_info(repo_id, revision=branch).sha
            candidates = [(None, sha)] if sha != head else []
        else:
            candidates = [(ref, sha) for ref, sha in _pr_refs(api, repo_id).items() if ref not in prs_before]
        for ref, sha in candidates:
            commits = api.list_repo_commits(repo_id, revision=sha)
            if commits and commits[0].title == message:
                number = ref.rsplit("/", 1)[-1] if ref else None
                return CommitInfo(
                    commit_url=f"{constants.ENDPOINT}/{repo_id}/commit/{sha}", commit_message=message,
                    commit_description="", oid=sha, _endpoint=constants.ENDPOINT,
                    pr_url=f"{constants.ENDPOINT}/{repo_id}/discussions/{number}" if number else None)
    except Exception:
        return None
    return None


def _after_failure(api, repo_id: str, branch_name: str, existed: bool, repo: bool, branch: bool,
                   resumable: bool) -> str:
    """Put back what this push created, and say in which state the repo is left."""
    again = "Run the same command again to finish: what already uploaded is not sent again."
    try:
        if repo and resumable:  # keep it: deleting it would throw the uploaded data away
            return (f"{repo_id} was created by this push and stays empty (no commit) until it finishes. {again} "
                    "Or delete the repo if you give up.")
        if repo:
            api.delete_repo(repo_id)
            return f"The repo {repo_id} that this push created was deleted again."
        if branch:
            api.delete_branch(repo_id, branch=branch_name)
            return (f"{repo_id} is unchanged; the branch {branch_name} that this push created was deleted again."
                    + (f" {again}" if resumable else ""))
    except Exception as e:
        what = f"repo {repo_id}" if repo else f"branch {branch_name} of {repo_id}"
        return f"This push created the {what} and could not delete it again ({_root_cause(e)}); delete it on the Hub."
    if not existed:
        return "Nothing was created on the Hub."
    return f"{repo_id} is unchanged." + (f" {again}" if resumable else "")


def _call(fn, repo_id: str, access: Access, action: str):
    try:
        return fn()
    except Exception as e:
        raise HubError(_explain(e, repo_id, access, action)) from None


# --- errors ------------------------------------------------------------------------------------------
def _http_status(error: BaseException) -> tuple[int | None, str]:
    """(HTTP status, server message) of the first HfHubHTTPError in the exception's chain."""
    from huggingface_hub.errors import HfHubHTTPError

    seen = error
    while seen is not None:
        if isinstance(seen, HfHubHTTPError) and getattr(seen, "response", None) is not None:
            message = getattr(seen, "server_message", None) or seen.response.headers.get("X-Error-Message") or ""
            return seen.response.status_code, message.strip() or str(seen).splitlines()[0]
        seen = seen.__cause__ or seen.__context__
    return None, ""


def _permanent(error: BaseException) -> bool:
    """A 4xx answer (other than timeouts and rate limits) or a malformed request: retrying won't help."""
    status, _ = _http_status(error)
    if status is not None:
        return 400 <= status < 500 and status not in (408, 429)
    return isinstance(error, ValueError)


def _root_cause(error: BaseException | None) -> str:
    while error is not None and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {error}" if error is not None else "unknown error"


def _explain(error: BaseException, repo_id: str, access: Access, action: str) -> str:
    from huggingface_hub import constants

    status, message = _http_status(error)
    if status == 401:
        return (f"the Hub rejected the token while {action} (401 Unauthorized: invalid or expired). Log in again "
                f"with `hf auth login` or set HF_TOKEN ({constants.ENDPOINT}/settings/tokens).")
    if status == 403:
        return (f"{access.user} has no write access to {repo_id} (403 Forbidden while {action}: {message}). "
                f"Use a token with write access to {repo_id.split('/')[0]!r}, or push to {access.user}/"
                f"{repo_id.split('/')[1]}.")
    if status == 404:
        return f"{repo_id} or its branch was not found while {action} (404: {message})."
    return _network_or_http(error, action)


def _network_or_http(error: BaseException, action: str) -> str:
    from huggingface_hub import constants

    status, message = _http_status(error)
    if status is not None:
        return f"the Hub answered {status} while {action}: {message}"
    return f"cannot reach the Hub at {constants.ENDPOINT} while {action} ({_root_cause(error)})"


def _repo_url(repo_id: str, branch: str) -> str:
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/{repo_id}" + (f"/tree/{branch}" if branch != "main" else "")

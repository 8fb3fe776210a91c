"""Publish an artifact directory to the Hub: every check first, then one commit with its model card.

1. Local, no network: the directory is a complete artifact; its validation passed (or
   ``allow_unvalidated``); the model card renders; what esmc-mlx wrote (config.json, validation/,
   the card) holds no token, home directory, absolute path, user or host name.
2. Access, read-only requests: not offline; a token exists (HF_TOKEN or ``hf auth login``); the Hub
   accepts it; it is not read-only; the namespace is the user's or one of their organizations.
3. Create the repo if it is new; create the branch that ``revision`` names if it is new.
4. One ``HfApi.create_commit``: README.md, config, weights, tokenizer, validation/, and the deletion
   of weight shards and validation files the repo holds but this artifact does not (so a re-push
   never mixes shards), on top of the head read in step 2 (``parent_commit``).

``create_commit`` uploads every file first and commits only when all are on the Hub, so a failure
leaves the repo as it was: nothing is committed. Files that did reach the Hub are not sent again
by the next push. Only huggingface_hub's public API is used (``HfApi`` methods, the public
``CommitOperationAdd/Delete``, the exceptions of ``huggingface_hub.errors``), so its settings apply:
HF_ENDPOINT, HF_TOKEN or the stored login, HF_HUB_OFFLINE, Xet storage when hf_xet is installed.

Why not ``upload_folder``: with hf_xet installed (huggingface_hub's default) it runs a pipelined
upload that commits a large folder in several batches, and it opens pull requests only against
main; a failed run could leave half an artifact published. An artifact is a handful of files (the
6B in bf16 is about 20), far below one commit's limits.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import time
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, get_token, is_offline_mode
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from .._version import __version__
from ..artifact import (
    CARD_FILE,
    REPORT_DIR,
    ArtifactKind,
    artifact_kind,
    human_size,
    plural,
    precision_label,
    published_files,
)
from ..errors import ConvertError, EsmcMlxError, HubError
from ..finetune import check_adapter_base
from ..finetune import render_card as render_adapter_card
from ..fold_artifact import FOLD
from ..outputs import add_to_marker, atomic_file, locked, read_marker
from ..privacy import find_tokens, private_findings
from ..readers import read_json
from .card import MARKER, Validation, base_model_of, read_validation, render_card, render_fold_card, render_sae_card
from .repo_id import check_repo_id

# What an adapter's push reports for validation: it has none of the model's kind.
ADAPTER_VALIDATION = Validation("missing", problem="an adapter; its card holds its training metrics")
ATTEMPTS = 3  # tries of the whole commit on a transient failure (the client also retries each request)
RETRY_WAITS = (5.0, 20.0)  # seconds before the 2nd and the 3rd attempt
# Paths a push owns in the repo: deleted there when the artifact no longer has them.
OWNED_PATTERNS = ("model*.safetensors", "model.safetensors.index.json", "layer_*.safetensors", "validation/*")
SNIFF_BYTES = 8192  # a file holding a NUL byte in its first 8 KiB is binary (git's own test)


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
    loader: str = "load"  # the esmc_mlx function that loads it (load_sae, load_adapter, load_fold for those kinds)
    hub_checked: bool = True  # False: a dry run that did not ask the Hub (offline, no token)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def summary(self) -> str:
        size = f"{plural(len(self.files), 'file')}, {human_size(self.total_bytes)}"
        where = self.repo_id + (f" (branch {self.revision})" if self.revision != "main" else "")
        if self.dry_run and not self.hub_checked:
            lines = [f"Dry run, without the Hub: nothing was uploaded. A push to {where} would send:"]
            lines += [f"  + {path} ({human_size(n)})" for path, n in self.files]
        elif self.dry_run:
            lines = [f"Dry run: nothing was uploaded. A push would {'create' if self.created else 'update'} {where}:"]
            lines += [f"  + {path} ({human_size(n)})" for path, n in self.files]
            lines += [f"  - {path} (in the repo, not in the artifact)" for path in self.deletions]
        elif self.unchanged:
            lines = [f"Nothing to push: {where} already holds this artifact (commit {self.commit_oid[:12]})."]
        elif self.pr_url:
            lines = [f"Opened a pull request on {where}: {self.pr_url}", f"  commit {self.commit_url}, {size}"]
        else:
            lines = [
                f"{'Created' if self.created else 'Updated'} {where}: {self.url}",
                f"  commit {self.commit_url}, {size}"
                + (f", {len(self.deletions)} stale files removed" if self.deletions else ""),
            ]
        lines.append(f"  validation: {self.validation.headline()}")
        lines.append("  model card: " + ("generated README.md" if self.card_generated else "your README.md (kept)"))
        lines += [f"  note: {n}" for n in self.notes]
        if not self.dry_run and not self.pr_url:
            lines.append(f'  load it: esmc_mlx.{self.loader}("{self.repo_id}")')
        return "\n".join(lines)


# --- local checks -----------------------------------------------------------------------------------
def publishing_kind(model_dir: Path) -> ArtifactKind:
    """The kind of artifact ``model_dir`` holds (``artifact.artifact_kind``: its marker's, else
    the kind that recognises it); HubError for a folder that holds none."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise HubError(f"{model_dir}: no such directory")
    marker = read_marker(model_dir)
    try:
        kind = artifact_kind(model_dir, marker["kind"] if marker is not None else None)
    except ConvertError as e:
        raise HubError(str(e)) from None
    if not (model_dir / kind.config).is_file():
        raise HubError(f"{model_dir}: no {kind.config}; is this an esmc-mlx output directory?")
    return kind


def artifact_files(model_dir: Path, include=()) -> list[tuple[str, int]]:
    """The files a push uploads, as (posix path relative to the directory, size): what the
    artifact is made of (its kind's files: a model's config, index, weights and tokenizer
    files; an SAE's config and layer files; an adapter's config, weights, head and metrics),
    its card and validation report (``artifact.published_files``), and the files ``include``
    names; nothing else the folder holds. HubError for an incomplete artifact, or a file that
    leads out of the folder."""
    model_dir = Path(model_dir)
    kind = publishing_kind(model_dir)
    try:
        list(kind.files(model_dir))
    except EsmcMlxError as e:
        raise HubError(f"incomplete artifact, refusing to push: {e}") from None
    try:
        names = published_files(model_dir, kind, include)
    except ConvertError as e:
        raise HubError(f"refusing to push {model_dir}: {e}") from None
    return [(name, (model_dir / name).stat().st_size) for name in names]


def check_validation(model_dir: Path, repo_id: str, allow_unvalidated: bool) -> Validation:
    """The artifact's validation; raises HubError when it is missing or failed, unless allowed."""
    validation = read_validation(model_dir)
    if validation.passed or allow_unvalidated:
        return validation
    try:
        meta = read_json(Path(model_dir) / "config.json", HubError).get("esmc_mlx") or {}
    except (HubError, AttributeError):
        meta = {}
    reference = base_model_of(meta) or (meta.get("source") or {}).get("id") or "SOURCE"
    revalidate = f"esmc-mlx validate {model_dir} --reference {reference}"
    if publishing_kind(model_dir).name == "sae":
        revalidate = f"esmc-mlx quantize-sae {reference} -o {model_dir} --q SPEC --model MODEL --force"
    anyway = f"esmc-mlx push {model_dir} {repo_id} --allow-unvalidated"
    if validation.state == "failed":
        report = Path(model_dir) / REPORT_DIR / "report.md"
        raise HubError(
            f"refusing to push {model_dir}: {validation.problem}.\n"
            f"See {report if report.exists() else report.with_name('report.json')}. "
            f"To publish it anyway (its model card will say that validation FAILED):\n  {anyway}"
        )
    raise HubError(
        f"refusing to push {model_dir}: it is not validated ({validation.problem}).\n"
        f"Validate it first:\n  {revalidate}\n"
        f'or publish it anyway (its model card will say "not validated"):\n  {anyway}'
    )


def check_private(
    model_dir: Path,
    files: list[str],
    ours: set[str],
    card: str | None,
    tokens: list[str],
    texts: dict[str, str] | None = None,
) -> None:
    """Refuse to send any of ``files`` (paths in ``model_dir``) that holds an access token (the
    ones in use, or anything shaped like one), a binary file's bytes and a weight file's header
    included; and a text file of the artifact's own (``ours``: config, tokenizer files, the
    validation report), the generated ``card`` or the commit's ``texts`` that holds the home
    directory, an absolute path, the user or the host name."""
    for name in files:
        path = Path(model_dir) / name
        text, binary = _readable_text(path)
        written = name in ours and name != CARD_FILE and not binary  # (a plot's bytes are no path)
        found = (
            private_findings(text, tokens) if written else (["an access token"] if find_tokens(text, tokens) else [])
        )
        if found:
            fix = (
                "run `esmc-mlx validate` again to rewrite it"
                if name.startswith(f"{REPORT_DIR}/")
                else "convert again with this esmc-mlx, or edit the file"
                if name == "config.json"
                else "edit the file, or leave it out"
            )
            raise HubError(
                f"refusing to push {model_dir}: {name} holds {' and '.join(found)}, which must not leave "
                f"this machine; {fix}."
            )
    if card is not None and (found := private_findings(card, tokens)):
        raise HubError(
            f"refusing to push {model_dir}: the model card would hold {' and '.join(found)}; edit or delete README.md."
        )
    for what, text in (texts or {}).items():
        if found := private_findings(text, tokens):
            raise HubError(f"refusing to push {model_dir}: the {what} would hold {' and '.join(found)}.")


def _readable_text(path: Path) -> tuple[str, bool]:
    """What of ``path`` a reader could take for text: all of a text file; the header of a
    safetensors file (its metadata is free text); the bytes of any other binary file, as Latin-1.
    And whether the file is binary."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
        if path.suffix == ".safetensors" and len(head) >= 8:
            length = int.from_bytes(head[:8], "little")
            f.seek(8)
            return f.read(min(length, 100_000_000)).decode("latin-1"), True
        rest = f.read()
    data = head + rest
    binary = b"\0" in head
    return (data.decode("latin-1") if binary else data.decode("utf-8", errors="replace")), binary


def _check_card(card: str, readme: Path) -> None:
    try:
        ModelCard(card, ignore_metadata_errors=False)
    except Exception as e:
        raise HubError(f"{readme}: the model card does not parse ({e}); fix or delete it") from None


# --- access -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Access:
    """Who is pushing, established with read-only requests."""

    api: HfApi  # bound to the token
    user: str
    orgs: dict[str, str | None]  # organization -> role in it


def check_push_access(repo_id: str, token: str | None = None) -> Access:
    """Everything about the token and the namespace that can be known without writing anything.

    Raises HubError when offline mode is on, no token is set, the Hub rejects the token, the token is
    read-only, or ``repo_id``'s namespace is neither the user's nor one of their organizations (saying
    whose repo it is when it exists). ``esmc-convert --upload-repo`` calls it before converting.
    """
    check_repo_id(repo_id)
    api = HfApi(token=token)
    tokens_url = f"{api.endpoint}/settings/tokens"
    if is_offline_mode():
        raise HubError(
            f"cannot push to {repo_id}: offline mode is on (HF_HUB_OFFLINE is set). "
            "Unset it, or set HF_HUB_OFFLINE=0, to publish."
        )
    if not (token or get_token()):
        raise HubError(
            f"cannot push to {repo_id}: no Hugging Face token. Log in with `hf auth login` or set "
            f"HF_TOKEN to a token with write access ({tokens_url})."
        )
    try:
        me = api.whoami()
    except Exception as e:
        if _status(e) == 401:
            raise HubError(
                f"cannot push to {repo_id}: the Hub rejected the token (401 Unauthorized: invalid or "
                f"expired). Log in again with `hf auth login` or set HF_TOKEN ({tokens_url})."
            ) from None
        raise HubError(f"cannot push to {repo_id}: {_describe(e, api, 'checking the token')}") from None
    user = me.get("name") or "?"
    role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
    orgs = {o.get("name"): o.get("roleInOrg") for o in me.get("orgs") or [] if isinstance(o, dict)}
    if role == "read":
        raise HubError(
            f"cannot push to {repo_id}: the token of {user} is read-only. Create a token with write "
            f"access ({tokens_url}) and log in with it (`hf auth login`) or set HF_TOKEN."
        )
    namespace, name = repo_id.split("/")
    if namespace != user and namespace not in orgs:
        try:
            exists = bool(api.repo_exists(repo_id))
        except Exception:
            exists = False
        whose = (
            f"{repo_id} already exists and belongs to {namespace!r}"
            if exists
            else f"{namespace!r} is not your user name"
        )
        member = f" or one of your organizations ({', '.join(sorted(orgs))})" if orgs else ""
        raise HubError(
            f"cannot push to {repo_id} as {user}: {whose}, and you can only write under {user!r}"
            f"{member}. Push to {user}/{name}, or ask an admin of {namespace!r} for write access."
        )
    if orgs.get(namespace) == "read":
        raise HubError(
            f"cannot push to {repo_id}: {user} has the read role in {namespace!r}; ask one of its "
            "admins for write access."
        )
    return Access(api, user, orgs)


# --- push -------------------------------------------------------------------------------------------
# A push reads the artifact's files while it uploads them and writes its card there: it holds the
# artifact's lock, as its writers do, so that no conversion replaces the files mid-upload.
@locked("model_dir", when=lambda args: args["hold_lock"] and not args["dry_run"], create_parent=False, optional=True)
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
    hold_lock: bool = True,
    include=(),
) -> PushResult:
    """Publish the artifact ``model_dir`` to the model repo ``repo_id`` in one commit.

    Uploads what the artifact is made of (``artifact_files``) and the files ``include`` names in
    ``model_dir``; nothing else there. Writes README.md (the generated model card) into
    ``model_dir`` unless a hand-written one is there (no esmc-mlx marker line). ``revision`` is
    the branch to commit to (created from main if new); ``create_pr`` opens a pull request
    against it instead. ``private`` applies when the repo
    is created. ``dry_run`` makes every check, including the read-only Hub ones, and returns what a
    push would upload, without writing anything anywhere.

    Raises HubError, before any upload, for an incomplete artifact, a missing or failed validation
    (unless ``allow_unvalidated``), a file leading out of ``model_dir``, an access token in any
    file it would send, private data in the files esmc-mlx wrote, offline mode, a
    missing, invalid or read-only token, or a namespace the user cannot write to; after uploads
    start, when the commit fails (with what the Hub said, the repo and the branch). On failure
    nothing is committed; a branch this call created is deleted again, and so is a repo it created
    unless the failure looked transient (then the repo stays, empty, so that running the push again
    resumes; the message says which). OutputError, before anything, when another esmc-mlx run is
    writing ``model_dir``; ``hold_lock=False`` for a caller that holds its lock already.
    """
    model_dir = Path(model_dir)
    check_repo_id(repo_id)
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):  # never main in its place
        raise HubError(f"--revision {revision!r}: give the branch to commit to (or leave the option out for main)")
    branch = revision or "main"
    # The artifact's kind says what it is made of, its card and how it loads; an adapter has no
    # validation report (its card holds its metrics) and must name its base.
    kind = publishing_kind(model_dir)
    sae, adapter, fold = kind.name == "sae", kind.name == "adapter", kind.name == FOLD.name
    if adapter:
        check_adapter_base(model_dir)
    files = artifact_files(model_dir, include)
    validation = ADAPTER_VALIDATION if adapter else check_validation(model_dir, repo_id, allow_unvalidated)
    readme = model_dir / CARD_FILE
    generated = not (readme.is_file() and MARKER not in readme.read_text(errors="replace"))
    render = render_sae_card if sae else render_adapter_card if adapter else render_fold_card if fold else render_card
    card = render(model_dir, repo_id) if generated else readme.read_text(errors="replace")
    _check_card(card, readme)
    config = read_json(model_dir / kind.config, HubError)
    if not isinstance(config, dict):
        raise HubError(f"{model_dir / kind.config}: not a JSON object")
    meta = config.get("esmc_mlx") if isinstance(config.get("esmc_mlx"), dict) else {}
    description = "\n".join(
        filter(
            None,
            [
                f"Converted with: `{meta['command']}`" if isinstance(meta.get("command"), str) else None,
                f"Validation: {validation.headline()}",
                f"Pushed with esmc-mlx {__version__}",
            ],
        )
    )
    ours = {name for name, _ in artifact_files(model_dir)}
    check_private(
        model_dir,
        [name for name, _ in files],
        ours,
        card if generated else None,
        [t for t in (token, get_token()) if t],
        {"commit message": commit_message or "", "commit description": description},
    )
    if generated and not any(path == CARD_FILE for path, _ in files):
        files = sorted([*files, (CARD_FILE, len(card.encode()))])
    if dry_run and (is_offline_mode() or not (token or get_token())):
        return _local_preview(repo_id, branch, files, card, generated, validation)

    access = check_push_access(repo_id, token)
    api = access.api
    exists = _repo_exists(api, repo_id)
    head = _branch_head(api, repo_id, branch) if exists else None
    if revision and create_pr and head is None:
        raise HubError(f"cannot open a pull request against {repo_id}@{branch}: no such branch")
    local = {path for path, _ in files}
    remote = _remote_files(api, repo_id, head) if head else []
    deletions = sorted(p for p in remote if p not in local and any(fnmatch.fnmatch(p, pat) for pat in OWNED_PATTERNS))
    url = f"{api.endpoint}/{repo_id}" + (f"/tree/{branch}" if branch != "main" else "")
    result = PushResult(
        repo_id, url, branch, files, deletions, card, generated, validation, dry_run=dry_run, created=not exists
    )
    result.loader = "load_sae" if sae else "load_adapter" if adapter else "load_fold" if fold else "load"
    if not generated:
        result.notes.append("README.md has no esmc-mlx marker line, so it was published as written")
    if not validation.passed and not adapter:
        result.notes.append(f"published with --allow-unvalidated: the card says {validation.headline()}")
    if exists and head is None and not create_pr:
        result.notes.append(f"branch {branch} is new: it starts from main")
    if dry_run:
        return result

    if adapter:
        what = f"LoRA adapter on {meta['base']['repo_id']}"
    elif fold:
        what = f"ESMFold2, ESMC backbone {precision_label(config)}"
    else:
        what = f"ESMC {'sparse autoencoders, ' if sae else ''}{precision_label(config)}"
    message = commit_message or (
        f"{'Update' if exists else 'Upload'} {repo_id.split('/')[1]}: {what} for MLX (esmc-mlx {__version__})"
    )
    if generated:
        with atomic_file(readme) as f:
            f.write(card)
        add_to_marker(model_dir, CARD_FILE)
    created_repo = created_branch = False
    try:
        if not exists:
            created_repo = result.created = _create_repo(access, repo_id, private)
        if head is None and branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
            created_branch = True
        if head is None:
            head = _branch_head(api, repo_id, branch)

        def operations() -> list:  # fresh objects per attempt: create_commit consumes them
            return [CommitOperationDelete(path_in_repo=p) for p in deletions] + [
                CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(model_dir / p)) for p, _ in files
            ]

        oid, commit_url, pr_url = _commit(api, repo_id, operations, message, description, branch, create_pr, head)
    except Exception as error:  # (Ctrl-C is not one: it leaves everything as it is for a re-run to resume)
        transient = not _permanent(error)
        what = str(error) if isinstance(error, HubError) else _describe(error, api, "pushing", access.user, repo_id)
        state = _after_failure(api, repo_id, branch, exists, created_repo, created_branch, keep_repo=transient)
        raise HubError(f"push to {repo_id}@{branch} failed: {what} Nothing was committed; {state}") from None
    result.commit_oid, result.commit_url, result.pr_url = oid, commit_url, pr_url
    result.unchanged = oid == head and not pr_url
    return result


def _local_preview(repo_id, branch, files, card, generated, validation) -> PushResult:
    """A dry run without the Hub (offline mode, or no token): the card and the files, from the
    artifact alone; what the repo holds (so what a push would delete, or whether it would create
    the repo) is left unknown, and the access checks are left to the push."""
    from huggingface_hub import constants

    url = f"{constants.ENDPOINT.rstrip('/')}/{repo_id}"
    result = PushResult(repo_id, url, branch, files, [], card, generated, validation, dry_run=True, hub_checked=False)
    why = "offline mode is on (HF_HUB_OFFLINE)" if is_offline_mode() else "no Hugging Face token is set"
    result.notes.append(
        f"the Hub was not asked ({why}): the token, the namespace and the files the repo already holds are "
        "checked by the push itself"
    )
    if not validation.passed:
        result.notes.append(f"published with --allow-unvalidated: the card says {validation.headline()}")
    return result


# --- steps ------------------------------------------------------------------------------------------
def _repo_exists(api: HfApi, repo_id: str) -> bool:
    try:
        api.repo_info(repo_id)
    except RepositoryNotFoundError:
        return False
    except Exception as e:
        raise HubError(f"cannot push to {repo_id}: {_describe(e, api, 'looking the repo up')}") from None
    return True


def _branch_head(api: HfApi, repo_id: str, branch: str) -> str | None:
    try:
        return api.repo_info(repo_id, revision=branch).sha
    except RevisionNotFoundError:
        return None
    except Exception as e:
        raise HubError(f"cannot push to {repo_id}: {_describe(e, api, f'looking up branch {branch}')}") from None


def _remote_files(api: HfApi, repo_id: str, commit: str) -> list[str]:
    from huggingface_hub import RepoFile

    try:
        return [f.path for f in api.list_repo_tree(repo_id, recursive=True, revision=commit) if isinstance(f, RepoFile)]
    except Exception as e:
        raise HubError(f"cannot push to {repo_id}: {_describe(e, api, 'listing its files')}") from None


def _create_repo(access: Access, repo_id: str, private: bool) -> bool:
    """Create the repo; False when it appeared meanwhile (409: someone else's, never deleted by us)."""
    try:
        access.api.create_repo(repo_id, private=private, exist_ok=False)
        return True
    except Exception as e:
        status = _status(e)
        if status == 409:
            return False
        if status in (401, 403):
            raise HubError(
                f"the Hub refused to create {repo_id} for {access.user} ({status}: {_server_message(e)}). "
                f"The token needs write access to {repo_id.split('/')[0]!r}; fine-grained tokens "
                "need the repo-creation permission for that namespace."
            ) from None
        raise HubError(f"cannot create {repo_id}: {_describe(e, access.api, 'creating the repo')}") from None


def _commit(
    api: HfApi, repo_id: str, operations, message: str, description: str, branch: str, create_pr: bool, head: str | None
) -> tuple[str, str, str | None]:
    """One ``create_commit`` (it uploads every file, then commits), tried ATTEMPTS times while the
    failure looks transient; a commit whose answer was lost is recognised, not made twice.
    Returns (commit id, commit URL, pull-request URL or None)."""
    prs_before = _pr_refs(api, repo_id) if create_pr else None
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(RETRY_WAITS[min(attempt - 1, len(RETRY_WAITS) - 1)])
            landed = _landed(api, repo_id, branch, head, message, prs_before)
            if landed:
                return landed
        try:
            info = api.create_commit(
                repo_id,
                operations=operations(),
                commit_message=message,
                commit_description=description,
                revision=branch,
                create_pr=create_pr,
                parent_commit=None if create_pr else head,
            )
            return info.oid, info.commit_url, info.pr_url
        except Exception as e:
            if _status(e) == 412:
                raise HubError(f"{repo_id}@{branch} changed while this push ran (someone else committed).") from None
            if _permanent(e) or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _pr_refs(api: HfApi, repo_id: str) -> dict[str, str]:
    try:
        refs = api.list_repo_refs(repo_id, include_pull_requests=True)
        return {r.ref: r.target_commit for r in refs.pull_requests or []}
    except Exception:
        return {}


def _landed(
    api: HfApi, repo_id: str, branch: str, head: str | None, message: str, prs_before: dict[str, str] | None
) -> tuple[str, str, str | None] | None:
    """The commit this push made if the Hub has it although the request failed (the answer was lost),
    else None. ``prs_before``: the pull-request refs before the commit, or None when not opening one."""
    try:
        if prs_before is None:
            sha = api.repo_info(repo_id, revision=branch).sha
            candidates = [(None, sha)] if sha != head else []
        else:
            candidates = [(ref, sha) for ref, sha in _pr_refs(api, repo_id).items() if ref not in prs_before]
        for ref, sha in candidates:
            commits = api.list_repo_commits(repo_id, revision=sha)
            if commits and commits[0].title == message:
                pr_url = f"{api.endpoint}/{repo_id}/discussions/{ref.rsplit('/', 1)[-1]}" if ref else None
                return sha, f"{api.endpoint}/{repo_id}/commit/{sha}", pr_url
    except Exception:
        return None
    return None


def _after_failure(
    api: HfApi, repo_id: str, branch: str, existed: bool, repo: bool, created_branch: bool, keep_repo: bool
) -> str:
    """Put back what this push created, and say in which state the repo is left. ``keep_repo``: the
    failure looked transient, so a repo this push created stays for the next run to resume."""
    again = " Run the same command again to finish: files that reached the Hub are not sent again." if keep_repo else ""
    try:
        if repo and keep_repo:
            return f"{repo_id}, created by this push, stays empty (no commit of it).{again} Or delete the repo."
        if repo:
            api.delete_repo(repo_id)
            return f"the repo {repo_id} that this push created was deleted again."
        if created_branch:
            api.delete_branch(repo_id, branch=branch)
            return f"{repo_id} is unchanged (the branch {branch} that this push created was deleted again).{again}"
    except Exception as e:
        what = f"repo {repo_id}" if repo else f"branch {branch} of {repo_id}"
        return f"this push created the {what} and could not delete it again ({_root_cause(e)}); delete it on the Hub."
    if not existed:
        return "nothing was created on the Hub."
    return f"{repo_id} is unchanged.{again}"


# --- errors -----------------------------------------------------------------------------------------
def _http_error(error: BaseException) -> HfHubHTTPError | None:
    """The first HfHubHTTPError in the exception's chain (the client wraps some, e.g. an LFS upload's)."""
    seen = error
    while seen is not None:
        if isinstance(seen, HfHubHTTPError) and seen.response is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _status(error: BaseException) -> int | None:
    http = _http_error(error)
    return http.response.status_code if http is not None else None


def _server_message(error: BaseException) -> str:
    http = _http_error(error)
    if http is None:
        return ""
    message = http.server_message or http.response.headers.get("X-Error-Message") or str(http)
    return message.strip().splitlines()[0]


def _permanent(error: BaseException) -> bool:
    """A 4xx answer (other than timeouts and rate limits), a refusal of ours, or a malformed request:
    retrying won't help."""
    if isinstance(error, HubError):
        return True
    status = _status(error)
    if status is not None:
        return 400 <= status < 500 and status not in (408, 429)
    return isinstance(error, ValueError)


def _root_cause(error: BaseException) -> str:
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {error}"


def _describe(
    error: BaseException, api: HfApi, action: str, user: str | None = None, repo_id: str | None = None
) -> str:
    """What went wrong, in one sentence: what the client said (it names the file of a failed
    upload), the HTTP status and the Hub's message, or the network error."""
    status = _status(error)
    said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if status == 401:
        return (
            f"the Hub rejected the token while {action} (401 Unauthorized: invalid or expired). Log in again "
            f"with `hf auth login` or set HF_TOKEN ({api.endpoint}/settings/tokens)."
        )
    if status == 403 and user and repo_id:
        return (
            f"{user} has no write access to {repo_id} (403 Forbidden while {action}: {_server_message(error)}). "
            f"Use a token with write access to {repo_id.split('/')[0]!r}, or push to {user}/"
            f"{repo_id.split('/')[1]}."
        )
    if status is not None:
        http = _http_error(error)
        detail = _server_message(error) if http is error else f"{said.rstrip('.')} ({status}: {_server_message(error)})"
        return f"the Hub answered {status} while {action}: {detail}."
    cause = _root_cause(error)
    detail = said if cause.endswith(said) else f"{said.rstrip('.')} ({cause})"
    return f"cannot reach the Hub at {api.endpoint} while {action}: {detail}."

"""A small Hugging Face Hub look-alike on 127.0.0.1, for tests that drive the real client.

It answers what ``huggingface_hub``'s public calls used by esmc-mlx send: ``whoami``,
``create_repo`` / ``delete_repo``, ``repo_info``, ``list_repo_tree``, ``list_repo_refs``,
``list_repo_commits``, ``create_branch`` / ``delete_branch``, ``create_commit`` (preupload, LFS
batch and PUT, the NDJSON commit, the README metadata check) and downloads (HEAD/GET
``resolve``), with the status codes, ``X-Error-Code`` headers and JSON bodies the client
interprets. Storage is in memory. File ids are git blob ids (the client compares them with its
own to skip unchanged files); LFS objects are stored by sha256.

Not implemented: Xet storage (run the client with ``HF_HUB_DISABLE_XET=1``; it then uses classic
LFS), multipart LFS, gated repos, discussions beyond PR refs, pagination, Range requests.

Users, tokens and faults are set on ``server.state`` (``server.reset()`` starts a fresh one)::

    server = HubServer().start()
    server.state.add_user("alice", token="hf_alice", orgs=["my-org"])
    server.state.faults.fail_lfs_puts = 2  # the next two LFS uploads fail (524)
    ...  # point HF_ENDPOINT at server.url before importing huggingface_hub
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import fnmatch
import hashlib
import itertools
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

# The Hub's default .gitattributes: its LFS patterns decide "lfs" in preupload.
LFS_PATTERNS = (
    "*.bin",
    "*.gz",
    "*.h5",
    "*.msgpack",
    "*.npy",
    "*.npz",
    "*.onnx",
    "*.pt",
    "*.pth",
    "*.safetensors",
    "*.tar",
    "*.zip",
    "*.zst",
    "*tfevents*",
)
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()
REGULAR_MAX_BYTES = 10 * 1024 * 1024
_counter = itertools.count()


def git_blob_oid(content: bytes) -> str:
    return hashlib.sha1(f"blob {len(content)}\0".encode() + content).hexdigest()


@dataclasses.dataclass(frozen=True)
class Blob:
    """One file of a commit: inline content (regular) or an LFS object."""

    size: int
    oid: str  # git blob id of a regular file; sha256 of an LFS object
    content: bytes | None = None  # regular files only

    @classmethod
    def regular(cls, content: bytes) -> Blob:
        return cls(len(content), git_blob_oid(content), content=content)

    @classmethod
    def lfs(cls, sha256: str, size: int) -> Blob:
        return cls(size, sha256)

    @property
    def is_lfs(self) -> bool:
        return self.content is None


@dataclasses.dataclass
class Commit:
    sha: str
    parent: str | None
    files: dict[str, Blob]
    title: str
    message: str
    date: str

    @classmethod
    def make(cls, parent: Commit | None, files: dict[str, Blob], title: str, message: str = "") -> Commit:
        listing = json.dumps(
            [parent.sha if parent else None, sorted((p, b.oid) for p, b in files.items()), title, next(_counter)]
        )
        return cls(
            hashlib.sha1(listing.encode()).hexdigest(),
            parent.sha if parent else None,
            dict(files),
            title,
            message,
            _now(),
        )


@dataclasses.dataclass
class Repo:
    id: str
    private: bool
    refs: dict[str, str] = dataclasses.field(default_factory=dict)  # "main", "dev", "refs/pr/1" -> sha
    commits: dict[str, Commit] = dataclasses.field(default_factory=dict)
    lfs: dict[str, bytes] = dataclasses.field(default_factory=dict)  # sha256 -> content
    pr_count: int = 0

    @property
    def namespace(self) -> str:
        return self.id.split("/")[0]

    def resolve(self, revision: str) -> Commit | None:
        sha = self.refs.get(revision.removeprefix("refs/heads/"), revision)
        return self.commits.get(sha)

    def history(self, revision: str) -> list[Commit]:
        out, commit = [], self.resolve(revision)
        while commit is not None:
            out.append(commit)
            commit = self.commits.get(commit.parent) if commit.parent else None
        return out


@dataclasses.dataclass
class Token:
    user: str
    role: str = "write"  # "write", "read", or "fineGrained" (a fine-grained token without write scopes)


@dataclasses.dataclass
class Faults:
    """Failure injection; counters are decremented as faults fire."""

    # An LFS PUT that fails answers 524 (a proxy timeout, as Cloudflare says it): transient for esmc-mlx,
    # which retries, but not in the client's own retry list (it would wait 1+2+4+8+8 s first).
    fail_lfs_puts: int = 0  # the next N LFS PUTs (all of them if negative) fail, nothing stored
    fail_lfs_oids: set[str] = dataclasses.field(default_factory=set)  # every PUT of these sha256s fails
    fail_commits: int = 0  # the next N commit requests answer 500 without committing
    reject_commits: int = 0  # the next N commit requests answer 422 (a refusal: retrying won't help)
    drop_commit_responses: int = 0  # the next N commits succeed, but the connection closes before the answer


class HubState:
    """Everything the server knows; safe to inspect and change from the test thread."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.users: dict[str, list[str]] = {}  # user -> orgs (with write access)
        self.tokens: dict[str, Token] = {}
        self.repos: dict[str, Repo] = {}
        self.faults = Faults()
        self.log: list[tuple[str, str, int]] = []  # (method, path, status)
        self.received: list[bytes] = []  # every request's target and body, as sent
        self.uploads: dict[str, tuple[str, str, int]] = {}  # upload signature -> (repo id, sha256, size)
        self.lfs_puts: list[str] = []  # sha256 of every LFS PUT that was stored

    def add_user(self, name: str, token: str | None = None, role: str = "write", orgs: tuple[str, ...] = ()) -> None:
        with self.lock:
            self.users[name] = list(orgs)
            if token:
                self.tokens[token] = Token(name, role)

    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        """Server-side creation (as the Hub does it: one initial commit with .gitattributes)."""
        with self.lock:
            repo = Repo(repo_id, private)
            initial = Commit.make(None, {".gitattributes": Blob.regular(GITATTRIBUTES)}, "initial commit")
            repo.commits[initial.sha] = initial
            repo.refs["main"] = initial.sha
            self.repos[repo_id] = repo
            return repo

    def commit_files(self, repo_id: str, files: dict[str, bytes], title: str = "add files") -> str:
        """Server-side commit to main for test setup (LFS-pattern files are stored in LFS)."""
        with self.lock:
            repo = self.repos[repo_id]
            parent = repo.resolve("main")
            tree = dict(parent.files)
            for path, content in files.items():
                if _is_lfs(path, content, len(content)):
                    sha = hashlib.sha256(content).hexdigest()
                    repo.lfs[sha] = content
                    tree[path] = Blob.lfs(sha, len(content))
                else:
                    tree[path] = Blob.regular(content)
            commit = Commit.make(parent, tree, title)
            repo.commits[commit.sha] = commit
            repo.refs["main"] = commit.sha
            return commit.sha

    def stored_bytes(self) -> list[bytes]:
        """Every byte the Hub holds: file contents, LFS objects, commit titles and messages."""
        with self.lock:
            out = []
            for repo in self.repos.values():
                out += list(repo.lfs.values())
                for commit in repo.commits.values():
                    out += [commit.title.encode(), commit.message.encode()]
                    out += [b.content for b in commit.files.values() if b.content is not None]
            return out


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def _is_lfs(path: str, sample: bytes, size: int) -> bool:
    if size > REGULAR_MAX_BYTES or b"\0" in sample or any(fnmatch.fnmatch(path, p) for p in LFS_PATTERNS):
        return True
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as e:  # a multi-byte character cut by the 512-byte sample is still text
        return e.start < len(sample) - 4
    return False


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _Drop(Exception):
    """Close the connection without answering (a network failure, as the client sees it)."""


# --- HTTP -----------------------------------------------------------------------------------
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hub-test/1.0"

    def log_message(self, format, *args):  # quiet
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    @property
    def state(self) -> HubState:
        return self.server.state

    def _read_body(self) -> bytes:  # the client sends Content-Length (files too), never chunks
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.method, self.body = method, self._read_body()
        self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.segments = [unquote(s) for s in url.path.split("/")[1:]]
        with self.state.lock:
            self.state.received.append(self.path.encode() + b"\n" + self.body)
        try:
            status, headers, payload = self._route()
        except _Drop:
            self._record(url.path, 0)
            self.close_connection = True
            return
        except HttpError as e:
            status, headers, payload = e.status, {"X-Error-Message": e.message}, {"error": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
        self._record(url.path, status)
        if isinstance(payload, (dict, list)):
            data, headers = json.dumps(payload).encode(), {"Content-Type": "application/json", **headers}
        else:
            data = payload or b""
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)

    def _record(self, path: str, status: int) -> None:
        with self.state.lock:
            self.state.log.append((self.method, path, status))

    @property
    def base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def _json(self) -> dict:
        try:
            return json.loads(self.body or b"{}")
        except json.JSONDecodeError:
            raise HttpError(400, "body is not JSON") from None

    # auth
    def _token(self, required: bool) -> Token | None:
        header = self.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            if required:
                raise HttpError(401, "Invalid username or password.")
            return None
        token = self.state.tokens.get(header[7:].strip())
        if token is None:
            raise HttpError(401, "Invalid credentials in Authorization header")
        return token

    def _member(self, token: Token, namespace: str) -> bool:
        return namespace == token.user or namespace in self.state.users.get(token.user, [])

    def _repo(self, repo_id: str, write: bool = False) -> Repo:
        token = self._token(required=write)
        repo = self.state.repos.get(repo_id)
        if repo is None or (repo.private and not (token and self._member(token, repo.namespace))):
            raise HttpError(401 if token is None else 404, "Repository not found", "RepoNotFound")
        if write and not (token.role == "write" and self._member(token, repo.namespace)):
            why = (
                "your token is read-only"
                if token.role == "read"
                else (
                    "this fine-grained token has no write access to it"
                    if token.role == "fineGrained"
                    else f"{token.user} is not a member of {repo.namespace!r}"
                )
            )
            raise HttpError(403, f"You don't have write access to {repo_id}: {why}.")
        return repo

    def _commit_at(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    # routing
    def _route(self):
        s, m = self.segments, self.method
        if s[:1] == ["lfs-upload"] and len(s) == 2 and m == "PUT":
            return self._lfs_put(s[1])
        with self.state.lock:
            if s[:2] == ["api", "whoami-v2"] and m == "GET":
                return self._whoami()
            if s[:3] == ["api", "repos", "create"] and m == "POST":
                return self._create_repo()
            if s[:3] == ["api", "repos", "delete"] and m == "DELETE":
                return self._delete_repo()
            if s[:2] == ["api", "validate-yaml"] and m == "POST":
                return self._validate_yaml()
            if len(s) >= 4 and s[:2] == ["api", "models"]:
                repo_id, rest = f"{s[2]}/{s[3]}", s[4:]
                action, arg = (rest[0], "/".join(rest[1:])) if rest else ("", "")
                routes = {
                    ("", "GET"): lambda: self._info(repo_id, "main"),
                    ("revision", "GET"): lambda: self._info(repo_id, arg),
                    ("tree", "GET"): lambda: self._tree(repo_id, rest[1], "/".join(rest[2:])),
                    ("refs", "GET"): lambda: self._refs(repo_id),
                    ("commits", "GET"): lambda: self._commits(repo_id, arg),
                    ("preupload", "POST"): lambda: self._preupload(repo_id, arg),
                    ("commit", "POST"): lambda: self._commit(repo_id, arg),
                    ("branch", "POST"): lambda: self._branch(repo_id, arg),
                    ("branch", "DELETE"): lambda: self._branch(repo_id, arg),
                }
                if (action, m) in routes:
                    return routes[action, m]()
            if len(s) == 6 and s[1].endswith(".git") and s[2:] == ["info", "lfs", "objects", "batch"] and m == "POST":
                return self._lfs_batch(f"{s[0]}/{s[1][:-4]}")
            if len(s) >= 5 and s[2] == "resolve" and m in ("GET", "HEAD"):
                return self._resolve(f"{s[0]}/{s[1]}", s[3], "/".join(s[4:]))
        raise HttpError(404, f"no route for {m} {self.path}")

    # endpoints
    def _whoami(self):
        token = self._token(required=True)
        access = {"displayName": "test token", "role": token.role}
        return (
            200,
            {},
            {
                "type": "user",
                "name": token.user,
                "fullname": token.user.title(),
                "orgs": [
                    {"type": "org", "name": o, "roleInOrg": "write"} for o in self.state.users.get(token.user, [])
                ],
                "auth": {"type": "access_token", "accessToken": access},
            },
        )

    def _create_repo(self):
        token = self._token(required=True)
        body = self._json()
        namespace = body.get("organization") or token.user
        repo_id = f"{namespace}/{body['name']}"
        if not (token.role == "write" and self._member(token, namespace)):
            raise HttpError(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')
        if repo_id in self.state.repos:
            raise HttpError(409, "You already created this model repo")
        self.state.create_repo(repo_id, private=bool(body.get("private")) or body.get("visibility") == "private")
        return 200, {}, {"url": f"{self.base}/{repo_id}", "name": repo_id}

    def _delete_repo(self):
        body = self._json()
        repo_id = f"{body.get('organization') or self._token(required=True).user}/{body['name']}"
        self._repo(repo_id, write=True)
        del self.state.repos[repo_id]
        return 200, {}, b""

    def _validate_yaml(self):
        import yaml

        content = self._json().get("content", "")
        if content.startswith("---"):
            parts = content.split("\n---", 1)
            try:
                meta = yaml.safe_load(parts[0][3:]) if len(parts) == 2 else None
            except yaml.YAMLError as e:
                return 400, {}, {"errors": [{"message": f"invalid YAML: {e}"}], "warnings": []}
            if not isinstance(meta, dict):
                return 400, {}, {"errors": [{"message": "metadata must be a YAML mapping"}], "warnings": []}
        return 200, {}, {"errors": [], "warnings": []}

    def _info(self, repo_id: str, revision: str):
        repo = self._repo(repo_id)
        commit = self._commit_at(repo, revision)
        return (
            200,
            {},
            {
                "id": repo_id,
                "modelId": repo_id,
                "author": repo.namespace,
                "sha": commit.sha,
                "lastModified": commit.date,
                "private": repo.private,
                "tags": [],
                "siblings": [{"rfilename": p} for p in sorted(commit.files)],
            },
        )

    def _tree(self, repo_id: str, revision: str, path: str):
        files = self._commit_at(self._repo(repo_id), revision).files
        prefix = path.rstrip("/") + "/" if path else ""
        recursive = self.query.get("recursive", "false").lower() in ("1", "true")
        entries, dirs = [], set()
        for p in sorted(f for f in files if f.startswith(prefix)):
            parts = p[len(prefix) :].split("/")
            dirs.update(prefix + "/".join(parts[:i]) for i in range(1, len(parts) if recursive else min(2, len(parts))))
            if recursive or len(parts) == 1:
                blob = files[p]
                entry = {
                    "type": "file",
                    "oid": blob.oid if not blob.is_lfs else git_blob_oid(blob.oid.encode()),
                    "size": blob.size,
                    "path": p,
                }
                if blob.is_lfs:
                    entry["lfs"] = {"oid": blob.oid, "size": blob.size, "pointerSize": 134}
                entries.append(entry)
        if path and not entries and not dirs:
            raise HttpError(404, f"{path} does not exist", "EntryNotFound")
        folders = [
            {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
            for d in sorted(dirs)
        ]
        return 200, {}, folders + entries

    def _refs(self, repo_id: str):
        repo = self._repo(repo_id)
        branches = [
            {"name": b, "ref": f"refs/heads/{b}", "targetCommit": sha}
            for b, sha in repo.refs.items()
            if not b.startswith("refs/")
        ]
        prs = [{"name": r, "ref": r, "targetCommit": sha} for r, sha in repo.refs.items() if r.startswith("refs/pr/")]
        return (
            200,
            {},
            {
                "branches": branches,
                "converts": [],
                "tags": [],
                "pullRequests": prs if self.query.get("include_prs") else [],
            },
        )

    def _commits(self, repo_id: str, revision: str):
        repo = self._repo(repo_id)
        self._commit_at(repo, revision)
        return (
            200,
            {},
            [
                {"id": c.sha, "title": c.title, "message": c.message, "authors": [], "date": c.date}
                for c in repo.history(revision)
            ],
        )

    def _preupload(self, repo_id: str, revision: str):
        repo = self._repo(repo_id, write=True)
        current = self._commit_at(repo, revision).files
        out = []
        for f in self._json().get("files", []):
            existing = current.get(f["path"])
            lfs = _is_lfs(f["path"], base64.b64decode(f.get("sample", "")), f["size"]) or bool(
                existing and existing.is_lfs
            )
            entry = {"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
            if existing:
                entry["oid"] = existing.oid
            out.append(entry)
        return 200, {}, {"files": out, "commitOid": repo.refs.get(revision)}

    def _lfs_batch(self, repo_id: str):
        repo = self._repo(repo_id, write=True)
        objects = []
        for obj in self._json().get("objects", []):
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in repo.lfs:  # already stored: nothing to send (how a re-run resumes)
                sig = secrets.token_hex(16)
                self.state.uploads[sig] = (repo_id, obj["oid"], obj["size"])
                entry["actions"] = {"upload": {"href": f"{self.base}/lfs-upload/{sig}", "expires_in": 3600}}
            objects.append(entry)
        return 200, {"Content-Type": "application/vnd.git-lfs+json"}, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, sig: str):
        with self.state.lock:
            target = self.state.uploads.get(sig)
            if target is None:
                raise HttpError(403, "upload URL unknown or expired")
            repo_id, oid, size = target
            faults = self.state.faults
            if oid in faults.fail_lfs_oids or faults.fail_lfs_puts:
                faults.fail_lfs_puts -= 1 if faults.fail_lfs_puts > 0 else 0
                raise HttpError(524, "A timeout occurred")
            if hashlib.sha256(self.body).hexdigest() != oid or len(self.body) != size:
                raise HttpError(400, "uploaded content does not match the announced sha256/size")
            repo = self.state.repos.get(repo_id)
            if repo is None:
                raise HttpError(404, "Repository not found", "RepoNotFound")
            repo.lfs[oid] = self.body
            self.state.lfs_puts.append(oid)
        return 200, {"ETag": f'"{oid}"'}, b""

    def _commit(self, repo_id: str, revision: str):
        repo = self._repo(repo_id, write=True)
        faults = self.state.faults
        if faults.fail_commits:
            faults.fail_commits -= 1
            raise HttpError(500, "Internal Error - We're working hard to fix this as soon as possible!")
        if faults.reject_commits:
            faults.reject_commits -= 1
            raise HttpError(422, "Your commit was rejected: file too large")
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HttpError(400, "the first NDJSON line must be the commit header")
        header = lines[0]["value"]
        base = self._commit_at(repo, revision)
        create_pr = self.query.get("create_pr") in ("1", "true")
        if not create_pr and revision not in repo.refs:
            raise HttpError(400, f"{revision} is not a branch: commits go to a branch")
        parent = header.get("parentCommit")
        if parent and not create_pr and not base.sha.startswith(parent):
            raise HttpError(412, f"A commit has happened since {parent}. Please refresh and try again.")
        files = dict(base.files)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            path = value.get("path", "")
            if key == "file":
                raw = value["content"]
                files[path] = Blob.regular(base64.b64decode(raw) if value.get("encoding") == "base64" else raw.encode())
            elif key == "lfsFile":
                if value["oid"] not in repo.lfs:
                    raise HttpError(422, f"LFS object {value['oid']} for {path} was never uploaded")
                files[path] = Blob.lfs(value["oid"], len(repo.lfs[value["oid"]]))
            elif key == "deletedFile":
                if files.pop(path, None) is None:
                    raise HttpError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            else:
                raise HttpError(400, f"unknown commit operation {key!r}")
        commit = Commit.make(base, files, header.get("summary") or "update", header.get("description") or "")
        repo.commits[commit.sha] = commit
        answer = {
            "success": True,
            "commitOid": commit.sha,
            "commitUrl": f"{self.base}/{repo_id}/commit/{commit.sha}",
            "pullRequestUrl": None,
        }
        if create_pr:
            repo.pr_count += 1
            repo.refs[f"refs/pr/{repo.pr_count}"] = commit.sha
            answer["pullRequestUrl"] = f"{self.base}/{repo_id}/discussions/{repo.pr_count}"
        else:
            repo.refs[revision] = commit.sha
        if faults.drop_commit_responses:
            faults.drop_commit_responses -= 1
            raise _Drop()
        return 200, {}, answer

    def _branch(self, repo_id: str, branch: str):
        repo = self._repo(repo_id, write=True)
        if self.method == "DELETE":
            if branch == "main" or branch not in repo.refs:
                raise HttpError(403 if branch == "main" else 404, f"cannot delete branch {branch}")
            del repo.refs[branch]
            return 200, {}, b""
        if branch in repo.refs:
            raise HttpError(409, f"Reference already exists: refs/heads/{branch}")
        repo.refs[branch] = self._commit_at(repo, self._json().get("startingPoint") or "main").sha
        return 200, {}, b""

    def _resolve(self, repo_id: str, revision: str, path: str):
        repo = self._repo(repo_id)
        commit = self._commit_at(repo, revision)
        blob = commit.files.get(path)
        if blob is None:
            raise HttpError(404, "Entry not found", "EntryNotFound")
        content = repo.lfs[blob.oid] if blob.is_lfs else blob.content
        headers = {
            "X-Repo-Commit": commit.sha,
            "ETag": f'"{blob.oid}"',
            "Content-Length": len(content),
            "Content-Type": "application/octet-stream",
        }
        if blob.is_lfs:
            headers.update({"X-Linked-Etag": f'"{blob.oid}"', "X-Linked-Size": blob.size})
        return 200, headers, content


class HubServer:
    """Serves on ``url`` (127.0.0.1, a free port) in a daemon thread once started."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.state = HubState()

    @property
    def state(self) -> HubState:
        return self.httpd.state

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def reset(self) -> HubState:
        self.httpd.state = HubState()
        return self.httpd.state

    def start(self) -> HubServer:
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":  # a manual playground: python tests/hub_server.py
    import time

    hub = HubServer(port=8765).start()
    hub.state.add_user("alice", token="hf_alice", orgs=("my-org",))
    print(f"serving on {hub.url}; token hf_alice (user alice, org my-org). Ctrl-C to stop.")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        hub.stop()

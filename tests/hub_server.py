"""A small Hugging Face Hub look-alike on 127.0.0.1, for tests that drive the real client.

It implements what ``huggingface_hub`` (2.x) calls to create repos, upload (preupload, LFS batch,
LFS PUT, verify, NDJSON commit), list (repo info, tree, refs, commits), branch, delete and download
(HEAD/GET ``resolve``), with the status codes, ``X-Error-Code`` headers and JSON bodies the client
interprets. Storage is in memory; commit, tree and blob ids are real git object ids (sha1 of the
git object), LFS files are stored by sha256 and committed as git-lfs pointer files.

Not implemented: Xet storage (run the client with ``HF_HUB_DISABLE_XET=1``; the client then uses
classic LFS), multipart LFS, gated repos, discussions beyond PR refs, pagination (one page).

Users, tokens and faults are set on ``server.state``::

    with HubServer() as hub:
        hub.state.add_user("alice", token="hf_alice", orgs=["my-org"])
        hub.state.add_user("bob", token="hf_bob_read", role="read")
        hub.state.faults.drop_lfs_puts = 2  # the next two LFS uploads lose their connection
        ...  # point HF_ENDPOINT at hub.url
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import fnmatch
import hashlib
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

# The Hub's default .gitattributes (the LFS patterns are what decides "lfs" in preupload).
LFS_PATTERNS = (
    "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
    "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
    "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
    "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*",
)
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()
REGULAR_MAX_BYTES = 10 * 1024 * 1024
AUTHOR = "hub-test"


# --- git objects ----------------------------------------------------------------------------
def git_oid(kind: str, payload: bytes) -> str:
    return hashlib.sha1(f"{kind} {len(payload)}\0".encode() + payload).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclasses.dataclass(frozen=True)
class Blob:
    """One file of a commit: inline content (regular) or an LFS object id."""

    size: int
    oid: str  # git blob id: of the content, or of the LFS pointer
    content: bytes | None = None
    lfs_sha256: str | None = None

    @classmethod
    def regular(cls, content: bytes) -> Blob:
        return cls(len(content), git_oid("blob", content), content=content)

    @classmethod
    def lfs(cls, sha256: str, size: int) -> Blob:
        return cls(size, git_oid("blob", lfs_pointer(sha256, size)), lfs_sha256=sha256)

    @property
    def pointer_size(self) -> int:
        return len(lfs_pointer(self.lfs_sha256, self.size)) if self.lfs_sha256 else 0


def tree_oid(files: dict[str, Blob], prefix: str = "") -> str:
    """The git tree id of the directory ``prefix`` (entries sorted as git sorts them)."""
    entries: dict[str, tuple[str, bytes]] = {}
    for path, blob in files.items():
        if not path.startswith(prefix):
            continue
        head, sep, _ = path[len(prefix):].partition("/")
        if sep:  # a sub-directory
            entries[head + "/"] = ("40000", bytes.fromhex(tree_oid(files, prefix + head + "/")))
        else:
            entries[head] = ("100644", bytes.fromhex(blob.oid))
    payload = b"".join(
        f"{mode} {name.rstrip('/')}".encode() + b"\0" + sha for name, (mode, sha) in sorted(entries.items())
    )
    return git_oid("tree", payload)


@dataclasses.dataclass
class Commit:
    sha: str
    parent: str | None
    files: dict[str, Blob]
    title: str
    message: str
    author: str
    date: str

    @classmethod
    def make(cls, parent: Commit | None, files: dict[str, Blob], title: str, message: str, author: str) -> Commit:
        now = dt.datetime.now(dt.timezone.utc)
        stamp = f"{author} <{author}@users.noreply.hub> {int(now.timestamp())} +0000"
        body = f"tree {tree_oid(files)}\n"
        if parent:
            body += f"parent {parent.sha}\n"
        body += f"author {stamp}\ncommitter {stamp}\n\n{title}\n" + (f"\n{message}\n" if message else "")
        return cls(git_oid("commit", body.encode()), parent.sha if parent else None, dict(files), title, message,
                   author, now.isoformat().replace("+00:00", "Z"))


@dataclasses.dataclass
class Repo:
    id: str
    private: bool
    created_at: str
    refs: dict[str, str] = dataclasses.field(default_factory=dict)  # "main", "dev", "refs/pr/1" -> sha
    commits: dict[str, Commit] = dataclasses.field(default_factory=dict)
    lfs: dict[str, bytes] = dataclasses.field(default_factory=dict)  # sha256 -> content
    pr_count: int = 0

    @property
    def namespace(self) -> str:
        return self.id.split("/")[0]

    def resolve(self, revision: str) -> Commit | None:
        if revision in self.refs:
            return self.commits[self.refs[revision]]
        if revision.startswith("refs/heads/") and revision[11:] in self.refs:
            return self.commits[self.refs[revision[11:]]]
        return self.commits.get(revision)

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

    drop_lfs_puts: int = 0  # the next N LFS PUTs (all of them if negative): the connection closes unanswered
    drop_lfs_oids: set[str] = dataclasses.field(default_factory=set)  # every PUT of these sha256s is dropped
    fail_commits: int = 0  # the next N commit requests answer 500 without committing
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
        self.uploads: dict[str, tuple[str, str, int]] = {}  # signature -> (repo id, sha256, size)
        self.lfs_puts: list[str] = []  # sha256 of every LFS PUT that was stored

    def add_user(self, name: str, token: str | None = None, role: str = "write", orgs: tuple[str, ...] = ()) -> None:
        with self.lock:
            self.users[name] = list(orgs)
            if token:
                self.tokens[token] = Token(name, role)

    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        """Server-side creation (as the Hub does it: one initial commit with .gitattributes)."""
        with self.lock:
            repo = Repo(repo_id, private, _now())
            initial = Commit.make(None, {".gitattributes": Blob.regular(GITATTRIBUTES)}, "initial commit", "", AUTHOR)
            repo.commits[initial.sha] = initial
            repo.refs["main"] = initial.sha
            self.repos[repo_id] = repo
            return repo

    def commit_files(self, repo_id: str, files: dict[str, bytes], title: str = "add files",
                     branch: str = "main") -> str:
        """Server-side commit for test setup (files ending like LFS patterns are stored in LFS)."""
        with self.lock:
            repo = self.repos[repo_id]
            parent = repo.resolve(branch)
            tree = dict(parent.files) if parent else {}
            for path, content in files.items():
                if _is_lfs(path, content, len(content)):
                    sha = hashlib.sha256(content).hexdigest()
                    repo.lfs[sha] = content
                    tree[path] = Blob.lfs(sha, len(content))
                else:
                    tree[path] = Blob.regular(content)
            commit = Commit.make(parent, tree, title, "", AUTHOR)
            repo.commits[commit.sha] = commit
            repo.refs[branch] = commit.sha
            return commit.sha

    def requests(self, method: str | None = None, contains: str = "") -> list[tuple[str, str, int]]:
        with self.lock:
            return [r for r in self.log if (method is None or r[0] == method) and contains in r[1]]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _is_lfs(path: str, sample: bytes, size: int) -> bool:
    if size > REGULAR_MAX_BYTES or any(fnmatch.fnmatch(path, p) for p in LFS_PATTERNS):
        return True
    if b"\0" in sample:
        return True
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as e:  # a multi-byte character cut by the 512-byte sample is still text
        return e.start < len(sample) - 4
    return False


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class _Drop(Exception):
    """Close the connection without answering (a network failure, as the client sees it)."""


# --- HTTP -----------------------------------------------------------------------------------
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hub-test/1.0"
    state: HubState  # set by HubServer

    def log_message(self, format, *args):  # quiet
        pass

    # plumbing
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

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.segments = [unquote(s) for s in url.path.split("/")[1:]]
        self.body = self._read_body()
        self.method = method
        status = 500
        try:
            status, headers, payload = self._route()
        except _Drop:
            self._record(url.path, 0)
            self.close_connection = True
            return
        except HttpError as e:
            status, headers = e.status, {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            payload = {"error": e.message}
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

    def _can_write_namespace(self, token: Token, namespace: str) -> bool:
        return token.role == "write" and (namespace == token.user or namespace in self.state.users.get(token.user, []))

    def _repo(self, repo_id: str, write: bool = False) -> Repo:
        token = self._token(required=write)
        repo = self.state.repos.get(repo_id)
        visible = repo is not None and (not repo.private or (token and self._can_read(token, repo)))
        if not visible:
            raise HttpError(401 if token is None else 404, "Repository not found", "RepoNotFound")
        if write and not self._can_write_namespace(token, repo.namespace):
            why = "your token is read-only" if token.role == "read" else (
                "this fine-grained token has no write access to it" if token.role == "fineGrained"
                else f"{token.user} is not a member of {repo.namespace!r}")
            raise HttpError(403, f"You don't have write access to {repo_id}: {why}.")
        return repo

    def _can_read(self, token: Token, repo: Repo) -> bool:
        return repo.namespace == token.user or repo.namespace in self.state.users.get(token.user, [])

    # routing
    def _route(self):
        s, m = self.segments, self.method
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
                if not rest and m == "GET":
                    return self._info(repo_id, "main")
                if rest[:1] == ["revision"] and m == "GET":
                    return self._info(repo_id, "/".join(rest[1:]))
                if rest[:1] == ["tree"] and m == "GET":
                    return self._tree(repo_id, rest[1], "/".join(rest[2:]))
                if rest[:1] == ["refs"] and m == "GET":
                    return self._refs(repo_id)
                if rest[:1] == ["commits"] and m == "GET":
                    return self._commits(repo_id, "/".join(rest[1:]))
                if rest[:1] == ["preupload"] and m == "POST":
                    return self._preupload(repo_id, "/".join(rest[1:]))
                if rest[:1] == ["commit"] and m == "POST":
                    return self._commit(repo_id, "/".join(rest[1:]))
                if rest[:1] == ["branch"] and m in ("POST", "DELETE"):
                    return self._branch(repo_id, "/".join(rest[1:]))
            if len(s) == 6 and s[1].endswith(".git") and s[2:] == ["info", "lfs", "objects", "batch"] and m == "POST":
                return self._lfs_batch(f"{s[0]}/{s[1][:-4]}")
            if s[:1] == ["lfs-verify"] and len(s) == 3 and m == "POST":
                return self._lfs_verify(f"{s[1]}/{s[2]}")
            if len(s) >= 5 and s[2] == "resolve" and m in ("GET", "HEAD"):
                return self._resolve(f"{s[0]}/{s[1]}", s[3], "/".join(s[4:]))
        if s[:1] == ["lfs-upload"] and len(s) == 2 and m == "PUT":
            return self._lfs_put(s[1])  # outside the lock: the body is already read, storing is locked
        raise HttpError(404, f"no route for {m} {self.path}")

    # endpoints
    def _whoami(self):
        token = self._token(required=True)
        orgs = self.state.users.get(token.user, [])
        access = {"displayName": "test token", "role": token.role, "createdAt": "2026-01-01T00:00:00.000Z"}
        if token.role == "fineGrained":
            access["fineGrained"] = {"canReadGatedRepos": False, "global": [], "scoped": []}
        return 200, {}, {
            "type": "user", "id": hashlib.sha1(token.user.encode()).hexdigest()[:24], "name": token.user,
            "fullname": token.user.title(), "email": f"{token.user}@example.org", "emailVerified": True,
            "isPro": False, "orgs": [{"type": "org", "name": o, "fullname": o, "roleInOrg": "write"} for o in orgs],
            "auth": {"type": "access_token", "accessToken": access},
        }

    def _create_repo(self):
        token = self._token(required=True)
        body = self._json()
        if body.get("type", "model") != "model":
            raise HttpError(400, "this test server hosts model repos only")
        namespace = body.get("organization") or token.user
        repo_id = f"{namespace}/{body['name']}"
        if not self._can_write_namespace(token, namespace):
            why = " (read-only token)" if token.role == "read" else ""
            raise HttpError(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"{why}')
        if repo_id in self.state.repos:
            raise HttpError(409, "You already created this model repo", headers={})
        private = bool(body.get("private")) or body.get("visibility") == "private"
        self.state.create_repo(repo_id, private=private)
        return 200, {}, {"url": f"{self.base}/{repo_id}", "name": repo_id,
                         "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]}

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
            if len(parts) != 2 or not isinstance(meta, dict):
                return 400, {}, {"errors": [{"message": "metadata must be a YAML mapping"}], "warnings": []}
        return 200, {}, {"errors": [], "warnings": []}

    def _commit_at(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def _info(self, repo_id: str, revision: str):
        repo = self._repo(repo_id)
        commit = self._commit_at(repo, revision)
        return 200, {}, {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
            "author": repo.namespace, "sha": commit.sha, "lastModified": commit.date, "createdAt": repo.created_at,
            "private": repo.private, "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": [{"rfilename": p} for p in sorted(commit.files)],
        }

    def _tree(self, repo_id: str, revision: str, path: str):
        repo = self._repo(repo_id)
        files = self._commit_at(repo, revision).files
        prefix = path.rstrip("/") + "/" if path else ""
        recursive = self.query.get("recursive", "false").lower() in ("1", "true")
        entries, dirs = [], set()
        for p in sorted(files):
            if not p.startswith(prefix):
                continue
            rel = p[len(prefix):]
            parts = rel.split("/")
            for i in range(1, len(parts) if recursive else min(2, len(parts))):
                dirs.add(prefix + "/".join(parts[:i]))
            if recursive or len(parts) == 1:
                blob = files[p]
                entry = {"type": "file", "oid": blob.oid, "size": blob.size, "path": p}
                if blob.lfs_sha256:
                    entry["lfs"] = {"oid": blob.lfs_sha256, "size": blob.size, "pointerSize": blob.pointer_size}
                entries.append(entry)
        if path and not entries and not dirs:
            raise HttpError(404, f"{path} does not exist", "EntryNotFound")
        folders = [{"type": "directory", "oid": tree_oid(files, d + "/"), "size": 0, "path": d} for d in sorted(dirs)]
        return 200, {}, folders + entries

    def _refs(self, repo_id: str):
        repo = self._repo(repo_id)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": sha}
                    for b, sha in repo.refs.items() if not b.startswith("refs/")]
        prs = [{"name": r, "ref": r, "targetCommit": sha} for r, sha in repo.refs.items() if r.startswith("refs/pr/")]
        return 200, {}, {"branches": branches, "converts": [], "tags": [],
                         "pullRequests": prs if self.query.get("include_prs") else []}

    def _commits(self, repo_id: str, revision: str):
        repo = self._repo(repo_id)
        self._commit_at(repo, revision)
        return 200, {}, [{"id": c.sha, "title": c.title, "message": c.message, "authors": [{"user": c.author}],
                          "date": c.date} for c in repo.history(revision)]

    def _preupload(self, repo_id: str, revision: str):
        repo = self._repo(repo_id, write=True)
        current = self._commit_at(repo, revision).files
        out = []
        for f in self._json().get("files", []):
            sample = base64.b64decode(f.get("sample", ""))
            existing = current.get(f["path"])
            lfs = _is_lfs(f["path"], sample, f["size"]) or bool(existing and existing.lfs_sha256)
            entry = {"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
            if existing:
                entry["oid"] = existing.lfs_sha256 or existing.oid
            out.append(entry)
        return 200, {}, {"files": out, "commitOid": repo.refs.get(revision)}

    def _lfs_batch(self, repo_id: str):
        repo = self._repo(repo_id, write=True)
        body = self._json()
        if body.get("operation") != "upload":
            raise HttpError(400, "only uploads are supported")
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj["oid"], obj["size"]
            entry = {"oid": oid, "size": size, "authenticated": True}
            if oid not in repo.lfs:
                sig = secrets.token_hex(16)
                self.state.uploads[sig] = (repo_id, oid, size)
                entry["actions"] = {
                    "upload": {"href": f"{self.base}/lfs-upload/{sig}", "expires_in": 3600},
                    "verify": {"href": f"{self.base}/lfs-verify/{repo_id}", "expires_in": 3600},
                }
            objects.append(entry)
        return 200, {"Content-Type": "application/vnd.git-lfs+json"}, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, sig: str):
        with self.state.lock:
            target = self.state.uploads.get(sig)
            if target is None:
                raise HttpError(403, "upload URL unknown or expired")
            repo_id, oid, size = target
            faults = self.state.faults
            if oid in faults.drop_lfs_oids:
                raise _Drop()
            if faults.drop_lfs_puts:
                faults.drop_lfs_puts -= 1 if faults.drop_lfs_puts > 0 else 0
                raise _Drop()
            if hashlib.sha256(self.body).hexdigest() != oid or len(self.body) != size:
                raise HttpError(400, "uploaded content does not match the announced sha256/size")
            repo = self.state.repos.get(repo_id)
            if repo is None:
                raise HttpError(404, "Repository not found", "RepoNotFound")
            repo.lfs[oid] = self.body
            self.state.lfs_puts.append(oid)
        return 200, {"ETag": f'"{oid}"'}, b""

    def _lfs_verify(self, repo_id: str):
        repo = self._repo(repo_id, write=True)
        body = self._json()
        if len(repo.lfs.get(body.get("oid"), b"")) != body.get("size") or body.get("oid") not in repo.lfs:
            raise HttpError(404, f"object {body.get('oid')} not found")
        return 200, {}, {"success": True}

    def _commit(self, repo_id: str, revision: str):
        repo = self._repo(repo_id, write=True)
        faults = self.state.faults
        if faults.fail_commits:
            faults.fail_commits -= 1
            raise HttpError(500, "Internal Error - We're working hard to fix this as soon as possible!")
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
                content = base64.b64decode(raw) if value.get("encoding") == "base64" else raw.encode()
                files[path] = Blob.regular(content)
            elif key == "lfsFile":
                oid = value["oid"]
                if oid not in repo.lfs:
                    raise HttpError(422, f"LFS object {oid} for {path} was never uploaded")
                files[path] = Blob.lfs(oid, len(repo.lfs[oid]))
            elif key == "deletedFile":
                if files.pop(path, None) is None:
                    raise HttpError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                for p in [p for p in files if p.startswith(prefix)]:
                    del files[p]
            else:
                raise HttpError(400, f"unknown commit operation {key!r}")
        token = self._token(required=True)
        commit = Commit.make(base, files, header.get("summary") or "update", header.get("description") or "",
                             token.user)
        repo.commits[commit.sha] = commit
        answer = {"success": True, "commitOid": commit.sha, "commitUrl": f"{self.base}/{repo_id}/commit/{commit.sha}",
                  "pullRequestUrl": None}
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
            if branch == "main":
                raise HttpError(403, "main cannot be deleted")
            if branch not in repo.refs:
                raise HttpError(404, f"branch {branch} not found", "RevisionNotFound")
            del repo.refs[branch]
            return 200, {}, b""
        if branch in repo.refs:
            raise HttpError(409, f"Reference already exists: refs/heads/{branch}")
        start = self._commit_at(repo, self._json().get("startingPoint") or "main")
        repo.refs[branch] = start.sha
        return 200, {}, b""

    def _resolve(self, repo_id: str, revision: str, path: str):
        repo = self._repo(repo_id)
        commit = self._commit_at(repo, revision)
        blob = commit.files.get(path)
        if blob is None:
            raise HttpError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": commit.sha})
        content = repo.lfs[blob.lfs_sha256] if blob.lfs_sha256 else blob.content
        headers = {"X-Repo-Commit": commit.sha, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if blob.lfs_sha256:
            headers.update({"ETag": f'"{blob.lfs_sha256}"', "X-Linked-Etag": f'"{blob.lfs_sha256}"',
                            "X-Linked-Size": blob.size})
        else:
            headers["ETag"] = f'"{blob.oid}"'
        status = 200
        start = _range_start(self.headers.get("Range"))
        if start:
            content, status = content[start:], 206
            headers["Content-Range"] = f"bytes {start}-{blob.size - 1}/{blob.size}"
        headers["Content-Length"] = len(content)
        return status, headers, content


def _range_start(header: str | None) -> int:
    if header and header.startswith("bytes=") and header[6:].split("-")[0].isdigit():
        return int(header[6:].split("-")[0])
    return 0


class HubServer:
    """``with HubServer() as hub:`` serves on ``hub.url`` (127.0.0.1, a free port) in a thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = HubState()
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # a manual playground: python tests/hub_server.py
    import time

    with HubServer(port=8765) as hub:
        hub.state.add_user("alice", token="hf_alice", orgs=("my-org",))
        print(f"serving on {hub.url}; token hf_alice (user alice, org my-org). Ctrl-C to stop.")
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass

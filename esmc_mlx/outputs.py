"""Outputs that survive faults. Every file or directory esmc-mlx writes goes through here:

* a directory is built in a hidden staging sibling ``.NAME.partial-PID-XXXXXX`` and moved into
  place whole (``StagedDirectory.publish``); on any error the staging is removed, and an
  existing output stays as it was until the new one is published;
* a file is written to a hidden sibling ``.NAME.tmp-PID-XXXXXX`` and ``os.replace``d
  (``atomic_file``), so a reader sees the old file or the new one, never half of one;
* an output path is locked while it is written (``output_lock``: ``flock`` on ``.NAME.lock``
  beside it); a second run on the same path fails at once, naming the PID that holds it;
* staging and temporary files left by a run that was killed (its PID gone) are removed, and
  named in a warning, by the next run on that path;
* a directory esmc-mlx wrote carries a marker file (``.esmc-mlx``) listing its entries;
  ``--force`` replaces only such a directory while it holds nothing else, never a file, the
  current directory, or a path that is or contains the input;
* modes come from the user's umask (nothing here uses tempfile's private 0700/0600);
* a full disk is one error that says so and names the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import glob
import inspect
import json
import os
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ._version import __version__
from .artifact import GENERATED_CARD_LINE, REPORT_DIR, REPORT_FILES
from .errors import EsmcMlxWarning, OutputError

MARKER = ".esmc-mlx"
# What esmc-mlx versions before the marker wrote into a model directory (their config.json says
# "converter": "esmc-mlx"); --force accepts such a directory while it holds nothing else.
_LEGACY_MODEL_FILES = re.compile(
    r"config\.json|tokenizer(_config)?\.json|special_tokens_map\.json|model(-\d{5}-of-\d{5})?\.safetensors"
    r"|model\.safetensors\.index\.json"
)
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|old|tmp)-(?P<pid>\d+)-[0-9a-f]{6}")
# esmc-mlx 0.x before the lock named its staging with tempfile's 8 random characters and no PID
_LEGACY_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|old)-[a-z0-9_]{8}")
DISK_FULL_MARGIN = 16 << 20  # after a failed write, less free space than this means the disk filled up


# --- small facts ----------------------------------------------------------------------------------
def _token() -> str:
    return secrets.token_hex(3)


def _alive(pid: int) -> bool:
    if pid <= 0:  # unknown (a leftover of a version without PIDs): its run held no lock, ours does
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def disk_full(error: BaseException, where: Path) -> bool:
    """Whether a failed write of ``where`` failed because its file system is full. MLX's writers
    raise a bare RuntimeError without errno; then the free space decides."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    if not isinstance(error, RuntimeError):
        return False
    for candidate in (where, *where.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free < DISK_FULL_MARGIN
            except OSError:
                return False
    return False


def disk_full_error(path: Path) -> OutputError:
    return OutputError(
        f"the disk is full: could not write {path}. Free some space (or write to another disk) "
        "and run the command again; nothing was left behind"
    )


def write_error(error: OSError, path: Path) -> OutputError:
    """The one-line error for a failed write of ``path`` (disk full, permission, read-only ...)."""
    if disk_full(error, path):
        return disk_full_error(path)
    return OutputError(f"cannot write {error.filename or path}: {error.strerror or error}")


def current_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


def apply_umask(directory: Path) -> None:
    """Give everything under ``directory`` the modes the user's umask asks for: MLX creates its
    files 0644 (then masked), so a umask of 002 would otherwise not get group-writable files."""
    mask = current_umask()
    for root, _dirs, files in os.walk(directory):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _listing(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


# --- leftovers of killed runs -----------------------------------------------------------------------
def leftovers(target: Path | None = None, folder: Path | None = None) -> list[tuple[Path, Path, str, int]]:
    """(path, the output it was for, kind, pid) of every staging, swapped-out or temporary
    sibling of ``target`` (or of anything in ``folder``)."""
    folder = Path(folder) if folder is not None else Path(target).parent
    pattern = f".{glob.escape(Path(target).name)}.*-*" if target is not None else ".*-*"
    found = []
    for path in folder.glob(pattern):
        m = _LEFTOVER.fullmatch(path.name) or _LEGACY_LEFTOVER.fullmatch(path.name)
        if m and (target is None or m["name"] == Path(target).name):
            found.append((path, path.parent / m["name"], m["kind"], int(m.groupdict().get("pid") or 0)))
    return found


def clean_leftovers(target: Path | None = None, folder: Path | None = None) -> list[Path]:
    """Remove what runs that are gone left beside ``target`` (or anywhere in ``folder``) and
    warn naming each. A swapped-out old output (a run killed between its two renames) is put
    back when ``target`` is missing."""
    removed = []
    for path, its_target, kind, pid in leftovers(target, folder):
        if _alive(pid):
            continue
        if kind == "old" and not os.path.lexists(its_target):
            os.replace(path, its_target)
            warnings.warn(
                f"restored {its_target} from {path.name}, left by a run (PID {pid}) killed while replacing it",
                EsmcMlxWarning,
                stacklevel=3,
            )
            continue
        _remove(path)
        removed.append(path)
        warnings.warn(
            f"removed {path}, left by a run that was interrupted" + (f" (PID {pid}, no longer running)" if pid else ""),
            EsmcMlxWarning,
            stacklevel=3,
        )
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# --- the lock -------------------------------------------------------------------------------------
def lock_path(target: Path) -> Path:
    return Path(target).parent / f".{Path(target).name}.lock"


# What opening a lock file in a folder we may not write in raises.
READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


@contextlib.contextmanager
def output_lock(target: str | Path, create_parent: bool = True, optional: bool = False) -> Iterator[bool]:
    """Hold an exclusive lock on the output path ``target`` (a file ``.NAME.lock`` beside it,
    removed on release). A second holder fails at once with OutputError naming the first's PID.
    The kernel drops the lock when its process dies, so a killed run never blocks the next.
    ``create_parent=False``: a missing parent folder is an error instead. ``optional``: for a
    caller that only reads ``target`` or writes inside it (push, validate), a folder it may not
    write in means going on unlocked: no esmc-mlx run can replace ``target`` there either
    (replacing renames entries of that folder). Yields whether the lock is held."""
    target = Path(target)
    path = lock_path(target)
    made = _first_missing(target) if create_parent else None
    if create_parent:
        ensure_parent(target)
    elif not target.parent.is_dir():
        raise OutputError(f"{target}: no such directory {target.parent}")
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            _remove_made(target, made)
            if not (optional and e.errno in READ_ONLY):
                raise write_error(e, path) from None
            fd = None
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            _remove_made(target, made)
            raise OutputError(
                f"{target} is being written by another esmc-mlx run (PID {holder}); wait for it "
                f"to finish or choose another output"
            ) from None
        try:  # the previous holder may have removed the file between our open and our lock
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    if fd is None:
        yield False
        return
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still holding it: whoever opened the old file fails its check above
        os.close(fd)
        _remove_made(target, made)


def locked(
    parameter: str, when: Callable[[dict], bool] = lambda args: True, create_parent: bool = True, optional: bool = False
):
    """Decorator: hold ``output_lock`` on the function's argument ``parameter`` (when it is not
    None and ``when(arguments)``) for the whole call, leftovers of dead runs cleaned first."""

    def decorate(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            target = bound.arguments.get(parameter)
            if target is None or not when(bound.arguments):
                return function(*args, **kwargs)
            with output_lock(target, create_parent, optional) as held:
                if held:  # (unlocked: a read-only folder, where no run left anything since)
                    clean_leftovers(Path(target))
                return function(*args, **kwargs)

        return wrapper

    return decorate


# --- the marker -----------------------------------------------------------------------------------
def write_marker(directory: Path, kind: str) -> None:
    """Record that esmc-mlx wrote ``directory`` and which entries it holds."""
    directory = Path(directory)
    entries = sorted(p.name for p in directory.iterdir() if p.name != MARKER)
    payload = {"written_by": "esmc-mlx", "version": __version__, "kind": kind, "entries": entries}
    (directory / MARKER).write_text(json.dumps(payload, indent=1) + "\n")


def read_marker(directory: Path) -> dict | None:
    try:
        data = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == "esmc-mlx" else None


def add_to_marker(directory: Path, name: str) -> None:
    """Record ``name`` as esmc-mlx's in a marked directory (validate's report folder)."""
    data = read_marker(directory)
    if data is not None and name not in data.get("entries", []):
        data["entries"] = sorted([*data.get("entries", []), name])
        with atomic_file(Path(directory) / MARKER) as f:
            f.write(json.dumps(data, indent=1) + "\n")


def _legacy_model_directory(directory: Path) -> bool:
    try:
        config = json.loads((directory / "config.json").read_text())
        return config["esmc_mlx"]["converter"]["name"] == "esmc-mlx"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _later_product(directory: Path, name: str) -> bool:
    """What esmc-mlx adds to a model directory after writing it, recognized by content: the
    report folder of ``validate`` and the model card ``push`` generates (a hand-written
    README.md is the user's)."""
    path = directory / name
    if name == REPORT_DIR:
        return (path / "report.json").is_file()
    if name == "README.md":
        try:
            return path.read_text(errors="replace").rstrip().endswith(GENERATED_CARD_LINE)
        except OSError:
            return False
    return False


def foreign_entries(directory: Path) -> list[str] | None:
    """Entries of ``directory`` esmc-mlx did not write; None if esmc-mlx did not write it at all."""
    directory = Path(directory)
    present = sorted(p.name for p in directory.iterdir() if p.name != MARKER)
    marker = read_marker(directory)
    if marker is not None:
        ours = set(marker.get("entries", []))
    elif _legacy_model_directory(directory):
        ours = {n for n in present if _LEGACY_MODEL_FILES.fullmatch(n)}
    else:
        return None
    foreign = [n for n in present if n not in ours and not _later_product(directory, n) and not _own_leftover(n)]
    report = directory / REPORT_DIR
    if REPORT_DIR in present and REPORT_DIR not in foreign and report.is_dir() and not report.is_symlink():
        # the report folder is ours while it holds only the report's files
        inside = sorted(p.name for p in report.iterdir())
        foreign += [f"{REPORT_DIR}/{n}" for n in inside if n not in REPORT_FILES and not _own_leftover(n)]
    return foreign


def _own_leftover(name: str) -> bool:
    """A lock or temporary file esmc-mlx makes beside what it writes (a killed run leaves them)."""
    return bool(name.startswith(".") and (name.endswith(".lock") or _LEFTOVER.fullmatch(name)))


# --- checks before any work -----------------------------------------------------------------------
def ensure_parent(target: Path, create: bool = True) -> None:
    """Create ``target``'s parent directory (or, with ``create=False``, check that it could be
    created: nothing is made before the work is known to start); OutputError if it cannot be
    created or written."""
    parent = Path(target).parent
    if create:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create {parent}: {e.strerror}") from None
    existing = next(p for p in (parent, *parent.parents) if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        raise OutputError(f"cannot create {parent}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{existing} is not writable")


def _first_missing(target: Path) -> Path | None:
    """The topmost folder above ``target`` that does not exist yet (what creating it would make)."""
    missing = [p for p in (Path(target).parent, *Path(target).parent.parents) if not p.exists()]
    return missing[-1] if missing else None


def _remove_made(target: Path, top: Path | None) -> None:
    """Remove the (empty) folders made for ``target`` down from ``top``, when nothing came of it."""
    if top is None or os.path.lexists(target):
        return
    for folder in (Path(target).parent, *Path(target).parent.parents):
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == top:
            return


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_target(out: str | Path, force: bool, sources: Iterable[str | Path] = (), create_parent: bool = False) -> None:
    """Fail before any work when the output directory ``out`` cannot be (re)placed: it exists and
    ``force`` is off; it is, contains or lies inside one of ``sources``; or, with ``force``, it is a file, a
    link, the current directory or one holding it, a directory esmc-mlx did not write, or one
    holding files esmc-mlx did not write."""
    out = Path(out)
    exists = os.path.lexists(out)
    if out.is_symlink() and not out.exists():  # "already exists" would puzzle: ls shows nothing usable
        raise OutputError(
            f"{out} is a link to {os.readlink(out)}, which does not exist; remove the link or choose another output"
        )
    if exists and not force:
        raise OutputError(f"{out} already exists; pass --force to replace it")
    real = out.resolve()
    for source in sources:
        source = Path(source).resolve()
        if _is_within(source, real):
            what = "is" if source == real else "contains"
            raise OutputError(f"the output {out} {what} the input {source}; write the output somewhere else")
        if source.is_dir() and _is_within(real, source):  # it would become part of the input (and its upload)
            raise OutputError(f"the output {out} is inside the input {source}; write the output somewhere else")
    if exists:
        refuse = f"--force will not replace {out}:"
        if _is_within(Path.cwd().resolve(), real):
            raise OutputError(f"{refuse} it is the current directory (or holds it); choose another output")
        if out.is_symlink() or not out.is_dir():
            raise OutputError(
                f"{refuse} it is a {'link' if out.is_symlink() else 'file'}, not a directory esmc-mlx wrote"
            )
        foreign = foreign_entries(out)
        if foreign is None:
            raise OutputError(
                f"{refuse} esmc-mlx did not write it (no {MARKER} marker); remove it yourself or choose another output"
            )
        if foreign:
            raise OutputError(
                f"{refuse} it holds files esmc-mlx did not write ({_listing(foreign)}); move them out first"
            )
    ensure_parent(out, create_parent)


def check_file_target(path: str | Path, option: str = "-o", sources: Iterable[str | Path] = ()) -> None:
    """Fail before any work when the output file ``path`` cannot be written: its directory is
    missing or not writable, the path is a directory, or it is one of the input files
    ``sources``. (Replacing a file is what a file output does; it happens atomically.)"""
    path = Path(path)
    for source in sources:
        with contextlib.suppress(OSError):
            if os.path.samefile(path, source):
                raise OutputError(f"{option} {path} is the input {source}; write the output somewhere else")
    if written_in_place(path):  # /dev/null, /dev/stdout, a FIFO
        if not os.access(path, os.W_OK):
            raise OutputError(f"{option} {path}: not writable")
        return
    if not path.parent.is_dir():
        raise OutputError(f"{option} {path}: no such directory {path.parent}")
    target = Path(os.path.realpath(path))  # a link is written through (atomic_file)
    if path.is_symlink() and not target.parent.is_dir():
        raise OutputError(f"{option} {path}: a link to {os.readlink(path)}, whose folder does not exist")
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a directory; give a file name")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: {path.parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{option} {path}: the file is not writable")


# --- writing --------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", **open_kwargs) -> Iterator:
    """Open a hidden sibling of ``path`` for writing; on success it replaces ``path`` whole, on
    any error it is removed (a full disk becomes OutputError naming ``path``). A link is kept:
    the file it points to is replaced. A device or a pipe (``-o /dev/null``, ``/dev/stdout``, a
    FIFO) is written in place: a rename would put a regular file where it was (as root, /dev/null
    for every program)."""
    path = Path(path)
    if written_in_place(path):
        with open(path, mode, **open_kwargs) as f:
            yield f
        return
    path = path.resolve() if path.is_symlink() else path
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{_token()}"
    try:
        with open(tmp, "x" + mode.replace("w", ""), **open_kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if disk_full(e, path):
            raise disk_full_error(path) from None
        if isinstance(e, OSError) and e.filename in (str(tmp), str(path)):
            raise OutputError(f"cannot write {path}: {e.strerror}") from None
        raise


def written_in_place(path: str | Path) -> bool:
    """Whether ``path`` takes bytes where it is rather than being replaced: a device, a FIFO or
    a socket, or a link through /proc (``/dev/stdout`` -> ``/proc/self/fd/1``: the process's
    output, whatever file it is). Such an output needs neither a lock nor a writable folder."""
    path = Path(path)
    if not path.exists() or path.is_dir():
        return False
    if not path.is_file():
        return True
    for _ in range(40):  # the link chain, hop by hop (resolve() would pass through /proc unseen)
        if not path.is_symlink():
            return False
        path = path.parent / os.readlink(path)
        if path.parts[:2] == ("/", "proc"):
            return True
    return False


class StagedDirectory:
    """An output directory built aside and put in place whole, under the output's lock.

    ``with StagedDirectory(out, force, sources) as stage:`` checks the target, takes the lock,
    removes leftovers of dead runs and creates ``stage.path``. Write there, then ``publish()``
    (marker, then swap into place) or ``keep_failed()`` (move aside as ``OUT.failed-<time>``,
    the old output untouched). Leaving the block without either removes the staging; a full
    disk becomes one OutputError naming the file.
    """

    def __init__(self, out: str | Path, force: bool = False, sources: Iterable[str | Path] = (), kind: str = "model"):
        self.out = Path(out)
        self.force = force
        self.sources = list(sources)
        self.kind = kind
        self.path: Path | None = None
        self.done: Path | None = None  # where the staging went: out, or the failed copy
        self._made: Path | None = None  # the topmost folder made for out, removed if nothing came of it
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StagedDirectory:
        self._made = _first_missing(self.out)
        try:
            check_target(self.out, self.force, self.sources, create_parent=True)
            with self._stack:
                self._stack.enter_context(output_lock(self.out))
                clean_leftovers(self.out)
                check_target(self.out, self.force, self.sources)  # another run may have finished meanwhile
                path = self.out.parent / f".{self.out.name}.partial-{os.getpid()}-{_token()}"
                try:
                    path.mkdir()  # mode 0777 & ~umask
                except OSError as e:
                    raise write_error(e, path) from None
                self.path = path
                self._stack = self._stack.pop_all()
        except BaseException:
            _remove_made(self.out, self._made)
            raise
        return self

    def publish(self) -> Path:
        write_marker(self.path, self.kind)
        apply_umask(self.path)
        if os.path.lexists(self.out):  # --force, checked: swap, then delete the old one
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}-{_token()}"
            try:
                os.replace(self.out, old)
                os.replace(self.path, self.out)
            except BaseException:  # Ctrl-C or an error between the two renames: the old one goes back
                if os.path.lexists(old) and not os.path.lexists(self.out):
                    os.replace(old, self.out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.path, self.out)
        self.done = self.out
        return self.out

    def keep_failed(self) -> Path:
        """Move the staging aside as ``OUT.failed-<time>`` (named in the caller's error)."""
        write_marker(self.path, self.kind)
        apply_umask(self.path)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = self.out.parent / f"{self.out.name}.failed-{stamp}"
        n = 1
        while os.path.lexists(dest):
            n += 1
            dest = self.out.parent / f"{self.out.name}.failed-{stamp}-{n}"
        os.replace(self.path, dest)
        self.done = dest
        return dest

    def __exit__(self, kind, error, traceback) -> bool:
        # judge a full disk before the staging is removed (removing it frees the space)
        full = error is not None and self.path is not None and disk_full(error, self.path)
        try:
            if self.done is None and self.path is not None:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self._stack.close()
            if self.done is None:
                _remove_made(self.out, self._made)
        if full:
            raise disk_full_error(Path(getattr(error, "filename", None) or self.path)) from None
        return False

"""The one guard every output of esmc-mlx goes through (docs/reliability.md). Three shapes:

* ``directory`` (``StagedDirectory``: convert, quantize, quantize-sae, predict --fuse): built in a
  hidden staging sibling and moved into place whole by ``publish()``; an existing output stays
  as it was until then, and ``--force`` replaces only a directory esmc-mlx wrote, of the same
  kind, holding nothing else;
* ``folder`` (``OutputFolder``: embed, scan, features, attention, finetune): a folder esmc-mlx adds files to,
  run after run; made with its marker, reopened only by a run of its own kind, each file written
  whole and recorded in the marker; a file esmc-mlx did not write is never written over;
* ``file`` (``OutputFile``: score's and predict's CSVs): one file, replaced whole. A file esmc-mlx
  did not write (or that was changed since) is replaced only with ``--force``: what esmc-mlx
  wrote is remembered in its cache (``written.json``: the path, size and sha256 of each file).

What every guard does, before any work: the target is not an input, holds none and lies inside
none, nor inside another esmc-mlx output (a model, an embeddings or scan folder); a folder
esmc-mlx did not make is neither written into nor replaced. For the whole run it holds the
output's lock (``flock`` on ``.NAME.lock`` beside it, a file that says it is esmc-mlx's): a
second run fails at once naming the first's PID; the kernel drops the lock of a killed run.

Whatever a run makes beside an output (a staging folder, a file being written, an old output
set aside while the new one goes in) is a hidden folder ``.NAME.<stage>-<pid>-<random>`` holding
esmc-mlx's marker, which names that folder and its writer's PID. The next run on that output
recognises leftovers by that mark alone, never by a name: it removes those whose writer is gone,
naming each in a warning, and puts back an old output whose replacement never arrived.

A directory esmc-mlx wrote carries the marker ``.esmc-mlx`` (JSON: writer, version, kind, the
entries it wrote). Modes come from the user's umask (nothing here uses tempfile's private
0700/0600); a full disk is one error that says so and names the file.

A new command adopts the guard with one call::

    with guard(out, "sae", "directory", force=force, inputs=[model_dir]) as target:
        ...  # write into target.path
        target.publish()
    with guard(out, "attention", "folder", inputs=[model_dir, fasta]) as folder:
        with folder.file("P69905_attention.npy", "wb") as f: ...
    with guard(out_csv, "predictions", "file", inputs=[csv]) as target:
        with target.open("w", newline="") as f: ...

or, for a library function whose argument ``out`` is the output, ``@guarded("out", "scan",
"folder", inputs=("model", "fasta"))`` and ``held(out)`` inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
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

from . import settings
from ._version import __version__
from .artifact import (
    GENERATED_CARD_LINE,
    INDEX_FILE,
    REPORT_DIR,
    REPORT_FILES,
    SINGLE_FILE,
    TOKENIZER_FILES,
    index_files,
)
from .errors import EsmcMlxError, EsmcMlxWarning, OutputError
from .readers import read_json
from .resolve import local_copy

MARKER = ".esmc-mlx"
MARKER_BYTES = 16 << 20  # a marker lists names: a folder of 100,000 files is ~4 MB
LOCK_MARK = b"esmc-mlx lock"
STAGES = ("partial", "tmp", "old")  # a staging folder, a file being written, an old output set aside
MODES = ("directory", "folder", "file")
DISK_FULL_MARGIN = 16 << 20  # after a failed write, less free space than this means the disk filled up


# --- small facts ----------------------------------------------------------------------------------
def _token() -> str:
    return secrets.token_hex(3)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # someone else's live process; or not a PID
        return pid > 0
    return True


def disk_full(error: BaseException, where: Path) -> bool:
    """Whether a failed write of ``where`` failed because its file system is full. MLX's writers
    raise a bare RuntimeError, numpy's an OSError without errno ("8000 requested and 3040
    written"); then the free space decides."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    if not isinstance(error, (OSError, RuntimeError)):
        return False
    for candidate in (Path(where), *Path(where).parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free < DISK_FULL_MARGIN
            except OSError:
                return False
    return False


def disk_full_error(path: Path) -> OutputError:
    return OutputError(
        f"the disk is full: could not write {shown_path(path)}. Free some space (or write to another disk) "
        "and run the command again; nothing was left behind"
    )


def write_error(error: OSError, path: Path) -> OutputError:
    """The one-line error for a failed write of ``path`` (disk full, permission, read-only ...)."""
    if disk_full(error, path):
        return disk_full_error(path)
    return OutputError(
        f"cannot write {shown_path(getattr(error, 'filename', None) or path)}: {error.strerror or error}"
    )


_STAGED = re.compile(r"\.(.+)\.(partial|tmp|old)-\d+-[0-9a-f]{6}")


def shown_path(path: str | Path) -> Path:
    """The path a message names for ``path``: a file inside a staging folder (``make_staging``)
    is named where it goes, ``OUT/layer_3.safetensors`` for ``.OUT.partial-PID-RAND/layer_3.safetensors``
    (the user acts on the output; the staging is gone by the time they read the message)."""
    parts = Path(path).parts
    for i, part in enumerate(parts):
        staged = _STAGED.fullmatch(part)
        if staged is None:
            continue
        target, stage, rest = staged[1], staged[2], parts[i + 1 :]
        if stage == "tmp" and rest == ("new",):  # atomic_file's file: it becomes TARGET itself
            return Path(*parts[:i], target)
        if stage == "tmp" and target == "files":  # StagedFiles: its files go into the folder
            return Path(*parts[:i], *rest)
        return Path(*parts[:i], target, *rest)
    return Path(path)


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


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def _a(kind: str) -> str:
    """``a model``, ``an adapter``, ``an sae`` (said letter by letter)."""
    return f"{'an' if kind[:1] in 'aeiou' or kind == 'sae' else 'a'} {kind}"


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


@dataclasses.dataclass(frozen=True)
class Found(os.PathLike):
    """An input the user did not name as a path, found through a record or a resolution: the
    base model an adapter records, the folder of a Hub repo id in the HF cache, a packaged model.
    ``how`` says how, in the refusal (``the base model my-adapter records``). The guard treats
    it as every other input."""

    path: Path
    how: str

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)


def _input(source) -> str:
    """An input as a refusal names it: the path, and for a ``Found`` one how it was found."""
    return f"{source} ({source.how})" if isinstance(source, Found) else str(source)


# --- the marker -----------------------------------------------------------------------------------
def write_marker(directory: Path, kind: str, entries: Iterable[str] | None = None, **extra) -> None:
    """Record that esmc-mlx wrote ``directory``, its kind and its entries (default: all it holds)."""
    directory = Path(directory)
    if entries is None:
        entries = (p.name for p in directory.iterdir() if p.name != MARKER)
    payload = {"written_by": "esmc-mlx", "version": __version__, "kind": kind, "entries": sorted(set(entries)), **extra}
    with atomic_file(directory / MARKER) as f:
        f.write(json.dumps(payload, indent=1) + "\n")


def read_marker(directory: Path) -> dict | None:
    """The marker of ``directory`` if esmc-mlx wrote one there (a planted or damaged one: None)."""
    path = Path(directory) / MARKER
    if not path.is_file() or path.is_symlink():
        return None
    try:
        data = read_json(path, OutputError, max_bytes=MARKER_BYTES, max_depth=4)
    except OutputError:
        return None
    if not (isinstance(data, dict) and data.get("written_by") == "esmc-mlx" and isinstance(data.get("kind"), str)):
        return None
    entries = data.get("entries", [])
    data["entries"] = [e for e in entries if _plain_name(e)] if isinstance(entries, list) else []
    return data


def _plain_name(name) -> bool:
    """A name inside one folder: no separator, not ``.`` or ``..`` (what a marker or a manifest
    may name; anything else is never read as one of esmc-mlx's entries)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def add_to_marker(directory: Path, *names: str) -> None:
    """Record ``names`` as esmc-mlx's in a marked directory (validate's report folder, the card)."""
    data = read_marker(directory)
    if data is not None and not set(names) <= set(data["entries"]):
        extra = {k: v for k, v in data.items() if k not in ("written_by", "version", "kind", "entries")}
        write_marker(directory, data["kind"], [*data["entries"], *names], **extra)


def _legacy_model_entries(directory: Path) -> set[str] | None:
    """What a model directory from before the marker holds of its own (its config.json says
    esmc-mlx converted it): config.json, tokenizer files, the index and the weights it names."""
    try:
        config = read_json(Path(directory) / "config.json", OutputError, max_bytes=1 << 20)
        if config["esmc_mlx"]["converter"]["name"] != "esmc-mlx":
            return None
    except (OutputError, KeyError, TypeError):
        return None
    ours = {"config.json", SINGLE_FILE, *TOKENIZER_FILES}
    index = Path(directory) / INDEX_FILE
    if index.is_file():
        with contextlib.suppress(EsmcMlxError):
            ours |= {INDEX_FILE, *(f.name for f in index_files(index))}
    return ours


def marker_kind(directory: Path) -> str | None:
    """The kind of esmc-mlx output ``directory`` is (its marker's; ``model`` for a model
    directory from before the marker), or None."""
    marker = read_marker(directory)
    if marker is not None:
        return marker["kind"]
    return "model" if (Path(directory) / "config.json").is_file() and _legacy_model_entries(directory) else None


# --- what runs make beside an output: staging folders and their leftovers -----------------------------
def make_staging(parent: Path, target: str, stage: str) -> Path:
    """A new hidden folder ``parent/.TARGET.STAGE-PID-RANDOM`` for work on ``target``, carrying
    esmc-mlx's marker that names it (``staged_as``) and this process: what lets a later run tell
    it from a user's folder of a similar name."""
    path = Path(parent) / f".{target}.{stage}-{os.getpid()}-{_token()}"
    try:
        path.mkdir()  # mode 0777 & ~umask
        payload = {
            "written_by": "esmc-mlx",
            "version": __version__,
            "kind": "staging",
            "stage": stage,
            "for": target,
            "staged_as": path.name,
            "pid": os.getpid(),
            "entries": [],
        }
        with open(path / MARKER, "x") as f:
            f.write(json.dumps(payload) + "\n")
    except OSError as e:
        with contextlib.suppress(OSError):
            shutil.rmtree(path)
        raise write_error(e, path) from None
    return path


def staging_mark(path: Path) -> dict | None:
    """The marker of a folder some run made beside an output (``make_staging``), when ``path``
    is one: a real folder whose marker was written under this very name. Else None."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return None
    marker = read_marker(path)
    if marker is None or marker.get("staged_as") != path.name or not isinstance(marker.get("pid"), int):
        return None
    return marker


def leftovers(target: Path | None = None, folder: Path | None = None) -> list[tuple[Path, Path, str, int]]:
    """(path, the output it was for, stage, pid) of every folder a run made beside ``target``
    (or beside anything in ``folder``), recognised by its marker alone."""
    folder = Path(folder) if folder is not None else Path(target).parent
    prefix = f".{Path(target).name}." if target is not None else "."
    found = []
    try:
        candidates = [p for p in folder.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    for path in sorted(candidates):
        mark = staging_mark(path)
        if mark is None or not _plain_name(mark.get("for")):
            continue
        if target is not None and mark["for"] != Path(target).name:
            continue
        found.append((path, folder / mark["for"], str(mark.get("stage")), mark["pid"]))
    return found


def clean_leftovers(target: Path | None = None, folder: Path | None = None) -> list[Path]:
    """Remove what runs that are gone left beside ``target`` (or anywhere in ``folder``) and
    warn naming each. An old output set aside by a run killed between its two renames is put
    back when ``target`` is missing."""
    removed = []
    for path, its_target, stage, pid in leftovers(target, folder):
        if _alive(pid):
            continue
        kept = path / its_target.name
        if stage == "old" and os.path.lexists(kept) and not os.path.lexists(its_target):
            os.replace(kept, its_target)
            warnings.warn(
                f"restored {its_target} from {path.name}, left by a run (PID {pid}) killed while replacing it",
                EsmcMlxWarning,
                stacklevel=3,
            )
        _remove(path)
        removed.append(path)
        warnings.warn(
            f"removed {path}, left by a run that was interrupted (PID {pid}, no longer running)",
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


def _own_leftover(path: Path) -> bool:
    """A lock file or staging folder esmc-mlx makes beside what it writes (a killed run leaves
    them), known by its content, never by its name alone."""
    path = Path(path)
    if staging_mark(path) is not None:
        return True
    if not (path.name.startswith(".") and path.name.endswith(".lock") and path.is_file() and not path.is_symlink()):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(len(LOCK_MARK))
    except OSError:
        return False
    return head in (b"", LOCK_MARK)  # empty: made a moment ago by a run that has not written it yet


# --- the lock -------------------------------------------------------------------------------------
def lock_path(target: Path) -> Path:
    return Path(target).parent / f".{Path(target).name}.lock"


# What opening a lock file in a folder we may not write in raises.
READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


def _open_lock(path: Path) -> int:
    """A descriptor of the lock file ``path``, made if missing; OutputError for a file of that
    name that esmc-mlx did not make (it is never written to or removed)."""
    for _ in range(100):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:  # its holder removed it meanwhile: make it again
            continue
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            fd = None
        if fd is None or not _own_leftover(path):
            if fd is not None:
                os.close(fd)
            raise OutputError(
                f"{path} is in the way: esmc-mlx locks this output with a file of that name, and this one is not "
                "esmc-mlx's; move it, or choose another output"
            )
        return fd
    raise OutputError(f"cannot take the lock {path}: it keeps disappearing")


@contextlib.contextmanager
def output_lock(target: str | Path, create_parent: bool = True, optional: bool = False) -> Iterator[bool]:
    """Hold an exclusive lock on the output path ``target`` (a file ``.NAME.lock`` beside it,
    holding esmc-mlx's mark and the holder's PID, removed on release). A second holder fails at
    once with OutputError naming the first's PID. The kernel drops the lock when its process
    dies, so a killed run never blocks the next. ``create_parent=False``: a missing parent
    folder is an error instead. ``optional``: for a caller that only reads ``target`` or writes
    inside it (push, validate), a folder it may not write in means going on unlocked: no
    esmc-mlx run can replace ``target`` there either. Yields whether the lock is held."""
    target = Path(target)
    path = lock_path(target)
    made = _first_missing(target) if create_parent else None
    if create_parent:
        ensure_parent(target)
    elif not target.parent.is_dir():
        raise OutputError(f"{target}: no such directory {target.parent}")
    while True:
        try:
            fd = _open_lock(path)
        except OutputError:
            _remove_made(target, made)
            raise
        except OSError as e:
            _remove_made(target, made)
            if not (optional and e.errno in READ_ONLY):
                raise write_error(e, path) from None
            fd = None
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = os.pread(fd, 64, 0).decode(errors="replace").removeprefix(LOCK_MARK.decode()).strip()
            os.close(fd)
            _remove_made(target, made)
            raise OutputError(
                f"{target} is being written by another esmc-mlx run (PID {held or 'unknown'}); wait for it "
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
        os.pwrite(fd, LOCK_MARK + f" {os.getpid()}\n".encode(), 0)
        yield True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still holding it: whoever opened the old file fails its check above
        os.close(fd)
        _remove_made(target, made)


def _around_output(parameter, when: Callable[[dict], bool], context: Callable[[object, dict], object]):
    """Decorator: run the function inside ``context(output, arguments)``, the output being its
    argument ``parameter`` (or what ``parameter(arguments)`` returns), when that is not None and
    ``when(arguments)``."""

    def decorate(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            target = parameter(bound.arguments) if callable(parameter) else bound.arguments.get(parameter)
            if target is None or not when(bound.arguments):
                return function(*args, **kwargs)
            with context(target, bound.arguments):
                return function(*args, **kwargs)

        return wrapper

    return decorate


def locked(
    parameter: str, when: Callable[[dict], bool] = lambda args: True, create_parent: bool = True, optional: bool = False
):
    """Decorator: hold ``output_lock`` on the function's argument ``parameter`` (when it is not
    None and ``when(arguments)``) for the whole call, leftovers of dead runs cleaned first."""

    @contextlib.contextmanager
    def lock(target, arguments):
        with output_lock(target, create_parent, optional) as held_lock:
            if held_lock:  # (unlocked: a read-only folder, where no run left anything since)
                clean_leftovers(Path(target))
            try:
                yield
            except KeyboardInterrupt:  # (validate's report, push's card: each file written whole)
                note_stopped(f"nothing in {target} was left half-written")
                raise

    return _around_output(parameter, when, lock)


# --- what is ours in a directory --------------------------------------------------------------------
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
        ours = set(marker["entries"])
    else:
        ours = _legacy_model_entries(directory)
        if ours is None:
            return None
    foreign = [
        n for n in present if n not in ours and not _later_product(directory, n) and not _own_leftover(directory / n)
    ]
    report = directory / REPORT_DIR
    if REPORT_DIR in present and REPORT_DIR not in foreign and report.is_dir() and not report.is_symlink():
        # the report folder is ours while it holds only the report's files
        inside = sorted(p for p in report.iterdir() if p.name != MARKER)
        foreign += [f"{REPORT_DIR}/{p.name}" for p in inside if p.name not in REPORT_FILES and not _own_leftover(p)]
    return foreign


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


def check_sources(out: str | Path, sources: Iterable[str | Path] = (), option: str = "the output") -> None:
    """OutputError when ``out`` is, contains or lies inside one of the inputs ``sources``."""
    real = _real(out)
    for source in sources:
        if source is None:
            continue
        s = _real(source)
        if _is_within(s, real):
            what = "is" if s == real else "contains"
            raise OutputError(f"{option} {out} {what} the input {_input(source)}; write the output somewhere else")
        if s.is_dir() and _is_within(real, s):  # it would become part of the input (and its upload)
            raise OutputError(f"{option} {out} is inside the input {_input(source)}; write the output somewhere else")


def check_not_inside_output(out: str | Path, hosts: Iterable[str] = (), option: str = "the output") -> None:
    """OutputError when ``out`` lies inside a directory esmc-mlx wrote (a model, an embeddings
    or scan folder ...) whose kind is not one of ``hosts``: it would become part of that output,
    and of a model's next upload."""
    real = _real(out)
    for folder in real.parents:
        kind = marker_kind(folder)
        if kind is not None and kind not in hosts:
            raise OutputError(f"{option} {out} is inside {folder}, {_a(kind)} esmc-mlx wrote; write it somewhere else")


def check_target(
    out: str | Path,
    force: bool,
    sources: Iterable[str | Path] = (),
    create_parent: bool = False,
    kind: str | tuple[str, ...] = "model",
) -> None:
    """Fail before any work when the output directory ``out`` cannot be (re)placed: it exists and
    ``force`` is off; it is, contains or lies inside one of ``sources`` or another esmc-mlx
    output; or, with ``force``, it is a file, a link, the current directory or one holding it, a
    directory esmc-mlx did not write (or wrote as another kind than ``kind``, or than each of
    the kinds a tuple names), or one holding files esmc-mlx did not write."""
    out = Path(out)
    exists = os.path.lexists(out)
    if out.is_symlink() and not out.exists():  # "already exists" would puzzle: ls shows nothing usable
        raise OutputError(
            f"{out} is a link to {os.readlink(out)}, which does not exist; remove the link or choose another output"
        )
    if exists and not force:
        raise OutputError(f"{out} already exists; pass --force to replace it")
    sources = list(sources)
    check_sources(out, sources)
    check_not_inside_output(out)
    if exists:
        refuse = f"--force will not replace {out}:"
        if _is_within(Path.cwd().resolve(), out.resolve()):
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
        there = marker_kind(out)
        kinds = (kind,) if isinstance(kind, str) else tuple(kind)
        if there not in kinds:
            wanted = " or ".join(map(_a, kinds))
            raise OutputError(f"{refuse} it holds an esmc-mlx {there}, not {wanted}; choose another output")
        if foreign:
            raise OutputError(
                f"{refuse} it holds files esmc-mlx did not write ({_listing(foreign)}); move them out first"
            )
    ensure_parent(out, create_parent)


def check_folder_target(
    out: str | Path,
    kind: str,
    sources: Iterable[str | Path] = (),
    legacy: Callable[[Path], Iterable[str] | None] | None = None,
    hosts: Iterable[str] = (),
    option: str = "-o",
) -> None:
    """Fail before any work when ``out`` cannot be the folder of a ``kind`` output: a file; an
    input, holding one or inside one; inside another esmc-mlx output (but one of ``hosts``);
    a folder of another kind; or a folder esmc-mlx did not make that is not empty (``legacy``
    may recognise a folder of this kind written before the marker, by its content)."""
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise OutputError(f"{option} {out}: a link to {os.readlink(out)}, which does not exist")
    if os.path.lexists(out) and not out.is_dir():
        raise OutputError(f"{option} {out}: a file, not a folder; give a folder for the {kind} output")
    check_sources(out, sources, f"{option}")
    check_not_inside_output(out, hosts, f"{option}")
    if not out.is_dir():
        ensure_parent(out, create=False)
        return
    there = marker_kind(out)
    if there is not None and there != kind:
        raise OutputError(f"{option} {out} holds an esmc-mlx {there}, not {kind} output; choose another folder")
    held_there = _visible(out) if there is None else []
    if held_there and (legacy is None or legacy(out) is None):
        raise OutputError(
            f"{option} {out} is a folder esmc-mlx did not make (no {MARKER} marker) and it is not empty (it holds "
            f"{_listing(sorted(held_there), 3)}): esmc-mlx writes only into a new or empty folder, or one it made; "
            "choose another"
        )
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {out}: not writable")


def _visible(directory: Path) -> list[str]:
    """What ``directory`` holds besides esmc-mlx's own lock files and staging folders."""
    return [p.name for p in Path(directory).iterdir() if not _own_leftover(p)]


def check_file_target(
    path: str | Path, option: str = "-o", sources: Iterable[str | Path] = (), force: bool = False
) -> None:
    """Fail before any work when the output file ``path`` cannot be written: its directory is
    missing or not writable, the path is a directory, it is one of the input files ``sources``
    or inside an input folder, it lies inside an esmc-mlx output, or, without ``force``, it is a
    file esmc-mlx did not write (``wrote``). The file is replaced whole (``atomic_file``)."""
    path = Path(path)
    sources = [s for s in sources if s is not None]
    for source in sources:
        with contextlib.suppress(OSError):
            if os.path.samefile(path, source):
                raise OutputError(f"{option} {path} is the input {_input(source)}; write the output somewhere else")
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
    for source in sources:
        if Path(source).is_dir() and _is_within(target, _real(source)):
            raise OutputError(f"{option} {path} is inside the input {_input(source)}; write the output somewhere else")
    check_not_inside_output(path, option=option)
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: {path.parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{option} {path}: the file is not writable")
    if path.exists() and not force and not wrote(path):
        blind = " (esmc-mlx's cache is off, ESMC_MLX_CACHE=off, so it cannot tell its own files)"
        raise OutputError(
            f"{option} {path}: the file is there and esmc-mlx did not write it (or it was changed since)"
            f"{blind if _ledger_path() is None else ''}; pass --force to replace it, or choose another name"
        )


# --- the files esmc-mlx wrote ------------------------------------------------------------------------
# A file carries no marker, so what esmc-mlx wrote is remembered in its cache: the real path, size
# and sha256 of each output file, as it was written. A rerun replaces such a file; a file of the
# user's (or one edited since) needs --force.
WRITTEN = "written.json"
WRITTEN_LIMIT = 20_000  # files remembered, the oldest forgotten first (~2 MB)
WRITTEN_BYTES = 16 << 20


def _ledger_path() -> Path | None:
    try:
        root = settings.current().cache
    except EsmcMlxError:
        return None
    return None if root is None else Path(root) / WRITTEN


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_ledger(path: Path) -> dict:
    try:
        data = read_json(path, OutputError, max_bytes=WRITTEN_BYTES, max_depth=3)
    except OutputError:  # missing, damaged, someone else's: as if empty (files then need --force)
        return {}
    return data if isinstance(data, dict) else {}


def wrote(path: str | Path) -> bool:
    """Whether esmc-mlx wrote the file ``path`` as it is now (same size and sha256 as it wrote)."""
    ledger = _ledger_path()
    if ledger is None or not ledger.is_file():
        return False
    real = _real(path)
    entry = _read_ledger(ledger).get(str(real))
    if not (isinstance(entry, list) and len(entry) == 2):
        return False
    try:
        return real.stat().st_size == entry[0] and _file_digest(real) == entry[1]
    except OSError:
        return False


def remember_written(path: str | Path) -> None:
    """Remember that esmc-mlx wrote ``path`` as it is now, so that a later run may replace it
    without --force. A cache that is off, read-only or full only costs that."""
    ledger = _ledger_path()
    if ledger is None:
        return
    real = _real(path)
    try:
        entry = [real.stat().st_size, _file_digest(real)]
        ledger.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(ledger.with_name(WRITTEN + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # runs that finish together each add their file
            data = _read_ledger(ledger)
            data.pop(str(real), None)
            data[str(real)] = entry
            for old in list(data)[: max(0, len(data) - WRITTEN_LIMIT)]:
                del data[old]
            with atomic_file(ledger) as f:
                json.dump(data, f, indent=0)
        finally:
            os.close(fd)
    except (OSError, OutputError):
        pass


# --- writing --------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", **open_kwargs) -> Iterator:
    """Open a new file in a staging folder beside ``path`` for writing; on success it replaces
    ``path`` whole, on any error it is removed (a full disk becomes OutputError naming
    ``path``). A link is kept: the file it points to is replaced. A device or a pipe (``-o
    /dev/null``, ``/dev/stdout``, a FIFO) is written in place: a rename would put a regular
    file where it was (as root, /dev/null for every program)."""
    path = Path(path)
    if written_in_place(path):
        with open(path, mode, **open_kwargs) as f:
            yield f
        return
    path = path.resolve() if path.is_symlink() else path
    stage = make_staging(path.parent, path.name, "tmp")
    tmp = stage / "new"  # (not the file's own name: that may be the marker's)
    try:
        with open(tmp, "x" + mode.replace("w", ""), **open_kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException as e:
        if disk_full(e, path):  # judged before the staging goes (removing it frees the space)
            shutil.rmtree(stage, ignore_errors=True)
            raise disk_full_error(path) from None
        if isinstance(e, OSError) and getattr(e, "filename", None) in (str(tmp), str(path)):
            shutil.rmtree(stage, ignore_errors=True)
            raise OutputError(f"cannot write {path}: {e.strerror}") from None
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


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


class StagedFiles:
    """Several files of one folder written in a staging folder beside them and moved into place
    together when the block ends without an error (a scan's files of one protein); on an error
    none of them is, and the staging goes. ``path(name)`` is where to write ``name``; ``check``
    refuses a name before anything is written, ``claim`` takes each name just before the files
    go into place (an ``OutputFolder`` records them in its marker then)."""

    def __init__(self, folder: Path, check: Callable[[str], object] = None, claim: Callable[[str], object] = None):
        self.folder = Path(folder)
        self._check = check or (lambda name: None)
        self._claim = claim or (lambda name: None)
        self.stage: Path | None = None
        self.names: list[str] = []

    def __enter__(self) -> StagedFiles:
        self.stage = make_staging(self.folder, "files", "tmp")
        return self

    def path(self, name: str) -> Path:
        self._check(name)
        self.names.append(name)
        return self.stage / name

    def open(self, name: str, mode: str = "w", **open_kwargs):
        return open(self.path(name), "x" + mode.replace("w", ""), **open_kwargs)

    def __exit__(self, kind, error, traceback) -> bool:
        try:
            if error is None:
                for name in self.names:
                    self._claim(name)
                for name in self.names:
                    os.replace(self.stage / name, self.folder / name)
            elif disk_full(error, self.stage):  # judged before the staging goes (that frees the space)
                shutil.rmtree(self.stage, ignore_errors=True)
                raise disk_full_error(self.folder / self.names[-1] if self.names else self.folder) from None
        finally:
            shutil.rmtree(self.stage, ignore_errors=True)
        return False


_HELD: dict[Path, object] = {}  # the guards this process holds, by the real path of their output
_STOPPED: list[str] = []  # what each guard left, said when a run is stopped (Ctrl-C, SIGTERM)


def note_stopped(note: str) -> None:
    """Say ``note`` in the Stopped line of a run stopped by Ctrl-C or SIGTERM (``stopped_notes``):
    what a guard, or a job inside one, left at its output."""
    _STOPPED.append(note)


def stopped_notes() -> list[str]:
    """What the guards of a run stopped by Ctrl-C or SIGTERM left at their outputs, one sentence
    each (``OUT is as it was``, ``OUT keeps ...; the same command resumes``), once: the command
    line prints them in place of click's bare ``Aborted!``."""
    notes = list(dict.fromkeys(_STOPPED))
    _STOPPED.clear()
    return notes


def held(path: str | Path):
    """The guard this process holds on ``path`` (an ``OutputFolder``, ``StagedDirectory`` or
    ``OutputFile``), or None: how a function under ``@guarded`` reaches it."""
    return _HELD.get(_real(path))


class StagedDirectory:
    """An output directory built aside and put in place whole, under the output's lock.

    ``with StagedDirectory(out, force, sources, kind) as stage:`` checks the target, takes the
    lock, removes leftovers of dead runs and creates ``stage.path``. Write there, then
    ``publish()`` (marker, then swap into place) or ``keep_failed()`` (move aside as
    ``OUT.failed-<time>``, the old output untouched). Leaving the block without either removes
    the staging; a full disk becomes one OutputError naming the file.
    """

    def __init__(self, out: str | Path, force: bool = False, sources: Iterable[str | Path] = (), kind: str = "model"):
        self.out = Path(out)
        self.force = force
        self.sources = list(sources)
        self.kind = kind
        self.path: Path | None = None
        self.done: Path | None = None  # where the staging went: out, or the failed copy
        self.existed = False
        self._made: Path | None = None  # the topmost folder made for out, removed if nothing came of it
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StagedDirectory:
        self._made = _first_missing(self.out)
        self.existed = os.path.lexists(self.out)
        try:
            check_target(self.out, self.force, self.sources, create_parent=True, kind=self.kind)
            with self._stack:
                self._stack.enter_context(output_lock(self.out))
                clean_leftovers(self.out)
                check_target(self.out, self.force, self.sources, kind=self.kind)  # another run may have finished
                self.path = make_staging(self.out.parent, self.out.name, "partial")
                _HELD[_real(self.out)] = self
                self._stack.callback(_HELD.pop, _real(self.out), None)
                self._stack = self._stack.pop_all()
        except BaseException:
            _remove_made(self.out, self._made)
            raise
        return self

    def _seal(self) -> None:
        write_marker(self.path, self.kind, staged_as=self.path.name)
        apply_umask(self.path)

    def publish(self) -> Path:
        self._seal()
        if os.path.lexists(self.out):  # --force, checked: set the old one aside, swap, then delete it
            aside = make_staging(self.out.parent, self.out.name, "old")
            old = aside / self.out.name
            try:
                os.replace(self.out, old)
                os.replace(self.path, self.out)
            except BaseException:  # Ctrl-C or an error between the two renames: the old one goes back
                if os.path.lexists(old) and not os.path.lexists(self.out):
                    os.replace(old, self.out)
                raise
            finally:
                shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(self.path, self.out)
        self.done = self.out
        return self.out

    def keep_failed(self) -> Path:
        """Move the staging aside as ``OUT.failed-<time>`` (named in the caller's error)."""
        self._seal()
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
        if isinstance(error, KeyboardInterrupt):
            if self.done is not None:
                note_stopped(f"{self.done} was written before the stop")
            else:
                note_stopped(f"{self.out} is as it was" if self.existed else f"{self.out} was not written")
        if full:  # named where it was going: the staging is gone (a writer that knows the file names it)
            raise disk_full_error(Path(getattr(error, "filename", None) or self.out)) from None
        return False


class OutputFolder:
    """A folder esmc-mlx adds files to, run after run (embed, scan, a report folder).

    ``with OutputFolder(out, kind, sources) as folder:`` checks the target
    (``check_folder_target``), takes the lock and removes leftovers of dead runs beside and
    inside it. ``folder.file(name)`` writes one file whole and records it in the marker;
    ``folder.files()`` writes several that go into place together; ``clear()`` removes what
    esmc-mlx wrote there (``--force``). The folder is made, with its marker, at the first
    write. A folder this run made is removed again when the run fails before ``commit()``
    (the first result worth keeping for a rerun to resume from)."""

    def __init__(
        self,
        out: str | Path,
        kind: str,
        sources: Iterable[str | Path] = (),
        legacy: Callable[[Path], Iterable[str] | None] | None = None,
        hosts: Iterable[str] = (),
        resumable: bool = True,
    ):
        self.path = Path(out)
        self.kind = kind
        self.sources = list(sources)
        self.legacy = legacy
        self.hosts = tuple(hosts)
        self.resumable = resumable  # what the job does on a rerun: go on from what the folder holds
        self.created = False
        self.kept = False
        self._made: Path | None = None
        self._stack = contextlib.ExitStack()

    def _check(self) -> None:
        check_folder_target(self.path, self.kind, self.sources, self.legacy, self.hosts)

    def __enter__(self) -> OutputFolder:
        self._made = _first_missing(self.path)
        self._check()
        with self._stack:
            self._stack.enter_context(output_lock(self.path))
            clean_leftovers(self.path)
            self._check()  # another run may have made it meanwhile
            if self.path.is_dir():
                clean_leftovers(folder=self.path)
            _HELD[_real(self.path)] = self
            self._stack.callback(_HELD.pop, _real(self.path), None)
            self._stack = self._stack.pop_all()
        return self

    def make(self) -> Path:
        """The folder, made (with its marker) if it is not there yet; an empty folder or one
        ``legacy`` recognises gets the marker now."""
        if not self.path.exists():
            try:
                self.path.mkdir(parents=True)
            except OSError as e:
                raise write_error(e, self.path) from None
            self.created = True
            write_marker(self.path, self.kind, [])
        elif read_marker(self.path) is None:
            entries = (self.legacy(self.path) if self.legacy else None) or []
            write_marker(self.path, self.kind, entries)
        return self.path

    def owns(self, name: str) -> bool:
        marker = read_marker(self.path)
        return marker is not None and name in marker["entries"]

    def record(self, *names: str) -> None:
        """Enter ``names`` in the marker as esmc-mlx's (before they are written)."""
        self.make()
        add_to_marker(self.path, *names)

    def check_free(self, name: str) -> Path:
        """``OUT/name``, when esmc-mlx may write it: OutputError when a file of that name is
        there and esmc-mlx did not write it (or the name leaves the folder)."""
        if not _plain_name(name):
            raise OutputError(f"{name!r} is not a file name inside {self.path}")
        path = self.path / name
        if os.path.lexists(path) and not self.owns(name):
            raise OutputError(
                f"{path} is there and esmc-mlx did not write it; move it out of {self.path} or choose another folder"
            )
        return path

    def claim(self, name: str) -> Path:
        """``OUT/name`` for esmc-mlx to write (``check_free``), recorded as its own."""
        path = self.check_free(name)
        self.record(name)
        return path

    def file(self, name: str, mode: str = "w", **open_kwargs):
        """Write ``OUT/name`` whole (``atomic_file``), recorded as esmc-mlx's."""
        return atomic_file(self.claim(name), mode, **open_kwargs)

    def files(self) -> StagedFiles:
        """Several files of OUT written together (``StagedFiles``), each recorded."""
        return StagedFiles(self.make(), self.check_free, self.claim)

    def remove(self, *names: str) -> None:
        """Remove the entries ``names`` esmc-mlx wrote here (a checkpoint once the result is
        complete) and drop them from the marker; a name esmc-mlx did not write is left alone."""
        marker = read_marker(self.path)
        ours = [n for n in names if marker is not None and n in marker["entries"]]
        for name in ours:
            _remove(self.path / name)
        if ours:
            extra = {k: v for k, v in marker.items() if k not in ("written_by", "version", "kind", "entries")}
            write_marker(self.path, marker["kind"], [e for e in marker["entries"] if e not in ours], **extra)

    def foreign(self) -> list[str]:
        found = foreign_entries(self.path) if self.path.is_dir() else []
        return found or []

    def clear(self) -> None:
        """Remove every entry esmc-mlx wrote here (``--force``); OutputError, touching nothing,
        when the folder holds anything else."""
        if not self.path.is_dir():
            return
        foreign = self.foreign()
        if foreign:
            raise OutputError(
                f"--force will not clear {self.path}: it holds files esmc-mlx did not write ({_listing(foreign)}); "
                "move them out first"
            )
        self.make()
        for name in read_marker(self.path)["entries"]:
            _remove(self.path / name)
        write_marker(self.path, self.kind, [])

    def commit(self) -> None:
        """The folder now holds a result worth keeping, also if the run fails later."""
        self.kept = True

    def __exit__(self, kind, error, traceback) -> bool:
        try:
            if error is not None and self.created and not self.kept:
                shutil.rmtree(self.path, ignore_errors=True)  # made by this run, nothing worth keeping
        finally:
            self._stack.close()
            if not self.path.exists():
                _remove_made(self.path, self._made)
        if isinstance(error, KeyboardInterrupt):
            note_stopped(self._stop_note())
        return False

    def _stop_note(self) -> str:
        if not self.path.exists():
            return f"{self.path} was not written"
        again = "; run the same command again to go on from there" if self.resumable else ""
        if self.kept:
            return f"{self.path} keeps what this run finished, each file whole{again}"
        return f"{self.path} is as it was{again}"


class OutputFile:
    """One output file, replaced whole: ``with OutputFile(path, sources, force) as out:`` checks
    it (``check_file_target``: a file esmc-mlx did not write is replaced only with ``force``),
    locks it and removes leftovers of dead runs beside it; ``out.open(mode)`` writes it
    (``atomic_file``) and remembers it as esmc-mlx's. A device or pipe is written in place."""

    def __init__(self, path: str | Path, sources: Iterable[str | Path] = (), option: str = "-o", force: bool = False):
        self.path = Path(path)
        self.sources = list(sources)
        self.option = option
        self.force = force
        self.existed = False
        self.written = False
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> OutputFile:
        check_file_target(self.path, self.option, self.sources, self.force)
        self.existed = os.path.lexists(self.path)
        with self._stack:
            if not written_in_place(self.path):  # (a device or pipe: nothing to lock or clean)
                self._stack.enter_context(output_lock(self.path, create_parent=False))
                clean_leftovers(self.path)
            _HELD[_real(self.path)] = self
            self._stack.callback(_HELD.pop, _real(self.path), None)
            self._stack = self._stack.pop_all()
        return self

    @contextlib.contextmanager
    def open(self, mode: str = "w", **open_kwargs) -> Iterator:
        with atomic_file(self.path, mode, **open_kwargs) as f:
            yield f
        self.written = True
        if not written_in_place(self.path):
            remember_written(self.path)

    def __exit__(self, kind, error, traceback) -> bool:
        self._stack.close()
        if isinstance(error, KeyboardInterrupt) and not self.written:
            note_stopped(f"{self.path} is as it was" if self.existed else f"{self.path} was not written")
        return False


def guard(
    path: str | Path,
    kind: str,
    mode: str,
    *,
    force: bool = False,
    inputs: Iterable[str | Path] = (),
    legacy: Callable[[Path], Iterable[str] | None] | None = None,
    hosts: Iterable[str] = (),
    resumable: bool = True,
):
    """The guard for an output of ``kind`` at ``path`` (a context manager): ``mode`` is
    ``directory`` (``StagedDirectory``; ``force`` replaces one esmc-mlx wrote), ``folder``
    (``OutputFolder``; ``resumable``: a rerun goes on from what it holds) or ``file``
    (``OutputFile``; ``force`` replaces a file esmc-mlx did not write); ``inputs``: the paths the
    command reads (the output may be none of them, hold none and lie inside none). Within a
    guard this process already holds on ``path``, the same guard (entering and leaving it again
    does nothing)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    current = held(path)
    if current is not None:
        return contextlib.nullcontext(current)
    sources = [p for p in inputs if p is not None]
    if mode == "directory":
        return StagedDirectory(path, force, sources, kind)
    if mode == "folder":
        return OutputFolder(path, kind, sources, legacy, hosts, resumable)
    return OutputFile(path, sources, force=force)


def local_paths(*values) -> list[Path | Found]:
    """What the values name on this machine: a path as given (a model directory, a FASTA ...);
    for an alias or a Hub repo id, the copy already here (``resolve.local_copy``: a packaged
    model, the repo's folder in the HF cache), as a ``Found`` input. A sequence or a loaded
    model is none."""
    found = []
    for value in values:
        if isinstance(value, Found):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += local_paths(*value)
        elif isinstance(value, (str, os.PathLike)) and str(value):
            with contextlib.suppress(OSError, ValueError):
                if os.path.lexists(os.path.expanduser(str(value))):
                    found.append(Path(os.path.expanduser(str(value))))
                elif isinstance(value, str) and (copy := local_copy(value)) is not None:
                    found.append(Found(copy, f"where {value} is kept on this machine"))
    return found


def guarded(
    parameter: str | Callable[[dict], str | Path | None],
    kind: str,
    mode: str,
    inputs: Iterable[str] = (),
    when: Callable[[dict], bool] = lambda args: True,
    legacy: Callable[[Path], Iterable[str] | None] | None = None,
    agree: Callable[[dict, BaseException | None], None] | None = None,
    found: Callable[[dict], Iterable[Found]] | None = None,
):
    """Decorator: run the function inside ``guard`` on its argument ``parameter`` (or on the path
    ``parameter(arguments)`` returns: an output derived from the arguments), when it is not None
    and ``when(arguments)``; ``inputs`` names the arguments that are inputs (``local_paths``:
    those naming something on this machine count), ``found(arguments)`` gives the inputs found
    through what those name (an adapter's base model). A ``file`` output's ``force`` is the
    function's argument ``force`` (a folder's is its job's to act on). The function reaches its
    guard with ``held(path)``. Stacked, one per output.
    ``agree(arguments, error)``: for processes that run the function together (ranks of which
    one writes): called where the guard is taken, with its refusal or None, and with None where
    ``when`` is false, so that every process learns whether the writer may go on."""

    def around(target, arguments):
        if not when(arguments):
            return _agreed(contextlib.nullcontext(), lambda error: agree(arguments, error))
        sources = local_paths(*(arguments.get(name) for name in inputs))
        sources += list(found(arguments)) if found is not None else []
        force = mode == "file" and bool(arguments.get("force"))  # (a folder's --force is its job's)
        taken = guard(target, kind, mode, force=force, inputs=sources, legacy=legacy)
        return taken if agree is None else _agreed(taken, lambda error: agree(arguments, error))

    return _around_output(parameter, when if agree is None else (lambda args: True), around)


@contextlib.contextmanager
def _agreed(context, tell: Callable[[BaseException | None], None]):
    """``context``, telling ``tell`` whether entering it failed (the error) or not (None)."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(context)
        except BaseException as error:
            tell(error)
            raise
        tell(None)
        yield

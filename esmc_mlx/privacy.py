"""What may leave the machine: the public form of local paths, source ids and command lines.

Everything a push uploads (config.json, validation/report.json and report.md, the model card)
is written through these, so it names files relative to the artifact and local sources by their
basename only: no absolute path, hence no user name, home or host layout (docs/reliability.md,
rule 9).
The Hub push checks the result once more before sending (``private_findings``).
"""

from __future__ import annotations

import getpass
import os
import re
import shlex
import socket
from pathlib import Path

# An absolute POSIX path (or one under ~) inside any text: a "/" not preceded by a word, a dot,
# a colon or another slash (so URLs, "and/or", "1/2" and relative paths are left alone), or one
# glued to a short option (-o/abs/out).
_ABSOLUTE = re.compile(r"(?:(?<![\w.:/~-])|(?<=(?<![\w-])-[A-Za-z]))~?(?:/[^\s/'\"`<>|:;,()\[\]{}]+)+/?")
# Access tokens, whoever's they are: Hugging Face (hf_..., api_org_...), GitHub (ghp_...,
# github_pat_...), AWS access key ids. Published, a token is everyone's.
TOKEN_PATTERN = re.compile(
    r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{30,}|api_org_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{40,}|AKIA[0-9A-Z]{16})(?![A-Za-z0-9])"
)


def public_path(path: str | Path, root: str | Path | None = None) -> str:
    """``path`` relative to ``root`` when inside it (``root`` itself: its name); else its basename."""
    path = Path(os.path.expanduser(str(path)))
    if root is not None:
        root = Path(root).resolve()
        resolved = path.resolve()
        if resolved == root:
            return root.name
        if resolved.is_relative_to(root):
            return resolved.relative_to(root).as_posix()
    return path.name or path.as_posix()  # "." stays "." (its resolved name could be the user's)


def public_source_id(source_id: str | None) -> str | None:
    """A source as provenance records it: a Hub repo id or alias as is, a local path by its basename."""
    if not source_id or not (os.path.isabs(source_id) or source_id.startswith("~")):
        return source_id
    return public_path(source_id)


def public_command(command: str | None) -> str | None:
    """The command line with every argument that names a local path cut to its basename:
    ``esmc-convert /home/me/ckpt -o /data/out --q 4`` -> ``esmc-convert ckpt -o out --q 4``;
    also ``-o/abs/out``, ``--output=rel/out`` and relative paths of several parts
    (``SECRET/alice/out``: only a Hub repo id has exactly one ``/``, and one that names a local
    path is cut too)."""
    if not command:
        return command
    try:
        words = shlex.split(command)
    except ValueError:  # unbalanced quotes: scrub what looks like a path
        return scrub(command)
    out = []
    for word in words:
        if word.startswith("--"):
            option, eq, value = word.partition("=")
        elif len(word) > 2 and word[0] == "-" and word[1].isalpha() and word[2] in "/~.":
            option, eq, value = word[:2], "", word[2:]  # -o/abs/out
        else:
            option, eq, value = "", "", word
        out.append(option + eq + (_public_word(value) if value else ""))
    return " ".join(shlex.quote(w) for w in out)


def _public_word(word: str) -> str:
    if "://" in word:
        return word
    local = False
    try:
        local = os.path.exists(os.path.expanduser(word))
    except (OSError, ValueError):
        pass
    if word.startswith(("/", "~", "./", "../")) or word.count("/") > 1 or ("/" in word and local):
        return public_path(word) or word
    return word


def scrub(obj, root: str | Path | None = None):
    """``obj`` (str, dict, list: a report, a provenance record) with every absolute path in its
    strings replaced by ``public_path(path, root)``; the home directory first, so that a home with
    a space in it goes whole."""
    if isinstance(obj, dict):
        return {k: scrub(v, root) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, root) for v in obj]
    if not isinstance(obj, str) or "/" not in obj:
        return obj
    home = str(Path.home())
    text = re.sub(re.escape(home) + r"(?=[/\s'\"]|$)", "~", obj) if len(home) > 1 else obj
    return _ABSOLUTE.sub(lambda m: public_path(m.group(0), root) if m.group(0) != "~" else "~", text)


def find_tokens(text: str, tokens: list[str] = ()) -> bool:
    """Whether ``text`` holds one of ``tokens`` (the ones in use here) or anything shaped like an
    access token (``TOKEN_PATTERN``)."""
    return any(t and t in text for t in tokens) or TOKEN_PATTERN.search(text) is not None


def private_findings(text: str, tokens: list[str] = ()) -> list[str]:
    """What in ``text`` must not be published: an access token, the home directory, an absolute
    path, the user's name as a path component, the host name. Each finding in words, the secret
    itself not repeated."""
    found = []
    if find_tokens(text, tokens):
        found.append("an access token")
    home = str(Path.home())
    if len(home) > 1 and home in text:
        found.append("the home directory")
    paths = _ABSOLUTE.findall(text)
    if paths:
        found.append(f"a local absolute path ({_shorten(paths[0])})")
    user = _user()
    if user and re.search(rf"(?:^|[/\\]){re.escape(user)}(?:[/\\]|$)", text, re.M):
        found.append("the user name")
    host = socket.gethostname().split(".")[0]
    if len(host) >= 4 and host != "localhost" and re.search(rf"\b{re.escape(host)}\b", text):
        found.append("the host name")
    return found


def _user() -> str | None:
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (containers)
        return None


def _shorten(path: str) -> str:
    return path if len(path) <= 40 else path[:18] + "..." + path[-18:]

"""sha256 of files, remembered across processes: the converter hashes its source for provenance,
and validation needs the same hashes for its reference cache (``validate/cache.py``). Hashing a
12 GB checkpoint takes seconds (4.5 s on the H200 host), so each digest is kept in
``<cache>/hashes.json`` under (resolved path, size, mtime): a file changed in place gets a new
stamp and is hashed again. Files are hashed in parallel threads (hashlib releases the GIL).

Where: ``$ESMC_MLX_CACHE`` if set, else ``$XDG_CACHE_HOME/esmc-mlx``, else ``~/.cache/esmc-mlx``
(as huggingface_hub does with HF_HOME). ``ESMC_MLX_CACHE=off`` turns the cache off.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import settings
from .artifact import sha256
from .errors import OutputError
from .outputs import atomic_file


def cache_root() -> Path | None:
    """The esmc-mlx cache directory, or None when ``ESMC_MLX_CACHE=off`` (settings.py)."""
    return settings.current().cache


def _stamp(f: Path) -> str:
    st = f.stat()
    return f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def file_hashes(files: list[Path]) -> dict[str, str]:
    """File name -> sha256 for ``files``, from the memo where the stamp matches, else hashed (and
    remembered, written whole by ``outputs.atomic_file``)."""
    files = [Path(f) for f in files]
    root = cache_root()
    memo_path = root / "hashes.json" if root else None
    try:
        memo = json.loads(memo_path.read_text()) if memo_path and memo_path.exists() else {}
    except (OSError, ValueError):  # unreadable, not JSON, not text
        memo = {}
    if not isinstance(memo, dict):  # a memo some other hand wrote: start again rather than fail the run
        memo = {}
    stamps = {f: _stamp(f) for f in files}
    todo = [f for f in files if stamps[f] not in memo]
    if todo:
        with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
            for f, digest in zip(todo, pool.map(sha256, todo)):
                memo[stamps[f]] = digest
        if memo_path:
            try:
                memo_path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_file(memo_path) as f:
                    json.dump(memo, f, indent=0)
            except (OSError, OutputError):  # a read-only or full cache only costs the hashing next time
                pass
    return {f.name: memo[stamps[f]] for f in files}

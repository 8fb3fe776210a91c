"""What `make install` (so `make demo` and `make test` on a fresh clone) would download, without
installing anything: the pip commands `make -n -B install` prints, resolved together by
``pip install --dry-run --ignore-installed --report``. Fails when the Makefile chose PyTorch's CPU
index and the resolution still holds a CUDA package (nvidia-*, cuda-*, triton, a torch without
``+cpu``).

    python scripts/check_torch_index.py                        # this machine's decision
    python scripts/check_torch_index.py --torch-index URL      # another index, e.g. a local mirror

pip's own configuration on this machine (find-links, mirrors, constraints) is set aside, so the
answer is what a machine that reaches PyPI and the index gets. Needs make and the network.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
CUDA = re.compile(r"^(nvidia-|cuda-|triton$)")


def make_pip_options(make_args: list[str]) -> tuple[list[str], bool]:
    """The options and requirements of every `pip install` the Makefile would run (the pip upgrade
    aside), and whether it chose an extra index for torch."""
    printed = subprocess.run(
        ["make", "-n", "-B", "install", *make_args], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True
    ).stdout  # make's notes (an index that does not answer) go to stderr, shown
    options, cpu_index = [], False
    for line in printed.splitlines():
        words = shlex.split(line)
        if "pip" not in words or "install" not in words or "--upgrade" in words:
            continue
        rest = [w for w in words[words.index("install") + 1 :] if w not in ("-q", "--quiet")]
        cpu_index = cpu_index or ("--extra-index-url" in rest and any("torch==" in w for w in rest))
        options += rest
    return options, cpu_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-index", help="TORCH_INDEX for make (default: the Makefile's own choice)")
    args = parser.parse_args()
    options, cpu_index = make_pip_options([] if args.torch_index is None else [f"TORCH_INDEX={args.torch_index}"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no config file at all: this machine's mirrors are not the question
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
        command += ["--report", str(report), *options]
        print("$", shlex.join(command), flush=True)
        subprocess.run(command, cwd=ROOT, env=env, check=True)
        installs = json.loads(report.read_text())["install"]
    packages = sorted((i["metadata"]["name"], i["metadata"]["version"], i["download_info"]["url"]) for i in installs)
    for name, version, url in packages:
        print(f"  {name} {version}  {urlparse(url).netloc or url}")
    cuda = [f"{n} {v}" for n, v, _ in packages if CUDA.match(n.lower()) or (n == "torch" and "+cpu" not in v)]
    print(f"{len(packages)} packages; torch's CPU index {'chosen' if cpu_index else 'not chosen'}")
    if cuda:
        print(f"CUDA packages: {', '.join(cuda)}")
    if cpu_index and cuda:
        sys.exit("the Makefile chose the CPU index, yet pip would download CUDA packages")


if __name__ == "__main__":
    main()

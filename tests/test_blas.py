"""MLX's CPU GEMMs run on OpenBLAS, nothing else in the process does (torch keeps its own BLAS),
the kernel fits the CPU, and a broken MLX install gives one error line. Each case runs in a
fresh interpreter: what a process has loaded cannot be unloaded."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_torch

from esmc_mlx.testing import child_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS binding is Linux-only")

ROOT = Path(__file__).resolve().parent.parent


def python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=child_env(**(env or {})), capture_output=True, text=True, timeout=300
    )


def report(code: str, env: dict | None = None) -> dict:
    out = python(code, env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


GLOBAL_LOOKUP = """
import ctypes
process = ctypes.CDLL(None)  # dlsym(RTLD_DEFAULT): what any library loaded later would bind to
exported = [s for s in ("cblas_sgemm", "sgemm_", "scipy_cblas_sgemm", "openblas_get_corename") if hasattr(process, s)]
"""


def test_mlx_gemms_run_on_openblas_and_export_nothing():
    r = report(
        GLOBAL_LOOKUP.replace("import ctypes", "import ctypes, json, numpy as np, mlx.core as mx, esmc_mlx")
        + """
from esmc_mlx import _blas
a = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((200, 100)).astype(np.float32)
got = np.array(mx.matmul(mx.array(a), mx.array(b), stream=mx.cpu))
err = float(np.abs(got - a.astype(np.float64) @ b).max())
print(json.dumps({"exported": exported, "serves": _blas.mlx_blas_library(), "loaded": _blas.loaded_path,
                  "info": _blas.info, "err": err}))
"""
    )  # mlx.core imported before esmc_mlx: the order does not matter any more
    if r["loaded"] is None:
        pytest.skip(f"no OpenBLAS on this machine: {r['info']}")
    assert r["serves"] == r["loaded"] and "openblas" in Path(r["loaded"]).name
    assert r["exported"] == [], "esmc_mlx made BLAS symbols visible to every library loaded later"
    assert r["err"] < 1e-3


QUEUED_AT_EXIT = """
import sys
import esmc_mlx
import mlx.core as mx
a = mx.random.normal((1024, 1024))
mx.eval(a)
queued = []
for _ in range(40):
    a = a @ a / 32
    queued.append(a)
mx.async_eval(queued)  # what a scan or an embedding has in flight when Ctrl-C or SIGTERM stops it
sys.exit(1)
"""


def test_exit_with_gemms_still_queued_does_not_hang():
    """Without the atexit wait, OpenBLAS's finalizer stopped its threads under a GEMM still being
    handed out from MLX's thread and hung in 12 of 12 runs of this script (5 of 20 terminated scans)."""
    env = child_env()
    for _ in range(3):
        try:
            out = subprocess.run(
                [sys.executable, "-c", QUEUED_AT_EXIT], env=env, capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            pytest.fail("the process hung at exit with MLX work still queued")
        assert out.returncode == 1, out.stderr


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_torch_keeps_its_own_sgemm():
    requires_torch()
    code = """
import json, os, torch
from esmc_mlx import _blas
lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
print(json.dumps({"lib": lib, "serves": _blas.serving_library(lib, "sgemm_")}))
"""
    r = report("import esmc_mlx\n" + code)
    if r["serves"] is None:
        pytest.skip("this torch build does not call sgemm_ through its GOT")
    assert r["serves"] == r["lib"], f"torch's sgemm_ goes to {r['serves']}"
    # The check sees the failure it guards against: a BLAS opened RTLD_GLOBAL before torch
    # (what esmc_mlx did before) takes torch's sgemm_ calls.
    netlib = next((Path(sys.prefix).glob("lib/python*/site-packages/mlx_cpu.libs/libblas-*.so*")), None)
    if netlib is not None:
        control = report(f"import ctypes, os; ctypes.CDLL({str(netlib)!r}, mode=os.RTLD_GLOBAL)\n" + code)
        assert control["serves"] == os.path.realpath(netlib)


def test_openblas_kernel_fits_the_cpu():
    """OPENBLAS_CORETYPE=Prescott in the environment (as set on some hosts for old builds) gives
    MLX's copy the kernel of the CPU's vector tier all the same; the variable is left as it was."""
    r = report(
        """
import json, os, esmc_mlx
from esmc_mlx import _blas
print(json.dumps({"info": _blas.info, "kernel": _blas.cpu_kernel(), "env": os.environ.get("OPENBLAS_CORETYPE")}))
""",
        {"OPENBLAS_CORETYPE": "Prescott"},
    )
    from esmc_mlx import _blas

    if not r["info"].get("corename") or r["kernel"] is None:
        pytest.skip(f"no OpenBLAS, or no AVX2 on this CPU: {r}")
    best = _blas.AVX512_CORES if r["kernel"] == "SkylakeX" else _blas.AVX2_CORES
    assert r["info"]["corename"].lower() in best, r
    assert r["env"] == "Prescott"


def test_forced_slow_kernel_warns_with_the_rate():
    out = python(
        "import warnings; warnings.simplefilter('always'); import esmc_mlx; "
        "from esmc_mlx import _blas; print(_blas.info)",
        {"ESMC_MLX_BLAS_CORETYPE": "Prescott"},
    )
    assert out.returncode == 0, out.stderr
    if "Prescott" not in out.stdout:
        pytest.skip(f"no OpenBLAS: {out.stdout}")
    from esmc_mlx import _blas

    if _blas.cpu_kernel() is None:
        pytest.skip("Prescott is this CPU's own tier")
    assert "GFLOP/s" in out.stderr and "ESMC_MLX_BLAS_CORETYPE" in out.stderr


@pytest.fixture
def broken_mlx(tmp_path):
    """An `mlx` package whose core fails to load as it does without a backend wheel."""
    fake = tmp_path / "fake" / "mlx"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core.py").write_text(
        'raise ImportError("libmlx.so: cannot open shared object file: No such file or directory")\n'
    )
    return {"PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)])}


@pytest.mark.parametrize("args", [["--help"], ["info", "--help"], []])
def test_broken_mlx_is_one_error_line_for_every_command(broken_mlx, args):
    exe = shutil.which("esmc-mlx", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the esmc-mlx console script is not installed in this environment")
    out = subprocess.run([exe, *args], env={**os.environ, **broken_mlx}, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: MLX is installed without a working backend"), out.stderr
    assert "pip install" in lines[0] and "libmlx.so" in lines[0]


def test_broken_mlx_in_python_is_an_import_error_naming_the_fix(broken_mlx):
    out = subprocess.run(
        [sys.executable, "-c", "import esmc_mlx"],
        env={**os.environ, **broken_mlx},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "ImportError: MLX is installed without a working backend" in out.stderr


def test_cpu_libmlx_in_place_of_the_cuda_one_is_named(tmp_path):
    """mlx-cpu and mlx-cuda-13 ship the same mlx/lib/libmlx.so: with a CUDA package recorded as
    installed but another file in place, the warning names the reinstall that fixes it."""
    info = tmp_path / "mlx_cuda_13-0.32.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx-cuda-13\nVersion: 0.32.4\n")
    # a size that is not the installed file's: 145673817 (mlx-cuda-13's own) was, on a GPU machine
    libmlx = Path(importlib.util.find_spec("mlx.core").origin).parent / "lib" / "libmlx.so"
    (info / "RECORD").write_text(f"mlx/lib/libmlx.so,sha256=x,{libmlx.stat().st_size + 1}\n")
    # Python 3.12's Distribution.files drops RECORD entries missing beside the dist-info (the
    # GPU machine's Python read files == [] and no warning): a placeholder where a real install
    # has the library. mlx.core still loads from its own install, and its libmlx is compared.
    (tmp_path / "mlx" / "lib").mkdir(parents=True)
    (tmp_path / "mlx" / "lib" / "libmlx.so").write_bytes(b"")
    out = python(
        "import warnings; warnings.simplefilter('always'); import esmc_mlx",
        {"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path), os.environ.get("PYTHONPATH", "")])},
    )
    assert out.returncode == 0, out.stderr
    assert "MLX will not use the GPU" in out.stderr
    assert "pip install --force-reinstall --no-deps mlx-cuda-13==0.32.4" in out.stderr
    clean = python("import warnings; warnings.simplefilter('always'); import esmc_mlx")
    assert "MLX will not use the GPU" not in clean.stderr

"""scripts/device_setup.py, the GPU machine's set-up: the wheel's parts travel and join back
byte for byte, and a missing part or wheel stops with one Error: line."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_setup.py"


@pytest.fixture
def setup(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("device_setup", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "WHEELS", tmp_path / "checkout" / ".whl")
    monkeypatch.setattr(module, "STASH", tmp_path / "home" / "stash")
    monkeypatch.setattr(module, "SITE", tmp_path / "home" / "site")
    return module


def test_the_parts_join_back_into_the_wheel(setup, tmp_path):
    wheel = tmp_path / "mlx_cuda_13.whl"
    wheel.write_bytes(np.random.default_rng(0).bytes(250))
    setup.split(wheel, size=100)
    assert [(setup.WHEELS / folder / name).stat().st_size for folder, name in setup.PARTS.items()] == [100, 100, 50]
    setup.STASH.parent.mkdir(parents=True)
    setup.stash()
    assert setup.joined("w.whl").read_bytes() == wheel.read_bytes()


def test_a_wheel_past_its_parts_or_a_missing_part_stops_with_an_error(setup, tmp_path):
    wheel = tmp_path / "big.whl"
    wheel.write_bytes(bytes(301))
    with pytest.raises(SystemExit, match="Error: big.whl is over 3 parts of 100 bytes"):
        setup.split(wheel, size=100)
    assert not setup.WHEELS.exists()  # nothing written
    setup.STASH.mkdir(parents=True)
    (setup.STASH / "part_aa").write_bytes(b"x")
    with pytest.raises(SystemExit, match=r"Error: .*stash holds \['part_aa'\]: run stash"):
        setup.joined("w.whl")
    with pytest.raises(SystemExit, match=r"Error: .whl/c holds no mlx wheel"):
        setup.install()

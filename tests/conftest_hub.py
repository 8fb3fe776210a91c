"""The local test Hub (tests/hub_server.py) for the real ``huggingface_hub`` client, configured the
public way: environment variables.

``huggingface_hub`` reads HF_ENDPOINT, HF_HOME, HF_HUB_DISABLE_XET, ... once, when it is imported.
So this module starts one server for the whole session and sets those variables when it is
imported, and tests/conftest.py imports it before anything imports huggingface_hub: every Hub
request of the test session goes to 127.0.0.1. The ``hub`` fixture gives each test a fresh Hub
(users, repos, faults) and an empty cache. What is read at import only (HF_HUB_OFFLINE) is tested
in a subprocess, which gets the environment before it imports anything.

Import the fixtures into a test module: ``from conftest_hub import hub, no_remote_network  # noqa: F401``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sys
import tempfile
import types
from pathlib import Path

import pytest
from hub_server import HubServer

LOOPBACK = {"127.0.0.1", "::1", "localhost"}

SERVER = HubServer().start()
HOME = Path(tempfile.mkdtemp(prefix="esmc-mlx-test-hf-home-"))
ENV = {
    "HF_ENDPOINT": SERVER.url,
    "HF_HOME": str(HOME),
    "HF_HUB_OFFLINE": "0",
    "HF_HUB_DISABLE_XET": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
}
if "huggingface_hub" in sys.modules:  # too late: its constants hold the real Hub
    raise RuntimeError("tests/conftest_hub.py must be imported before huggingface_hub (see tests/conftest.py)")
os.environ.update(ENV)
for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN_PATH"):
    os.environ.pop(name, None)
atexit.register(shutil.rmtree, HOME, ignore_errors=True)
atexit.register(SERVER.stop)


@pytest.fixture(autouse=True)
def no_remote_network(monkeypatch):
    """Refuse every connection and name lookup that is not loopback: a test that would reach the
    real Hub (or anything else) fails loudly instead."""
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
            raise ConnectionRefusedError(f"test guard: connection to {address} refused (loopback only)")
        return real_connect(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in LOOPBACK and host is not None:
            raise socket.gaierror(f"test guard: name lookup of {host!r} refused (loopback only)")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


class LocalHub(types.SimpleNamespace):
    """What the ``hub`` fixture yields: server, url, state, home (HF_HOME), token_path."""

    def use_token(self, token: str | None) -> None:
        if token is None:
            self.monkeypatch.delenv("HF_TOKEN", raising=False)
        else:
            self.monkeypatch.setenv("HF_TOKEN", token)


@pytest.fixture
def hub(monkeypatch):
    """A fresh local Hub with users alice (write token ``hf_alice``, member of ``my-org``), bob
    (write token ``hf_bob``), a read-only token ``hf_read`` and a fine-grained token without write
    scopes ``hf_fine`` (both alice's). HF_TOKEN is alice's; the cache under HF_HOME is empty."""
    state = SERVER.reset()
    state.add_user("alice", token="hf_alice", orgs=("my-org",))
    state.add_user("bob", token="hf_bob")
    state.add_user("alice", token="hf_read", role="read", orgs=("my-org",))
    state.add_user("alice", token="hf_fine", role="fineGrained", orgs=("my-org",))

    def clean():
        for entry in HOME.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    clean()
    monkeypatch.setenv("HF_TOKEN", "hf_alice")
    yield LocalHub(
        server=SERVER, url=SERVER.url, state=state, home=HOME, token_path=HOME / "token", monkeypatch=monkeypatch
    )
    clean()


# For a subprocess (python -c GUARD + "..."): the same loopback-only guard, installed first.
GUARD = """
import socket as _s
_connect, _gai = _s.socket.connect, _s.getaddrinfo
def _guarded_connect(self, address):
    if self.family in (_s.AF_INET, _s.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
        raise ConnectionRefusedError(f"test guard: connection to {address} refused (loopback only)")
    return _connect(self, address)
def _guarded_getaddrinfo(host, *args, **kwargs):
    if host not in ("127.0.0.1", "::1", "localhost", None):
        raise _s.gaierror(f"test guard: name lookup of {host!r} refused (loopback only)")
    return _gai(host, *args, **kwargs)
_s.socket.connect, _s.getaddrinfo = _guarded_connect, _guarded_getaddrinfo
"""

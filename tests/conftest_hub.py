"""Fixtures that point the real ``huggingface_hub`` client at the local test Hub (tests/hub_server.py).

Import them into a test module: ``from conftest_hub import hub, no_remote_network  # noqa: F401``.

``huggingface_hub`` reads HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE, HF_HUB_DISABLE_XET, ... once, at
import, into ``huggingface_hub.constants``; the fixture sets the environment variables (for
anything that reads them later, and for subprocesses) and patches those constants.
"""

from __future__ import annotations

import socket
import types
from pathlib import Path

import pytest

from hub_server import HubServer

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


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
    """What the ``hub`` fixture yields: server, url, state, home, and helpers to switch identity."""

    def use_token(self, token: str | None) -> None:
        if token is None:
            self.monkeypatch.delenv("HF_TOKEN", raising=False)
        else:
            self.monkeypatch.setenv("HF_TOKEN", token)

    def set_offline(self, offline: bool = True) -> None:
        from huggingface_hub import constants

        self.monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
        self.monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


@pytest.fixture
def hub(tmp_path_factory, monkeypatch):
    """A fresh local Hub with users alice (write token ``hf_alice``, member of ``my-org``), bob
    (write token ``hf_bob``), a read-only token ``hf_read`` and a fine-grained token without write
    scopes ``hf_fine`` (both alice's). HF_TOKEN is alice's; HF_HOME is a fresh temporary folder."""
    from huggingface_hub import constants
    from huggingface_hub import utils as hf_utils
    from huggingface_hub.utils import _http

    home = Path(tmp_path_factory.mktemp("hf_home"))
    server = HubServer().start()
    state = server.state
    state.add_user("alice", token="hf_alice", orgs=("my-org",))
    state.add_user("bob", token="hf_bob")
    state.tokens["hf_read"] = type(state.tokens["hf_alice"])("alice", "read")
    state.tokens["hf_fine"] = type(state.tokens["hf_alice"])("alice", "fineGrained")

    env = {
        "HF_ENDPOINT": server.url, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
        "HF_TOKEN": "hf_alice", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    patches = {
        "ENDPOINT": server.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": server.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_ASSETS_CACHE": str(home / "assets"),
        "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "HF_XET_CACHE": str(home / "xet"), "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        "HF_HUB_OFFLINE": False, "HF_HUB_DISABLE_XET": True, "HF_HUB_DISABLE_TELEMETRY": True,
    }
    for k, v in patches.items():
        monkeypatch.setattr(constants, k, v)
    # The client's own retries sleep 1, 2, 4, 8 s: keep them, but without the waiting.
    sleeps: list[float] = []
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=sleeps.append))
    _http.close_session()  # no pooled connection from an earlier test's server
    bars_were_on = not hf_utils.are_progress_bars_disabled()
    hf_utils.disable_progress_bars()
    try:
        yield LocalHub(server=server, url=server.url, state=state, home=home, monkeypatch=monkeypatch,
                       client_sleeps=sleeps)
    finally:
        _http.close_session()
        server.stop()
        if bars_were_on:
            hf_utils.enable_progress_bars()


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

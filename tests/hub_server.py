"""A real Hugging Face Hub on localhost for tests: olah (`olah-cli`, offline mode) serving git repositories
built in code from the tiny checkpoint, behind a small TCP gate that logs every request and can cut a
download mid-body. huggingface_hub runs its real HTTP code against it (no patched calls).

What olah cannot emulate is written by the gate and said so: a gated repo's refusal (HTTP 403 with
`X-Error-Code: GatedRepo`, the header huggingface_hub's hf_raise_for_status reads). olah answers an unknown
repo and an unknown revision alike with 401 `RepoNotFound`, where the public hub distinguishes them.
docs/hub.md lists the endpoints the tests cover.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ORG = "MiniMaxAI"
MODEL_CARD = """---
license: apache-2.0
library_name: transformers
---
# Tiny-M3

A tiny random MiniMax-M3 checkpoint for porter's tests.
"""
LICENSE_TEXT = "Apache License\nVersion 2.0, January 2004\n\n(tiny test license text)\n"
TAG = "v1.0"
UNUSED_FILES = ("consolidated.safetensors", "training_args.bin")  # beside the indexed shards, like real repos


@dataclass
class MirrorRepo:
    repo_id: str
    folder: Path  # the git work tree olah serves
    main: str  # commit sha of branch main
    tagged: Optional[str] = None  # commit sha of TAG (an older commit than main)
    files: list = field(default_factory=list)  # paths at main


def _git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "porter-tests",
        "GIT_AUTHOR_EMAIL": "tests@porter.invalid",
        "GIT_COMMITTER_NAME": "porter-tests",
        "GIT_COMMITTER_EMAIL": "tests@porter.invalid",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def _commit_all(folder: Path, message: str) -> str:
    _git(folder, "add", "-A")
    _git(folder, "commit", "-q", "-m", message)
    return _git(folder, "rev-parse", "HEAD")


def build_mirrors(root: Path, checkpoints: dict) -> dict:
    """`root/models/<org>/<name>`: one git repo (branch main) per {name: checkpoint dir}. Each gets a
    model card and LICENSE; the first commit is tagged TAG, a second commit on main edits the card, so
    a revision given as the tag resolves to another commit than main."""
    repos = {}
    for name, ckpt in checkpoints.items():
        folder = root / "models" / ORG / name
        shutil.copytree(ckpt, folder)
        (folder / "README.md").write_text(MODEL_CARD)
        (folder / "LICENSE").write_text(LICENSE_TEXT)
        for extra in UNUSED_FILES:  # in the repo, never needed by a conversion: allow_patterns skips them
            (folder / extra).write_bytes(b"unused " * 100)
        _git(folder, "init", "-q", "-b", "main")
        tagged = _commit_all(folder, "tiny checkpoint")
        _git(folder, "tag", TAG)
        (folder / "README.md").write_text(MODEL_CARD + "\nRevised card.\n")
        main = _commit_all(folder, "revise the card")
        files = sorted(_git(folder, "ls-files").splitlines())
        repos[f"{ORG}/{name}"] = MirrorRepo(f"{ORG}/{name}", folder, main, tagged, files)
    return repos


def add_pickle_repo(root: Path, config: Path) -> MirrorRepo:
    """A repo holding only pickle weights (porter must refuse it before downloading them)."""
    folder = root / "models" / ORG / "Tiny-M3-Pickle"
    folder.mkdir(parents=True)
    shutil.copyfile(config, folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled" * 64)
    _git(folder, "init", "-q", "-b", "main")
    return MirrorRepo(
        f"{ORG}/Tiny-M3-Pickle",
        folder,
        _commit_all(folder, "pickle weights"),
        files=["config.json", "pytorch_model.bin"],
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------


@dataclass
class Request:
    method: str
    path: str
    headers: dict  # lower-case names


class Gate:
    """TCP forwarder in front of olah. Logs each request (method, path, headers); `cut_after` closes a
    download mid-body and can keep the hub down until `reopen()`; `gate(repo_id)` answers a repo's
    requests as the hub does for a gated repo."""

    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.cut: Optional[tuple] = None  # (path part, body bytes, down mode) of the next cut
        self.cuts_done = 0
        self.down: Optional[str] = None  # "503", "drop" or None (up)
        self.gated: set[str] = set()
        threading.Thread(target=self._accept, daemon=True, name="hub-gate").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.cut, self.cuts_done, self.down = None, 0, None
            self.gated.clear()

    def cut_after(self, path_part: str, nbytes: int, down="503") -> None:
        """Cut the next GET whose path contains path_part after nbytes of its body; then until reopen(),
        down="503" answers every request with 503, down="drop" closes every connection unanswered (a killed
        server), down=None stays up."""
        self.cut = (path_part, nbytes, down)

    def reopen(self) -> None:
        self.down = None

    def gate(self, repo_id: str) -> None:
        self.gated.add(repo_id)

    def gets(self, path_part: str = "") -> list[Request]:
        """The GET requests whose path contains path_part."""
        return [r for r in self.requests if r.method == "GET" and path_part in r.path]

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        conn = {"budget": None}  # body bytes left before the armed cut of this connection's response
        threading.Thread(target=self._responses, args=(upstream, client, conn), daemon=True).start()
        buf = b""
        try:
            while True:
                head, buf = _read_head(client, buf)
                if head is None:
                    break
                req = _parse(head)
                body_len = int(req.headers.get("content-length", 0))
                while len(buf) < body_len:
                    chunk = client.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
                body, buf = buf[:body_len], buf[body_len:]
                with self.lock:
                    self.requests.append(req)
                    if self.cut and req.method == "GET" and self.cut[0] in req.path and not self.down:
                        conn["budget"], conn["down"], self.cut = self.cut[1], self.cut[2], None
                refusal = self._refusal(req)
                if refusal is not None:
                    client.sendall(refusal)
                    break
                upstream.sendall(_one_request_per_connection(head) + body)
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def _refusal(self, req: Request) -> Optional[bytes]:
        if self.down == "drop":
            return b""
        if self.down:
            return b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        if any(f"/{r}/" in req.path for r in self.gated):
            msg = b"Access to this model is restricted. You must accept its terms to access it."
            return (
                b"HTTP/1.1 403 Forbidden\r\nX-Error-Code: GatedRepo\r\nX-Error-Message: "
                + msg
                + b"\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                + b"Content-Length: %d\r\n\r\n" % len(msg)
                + msg
            )
        return None

    def _responses(self, upstream: socket.socket, client: socket.socket, conn: dict) -> None:
        head = b""  # an armed response's bytes before its header end
        try:
            while True:
                chunk = upstream.recv(65536)
                if not chunk:
                    break
                if conn["budget"] is None:
                    client.sendall(chunk)
                    continue
                if head is not None:
                    head += chunk
                    end = head.find(b"\r\n\r\n")
                    if end < 0:
                        continue
                    client.sendall(head[: end + 4])
                    head, chunk = None, head[end + 4 :]
                client.sendall(chunk[: conn["budget"]])
                conn["budget"] -= min(len(chunk), conn["budget"])
                if conn["budget"] == 0:  # the hub dies mid-body
                    self.down = conn["down"]
                    self.cuts_done += 1
                    break
        except OSError:
            pass
        finally:
            _close(client, upstream)


def _read_head(sock: socket.socket, buf: bytes) -> tuple[Optional[bytes], bytes]:
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None, buf
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    return buf[:end], buf[end:]


def _one_request_per_connection(head: bytes) -> bytes:
    """The request head with `Connection: close`: the server answers with it too, so the client never
    reuses a connection, which would race the server's keep-alive timeout (uvicorn closes idle connections
    after 5 s; a request sent as it does fails, on a real hub too, but not deterministically)."""
    lines = head.split(b"\r\n")
    kept = [ln for ln in lines[1:] if ln and not ln.lower().startswith(b"connection:")]
    return b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""])


def _parse(head: bytes) -> Request:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    pairs = (ln.split(":", 1) for ln in lines[1:] if ":" in ln)
    headers = {k.strip().lower(): v.strip() for k, v in pairs}
    return Request(method, path, headers)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


# ---------------------------------------------------------------------------------------------------------


class HubServer:
    """olah over `mirrors` on a free port, with a Gate in front: `url` is what HF_ENDPOINT should say."""

    def __init__(self, mirrors: Path, scratch: Path, repos: dict):
        self.mirrors, self.scratch, self.repos = mirrors, scratch, repos
        self.proc: Optional[subprocess.Popen] = None
        self.gate: Optional[Gate] = None

    @property
    def url(self) -> str:
        return self.gate.url

    def start(self, timeout: float = 90.0) -> "HubServer":
        exe = shutil.which("olah-cli") or str(Path(sys.executable).with_name("olah-cli"))
        if not Path(exe).exists():
            raise RuntimeError("olah-cli not found: the hub tests need olah (pip install -e '.[test]')")
        port = free_port()
        self.gate = Gate(port)
        config = self.scratch / "olah.toml"
        config.write_text(
            f'[basic]\nhost = "127.0.0.1"\nport = {port}\nmirrors-path = [{json.dumps(str(self.mirrors))}]\n'
            f'repos-path = {json.dumps(str(self.scratch / "repos"))}\nmirror-scheme = "http"\n'
            f'mirror-netloc = "127.0.0.1:{self.gate.port}"\n'
            f'mirror-lfs-netloc = "127.0.0.1:{self.gate.port}"\n'
            "\n[accessibility]\noffline = true\n"
        )
        self.log = self.scratch / "olah.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [exe, "-c", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.scratch,
                start_new_session=True,
            )
        probe = f"http://127.0.0.1:{port}/api/models/{next(iter(self.repos))}/revision/main"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"olah exited with {self.proc.returncode}: {self._log_tail()}")
            try:
                with urllib.request.urlopen(probe, timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"olah did not answer {probe} within {timeout:.0f} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-5:])

    def stop(self) -> None:
        if self.gate is not None:
            self.gate.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------------------------
# pytest fixtures (imported by tests/conftest.py)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory, tiny_vendor, tiny_transformers):
    """olah serving MiniMaxAI/Tiny-M3 (vendor layout), MiniMaxAI/Tiny-M3-HF (transformers layout) and
    MiniMaxAI/Tiny-M3-Pickle. A server that cannot be installed or started fails the test: never skipped."""
    root = tmp_path_factory.mktemp("hub")
    mirrors = root / "mirrors"
    repos = build_mirrors(mirrors, {"Tiny-M3": tiny_vendor, "Tiny-M3-HF": tiny_transformers})
    repos["MiniMaxAI/Tiny-M3-Pickle"] = add_pickle_repo(mirrors, tiny_vendor / "config.json")
    (root / "scratch").mkdir()
    server = HubServer(mirrors, root / "scratch", repos)
    for attempt in range(3):  # the free port can be taken by another process before olah binds it
        try:
            server.start()
            break
        except RuntimeError as e:
            server.stop()
            if "address already in use" not in str(e) or attempt == 2:
                pytest.fail(f"the local hub server (olah) is required: {e}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture()
def hub(hub_server, tmp_path, monkeypatch):
    """The server for one test: HF_ENDPOINT at it, a scratch HF_HOME (no stored token of the developer is
    sent), its gate reset. huggingface_hub reads its constants at import, so they are set here too."""
    import huggingface_hub.constants as c

    home = tmp_path / "hf_home"
    env = {
        "HF_ENDPOINT": hub_server.url,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_ETAG_TIMEOUT": "60",
        "HF_HUB_DOWNLOAD_TIMEOUT": "60",
    }  # 10 s defaults: a loaded CI box
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    constants = {
        "ENDPOINT": hub_server.url,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HUGGINGFACE_CO_URL_TEMPLATE": hub_server.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_ETAG_TIMEOUT": 60,
        "HF_HUB_DOWNLOAD_TIMEOUT": 60,
    }
    for name, value in constants.items():
        monkeypatch.setattr(c, name, value)
    from huggingface_hub import hf_api

    monkeypatch.setattr(hf_api.api, "endpoint", hub_server.url)  # the HfApi behind the free functions
    hub_server.gate.reset()
    hub_server.cache = home / "hub"
    yield hub_server
    hub_server.gate.reset()

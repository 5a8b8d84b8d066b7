"""XXH3-128 of bytes on a GPU (runtime/kernels/xxh3.py) equals the xxhash package's, byte for byte: the host
merge of the eight lanes (from lanes computed here by a plain Python reading of xxhash.h's long-input loop),
the Triton kernel in the CPU interpreter (a child process; where Triton is installed) and on a GPU; and the
staged loader's path that hashes each tensor on its device after its copy (runtime/staging.py
hash_on_device) hands out the same bytes, hashes nothing on the reading threads and still names a changed
tensor."""

import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import xxhash
from interpreter import run_in_interpreter

import porter
from porter.errors import LoadError
from porter.format.safetensors_io import file_digests, parse_header
from runtime import loader
from runtime.kernels import xxh3
from runtime.staging import DigestRule, Span, Staging

CUDA = torch.cuda.is_available()


def _lanes(data: bytes) -> list:
    """XXH3's eight accumulators after its long-input loop (xxhash.h, XXH3_hashLong_internal_loop), read
    literally: stripes of 64 bytes, blocks of 16 stripes, a scramble after each block."""
    m, s = (1 << 64) - 1, xxh3.SECRET
    le = lambda b, at: struct.unpack_from("<Q", b, at)[0]  # noqa: E731
    acc = list(xxh3.INIT)

    def stripe(at: int, key_at: int) -> None:
        for lane in range(8):
            v = le(data, at + 8 * lane)
            k = v ^ le(s, key_at + 8 * lane)
            acc[lane ^ 1] = (acc[lane ^ 1] + v) & m
            acc[lane] = (acc[lane] + (k & 0xFFFFFFFF) * (k >> 32)) & m

    n = len(data)
    blocks = (n - 1) // 1024
    for b in range(blocks):
        for k in range(16):
            stripe(b * 1024 + 64 * k, 8 * k)
        for lane in range(8):
            a = acc[lane] ^ (acc[lane] >> 47) ^ le(s, 128 + 8 * lane)
            acc[lane] = (a * xxh3.PRIME32[0]) & m
    for k in range(((n - 1) - 1024 * blocks) // 64):
        stripe(blocks * 1024 + 64 * k, 8 * k)
    stripe(n - 64, 192 - 64 - 7)
    return acc


@pytest.mark.parametrize("n", [241, 1024, 1025, 2048 + 64, 5003, 3 * 1024 + 7])
def test_host_merge_of_the_lanes_is_xxhash(n):
    data = bytes((i * 2654435761 >> 7) & 255 for i in range(n))
    assert xxh3.digest_from_lanes(_lanes(data), n) == xxhash.xxh3_128(data).digest()


@pytest.mark.slow
def test_kernel_in_the_triton_interpreter_is_xxhash():
    pytest.importorskip("triton")
    (row,) = run_in_interpreter("xxh3_interpreter_cases.py")
    assert row["cases"] == 71 and row["chunks"] > 100 and row["mismatches"] == [], row


def _host_chunks(flat: torch.Tensor, chunk: int) -> list:
    raw = flat.cpu().numpy().tobytes()
    return [xxhash.xxh3_128(raw[b : b + chunk]).digest() for b in range(0, len(raw), chunk)]


class _HostPending:
    """hash_on_device's contract (xxh3.PendingDigests), computed by the xxhash package: the CPU stand-in for
    the GPU kernel; not ready until asked twice, so the staging's threads go on reading meanwhile."""

    def __init__(self, flat: torch.Tensor, chunk: int):
        self.digests, self.asked = _host_chunks(flat, chunk), 0

    def ready(self) -> bool:
        self.asked += 1
        return self.asked > 2

    def result(self) -> list:
        return self.digests


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("xxh3") / "art"
    porter.convert(tiny_vendor, out, progress=False, max_shard_size="300KB")
    return out


def _spans(art: Path, device) -> list:
    """Every tensor of the shards with its digest under 4096-byte chunks (many chunks per tensor)."""
    out = []
    with ThreadPoolExecutor(2) as pool:
        for f in sorted(art.glob("*.safetensors")):
            start, header = parse_header(f)
            digests = file_digests(f, pool, 4096, "xxh3-128").tensors
            for name, info in header.items():
                b, e = info["data_offsets"]
                out.append(Span(name, f, start + b, e - b, torch.uint8, (e - b,), device, digests[name]))
    return out


def _changed_copy(art: Path, tmp_path: Path, at) -> tuple:
    """A copy of the artifact with one byte of its largest tensor flipped (`at`: the byte's offset in the
    tensor, from its size); the copy and that tensor's span."""
    d = tmp_path / "art"
    shutil.copytree(art, d)
    big = max(_spans(d, torch.device("cpu")), key=lambda sp: sp.nbytes)
    where = big.offset + at(big.nbytes)
    with open(big.path, "r+b") as f:
        f.seek(where)
        b = f.read(1)
        f.seek(where)
        f.write(bytes([b[0] ^ 1]))
    return d, big


def _counting_rule(chunk: int, made: list) -> DigestRule:
    class Counting(DigestRule):  # counts the chunk hashers made on the reading threads
        def new_hash(self):
            made.append(1)
            return super().new_hash()

    return Counting(chunk, "xxh3-128")


@pytest.mark.parametrize("buffer_bytes", [1000, 4096, 3 * 4096])  # chunks cut across items, whole, several
def test_staging_hashes_each_tensor_on_its_device_after_the_copy(artifact, buffer_bytes):
    made, spans = [], _spans(artifact, torch.device("cpu"))
    rule = _counting_rule(4096, made)
    s = Staging(spans, rule, threads=3, buffer_bytes=buffer_bytes, hash_on_device=_HostPending).start()
    got = {sp.name: s.take(sp.name).clone() for sp in spans}
    s.finish()
    assert made == [] and sum(sp.nbytes > 4096 for sp in spans) > 10  # none hashed on the reading threads
    for sp in spans:
        with open(sp.path, "rb") as f:
            f.seek(sp.offset)
            assert got[sp.name].numpy().tobytes() == f.read(sp.nbytes), sp.name


def test_a_changed_tensor_is_named_when_hashed_on_its_device(artifact, tmp_path):
    d, big = _changed_copy(artifact, tmp_path, lambda n: n // 2)
    spans = [
        replace(sp, path=d / sp.path.name) for sp in _spans(artifact, torch.device("cpu"))
    ]  # digests of before
    s = Staging(
        spans, _counting_rule(4096, []), threads=2, buffer_bytes=4096, hash_on_device=_HostPending
    ).start()
    with pytest.raises(LoadError, match=f"tensor {big.name!r} differs from porter.json's digest"):
        s.finish()


def test_the_loader_hashes_on_gpus_only_when_asked_and_only_there(monkeypatch):
    rule = DigestRule(4096, "xxh3-128")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(xxh3, "works_on", lambda d: True)
    assert loader.gpu_digests(rule, {cuda}) is None  # HASH_ON_GPU off
    monkeypatch.setattr(loader, "HASH_ON_GPU", True)
    assert loader.gpu_digests(rule, {cuda}) is xxh3.PendingDigests
    assert loader.gpu_digests(rule, {cuda, torch.device("cpu")}) is None
    assert loader.gpu_digests(DigestRule(4096, "sha256"), {cuda}) is None
    assert loader.gpu_digests(DigestRule(4100, "xxh3-128"), {cuda}) is None
    monkeypatch.setattr(xxh3, "works_on", lambda d: False)  # a kernel that does not give xxhash's digests
    assert loader.gpu_digests(rule, {cuda}) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_chunk_digests_on_the_gpu_are_xxhash():
    assert xxh3.works_on(torch.device("cuda", 0))
    g = torch.Generator().manual_seed(1)
    for n in (0, 100, 241, 1024, 1025, 5003, (16 << 20) + 12345, (40 << 20) + 7):
        flat = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert xxh3.chunk_digests(flat.cuda(), 16 << 20) == _host_chunks(flat, 16 << 20), n


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_load_with_digests_on_the_gpu(artifact, tmp_path, monkeypatch):
    import runtime

    monkeypatch.setattr(loader, "HASH_ON_GPU", True)
    ids = torch.randint(0, 384, (1, 16), generator=torch.Generator().manual_seed(2))
    want = runtime.load(artifact, device="cpu")(ids)
    got = runtime.load(artifact, device="cuda", dtype=torch.float32, backend="torch", rehash=True)(ids.cuda())
    assert float((got.cpu() - want).norm() / want.norm()) <= 1e-5
    d, big = _changed_copy(artifact, tmp_path, lambda n: 7)
    with pytest.raises(LoadError, match=repr(big.name)):
        runtime.load(d, device="cuda", rehash=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_verify_on_cuda_with_digests_on_the_gpu(artifact, tmp_path, monkeypatch):
    """porter verify's staged reads take the same path: PASS on the artifact, a changed byte named."""
    from click.testing import CliRunner

    from porter.cli import main as cli

    monkeypatch.setattr(loader, "HASH_ON_GPU", True)
    assert xxh3.works_on(torch.device("cuda", 0))  # its self-check done before the calls are counted
    made = []
    real = xxh3.PendingDigests
    monkeypatch.setattr(xxh3, "PendingDigests", lambda *a: made.append(1) or real(*a))
    args = ["-q", "verify", "--prompt", "x", "--max-new-tokens", "0", "--device", "cuda", "--stream"]
    res = CliRunner().invoke(cli, [*args[:2], str(artifact), *args[2:]])
    assert res.exit_code == 0 and made, res.output
    d, big = _changed_copy(artifact, tmp_path, lambda n: 3)
    res = CliRunner().invoke(cli, [*args[:2], str(d), *args[2:]])
    assert res.exit_code == 1 and f"tensor {big.name} in shard {big.path.name}: digest differs" in res.output

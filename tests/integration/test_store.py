"""CheckpointStore against a real MinIO (hack/install-minio): round trip, dedup, refusals."""

from __future__ import annotations

import os
import random
import re
import stat
import time
from pathlib import Path

import pytest
import zstandard

from hermit_common.errors import CheckpointFailed, CheckpointRefused, StoreUnavailable
from hermit_common.manifest import Binding
from hermit_common.pin import Pin
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointNotFound, CheckpointStore, UploadProgress
from tests.support.minio import MinioServer, start_minio, stop_minio

pytestmark = pytest.mark.integration

CHUNK = 64 * 1024
NS, BOX, UID = "team-a", "agent-1", "7f1c0c8e-uid"


def _binding(checkpoint: str, uid: str = UID, sandbox: str = BOX) -> Binding:
    return Binding(namespace=NS, sandbox=sandbox, sandbox_uid=uid, checkpoint=checkpoint,
                   criu_version="4.2.1", kernel="6.18.0", cpu_flags=("avx2", "sse4_2"),
                   image_digest="sha256:" + "0" * 64)


def _bucket(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    return f"t-{name}-{os.getpid()}"


@pytest.fixture
def store(minio_server: MinioServer, request: pytest.FixtureRequest) -> CheckpointStore:
    s = CheckpointStore(minio_server.settings(_bucket(request), chunk_size_bytes=CHUNK))
    s.ensure_bucket()
    return s


def _make_tree(root: Path, seed: int = 1) -> dict[str, Path]:
    rng = random.Random(seed)
    criu = root / "criu"
    fs = root / "fs"
    criu.mkdir(parents=True)
    (criu / "pages-1.img").write_bytes(rng.randbytes(5 * CHUNK + 123))  # 6 chunks
    (criu / "core-1.img").write_bytes(rng.randbytes(900))
    (criu / "zeros.img").write_bytes(bytes(3 * CHUNK))  # 3 identical chunks
    (criu / "empty.img").write_bytes(b"")
    (fs / "etc" / "app").mkdir(parents=True)
    (fs / "etc" / "app" / "conf").write_text("key=value\n")
    (fs / "etc" / "app" / "conf").chmod(0o640)
    (fs / "etc" / "app").chmod(0o750)
    os.symlink("../usr/bin/python3", fs / "etc" / "python")
    os.symlink("/absolute/target", fs / "abs-link")
    os.link(fs / "etc" / "app" / "conf", fs / "conf.hardlink")
    (fs / os.fsdecode(b"caf\xe9")).write_bytes(b"latin-1 name")
    (fs / "run").mkdir()
    (fs / "run" / "x").write_bytes(rng.randbytes(10))
    os.chown(fs / "run" / "x", 1234, 5678)
    os.mknod(fs / "etc" / "deleted", stat.S_IFCHR, os.makedev(0, 0))  # whiteout
    (fs / "var").mkdir()
    os.setxattr(fs / "var", "trusted.overlay.opaque", b"y")
    return {"criu": criu, "fs": fs}


def _snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """What must survive a round trip: kind, content/target, mode, owner, mtime."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = os.fspath(full.relative_to(root))
            st = os.lstat(full)
            if stat.S_ISCHR(st.st_mode):
                continue  # whiteouts are manifest entries, not nodes
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(full), st.st_uid, st.st_gid, st.st_mtime_ns)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns)
            else:
                out[rel] = ("f", full.read_bytes(), stat.S_IMODE(st.st_mode), st.st_uid,
                            st.st_gid, st.st_mtime_ns)
    return out


def test_round_trip(store: CheckpointStore, tmp_path: Path) -> None:
    sections = _make_tree(tmp_path / "src")
    progress: list[UploadProgress] = []
    result = store.upload(_binding("c1"), sections, {"pid": 42, "pipes": ["pipe:[7]"]},
                          on_progress=progress.append)
    assert result.manifest_uri == (
        f"s3://{store.settings.bucket}/hermit/{NS}/{BOX}/checkpoints/c1/manifest.json")
    assert result.image_bytes == 5 * CHUNK + 123 + 900 + 3 * CHUNK + 10 + 10 + 12 + 10
    assert result.chunks_total == 6 + 1 + 3 + 1 + 1 + 1 + 1
    assert result.chunks_uploaded == result.chunks_total - 3  # 2 zero chunks, 1 hardlink
    assert len(store.list_chunks(NS, BOX)) == result.chunks_uploaded
    assert result.stored_bytes == sum(store.list_chunks(NS, BOX).values())
    assert result.uploaded_bytes > result.stored_bytes
    assert progress[-1].chunks_done == result.chunks_total
    assert progress[-1].bytes_done == result.image_bytes
    assert store.list_checkpoints(NS, BOX) == ["c1"]

    dest = tmp_path / "dest"
    manifest = store.download(Pin(NS, BOX, "c1", uid=UID, digest=result.manifest_digest), dest)
    assert manifest == result.manifest
    assert manifest.restore == {"pid": 42, "pipes": ["pipe:[7]"]}
    for name, src in sections.items():
        assert _snapshot(dest / name) == _snapshot(src), name
    fs = {e.path: e for e in manifest.sections["fs"]}
    assert fs["etc/deleted"].kind == "whiteout"
    assert not (dest / "fs" / "etc" / "deleted").exists()
    assert fs["var"].opaque


def test_unchanged_tree_uploads_only_the_manifest(store: CheckpointStore, tmp_path: Path) -> None:
    sections = _make_tree(tmp_path / "src")
    first = store.upload(_binding("c1"), sections, {})
    second = store.upload(_binding("c2"), sections, {})
    assert second.chunks_uploaded == 0
    assert second.uploaded_bytes == len(second.manifest.to_json())
    assert second.stored_bytes == first.stored_bytes

    pages = sections["criu"] / "pages-1.img"
    with pages.open("r+b") as f:  # one byte in the middle of chunk 3
        f.seek(3 * CHUNK + 17)
        old = f.read(1)
        f.seek(3 * CHUNK + 17)
        f.write(bytes([old[0] ^ 0xFF]))
    before = store.list_chunks(NS, BOX)
    third = store.upload(_binding("c3"), sections, {})
    after = store.list_chunks(NS, BOX)
    new = set(after) - set(before)
    assert third.chunks_uploaded == 1 and len(new) == 1
    assert third.uploaded_bytes == after[new.pop()] + len(third.manifest.to_json())
    assert store.list_checkpoints(NS, BOX) == ["c1", "c2", "c3"]

    out = tmp_path / "out"
    store.download(Pin(NS, BOX, "c3", uid=UID), out)
    assert (out / "criu" / "pages-1.img").read_bytes() == pages.read_bytes()


def test_files_cut_at_chosen_places_share_their_chunks(store: CheckpointStore,
                                                       tmp_path: Path) -> None:
    """Two page images holding the same region at different offsets (a parent and its
    copy-on-write child): cut where the region starts, they store it once, and a
    download puts every byte back where it was."""
    rng = random.Random(5)
    region = rng.randbytes(4 * CHUNK)
    criu = tmp_path / "src" / "criu"
    criu.mkdir(parents=True)
    (criu / "pages-1.img").write_bytes(rng.randbytes(100) + region)
    (criu / "pages-2.img").write_bytes(rng.randbytes(3000) + region + rng.randbytes(7))
    (criu / "pages-3.img").write_bytes(region)  # no layout: fixed-size chunks
    layouts = {"criu": {"pages-1.img": (100,) + (CHUNK,) * 4,
                        "pages-2.img": (3000,) + (CHUNK,) * 4 + (7,),
                        "pages-3.img": (2 * CHUNK, 2 * CHUNK),  # past the chunk size: ignored
                        "core-9.img": (1,)}}  # no such file: ignored
    result = store.upload(_binding("c1"), {"criu": criu}, {}, layouts=layouts)
    assert result.chunks_total == 5 + 6 + 4
    assert result.chunks_uploaded == 4 + 3  # the region once (pages-3 too), two heads, a tail
    entries = {e.path: e for e in result.manifest.sections["criu"]}
    assert entries["pages-2.img"].chunk_lengths == (3000,) + (CHUNK,) * 4 + (7,)
    assert entries["pages-3.img"].chunk_lengths == ()
    out = tmp_path / "out"
    store.download(Pin(NS, BOX, "c1", uid=UID, digest=result.manifest_digest), out)
    for name in ("pages-1.img", "pages-2.img", "pages-3.img"):
        assert (out / "criu" / name).read_bytes() == (criu / name).read_bytes(), name


def test_chunks_staged_while_the_file_is_written_are_the_manifests(
        store: CheckpointStore, tmp_path: Path) -> None:
    """A session stages the first chunks of a page image (as ImageStreamer does during
    the dump), then finishes: nothing is uploaded twice, every byte comes back."""
    rng = random.Random(9)
    criu = tmp_path / "src" / "criu"
    criu.mkdir(parents=True)
    pages = criu / "pages-1.img"
    pages.write_bytes(rng.randbytes(3 * CHUNK + 5))
    session = store.begin_upload(_binding("c1"))
    session.stage(os.fspath(pages), 0, CHUNK)
    session.stage(os.fspath(pages), CHUNK, CHUNK)
    assert store.list_checkpoints(NS, BOX) == []  # staged chunks are no checkpoint yet
    result = session.finish({"criu": criu}, {})
    assert result.chunks_staged == 2
    assert result.chunks_uploaded == 4 and len(store.list_chunks(NS, BOX)) == 4
    assert result.uploaded_bytes == result.stored_bytes + len(result.manifest.to_json())
    out = tmp_path / "out"
    store.download(Pin(NS, BOX, "c1", uid=UID, digest=result.manifest_digest), out)
    assert (out / "criu" / "pages-1.img").read_bytes() == pages.read_bytes()


def test_tampered_chunk_is_refused(store: CheckpointStore, tmp_path: Path) -> None:
    sections = _make_tree(tmp_path / "src")
    result = store.upload(_binding("c1"), sections, {})
    entry = next(e for e in result.manifest.sections["criu"] if e.path == "pages-1.img")
    victim = entry.chunks[2]
    key = store.chunk_key(NS, BOX, victim)
    client = store._client
    evil = zstandard.ZstdCompressor().compress(b"\x00" * CHUNK)
    client.put_object(Bucket=store.settings.bucket, Key=key, Body=evil)
    dest = tmp_path / "dest"
    with pytest.raises(CheckpointRefused, match=rf"chunk {victim} of criu/pages-1.img is corrupt"):
        store.download(Pin(NS, BOX, "c1", uid=UID), dest)
    assert not (dest / "criu").exists() and not (dest / "fs").exists()

    client.put_object(Bucket=store.settings.bucket, Key=key, Body=b"not zstd at all")
    with pytest.raises(CheckpointRefused, match=rf"chunk {victim} .* cannot decompress"):
        store.download(Pin(NS, BOX, "c1", uid=UID), dest)

    client.delete_object(Bucket=store.settings.bucket, Key=key)
    with pytest.raises(CheckpointRefused, match=rf"chunk {victim} .* missing from the store"):
        store.download(Pin(NS, BOX, "c1", uid=UID), dest)


def test_foreign_or_altered_manifest_is_refused(store: CheckpointStore, tmp_path: Path) -> None:
    result = store.upload(_binding("c1"), _make_tree(tmp_path / "src"), {})
    with pytest.raises(CheckpointRefused) as info:
        store.download(Pin(NS, BOX, "c1", uid="someone-else"), tmp_path / "d1")
    msg = str(info.value)
    assert msg == (f"checkpoint {NS}/c1 belongs to sandbox {NS}/{BOX} (uid {UID}, checkpoint c1),"
                   f" not {NS}/{BOX} (uid someone-else)")
    assert not (tmp_path / "d1").exists() or not any((tmp_path / "d1").iterdir())

    with pytest.raises(CheckpointRefused, match=r"manifest digest .* does not match"):
        store.download(Pin(NS, BOX, "c1", uid=UID, digest="sha256:" + "1" * 64), tmp_path / "d2")

    # A manifest copied under another sandbox's prefix is refused by its binding.
    other_key = store.manifest_key(NS, "agent-2", "c1")
    store._client.copy_object(Bucket=store.settings.bucket, Key=other_key,
                              CopySource={"Bucket": store.settings.bucket,
                                          "Key": result.manifest_uri.split("/", 3)[3]})
    with pytest.raises(CheckpointRefused, match=f"belongs to sandbox {NS}/{BOX}"):
        store.download(Pin(NS, "agent-2", "c1", uid=UID), tmp_path / "d3")

    with pytest.raises(CheckpointNotFound, match=f"checkpoint {NS}/nope .* not found"):
        store.download(Pin(NS, BOX, "nope", uid=UID), tmp_path / "d4")


def test_failed_read_leaves_no_manifest(store: CheckpointStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    big = src / "big.img"
    big.write_bytes(random.Random(3).randbytes(200 * CHUNK))
    shrunk = False

    def shrink(progress: UploadProgress) -> None:
        nonlocal shrunk
        if not shrunk:
            os.truncate(big, 0)  # later chunk reads come up short
            shrunk = True

    with pytest.raises(CheckpointFailed, match=r"big.img: file shrank"):
        store.upload(_binding("c1"), {"criu": src}, {}, on_progress=shrink)
    assert store.list_checkpoints(NS, BOX) == []
    with pytest.raises(CheckpointNotFound):
        store.download(Pin(NS, BOX, "c1", uid=UID), tmp_path / "d")


def test_s3_dying_mid_upload_leaves_no_manifest(tmp_path: Path) -> None:
    server = start_minio(tmp_path / "minio")
    port = int(server.endpoint.rsplit(":", 1)[1])
    settings = server.settings("dying", chunk_size_bytes=CHUNK, max_attempts=1,
                               connect_timeout_seconds=1.0, transfer_concurrency=2)
    store = CheckpointStore(settings)
    store.ensure_bucket()
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.img").write_bytes(random.Random(4).randbytes(100 * CHUNK))
    try:
        with pytest.raises(StoreUnavailable) as info:
            store.upload(_binding("c1"), {"criu": src}, {},
                         on_progress=lambda _p: stop_minio(server))
        message = str(info.value)
        # Depending on when the server goes, the request is refused or answered with an
        # error status while it shuts down; either way the message says what failed.
        assert message.startswith((f"cannot reach S3 endpoint {server.endpoint}: ",
                                   "cannot upload chunk s3://dying/")), message
        assert "\n" not in message
        server = start_minio(tmp_path / "minio", port=port)
        assert len(store.list_chunks(NS, BOX)) >= 1  # some chunks did land
        assert store.list_checkpoints(NS, BOX) == []
        with pytest.raises(CheckpointNotFound):
            store.download(Pin(NS, BOX, "c1", uid=UID), tmp_path / "d")
    finally:
        stop_minio(server)


def test_unreachable_endpoint_fails_fast_with_one_line(tmp_path: Path) -> None:
    settings = StoreSettings(bucket="b", endpoint_url="http://127.0.0.1:1",
                             access_key_id="k", secret_access_key="s", max_attempts=1,
                             connect_timeout_seconds=1.0, read_timeout_seconds=2.0)
    store = CheckpointStore(settings)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        store.upload(_binding("c1"), {"criu": src}, {})
    assert str(info.value) == "cannot reach S3 endpoint http://127.0.0.1:1: connection refused"
    with pytest.raises(StoreUnavailable) as info:
        store.download(Pin(NS, BOX, "c1", uid=UID), tmp_path / "d")
    assert str(info.value) == "cannot reach S3 endpoint http://127.0.0.1:1: connection refused"
    assert time.monotonic() - started < 10


def test_missing_bucket_and_bad_credentials(minio_server: MinioServer, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    missing = CheckpointStore(minio_server.settings("no-such-bucket"))
    with pytest.raises(StoreUnavailable,
                       match=r"bucket 'no-such-bucket' does not exist at http://127.0.0.1"):
        missing.upload(_binding("c1"), {"criu": src}, {})
    bad = CheckpointStore(minio_server.settings("whatever", secret_access_key="wrong-secret"))
    with pytest.raises(StoreUnavailable, match="access denied") as info:
        bad.list_checkpoints(NS, BOX)
    assert "wrong-secret" not in str(info.value)


def test_delete_and_collect_garbage(store: CheckpointStore, tmp_path: Path) -> None:
    sections = _make_tree(tmp_path / "src")
    first = store.upload(_binding("c1"), sections, {})
    (sections["criu"] / "pages-1.img").write_bytes(random.Random(9).randbytes(2 * CHUNK))
    second = store.upload(_binding("c2"), sections, {})
    assert store.collect_garbage(NS, BOX) == 0
    only_first = first.manifest.chunk_digests() - second.manifest.chunk_digests()
    assert len(only_first) == 6

    store.delete_checkpoint(NS, BOX, "c1")
    assert store.list_checkpoints(NS, BOX) == ["c2"]
    assert store.collect_garbage(NS, BOX, min_age_seconds=3600) == 0  # too young
    assert store.collect_garbage(NS, BOX) == len(only_first)
    assert set(store.list_chunks(NS, BOX)) == second.manifest.chunk_digests()
    store.download(Pin(NS, BOX, "c2", uid=UID), tmp_path / "dest")
    assert (tmp_path / "dest" / "criu" / "pages-1.img").read_bytes() == \
        (sections["criu"] / "pages-1.img").read_bytes()


def test_download_refuses_existing_destination(store: CheckpointStore, tmp_path: Path) -> None:
    store.upload(_binding("c1"), _make_tree(tmp_path / "src"), {})
    dest = tmp_path / "dest"
    (dest / "fs").mkdir(parents=True)
    (dest / "fs" / "keep").write_text("mine")
    with pytest.raises(CheckpointFailed, match="already exists"):
        store.download(Pin(NS, BOX, "c1", uid=UID), dest)
    assert (dest / "fs" / "keep").read_text() == "mine"

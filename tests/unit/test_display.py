"""The display fields of the printer columns (hermit_common.display): pure formatting."""

from __future__ import annotations

import pytest

from hermit_common import display


@pytest.mark.parametrize(("num", "text"), [
    (0, "0 B"), (-5, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
    (1536, "1.5 KiB"), (25_270_000, "24.1 MiB"), (1024 ** 2 - 1, "1.0 MiB"),
    (6_000_000, "5.7 MiB"), (3 * 1024 ** 3, "3.0 GiB"), (5 * 1024 ** 4, "5.0 TiB"),
    (2048 * 1024 ** 5, "2048.0 PiB"),
])
def test_size(num: int, text: str) -> None:
    assert display.size(num) == text


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0ms"), (-1, "0ms"), (0.85, "850ms"), (1.0, "1.0s"), (1.84, "1.8s"), (1.89, "1.8s"),
    (59.99, "59.9s"), (60, "1m0s"), (125.5, "2m5s"), (3599, "59m59s"), (3600, "1h0m"),
    (3725, "1h2m"), (90000, "25h0m"),
])
def test_duration(seconds: float, text: str) -> None:
    assert display.duration(seconds) == text


def test_upload_progress() -> None:
    assert display.upload_progress(12, 40, 300, 1000) == "uploading 12/40 chunks (30%)"
    assert display.upload_progress(39, 40, 999, 1000) == "uploading 39/40 chunks (99%)"
    assert display.upload_progress(40, 40, 1000, 1000) == "uploading 40/40 chunks (100%)"
    assert display.upload_progress(1, 4, 0, 0) == "uploading 1/4 chunks (25%)"  # empty files
    assert display.upload_progress(0, 0, 0, 0) == display.UPLOADING


def test_upload_summary() -> None:
    assert display.upload_summary(40, 3) == "40 chunks, 3 new"
    assert display.upload_summary(1, 1) == "1 chunk, 1 new"
    assert display.upload_summary(7, None) == "7 chunks"


def test_display_fields_fit_their_schema_limits() -> None:
    from tests.support.crds import CRDS, schema_of, walk

    nodes = {path: node for crd in CRDS.values() for path, node in walk(schema_of(crd))}
    assert len(display.size(2 ** 63)) <= nodes[".status.size"]["maxLength"]
    assert len(display.duration(10 ** 9)) <= nodes[".status.duration"]["maxLength"]
    longest = display.upload_progress(10 ** 9, 10 ** 9, 1, 2)
    assert len(longest) <= nodes[".status.progress"]["maxLength"]

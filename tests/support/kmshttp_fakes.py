"""A stand-in for ``requests.Session`` that answers the KMS wrappers' REST calls from a
handler (unit tests of hermit_operator.keyvault and .cloudkms; no network)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import requests


@dataclass
class Sent:
    method: str
    url: str
    headers: dict[str, str]
    json: Any
    form: Any


@dataclass
class Reply:
    status: int = 200
    body: Any = field(default_factory=dict)  # JSON, or bytes as they are
    headers: dict[str, str] = field(default_factory=dict)


class FakeResponse:
    def __init__(self, reply: Reply) -> None:
        self.status_code = reply.status
        raw = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
        self._raw, self.headers = raw, reply.headers
        self.read = 0

    def iter_content(self, size: int) -> Iterator[bytes]:
        for i in range(0, len(self._raw), size):
            self.read += size
            yield self._raw[i:i + size]

    def __enter__(self) -> FakeResponse:
        return self

    def __exit__(self, *_: object) -> None:
        return None


class FakeHttp:
    """``handler(sent)`` returns a Reply or raises (a requests exception: no answer)."""

    def __init__(self, handler: Callable[[Sent], Reply]) -> None:
        self.handler = handler
        self.sent: list[Sent] = []
        self.last: FakeResponse | None = None

    def request(self, method: str, url: str, *, headers: dict[str, str], json: Any = None,
                data: Any = None, **_: Any) -> FakeResponse:
        sent = Sent(method, url, headers, json, data)
        self.sent.append(sent)
        self.last = FakeResponse(self.handler(sent))
        return self.last


def refuse_network(_: Sent) -> Reply:
    raise requests.ConnectionError("no route")

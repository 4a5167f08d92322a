"""Errors raised by the testbed: one-line messages that say what failed."""

from __future__ import annotations

from hermit_common.errors import HermitError


class TestbedError(HermitError):
    """A testbed component (containerd, runc, CNI, image build) failed."""

    __test__ = False  # not a pytest test class despite the name

"""Pin: which checkpoint, pinned how."""

from __future__ import annotations

import pytest

from hermit_common.pin import Pin


def test_a_download_needs_the_uid_the_checkpoint_is_bound_to() -> None:
    unbound = Pin("team-a", "box", "c1", parent="", digest="sha256:" + "0" * 64)
    with pytest.raises(ValueError, match=r"\(Pin\.uid\)"):
        unbound.bound()
    bound = unbound.with_uid("uid-1")
    assert bound.bound() == "uid-1"
    assert (bound.parent, bound.digest) == (unbound.parent, unbound.digest)


"""The error types Hermit raises on purpose.

Every error that reaches a user is a ``HermitError``: the CLIs print its
one-line message and exit non-zero instead of a traceback.
"""


class HermitError(Exception):
    """A failure with a message meant for a person: what failed and why."""


class SettingsError(HermitError):
    """A setting from the environment is missing or has a wrong value."""


class CheckpointRefused(HermitError):
    """A checkpoint was refused before any byte reached CRIU (tampered, foreign, incompatible)."""


class StoreUnavailable(HermitError):
    """The checkpoint store (S3) could not be reached or refused the request."""


class CheckpointFailed(HermitError):
    """Taking a checkpoint failed; the source workload was left running."""


class RestoreFailed(HermitError):
    """Restoring a checkpoint into a new container failed."""

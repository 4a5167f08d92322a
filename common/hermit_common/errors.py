"""The error types Hermit raises on purpose.

Every error that reaches a user is a ``HermitError``: the CLIs print its
one-line message and exit non-zero instead of a traceback.

Whether to try again is said by two bases, as kopf's ``TemporaryError`` and
``PermanentError`` do:

- ``Permanent``: the input itself is wrong (a tampered or foreign checkpoint, an
  invalid spec, a malformed CRIU image); the same input fails the same way again.
- ``Retryable``: the failure is of the moment or of the place (the network, a
  busy or absent service, this node's state); another attempt may succeed.

How soon to try again is the catcher's: an S3 or API call loop retries at once
only its ``*Transient`` errors, a job waits for its next loop, a restore for a new
pod. An error that is neither (an unclassified ``HermitError``, such as a refused
Kubernetes API call, or an exception nobody expected) is retried, as kopf does:
it says nothing against the input, and every retrying caller bounds its attempts.
``retryable`` is the one place that decides it.
"""


class HermitError(Exception):
    """A failure with a message meant for a person: what failed and why."""


class Retryable(HermitError):
    """Another attempt may succeed: the cause is of the moment or of the place."""


class Permanent(HermitError):
    """The input itself is wrong: the same input fails the same way every time."""


def retryable(exc: BaseException) -> bool:
    """Whether the work that raised ``exc`` may be tried again (the module's docstring)."""
    if isinstance(exc, Retryable):
        return True
    # Unclassified (neither base) is retried: nothing says the input is wrong (kopf's rule).
    return not isinstance(exc, Permanent)


class SettingsError(HermitError):
    """A setting from the environment is missing or has a wrong value."""


class CheckpointRefused(Permanent):
    """A checkpoint was refused before any byte reached CRIU (tampered, foreign, incompatible)."""


class StoreUnavailable(Retryable):
    """The checkpoint store (S3) could not be reached or refused the request."""


class CheckpointFailed(Retryable):
    """Taking a checkpoint failed; the source workload was left running."""


class RestoreFailed(Retryable):
    """Restoring a checkpoint into a new container failed."""

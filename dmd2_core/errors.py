"""Every error class of dmd2, by what a failure is: bad input (the same on every try: the CLI says
it in one line and exits 2, Prefect never retries it) or a runtime failure (retried from the
latest checkpoint, unless a replay would repeat it). The retry policy (``NEVER_RETRY``) and the
CLI read them here."""

from __future__ import annotations

import difflib

import yaml

# ---- bad input ----------------------------------------------------------------------------------


class ArgsError(ValueError):
    """Bad configuration input; its message is one line that names the key or path."""


class LeaseHeldError(ArgsError):
    """Another live run holds the save URL (bad input: pick another ``save``)."""


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping that repeats a key; the message names the key and both lines."""


class StoredFilesError(ValueError):
    """Files in storage that cannot be used as they are: a model directory, an export or a
    training checkpoint. The message names the path."""


class ModelDirError(StoredFilesError):
    """A model directory (a diffusers teacher, or a student export) that cannot be used."""


class WeightFilesError(ModelDirError):
    """A weights directory or file that cannot be read; the message names the path."""


class CheckpointError(StoredFilesError):
    """A training checkpoint (a trainer's DCP shards and state) or its tracker that cannot be
    resumed from; the message is one line naming the path."""


class InputChangedError(StoredFilesError):
    """A file a run opened (a prompt or real set, a weights file) that changed in storage since:
    its rows would no longer lie at the offsets its header gave when it was opened. Not retried (a
    retry would read the new file as the old one); the run stops, nothing saved is touched, and a
    rerun opens the file as it is now and resumes from the latest checkpoint. The message is one
    line naming the URL."""


class SafetensorsHeaderError(ValueError):
    """A file whose safetensors header is missing or unreadable; the message says why."""


# ---- runtime failures ---------------------------------------------------------------------------


class StorageUnavailableError(RuntimeError):
    """Storage kept failing with transient errors for longer than the retry budget. A runtime
    failure (worth a retry of the task), not bad input."""


class TransientError(RuntimeError):
    """A runtime failure that a retry from the latest checkpoint may get past (a storage blip, a
    failed write): what the other ranks of a trainer group raise when one of them hits one, so the
    group's failure is retried whichever rank it began on."""


class RayWorkError(RuntimeError):
    """Ray work failed (an actor died, a call timed out); retrying recovers from the checkpoint."""


class NonFiniteError(RuntimeError):
    """The run produced non-finite values it cannot recover from (too many skipped steps in a
    row, or a non-finite weight at save). Not retried: a replay from the checkpoint would repeat
    it exactly. The message is one line naming the trainer and the iteration."""


class LeaseLostError(RuntimeError):
    """This process's lease on its save URL was taken over (or cannot be verified): it writes
    nothing more there. Retried: the retry acquires the lease again, which is refused in one line
    (LeaseHeldError) while the other run lives and taken back once it is gone."""


# Configuration errors fail the same way every time: ArgsError and StoredFilesError are ValueErrors,
# and so is a ValueError raised inside a trainer (Ray re-raises it as an instance of its cause).
# NonFiniteError: a replay from the checkpoint would hit the same non-finite values again.
NEVER_RETRY = (ArgsError, StoredFilesError, ValueError, NonFiniteError)


def one_line(exc: BaseException) -> str:
    """An exception as one line: its class and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def nearest(name: str, options) -> str:
    """Suffix of a one-line error suggesting the closest valid name, or '' when none is close."""
    match = difflib.get_close_matches(str(name), list(options), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""

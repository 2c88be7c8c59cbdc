"""Checkpoints of one trainer and the latest pointer, at any fsspec URL (path, file://, s3://).

Layout under the run's ``save`` URL (format 3)::

    {save}/latest_checkpointed_iteration.txt          the latest pointer: one integer
    {save}/trainers/{role}/iter_{iteration:07d}/
        dcp/               torch.distributed.checkpoint: every rank writes its own shards
                           (__{rank}_{n}.distcp) of the model, the EMA and the AdamW moments and
                           step counts, keyed ``model.<name>``, ``ema.<name>``, ``optim.<name>.<key>``;
                           .metadata last (rank 0, after every rank's files are written)
        trainer_state.pt   {'format', 'param_groups' (settings keyed by parameter name), 'extra'}
        complete.json      written LAST by rank 0: every file with its size and its sha256
    {save}/exports/iter_{iteration:07d}/    the student as a diffusers pipeline (dmd2_core.export.pipeline)

No rank ever holds the whole model: a 14B trainer on 8 ranks writes 1/8 of its state per rank.
DCP records the global shape and offsets of every shard, so a checkpoint loads on any number of
ranks (DCP reshards on load). Each file's sha256 is computed while it is written (by the rank that
writes it) and gathered into ``complete.json``; at load the ranks split the files between them and
check every hash before anything is loaded, so a flipped byte is one line naming the file. The
pre-flight check (``validate_resume``, before any actor) checks the listing and sizes only.

A trainer directory counts only once ``complete.json`` exists; a save interrupted midway leaves a
directory without it, which ``load_trainer`` and ``validate_resume`` refuse. The latest pointer is
written by the driver alone (``write_latest``), after every trainer's save is durable (its marker
written), so it only ever names an iteration that every role finished saving. Retention
(``prune``) runs after the latest pointer moved and never touches the tracked checkpoint or a newer one.

Asynchronous saves (``save_trainer(..., asynchronous=True)``): the state is copied to host memory
before the call returns; the files are written and uploaded in a background thread, which then
writes the marker; ``PendingSave.result()`` waits for it. The checkpoint collectives (DCP's
planning, the hash gather) run on a separate gloo process group (``checkpoint_group``), never on
the training one. Storage outages are retried like every other write (``storage.RETRY_S``), the
ranks agreeing on each retry.

Exact resume: weights (fp32 masters), EMA and AdamW state are the bytes that were saved; the
param-group settings (``lr``, betas, weight decay) are the resuming run's own (its ``lr`` is the
fix for a diverging run; run/resume_check.py reports the change). ``extra['run']`` records what the
run started from (``load``, the model directory, a LoRA's adapters and base identity). Anything else a trainer needs (iteration, step
counters, the GAN head) goes in ``extra``, which must hold only what ``torch.load(weights_only=True)``
reads back; ``save_trainer`` checks that before it writes anything.

Only this format is read: a marker of any other names its path and format in one line. DCP's
``.metadata`` is a pickle: it is read admitting only the records of a tensor checkpoint, each
entry a tensor of a plain shape stored in a file inside the checkpoint (``metadata``), so a
tampered one is refused in one line instead of running code on every rank.

Modules (the paths and file names are in ``dmd2_core.save_layout``): ``integrity`` (hashes, the marker, finite state),
``collective`` (the ranks' agreement and retries), ``metadata`` (DCP's .metadata, read safely), ``state`` (the trainer state as saved),
``save``, ``load``, ``latest`` (and the pre-flight check), ``retention`` (checkpoints; exports' is export/retention.py).
"""

import warnings

# a single process without torch.distributed (tests, tools) saves and loads with no_dist=True
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

from dmd2_core.checkpoint.collective import checkpoint_group  # noqa: E402
from dmd2_core.save_layout import FORMAT, LATEST_NAME, export_url, exports_root, latest_url, trainer_dir  # noqa: E402
from dmd2_core.checkpoint.load import load_trainer, read_weights  # noqa: E402
from dmd2_core.checkpoint.retention import prune, saved_iterations  # noqa: E402
from dmd2_core.checkpoint.save import PendingSave, save_trainer  # noqa: E402
from dmd2_core.checkpoint.latest import read_latest, resume_url, validate_resume, write_latest  # noqa: E402

__all__ = [
    "FORMAT", "LATEST_NAME", "PendingSave", "checkpoint_group", "export_url", "exports_root",
    "load_trainer", "prune", "read_latest",
    "read_weights", "resume_url", "save_trainer", "saved_iterations", "latest_url", "trainer_dir", "validate_resume", "write_latest",
]

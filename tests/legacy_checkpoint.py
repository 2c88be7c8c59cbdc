"""The format-2 trainer checkpoint writer, as dmd2 shipped it before sharded (DCP) checkpoints:
whole diffusers weights under model/ and ema/, the whole optimizer keyed by parameter name in
trainer_state.pt, complete.json with sizes and sha256. Tests use it to check that checkpoints
of that format still resume."""

from __future__ import annotations

import hashlib
import io
import json

import torch

from dmd2_core import checkpoint as ckpt
from dmd2_core import parallel, storage
from dmd2_core.models import save_checkpoint


def save_format2(save_url: str, role: str, iteration: int, model, optimizer, shift: float, ema=None,
                 extra=None) -> str:
    model_state = parallel.full_state_dict(model)
    ema_state = parallel.full_state_dict(model, ema) if ema is not None else None
    buf = io.BytesIO()
    torch.save({"format": 2, "optimizer": parallel.full_optimizer_state(model, optimizer), "extra": dict(extra or {})}, buf)
    state = buf.getvalue()
    d = ckpt.trainer_dir(save_url, role, iteration)
    save_checkpoint(model, storage.join(d, "model"), shift, state=model_state)
    if ema_state is not None:
        save_checkpoint(model, storage.join(d, "ema"), shift, state=ema_state)
    storage.write_bytes(storage.join(d, "trainer_state.pt"), state)
    files = ckpt._listing(d)
    marker = {"format": 2, "role": role, "iteration": int(iteration), "has_ema": ema_state is not None,
              "trainer_state_sha256": hashlib.sha256(state).hexdigest(), "files": dict(sorted(files.items())),
              "sha256": {rel: storage.sha256(storage.join(d, rel)) for rel in sorted(files)}}
    storage.write_text(storage.join(d, "complete.json"), json.dumps(marker, indent=1))
    return d

"""Rank 0's host memory while it exports the student (dmd2_core/export/stream.py): the transformer
streams to its files tensor by tensor and is verified by reading each back, so the writer's peak
grows by about one tensor, not by the model (the old path held the student and its EMA whole and
reloaded each to verify). Measured in a fresh process (its peak resident set, VmHWM)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO

CHILD = r"""
import json, sys
from pathlib import Path
import torch
from dmd2_core.export import stream
from dmd2_core.export.pipeline import export_student
from dmd2_core.models import FAMILIES

def vm(key):
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))

root = Path(sys.argv[1])
family = FAMILIES["WanTransformer3DModel"]
with torch.device("meta"):  # Wan2.1 1.3B's block shape, 1 block: 73 M parameters
    model = family.model_class.from_config(dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
        in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=1, rope_max_seq_len=1024))
model.to_empty(device="cpu")
with torch.no_grad():
    for i, p in enumerate(model.parameters()):
        p.fill_(0.01 * i)
ema = [p.detach() + 1 for p in model.parameters()]
stream.write_config(family, model.config, root / "teacher")
Path("/proc/self/clear_refs").write_text("5")
before = vm("VmRSS")
out = export_student(str(root / "export"), model, teacher_url=str(root / "teacher"), shift=5.0, num_steps=4,
                     export_dtype=torch.bfloat16, ema=ema, iteration=1)
print(json.dumps({"grew": vm("VmHWM") - before, "model": sum(p.numel() for p in model.parameters()) * 2,
                  "bytes": out["bytes"]}))
"""


def test_the_export_writer_holds_a_tensor_at_a_time_not_the_model(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["bytes"] > 2 * got["model"]  # the EMA and the online transformer, bf16 (~140 MB each)
    assert got["grew"] < got["model"] / 2, got

"""Host memory of a rank against the size of its prompt set, and of rank 0 while it exports the
student, the old path (every rank loads the whole set; the writer gathers the student and its EMA
whole, writes them, reloads each to verify) against the new one (dmd2_core.data.StoredRows: each
rank reads the rows it uses; dmd2_core.export.stream: tensor by tensor, verified by reading back).

Prints one JSON line:

  {"prompt_bytes", "sets": {"<prompts>": {"new" | "old": {"grew_mib", "peak_rss_mib", "s"}}},
   "export": {"params_m", "model_mib" (one transformer in the export dtype), "export_mib" (its files),
              "new" | "old": {"grew_mib", "peak_rss_mib", "s"}}}

Sets: MiniMax-H3 stand-in prompt sets of 100 to 10,000 prompts at the real per-prompt bytes of
MiniMax-H3 (~2.6 MB of conditioner states each: the stand-in's width of 32, ``--prompt-mb`` of
float32 tokens per prompt, true lengths of the stand-in's 6 tokens so the stand-in's forward stays
small). The files are sparse (a header, then a hole: the apparent size of the set, 26 GB at 10,000
prompts, with no disk behind it; reads give zeros), so the count need not be scaled down. Each run
is a fresh process: the H3 stand-in's actor (``minimax-h3`` recipe, CPU) starts on the set and
runs three rollouts of 4 prompts. ``grew_mib``: its peak resident set (VmHWM) less the one before
the trainer starts. The old path (the set loaded whole, as trainers did) runs only up to
``--old-max`` prompts (its peak is twice the set: the file's bytes and the tensors).

Export: a Wan transformer of ``--layers`` blocks (Wan2.1 1.3B's block shape), random fp32
weights and an EMA, exported in bf16 (two transformers: EMA and online) to a local directory.
``grew_mib``: rank 0's peak resident set during the export less the one before it (the model and
the EMA are already resident: on a GPU run they are device memory).

    python bench/host_memory.py [--counts 100 1000 10000] [--prompt-mb 2.6] [--old-max 1000] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 1024 ** 2


def _vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> int:
    """Reset VmHWM to the current resident set; returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return _vm("VmRSS")


def write_sparse_prompt_set(path: str, n: int, tokens: int, dim: int, length: int) -> None:
    """An H3 prompt set file of ``n`` prompts of ``tokens`` x ``dim`` float32 (zeros: a hole in the
    file) and true lengths ``length``."""
    embeds = n * tokens * dim * 4
    header = {"prompt_lengths": {"dtype": "I64", "shape": [n], "data_offsets": [0, 8 * n]},
              "prompt_embeds": {"dtype": "F32", "shape": [n, tokens, dim], "data_offsets": [8 * n, 8 * n + embeds]},
              "__metadata__": {"prompts": json.dumps([f"stand-in clip {i}" for i in range(n)])}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.write(length.to_bytes(8, "little") * n)
        f.truncate(8 + len(text) + 8 * n + embeds)


def child_set(teacher: str, prompts: str, save: str, old: bool) -> dict:
    from dmd2_core.args import load_args
    from dmd2_core.run.distill_run import preflight
    from dmd2_core.toys.standins import H3_GEOMETRY
    from dmd2_core.train import trainer as trainer_module

    if old:
        from dmd2_core.data import load_prompt_set

        trainer_module.open_prompt_set = load_prompt_set
    args = load_args("minimax-h3", dict(device="cpu", num_devices=1, cp_size=1, lora_rank=0, dtype="float32", global_batch_size=4,
                                        micro_batch_size=2, torch_threads=1, hf_checkpoint=teacher, prompts=prompts,
                                        save=save, **H3_GEOMETRY))
    roles = preflight(args)
    start, t0 = _reset_peak(), time.perf_counter()
    actor = trainer_module.Trainer(roles["actor"], "actor")
    for iteration in (1, 2, 3):
        actor.rollout(iteration)
    return {"grew_mib": round((_vm("VmHWM") - start) / MIB, 1), "peak_rss_mib": round(_vm("VmHWM") / MIB, 1),
            "s": round(time.perf_counter() - t0, 1)}


def wan_config(layers: int) -> dict:
    return dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=layers, rope_max_seq_len=1024)


def old_export(model, ema, directory: Path, dtype) -> None:
    """What the writer did before: the student and its EMA gathered whole, written, each
    transformer reloaded whole to verify."""
    from dmd2_core import parallel
    from dmd2_core.models import family_of, write_transformer

    family = family_of(model)
    skip = {f"{p}.{n}" if p else n for p, m in model.named_modules() for n in m._non_persistent_buffers_set}
    online = {k: v for k, v in parallel.full_state_dict(model, dtype=dtype).items() if k not in skip}
    averaged = {k: v for k, v in parallel.full_state_dict(model, ema, dtype=dtype).items() if k not in skip}
    for name, state in (("transformer", averaged), ("transformer_online", online)):
        write_transformer(family, model.config, state, directory / name)
    for name in ("transformer", "transformer_online"):
        reloaded = family.model_class.from_pretrained(str(directory / name), torch_dtype=dtype)
        del reloaded


def child_export(root: str, layers: int, old: bool) -> dict:
    import torch

    from dmd2_core.export import stream
    from dmd2_core.export.pipeline import export_student
    from dmd2_core.models import FAMILIES

    torch.manual_seed(0)
    family = FAMILIES["WanTransformer3DModel"]
    model = family.model_class.from_config(wan_config(layers))
    ema = [p.detach().clone() for p in model.parameters()]
    teacher = Path(root) / "teacher"
    stream.write_config(family, model.config, teacher)
    params = sum(p.numel() for p in model.parameters())
    start, t0 = _reset_peak(), time.perf_counter()
    out = Path(root) / ("old" if old else "new")
    if old:
        old_export(model, ema, out, torch.bfloat16)
    else:
        export_student(str(out / "iter_0000001"), model, teacher_url=str(teacher), shift=5.0, num_steps=4,
                       export_dtype=torch.bfloat16, ema=ema, iteration=1)
    files = sum(f.stat().st_size for f in out.rglob("*.safetensors"))
    return {"params_m": round(params / 1e6, 1), "model_mib": round(params * 2 / MIB, 1),
            "export_mib": round(files / MIB, 1),
            "grew_mib": round((_vm("VmHWM") - start) / MIB, 1), "peak_rss_mib": round(_vm("VmHWM") / MIB, 1),
            "s": round(time.perf_counter() - t0, 1)}


def run_child(*argv: str) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *argv], capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"child {argv} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--prompt-mb", type=float, default=2.6)
    parser.add_argument("--old-max", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--child", nargs="+")
    ns = parser.parse_args()
    if ns.child:
        kind, *rest = ns.child
        if kind == "set":
            out = child_set(rest[0], rest[1], rest[2], rest[3] == "old")
        else:
            out = child_export(rest[0], int(rest[1]), rest[2] == "old")
        print(json.dumps(out))
        return

    from dmd2_core.toys.standins import TEXT_DIM, TEXT_TOKENS, build_h3_standin

    tokens = math.ceil(ns.prompt_mb * 1e6 / (TEXT_DIM * 4))
    result: dict = {"prompt_bytes": tokens * TEXT_DIM * 4, "sets": {}}
    with tempfile.TemporaryDirectory(prefix="dmd2-host-memory-") as tmp:
        teacher = build_h3_standin(f"{tmp}/h3")
        for n in ns.counts:
            prompts = f"{tmp}/prompts_{n}.safetensors"
            write_sparse_prompt_set(prompts, n, tokens, TEXT_DIM, TEXT_TOKENS)
            row = {"new": run_child("set", teacher, prompts, f"{tmp}/run", "new")}
            if n <= ns.old_max:
                row["old"] = run_child("set", teacher, prompts, f"{tmp}/run", "old")
            result["sets"][str(n)] = row
            os.remove(prompts)
        result["export"] = {}
        for kind in ("new", "old"):
            with tempfile.TemporaryDirectory(prefix="export-", dir=tmp) as root:
                got = run_child("export", root, str(ns.layers), kind)
            result["export"].update({k: got.pop(k) for k in ("params_m", "model_mib", "export_mib") if k in got})
            result["export"][kind] = got
    print(json.dumps(result))


if __name__ == "__main__":
    main()

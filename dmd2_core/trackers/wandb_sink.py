"""Weights & Biases, offline by default (run files only: ``wandb sync`` uploads them later; no
login, no network). Metrics and media are logged with ``step`` = the iteration; images as
wandb.Image, GIFs and MP4s as wandb.Video, soundtracks as wandb.Audio; the configuration once, as
the run's config. A resumed run is ``wandb.init(id=<the stored id>, resume="allow")``: offline,
a new run directory of the same id, which ``wandb sync`` appends to the run; its steps start after
the last one already written (W&B drops a step below its current one).

W&B writes its run file every 15 s (``x_transaction_log_flush_interval``), and a killed process's
unwritten records are lost: ``held`` is the last step the run's files (offline) or W&B's server
(online: where the resumed run starts) really hold, and the rerun gives it the rest again."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import uuid
from pathlib import Path
from typing import Optional

from dmd2_core import storage
from dmd2_core.args import Args
from dmd2_core.trackers.base import Medium, Sink


def dir_of(args: Args) -> Optional[str]:
    """The flag, else the save when it is local; None: W&B's own default (./wandb)."""
    if args.wandb_dir:
        return args.wandb_dir
    return str(Path(storage.filesystem(args.save)[1]).resolve()) if storage.is_local(args.save) else None


class WandbSink(Sink):
    name = "wandb"
    config_every_open = True  # the run's config, set again: a killed process may never have written it

    def __init__(self, args: Args, run_name: str, state: Optional[dict], written: int):
        import wandb

        super().__init__(args, run_name, state, written)
        run_id = self.state.get("run_id") or uuid.uuid4().hex[:12]
        directory = self.state.get("dir", dir_of(args))
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=args.wandb_project or args.run_name, name=run_name, id=run_id, dir=directory,
            mode=args.wandb_mode, resume="allow", reinit="create_new",
            settings=wandb.Settings(console="off", disable_git=True, save_code=False))
        self.state.update(run_id=run_id, dir=directory)
        if state and args.wandb_mode == "offline":
            self.held = offline_last_step(Path(directory or "."), run_id)
        elif state and self.run.resumed:
            self.held = self.run.starting_step - 1
        self.staging = tempfile.mkdtemp(prefix="dmd2-wandb-")  # media files until W&B has copied them

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def write(self, step: int, scalars: dict[str, float], media: list[Medium]) -> None:
        import wandb

        data: dict = dict(scalars)
        for m in media:
            path = Path(self.staging) / f"{step}_{m.name}.{m.ext}"
            path.write_bytes(m.data)
            if m.kind == "audio":
                data[f"eval/{m.name}"] = wandb.Audio(str(path), sample_rate=m.sample_rate, caption=m.caption)
            elif m.kind == "video":
                data[f"eval/{m.name}"] = wandb.Video(str(path), format=m.ext, caption=m.caption)
            else:
                data[f"eval/{m.name}"] = wandb.Image(str(path), caption=m.caption)
        self.run.log(data, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        shutil.rmtree(self.staging, ignore_errors=True)


BLOCK = 32768  # W&B's run file: a header, then 32 KiB blocks of framed chunks (leveldb's log format)
CHUNK_HEADER = 7  # crc32 (4), length (2), type (1: full, 2: first, 3: middle, 4: last)


def offline_last_step(directory: Path, run_id: str) -> int:
    """The last ``_step`` the offline run files of ``run_id`` under ``directory`` hold (every
    attempt's); -1 when they hold none. A file cut short by a kill is read up to its last whole
    record."""
    from wandb.proto.wandb_internal_pb2 import Record

    last = -1
    for run_file in (directory / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"):
        data, pos, pending = run_file.read_bytes(), CHUNK_HEADER, b""
        while pos + CHUNK_HEADER <= len(data):
            if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
                pos += BLOCK - pos % BLOCK
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
            if kind == 0 or pos + CHUNK_HEADER + length > len(data):
                break
            pending += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
            pos += CHUNK_HEADER + length
            if kind in (1, 4):
                record = Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    last = max([last] + [int(json.loads(item.value_json)) for item in record.history.item
                                         if (item.key or "/".join(item.nested_key)) == "_step"])
    return last

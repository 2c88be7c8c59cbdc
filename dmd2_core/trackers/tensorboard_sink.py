"""TensorBoard event files: scalars, grouped by what they measure (``losses/``, ``quality/``,
``grad_norm/``, ``timing/``, ``train/``: TensorBoard folds a tag's section at its first ``/``), eval
images (a GIF is an image TensorBoard animates) and the soundtracks as audio; the configuration as
text. The log directory is one run's, ``.../tensorboard/{run_name}``, so ``tensorboard --logdir
{save}/tensorboard`` lists the run by its name. A resumed run writes into the same log
directory with ``purge_step`` (the first step it will write): TensorBoard's readers drop whatever an
earlier attempt wrote from that step on, so each step shows once whatever an attempt left behind."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Optional

from PIL import Image

from dmd2_core import storage
from dmd2_core.args import Args
from dmd2_core.evaluation.evaluator import evaluator_of
from dmd2_core.step_counts import split_steps
from dmd2_core.trackers.base import Medium, Sink

COLOURS = {"L": 1, "LA": 2, "RGB": 3, "P": 3, "RGBA": 4}


def log_dir_of(args: Args) -> str:
    """The flag, else ``{save}/tensorboard/{run_name}`` for a local save, else
    ``./tensorboard/{run_name}``: on s3:// TensorBoard uploads the whole event file again at every
    flush (one an iteration here)."""
    if args.tensorboard_dir:
        return args.tensorboard_dir
    if storage.is_local(args.save):
        return storage.join(args.save, "tensorboard", args.run_name)
    return str(Path("tensorboard", args.run_name).resolve())


def scalar_tag(key: str, quality_keys: tuple[str, ...] = ()) -> str:
    """A metrics row's key as a TensorBoard tag in its group: ``dmd2_loss`` -> ``losses/dmd2_loss``,
    ``teacher_kid@4`` -> ``quality/teacher_kid@4`` (``quality_keys``: the run evaluator's figures),
    ``iteration_s`` -> ``timing/iteration_s``; a key no group names (a learning rate, a shift) under
    ``train/``."""
    name = split_steps(key)[0]
    if name in quality_keys or name.startswith(("drift_", "diversity_", "real_kid", "teacher_kid")):
        group = "quality"
    elif "grad_norm" in name or name.endswith("grad_ratio"):
        group = "grad_norm"
    elif "loss" in name:
        group = "losses"
    elif name.endswith("_s") or name == "wall_time":
        group = "timing"
    else:
        group = "train"
    return f"{group}/{key}"


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, args: Args, run_name: str, state: Optional[dict], written: int):
        from torch.utils.tensorboard import SummaryWriter

        super().__init__(args, run_name, state, written)
        log_dir = self.state.get("log_dir") or log_dir_of(args)
        self.state["log_dir"] = log_dir
        local = storage.is_local(log_dir)
        path = storage.filesystem(log_dir)[1] if local else log_dir
        if local:
            Path(path).mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=path, purge_step=written + 1 if written >= 0 else None)
        self.first_step = max(written + 1, 0)
        self.quality_keys = evaluator_of(args).quality_keys

    def log_config(self, config: dict) -> None:
        text = "```json\n" + json.dumps(config, indent=1, sort_keys=True, default=str) + "\n```"
        self.writer.add_text("config", text, self.first_step)
        self.writer.flush()

    def write(self, step: int, scalars: dict[str, float], media: list[Medium]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        for key, value in scalars.items():
            self.writer.add_scalar(scalar_tag(key, self.quality_keys), value, step)
        values = []
        for m in media:
            tag = f"eval/{m.name}"
            if m.kind == "audio":
                values.append(Summary.Value(tag=tag, audio=Summary.Audio(
                    sample_rate=m.sample_rate, num_channels=m.channels, length_frames=m.frames,
                    encoded_audio_string=m.data, content_type="audio/wav")))
            elif m.ext in ("png", "gif"):  # TensorBoard shows images the browser decodes; an MP4 is not one
                with Image.open(io.BytesIO(m.data)) as img:
                    width, height, colours = img.width, img.height, COLOURS.get(img.mode, 3)
                values.append(Summary.Value(tag=tag, image=Summary.Image(
                    height=height, width=width, colorspace=colours, encoded_image_string=m.data)))
        if values:
            self.writer.file_writer.add_summary(Summary(value=values), step)
        self.writer.flush()  # what the metrics log records is on disk: the replay rule relies on it

    def close(self, failed: bool = False) -> None:
        self.writer.close()

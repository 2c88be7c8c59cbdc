"""Pretrain a small MiniMax-H3 teacher (``MiniMaxH3Transformer3DModel``) on sounding digits.

    python -m dmd2_core.toys.sounding_digits_teacher --save runs/av-teacher [--steps N] [--seed S] [--reuse] [--table]
        [--check-fixture tests/fixtures/av_teacher] [--write-fixture DIR]

The model is the flagship's class at a CPU size, in its packed layout (video patches, stereo audio
rows and text tokens in one sequence) and with both schedules: through ``MiniMaxH3Family`` the
project's sigma is the shared schedule position u, video sits at shift(u, 12) and audio at
shift(u, 3), and the family maps the model's data-ward velocity to the project's ``eps - x0``, so
the teacher is trained in exactly the convention distillation uses. Loss: each modality's own
flow-matching mse, averaged (``losses.flow_matching_loss`` with the family's segments).

One forward holds one u (the family's layout rule), so a batch is split into ``U_GROUPS`` = 8
groups, each at its own u, and each clip of the batch is seen at ``SIGMAS_PER_CLIP`` = 2 of them
(16 clips, 32 rows): more noise levels per step, and several per clip, cut the variance of the
loss over u (with 2 levels per step, 700 steps left frames that were not yet digits). Half the u
are uniform (the sampling grid visits u uniformly); the other half put the *video* sigma
logit-normal, since shift 12 leaves the video nearly pure noise for most u and its fine detail is
made at small u. Labels are never dropped: the teacher is guidance-distilled (one forward per
step), as MiniMax-H3 is.

Saved as a diffusers directory: transformer/, scheduler/ (shift 12), audio_scheduler/ (shift 3),
model_index.json, the conditions of the ten digits in ``prompts.safetensors`` beside them, and the
train clips as a real set for the GAN head (``real.safetensors``).

The tests load this teacher from a committed fixture (``tests/fixtures/av_teacher``: the saved
directory less its real set, which ``ensure_real_set`` rebuilds; 1.5 MB of fp32 weights) instead
of training it for minutes; ``--check-fixture`` says whether the teacher at ``--save`` has the
fixture's weights to the bit (``make av-teacher`` runs it), ``--write-fixture`` writes one.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import hashlib
from pathlib import Path
from typing import Callable, Optional

import torch

from dmd2_core import storage
from dmd2_core.train import dmd2_iteration
from dmd2_core.data import REAL_LATENTS, write_safetensors
from dmd2_core.toys import sounding_digits as sd
from dmd2_core.losses import flow_matching_loss
from dmd2_core.models import describe_model_dir, load_model_dir, save_model_dir, transformer_folder
from dmd2_core.errors import ModelDirError
from dmd2_core.models.minimax_h3 import AUDIO_SHIFT, VIDEO_SHIFT, MiniMaxH3Family
from dmd2_core.toys.digits_teacher import ema_update, lr_factor, logit_normal_sigmas

DEFAULT_STEPS = 4000  # measured: 2000 steps (loss 0.29) agree on sound and picture in 25% of
# 50-step clips, 4000 (loss 0.25) in 39%; the teacher bounds every student's agreement
DEFAULT_BATCH_SIZE = 32
U_GROUPS = 8  # noise levels per step, one forward each
SIGMAS_PER_CLIP = 2  # each clip of a step is seen at this many of its noise levels
ROPE_THETA = 100.0  # the rotary base: the grid is 4 frames x 4 x 8 patches and 8 audio rows, not thousands
DEFAULT_LR = 1e-3
DEFAULT_EMA_DECAY = 0.999
PROMPTS_FILE = "prompts.safetensors"
TRAINING_FILE = "training.json"  # how the teacher was trained: what --reuse compares
REAL_FILE = "real.safetensors"  # the train clips as a real set: the GAN head's real_data
TABLE_STEPS = (50, 8, 4, 1)
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_FILE = f"transformer/{WEIGHTS_NAME}"  # a ref2va teacher's are in transformer_ref/, as H3's own partition
# the test fixture: the saved teacher less its real set (6 MB that ``ensure_real_set`` rebuilds)
FIXTURE_FILES = ("model_index.json", "scheduler/scheduler_config.json", "audio_scheduler/scheduler_config.json",
                 "transformer/config.json", WEIGHTS_FILE, PROMPTS_FILE, TRAINING_FILE)
FIXTURE_HASH_FILE = "weights.sha256"  # `sha256sum -c weights.sha256` in the fixture checks it too


# a world's conditions per train clip, by the workflow its teacher is trained for (t2va: the digits' prompts)
WORLD_PROMPT_SETS = {"fl2va": sd.keyframe_prompt_set, "ref2va": sd.reference_prompt_set}


def tiny_h3_config(width: int = 64, layers: int = 4) -> dict:
    """The default is ~0.4 M parameters: 4 blocks (plus a refiner) of width 64, two heads of 32, and
    a rotary base of ``ROPE_THETA`` (diffusers' 10000 is for long sequences: at this grid its
    slower frequencies hardly turn from one position to the next)."""
    heads = 2
    return dict(num_attention_heads=heads, attention_head_dim=width // heads, hidden_size=width, num_layers=layers,
                num_refiner_layers=1, ffn_dim=2 * width, in_channels=sd.VIDEO_LATENT_SHAPE[0],
                audio_in_channels=sd.AUDIO_ROW, patch_size=(1, 2, 2),
                text_dim=sd.prompt_set().embeds["prompt_embeds"].shape[-1], freq_dim=64, time_embed_hidden_dim=width,
                time_embed_dim=32, rope_freq_dim=width // heads // 8, rope_theta=ROPE_THETA)


def new_av_teacher_model(seed: int = 0, config: Optional[dict] = None) -> torch.nn.Module:
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MiniMaxH3Transformer3DModel(**(config or tiny_h3_config()))


def bound_family(model: Optional[torch.nn.Module] = None) -> MiniMaxH3Family:
    return MiniMaxH3Family().bind(sd.VIDEO_LATENT_SHAPE, model, (VIDEO_SHIFT, AUDIO_SHIFT))


def draw_u(n: int, generator: torch.Generator) -> torch.Tensor:
    """Half uniform u, half u whose video sigma shift(u, 12) is logit-normal (see the module doc)."""
    uniform = torch.rand(n, generator=generator)
    video_sigma = logit_normal_sigmas(n, generator)
    from_video = video_sigma / (VIDEO_SHIFT - (VIDEO_SHIFT - 1) * video_sigma)  # the inverse shift
    return torch.where(torch.rand(n, generator=generator) < 0.5, uniform, from_video)


def train_av_teacher(save_url: Optional[str], seed: int = 0, num_steps: int = DEFAULT_STEPS,
                     batch_size: int = DEFAULT_BATCH_SIZE, lr: float = DEFAULT_LR,
                     ema_decay: float = DEFAULT_EMA_DECAY, data_seed: int = 0, config: Optional[dict] = None,
                     log: Optional[Callable[[str], None]] = print, log_every: int = 250,
                     workflow: str = "t2va") -> dict:
    """Train (deterministic for a seed at a fixed thread count) and save the EMA weights at
    ``save_url`` (None: not saved). ``workflow`` ``fl2va``: every clip conditioned on its own first
    and last frames too (``sd.keyframe_prompt_set``). Returns {url, seed, steps, batch_size, lr,
    workflow, train_time_s, final_loss, num_params, model}."""
    clips = sd.make_clips("train", data_seed)
    x_train = sd.encode(clips.frames, clips.audio)
    conditions = train_conditions(workflow, clips)
    model = new_av_teacher_model(seed, config)
    family = bound_family(model)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, num_steps))
    g = torch.Generator().manual_seed(seed)
    per_group = batch_size // U_GROUPS
    losses: list[float] = []
    start = time.perf_counter()
    model.train()
    for step in range(num_steps):
        clips_idx = torch.randint(0, len(x_train), (per_group * U_GROUPS // SIGMAS_PER_CLIP,), generator=g)
        # the copies of a clip land in different groups, hence at different noise levels
        idx = torch.cat([clips_idx[torch.randperm(len(clips_idx), generator=g)] if r else clips_idx
                         for r in range(SIGMAS_PER_CLIP)])
        x0, cond = x_train[idx], conditions(idx)
        noise = torch.randn(x0.shape, generator=g)
        u = draw_u(U_GROUPS, g).repeat_interleave(per_group)
        v = family.predict_velocity(model, family.add_noise(x0, noise, u), u, cond)
        loss = flow_matching_loss(v, noise, x0, family.segments)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema_update(ema, model, min(ema_decay, (1 + step) / (10 + step)))
        losses.append(loss.item())
        if log and ((step + 1) % log_every == 0 or step + 1 == num_steps):
            recent = losses[-log_every:]
            log(f"av teacher step {step + 1}/{num_steps} loss {sum(recent) / len(recent):.4f} "
                f"({time.perf_counter() - start:.0f}s)")
    train_time = time.perf_counter() - start
    ema.eval()
    tail = losses[-100:]
    record = {"seed": seed, "steps": num_steps, "batch_size": batch_size, "lr": lr, "data_seed": data_seed,
              **({} if workflow == "t2va" else {"workflow": workflow}),
              "train_time_s": round(train_time, 2), "final_loss": sum(tail) / len(tail),
              "num_params": sum(p.numel() for p in ema.parameters())}
    if save_url is not None:
        save_av_teacher(ema, save_url, workflow)
        storage.write_bytes(storage.join(save_url, TRAINING_FILE), json.dumps(record, indent=1).encode())
        if log:
            log(f"av teacher saved to {save_url}")
    return {"url": save_url, **record, "model": ema}


def train_conditions(workflow: str, clips: sd.Clips) -> Callable[[torch.Tensor], dict]:
    """Clip indices -> their conditions: the digit's prompt (t2va), and its own keyframes (fl2va);
    or a prompt naming no digit and a picture of its digit as a reference (ref2va)."""
    if workflow in WORLD_PROMPT_SETS:
        return WORLD_PROMPT_SETS[workflow](clips).cond
    prompts = sd.prompt_set()
    return lambda idx: prompts.cond(clips.labels[idx])


def save_av_teacher(model: torch.nn.Module, url: str, workflow: str = "t2va") -> None:
    from diffusers import MiniMaxH3Scheduler

    save_model_dir(model, url, shift=VIDEO_SHIFT, folder=transformer_folder(workflow))
    with tempfile.TemporaryDirectory() as tmp:
        MiniMaxH3Scheduler(shift=AUDIO_SHIFT).save_pretrained(tmp)
        storage.write_bytes(storage.join(url, "audio_scheduler", "scheduler_config.json"),
                            (Path(tmp) / "scheduler_config.json").read_bytes())
    save_conditions(url, workflow)


def save_conditions(url: str, workflow: str, data_seed: int = 0) -> None:
    """The teacher's prompt set (a student's training conditions: for fl2va the train clips'
    keyframes, one row each; a bench evaluates on the held-out clips', ``sd.heldout_clips``) and
    its real set."""
    prompts = WORLD_PROMPT_SETS[workflow](sd.make_clips("train", data_seed)) if workflow in WORLD_PROMPT_SETS \
        else sd.prompt_set()
    prompts.save(prompts_url(url))
    save_real_set(real_set_url(url), data_seed, workflow)


def teacher_workflow(teacher_url: str) -> str:
    """The workflow the teacher at ``teacher_url`` was trained for (its ``training.json``)."""
    record_url = storage.join(teacher_url, TRAINING_FILE)
    return json.loads(storage.read_bytes(record_url)).get("workflow", "t2va") if storage.exists(record_url) else "t2va"


def prompts_url(teacher_url: str) -> str:
    return storage.join(teacher_url, PROMPTS_FILE)


def real_set_url(teacher_url: str) -> str:
    return storage.join(teacher_url, REAL_FILE)


def save_real_set(url: str, data_seed: int = 0, workflow: str = "t2va") -> None:
    """The train clips (the teacher's own data) as a real set for the GAN head: their latents and,
    per clip, its conditions (``train_conditions``). Deterministic from ``data_seed``."""
    clips = sd.make_clips("train", data_seed)
    write_safetensors(url, {REAL_LATENTS: sd.encode(clips.frames, clips.audio),
                            **train_conditions(workflow, clips)(torch.arange(len(clips)))})


def ensure_real_set(teacher_url: str) -> str:
    """The teacher's real set, written beside it if an older teacher directory lacks one."""
    url = real_set_url(teacher_url)
    if not storage.exists(url):
        save_real_set(url, workflow=teacher_workflow(teacher_url))
    return url


def ensure_conditions(teacher_url: str) -> str:
    """A teacher's prompt and real sets written beside its weights where they are missing (an
    fl2va fixture keeps its weights only: its sets are 3 MB that this rebuilds to the bit)."""
    if not storage.exists(prompts_url(teacher_url)):
        save_conditions(teacher_url, teacher_workflow(teacher_url))
    return ensure_real_set(teacher_url)


def present(url: str) -> bool:
    """``url`` holds a readable teacher (its prompt and real sets are rebuilt when missing)."""
    try:
        describe_model_dir(url, transformer=transformer_folder(teacher_workflow(url)))
    except ModelDirError:
        return False
    return True


def differs(url: str, seed: int = 0, num_steps: int = DEFAULT_STEPS, workflow: str = "t2va") -> Optional[str]:
    """How the teacher at ``url`` was trained otherwise than ``num_steps`` from ``seed`` for
    ``workflow`` (None: as asked). A teacher from before ``training.json`` was written recorded nothing."""
    record_url = storage.join(url, TRAINING_FILE)
    if not storage.exists(record_url):
        return f"no {TRAINING_FILE}: trained before its steps were recorded"
    record = json.loads(storage.read_bytes(record_url))
    if record.get("workflow", "t2va") != workflow:
        return f"trained for {record.get('workflow', 't2va')}, not {workflow}"
    if (record.get("steps"), record.get("seed")) != (num_steps, seed):
        return f"trained for {record.get('steps')} steps from seed {record.get('seed')}, not {num_steps} from {seed}"
    return None


def reuse_message(url: str, seed: int = 0, num_steps: int = DEFAULT_STEPS, workflow: str = "t2va") -> str:
    why = differs(url, seed, num_steps, workflow)
    return f"reusing av teacher at {url}" + (
        "" if why is None else f" ({why}; its figures are not the bench's: remove it to train this one)")


def ensure_av_teacher(url: str, seed: int = 0, log: Optional[Callable[[str], None]] = print,
                      num_steps: int = DEFAULT_STEPS, workflow: str = "t2va", **train_kwargs) -> str:
    """``url`` when it already holds a teacher (reused as it is, never overwritten, its missing
    sets rebuilt; the log says when it was trained otherwise than asked), else one trained there."""
    if present(url):
        if log:
            log(reuse_message(url, seed, num_steps, workflow))
        ensure_conditions(url)
        return url
    train_av_teacher(url, seed=seed, num_steps=num_steps, log=log, workflow=workflow, **train_kwargs)
    return url


def weights_sha256(teacher_url: str) -> str:
    return hashlib.sha256(storage.read_bytes(storage.join(teacher_url, weights_file(teacher_url)))).hexdigest()


def weights_file(teacher_url: str) -> str:
    """The teacher's weights file, in the partition its workflow distills (``transformer_folder``)."""
    return f"{transformer_folder(teacher_workflow(teacher_url))}/{WEIGHTS_NAME}"


def load_teacher(url: str):
    """The teacher at ``url`` (``load_model_dir``), from the partition its workflow distills."""
    return load_model_dir(url, transformer=transformer_folder(teacher_workflow(url)))


def recorded_sha256(fixture_dir: str) -> str:
    """The weights' sha256 recorded beside the fixture."""
    return (Path(fixture_dir) / FIXTURE_HASH_FILE).read_text().split()[0]


def write_fixture(teacher_url: str, fixture_dir: str) -> str:
    """Copy the teacher's ``FIXTURE_FILES`` (an fl2va teacher's less its prompt set) to
    ``fixture_dir`` and record its weights' sha256 there."""
    out = Path(fixture_dir)
    # an fl2va teacher's prompt set is 3 MB that ``ensure_conditions`` rebuilds: not committed
    folder = transformer_folder(teacher_workflow(teacher_url))
    for name in (n for n in FIXTURE_FILES if n != PROMPTS_FILE or teacher_workflow(teacher_url) == "t2va"):
        name = name.replace("transformer/", f"{folder}/")
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(storage.read_bytes(storage.join(teacher_url, name)))
    digest = weights_sha256(str(out))
    (out / FIXTURE_HASH_FILE).write_text(f"{digest}  {weights_file(teacher_url)}\n")
    return digest


def check_fixture(teacher_url: str, fixture_dir: str) -> Optional[str]:
    """None when the teacher at ``teacher_url`` has the fixture's weights to the bit, else why not."""
    recorded = recorded_sha256(fixture_dir)
    if weights_sha256(fixture_dir) != recorded:
        return f"the fixture's own weights at {fixture_dir} are not the sha256 recorded beside them ({recorded})"
    trained = json.loads(storage.read_bytes(storage.join(fixture_dir, TRAINING_FILE)))
    why = differs(teacher_url, trained["seed"], trained["steps"], trained.get("workflow", "t2va"))
    if why is not None:
        return f"the teacher at {teacher_url} is not the fixture's recipe ({why}): nothing to compare"
    got = weights_sha256(teacher_url)
    if got == recorded:
        return None
    from safetensors.torch import load as load_safetensors

    mine = load_safetensors(storage.read_bytes(storage.join(teacher_url, weights_file(teacher_url))))
    theirs = load_safetensors((Path(fixture_dir) / weights_file(fixture_dir)).read_bytes())
    if mine.keys() != theirs.keys() or any(mine[k].shape != theirs[k].shape for k in mine):
        return f"the teacher at {teacher_url} has other tensors than the fixture's: another model config"
    gap = max((mine[k].float() - theirs[k].float()).abs().max().item() for k in mine)
    return (f"the weights at {teacher_url} (sha256 {got}) are not the fixture's ({recorded}), by at most {gap:.3g}: "
            "same recipe and seed, so this is float arithmetic that differs from where the fixture was made "
            "(CPU kernels, torch version, thread count: it was made with --threads 1). The tests keep loading the "
            f"committed fixture; if the recipe changed on purpose, write a new one with --write-fixture {fixture_dir}")


@torch.no_grad()
def sample_clips(family, model, labels: torch.Tensor, num_steps: int, seed: int,
                 cond: Optional[dict] = None) -> torch.Tensor:
    """K Euler steps on MiniMax-H3's grid u = 1, (K-1)/K, .., 1/K, 0 from the pipeline's noise of
    ``seed`` (sample j from seed + j): for a teacher, its K-step samples; for a student, its own.
    ``cond``: the samples' conditions (default the digits' prompts of ``labels``)."""
    cond = sd.prompt_set().cond(labels) if cond is None else cond
    return dmd2_iteration.eval_samples(family, model, cond, (len(labels), sd.SAMPLE_SIZE), seed, num_steps, 1.0)


class EvalClips:
    """What a sampler of the teacher's workflow is evaluated on: ``n`` digits balanced over the
    ten (t2va), or ``n`` held-out clips' conditions (``sd.heldout_clips``, never trained on: fl2va
    their keyframes, ref2va their digits' pictures), and their figures
    (``sounding_digits_metrics``; with keyframes, ``keyframe_figures`` too; with references, the
    digit and sound accuracies are the reference's: the prompt names no digit)."""

    def __init__(self, workflow: str, n: int, data_seed: int = 0):
        from dmd2_core.toys import sounding_digits_metrics

        self.workflow = workflow
        if workflow == "fl2va":
            clips = sd.heldout_clips(n, data_seed)
            self.labels, self.anchors = clips.labels, sd.KEYFRAME_ANCHORS
            self.cond = sd.keyframe_prompt_set(clips, self.anchors).cond(torch.arange(n))
            self.keyframes = clips.frames[:, sd.keyframe_frames(self.anchors)]
        elif workflow == "ref2va":
            clips = sd.heldout_clips(n, data_seed)
            self.labels = clips.labels
            self.cond = sd.reference_prompt_set(clips).cond(torch.arange(n))
        else:
            self.labels, self.cond = sounding_digits_metrics.balanced_labels(n), None

    def sample(self, family, model, num_steps: int, seed: int) -> torch.Tensor:
        return sample_clips(family, model, self.labels, num_steps, seed, self.cond)

    def figures(self, samples: torch.Tensor) -> dict[str, float]:
        from dmd2_core.toys import sounding_digits_metrics

        out = sounding_digits_metrics.evaluate_clips(samples, self.labels)
        if self.workflow == "fl2va":
            out.update(sounding_digits_metrics.keyframe_figures(samples, self.keyframes, self.anchors))
        return out


def av_teacher_table(url: str, steps=TABLE_STEPS, num_samples: int = 500, seed: int = 0) -> dict:
    loaded = load_teacher(url)
    family = bound_family(loaded.model)
    clips = EvalClips(teacher_workflow(url), num_samples)
    return {str(k): clips.figures(clips.sample(family, loaded.model.eval(), k, seed)) for k in steps}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmd2_core.toys.sounding_digits_teacher", description=__doc__.splitlines()[0])
    parser.add_argument("--save", required=True, help="Storage URL of the teacher (path, file:// or s3://).")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--lr", type=float, default=DEFAULT_LR)
    parser.add_argument("--workflow", choices=("t2va", "fl2va", "ref2va"), default="t2va",
                        help="fl2va: every clip conditioned on its own first and last frames too; ref2va: on a "
                             "picture of its digit (another clip's), its prompt naming no digit.")
    parser.add_argument("--reuse", action="store_true", help="Reuse a teacher already at --save.")
    parser.add_argument("--table", action="store_true", help="Print the quality table at 50/8/4/1 steps.")
    parser.add_argument("--num-samples", type=int, default=500)
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--check-fixture", metavar="DIR", help="Say whether the teacher's weights are the test "
                        "fixture's at DIR to the bit (its recorded sha256); exit 1 when not.")
    parser.add_argument("--write-fixture", metavar="DIR", help="Write the teacher as a test fixture at DIR.")
    ns = parser.parse_args(argv)
    torch.set_num_threads(ns.threads)
    result: dict = {"url": ns.save, "reused": ns.reuse and present(ns.save)}
    if result["reused"]:
        ensure_av_teacher(ns.save, ns.seed, lambda m: print(m, file=sys.stderr), ns.steps, ns.workflow)
    else:
        info = train_av_teacher(ns.save, seed=ns.seed, num_steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr,
                                workflow=ns.workflow)
        info.pop("model")
        result.update(info)
    if ns.table:
        result["table"] = av_teacher_table(ns.save, num_samples=ns.num_samples, seed=ns.eval_seed)
    if ns.write_fixture:
        result["fixture_sha256"] = write_fixture(ns.save, ns.write_fixture)
    mismatch = None
    if ns.check_fixture:
        mismatch = check_fixture(ns.save, ns.check_fixture)
        result["fixture"] = "matches" if mismatch is None else "differs"
        print(f"av teacher fixture check: weights are the fixture's at {ns.check_fixture} (sha256 "
              f"{recorded_sha256(ns.check_fixture)})" if mismatch is None else
              f"av teacher fixture check FAILED: {mismatch}", file=sys.stderr)
    print(json.dumps(result))
    return 0 if mismatch is None else 1


if __name__ == "__main__":
    sys.exit(main())

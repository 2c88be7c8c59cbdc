"""Quality metrics for the digits task: Fréchet distance (FD) in a small digits classifier's feature
space, measured against the held-out test split, class accuracy and within-prompt diversity.

The classifier is trained once on the train split (deterministic for its version string) and cached
under ``$DMD2_CACHE_DIR`` (default ``~/.cache/dmd2``), so every process scores in the same space.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dmd2_core import flow_matching as fm
from dmd2_core.data import PromptSet
from dmd2_core.toys.digits import digits_prompt_set, digits_tensors
from dmd2_core.sampling import euler_sample

# Bump when the architecture or the training recipe changes: it names the cache file.
CLASSIFIER_VERSION = "mlp-256-64-v1"
FEATURE_DIM = 64
TEACHER_TABLE_STEPS = (50, 8, 4, 2, 1)

SampleFn = Callable[[torch.Tensor, dict, torch.Tensor], torch.Tensor]


class DigitsClassifier(torch.nn.Module):
    """64 pixels -> 256 -> 64 (the feature layer) -> 10 logits."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, FEATURE_DIM),
            torch.nn.Tanh(),  # bounded, dense features keep the feature covariance well conditioned
        )
        self.head = torch.nn.Linear(FEATURE_DIM, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(images))


def cache_dir() -> Path:
    return Path(os.environ.get("DMD2_CACHE_DIR") or Path.home() / ".cache" / "dmd2")


def classifier_path() -> Path:
    return cache_dir() / f"digits-classifier-{CLASSIFIER_VERSION}.safetensors"


@torch.enable_grad()  # the first use may come from inside a no_grad block
def _train_classifier(seed: int = 0, epochs: int = 150, batch_size: int = 64) -> DigitsClassifier:
    x, y = digits_tensors("train")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsClassifier()
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch_size):
            idx = perm[i : i + batch_size]
            # Mild pixel noise makes the features vary smoothly around real digits, which is where
            # generated samples land.
            xb = x[idx] + 0.1 * torch.randn(x[idx].shape, generator=g)
            loss = torch.nn.functional.cross_entropy(model(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


_CLASSIFIERS: dict[str, DigitsClassifier] = {}


def digits_classifier() -> DigitsClassifier:
    """The cached classifier: from memory, else from the cache file, else trained and written."""
    path = classifier_path()
    key = str(path)
    if key in _CLASSIFIERS:
        return _CLASSIFIERS[key]
    if path.is_file():
        model = DigitsClassifier()
        model.load_state_dict(load_file(str(path)))
        model.eval()
    else:
        # One thread: the cached weights then do not depend on the creating process's thread count.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model = _train_classifier()
        finally:
            torch.set_num_threads(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp),
                  metadata={"version": CLASSIFIER_VERSION})
        os.replace(tmp, path)
    for p in model.parameters():
        p.requires_grad_(False)
    _CLASSIFIERS[key] = model
    return model


def _prepare(images: torch.Tensor | np.ndarray) -> torch.Tensor:
    images = images if torch.is_tensor(images) else torch.as_tensor(np.asarray(images))
    # Samplers can overshoot the pixel range; score what would be saved as an image.
    return images.detach().float().cpu().reshape(-1, 1, 8, 8).clamp(-1, 1)


@torch.no_grad()
def features(images: torch.Tensor | np.ndarray) -> np.ndarray:
    """Feature-layer activations [N, FEATURE_DIM] (float64) of images [N, 1, 8, 8] in [-1, 1]."""
    return digits_classifier().body(_prepare(images)).double().numpy()


@torch.no_grad()
def predict(images: torch.Tensor | np.ndarray) -> np.ndarray:
    return digits_classifier()(_prepare(images)).argmax(1).numpy()


def class_accuracy(images: torch.Tensor | np.ndarray, labels) -> float:
    return float((predict(images) == np.asarray(labels).reshape(-1)).mean())


def _sqrtm_of_product(cov_a: np.ndarray, cov_b: np.ndarray, eps: float) -> np.ndarray:
    """Real part of sqrtm(C_a C_b); near-singular covariances (collapsed or constant features) are
    regularised with eps * I, as pytorch-fid does, when the plain root is inaccurate."""
    from scipy import linalg

    def root(a, b):
        prod = a @ b
        covmean = linalg.sqrtm(prod)
        err = np.linalg.norm(covmean @ covmean - prod) / max(np.linalg.norm(prod), 1e-300)
        return covmean, bool(np.isfinite(covmean).all() and err < 1e-6)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", linalg.LinAlgWarning)  # singular inputs are handled below
        covmean, ok = root(cov_a, cov_b)
        if not ok:
            offset = np.eye(cov_a.shape[0]) * eps
            covmean, _ = root(cov_a + offset, cov_b + offset)
    return np.real(covmean)


def frechet_distance(feats_a: np.ndarray, feats_b: np.ndarray, eps: float = 1e-6) -> float:
    """||mu_a - mu_b||^2 + Tr(C_a + C_b - 2 sqrt(C_a C_b)) between two feature sets [N, D]."""
    feats_a, feats_b = np.asarray(feats_a, np.float64), np.asarray(feats_b, np.float64)
    mu_a, mu_b = feats_a.mean(0), feats_b.mean(0)
    cov_a = np.atleast_2d(np.cov(feats_a, rowvar=False))
    cov_b = np.atleast_2d(np.cov(feats_b, rowvar=False))
    diff = mu_a - mu_b
    fd = diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(_sqrtm_of_product(cov_a, cov_b, eps))
    # Rounding can leave a tiny negative value for identical distributions.
    return float(max(fd, 0.0))


def within_prompt_diversity(images: torch.Tensor | np.ndarray, labels) -> float:
    """Mean over prompts of the per-feature standard deviation among that prompt's samples:
    low means mode collapse, above the real digits' value means over-dispersed samples."""
    return feature_diversity(features(images), np.asarray(labels).reshape(-1))


def feature_diversity(feats: np.ndarray, labels: np.ndarray) -> float:
    stds = [feats[labels == c].std(0, ddof=1).mean() for c in np.unique(labels) if (labels == c).sum() > 1]
    return float(np.mean(stds)) if stds else 0.0


def reference_stats() -> dict[str, float]:
    """The real digits' own values: FD of the held-out test split against the train split (the
    floor a perfect sampler reaches with this many test samples), their accuracy and diversity."""
    x_te, y_te = digits_tensors("test")
    x_tr, _ = digits_tensors("train")
    f_te = features(x_te)
    return {
        "fd": frechet_distance(features(x_tr), f_te),
        "acc": class_accuracy(x_te, y_te),
        "diversity": feature_diversity(f_te, y_te.numpy()),
    }


def evaluate_digits(images: torch.Tensor | np.ndarray, labels) -> dict[str, float]:
    """{fd, acc, diversity} of generated images against the held-out test split."""
    labels = np.asarray(labels).reshape(-1)
    feats = features(images)
    test_feats = features(digits_tensors("test")[0])
    return {
        "fd": frechet_distance(feats, test_feats),
        "acc": class_accuracy(images, labels),
        "diversity": feature_diversity(feats, labels),
    }


def balanced_labels(num_samples: int, num_classes: int = 10) -> torch.Tensor:
    return torch.arange(num_samples) % num_classes


def eval_noise(num_samples: int, seed: int, shape: Sequence[int] = (1, 8, 8)) -> torch.Tensor:
    """The starting noise of every sampler evaluated with this seed."""
    return torch.randn((num_samples, *shape), generator=torch.Generator().manual_seed(seed))


def sample_quality(
    sample_fn: SampleFn,
    num_samples: int = 2000,
    seed: int = 0,
    prompts: Optional[PromptSet] = None,
) -> dict[str, float]:
    """Score a sampler: ``sample_fn(noise, cond, labels) -> images`` gets seeded noise [N, 1, 8, 8],
    the prompt conditions and labels balanced over the prompts; returns {fd, acc, diversity}."""
    prompts = prompts or digits_prompt_set()
    labels = balanced_labels(num_samples, len(prompts))
    noise = eval_noise(num_samples, seed)
    images = sample_fn(noise, prompts.cond(labels), labels)
    return evaluate_digits(images, labels)


def teacher_table(
    model,
    steps: Sequence[int] = TEACHER_TABLE_STEPS,
    num_samples: int = 2000,
    seed: int = 0,
    guidance_scale: float = 1.0,
    shift: Optional[float] = None,
) -> dict[str, dict[str, float]]:
    """Teacher quality at several Euler step counts, all from the same noise:
    {str(steps): {fd, acc, diversity}}. ``model`` is a checkpoint URL or a LoadedModel;
    ``shift`` defaults to the checkpoint's scheduler shift."""
    from dmd2_core.models import LoadedModel, load_model_dir

    loaded: LoadedModel = load_model_dir(model) if isinstance(model, (str, os.PathLike)) else model
    shift = loaded.shift if shift is None else shift
    prompts = digits_prompt_set()
    net = loaded.model.eval()
    table = {}
    for n in steps:
        sigmas = fm.euler_sigmas(int(n), shift)

        def sample(noise, cond, labels, sigmas=sigmas):
            uncond = prompts.uncond(len(noise))
            x = euler_sample(loaded.family, net, noise, cond, sigmas, uncond, guidance_scale)
            return loaded.family.decode(loaded.vae, x)

        table[str(n)] = sample_quality(sample, num_samples, seed, prompts)
    return table


def format_table(table: dict[str, dict[str, float]], reference: Optional[dict[str, float]] = None) -> str:
    """A plain-text table of {row: {metric: value}}; ``reference`` adds the real digits' row."""
    rows = dict(table)
    if reference:
        rows = {**rows, "real": reference}
    metrics = list(next(iter(rows.values())).keys()) if rows else []
    lines = ["steps  " + "  ".join(f"{m:>9}" for m in metrics)]
    for name, vals in rows.items():
        lines.append(f"{name:>5}  " + "  ".join(f"{vals[m]:9.4f}" for m in metrics))
    return "\n".join(lines)

"""Activation bytes for the memory plan, from a calibration measured on real-width blocks.

``activation_calibration.json`` (written by ``python bench/activations.py``) holds, per real
config, fits ``bytes = a * tokens + b (+ c * tokens^2)`` of what autograd saves for backward in
bf16: one block's own (``per_block``), its carried input (``carried``, all a checkpointed block
keeps), the inputs every block shares (``shared``) and the rest of the model (``root``). A config
the file does not hold is estimated: the family's hand count of elements per block
(``ModelFamily.activation_elements``) times the ratio measured/hand of a calibrated config of the
same family; ``source`` says which.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "activation_calibration.json")
CALIBRATED_BYTES = 2  # the calibration ran in bf16
# the config keys that set one block's widths (a calibrated config matches on these)
WIDTH_KEYS = ("num_attention_heads", "attention_head_dim", "hidden_size", "ffn_dim", "patch_size", "in_channels",
              "text_dim", "joint_attention_dim", "caption_projection_dim", "qk_norm", "cross_attn_norm")


def match_keys(config: dict) -> dict:
    return {k: list(config[k]) if isinstance(config[k], tuple) else config[k]
            for k in WIDTH_KEYS if config.get(k) is not None}


def one_block_configs(config: dict) -> list[tuple[float, dict]]:
    """The one-block configs whose mix is an average block: SD3.5's MMDiT-X blocks with a second
    attention and those without, weighted by their share of the layers; else one block."""
    layers = int(config.get("num_layers", 1))
    base = {**config, "num_layers": 1}
    if "num_refiner_layers" in config:
        base["num_refiner_layers"] = 0
    dual = config.get("dual_attention_layers")
    if dual:
        with_dual = len([i for i in dual if i < layers])
        parts = [(with_dual / layers, {**base, "dual_attention_layers": [0]})]
        if with_dual < layers:
            parts.append(((layers - with_dual) / layers, {**base, "dual_attention_layers": []}))
        return parts
    return [(1.0, base)]


def fit(tokens: list[int], values: list[int], secant: bool = False) -> dict:
    """``bytes = per_token * tokens + constant`` by least squares (what autograd saves grows
    linearly), or with ``secant`` through the two largest counts (a forward's peak moves from the
    text tokens to the image tokens as these grow; the plan needs the large-count slope); never
    below ``floor``, the smallest count's figure for a peak. ``quadratic`` is the least-squares
    ``tokens^2`` coefficient, kept as evidence (~0 with SDPA: no score matrix is kept)."""
    import torch

    t = torch.tensor(tokens, dtype=torch.float64)
    v = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
    if secant:
        order = sorted(range(len(tokens)), key=tokens.__getitem__)[-2:]
        (t0, v0), (t1, v1) = [(tokens[i], values[i]) for i in order]
        a = (v1 - v0) / (t1 - t0)
        line = [a, v1 - a * t1]
    else:
        line = torch.linalg.lstsq(torch.stack([t, torch.ones_like(t)], 1), v).solution.squeeze(1).tolist()
    quad = torch.linalg.lstsq(torch.stack([t, torch.ones_like(t), t * t], 1), v).solution.squeeze(1).tolist()
    return {"per_token": float(line[0]), "constant": float(line[1]), "floor": float(min(values)) if secant else 0.0,
            "quadratic": float(quad[2])}


SECANT = {"no_grad_peak"}


@lru_cache(maxsize=1)
def load() -> dict:
    with open(PATH) as f:
        return json.load(f)


@dataclass
class Activations:
    """Bytes of one sample at ``tokens`` tokens, in the compute dtype."""
    per_block: int  # one block's saved tensors without checkpointing
    carried: int  # what one checkpointed block keeps
    shared: int  # inputs every block reads (once)
    root: int  # outside the blocks
    no_grad: int  # the peak working set of a forward without grad (a frozen teacher's, an eval's)
    source: str  # "calibrated (<config>)" or "estimated (...)"

    def total(self, num_blocks: int, checkpointing: bool) -> int:
        if checkpointing:
            return self.root + self.shared + num_blocks * self.carried + self.per_block
        return self.root + self.shared + num_blocks * self.per_block


KEYS = ("per_block", "carried", "shared", "root", "no_grad_peak")


def _at(fits: dict, key: str, tokens: int) -> float:
    f = fits[key]
    return max(f["floor"], f["per_token"] * tokens + f["constant"])


def _calibrated(entry: dict, tokens: int, config: dict | None = None) -> dict:
    """The fits at ``tokens``, the variants weighted as ``config`` mixes them (else as measured)."""
    mix = [w for w, _ in one_block_configs(config)] if config else []
    weights = mix if len(mix) == len(entry["variants"]) else [v["weight"] for v in entry["variants"]]
    return {key: sum(w * max(0.0, _at(v["fit"], key, tokens)) for w, v in zip(weights, entry["variants"]))
            for key in KEYS}


def lookup(config: dict) -> tuple:
    """(name, entry) of the calibrated config with these block sizes, else (None, None)."""
    keys = match_keys(config)
    for name, entry in load().get("configs", {}).items():
        if entry["class_name"] == config.get("_class_name") and entry["match"] == keys:
            return name, entry
    return None, None


def estimate(family, config: dict, tokens: int, text_tokens: int, hidden: int, compute_bytes: int) -> Activations:
    """One sample's activations at ``tokens`` tokens (image/video/audio; text at ``text_tokens``)."""
    name, entry = lookup(config)
    scale = compute_bytes / CALIBRATED_BYTES
    if entry is not None and text_tokens == entry["text_tokens"]:
        v = _calibrated(entry, tokens, config)
        return Activations(*(int(v[k] * scale) for k in KEYS), source=f"calibrated ({name})")
    hand = family.activation_elements(config, tokens, text_tokens) * compute_bytes
    carried = (tokens + text_tokens) * hidden * compute_bytes
    ratio, no_grad, why = 1.0, 0.5, "the hand count"
    for other, e in load().get("configs", {}).items():
        if e["class_name"] == config.get("_class_name"):
            measured = _calibrated(e, tokens)
            counted = family.activation_elements(e["match"], tokens, e["text_tokens"]) * CALIBRATED_BYTES
            ratio, no_grad = measured["per_block"] / counted, measured["no_grad_peak"] / measured["per_block"]
            why = f"the hand count x {ratio:.2f}, the ratio measured on {other}"
            break
    per_block = int(hand * ratio)
    return Activations(per_block, carried, 0, 0, int(per_block * no_grad), source=f"estimated ({why})")

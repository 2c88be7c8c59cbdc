"""Calibrate the memory plan's activations: the bytes autograd keeps for backward, measured on one
real-width block of each real config in deployments/model_configs, on CPU in bf16.

For each config the transformer is built from its config with one block (every width as shipped),
in bf16, and run forward at a few small token counts with the pipeline's text length. A
``torch.autograd.graph.saved_tensors_hooks`` pack hook records the unique storages autograd saves
(parameters excluded: FSDP's gathered blocks are planned apart), split into:

- ``per_block``: what one block keeps without gradient checkpointing (its own intermediates, fp32
  copies included, and the input it carries from the block before);
- ``carried``: the block's carried input(s) (the hidden states, and SD3's text stream), all that
  a checkpointed block keeps until its backward recomputes it;
- ``shared``: block inputs every block reads (time embedding, text states, rotary tables): once;
- ``root``: what the model saves outside its blocks (embeddings, final norm and projection);
- ``checkpointed``: the whole one-block forward again with diffusers' gradient checkpointing on
  (a cross-check: root + shared + carried, give or take the checkpoint's own inputs);
- ``no_grad_peak``: the peak bytes alive during the forward under ``torch.no_grad`` (a
  ``TorchDispatchMode`` following every storage created): the working set of a frozen teacher's
  forward, e.g. the guidance transient.

Each is fitted as ``a * tokens + b`` (least squares; a quadratic term is fitted too and recorded:
with SDPA it is ~0, no score matrix is kept); the no-grad peak through its two largest counts. ``tokens`` is the family's own count (patches, and
for MiniMax-H3 the audio rows; text tokens are fixed at the pipeline's length and land in ``b``).
The plan (dmd2_core/memory/activations.py) reads the fits from dmd2_core/memory/activation_calibration.json,
which this script rewrites:

    python bench/activations.py            # every config, ~5 min on 2 cores
    python bench/activations.py --print    # print, do not write
    python bench/activations.py --refit    # refit the stored rows (after a change of the fit)
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from dmd2_core import parallel
from dmd2_core.memory import activations  # noqa: E402
from dmd2_core.models import FAMILIES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # name -> (transformer config, family, latent shapes measured)
    "wan2.1-t2v-1.3b": ("wan2.1-t2v-1.3b/config.json", "WanTransformer3DModel", [[16, 1, 16, 32], [16, 1, 32, 32], [16, 1, 32, 64], [16, 2, 32, 64]]),
    "wan2.1-t2v-14b": ("wan2.1-t2v-14b/config.json", "WanTransformer3DModel", [[16, 1, 16, 32], [16, 1, 32, 32], [16, 1, 32, 64], [16, 2, 32, 64]]),
    "sd3.5-medium": ("sd3.5-medium/config.json", "SD3Transformer2DModel", [[16, 16, 32], [16, 32, 32], [16, 32, 64], [16, 64, 64]]),
    "minimax-h3": ("minimax-h3/transformer/config.json", "MiniMaxH3Transformer3DModel", [[24, 2, 16, 32], [24, 2, 32, 32], [24, 7, 16, 32], [24, 7, 32, 32]]),
}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def measure(model: torch.nn.Module, block: torch.nn.Module, run, checkpointed: bool = False) -> dict:
    """Bytes of the unique storages autograd saves during ``run()`` (parameters excluded), split
    into the last block's own, its carried and shared inputs, and the rest of the model (root)."""
    params = {_ptr(p) for p in model.parameters()}
    saved: dict[int, tuple] = {}  # storage -> (bytes, where first saved, weak reference)
    where = {"now": "root"}
    carried_text: list = []
    inputs: dict[int, int] = {}
    carried: set[int] = set()
    signature = inspect.signature(block.forward)

    def pack(t):
        s = t.untyped_storage()
        p = s.data_ptr()
        # an address freed (a graph branch autograd let go) and reused is a new storage
        if p not in params and s.nbytes() and (p not in saved or saved[p][2].expired()):
            saved[p] = (s.nbytes(), where["now"], StorageWeakRef(s))
        return t

    def pre(_m, args, kwargs):
        named = signature.bind(*args, **kwargs).arguments
        for t in _tensors((args, kwargs)):
            inputs[_ptr(t)] = t.untyped_storage().nbytes()
        # what the next block reads from this one: the hidden states (and SD3's text stream,
        # which its joint blocks return beside them)
        carried.update(_ptr(t) for t in _tensors(named.get("hidden_states")))
        carried_text.append(named.get("encoder_hidden_states"))
        where["now"] = "block"

    def post(_m, _args, _kwargs, out):
        if isinstance(out, tuple) and len(list(_tensors(out))) > 1 and carried_text[-1] is not None:
            carried.update(_ptr(t) for t in _tensors(carried_text[-1]))
        where["now"] = "root"

    h1 = block.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = block.register_forward_hook(post, with_kwargs=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        # what backward will read: the saved storages still alive with the output
        kept = {p: (n, w) for p, (n, w, ref) in saved.items() if not ref.expired()}
    finally:
        h1.remove(), h2.remove()
    del out
    shared = set(inputs) - carried
    total = sum(n for n, _ in kept.values())
    if checkpointed:
        return {"checkpointed": total}
    own = sum(n for p, (n, w) in kept.items() if w == "block" and p not in shared)
    return {
        "per_block": own + sum(inputs[p] for p in carried if p in kept and kept[p][1] == "root"),
        "carried": sum(inputs[p] for p in carried),
        "shared": sum(kept[p][0] for p in shared if p in kept),
        "root": sum(n for p, (n, w) in kept.items() if w == "root" and p not in shared and p not in carried),
        "total": total,
    }


class LivePeak(TorchDispatchMode):
    """The peak of the bytes alive in storages created inside (a no-grad forward's working set)."""

    def __init__(self, existing: set[int]):
        super().__init__()
        self.existing = existing  # parameters and buffers: their views are no new bytes
        self.live: dict[int, tuple] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {p: (ref, n) for p, (ref, n) in self.live.items() if not ref.expired()}
        for t in _tensors(out):
            s = t.untyped_storage()
            if s.data_ptr() and s.data_ptr() not in self.live and s.data_ptr() not in self.existing:
                self.live[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def no_grad_peak(model: torch.nn.Module, run) -> int:
    existing = {_ptr(t) for t in (*model.parameters(), *model.buffers())}
    with torch.no_grad(), LivePeak(existing) as mode:
        out = run()
    del out
    return mode.peak


def _inputs(family_name: str, model, config: dict, latent_shape: list[int]):
    family = FAMILIES[family_name].bind(latent_shape, model)
    shape = family.sample_shape(model, latent_shape)
    x = torch.randn(1, *shape)
    sigma = torch.tensor([0.5])
    text = family.default_text_tokens
    if family_name == "WanTransformer3DModel":
        cond = {"prompt_embeds": torch.randn(1, text, config["text_dim"])}
    elif family_name == "SD3Transformer2DModel":
        cond = {"prompt_embeds": torch.randn(1, text, config["joint_attention_dim"]),
                "pooled_prompt_embeds": torch.randn(1, config["pooled_projection_dim"])}
    else:
        cond = {"prompt_embeds": torch.randn(1, text, config["text_dim"]), "prompt_lengths": torch.tensor([text])}
    tokens = family.tokens(config, tuple(latent_shape))
    return family, x, sigma, cond, tokens


def fits(rows: list[dict]) -> dict:
    return {key: activations.fit([r["tokens"] for r in rows], [r[key] for r in rows], key in activations.SECANT)
            for key in ("per_block", "carried", "shared", "root", "checkpointed", "no_grad_peak")}


def calibrate(name: str) -> dict:
    path, family_name, shapes = CONFIGS[name]
    full = json.load(open(os.path.join(ROOT, "deployments", "model_configs", path)))
    entry = {"family": family_name, "class_name": full["_class_name"], "match": activations.match_keys(full),
             "text_tokens": FAMILIES[family_name].default_text_tokens, "variants": []}
    for weight, config in activations.one_block_configs(full):
        torch.manual_seed(0)
        model = FAMILIES[family_name].model_class.from_config(config).to(torch.bfloat16)
        if FAMILIES[family_name].keep_fp32_modules:  # as parallel.shard_model keeps them
            for module in parallel.fp32_modules(model):
                module.float()
        rows = []
        for latent_shape in shapes:
            family, x, sigma, cond, tokens = _inputs(family_name, model, full, latent_shape)
            run = functools.partial(family.predict_velocity, model, x, sigma, cond)
            block = getattr(model, family.blocks_attr)[-1]
            start = time.perf_counter()
            row = {"tokens": tokens, **measure(model, block, run)}
            model.enable_gradient_checkpointing()
            row.update(measure(model, block, run, checkpointed=True))
            model.disable_gradient_checkpointing()
            row["no_grad_peak"] = no_grad_peak(model, run)
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(name, weight, row, file=sys.stderr, flush=True)
        entry["variants"].append({"weight": weight, "config": {k: v for k, v in config.items() if k in
                                                                ("num_layers", "dual_attention_layers")},
                                  "rows": rows, "fit": fits(rows)})
        del model
        gc.collect()
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the calibration, do not write it")
    parser.add_argument("--only", nargs="*", default=list(CONFIGS), help="configs to calibrate")
    parser.add_argument("--refit", action="store_true", help="refit the stored measurements, measure nothing")
    ns = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    data = activations.load() if os.path.exists(activations.PATH) else {}
    data.setdefault("configs", {})
    for name in ns.only:
        if ns.refit:
            config = json.load(open(os.path.join(ROOT, "deployments", "model_configs", CONFIGS[name][0])))
            data["configs"][name]["match"] = activations.match_keys(config)
            for variant in data["configs"][name]["variants"]:
                variant["fit"] = fits(variant["rows"])
        else:
            data["configs"][name] = calibrate(name)
    data["torch"], data["how"] = torch.__version__, "python bench/activations.py (CPU, bf16, one real-width block)"
    text = json.dumps(data, indent=1)
    if ns.print:
        print(text)
    else:
        with open(activations.PATH, "w") as f:
            f.write(text + "\n")
        print(f"wrote {activations.PATH}")


if __name__ == "__main__":
    main()

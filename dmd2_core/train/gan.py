"""The GAN head of DMD2 (Yin et al. 2024, sec. 4.3): a small discriminator on the fake score's
intermediate features, trained in the critic group on real vs the student's samples noised to the
same sigma; its generator-side gradient w.r.t. the student's x0 is computed there too and handed
to the actor with the DMD gradient, so the actor holds only the student.

Losses (non-saturating, as in the paper and its code):
- discriminator, weight ``gan_critic_weight``: ``mean softplus(-D(real_t)) + mean softplus(D(fake_t))``;
  its gradient trains the head and the fake score's blocks up to the feature block.
- generator, weight ``gan_weight``: ``mean softplus(-D(fake_t))`` with ``fake_t = (1-s) x0 + s eps``,
  differentiated w.r.t. x0 (through the noising). It is handed over in the DMD gradient's units,
  ``g_gan = gan_weight * d * dsoftplus(-D_i)/dx0_i`` (d: elements per sample), so that the actor's
  ``0.5 * mse(x0, sg(x0 - (g_dmd + g_gan)))`` has the gradient of ``dmd_loss + gan_weight * mean
  softplus(-D)``, the paper's total, whatever the batch and its split over ranks.

The head is small and replicated on every critic rank; its gradient is all-reduced like any
replicated module's (see ``Critic._disc_step``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from dmd2_core import context_parallel, rng
from dmd2_core.losses import flow_matching_loss, modality_mse
from dmd2_core.models.feature_tap import FeatureTap
from dmd2_core.models.gan_head import DiscriminatorHead


def build_head(dim: int, seed: int, hidden: int = 256) -> DiscriminatorHead:
    """The same head on every rank and in the reference loop: initialised from ``seed`` alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DiscriminatorHead(dim, hidden)


class StepHeads(torch.nn.ModuleList):
    """One GAN head per step count of a set (``dmd2_critic_step_conditioning``): like the fake
    score's step vectors, each K's head tells that K's samples from real ones, not their mixture.
    One optimizer holds them all; only the iteration's head has gradients, so only it steps."""

    def __init__(self, heads, counts):
        super().__init__(heads)
        self.counts = tuple(int(k) for k in counts)


def build_heads(dim: int, seed: int, counts=None) -> torch.nn.Module:
    """``build_head``, or for several ``counts`` one such head per K (each the same start)."""
    if counts is None or len(counts) < 2:
        return build_head(dim, seed)
    return StepHeads([build_head(dim, seed) for _ in counts], counts)


def head_for(disc: Optional[torch.nn.Module], num_steps: int) -> Optional[torch.nn.Module]:
    """The head that judges samples of ``num_steps`` steps."""
    if not isinstance(disc, StepHeads):
        return disc
    return disc[disc.counts.index(num_steps)]


def discriminator_loss(logits_real: torch.Tensor, logits_fake: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean softplus(-D(real)), mean softplus(D(fake))): the head's loss on each side."""
    return F.softplus(-logits_real.float()).mean(), F.softplus(logits_fake.float()).mean()


def generator_gradient(logits_fake: torch.Tensor, x0: torch.Tensor, weight: float,
                       retain_graph: bool = True) -> torch.Tensor:
    """``weight * d * d softplus(-D_i) / d x0_i`` per sample, ``x0`` being the leaf the fake
    logits were computed from (through the noising); ``retain_graph`` keeps the graph for a later
    backward (plain models only: a sharded model's graph takes one backward)."""
    (grad,) = torch.autograd.grad(F.softplus(-logits_fake.float()).sum(), x0, retain_graph=retain_graph)
    return weight * x0[0].numel() * grad.detach().float()


def judged_features(family, forwards: list[torch.Tensor], sigma, cond, n: int,
                    modalities: Optional[Sequence[str]] = None) -> list[tuple[list[int], torch.Tensor]]:
    """What the GAN head judges of ``n`` samples, from the feature block's output of each forward
    ``family.predict_velocity`` ran for them at (``sigma`` | ``cond``) (a ``FeatureTap``'s
    ``forwards``; MiniMax-H3 runs one per layout and u): (the forward's samples, its block output
    on the rows ``family.judged_rows`` names for its layout). The layout rule is the family's, the
    one the teacher's features pool by: an fl2va sample's keyframe rows are given, not generated,
    and left out; where every row is judged (t2va, SD3, Wan) the block output is kept as it is.
    ``modalities`` (``gan_judged_modalities``): a joint model's rows of those alone."""
    groups = family.forward_groups(sigma, cond, n)
    if len(forwards) != len(groups):
        raise RuntimeError(f"GAN head: the feature block saw {len(forwards)} forwards where the family runs "
                           f"{len(groups)} for {n} samples")
    judged = []
    for features, (rows, (text_tokens, *layout)) in zip(forwards, groups):
        keep = family.judged_rows(text_tokens, tuple(layout), modalities)
        judged.append((rows, features if keep is None else features.index_select(1, keep.to(features.device))))
    return judged


def head_logits(head: DiscriminatorHead, judged: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """One logit per sample, in the samples' order, from ``judged_features``' parts."""
    if len(judged) == 1:
        return head(judged[0][1])
    order = torch.tensor([i for rows, _ in judged for i in rows])
    logits = torch.cat([head(features) for _, features in judged])
    return logits[torch.argsort(order.to(logits.device))]


def block_logits(family, model, head: DiscriminatorHead, block: Optional[int], x_t, sigma, cond,
                 modalities: Optional[Sequence[str]] = None) -> torch.Tensor:
    """The head's logits on the feature block's output at (x_t, sigma | cond) (the forward runs to
    its end: under FSDP a forward stopped midway would leave the sharding hooks half done)."""
    with FeatureTap(family, model, block) as tap:  # to the end: a sharded forward must not stop midway
        family.predict_velocity(model, x_t, sigma, cond)
    return head_logits(head, judged_features(family, tap.forwards, sigma, cond, x_t.shape[0], modalities))


def real_inputs(args, iteration: int, step: int, num_real: int, global_shape: tuple, rows: slice):
    """Real-set rows and noise of critic step ``step`` for this rank's rows (global draws)."""
    g = rng.generator(args.seed, iteration, f"critic/{step}/real")
    index = torch.randint(num_real, (global_shape[0],), generator=g)
    return index[rows], rng.randn_rows(global_shape, rows, args.seed, iteration, f"critic/{step}/real_noise")


def critic_forward(family, critic, head: Optional[DiscriminatorHead], block: Optional[int], x0, noise, sigma, cond,
                   real: Optional[tuple] = None, critic_weight: float = 0.0, gen_weight: Optional[float] = None,
                   modality_weights: Optional[dict] = None, judged: Optional[Sequence[str]] = None) -> dict:
    """One forward of the fake score on the noised student samples, shared by its losses:
    the flow-matching loss, plus (``real`` = (x0_real, noise_real, cond_real)) the discriminator
    loss on real and fake at the same sigma, plus (``gen_weight`` not None) the generator gradient
    w.r.t. x0; the head judges the rows of the ``judged`` modalities (default all). Returns {loss (to
    backward), v, x_t, and the GAN terms}."""
    gan_grad = None
    if gen_weight is not None:
        # its own forward: a sharded (FSDP) model frees what it gathered after one backward, so
        # the loss's backward cannot run through a graph this gradient already went through
        x0_in = x0.detach().float().requires_grad_(True)
        logits = block_logits(family, critic, head, block, family.add_noise(x0_in, noise, sigma), sigma, cond, judged)
        gan_grad = generator_gradient(logits, x0_in, gen_weight, retain_graph=False)
        gan_grad = context_parallel.sum_over_context(critic, gan_grad)  # each rank's part of the sequence
    x_t = family.add_noise(x0, noise, sigma)
    with (FeatureTap(family, critic, block) if head is not None else _nothing()) as tap:
        v = family.predict_velocity(critic, x_t, sigma, cond)
    out = {"v": v, "x_t": x_t.detach(), "loss": flow_matching_loss(v, noise, x0, family.segments, modality_weights)}
    if family.segments is not None:
        out["modality_loss"] = {k: t.detach() for k, t in modality_mse(v, noise, x0, family.segments).items()}
    if head is None:
        return out
    logits_fake = head_logits(head, judged_features(family, tap.forwards, sigma, cond, x0.shape[0], judged))
    out["logits_fake"] = logits_fake.detach()
    if real is not None:
        x0_real, noise_real, cond_real = real
        logits_real = block_logits(family, critic, head, block, family.add_noise(x0_real, noise_real, sigma), sigma,
                                   cond_real, judged)
        d_real, d_fake = discriminator_loss(logits_real, logits_fake)
        out.update(loss=out["loss"] + critic_weight * (d_real + d_fake), d_loss_real=d_real.detach(),
                   d_loss_fake=d_fake.detach(), logits_real=logits_real.detach())
    if gan_grad is not None:
        out["gan_grad"] = gan_grad
    return out


class _nothing:
    features = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def gan_grad_norms(gan_grad: torch.Tensor, segments: Optional[dict[str, slice]]) -> dict[str, float]:
    """The generator gradient's mean per-sample norm, whole (``gan_grad_norm``) and per modality of
    a joint model (``gan_grad_norm_<modality>``)."""
    return {"gan_grad_norm": gan_grad.flatten(1).norm(dim=1).mean().item(),
            **{f"gan_grad_norm_{name}": gan_grad[:, seg].norm(dim=1).mean().item() for name, seg in (segments or {}).items()}}


def gan_metrics(parts: list[dict]) -> dict:
    """Discriminator loss and accuracy on real and fake over the outputs of ``critic_forward``."""
    if not parts or "logits_real" not in parts[0]:
        return {}
    real = torch.cat([p["logits_real"] for p in parts])
    fake = torch.cat([p["logits_fake"] for p in parts])
    return {"gan_d_loss_real": F.softplus(-real).mean().item(), "gan_d_loss_fake": F.softplus(fake).mean().item(),
            "gan_d_acc_real": (real > 0).float().mean().item(), "gan_d_acc_fake": (fake < 0).float().mean().item()}

"""What a trainer group does for an eval: the student's K-step samples (the actor group), the
teacher's own N-step reference samples from the same noise and the teacher's features of any
samples (the critic group, which holds the frozen teacher), and decoding them (rank 0). Every rank
of the group runs each call (a sharded forward is a collective) on its own share of the rows
(``parallel.EvalShare``: each data-parallel rank a contiguous part, padded to equal counts), and
rank 0 gathers the shares in row order and returns the result. Each row's noise is a function of
its place in the whole batch and the seed alone, so the figures do not depend on the rank count.
The features are gathered to rank 0 whole rather than reduced as sums: a kernel distance needs
every pair of rows, and they are a few hundred floats a row."""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

from dmd2_core import parallel
from dmd2_core.models import describe_model_dir, lora
from dmd2_core.train import dmd2_iteration


class EvalSampling:
    """Mixed into ``Trainer``: the eval's calls, each waking a sleeping trainer and putting it back."""

    @torch.no_grad()
    def sample(self, prompt_index: list[int], seed: int, decode: bool = True, num_steps: Optional[int] = None):
        """Full K-step student samples (EMA weights when kept) for eval; same seed, same noise;
        ``num_steps`` one of the student's step counts (default its largest). Rank 0 decodes
        (``decode``) and returns them: a tensor, or for a joint model {'video', 'audio',
        'sample_rate'}; other ranks None."""
        share = self._eval_share(len(prompt_index))
        with self._awake():
            with self._ema_weights():
                x0 = dmd2_iteration.eval_samples(self.family, self.model, self._cond(torch.tensor(share.pick(prompt_index))),
                                              (len(prompt_index), *self.shape), seed,
                                              num_steps or self.args.max_student_steps, self.shift, self.device,
                                              rows=share.positions)
            self._reshard()
            x0 = share.gather(x0)
            return self._rank0(self._decode(x0) if decode else x0)

    @torch.no_grad()
    def teacher_reference(self, prompt_index: list[int], seed: int, num_steps: int) -> Optional[torch.Tensor]:
        """The frozen teacher's own ``num_steps``-step samples (latents) from the eval noise of
        ``sample(prompt_index, seed)``, with the real score's guidance: the reference an eval
        compares the student with. Critic group only."""
        share = self._eval_share(len(prompt_index))
        cond = self._cond(torch.tensor(share.pick(prompt_index)))
        family = self.family.on_schedulers()  # the teacher's sampler, whatever the student steps on
        noise, _ = dmd2_iteration.eval_start_noise(family, (share.n, *self.shape), seed, cond)
        noise = noise.index_select(0, torch.tensor(share.positions, dtype=torch.long))
        cond = dmd2_iteration.eval_cond(family, cond, share.n, seed, share.positions)
        with self._awake():
            x = dmd2_iteration.regression_target(family, self._real_score(), noise.to(self.device),
                                              torch.ones(share.per), cond, self._uncond(share.per),
                                              self.args.dmd2_guidance_scale, num_steps, self.shift)
            self._reshard()
        return self._rank0(share.gather(x))

    @torch.no_grad()
    def teacher_features(self, x0: torch.Tensor, prompt_index: list[int], u: float, seed: int) -> Optional[dict]:
        """The frozen teacher's features of samples ``x0`` (latents) under their prompts
        (``evaluation.teacher_features``): {modality: [N, width]} on rank 0. Critic group only."""
        from dmd2_core.evaluation.teacher_features import teacher_features

        share = self._eval_share(x0.shape[0])
        rows = torch.tensor(share.positions, dtype=torch.long)
        with self._awake():
            out = teacher_features(self.family.on_schedulers(), self._real_score(), x0.index_select(0, rows).to(self.device),
                                   self._cond(torch.tensor(share.pick(prompt_index))), u=u, seed=seed,
                                   micro_batch=self.args.micro_batch_size or 8, index_offset=share.start,
                                   stop=self.world_size == 1)  # a sharded forward runs whole on every rank
            self._reshard()
        return self._rank0(share.gather(out))

    @torch.no_grad()
    def real_features(self, rows: list[int], u: float, seed: int, index_offset: int) -> Optional[dict]:
        """The frozen teacher's features of rows ``rows`` of the run's real set under their own
        conditions, re-noised from ``index_offset`` on (not the eval samples' noise: the two sets
        must be independent for their kernel distance): {modality: [R, width]} on rank 0. Critic
        group only."""
        from dmd2_core.data import open_real_set
        from dmd2_core.evaluation.teacher_features import teacher_features

        share = self._eval_share(len(rows))
        x0, cond = open_real_set(self.args.real_data).batch(torch.tensor(share.pick(rows)))  # this rank's rows alone
        with self._awake():
            out = teacher_features(self.family.on_schedulers(), self._real_score(), x0.to(self.device), cond, u=u, seed=seed,
                                   micro_batch=self.args.micro_batch_size or 8, index_offset=index_offset + share.start,
                                   stop=self.world_size == 1)
            self._reshard()
        return self._rank0(share.gather(out))

    @torch.no_grad()
    def drift_stats(self, x0: torch.Tensor) -> Optional[list[dict]]:
        """Each sample's drift statistics (``drift.per_sample_stats``) of latents ``x0``, with its
        clip's sound features where it has sound (``sound_distance.with_sound_features``), decoded on
        rank 0 a media eval's clips at a time (the memory plan's decoder term), so the decoded
        media never all exist at once nor cross to the driver; other ranks None. A
        ``drift.TimedStats``: the decoder's seconds and the statistics' apart."""
        from dmd2_core.evaluation.drift import TimedStats, per_sample_stats
        from dmd2_core.evaluation.sound_distance import with_sound_features
        from dmd2_core.memory.terms import eval_clips

        chunk = eval_clips(self.args)
        out = TimedStats()
        with self._awake():
            self._decoder()  # loaded once a run: not a decode's seconds
            for start in range(0, x0.shape[0], chunk):
                started = time.perf_counter()
                decoded = self._decode(x0[start:start + chunk])
                decoded_at = time.perf_counter()
                if decoded is not None:
                    out += with_sound_features(per_sample_stats(decoded), decoded)
                    out.clips += x0[start:start + chunk].shape[0]
                out.decode_s += decoded_at - started
                out.stats_s += time.perf_counter() - decoded_at
        return out if self.rank == 0 else None

    def decode(self, x0: torch.Tensor):
        """Latents -> media on rank 0 (the family's decoder; latents as they are without one)."""
        with self._awake():
            return self._rank0(self._decode(x0))

    def _decoder(self):
        """Rank 0's VAE on its device, loaded on first use (None: no VAE, or another rank)."""
        if self.rank != 0:
            return None
        vae_url = describe_model_dir(self.args.hf_checkpoint)["vae_url"]
        if self.vae is None and vae_url:
            self.vae = self.family.load_vae(vae_url, self.dtype)
        if self.vae is not None:
            self.vae.to(self.device)
        return self.vae

    def _decode(self, x0: torch.Tensor):
        if self.rank != 0:
            return None
        return self.family.decode(self._decoder(), x0.to(self.device))

    def _eval_share(self, n: int) -> parallel.EvalShare:
        return parallel.EvalShare(n, self.rank, self.world_size, self.args.cp_size)

    def _real_score(self):
        return self.teacher if self.teacher is not None else lora.RealScore(self.model)

    @contextlib.contextmanager
    def _awake(self):
        was_asleep = self.asleep
        self.wake_up()
        try:
            yield
        finally:
            if was_asleep:
                self.sleep()

    def _rank0(self, value):
        if self.rank != 0 or value is None:
            return None
        if isinstance(value, dict):
            return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
        return value.cpu()

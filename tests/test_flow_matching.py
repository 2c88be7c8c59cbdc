"""Flow-matching math against diffusers' schedulers."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FlowMatchLCMScheduler

from dmd2_core import flow_matching as fm


@pytest.mark.parametrize("shift, steps", [(1.0, 50), (3.0, 4), (3.0, 8), (5.0, 1), (2.5, 2)])
def test_euler_sigmas_match_diffusers(shift, steps):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    np.testing.assert_allclose(fm.euler_sigmas(steps, shift), scheduler.sigmas.numpy(), rtol=1e-5, atol=1e-6)


def test_student_sigmas_match_the_lcm_scheduler():
    scheduler = FlowMatchLCMScheduler(shift=3.0)
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25])
    np.testing.assert_allclose(fm.student_sigmas(4, 3.0), scheduler.sigmas.numpy()[:4], rtol=1e-6)
    np.testing.assert_allclose(fm.student_sigmas(4, 3.0), [1.0, 0.9, 0.75, 0.5], rtol=1e-6)


def test_noise_velocity_and_x0_are_consistent():
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(5, 1, 4, 4, generator=g), torch.randn(5, 1, 4, 4, generator=g)
    sigma = torch.rand(5, generator=g)
    x_t = fm.add_noise(x0, eps, sigma)
    v = fm.velocity_target(x0, eps)
    torch.testing.assert_close(fm.velocity_to_x0(x_t, v, sigma), x0, atol=1e-6, rtol=0)
    torch.testing.assert_close(fm.x0_to_velocity(x_t, x0, sigma), v, atol=1e-4, rtol=1e-4)
    assert torch.equal(fm.add_noise(x0, eps, 0.0), x0) and torch.equal(fm.add_noise(x0, eps, 1.0), eps)


def test_sampled_sigmas_are_shifted_and_clamped():
    s = fm.sample_sigmas(20000, 3.0, torch.Generator().manual_seed(1), 0.02, 0.98)
    assert s.min() >= 0.02 and s.max() <= 0.98
    # shift 3 moves the median from 0.5 to s(0.5) = 0.75
    assert abs(s.median().item() - 0.75) < 0.02

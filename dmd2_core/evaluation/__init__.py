"""Weight-free quality signals for any model: nothing is downloaded, the only network is the
teacher's own. The compute core; runs, metrics and summaries call it. Import the modules
(``from dmd2_core.evaluation.teacher_features import teacher_features``); the package itself
imports nothing, so that no name here hides a module of the same name.

- ``teacher_features`` (teacher_features.py): samples seen by the frozen teacher. Each sample is
  re-noised at one fixed schedule position with noise fixed per sample index, the teacher runs up
  to its middle block and stops, and the block's tokens are mean-pooled per modality
  ({'image'} for SD3, {'video'} for Wan, {'video', 'audio'} for MiniMax-H3). The teacher has
  learned what its data look like at that noise level, so its features tell real-looking samples
  from drifting ones without an Inception or CLAP network that no run can download.
- ``projected_kid`` and the pieces under it (kernel.py): how far the student's features are from
  the teacher's (or a real set's), as the unbiased kernel distance on a fixed, seeded,
  orthonormal projection to 64 coordinates, standardised with the reference set's statistics.
- ``drift`` (drift.py): what the eye and ear notice first, from decoded media alone: brightness,
  saturation, contrast and VBench's temporal flicker of pictures; loudness, peak, clipping,
  spectral centroid and silence of sound; within-prompt diversity of features; and AV-Align's
  audio-onset / motion-peak agreement for video with sound.

Why KID, on a fixed low-dimensional projection: an eval draws a few dozen samples per prompt set,
and the teacher's features are hundreds to thousands wide. The Fréchet distance needs each set's
covariance and the trace of a matrix square root of their product; estimated from n samples in d
dimensions the covariance is rank-deficient for n < d and the figure is biased upward by an amount
that grows with d / n: measured, two draws of 32 unit Gaussians in 64 dimensions are at FD ~60
(from one distribution: the true value is 0), while the true FD of a 1.3x scale change there is
5.8; over a few dozen samples the figure measures the sample count more than the model. The
unbiased MMD^2 estimator behind KID has expectation exactly the population distance for any n
(its values for one distribution scatter around 0, negative ones included), so nights with
different sample counts compare. The projection to a fixed 64 coordinates (the same matrix for a
(width, seed) in every process, so every night is measured in the same coordinates) keeps the
cubic kernel's variance down at small n and the cost independent of the model's width;
standardising by the reference set alone puts the coordinates at unit scale, which the kernel
``(x . y / d + 1)^3`` assumes, without letting the samples under test move their own yardstick
(it costs a small positive offset, see ``kernel.projected_kid``).

Pairing: ``teacher_features`` noises sample i with noise i, so the teacher's and the student's
features of sample i (same prompt, same seed) are dependent. ``kernel_distance`` on two sets of
equal size leaves those (i, i) pairs out of its cross term and stays unbiased; pass the two sets
row for row. The shared noise then cancels much of the spread (common random numbers).

The noise level: ``u`` is the shared schedule position. For MiniMax-H3 its default 0.5 puts the
audio at sigma 0.75 but the video at shift(0.5, 12) ~0.92 (video sigma 0.5 is u ~0.077), so at the
default the video features see mostly noise; choose u per family where that matters.
"""

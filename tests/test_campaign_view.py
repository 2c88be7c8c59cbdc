"""The nights view shows the campaign, and a morning a team can read: one best student for the
whole campaign (kept across nights, named alike by the summary and the nights view), the MFU a
night's pace implies, the nights plot, the drift table's band, the configuration's sources and
clips that play in place."""

from __future__ import annotations


from dmd2_core import report
from dmd2_core.report import nights_view
from tests.helpers import FAST

# ---- one best student for the campaign (through the flow's nights: tests/test_night_budget.py) ----

def test_the_summary_header_the_student_line_and_the_nights_row_name_one_best():
    """A teacher-evaluated night 2 (from 2 to 4) whose evals are all worse than night 1's best (at
    2); the start's eval (iteration 0, the teacher-like student) scores best of all but is no result."""
    view = {"name": "h3-night-2", "evaluator": "teacher", "start": 2, "iteration": 4, "final": 8,
            "best_student": "s3://r/exports/iter_0000002", "best_iteration": 2, "student": "s3://r/exports/iter_0000004",
            "evals": [{"iteration": 0, "teacher_kid": 0.01}, {"iteration": 1, "teacher_kid": 0.3},
                      {"iteration": 2, "teacher_kid": 0.2}, {"iteration": 3, "teacher_kid": 0.5},
                      {"iteration": 4, "teacher_kid": 0.4}]}
    assert report.campaign_best(view["evals"], ("teacher_kid",))["iteration"] == 2
    text = report.summary_markdown(view)
    assert "Best eval so far (the campaign's): iteration 2 (teacher_kid 0.2)." in text
    assert "the campaign's best eval, iteration 2;" in text
    row = nights_view.night_row(view, "completed, regressed", 1.0, "id-2", None, "2026-12-08")
    assert (row["student"], row["student_iteration"], row["campaign_best_iteration"]) == (view["best_student"], 2, 2)
    assert (row["best"], row["best_iteration"]) == (0.4, 4)  # the night's own, judged against the nights before
    assert "2026-12-08: iteration 2 `s3://r/exports/iter_0000002`" in nights_view.nights_markdown("minimax-h3", [row], None)


# ---- the MFU a night's pace implies ---------------------------------------------------------------

def test_a_nights_pace_implies_its_mfu_from_the_plans_flops_and_the_clusters_peak(tiny_teacher, monkeypatch):
    from types import SimpleNamespace

    import ray

    from dmd2_core.args import load_args
    from dmd2_core.memory import time_plan
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs
    from flows.dmd2 import Driver

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 8.0, "accelerator_type:H100": 1.0})
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert time_plan.cluster_peak_flops() is None  # no cluster connected: no peak, no MFU (and no error)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert time_plan.cluster_peak_flops() == 989.4e12
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert time_plan.cluster_peak_flops() is None  # CPUs: no peak, no MFU

    args = load_args("tiny", {"hf_checkpoint": tiny_teacher, "save": "/tmp/unused", **FAST, "num_devices": 2})
    trainers = {c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)}
    driver = SimpleNamespace(args=args, run=SimpleNamespace(trainer_args=trainers), logger=None)
    assert Driver.implied_mfu(driver, 0.5) is None
    monkeypatch.setattr(time_plan, "cluster_peak_flops", lambda: 2e9)  # a 2 GFLOP/s device
    flops = sum(time_plan.iteration_flops(trainers).values())
    assert flops > 0
    assert Driver.implied_mfu(driver, 0.5) == round(flops / (0.5 * 2e9 * args.num_devices), 4)

    view = {"name": "n", "start": 0, "iteration": 10, "final": 40, "seconds_per_iteration": 490.6, "mfu": 0.398,
            "evals": [{"iteration": 0, "fd": 3.0}, {"iteration": 10, "fd": 2.0}]}
    row = nights_view.night_row(view, "completed, continues", 3600.0, "id-1", None, "2026-12-07")
    assert row["mfu"] == 0.398
    text = nights_view.nights_markdown("minimax-h3", [row], None)
    assert "| iterations | s / iteration | MFU | nights left | wall |" in text and "| 0 -> 10/40 | 490.6 | 0.398 | 3 |" in text


# ---- the nights plot ------------------------------------------------------------------------------

def test_the_nights_plot_is_on_a_log_axis_with_a_tick_per_night():
    """A diverged night at 1e11 beside good ones at 0.2-0.3 (a linear axis drew them all at 0), two
    nights on one date told apart by their start time; a figure at or below 0 gets a symmetric log."""
    def night(date, at, final, best):
        return {"criterion": "fd", "evaluator": "digits", "date": date, "time": at, "final": final, "best": best}

    rows = [night("2026-12-07", "02:00", 0.3, 0.2), night("2026-12-08", "02:00", 1e11, 1e11),
            night("2026-12-08", "14:30", 0.25, 0.2)]
    fig = nights_view.nights_figure(rows)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["#1 2026-12-07", "#2 2026-12-08 02:00", "#3 2026-12-08 14:30"]
    low, high = ax.get_ylim()
    assert 0.01 < low < 0.2 and high > 1e11  # the good nights read as ~0.2, in their own decade, not as 0
    assert nights_view.nights_plot(rows).startswith(b"\x89PNG")

    floor = nights_view.nights_figure([night("2026-12-07", "02:00", -0.01, -0.02), night("2026-12-08", "02:00", 0.5, 0.1)])
    assert floor.axes[0].get_yscale() == "symlog"


# ---- the drift table ------------------------------------------------------------------------------

def test_the_drift_table_judges_the_band_it_shows_in_each_statistics_unit():
    """Each statistic's band is the run's start +- its half-width (what drift_flags judges by), in
    its unit; out of it and away from the teacher is a drift, out of it towards the teacher is not."""
    from dmd2_core.evaluation.teacher_evaluator import drift_flags

    reference = {"source": "teacher", "value": {"brightness_video": 0.5, "loudness_audio": -20.0, "centroid_audio": 1000.0},
                 "se": {"brightness_video": 0.001, "loudness_audio": 0.1, "centroid_audio": 5.0}}
    start = {"iteration": 0, "teacher_kid": 0.5, "drift_brightness_video": 0.48, "drift_loudness_audio": -20.5,
             "drift_centroid_audio": 1100.0}
    latest = {"iteration": 10, "teacher_kid": 0.4, "drift_brightness_video": 0.495, "drift_loudness_audio": -23.0,
              "drift_centroid_audio": 1120.0}
    flags = drift_flags(latest, start, reference)
    assert flags == ["drift_loudness_audio"]
    text = report.summary_markdown({"name": "n", "evaluator": "teacher", "iteration": 10, "final": 10,
                                    "evals": [start, latest], "reference": reference, "drift_flags": flags})
    assert ("| statistic (unit) | teacher ± standard error | run's start | band (start ± half-width) | student | in band |"
            in text)
    # brightness: band 0.47-0.49 (the 0.01 floor); 0.495 is out of it, towards the teacher's 0.5
    assert "| brightness_video (mean luma, 0-1) | 0.5 ± 0.001 | 0.48 | 0.47 to 0.49 | 0.495 | out, towards the teacher: no drift |" in text
    # loudness: band -21.5 to -19.5 dBFS (the 1 dB floor); -23 is out of it, away from the teacher's -20
    assert "| loudness_audio (dBFS) | -20 ± 0.1 | -20.5 | -21.5 to -19.5 | -23 | no |" in text
    # centroid: band 1100 +- 50 Hz (5% of the teacher's 1000); 1120 is in it
    assert "| centroid_audio (Hz) | 1000 ± 5 | 1100 | 1050 to 1150 | 1120 | yes |" in text


# ---- the configuration ----------------------------------------------------------------------------

def test_the_configuration_lists_every_value_the_run_used_what_was_set_first(tiny_teacher):
    from dmd2_core.args import Args, load_args
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs
    from dmd2_core.report.summary import SOURCES
    from flows.dmd2 import config_sources

    sources = config_sources("tiny", {"lr": 3e-5}, hf_checkpoint=tiny_teacher, save="/r/s", seed=None)
    assert (sources["lr"], sources["hf_checkpoint"], sources["save"]) == ("set", "set", "set")
    assert "seed" not in sources or sources["seed"] == "recipe"  # a parameter left unset is not the user's
    args = load_args("tiny", {"lr": 3e-5, "hf_checkpoint": tiny_teacher, "save": "/r/s"})
    trainers = {c.role: compute_trainer_args(args, c).model_dump(mode="json") for c in compute_trainer_configs(args)}
    text = report.summary_markdown({"name": "n", "iteration": 0, "final": 2, "evals": [], "trainer_args": trainers,
                                    "config_sources": sources})
    table = text.split("## Configuration")[1]
    lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| key")]
    keys = [line.split(" | ")[0].removeprefix("| ") for line in lines]
    froms = [line.rstrip(" |").rsplit("| ", 1)[1] for line in lines]
    assert set(keys) == set(Args.model_fields)  # every value, once
    assert froms == sorted(froms, key=SOURCES.index)  # set, recipe, per role, derived, default
    assert froms[:3] == ["set"] * 3 and set(keys[:3]) == {"lr", "hf_checkpoint", "save"}
    assert dict(zip(keys, froms))["loss_type"] == "per role"  # the actor's and the critic's own
    recipe_keys = [k for k, f in zip(keys, froms) if f == "recipe"]
    assert "num_iterations" in recipe_keys and froms[-1] == "default"


# ---- clips that play in place ---------------------------------------------------------------------

def test_the_minimax_h3_standins_clips_play_in_place_at_its_four_eval_prompts(tmp_path):
    """A local save's summary carries each of the four eval prompts' clips as a playable data:
    video (both streams) within its share of INLINE_VIDEO_BYTES; the full clips stay on disk."""
    import base64
    import io
    import re

    import torch

    from dmd2_core.args import load_args
    from dmd2_core.media import av_clips
    from dmd2_core.media.eval_files import INLINE_VIDEO_BYTES, av_media_of
    from dmd2_core.models import FAMILIES, describe_model_dir
    from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin
    from flows.artifacts import summary_text

    url = build_h3_standin(str(tmp_path / "h3"))
    args = load_args("minimax-h3", {"hf_checkpoint": url, "prompts": "s3://d/p.safetensors", "save": str(tmp_path / "run")})
    info = describe_model_dir(url)
    family = FAMILIES[info["family"]].bind([24, 37, 2, 2])  # the stand-in's clip: H3_GEOMETRY's latents
    torch.manual_seed(0)
    decoded = family.decode(family.load_vae(info["vae_url"], torch.float32),
                            torch.randn(len(args.eval_prompts), family.segments["audio"].stop))
    assert tuple(decoded["video"].shape[2:]) == tuple(H3_GEOMETRY.values())
    share = INLINE_VIDEO_BYTES // len(args.eval_prompts)  # write_eval_media's share of one prompt's clip
    media = [av_media_of(decoded, j, str(tmp_path / f"iter_0000002_p{p}"), f"prompt {p}", 512 * 1024, share)[0]
             for j, p in enumerate(args.eval_prompts)]
    for j, m in enumerate(media):
        assert (tmp_path / f"iter_0000002_p{args.eval_prompts[j]}.mp4").stat().st_size > share  # the full clip, on disk
    text = summary_text({"name": "n", "iteration": 2, "final": 2, "evals": [], "media": media, "media_iteration": 2})
    played = re.findall(r'<video controls preload="metadata" src="data:video/mp4;base64,([A-Za-z0-9+/=]+)"></video>', text)
    assert len(played) == len(args.eval_prompts) == 4
    for data in played:
        clip = base64.b64decode(data)
        assert len(clip) <= share
        back = av_clips.read_mp4(io.BytesIO(clip))
        assert len(back["frames"]) >= 124 // 3 and back["audio"].shape[0] == 2 and back["audio"].shape[1] > 0

"""What a person reads about a run, without Ray or a server: the strict-JSON metrics log and its
constant-cost segments, the short table, the plot, the embedding rules, the summary, the windows
and names of the flow, and the deployments' schedules."""

from __future__ import annotations

import datetime
import io
import json

import pytest
import torch
from PIL import Image

from dmd2_core import report, storage
from dmd2_core import evaluators as registry
from dmd2_core.media import images
from dmd2_core.media.images import image_grid, png_bytes


def test_metrics_log_is_strict_json_with_constant_cost_segments(tmp_path, monkeypatch):
    save = str(tmp_path / "run")
    log = report.MetricsLog(save, resume_after=0, segment=100)
    written: list[tuple[str, int]] = []
    original = storage.write_text
    monkeypatch.setattr(storage, "write_text", lambda url, text: written.append((url, len(text))) or original(url, text))
    for i in range(0, 251):
        log.update(i, {"dmd2_loss": float("nan") if i == 7 else 1.0 / (1 + i), "critic_loss": float("inf") if i == 8 else 2.0,
                       "per_phase": {"rollout_s": 0.1}})
        log.write()
    # each write rewrites only the open segment: the bytes written at iteration 250 are those of
    # <= 100 lines, as at iteration 10
    assert all(url.endswith("iter_0000000.jsonl") for url, _ in written[:100])
    assert written[-1][0].endswith("metrics/iter_0000200.jsonl")
    assert written[-1][1] <= written[99][1]
    assert max(n for _, n in written) <= 1.05 * written[99][1]  # (longer iteration numbers later)
    log.finish()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}")) for line in lines]
    assert [r["iteration"] for r in rows] == list(range(251))
    assert rows[7]["dmd2_loss"] is None and rows[7]["nonfinite"] == ["dmd2_loss"]
    assert rows[8]["critic_loss"] is None and rows[8]["nonfinite"] == ["critic_loss"]
    assert "nonfinite" not in rows[9] and rows[9]["dmd2_loss"] == pytest.approx(0.1)
    assert sorted(p.name for p in (tmp_path / "run" / "metrics").iterdir()) == [
        "iter_0000000.jsonl", "iter_0000100.jsonl", "iter_0000200.jsonl"]

    # resume after 120: the later lines and segments go (they are replayed), the earlier stay
    resumed = report.MetricsLog(save, resume_after=120, segment=100)
    assert max(resumed.rows) == 120 and len(resumed.rows) == 121
    assert sorted(p.name for p in (tmp_path / "run" / "metrics").iterdir()) == ["iter_0000000.jsonl", "iter_0000100.jsonl"]
    resumed.write()
    assert [r["iteration"] for r in report.read_metrics(save)] == list(range(121))
    # a fresh start (resume_after 0) forgets an old run's segments
    report.MetricsLog(save, resume_after=0, segment=100)
    assert not list((tmp_path / "run" / "metrics").iterdir())


def test_metrics_table_few_columns_four_digits_newest_first():
    rows = [{"iteration": i, "dmd2_loss": 1 / 3 * (i + 1), "critic_loss": 123456.789, "critic_sigma_mean": 0.5,
             "iteration_s": 1.23456} for i in range(5)]
    rows[2]["fd"] = 0.987654
    rows[3]["dmd2_loss"] = float("nan")
    columns = report.table_columns(registry.get("digits"))
    table = report.metrics_table(rows, columns)
    assert [r["iteration"] for r in table] == [4, 3, 2, 1, 0]
    assert list(table[0]) == ["iteration", "dmd2_loss", "critic_loss", "fd", "iteration_s"]  # only columns with data
    assert table[0]["dmd2_loss"] == 1.667 and table[0]["critic_loss"] == 123500.0 and table[0]["iteration_s"] == 1.235
    assert table[2]["fd"] == 0.9877 and table[0]["fd"] is None and table[1]["dmd2_loss"] is None
    assert len(report.metrics_table(rows, columns, max_rows=2)) == 2


def test_plot_png_has_a_panel_per_kind_of_data():
    assert report.plot_png([{"iteration": 1, "stop_step": 2.0}]) is None
    losses = [{"iteration": i, "dmd2_loss": 0.1 * i, "critic_loss": 1.0} for i in range(1, 20)]
    full = [dict(r, dmd2_grad_norm=1.0, fd=2.0 - 0.01 * r["iteration"]) for r in losses]
    full[5]["dmd2_loss"] = float("nan")  # skipped, not drawn
    panels = report.plot_panels(registry.get("digits"))
    two, four = (Image.open(io.BytesIO(report.plot_png(rows, panels=panels))) for rows in (losses, full))
    assert two.format == four.format == "PNG"  # each loss at its own scale: dmd2_loss (~1e-8) is no flat line
    assert four.size[0] == 3 * two.size[0] // 2 and four.size[1] == 2 * two.size[1]  # 4 panels: 3 columns, 2 rows


def test_embedding_rules():
    grid = png_bytes(image_grid(torch.rand(12, 3, 64, 64) * 2 - 1, nrow=4))
    local = images.embed("/runs/x/media/iter_0000001.png", grid, browser_url=None)
    assert local["full"] and local["link"] is None and local["src"].endswith(
        __import__("base64").b64encode(grid).decode()[-40:])
    large = images.embed("/runs/x/media/iter_0000001.png", grid, browser_url=None, embed_limit=len(grid) - 1)
    s3 = images.embed("s3://b/x.png", grid, browser_url="https://s3.example/x.png?X-Amz-Signature=1")
    for shown in (large, s3):
        assert not shown["full"] and shown["src"].startswith("data:image/png;base64,")
        thumb = Image.open(io.BytesIO(__import__("base64").b64decode(shown["src"].split(",", 1)[1])))
        assert max(thumb.size) <= images.THUMBNAIL_PX
    assert s3["link"].startswith("https://") and large["link"] is None
    gif = io.BytesIO()
    frames = [Image.new("RGB", (600, 300), (i * 40, 0, 0)) for i in range(3)]
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    thumb = Image.open(io.BytesIO(images.thumbnail(gif.getvalue())))
    assert thumb.format == "PNG" and thumb.size == (256, 128)


def test_summary_markdown_reads_top_down():
    from dmd2_core.args import load_args
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

    args = load_args("minimax-h3", {"hf_checkpoint": "s3://m/h3", "prompts": "s3://d/p.safetensors", "save": "s3://r/h3",
                                    "dmd2_regression_weight": 0.25})
    trainer_args = {c.role: compute_trainer_args(args, c).model_dump(mode="json") for c in compute_trainer_configs(args)}
    evals = [{"iteration": 0, "fd": 1.0, "acc": 0.9}, {"iteration": 100, "fd": 0.3, "acc": 0.99},
             {"iteration": 200, "fd": 0.4, "acc": 0.98}]
    text = report.summary_markdown({
        "name": "minimax-h3-2026-12-02", "iteration": 200, "final": 4000, "status": "running",
        "updated": "2026-12-02 03:04:05 UTC",
        "trainer_args": trainer_args, "evals": evals,
        "media": [{"src": "data:image/png;base64,AAAA", "link": "https://x/y.png", "url": "s3://r/h3/media/iter_0000200.png",
                   "full": False, "caption": "iteration 200"}], "media_iteration": 200,
        "plot": b"\x89PNG....", "checkpoint": {"iteration": 200, "trainers": {"actor": "s3://r/h3/trainers/actor/iter_0000200"},
                                               "latest": "s3://r/h3/latest_checkpointed_iteration.txt"},
        "student": "s3://r/h3/trainers/actor/iter_0000200/model", "metrics_url": "s3://r/h3/metrics.jsonl"})
    order = [text.index(h) for h in ("# minimax-h3-2026-12-02", "Quality before -> after", "## Samples", "## Losses",
                                     "## Evals", "## Checkpoint", "## Configuration")]
    assert order == sorted(order)
    assert "Quality before -> after: fd 1, acc 0.9 -> fd 0.4, acc 0.98" in text
    assert "Best eval so far (the campaign's): iteration 100 (fd 0.3, acc 0.99)" in text
    assert "iteration 200 of 4000. Updated 2026-12-02 03:04:05 UTC." in text
    # the default UI shows an image inside a link as text: the image alone, the link on its own line
    assert "![iteration 200](data:image/png;base64,AAAA)\n" in text and "](data:image/png;base64,AAAA)](" not in text
    assert "\n[full size](https://x/y.png) (link expires)\n" in text
    assert text.index("| 200 | 0.4") < text.index("| 100 | 0.3")  # newest first
    assert "| loss_type | `dmd2_critic` | `dmd2` |" in text  # the differing keys, side by side
    assert "| dmd2_guidance_scale | 1 | 1 |" in text and "| num_devices | 8 | 8 |" in text and "| ema_decay |" in text
    # every value the run used: a loss term it turned on, and a key left at its default (listed last)
    assert "| dmd2_regression_weight | 0.25 | 0.25 |" in text and "| export_merged | False | False | default |" in text
    assert "`s3://r/h3/trainers/actor/iter_0000200/model`" in text


def test_windows_and_names():
    from flows.dmd2 import run_display_name, windows
    from flows.artifacts import artifact_keys

    assert windows(0, 250, 100) == [(1, 100), (101, 200), (201, 250)]
    assert windows(137, 300, 100) == [(138, 200), (201, 300)]
    assert windows(5, 5, 100) == []
    assert len(windows(0, 4000, 100)) == 40
    day = datetime.date(2026, 12, 2)
    assert run_display_name({"recipe": "tiny"}, day) == "dmd2-tiny-2026-12-02"
    # a flow run's name carries its id: two runs of a recipe on one day differ, and so do their keys
    a = run_display_name({"recipe": "tiny"}, day, run_id="1a2b3c4d-5e6f-0000-0000-000000000000")
    b = run_display_name({"recipe": "tiny"}, day, run_id="99aa0000-5e6f-0000-0000-000000000000")
    assert a == "dmd2-tiny-2026-12-02-1a2b3c4d" and b == "dmd2-tiny-2026-12-02-99aa0000"
    assert set(artifact_keys(a).values()).isdisjoint(artifact_keys(b).values())
    assert artifact_keys(a)["summary"] == "dmd2-tiny-2026-12-02-1a2b3c4d-summary"
    assert run_display_name({"recipe": "tiny", "overrides": {"run_name": "Ablation A"}}, day) == "ablation-a-2026-12-02"
    assert run_display_name({"recipe": "tiny", "overrides": {"lrr": 1}}, day) == "tiny-2026-12-02"
    assert artifact_keys("dmd2-tiny")["summary"] == "dmd2-tiny-summary"
    assert artifact_keys("minimax-h3")["metrics"] == "dmd2-minimax-h3-metrics"
    assert set(artifact_keys("h3-a").values()).isdisjoint(artifact_keys("h3-b").values())


def test_deployment_missing_inputs_is_paused_with_one_line(monkeypatch):
    from deployments.serve import build_deployments

    for key in ("HF_CHECKPOINT", "PROMPTS", "SAVE"):
        monkeypatch.delenv(f"DMD2_MINIMAX_H3_{key}", raising=False)
    lines: list[str] = []
    (h3,) = build_deployments(["minimax-h3"], warn=lines.append)
    assert lines == ["warning: deployment 'minimax-h3': schedule paused, missing hf_checkpoint, prompts, save "
                     "(set DMD2_MINIMAX_H3_HF_CHECKPOINT, DMD2_MINIMAX_H3_PROMPTS, DMD2_MINIMAX_H3_SAVE and restart serve)"]
    (schedule,) = h3.schedules
    assert schedule.active is False and schedule.schedule.timezone == "UTC" and schedule.schedule.cron == "0 2 * * *"
    assert "Schedule paused" in h3.description and "DMD2_MINIMAX_H3_SAVE" in h3.description
    schema = h3._parameter_openapi_schema
    assert {"recipe", "hf_checkpoint", "prompts", "save"} <= set(schema.required)
    assert all(p.get("description") for p in schema.properties.values())

    monkeypatch.setenv("DMD2_MINIMAX_H3_HF_CHECKPOINT", "s3://m/h3")
    monkeypatch.setenv("DMD2_MINIMAX_H3_PROMPTS", "s3://d/p.safetensors")
    monkeypatch.setenv("DMD2_MINIMAX_H3_SAVE", "s3://r/h3")
    lines.clear()
    (h3,) = build_deployments(["minimax-h3"], warn=lines.append)
    assert lines == [] and h3.schedules[0].active is True and "paused" not in h3.description
    assert h3.parameters["save"] == "s3://r/h3"


def test_plot_has_fd_and_gan_panels_and_a_bounded_cost():
    """FD has an axis of its own (not the 0-1 one of acc and diversity), the GAN head's metrics get
    a panel when present, and a plot of 5000 rows sees at most PLOT_POINTS (+ eval rows)."""
    from PIL import Image

    rows = [{"iteration": i, "dmd2_loss": 1.0 / (i + 1), "gan_d_loss_real": 0.7, "gan_grad_norm": 0.1}
            for i in range(5000)]
    for i in range(0, 5000, 1000):
        rows[i].update(fd=30.0 - i / 1000, acc=0.9, diversity=0.5)
    digits = registry.get("digits")
    kept = report.thin(rows, report.PLOT_POINTS, digits.quality_keys)
    assert len(kept) <= report.PLOT_POINTS + 5 + 1 and kept[-1]["iteration"] == 4999
    assert [r["iteration"] for r in kept if "fd" in r] == [0, 1000, 2000, 3000, 4000]
    names = [p.title for p in report.plot_panels(digits) if any(k in rows[0] for k in p.keys)]
    assert names == ["DMD2 loss", "FD", "accuracy, diversity", "GAN head"]
    img = Image.open(io.BytesIO(report.plot_png(kept, panels=report.plot_panels(digits))))
    assert img.size == (3 * 320, 2 * 240)  # 4 panels: 3 columns, 2 rows
    assert report.plot_png([{"iteration": 1, "dmd2_loss": 1.0}]) is not None


def test_nights_markdown_and_rows_roundtrip():
    from dmd2_core.report import nights_view
    from flows import nights

    view = {"name": "dmd2-tiny-2026-12-02-1a2b3c4d", "iteration": 250, "final": 250, "student": "/r/exports/iter_0000250",
            "evals": [{"iteration": 0, "fd": 9.0}, {"iteration": 100, "fd": 2.0, "acc": 0.8},
                      {"iteration": 250, "fd": 3.0, "acc": 0.9, "diversity": 0.4}]}
    one = nights_view.night_row(view, "completed", 61.23, "id-1", "http://ui/runs/flow-run/id-1", "2026-12-02")
    assert (one["criterion"], one["final"], one["best"], one["best_iteration"], one["acc"]) == ("fd", 3.0, 2.0, 100, 0.9)
    two = dict(one, run_id="id-2", date="2026-12-03", final=5.0, outcome="failed", name="dmd2-tiny-2026-12-03-99aa0000")
    rows = nights.merge(nights.merge([], one), two)
    rows = nights.merge(rows, dict(two, outcome="completed (1 rerun)"))  # a rerun replaces its run's row
    assert [r["outcome"] for r in rows] == ["completed", "completed (1 rerun)"]
    text = nights.with_rows(nights_view.nights_markdown("tiny", rows, nights_view.nights_plot(rows)), rows)
    assert nights.rows_of(text) == rows
    assert "![FD over nights](data:image/png;base64," in text
    assert text.index("2026-12-03") < text.index("| 2026-12-02")  # newest first
    assert "| 2026-12-02 | [dmd2-tiny-2026-12-02-1a2b3c4d](http://ui/runs/flow-run/id-1) | completed | 3 | 2 | 0.9 |" in text
    assert "`/r/exports/iter_0000250`" in text
    assert nights.nights_key("minimax-h3") == "dmd2-nights-minimax-h3"
    # a night that failed before it started (preflight, too many crash reruns): a row all the same
    early = nights_view.night_row({"name": "n", "iteration": None, "final": 2, "evals": []}, "failed", 0.0, "id-3", None, "d")
    assert "| d | `n` | failed |  |  | -/2 | 0.0 s |" in nights_view.nights_markdown("tiny", [early], None)


def test_a_teacher_evaluated_night_has_numbers_per_modality_its_drift_and_its_best_student():
    from dmd2_core.report import nights_view

    view = {"name": "minimax-h3-night", "iteration": 200, "final": 200, "student": "s3://r/exports/iter_0000200",
            "best_student": "s3://r/exports/iter_0000100", "drift_flags": ["drift_saturation_video"],
            "evals": [{"iteration": 0, "teacher_kid": 0.9, "teacher_kid_video": 1.2, "teacher_kid_audio": 0.6},
                      {"iteration": 100, "teacher_kid": 0.2, "teacher_kid_video": 0.3, "teacher_kid_audio": 0.1},
                      {"iteration": 200, "teacher_kid": 0.4, "teacher_kid_video": 0.5, "teacher_kid_audio": 0.3,
                       "drift_out": 1.0}]}
    row = nights_view.night_row(view, "completed", 10.0, "id-1", None, "2026-12-05")
    assert (row["criterion"], row["final"], row["best"], row["best_tkd"], row["best_iteration"]) == ("teacher_kid", 0.4, 0.2, 0.2, 100)
    assert row["student"] == "s3://r/exports/iter_0000100" and row["drift_out"] == ["drift_saturation_video"]
    text = nights_view.nights_markdown("minimax-h3", [row], nights_view.nights_plot([row]))
    assert ("| date | run | outcome | final teacher KID | best teacher KID | teacher_kid_video | teacher_kid_audio | "
            "drift out of band | iterations | wall |") in text
    assert "| 0.4 | 0.2 | 0.5 | 0.3 | drift_saturation_video | 200/200 |" in text
    assert "![teacher KID over nights](data:image/png;base64," in text

def test_the_summary_shows_what_a_joint_run_used_and_no_dead_link_to_a_local_clip(tmp_path):
    """MiniMax-H3 steps each modality at its scheduler's shift, which the configuration shows (not
    the shared schedule's dmd2_shift 1), the student's where ``student_modality_shifts`` moves one
    (the recipe's: video 8, sound 1); a clip on local storage is named, not linked (the UI would open a
    page of its own)."""
    from dmd2_core.args import load_args
    from dmd2_core.toys.standins import build_h3_standin
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs
    from flows.driver import shown_args

    url = build_h3_standin(str(tmp_path / "h3"))
    args = load_args("minimax-h3", {"hf_checkpoint": url, "prompts": "s3://d/p.safetensors", "save": "s3://r/h3"})
    shown = shown_args({c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)})
    assert {a["dmd2_shift"] for a in shown.values()} == {"video 8, audio 1 (the schedulers': video 12, audio 3)"}
    on_theirs = args.model_copy(update={"student_modality_shifts": None})
    assert {a["dmd2_shift"] for a in shown_args({c.role: compute_trainer_args(on_theirs, c)
                                                  for c in compute_trainer_configs(on_theirs)}).values()} == \
        {"video 12, audio 3"}
    media = [{"src": "data:image/png;base64,AAAA", "url": "/r/h3/media/iter_0000002_p0_frames.png", "full": True,
              "caption": "p0: frames", "video_url": "/r/h3/media/iter_0000002_p0.mp4", "play": "/r/h3/media/iter_0000002_p0.mp4"}]
    text = report.summary_markdown({"name": "n", "iteration": 2, "final": 2, "trainer_args": shown, "evals": [],
                                    "media": media, "media_iteration": 2})
    assert "| dmd2_shift | `video 8, audio 1 (the schedulers': video 12, audio 3)` |" in text
    assert "](/r/h3/media/iter_0000002_p0.mp4)" not in text and "MP4 with sound: `/r/h3/media/iter_0000002_p0.mp4`" in text

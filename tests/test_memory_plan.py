"""The memory plan to the GiB: calibrated activations, context parallelism, per-process reserves,
the guidance transient, rollout buffers, the eval decoder, host memory per node and the headroom;
and the plan's refusals (one line naming the knobs). Real-size configs on the meta device only."""

from __future__ import annotations

import os
import sys

import pytest

from dmd2_core.memory import activations
from dmd2_core.run import preflight_checks
from dmd2_core.memory import planner
from dmd2_core.memory import terms
from dmd2_core.args import load_args
from dmd2_core.errors import ArgsError
from dmd2_core.models import describe_model_dir
from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "deployments", "model_configs")
WAN14 = os.path.join(CONFIGS, "wan2.1-t2v-14b")
H3 = os.path.join(CONFIGS, "minimax-h3")
P720 = [16, 21, 90, 160]  # 81 frames of 720 x 1280
GIB = planner.GIB


def _plan(recipe: str = "wan-video", **overrides) -> planner.MemoryPlan:
    overrides.setdefault("hf_checkpoint", WAN14)
    if recipe == "wan-video":
        overrides.setdefault("latent_shape", P720)
    args = load_args(recipe, overrides)
    args = preflight_checks.check_family_args(args, describe_model_dir(args.hf_checkpoint))
    return planner.plan({c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)})


def _groups(plan):
    return {g.role: g for g in plan.groups}


def test_wan_14b_720p_on_8_devices_of_80_gib_needs_cp_and_the_critic_offloaded_within_the_headroom():
    """At cp 1 one clip's activations alone overflow the device: refused naming cp_size. At cp 8 the
    colocated groups' state (both resident while the critic trains) leaves the plan at ~74 GiB,
    inside the 10% headroom of 80 (refused; it fits at 5%). With the critic's shards in host memory
    it fits from cp 4 on."""
    base = dict(device_memory_gib=80, micro_batch_size=1, global_batch_size=16)
    refused = _plan(**base)
    with pytest.raises(ArgsError, match=r"^memory plan: .* less the 10% headroom \(memory_headroom\)\); try .*"
                                        r"a larger cp_size \(now 1;") as exc:
        planner.check_fits(refused)
    assert "\n" not in str(exc.value) and "memory_headroom (at" not in str(exc.value)  # beyond the device itself
    inside = _plan(cp_size=8, **base)
    assert 0.9 * 80 * GIB < inside.device_peak <= 0.95 * 80 * GIB and inside.usable == int(80 * GIB * 0.9)
    with pytest.raises(ArgsError, match=r"critic_fsdp_cpu_offload.*a smaller memory_headroom"):
        planner.check_fits(inside)
    fitting = [cp for cp in (1, 2, 4, 8) if _plan(cp_size=cp, critic_fsdp_cpu_offload=True, **base).fits]
    assert fitting == [4, 8]
    planner.check_fits(_plan(cp_size=4, critic_fsdp_cpu_offload=True, **base))
    assert "calibrated (wan2.1-t2v-14b)" in planner.table(inside)


def test_cp_splits_activations_and_adds_all_to_all_buffers_while_state_stays_sharded_over_the_group():
    one, four = _groups(_plan(micro_batch_size=1)), _groups(_plan(micro_batch_size=1, cp_size=4))
    for role in ("actor", "critic"):
        assert one[role].params == four[role].params and one[role].optimizer == four[role].optimizer
        assert one[role].cp_buffers == 0 < four[role].cp_buffers
        assert 3.5 < one[role].activations / four[role].activations <= 4.0
    # the critic's own cp_size (critic_cp_size) plans the critic alone
    mixed = _groups(_plan(micro_batch_size=1, cp_size=4, critic_cp_size=8))
    assert mixed["actor"].activations == four["actor"].activations
    assert mixed["critic"].activations < four["critic"].activations and mixed["critic"].cp_size == 8


def test_headroom_refuses_a_plan_inside_it_and_names_memory_headroom():
    plan = _plan(device_memory_gib=80, micro_batch_size=1, cp_size=8)
    gib = plan.device_peak / GIB / 0.94  # fits with no headroom, not within 10%
    planner.check_fits(_plan(device_memory_gib=gib, micro_batch_size=1, cp_size=8, memory_headroom=0.0))
    with pytest.raises(ArgsError, match=r"less the 10% headroom \(memory_headroom\).*a smaller memory_headroom"):
        planner.check_fits(_plan(device_memory_gib=gib, micro_batch_size=1, cp_size=8))


def test_every_process_on_a_device_has_its_own_reserve():
    colocated = _plan(cp_size=2)
    per_process = terms.process_reserve(load_args("wan-video", {"cp_size": 2}), colocated.shard_size)
    assert colocated.reserve == 2 * per_process  # actor and critic: two processes, two contexts
    assert _plan(cp_size=2, colocate=False).reserve == per_process
    assert _plan(cp_size=1).reserve < colocated.reserve  # one NCCL communicator fewer without cp
    assert _plan(device="cpu", sleep_after_train=False).reserve == 0


def test_the_guidance_transient_is_cond_plus_uncond_for_a_guided_teacher_only():
    guided, single = _groups(_plan(micro_batch_size=1)), _groups(_plan(micro_batch_size=1, dmd2_guidance_scale=1.0))
    assert guided["actor"].guidance == 0 and guided["critic"].guidance == 2 * single["critic"].guidance > 0
    h3 = _groups(_plan("minimax-h3", hf_checkpoint=H3, num_devices=16, global_batch_size=16))
    assert h3["critic"].guidance > 0  # guidance-distilled: one forward, micro rows
    assert h3["critic"].guidance < guided["critic"].guidance


def test_rollout_buffers_and_the_eval_decoder_are_planned_and_a_large_eval_is_refused_naming_its_knobs():
    plan = _plan(micro_batch_size=1, cp_size=8, device_memory_gib=80)
    assert all(g.rollout > 0 for g in plan.groups) and plan.eval_decoder > 0
    assert _plan(micro_batch_size=1, cp_size=8, eval_interval=0).eval_decoder == 0
    big = _plan(micro_batch_size=1, cp_size=8, device_memory_gib=80, eval_prompts=list(range(16)),
                eval_samples_per_prompt=8)
    assert big.peak_during.startswith("the eval")
    with pytest.raises(ArgsError, match=r"^memory plan: the eval .* try fewer eval clips \(eval_prompts, "
                                        r"eval_samples_per_prompt\), eval_interval=0"):
        planner.check_fits(big)


def test_host_memory_per_node_is_planned_and_refused_naming_the_part_and_the_knob():
    plan = _plan(micro_batch_size=1, cp_size=8, device_memory_gib=141)
    host, groups = plan.host, plan.groups
    assert host.ranks_per_node == 8 and host.limit == 2048 * GIB and host.fits  # the recipe's node
    assert host.parts["sleep_stash"] == sum(g.resident for g in groups)
    assert host.parts["async_save_staging"] == sum(g.saved for g in groups)  # the recipe saves in the background
    assert _plan(micro_batch_size=1, cp_size=8, async_save=False).host.parts["async_save_staging"] == 0
    need = host.peak / GIB
    planner.check_fits(_plan(micro_batch_size=1, cp_size=8, device_memory_gib=141, host_memory_gib=need / 0.85))
    with pytest.raises(ArgsError, match=r"^memory plan: host memory while training needs .* per node \(8 ranks; "
                                        r"per rank sleep stash .*host_memory_gib less the 10% headroom.*"
                                        r"sleep_after_train=false"):
        planner.check_fits(_plan(micro_batch_size=1, cp_size=8, device_memory_gib=141, host_memory_gib=need / 1.2))


def test_offloaded_shards_move_from_the_device_plan_to_the_host_plan():
    kept, off = _plan(micro_batch_size=1, cp_size=8), _plan(micro_batch_size=1, cp_size=8, fsdp_cpu_offload=True)
    assert off.device_peak < kept.device_peak
    assert off.host.parts["offloaded"] == sum(g.offloaded for g in off.groups) > 0


def test_the_calibration_file_holds_its_own_fits_for_every_real_config():
    data = activations.load()
    assert set(data["configs"]) >= {"wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "sd3.5-medium", "minimax-h3"}
    for name, entry in data["configs"].items():
        for variant in entry["variants"]:
            rows = sorted(variant["rows"], key=lambda r: r["tokens"])
            # a storage can land in the block or the root from one run to the next: their sum is the figure
            figures = {"carried": lambda r: r["carried"], "checkpointed": lambda r: r["checkpointed"],
                       "per_block + root": lambda r: r["per_block"] + r["root"]}
            for key, of in figures.items():
                for row in rows:
                    fitted = sum(activations._at(variant["fit"], k, row["tokens"]) for k in key.split(" + "))
                    assert abs(fitted - of(row)) <= 0.05 * of(row) + 2 ** 20, (name, key, row["tokens"])
            for row in rows[-2:]:  # the no-grad peak's secant
                assert abs(activations._at(variant["fit"], "no_grad_peak", row["tokens"]) - row["no_grad_peak"]) < 1024
            # with checkpointing a one-block model keeps root + shared + carried: the split adds up (within
            # 15%: one hidden-states-sized storage can land in the block or the root)
            for row in rows:
                assert abs(row["checkpointed"] - row["root"] - row["shared"] - row["carried"]) <= 0.15 * row["checkpointed"]
            per_block = variant["fit"]["per_block"]
            assert per_block["per_token"] > 0, name
            # SDPA keeps no score matrix: linear in tokens. A kept bf16 score matrix would add 2 bytes x
            # heads per token^2 (24-56 heads: 5-11% of the slope at 1k tokens); 2% is noise in where a
            # storage lands (block or root)
            assert abs(per_block["quadratic"]) * 1024 < 0.02 * per_block["per_token"], name


def test_a_tiny_block_measures_its_carried_input_exactly():
    """The calibration's measurement on a tiny Wan block: the carried input is the hidden states
    (tokens x width in bf16) and its own saved bytes grow linearly with the tokens."""
    import torch

    sys.path.insert(0, ROOT)
    from bench.activations import measure, no_grad_peak
    from dmd2_core.models import FAMILIES

    config = {"num_attention_heads": 2, "attention_head_dim": 8, "ffn_dim": 32, "num_layers": 1, "text_dim": 16,
              "freq_dim": 16, "in_channels": 4, "out_channels": 4, "patch_size": [1, 2, 2], "cross_attn_norm": True,
              "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 64}
    family = FAMILIES["WanTransformer3DModel"]
    model = family.model_class.from_config(config).to(torch.bfloat16)
    rows = []
    for frames in (1, 2, 4):
        x, cond = torch.randn(1, 4, frames, 16, 16), {"prompt_embeds": torch.randn(1, 8, 16)}
        run = lambda: family.predict_velocity(model, x, torch.tensor([0.5]), cond)  # noqa: E731
        rows.append({**measure(model, model.blocks[-1], run), "no_grad_peak": no_grad_peak(model, run)})
        assert rows[-1]["carried"] == frames * 64 * 16 * 2
    steps = [b["per_block"] - a["per_block"] for a, b in zip(rows, rows[1:])]
    assert steps[0] > 0 and abs(steps[1] - 2 * steps[0]) <= 0.1 * steps[1]
    assert 0 < rows[-1]["no_grad_peak"]


# ---- LoRA (dmd2_core/memory/lora_terms.py) ------------------------------------------------------------

# 124 frames of 768 x 1344, 8 devices, fully fine-tuned at cp 1 (not the recipe's LoRA at cp 2)
H3_5S = dict(hf_checkpoint=H3, num_frames=124, device_memory_gib=80, lora_rank=0, cp_size=1)


@pytest.fixture(scope="module")
def standins(tmp_path_factory, tiny_teacher):
    from dmd2_core.toys.standins import build_h3_standin, build_standin

    tmp = tmp_path_factory.mktemp("lora-plan")
    return {"sd3": tiny_teacher, "wan": build_standin(str(tmp / "wan"), "wan"), "h3": build_h3_standin(str(tmp / "h3"))}


@pytest.mark.parametrize("kind", ["sd3", "wan", "h3"])
@pytest.mark.parametrize("targets", [None, ["to_q", "ff.net.2", "proj_out"]])
def test_the_adapter_count_is_peft_s_trainable_parameters_of_the_real_model(standins, kind, targets):
    """The plan counts peft's adapters on the meta build by peft's own target rule; peft attached to
    the real model (on CPU) trains exactly that many parameters, and the base the trainer builds (in
    the compute dtype, its _keep_in_fp32_modules in fp32) is the plan's base, byte for byte."""
    import torch

    from dmd2_core.models import lora
    from dmd2_core.memory import lora_terms
    from dmd2_core.models import load_model_dir
    from dmd2_core.models.loading import build_empty

    url = standins[kind]
    args = load_args(None, dict(hf_checkpoint=url, prompts="digits", lora_rank=4, lora_target_modules=targets,
                                dtype="bfloat16"))
    size = lora_terms.size_of(args)
    model = lora.attach(load_model_dir(url).model, args)
    trained = [p for n, p in model.named_parameters() if p.requires_grad]
    assert size.adapters == sum(p.numel() for p in trained) > 0
    assert size.layers == len(trained) // 2
    base = build_empty(url, torch.bfloat16).model
    assert size.base_fp32 * 4 + size.base_compute * 2 == sum(p.numel() * p.element_size() for p in base.parameters())
    if kind == "wan":  # its time embedder, norms and modulation tables stay fp32 in a LoRA's base
        assert size.base_fp32 > 0


def test_the_planned_lora_state_is_the_bytes_a_rank_holds(tiny_teacher, tmp_path):
    """In-process trainers (one rank, bf16): the actor's and the critic's adapters (fp32 masters,
    AdamW moments, the actor's EMA) and their frozen bases in bf16 are the plan's figures; the
    critic holds one base and no teacher."""
    from dmd2_core.run.distill_run import preflight
    from tests.helpers import in_process_trainers, iterate_in_process, tiny_args

    args = tiny_args(tiny_teacher, str(tmp_path), dtype="bfloat16", lora_rank=4, lr=1e-3, critic_lr=1e-3,
                     ema_decay=0.99)
    planned = _groups(planner.plan(preflight(args)))
    trainers = in_process_trainers(args)
    iterate_in_process(trainers, 1)  # the optimizer state exists after a step
    for role, trainer in trainers.items():
        held, plan = trainer.state_bytes(), planned[role]
        assert plan.base > 0 and plan.params > 0
        assert held["params"] == plan.params + plan.base, role
        # AdamW's two moments, plus its step counters (one scalar per adapter)
        assert 0 <= held["optimizer"] - plan.optimizer <= 8 * len(trainer.optimizer.state), role
        assert held["ema"] == plan.ema and held["teacher"] == plan.teacher == 0, role
    assert planned["actor"].ema == planned["actor"].params and planned["critic"].ema == 0
    assert planned["critic"].guidance > 0  # the real score: the shared base with its adapter off


def test_the_critic_s_shared_base_is_counted_once_and_a_full_fake_score_keeps_its_teacher():
    full, lora16 = _groups(_plan(micro_batch_size=1, cp_size=8)), _groups(_plan(micro_batch_size=1, cp_size=8,
                                                                                lora_rank=16))
    critic, actor = lora16["critic"], lora16["actor"]
    assert critic.teacher == 0 and critic.base == actor.base > 0
    # the base: 14.3 B in bf16 (Wan's kept-fp32 norms and embedders at 4 bytes), an eighth per rank
    assert full["critic"].teacher <= critic.base <= 1.01 * full["critic"].teacher
    assert critic.resident < 0.25 * full["critic"].resident and critic.guidance == full["critic"].guidance
    # to_q, to_k, to_v, to_out.0 of self- and cross-attention: 8 layers of 5120 x 5120 in each of 40 blocks
    assert critic.params == actor.params == 16 * 40 * 8 * (2 * 5120) * 4 // 8
    assert critic.saved == critic.params + critic.optimizer  # a checkpoint holds the adapters alone
    assert _groups(_plan(micro_batch_size=1, cp_size=8, lora_rank=64))["critic"].params == 4 * critic.params
    # a full-fine-tuning fake score beside a LoRA student: its fp32 state and its own teacher again
    mixed = _groups(_plan(micro_batch_size=1, cp_size=8, lora_rank=16, critic_lora_rank=0))
    assert mixed["critic"].teacher == full["critic"].teacher and mixed["critic"].params == full["critic"].params
    assert mixed["critic"].base == 0 and mixed["actor"].base == actor.base


@pytest.mark.parametrize("rank", [16, 64])
def test_minimax_h3_5s_with_lora_fits_one_node_of_80_gib_within_the_headroom_and_full_fine_tuning_does_not(rank):
    """MiniMax-H3 (33 B) at 5 s on 8 x 80 GiB: full fine-tuning is refused at cp 1 and at cp 8 (the
    actor's fp32 state alone is ~62 GiB per rank); a LoRA student and fake score over one bf16 base
    each fit already at cp 1, inside the 10% headroom (72 GiB usable)."""
    refused = _plan("minimax-h3", **H3_5S)
    assert not refused.fits and refused.device_peak > 2 * refused.usable
    with pytest.raises(ArgsError, match=r"^memory plan: .*try .*LoRA \((critic_)?lora_rank\)"):
        planner.check_fits(refused)
    assert not _plan("minimax-h3", **{**H3_5S, "cp_size": 8}).fits
    for cp in (1, 2):
        plan = _plan("minimax-h3", **{**H3_5S, "lora_rank": rank, "cp_size": cp})
        planner.check_fits(plan)
        assert plan.fits and plan.device_peak <= plan.usable == int(0.9 * 80 * GIB)
        critic = _groups(plan)["critic"]
        assert critic.teacher == 0 and 7.5 * GIB < critic.base < 8 * GIB  # 33.1 B in bf16 over 8 ranks
    assert "base" in planner.table(plan)


def test_the_host_plan_counts_the_set_rows_a_step_reads_and_the_streaming_export_writer():
    """MiniMax-H3 (33 B): each rank holds its rows of the prompt set (per-prompt conditions, not
    the set) and rank 0 of the actor, exporting, one whole tensor at a time, not the 33 B model;
    a merged LoRA export merges on the host: the model whole, twice with an EMA."""
    plan = _plan("minimax-h3", **H3_5S)
    size = planner.model_size(H3)
    host = plan.host
    assert host.parts["export_writer"] == size.largest_tensor * (4 + 2 * 2) < size.params * 2 / 20  # 2.1 of 66 GB
    assert 0 < host.parts["set_rows"] < GIB
    bigger = _plan("minimax-h3", global_batch_size=4 * plan.groups[0].cp_size * 16, **H3_5S).host
    assert bigger.parts["set_rows"] > host.parts["set_rows"]
    assert host.steady == host.ranks_per_node * (host.parts["sleep_stash"] + host.parts["async_save_staging"]
                                                 + host.parts["offloaded"] + host.parts["processes"]
                                                 + host.parts["set_rows"]) + host.parts["export_writer"]
    merged = _plan("minimax-h3", export_merged=True, ema_decay=0.99, **{**H3_5S, "lora_rank": 16}).host
    assert merged.parts["export_writer"] >= 2 * size.params * 2


def test_the_eval_decoder_counts_each_familys_own_frames_and_refuses_a_family_that_did_not_say():
    """The decoded clips are priced at the family's frames: a MiniMax-H3 clip of 5n + 2 latent frames
    is 17n + 5 frames (124 for 5 s), a Wan clip of f latent frames 4(f - 1) + 1; a family without
    its decoder's facts is refused, never priced by another family's."""
    from dmd2_core.models.base import ModelFamily
    from dmd2_core.models.minimax_h3 import MiniMaxH3Family
    from dmd2_core.models.wan import WanVideoFamily

    args = load_args(None, {"eval_interval": 1, "eval_prompts": [0, 1], "eval_samples_per_prompt": 1})

    def decoded_frames(family, latent_shape):  # the decoded clips' bytes (fp32, 3 channels) over one frame's
        params, ratio, _ = family.decoder_facts()
        height, width = latent_shape[-2] * ratio, latent_shape[-1] * ratio
        total = terms.eval_decoder(args, family, latent_shape, 2)
        working = terms.DECODE_ELEMENTS_PER_PIXEL * family.decode_chunk_frames * height * width * 2
        return (total - params * 2 - min(working, total)) / (2 * 3 * height * width * 4)

    assert decoded_frames(MiniMaxH3Family(), (24, 37, 2, 2)) == 124
    assert decoded_frames(WanVideoFamily(), (16, 21, 2, 2)) == 81
    with pytest.raises(NotImplementedError, match="does not say its eval decoder"):
        terms.eval_decoder(args, ModelFamily(), (4, 8, 8), 2)

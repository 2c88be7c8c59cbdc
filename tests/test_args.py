"""The argument model, recipes, the CLI and per-trainer args (stack PR 1/10)."""

import pytest

from dmd2_core.args import ARG_NAMES, load_args
from dmd2_core.errors import ArgsError
from dmd2_core.train.trainer_config import TrainerConfig, compute_trainer_args, compute_trainer_configs

STACK_FLAGS = ["hf_checkpoint", "load", "save", "lr", "seed", "num_iterations", "num_steps_per_rollout",
               "global_batch_size", "micro_batch_size", "loss_type", "train_input_hook_path", "eval_interval",
               "save_interval", "critic_hf_checkpoint", "critic_lr", "dmd2_student_steps", "dmd2_guidance_scale",
               "dmd2_critic_scoring"]


def test_every_stack_flag_exists():
    assert set(STACK_FLAGS) <= set(ARG_NAMES)


def test_actor_alone_by_default_without_overrides():
    args = load_args(None, {"loss_type": "flow_matching"})
    assert compute_trainer_configs(args) == [TrainerConfig("actor", {})]
    assert compute_trainer_args(args, TrainerConfig("actor")).model_dump() == args.model_dump()


def test_dmd2_synthesizes_the_critic_with_its_overrides():
    args = load_args(None, {"hf_checkpoint": "s3://b/teacher", "save": "s3://b/run", "lr": 2e-5,
                            "critic_lr": 4e-5, "dmd2_update_ratio": 5, "critic_train_input_hook_path": "pkg.mod.fn"})
    roles = [c.role for c in compute_trainer_configs(args)]
    assert roles == ["critic", "actor"]
    critic = compute_trainer_args(args, compute_trainer_configs(args)[0])
    assert critic.hf_checkpoint == "s3://b/teacher" and critic.teacher_checkpoint == "s3://b/teacher"
    assert critic.lr == 4e-5 and critic.num_steps_per_rollout == 5 and critic.loss_type == "dmd2_critic"
    assert critic.save == "s3://b/run" and critic.train_input_hook_path == "pkg.mod.fn"
    own = load_args(None, {"hf_checkpoint": "t", "critic_hf_checkpoint": "c"})
    own_critic = compute_trainer_args(own, compute_trainer_configs(own)[0])
    assert own_critic.hf_checkpoint == "c" and own_critic.teacher_checkpoint == "t"
    actor = compute_trainer_args(args, compute_trainer_configs(args)[1])
    assert actor.lr == 2e-5 and actor.num_steps_per_rollout == 1


def test_trainer_args_are_a_deep_copy():
    args = load_args(None, {"eval_prompts": [1, 2]})
    copy = compute_trainer_args(args, TrainerConfig("critic", {"lr": 1.0}))
    copy.eval_prompts.append(3)
    assert args.lr == 1e-4 and args.eval_prompts == [1, 2]


def test_groups_sleep_by_default_only_where_sleeping_frees_device_memory():
    assert load_args("tiny").sleep_after_train is False  # cpu: device memory is host memory
    assert load_args("tiny", {"device": "cuda"}).sleep_after_train is True
    assert load_args("tiny", {"sleep_after_train": True}).sleep_after_train is True
    assert load_args("tiny", {"device": "cuda", "sleep_after_train": False}).sleep_after_train is False


def test_unknown_override_is_rejected_with_the_nearest_name():
    with pytest.raises(ArgsError, match=r"unknown key 'lrr' in overrides of trainer 'critic'; did you mean 'lr'\?"):
        compute_trainer_args(load_args(None), TrainerConfig("critic", {"lrr": 1.0}))


@pytest.mark.parametrize("overrides, pattern", [
    ({"micro_batch_sise": 4}, r"unknown key 'micro_batch_sise' in overrides; did you mean 'micro_batch_size'\?"),
    ({"lr": "fast"}, r"invalid value for 'lr'.*valid number.*'fast'"),
    ({"num_devices": 0}, r"invalid value for 'num_devices'.*greater than or equal to 1"),
    ({"dmd2_critic_scoring": "orig"}, r"invalid value for 'dmd2_critic_scoring'.*'fused' or 'original'"),
    ({"dmd2_min_sigma": 0.5, "dmd2_max_sigma": 0.4}, r"invalid value for 'dmd2_min_sigma'"),
])
def test_bad_values_fail_with_one_line_naming_the_key(overrides, pattern):
    with pytest.raises(ArgsError, match=pattern) as err:
        load_args(None, overrides)
    assert "\n" not in str(err.value)


def test_recipe_keys_are_checked(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: 1.0e-4\nglobal_batch_sizee: 8\n")
    with pytest.raises(ArgsError, match=r"unknown key 'global_batch_sizee' in recipe r.yaml; did you mean 'global_batch_size'"):
        load_args(recipe)
    with pytest.raises(ArgsError, match=r"recipe file not found"):
        load_args(tmp_path / "missing.yaml")
    recipe.write_text("lr: 3.0e-4\nseed: 4\n")
    args = load_args(recipe, {"seed": 5})
    assert (args.lr, args.seed) == (3e-4, 5)


def _cli(*argv):
    """``python -m dmd2_core *argv`` in this process (its exit code and output)."""
    import contextlib
    import io
    from types import SimpleNamespace

    from dmd2_core.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse: --help, unknown flags, bad values
            code = exc.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_check_prints_each_trainers_args_and_fails_cleanly(tmp_path):
    import json

    recipe = tmp_path / "r.yaml"
    recipe.write_text("hf_checkpoint: /models/teacher\nloss_type: dmd2\n")
    ok = _cli("check", "--recipe", str(recipe), "--critic-lr", "3e-5", "--eval-prompts", "1", "2")
    assert ok.returncode == 0, ok.stderr
    trainers = json.loads(ok.stdout)
    assert trainers["critic"]["lr"] == 3e-5 and trainers["actor"]["eval_prompts"] == [1, 2]
    bad = _cli("check", "--recipe", str(recipe), "--lrr", "3")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: unknown flag '--lrr'; did you mean '--lr'?"
    bad = _cli("check", "--recipe", str(recipe), "--seed", "-1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "'seed'" in bad.stderr
    assert "Traceback" not in bad.stderr
    helptext = _cli("check", "--help").stdout
    assert "dmd2 flags" in helptext and "--dmd2-critic-scoring" in helptext and "train flags" in helptext


def test_every_subcommand_takes_the_same_override_syntax_and_fails_in_one_line(tmp_path, capsys):
    """check, plan, prepare-* and the flow CLI take --set KEY=VALUE and the per-flag options
    alike; every usage error (a bad value, an unknown flag, a batch or run name that cannot work)
    is one line and exit 2, and a suggestion never names the flag it refuses."""
    import contextlib
    import io
    import json

    from flows.dmd2 import main as flow_main

    ok = _cli("check", "--recipe", "tiny", "--set", "lr=3e-5", "--critic-lr", "2e-5")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["actor"]["lr"] == 3e-5 and json.loads(ok.stdout)["critic"]["lr"] == 2e-5
    missing_teacher = _cli("prepare-prompts", "--set", "prompts_file=p.txt", "--set", f"out={tmp_path / 'o'}")
    assert missing_teacher.stderr == "error: --hf-checkpoint is not set (or --set hf_checkpoint=...)\n"
    cases = [
        (("check", "--recipe", "tiny", "--set", "micro_batch_size=128"),
         "error: invalid value for 'micro_batch_size' in recipe tiny with overrides: 128 is above global_batch_size 64"),
        (("plan", "--recipe", "tiny", "--run-name", "nights/a"),
         "error: invalid value for 'run_name' in recipe tiny with overrides: 'nights/a' must be one path segment"),
        (("check", "--recipe", "tiny", "--sett", "lr=1"), "error: unknown flag '--sett'; did you mean '--set'?"),
        (("prepare-prompts", "--json"), "error: unknown flag '--json'"),  # plan's flag, not this one's
        (("prepare-latents", "--set", "num_frame=16"), "error: unknown key 'num_frame' in --set; did you mean 'num_frames'?"),
        (("prepare-latents", "--num-frames", "many"), "error: argument --num-frames: invalid int value: 'many'"),
    ]
    for argv, line in cases:
        out = _cli(*argv)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith(line), (argv, out.stderr)
        assert f"did you mean '{argv[1]}'" not in out.stderr, out.stderr

    def flow(*argv) -> tuple[int, str]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = flow_main(list(argv))
            except SystemExit as exc:
                code = exc.code
        return code, err.getvalue() + capsys.readouterr().err

    for argv, line in ((("--num-iterations", "many"), "error: invalid value for 'num_iterations'"),
                       (("--lrr", "1"), "error: unknown flag '--lrr'; did you mean '--lr'?"),
                       (("--set", "run_name=a/b"), "error: invalid value for 'run_name'")):
        code, err = flow(*argv)
        assert code == 2 and err.count("\n") == 1 and err.startswith(line), (argv, err)


def test_settings_that_would_do_nothing_are_refused_before_any_actor(tiny_teacher, tmp_path, capsys):
    """A fine-tune from a checkpoint at iteration 4000 with num_iterations 200 (nothing to train),
    steps per rollout on the dmd2 actor (it takes one) and label_dropout (nothing trains with it):
    each is refused in one line naming the key, exit 2, before anything is written."""
    from dmd2_core import checkpoint, cli
    from dmd2_core.models import load_model_dir

    load = str(tmp_path / "pretrained")
    model = load_model_dir(tiny_teacher).model
    for role in ("actor", "critic"):
        checkpoint.save_trainer(load, role, 4000, model, None).result()
    checkpoint.write_latest(load, 4000)
    save = tmp_path / "run"
    recipe = tmp_path / "dropout.yaml"
    recipe.write_text("label_dropout: 0.2\n")
    base = ["check", "--deep", "--hf-checkpoint", tiny_teacher, "--prompts", "digits", "--save", str(save), "--load", load]
    for argv, key in ((["--recipe", "tiny", "--num-iterations", "200"], "num_iterations: 200 does not go beyond iteration 4000"),
                      (["--recipe", "tiny", "--num-iterations", "4200", "--num-steps-per-rollout", "3"], "'num_steps_per_rollout'"),
                      (["--recipe", str(recipe), "--num-iterations", "4200"], "unknown key 'label_dropout'")):
        assert cli.main(base + argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and key in err, err
    assert not save.exists()
    assert cli.main(base + ["--recipe", "tiny", "--num-iterations", "4200"]) == 0
    assert "--label-dropout" not in cli.build_parser().format_help()



@pytest.mark.parametrize("argv, key, first, second", [
    (("--set", "num_iterations=1", "--num-iterations", "-3"), "num_iterations", "--num-iterations -3",
     "--set num_iterations=1"),
    (("--set", "num_iterations=1", "--set", "num_iterations=abc"), "num_iterations", "--set num_iterations=1",
     "--set num_iterations=abc"),
    (("--num-iterations", "2", "--num-iterations", "3"), "num_iterations", "--num-iterations 2", "--num-iterations 3"),
    (("--eval-prompts", "1", "2", "--set", "eval_prompts=[1, 3]"), "eval_prompts", "--eval-prompts 1 2",
     "--set eval_prompts=[1, 3]"),
])
def test_one_key_given_twice_with_two_values_is_refused_naming_both(tmp_path, capsys, argv, key, first, second):
    """Neither value wins silently (the last one did, invalid or not): the recipe CLI and the
    flow's refuse in one line naming both spellings, exit 2, before anything runs."""
    from flows.dmd2 import main as flow_main

    line = f"error: {key}: given twice with different values ('{first}' and '{second}'); give it once\n"
    out = _cli("check", "--recipe", "tiny", "--save", str(tmp_path / "run"), *argv)
    assert out.returncode == 2 and out.stderr == line, out.stderr
    try:
        code = flow_main(["--save", str(tmp_path / "run"), *argv])
    except SystemExit as exc:  # argparse's own refusal of an option given twice
        code = exc.code
    assert code == 2 and capsys.readouterr().err == line
    assert not (tmp_path / "run").exists()


def test_one_key_given_twice_with_the_same_value_passes():
    import json

    for argv in (("--num-iterations", "7", "--set", "num_iterations=7"), ("--lr", "1e-4", "--set", "lr=0.0001"),
                 ("--num-iterations", "7", "--num-iterations", "7"),
                 ("--dmd2-student-steps", "1", "2", "--set", "dmd2_student_steps=[1, 2]")):
        out = _cli("check", "--recipe", "tiny", *argv)
        assert out.returncode == 0, (argv, out.stderr)
    assert json.loads(out.stdout)["actor"]["dmd2_student_steps"] == [1, 2]


@pytest.mark.parametrize("argv, line", [
    (("--out", "a", "--iteration", "20", "--set", "iteration=30"),
     "error: iteration: given twice with different values ('--iteration 20' and '--set iteration=30')"),
    (("--out", "a", "--out", "b"), "error: out: given twice with different values ('--out a' and '--out b')"),
])
def test_a_subcommand_option_given_twice_with_two_values_is_refused(tmp_path, argv, line):
    out = _cli("export", "--load", str(tmp_path / "run"), "--format", "pipeline", *argv)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith(line), out.stderr

"""`python -m dmd2_core` (console script `dmd2`): check a recipe, print each trainer's args, plan its
memory, prepare prompt and real sets, export any checkpoint after the fact.

Every subcommand, and the flow's CLI (``flows.dmd2``), takes its options both ways: one option
per flag (``--save URL``) and ``--set KEY=VALUE`` (the value parsed as YAML); a usage error is one
line and exit 2."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Optional

from dmd2_core.args import Args, given_twice, load_args, parse_set_spelled, recipe_names, same_value
from dmd2_core.errors import ArgsError, nearest
from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs
from dmd2_core.trackers.flags import TrackerFlags


def build_parser() -> ArgParser:
    parser = ArgParser(prog="dmd2", description="DMD2 distillation of flow-matching diffusion models.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgParser)
    check = sub.add_parser("check", help="validate a recipe with overrides and print each trainer's args")
    check.add_argument("--recipe", required=True, help=f"recipe name ({', '.join(recipe_names())}) or YAML path")
    check.add_argument("--deep", action="store_true", help="also check checkpoints, hooks and the resume point")
    add_arg_flags(check)
    # every flag, by group, also on the top-level help (they are the recipe keys and flow overrides)
    parser.epilog = "Every flag of a run (recipe keys, flow overrides), by group:\n\n" + check.format_help()
    plan = sub.add_parser("plan", help="the memory and time plan per group and rank, from the checkpoints' configs "
                          "(no weights loaded, no device needed), against the cluster the recipe names (num_devices "
                          "of device_kind, device_memory_gib each); exit 2 when it does not fit, naming the nearest "
                          "settings that do")
    plan.add_argument("--recipe", required=True, help=f"recipe name ({', '.join(recipe_names())}) or YAML path")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    plan.add_argument("--assumed-mfu", type=float, default=None, help="model FLOPs utilisation per device the time "
                      "plan assumes (default 0.4), unless a previous run of the same save measured its pace")
    plan.add_argument("--peak-tflops", type=float, default=None, help="a device's dense bf16 peak, TFLOP/s "
                      "(instead of the recipe's device_kind)")
    plan.add_argument("--storage-gbps", type=float, default=None, help="GB/s to and from the save's storage, "
                      "all ranks together: checkpoints, exports and the start (default 2)")
    plan.add_argument("--night-hours", type=float, default=None, help="the hours of a night the plan fills "
                      "(default 10)")
    plan.add_argument("--calibrate-from", default=None, help="a save (path or URL) of a run of this recipe, a few "
                      "iterations on the target devices: its first iteration sets the plan's FLOP/s and its first "
                      "checkpoint the storage bandwidth, instead of the assumed MFU and --storage-gbps")
    add_arg_flags(plan)
    sub.add_parser("recipes", help="list the recipes")
    prep = sub.add_parser("prepare-prompts", help="encode a prompt list with the checkpoint's own text encoder")
    prep.add_argument("--hf-checkpoint", help="diffusers pipeline directory (path or URL); required")
    prep.add_argument("--prompts-file", help="text file (path or URL), one prompt per line; required")
    prep.add_argument("--out", help="where to write the prompt set (.safetensors, path or URL); required")
    prep.add_argument("--negative-prompt", default="", help="the unconditional prompt for guidance (default empty)")
    prep.add_argument("--max-sequence-length", type=int, default=None, help="default: the pipeline's")
    prep.add_argument("--keyframes", default=None, help="MiniMax-H3 fl2va: a JSON list, one entry per prompt, "
                      "{\"first\": image, \"last\": image} (either or both, the clip's frame size), encoded with "
                      "the checkpoint's VAE into the set")
    prep.add_argument("--references", default=None, help="MiniMax-H3 ref2va: a JSON list, one entry per prompt, a "
                      "list of {\"image\": path} / {\"audio\": path} in the order the model reads them, encoded "
                      "with the checkpoint's VAEs into the set (needs --num-frames, --height, --width)")
    prep.add_argument("--num-frames", type=int, default=None, help="ref2va: the clip's frames (a sound is cut to them)")
    prep.add_argument("--height", type=int, default=None, help="ref2va: the clip's height in pixels")
    prep.add_argument("--width", type=int, default=None, help="ref2va: the clip's width in pixels")
    add_set_flag(prep, "set one of the options above, e.g. out=prompts.safetensors")
    lat = sub.add_parser("prepare-latents", help="encode images or clips with the checkpoint's own VAE, and their "
                         "captions with its text encoder, into a real set (the GAN head's real_data)")
    lat.add_argument("--hf-checkpoint", help="diffusers pipeline directory with vae/ (path or URL); required")
    lat.add_argument("--images", help="directory (path or URL) of images, or clips for a video family; required")
    lat.add_argument("--captions", help="text file: name<TAB>caption lines, or one caption per file in name order; required")
    lat.add_argument("--out", help="where to write the real set (.safetensors, path or URL); required")
    lat.add_argument("--latent-shape", type=int, nargs="+", default=None, help="[C, H, W] or [C, F, H, W]; default the model's")
    lat.add_argument("--num-frames", type=int, default=None, help="video + audio models: frames per clip (as the recipe's)")
    lat.add_argument("--height", type=int, default=None, help="video + audio models: clip height in pixels")
    lat.add_argument("--width", type=int, default=None, help="video + audio models: clip width in pixels")
    lat.add_argument("--negative-prompt", default="", help="the unconditional prompt for guidance (default empty)")
    lat.add_argument("--max-sequence-length", type=int, default=None, help="default: the pipeline's")
    lat.add_argument("--keyframe-anchors", default=None, help="MiniMax-H3 fl2va: first, last or first,last: each clip "
                     "conditioned on its own first / last frame, as an fl2va run's samples are on their keyframes")
    add_set_flag(lat, "set one of the options above, e.g. num_frames=16")
    exp = sub.add_parser("export", help="export any checkpoint of a run, after the fact, in the format its user loads")
    exp.add_argument("--load", help="the run's save URL (path or URL) holding the checkpoint; required")
    exp.add_argument("--iteration", type=int, default=None, help="the checkpoint's iteration (default: the newest complete)")
    exp.add_argument("--out", help="where to write the export (a directory, path or URL); required")
    exp.add_argument("--format", help="pipeline, merged, lora-diffusers, peft or original; required")
    exp.add_argument("--hf-checkpoint", default=None, help="the model directory (the LoRA's base, the pipeline's other "
                     "components); default the one the checkpoint records")
    exp.add_argument("--num-steps", type=int, default=None, help="the student's steps (default: the run's)")
    exp.add_argument("--shift", type=float, default=None, help="the student's sigma shift (default: the run's)")
    exp.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the run's export dtype)")
    add_set_flag(exp, "set one of the options above, e.g. iteration=200")
    return parser


PREPARE_REQUIRED = {"prepare-prompts": ("hf_checkpoint", "prompts_file", "out"),
                    "prepare-latents": ("hf_checkpoint", "images", "captions", "out"),
                    "export": ("load", "out", "format")}


# ---- CLI generated from the model -------------------------------------------------------------

class ArgParser(argparse.ArgumentParser):
    """argparse that reports any error as one line (an unknown flag with the nearest one the
    subcommand takes, never the refused flag itself) and exits 2. Its options are ``StoreOnce``:
    one given twice with two values is refused."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_flag(extras[0], _option_strings(chosen_subparser(self, ns) or self)))
        return ns

    def error(self, message: str):  # noqa: D401 - argparse hook
        match = re.search(r"unrecognized arguments: (\S+)", message)
        if match:
            message = unknown_flag(match.group(1), _option_strings(self))
        self.exit(2, f"error: {' '.join(message.split())}\n")


GIVEN = "given_options"  # the namespace's {dest: how the option was written}, kept by StoreOnce


class StoreOnce(argparse._StoreAction):
    """argparse's store, except that an option given twice with two values is refused in one line
    naming both (argparse keeps the last silently); the same value twice passes. What was written
    is kept for ``arg_overrides`` to tell a ``--set`` of the same key apart."""

    def __call__(self, parser, namespace, values, option_string=None):
        written = " ".join(map(str, values)) if isinstance(values, list) else str(values)
        spelling = f"{option_string} {written}"
        given = vars(namespace).setdefault(GIVEN, {})
        if self.dest in given and not same_value(self.dest, getattr(namespace, self.dest), values):
            parser.error(str(given_twice(self.dest, given[self.dest], spelling)))
        given[self.dest] = spelling
        setattr(namespace, self.dest, values)


def unknown_flag(item: str, known: list[str]) -> str:
    """The one line for an argument a parser does not take: the nearest flag it does take."""
    flag = item.split("=")[0]
    if not flag.startswith("-"):
        return f"unexpected argument '{item}'"
    return f"unknown flag '{flag}'{nearest(flag, [k for k in known if k != flag])}"


def chosen_subparser(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> Optional[argparse.ArgumentParser]:
    """The subcommand's parser that parsed ``ns``, or None."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(getattr(ns, action.dest, None))
    return None


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    found = []
    for action in parser._actions:
        found += action.option_strings
        for sub in (getattr(action, "choices", None) or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            found += _option_strings(sub)
    return found


def add_set_flag(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--set", dest="set_items", action="append", default=[], metavar="KEY=VALUE",
                        help=f"{help} (value parsed as YAML); repeatable")


def add_arg_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per Args field, grouped, and ``--set KEY=VALUE`` for any of them. Values stay
    strings for the model to validate (so errors name the key); unset flags stay absent so the
    recipe's value wins."""
    add_set_flag(parser, "override one flag")
    groups: dict[str, argparse._ArgumentGroup] = {}
    # the trackers' flags (declared in a base class of Args, so first in its fields) are listed last
    for name, field in sorted(Args.model_fields.items(), key=lambda item: item[0] in TrackerFlags.model_fields):
        group_name = (field.json_schema_extra or {}).get("group", "other")
        group = groups.setdefault(group_name, parser.add_argument_group(f"{group_name} flags"))
        is_list = "list[" in str(field.annotation)
        group.add_argument(
            "--" + name.replace("_", "-"), dest=name, nargs="+" if is_list else None,
            metavar=name.upper(), default=argparse.SUPPRESS,
            help=f"{field.description} (default: {field.default!r})",
        )


def arg_overrides(ns: argparse.Namespace) -> dict:
    """The Args overrides of a parse by ``add_arg_flags``: the per-flag options and ``--set``; a
    key given both ways with two values is refused in one line naming both."""
    overrides = {k: v for k, v in vars(ns).items() if k in Args.model_fields}
    for key, (value, spelling) in parse_set_spelled(getattr(ns, "set_items", [])).items():
        if key in overrides and not same_value(key, overrides[key], value):
            raise given_twice(key, _spelling(ns, key), spelling)
        overrides[key] = value
    return overrides


def _spelling(ns: argparse.Namespace, dest: str) -> str:
    """How option ``dest`` was written on the command line."""
    return vars(ns).get(GIVEN, {}).get(dest) or f"--{dest.replace('_', '-')} {getattr(ns, dest)}"


def apply_set_to_options(parser: argparse.ArgumentParser, ns: argparse.Namespace, required: tuple = ()) -> None:
    """``--set KEY=VALUE`` onto a subcommand's own options (its types applied), then the
    ``required`` ones checked: each failure one line naming the key."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "set_items")}
    for key, (value, spelling) in parse_set_spelled(ns.set_items).items():
        action = actions.get(key)
        if action is None:
            raise ArgsError(f"unknown key '{key}' in --set{nearest(key, sorted(actions))}")
        if key in vars(ns).get(GIVEN, {}) and not same_value(key, getattr(ns, key), value):
            raise given_twice(key, _spelling(ns, key), spelling)
        if action.type is not None and value is not None:
            try:
                value = [action.type(v) for v in value] if isinstance(value, list) else action.type(value)
            except (TypeError, ValueError):
                raise ArgsError(f"invalid value for '{key}' in --set: {value!r}") from None
        setattr(ns, key, value)
    for key in required:
        if getattr(ns, key, None) is None:
            raise ArgsError(f"--{key.replace('_', '-')} is not set (or --set {key}=...)")


def plan_time(ns: argparse.Namespace, args: Args, trainers: dict, memory_plan, kind_given: bool = False,
              mfu: Optional[float] = None):
    """The time plan of ``plan``: from its flags (``apply_set_to_plan_flags`` applied), its peak by
    the run's ``device_kind`` unless given in TFLOP/s (both given on the command line is refused),
    and the pace a previous run of the same save measured, if any; or at ``mfu``, measured or not."""
    from dmd2_core.evaluation.evaluator import evaluator_name
    from dmd2_core.memory import time_plan

    if ns.peak_tflops is not None and kind_given:
        raise ArgsError("peak_tflops: give it or device_kind, not both")
    if ns.peak_tflops is not None and ns.peak_tflops <= 0:
        raise ArgsError(f"peak_tflops: {ns.peak_tflops} is not above 0")
    peak = ns.peak_tflops * 1e12 if ns.peak_tflops is not None else time_plan.device_peak_flops(
        args.device_kind or time_plan.DEFAULT_DEVICE)
    pick = lambda value, default: default if value is None else value  # noqa: E731
    calibrating = bool(ns.calibrate_from) and not mfu
    planned = time_plan.time_plan(
        trainers, memory_plan, evaluator_name(args), mfu or pick(ns.assumed_mfu, time_plan.DEFAULT_MFU), peak,
        pick(ns.storage_gbps, time_plan.DEFAULT_STORAGE_GBPS), pick(ns.night_hours, time_plan.DEFAULT_NIGHT_HOURS),
        None if mfu or calibrating else _previous_pace(args.save, len(args.size_schedule or []) or None))
    if calibrating:
        return time_plan.calibrate(planned, trainers, *_calibration_rows(ns.calibrate_from))
    return planned


def plan_run(ns: argparse.Namespace, args: Args, kind_given: bool = False) -> int:
    """``plan``: the memory and time plan of ``args`` against the cluster it names; when it does
    not fit, the nearest settings that do (planned at this run's pace), and exit 2 in one line."""
    from dmd2_core.memory import planner, proposals, time_plan
    from dmd2_core.models import describe_model_dir
    from dmd2_core.run import preflight_checks

    apply_set_to_plan_flags(ns)
    if args.hf_checkpoint:  # a clip's geometry becomes its latents, as in preflight
        teacher = describe_model_dir(args.hf_checkpoint, "hf_checkpoint")
        args = preflight_checks.check_family_args(args, teacher)
        preflight_checks.check_size_schedule(args, teacher)

    def plans(setting: Args, **time_kw):
        trainers = {cfg.role: compute_trainer_args(setting, cfg) for cfg in compute_trainer_configs(setting)}
        memory_plan = planner.plan(trainers)
        return memory_plan, plan_time(ns, setting, trainers, memory_plan, kind_given, **time_kw)

    memory_plan, timing = plans(args)
    nearest_fits = []
    if not memory_plan.fits:  # a measured pace is this setting's: the others run at the MFU it implies
        pace = min(1.0, timing.implied_mfu)
        nearest_fits = proposals.propose(args, lambda setting: plans(setting, mfu=pace), memory_plan.shard_size)
    if ns.json:
        print(json.dumps({**memory_plan.as_dict(), "time": timing.as_dict(),
                          "proposals": [p.as_dict() for p in nearest_fits]}, indent=1))
    else:
        print(planner.table(memory_plan) + "\n" + time_plan.table(timing)
              + ("" if memory_plan.fits else "\n" + proposals.table(nearest_fits)))
    try:
        planner.check_fits(memory_plan)
    except ArgsError as refused:
        if not nearest_fits:
            raise
        raise ArgsError(f"{refused}; nearest that fits: {nearest_fits[0].describe()}") from None
    return 0


def _calibration_rows(save: str) -> tuple[list[dict], str]:
    """The metrics rows of the save ``--calibrate-from`` names, and its metrics log's URL."""
    from dmd2_core.report.metrics_log import read_metrics
    from dmd2_core.save_layout import metrics_url

    try:
        rows = read_metrics(save)
    except (FileNotFoundError, OSError):
        rows = []
    if not rows:
        raise ArgsError(f"calibrate_from: no metrics log in {save} (expected {metrics_url(save)})")
    return rows, metrics_url(save)


def _previous_pace(save: Optional[str], full_size_stage: Optional[int] = None) -> Optional[dict]:
    """The pace a previous run of ``save`` measured (its metrics log) at full size, None without one."""
    from dmd2_core.memory import time_plan
    from dmd2_core.report.metrics_log import read_metrics
    from dmd2_core.save_layout import metrics_url

    if not save:
        return None
    try:
        rows = read_metrics(save)
    except (FileNotFoundError, OSError):
        return None
    return time_plan.measured_pace(rows, metrics_url(save), full_size_stage)


PLAN_TIME_FLAGS = {"assumed_mfu": float, "peak_tflops": float, "storage_gbps": float, "night_hours": float,
                   "calibrate_from": str}


def split_plan_sets(ns: argparse.Namespace) -> None:
    """Takes ``plan``'s own flags (``--set assumed_mfu=0.3``) out of ``--set``: the rest are Args keys."""
    ns.time_sets, kept = {}, []
    for item in ns.set_items:
        (key, (value, _)), = parse_set_spelled([item]).items()
        if key in PLAN_TIME_FLAGS:
            ns.time_sets[key] = value
        else:
            kept.append(item)
    ns.set_items = kept


def apply_set_to_plan_flags(ns: argparse.Namespace) -> None:
    """``--set`` of the time plan's own flags, typed as their flags are; a flag given both ways
    with two values is refused."""
    for key, convert in PLAN_TIME_FLAGS.items():
        if key in ns.time_sets:
            value = ns.time_sets[key]
            if getattr(ns, key) is not None and not same_value(key, getattr(ns, key), value):
                raise given_twice(key, _spelling(ns, key), f"--set {key}={value}")
            try:
                setattr(ns, key, convert(value))
            except (TypeError, ValueError):
                raise ArgsError(f"invalid value for '{key}' in --set: {value!r}") from None


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        if ns.command in PREPARE_REQUIRED:
            apply_set_to_options(chosen_subparser(parser, ns), ns, PREPARE_REQUIRED[ns.command])
        if ns.command == "recipes":
            print("\n".join(recipe_names()))
            return 0
        if ns.command == "prepare-prompts":
            from dmd2_core.prepare.prompts import prepare_prompts, read_prompt_list

            prompt_set = prepare_prompts(ns.hf_checkpoint, read_prompt_list(ns.prompts_file), ns.out,
                                         ns.negative_prompt, ns.max_sequence_length, ns.keyframes, ns.references,
                                         (ns.num_frames, ns.height, ns.width))
            shapes = {k: list(v.shape) for k, v in prompt_set.embeds.items()}
            print(json.dumps({"out": ns.out, "prompts": len(prompt_set), "shapes": shapes}))
            return 0
        if ns.command == "prepare-latents":
            from dmd2_core.prepare.latents import prepare_latents

            geometry = (ns.num_frames, ns.height, ns.width)
            if any(v is not None for v in geometry) and None in geometry:
                raise ArgsError(f"--{('num-frames', 'height', 'width')[geometry.index(None)]}: set --num-frames, "
                                "--height and --width together")
            real = prepare_latents(ns.hf_checkpoint, ns.images, ns.captions, ns.out, ns.latent_shape,
                                   ns.negative_prompt, ns.max_sequence_length,
                                   clip=None if None in geometry else geometry, keyframe_anchors=ns.keyframe_anchors)
            print(json.dumps({"out": ns.out, "samples": len(real), "latents": list(real.latents.shape[1:]),
                              "shapes": {k: list(v.shape) for k, v in real.cond.items()}}))
            return 0
        if ns.command == "export":
            from dmd2_core.export.from_checkpoint import export_checkpoint, plan_export

            plan = plan_export(ns.load, ns.out, ns.format, ns.iteration, ns.hf_checkpoint, ns.num_steps, ns.shift,
                               ns.dtype)
            print(json.dumps(export_checkpoint(plan)))
            return 0
        if ns.command == "plan":
            split_plan_sets(ns)
        overrides = arg_overrides(ns)
        args = load_args(ns.recipe, overrides)
        if ns.command == "plan":
            return plan_run(ns, args, kind_given="device_kind" in overrides)
        if ns.deep:
            from dmd2_core.run.preflight import preflight

            trainers = preflight(args)
        else:
            trainers = {cfg.role: compute_trainer_args(args, cfg) for cfg in compute_trainer_configs(args)}
        print(json.dumps({role: a.model_dump() for role, a in trainers.items()}, indent=2))
        return 0
    except ValueError as exc:  # ArgsError, StoredFilesError: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`python -m dmd2_core` (console script `dmd2`): check a recipe, print each trainer's args."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Optional

from dmd2_core.args import Args, load_args, nearest, parse_set, recipe_names
from dmd2_core.errors import ArgsError
from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs


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
    plan = sub.add_parser("plan", help="the memory plan per group and rank, from the checkpoints' configs "
                          "(no weights loaded, no device needed); exit 2 when it does not fit")
    plan.add_argument("--recipe", required=True, help=f"recipe name ({', '.join(recipe_names())}) or YAML path")
    plan.add_argument("--set", dest="set_items", action="append", default=[], metavar="KEY=VALUE",
                      help="override one flag (value parsed as YAML); repeatable")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    add_arg_flags(plan)
    sub.add_parser("recipes", help="list the recipes")
    prep = sub.add_parser("prepare-prompts", help="encode a prompt list with the checkpoint's own text encoder")
    prep.add_argument("--hf-checkpoint", required=True, help="diffusers pipeline directory (path or URL)")
    prep.add_argument("--prompts-file", required=True, help="text file (path or URL), one prompt per line")
    prep.add_argument("--out", required=True, help="where to write the prompt set (.safetensors, path or URL)")
    prep.add_argument("--negative-prompt", default="", help="the unconditional prompt for guidance (default empty)")
    prep.add_argument("--max-sequence-length", type=int, default=None, help="default: the pipeline's")
    lat = sub.add_parser("prepare-latents", help="encode images or clips with the checkpoint's own VAE, and their "
                         "captions with its text encoder, into a real set (the GAN head's real_data)")
    lat.add_argument("--hf-checkpoint", required=True, help="diffusers pipeline directory with vae/ (path or URL)")
    lat.add_argument("--images", required=True, help="directory (path or URL) of images, or clips for a video family")
    lat.add_argument("--captions", required=True, help="text file: name<TAB>caption lines, or one caption per file in name order")
    lat.add_argument("--out", required=True, help="where to write the real set (.safetensors, path or URL)")
    lat.add_argument("--latent-shape", type=int, nargs="+", default=None, help="[C, H, W] or [C, F, H, W]; default the model's")
    lat.add_argument("--num-frames", type=int, default=None, help="video + audio models: frames per clip (as the recipe's)")
    lat.add_argument("--height", type=int, default=None, help="video + audio models: clip height in pixels")
    lat.add_argument("--width", type=int, default=None, help="video + audio models: clip width in pixels")
    lat.add_argument("--negative-prompt", default="", help="the unconditional prompt for guidance (default empty)")
    lat.add_argument("--max-sequence-length", type=int, default=None, help="default: the pipeline's")
    return parser


# ---- CLI generated from the model -------------------------------------------------------------

class ArgParser(argparse.ArgumentParser):
    """argparse that reports any error as one line (with the nearest flag) and exits 2."""

    def error(self, message: str):  # noqa: D401 - argparse hook
        match = re.search(r"unrecognized arguments: (\S+)", message)
        if match:
            flag = match.group(1).split("=")[0]
            known = _option_strings(self)
            message = f"unknown flag '{flag}'{nearest(flag, known)}"
        self.exit(2, f"error: {message}\n")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    found = []
    for action in parser._actions:
        found += action.option_strings
        for sub in (getattr(action, "choices", None) or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            found += _option_strings(sub)
    return found


def add_arg_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per Args field, grouped. Values stay strings for the model to validate (so
    errors name the key); unset flags stay absent so the recipe's value wins."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, field in Args.model_fields.items():
        group_name = (field.json_schema_extra or {}).get("group", "other")
        group = groups.setdefault(group_name, parser.add_argument_group(f"{group_name} flags"))
        is_list = "list[" in str(field.annotation)
        group.add_argument(
            "--" + name.replace("_", "-"), dest=name, nargs="+" if is_list else None,
            metavar=name.upper(), default=argparse.SUPPRESS,
            help=f"{field.description} (default: {field.default!r})",
        )


def main(argv: Optional[list[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "recipes":
            print("\n".join(recipe_names()))
            return 0
        if ns.command == "prepare-prompts":
            from dmd2_core.prepare.prompts import prepare_prompts, read_prompt_list

            prompt_set = prepare_prompts(ns.hf_checkpoint, read_prompt_list(ns.prompts_file), ns.out,
                                         ns.negative_prompt, ns.max_sequence_length)
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
                                   clip=None if None in geometry else geometry)
            print(json.dumps({"out": ns.out, "samples": len(real), "latents": list(real.latents.shape[1:]),
                              "shapes": {k: list(v.shape) for k, v in real.cond.items()}}))
            return 0
        overrides = {k: v for k, v in vars(ns).items() if k not in ("command", "recipe", "deep", "set_items", "json")}
        overrides.update(parse_set(getattr(ns, "set_items", [])))
        args = load_args(ns.recipe, overrides)
        if ns.command == "plan":
            from dmd2_core.run import preflight_checks
            from dmd2_core.memory import planner
            from dmd2_core.models import describe_model_dir

            if args.hf_checkpoint:  # a clip's geometry becomes its latents, as in preflight
                args = preflight_checks.check_family_args(args, describe_model_dir(args.hf_checkpoint))
            trainers = {cfg.role: compute_trainer_args(args, cfg) for cfg in compute_trainer_configs(args)}
            memory_plan = planner.plan(trainers)
            print(json.dumps(memory_plan.as_dict(), indent=1) if ns.json else planner.table(memory_plan))
            planner.check(memory_plan)
            return 0
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

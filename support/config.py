"""How the scripts read their settings: one dataclass, presets, then flags.

Each script declares a `Config` dataclass whose fields carry their --help text (`option`),
named presets (override sets, printed at start-up), the allowed range of every number
(`cli.Range`) and the choices of every text flag. `read_config` turns that into argparse
flags, applies defaults, then the preset, then the flags given, and checks every value
before anything loads: a bad one exits with status 2 and one line (argparse's way); a bad
$RLHF_DEVICE or $RLHF_KERNELS_BACKEND with status 1 and one line (a cli.UserError).
    --flag-name     one per field (underscores become dashes); bool fields are switches,
                    tuple fields take one value or more (ppo.py's --beta 0 0.1, --seeds 0 1)
    --model, --data-dir, --debug    shared by every script (loaders.add_common_args)
    --preset        "auto" (or none) picks `blog` with CUDA or MPS, else `cpu`
    --model         the Config's default: ppo.py's and reward_model.py's is sft.py's folder,
                    SmolLM2 until it exists
Test: pytest tests/test_cli.py
"""
import argparse
import dataclasses

import loaders
import ppo_kernels
from support import cli


def option(default, help, parse=None):
    """A Config field with its --help text; `parse` reads its value from the command line
    where the field's type does not (cli.number_or_off)."""
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse})


def add_flags(parser, config_class, choices):
    """One flag per field of `config_class` but the shared --model and --data-dir."""
    for f in dataclasses.fields(config_class):
        if f.name in ("model", "data_dir"):
            continue
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type is bool:
            parser.add_argument(flag, action="store_true", help=help)
        elif isinstance(f.default, (list, tuple)):          # one value or more
            parser.add_argument(flag, type=type(f.default[0]), nargs="+", default=None,
                                help=help)
        else:
            parse = f.metadata.get("parse") or {int: int, float: float}.get(f.type, str)
            parser.add_argument(flag, type=parse, default=None, choices=choices.get(f.name),
                                help=help)
    return parser


def read_config(config_class, presets, ranges, choices, argv=None, description=None):
    """Defaults, then the preset's overrides, then the flags given; then every value is
    checked (ranges, choices, --data-dir, --model). Returns (config, parser): a script's
    own checks end with parser.error too."""
    model = next(f.default for f in dataclasses.fields(config_class) if f.name == "model")
    parser = loaders.add_common_args(argparse.ArgumentParser(description=description), model)
    add_flags(parser, config_class, choices)
    args = vars(parser.parse_args(argv))
    args.pop("debug")                                    # read by cli.run_script
    ppo_kernels.check_environment()                      # $RLHF_KERNELS_BACKEND, one line
    preset = args["preset"] or "auto"
    if preset == "auto":
        preset = loaders.default_preset()
    given = {k: v for k, v in args.items() if v is not None and v is not False}
    config = config_class(**{**presets[preset], **given, "preset": preset})
    cli.check_flags(parser, config, ranges)
    loaders.check_common_args(parser, config)
    config.model = loaders.start_model(config.model, preset)    # runs/sft, or SmolLM2
    return config, parser

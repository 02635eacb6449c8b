"""llmscratch.cli: flags made from the config fields, and a refused value named by its flag."""

import argparse
import dataclasses

import pytest
from scripts import SCRIPTS

from llmscratch.cli import HelpFormatter, add_flags, build_config, refuse
from llmscratch.config import ConfigError
from llmscratch.finetuning.config import FinetuneConfig
from llmscratch.finetuning.flags import CHAPTER_5_SCRIPT, train_instruction_model
from llmscratch.training.config import TrainConfig


def parser_with(config, *names: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="script", formatter_class=HelpFormatter)
    add_flags(parser, config, *names)
    return parser


def test_every_field_with_help_makes_a_flag_with_its_default_type_and_choices():
    for config in (TrainConfig(), FinetuneConfig()):
        names = [f.name for f in dataclasses.fields(config) if "help" in f.metadata]
        args = parser_with(config, *names).parse_args([])
        assert {name: getattr(args, name) for name in names} == {name: getattr(config, name) for name in names}
    args = parser_with(TrainConfig(), "max_steps", "lr", "compile", "final_eval_tokens").parse_args(
        ["--max-steps", "7", "--lr", "0.5", "--compile", "--final-eval-tokens", "64"])
    assert (args.max_steps, args.lr, args.compile, args.final_eval_tokens) == (7, 0.5, True, 64)
    with pytest.raises(SystemExit):
        parser_with(FinetuneConfig(), "trainable").parse_args(["--trainable", "some"])  # not one of TRAINABLE


def test_help_shows_a_default_only_where_there_is_one():
    shown = parser_with(TrainConfig(max_steps=9), "max_steps", "compile", "peak_tflops").format_help()
    assert "optimizer steps (default: 9)" in shown
    assert "torch.compile\n" in shown  # a switch: no "(default: False)"
    assert "(default: None)" not in shown


def test_build_config_takes_the_flags_and_what_the_script_worked_out():
    args = parser_with(TrainConfig(), "max_steps", "lr").parse_args(["--max-steps", "5"])
    config = build_config(TrainConfig, args, min_lr=1e-5)
    assert (config.max_steps, config.lr, config.min_lr) == (5, 1e-3, 1e-5)


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--max-steps", "0"], "max_steps", "0"),
    (["--lr", "-1"], "lr", "-1.0"),
    (["--grad-clip", "-0.5"], "grad_clip", "-0.5"),
])
def test_a_refused_value_is_a_parser_error_naming_the_flag(flags, field, value, capsys):
    parser = parser_with(TrainConfig(), "max_steps", "lr", "grad_clip")
    with pytest.raises(ConfigError) as raised:
        build_config(TrainConfig, parser.parse_args(flags))
    said = str(raised.value)
    assert said.startswith(f"{field} ") and said.endswith(f" {value}"), said  # the field and the value given
    with pytest.raises(SystemExit) as exit_info:
        refuse(parser, raised.value)
    # The same message, with the field named by its flag.
    assert exit_info.value.code == 2 and f"error: {flags[0]}{said[len(field):]}\n" in capsys.readouterr().err


def test_configs_name_the_bad_field():
    for config_class, bad, bound in [  # the field, the value it was given, and the bound it broke, if one
        (TrainConfig, {"eval_tokens": 0}, ""),
        (TrainConfig, {"min_lr": 0.1}, "lr=0.001"),
        (TrainConfig, {"peak_tflops": float("inf")}, ""),
        (TrainConfig, {"sample_top_k": 0}, ""),
        (FinetuneConfig, {"trainable": "some"}, "['head', 'last-k', 'all', 'lora']"),
        (FinetuneConfig, {"warmup_fraction": 1.0}, "[0, 1)"),
    ]:
        with pytest.raises(ConfigError) as raised:
            config_class(**bad)
        (field, value), = bad.items()
        said = str(raised.value)
        assert said.startswith(f"{field} ") and said.endswith(f" {value!r}") and bound in said, said
    assert TrainConfig(final_eval_tokens=None, sample_top_k=None).sample_top_k is None  # None where the type allows


def test_chapter_6_trains_its_starting_model_with_the_chapter_5_script_where_it_is(capfd):
    """A chapter-6 script without its starting model trains it with chapter 5's script, found from the package."""
    assert CHAPTER_5_SCRIPT == SCRIPTS["instructions"] and CHAPTER_5_SCRIPT.is_file()
    train_instruction_model(["--help"])  # the script itself runs (here its help); a failure is a ValueError
    assert "--replay" in capfd.readouterr().out

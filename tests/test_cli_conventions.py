"""The command line's conventions: every option documented with its default, one `specc: error:` line
(exit 2, no traceback) for every wrong invocation, found before any bundle or model is loaded."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specc.cli import build_parser, main
from specc.cli.parser import HelpFormatter

REPO = Path(__file__).resolve().parent.parent


def all_parsers(parser: argparse.ArgumentParser | None = None) -> list[argparse.ArgumentParser]:
    """The top-level parser and every (nested) subcommand's."""
    parser = parser or build_parser()
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += all_parsers(sub)
    return found


def documented(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("parser", all_parsers(), ids=lambda p: p.prog)
def test_every_option_has_help_and_shows_its_default(parser):
    formatter = HelpFormatter(parser.prog)
    for action in documented(parser):
        if isinstance(action, argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{parser.prog} {name}: no help text"
        if action.default not in (None, False, argparse.SUPPRESS) and not isinstance(action, argparse._VersionAction):
            shown = formatter._get_help_string(action) % {"default": action.default}
            assert "default" in shown, f"{parser.prog} {name}: default {action.default!r} not shown"
    text = parser.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("parser", all_parsers()[1:], ids=lambda p: p.prog)
def test_every_subcommand_help_exits_0(parser, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(parser.prog.split()[1:] + ["--help"])
    assert exit_.value.code == 0 and "usage: " + parser.prog in capsys.readouterr().out


def test_serve_help_never_shows_the_api_key(monkeypatch, capsys):
    monkeypatch.setenv("SPECC_API_KEY", "s3cret-key")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "s3cret-key" not in capsys.readouterr().out


def test_compile_help_marks_required_fields_and_k_auto(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    out = capsys.readouterr().out
    assert "target.model (required)" in out and "speculation.k (default 'auto') [1..16|auto]" in out
    assert "target.model (default None)" not in out
    assert [line.split()[0] for line in out.splitlines() if "(required)" in line] == ["target.model"]
    assert "target.keep_float (default [])" in out


@pytest.fixture
def no_loading(monkeypatch):
    """Make every way of loading a bundle or model fail the test: the errors must come first."""
    import specc.bench.run
    import specc.bundle
    import specc.models.load
    import specc.runtime.model

    def loaded(*args, **kwargs):
        raise AssertionError("a bundle or model was loaded before the inputs were checked")

    for module, name in ((specc.runtime.model, "load"), (specc.bench.run, "load_bundles"),
                         (specc.bundle, "open_bundle"), (specc.models.load, "load_model")):
        monkeypatch.setattr(module, name, loaded)


@pytest.fixture
def no_llamacpp(monkeypatch):
    import importlib.util

    real, bindings = importlib.util.find_spec, ("llama_cpp", "llama_cpp_py_sync")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in bindings else real(name, *a))


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert sum(line.startswith("specc: error: ") for line in lines) == 1 and lines[-1].startswith("specc: error: "), err
    return lines[-1]


@pytest.fixture
def paths(tmp_path) -> dict[str, Path]:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (tmp_path / "p.txt").write_text("hello\n")
    (tmp_path / "r.yaml").write_text("target: {model: m}\n")
    return {"tmp": tmp_path, "bundle": bundle, "prompts": tmp_path / "p.txt", "recipe": tmp_path / "r.yaml"}


WRONG = [
    (["bench", "{bundle}", "--prompts", "{tmp}/missing.jsonl"], "prompts file {tmp}/missing.jsonl does not exist"),
    (["bench", "{bundle}", "--prompts", "{tmp}"], "prompts file {tmp} is a directory"),
    (["bench", "{bundle}", "--prompts", "{prompts}", "--compare", "llamacpp"], "pip install 'specc[llamacpp]'"),
    (["bench", "{tmp}/nope", "--prompts", "{prompts}"], "bundle {tmp}/nope does not exist"),
    (["bench", "{bundle}", "--prompts", "{prompts}", "--json", "{tmp}"], "a directory"),
    (["bench", "{bundle}", "--prompts", "{prompts}", "--repeats", "0"], "--repeats 0: allowed an integer >= 1"),
    (["bench", "{bundle}", "--prompts", "{prompts}", "--max-batch", "0"], "--max-batch 0: allowed an integer >= 1"),
    (["bench", "{bundle}", "--prompts", "{prompts}", "--compare", "hf", "--max-batch", "2"], "drop --max-batch"),
    (["bench", "{bundle}", "--prompts", "{prompts}", "--tree", "2,x"], "--tree"),
    (["bench", "{bundle}", "--prompts", "{prompts}", "--llamacpp-target", "{tmp}/t.gguf"], "{tmp}/t.gguf does not exist"),
    (["eval", "{bundle}", "--prompts", "{prompts}", "--gguf", "{prompts}"], "pip install 'specc[llamacpp]'"),
    (["eval", "{bundle}", "--text", "{tmp}/missing.txt"], "--text {tmp}/missing.txt does not exist"),
    (["eval", "{bundle}"], "give --text FILE"),
    (["generate", "{bundle}", "--prompts", "{tmp}/missing.jsonl"], "does not exist"),
    (["generate", "{bundle}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: allowed"),
    (["generate", "{tmp}/nope", "--prompt", "x"], "does not exist"),
    (["tune", "{bundle}", "--prompts", "{prompts}", "--recipe", "{tmp}/missing.yaml"], "does not exist"),
    (["tune", "{bundle}", "--prompts", "{prompts}", "--k-max", "0"], "--k-max 0"),
    (["inspect", "{tmp}/nope"], "does not exist"),
    (["inspect", "{prompts}"], "is not a directory"),
    (["triton", "{tmp}/nope", "--repo", "{tmp}/repo"], "does not exist"),
    (["triton", "{bundle}", "--repo", "{prompts}"], "is not a directory"),
    (["serve", "{tmp}/nope"], "does not exist"),
    (["serve", "{bundle}", "--port", "70000"], "--port 70000"),
    (["compile", "{tmp}/missing.yaml"], "recipe {tmp}/missing.yaml does not exist"),
    (["compile", "{tmp}"], "recipe {tmp} is a directory"),
    (["train-head", "{tmp}/missing.yaml", "--kind", "eagle"], "recipe {tmp}/missing.yaml does not exist"),
    (["train-exit-head", "m", "--layer", "1", "--corpus", "{tmp}/none", "-o", "{tmp}/a.safetensors"], "--corpus"),
    (["trt-check", "{tmp}/missing.onnx"], "does not exist"),
]


@pytest.mark.parametrize("args, message", WRONG, ids=lambda v: " ".join(v[:3]) if isinstance(v, list) else None)
def test_wrong_invocations_fail_before_loading(args, message, paths, no_loading, no_llamacpp, capsys):
    args = [a.format(**paths) for a in args]
    assert main(args) == 2
    line = one_error_line(capsys.readouterr().err)
    assert message.format(**paths) in line
    assert "recipe field '<file>'" not in line


@pytest.mark.parametrize("args, message", [
    (["bnch"], "invalid choice 'bnch' (did you mean bench?)"),
    (["models", "lst"], "(did you mean list?)"),
    (["bench", "b", "--jsn", "x"], "unrecognized arguments: --jsn x (did you mean --json?)"),
    (["train-head", "r.yaml", "--kind", "eagle", "--num-promts", "8"], "(did you mean --num-prompts?)"),
    (["generate", "b", "--max-new-tokens", "many"], "invalid int value"),
    (["bench", "b", "--compare", "llama"], "(did you mean llamacpp?)"),
    (["inspect", "--json", "b"], "write it after the positional arguments"),
])
def test_parse_errors_show_the_subcommand_usage_and_a_suggestion(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in one_error_line(err)
    command = " ".join(a for a in args[:2] if a in ("models", "bench", "train-head", "generate", "inspect"))
    assert err.startswith(f"usage: specc {command}".rstrip())


def test_old_spellings_warn_and_still_work(capsys):
    parser = build_parser()
    assert parser.parse_args(["bench", "b", "--batch-size", "4"]).max_batch == 4
    assert parser.parse_args(["triton", "b", "--repo", "r", "--default-max-tokens", "9"]).max_new_tokens == 9
    assert parser.parse_args(["train-head", "r", "--kind", "eagle", "--prompts", "8", "--prompts", "4:self"]).num_prompts \
        == [(8, "grid"), (4, "self")]
    err = capsys.readouterr().err
    for old, new in (("--batch-size", "--max-batch"), ("--default-max-tokens", "--max-new-tokens"),
                     ("--prompts", "--num-prompts")):
        assert f"specc: warning: {old} is deprecated; use {new}" in err
    bench = next(p for p in all_parsers(parser) if p.prog == "specc bench")
    assert "--batch-size" not in bench.format_help()


def test_a_recipe_file_that_cannot_be_read_is_named_as_a_file(tmp_path):
    from specc.errors import RecipeError
    from specc.recipe import load_recipe

    with pytest.raises(RecipeError, match=r"^recipe file: .*missing.yaml does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def test_json_means_stdout_alone_and_a_file_with_a_value():
    parser = build_parser()
    for command in (["generate", "b"], ["bench", "b"], ["eval", "b"], ["tune", "b"], ["inspect", "b"]):
        assert parser.parse_args(command + ["--json"]).json == "-"
        assert parser.parse_args(command + ["--json", "out.json"]).json == "out.json"
        assert parser.parse_args(command).json is None


def test_python_dash_m_specc_and_the_console_script_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "specc", "--version"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and ok.stdout.startswith("specc ")
    bad = subprocess.run([sys.executable, "-m", "specc", "bench", str(tmp_path), "--prompts", str(tmp_path / "x.jsonl")],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "prompts file" in one_error_line(bad.stderr)


@pytest.mark.parametrize("args", [["bench", "{tmp}", "--prompts", "{tmp}/x.jsonl"], ["eval", "{tmp}", "--text",
                                  "{tmp}/none.txt"], ["generate", "{tmp}/nope", "--prompt", "x"], ["bnch"],
                                  ["tune", "{tmp}", "--prompts", "{tmp}/x.jsonl"], ["inspect", "{tmp}/nope"],
                                  ["serve", "{tmp}/nope"], ["triton", "{tmp}/nope", "--repo", "{tmp}/r"],
                                  ["compile", "{tmp}/r.yaml"], ["train-head", "{tmp}/r.yaml", "--kind", "eagle"],
                                  ["train-exit-head", "m", "--layer", "1", "--corpus", "{tmp}/c", "-o", "{tmp}/a"],
                                  ["models", "pull", "nope"], ["trt-check", "{tmp}/m.onnx"]])
def test_wrong_invocations_answer_without_importing_torch(args, tmp_path):
    """The checks run before torch is imported, so the answer comes in a fraction of a second."""
    code = ("import sys\nfrom specc.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    rc = e.code\nassert 'torch' not in sys.modules, 'torch imported'\nsys.exit(rc)")
    argv = [a.format(tmp=tmp_path) for a in args]
    run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2, run.stderr
    one_error_line(run.stderr)


def test_catalog_pins_every_checksum_and_names_every_source():
    import dataclasses

    from specc.models.catalog import CATALOG

    for model in CATALOG.values():
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
        assert "third-party wheel" in model.source and model.upstream in model.source and model.gguf_type in model.source
    any_model = next(iter(CATALOG.values()))
    with pytest.raises(ValueError, match="sha256 must be 64"):
        dataclasses.replace(any_model, sha256=None)

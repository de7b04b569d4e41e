"""The ``mashbox`` command, run as a real process."""

import subprocess
import sys

import pytest

PLANETS = ("mercury", "venus", "earth", "mars", "jupiter", "saturn", "uranus", "neptune")


def mashbox(*args, stdin=""):
    return subprocess.run([sys.executable, "-m", "mashbox", *args], input=stdin, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("command", [["chat"], [], ["smollm2-135m"]])  # chat is the default command
def test_chat_answers_each_line_of_stdin_with_the_embedded_model(command):
    done = mashbox(*command, "--max-tokens", "32", stdin="Name three planets.\n\nThanks!\n")
    assert done.returncode == 0, done.stderr
    assert any(p in done.stdout.lower() for p in PLANETS)
    assert len([line for line in done.stdout.splitlines() if line.strip()]) >= 2


def test_a_word_that_is_no_command_nor_model_is_refused_naming_the_commands():
    done = mashbox("runn")
    assert done.returncode == 2 and "invalid choice: 'runn'" in done.stderr and "'run'" in done.stderr, done.stderr
    missing = mashbox("./no-such-model.gguf")  # a path is chat's model: that it is missing is said as chat says it
    assert missing.returncode == 1 and "no-such-model.gguf" in missing.stderr and "invalid choice" not in missing.stderr


def test_a_command_after_chats_flags_is_refused_as_out_of_place():
    """`mashbox --max-tokens 5 run` was chat with a model named `run` ("Unknown model 'run'")."""
    for command in ("run", "models"):
        done = mashbox("--max-tokens", "5", command)
        said = f"mashbox: {command} comes first: `mashbox {command} ...` (the flags before it are chat's)"
        assert done.returncode == 2 and done.stderr == f"{said} (see mashbox --help)\n", done.stderr


def test_a_model_folder_named_without_a_slash_is_chats_model(tmp_path):
    """`mashbox folder` was refused as no command ("invalid choice"), where `mashbox ./folder` was chat's model."""
    (tmp_path / "folder").mkdir()
    done = subprocess.run([sys.executable, "-m", "mashbox", "folder"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 1 and "is a directory without config.json" in done.stderr, done.stderr


def test_unknown_model_is_one_clear_error():
    done = mashbox("chat", "no-such-model")
    assert done.returncode == 1
    assert "Unknown model 'no-such-model'" in done.stderr and "smollm2-135m" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("flags", "words"), [
    (["--slots", "0"], "mashbox: --slots: must be between 1 and 1024 (got 0)"),
    (["--ctx", "8"], "mashbox: --ctx: must be >= 16 (got 8)"),
    (["--temperature", "9"], "mashbox: --temperature: must be between 0 and 4"),
    (["--max-tokens", "0"], "mashbox: --max-tokens: must be >= 1 (got 0)"),
])
def test_a_bad_chat_setting_is_one_line_and_exit_2_before_loading(flags, words):
    done = mashbox("chat", *flags, stdin="hi\n")
    assert done.returncode == 2 and done.stderr.startswith(words), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


def test_models_lists_the_catalog_with_file_sizes_and_what_is_installed():
    from mashbox.engine.load.catalog import catalog, installed

    done = mashbox("models")
    assert done.returncode == 0 and "smollm2-135m" in done.stdout and "qwen2.5-coder-0.5b" in done.stdout
    smol = next(line for line in done.stdout.splitlines() if line.startswith("smollm2-135m"))
    assert "file  0.10 GB  installed" in smol  # the embedded model always is
    for entry in catalog().values():
        line = next(line for line in done.stdout.splitlines() if line.startswith(entry.id))
        assert line.endswith("installed" if installed(entry) else entry.install)


def test_a_model_is_installed_only_when_every_part_is(monkeypatch):
    from mashbox.engine.load import catalog

    qwen = catalog.catalog()["qwen2.5-coder-0.5b"]
    monkeypatch.setattr(catalog, "package_file", lambda part: None if part == qwen.source.parts[-1] else "x")
    assert not catalog.installed(qwen)
    assert catalog.installed(catalog.catalog()["smollm2-135m"])


def test_every_flag_of_mashbox_run_is_in_the_servers_flags_table():
    """docs/server.md says its table and `mashbox run --help` say the same."""
    from pathlib import Path

    from mashbox.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command")
    flags = {o for a in commands.choices["run"]._actions for o in a.option_strings if o.startswith("--")}
    table = (Path(__file__).parent.parent / "docs" / "server.md").read_text().split("## Flags")[1].split("\n\n")[1]
    assert {f for f in flags if f"`{f}" not in table} == {"--help"}


def test_a_flag_no_command_knows_points_at_that_commands_help():
    out = subprocess.run([sys.executable, "-m", "mashbox", "run", "--bogus"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr == "mashbox run: unrecognized arguments: --bogus (see mashbox run --help)\n"
    out = subprocess.run([sys.executable, "-m", "mashbox", "run", "--slo", "2"], capture_output=True, text=True)
    assert out.returncode == 2 and "unrecognized arguments: --slo" in out.stderr  # a flag is taken only whole


def test_output_nobody_reads_and_input_that_is_closed_are_one_line_at_most():
    import os

    read, write = os.pipe()
    os.close(read)  # `mashbox models | head -1`, its reader gone
    out = subprocess.run([sys.executable, "-m", "mashbox", "models"], stdout=write, stderr=subprocess.PIPE, text=True)
    os.close(write)
    assert out.returncode == 1 and out.stderr == ""
    out = subprocess.run([sys.executable, "-m", "mashbox", "chat"], stdin=None, capture_output=True, text=True,
                         preexec_fn=lambda: os.close(0))
    assert out.returncode == 2 and out.stderr == "mashbox: chat reads its questions from stdin, and there is none (it is closed)\n"


def test_version_is_the_installed_package_s():
    from importlib.metadata import version

    done = mashbox("--version")
    assert done.returncode == 0 and done.stdout == f"mashbox {version('mashbox')}\n"

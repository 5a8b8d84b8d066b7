"""One error taxonomy: user-facing errors are `PorterError`s (exit 2, one line); anything else is an
internal error (exit 3, "please report", traceback with -v); Ctrl-C is 130. Checked through the real CLI."""

import pytest
import torch
from click.testing import CliRunner

import porter.commands.convert
import porter.commands.verify
from porter.cli import main
from porter.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    BackendUnavailable,
    ConfigError,
    ConvertError,
    InspectError,
    LayoutError,
    LoadError,
    MalformedSafetensors,
    ManifestError,
    MoeNumericsError,
    MXFP8Error,
    PlacementError,
    PorterError,
    PrequantizedError,
    ProduceError,
    SourceError,
    VerifyInputError,
)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize(
    "cls",
    [
        ConfigError,
        LayoutError,
        ConvertError,
        MXFP8Error,
        SourceError,
        ManifestError,
        LoadError,
        VerifyInputError,
        BackendUnavailable,
        InspectError,
        PrequantizedError,
        ProduceError,
        MalformedSafetensors,
        PlacementError,
        MoeNumericsError,
    ],
)
def test_user_facing_errors_are_porter_errors(cls):
    assert issubclass(cls, PorterError) and cls.exit_code == EXIT_BAD_INPUT == 2


def test_verify_command_is_registered():
    assert {"convert", "verify"} <= set(main.commands)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    res = invoke("convert", missing, "--output", tmp_path / "o")
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("porter: error: ") and str(missing) in lines[0]
    assert "Traceback" not in res.output and not (tmp_path / "o").exists()


def test_verify_bad_input_exit_2(tmp_path):
    res = invoke("verify", tmp_path / "nothing-here")
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        f"porter: error: {tmp_path / 'nothing-here'}: no such directory"
    ]


def test_bare_valueerror_is_internal_not_bad_input(tmp_path, monkeypatch):
    """A ValueError from a bug must not pass for bad input (exit 2): it is an internal error, exit 3."""

    def boom(*a, **k):
        raise ValueError("a bug\nspanning lines")

    monkeypatch.setattr(porter.commands.convert, "convert", boom)
    res = invoke("convert", tmp_path, "--output", tmp_path / "o")
    assert res.exit_code == EXIT_INTERNAL == 3
    assert res.output.strip().splitlines() == [
        "porter: internal error: ValueError: a bug spanning lines (please report; -v shows the traceback)"
    ]


def test_internal_error_with_v_shows_traceback_and_keeps_exit_3(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(porter.commands.convert, "convert", boom)
    res = invoke("-v", "convert", tmp_path, "--output", tmp_path / "o")
    assert res.exit_code == 3
    assert "Traceback (most recent call last)" in res.output and "in boom" in res.output
    assert res.output.rstrip().endswith("(please report; -v shows the traceback)")


def test_porter_error_with_v_shows_traceback_and_keeps_exit_2(tmp_path, monkeypatch):
    def bad(*a, **k):
        raise SourceError("x/config.json: field 'hidden_size' must be positive; fix the config")

    monkeypatch.setattr(porter.commands.convert, "convert", bad)
    res = invoke("-v", "convert", tmp_path, "--output", tmp_path / "o")
    assert res.exit_code == 2 and "Traceback" in res.output
    assert res.output.rstrip().endswith(
        "porter: error: x/config.json: field 'hidden_size' must be positive; fix the config"
    )


def test_verify_internal_error_exit_3(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyError("layers.0")

    monkeypatch.setattr(porter.commands.verify, "verify", boom)
    res = invoke("verify", tmp_path)
    assert res.exit_code == 3 and "internal error: KeyError" in res.output


def test_interrupt_exit_130(tmp_path, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(porter.commands.convert, "convert", interrupted)
    res = invoke("convert", tmp_path, "--output", tmp_path / "o")
    assert res.exit_code == 130 and res.output.strip() == "porter: interrupted"  # nothing written to resume


def test_convert_device_errors_are_bad_input(tiny_vendor, tmp_path, monkeypatch):
    """--device cuda without a GPU, or an unknown device through the Python API: exit 2 / PorterError with
    one line, and no output folder left behind."""
    import porter
    from porter.errors import PorterError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(
        main, ["convert", str(tiny_vendor), "--output", str(tmp_path / "o"), "--device", "cuda"]
    )
    assert res.exit_code == 2, res.output
    assert "no CUDA GPU" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()
    with pytest.raises(PorterError, match="auto .*, cpu, cuda or cuda:N"):
        porter.convert(tiny_vendor, tmp_path / "o2", device="tpu", progress=False)


def test_device_has_one_rule_in_convert_and_runtime(tiny_vendor, tmp_path, monkeypatch):
    """`--device` is checked by porter.devices.resolve_device everywhere: cuda:N is a device in convert as
    in runtime.load, and an index past the machine's GPUs is refused by both with the same line."""
    import porter
    import runtime
    from porter.errors import DeviceError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    messages = []
    for call in (
        lambda: porter.convert(tiny_vendor, tmp_path / "o", device="cuda:2", progress=False),
        lambda: runtime.load(tiny_vendor, device="cuda:2"),
    ):
        with pytest.raises(DeviceError) as e:
            call()
        messages.append(str(e.value))
    assert messages[0] == messages[1] == "device 'cuda:2': this machine has 2 CUDA device(s), cuda:0..cuda:1"
    assert not (tmp_path / "o").exists()


def test_every_user_facing_error_class_is_defined_in_porter_errors():
    """One taxonomy: no module but porter/errors.py defines a PorterError subclass (each module imports
    the ones it raises from there)."""
    import ast
    import inspect
    from pathlib import Path

    import porter.errors as errors

    taxonomy = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, PorterError)}
    assert {"ConfigError", "LayoutError", "ConvertError", "LoadError", "PlacementError"} <= taxonomy
    root = Path(__file__).resolve().parents[1]
    bad = []
    for path in (p for d in ("porter", "converters", "runtime") for p in (root / d).rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "porter":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                getattr(b, "id", getattr(b, "attr", None)) in taxonomy for b in node.bases
            ):
                bad.append(
                    f"{path.relative_to(root)}:{node.lineno}: class {node.name} belongs in porter/errors.py"
                )
    assert not bad, "\n".join(bad)

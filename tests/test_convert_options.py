"""`ConvertOptions`: the one typed object of `porter convert`'s options (the CLI's flags are made from it, the
journal records it, porter.json's options are read back with their defaults in one place)."""

import json
import shlex
from dataclasses import fields

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import converters
import porter
from porter.cli import convert as convert_command
from porter.cli import main as cli
from porter.commands.convert import ConvertOptions
from porter.commands.convert.options import RECORDED, flag, parse_size
from porter.errors import ConvertError, ManifestError
from porter.format import journal, manifest


def test_cli_flags_are_the_fields():
    """Every field with CLI metadata is one flag of `porter convert`, named after it, with its default."""
    params = {p.name: p for p in convert_command.params}
    for f in fields(ConvertOptions):
        if "cli" not in f.metadata:
            continue
        p = params[f.name]
        assert p.opts == [flag(f.name)] and p.default == f.default, f.name
        assert p.help == f.metadata["cli"]["help"]
    made = {f.name for f in fields(ConvertOptions) if "cli" in f.metadata}
    hub = {"token", "cache_dir"}  # the Hub options every command shares
    assert set(params) == made | hub | {"output", "source", "verbose", "quiet"}
    help_text = CliRunner().invoke(cli, ["convert", "--help"]).output
    assert all(flag(n) in help_text for n in made | hub)


def test_defaults_are_the_artifacts():
    """The options as given default to what porter.json's options default to (manifest.Options)."""
    default = ConvertOptions()
    assert default.artifact_options({"porter": "experts"}, None) == manifest.Options()
    assert parse_size(default.max_shard_size) == manifest.Options().max_shard_size


def test_porter_json_options_read_with_defaults_in_one_place():
    assert manifest.read_options({}) == manifest.Options()
    assert manifest.read_options({"options": {"layout": "hf"}}).layout == "hf"
    older = {"options": {"quantize": "all", "scale_rounding": "floor"}}  # written before gate_up was recorded
    got = manifest.read_options(older)
    assert (got.quantize, got.scale_rounding, got.gate_up, got.layout) == ("all", "floor", "auto", "porter")
    for bad in ({"options": []}, {"options": {"max_shard_size": "5GB"}}, {"options": {"quantize": 1}}):
        with pytest.raises(ManifestError, match="porter.json: "):
            manifest.read_options(bad)


def test_conversion_resolves_its_converter_once_and_records_its_options(tiny_vendor, tmp_path, monkeypatch):
    calls = []
    real = converters.for_config
    monkeypatch.setattr(converters, "for_config", lambda *a, **k: calls.append(1) or real(*a, **k))
    porter.convert(tiny_vendor, tmp_path / "out", scale_rounding="floor", progress=False, workers=1)
    assert len(calls) == 1
    man = manifest.read(tmp_path / "out")
    assert manifest.read_options(man) == manifest.Options(scale_rounding="floor")


@pytest.mark.parametrize(
    "given, want",
    [
        ({"colour": "red"}, "unknown option 'colour'"),
        ({"scale_rounding": "up"}, "--scale-rounding 'up': give one of rceil, floor"),
        ({"layout": "gguf"}, "--layout 'gguf': give one of porter, hf"),
        ({"digest": "md5"}, "--digest 'md5': give one of "),
        ({"workers": 0}, "--workers 0: give a positive number"),
        ({"max_shard_size": "0"}, "--max-shard-size '0'"),
        ({"max_memory": "lots"}, "--max-memory 'lots'"),
    ],
)
def test_python_api_checks_like_the_cli(tiny_vendor, tmp_path, given, want):
    with pytest.raises(ConvertError, match=want.replace("(", r"\(").replace(")", r"\)")):
        porter.convert(tiny_vendor, tmp_path / "o", progress=False, **given)
    assert not (tmp_path / "o").exists()


words = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12)


@settings(max_examples=50, deadline=None)
@given(
    source=words,
    output=words,
    size=st.sampled_from(["50MB", "300KB", "5GB", 123456]),
    rounding=st.sampled_from(["rceil", "floor"]),
    cache=st.one_of(st.none(), words),
)
def test_resume_command_round_trips_through_the_shell(source, output, size, rounding, cache):
    """The printed command is POSIX-shell quoted: split back, it is the argv that was recorded, whatever
    the paths hold (spaces, quotes, $, ;), and it carries exactly the options that are not defaults."""
    opts = ConvertOptions(max_shard_size=size, scale_rounding=rounding, cache_dir=cache, token="secret")
    argv = opts.command(source, output)
    rec = {"command": argv}
    text = journal.resume_command(rec)
    assert shlex.split(text) == argv and "secret" not in text
    assert argv[:5] == ["porter", "convert", source, "--output", output] and argv[-1] == "--resume"
    again = ConvertOptions.from_record(json.loads(json.dumps(opts.record())))
    assert again.command(source, output) == argv  # from the journal's record, the same command
    assert set(opts.record()) == set(RECORDED)
    shown = set(argv[5:-1:2])  # flag, value, flag, value ... between the output and --resume
    assert shown == {
        flag(n) for n in RECORDED if getattr(opts, n) not in (None, getattr(ConvertOptions(), n))
    }

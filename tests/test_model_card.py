"""The source's model card and license travel into the artifact: LICENSE* byte for byte, README.md as the
source's text followed by porter's section (porter.format.model_card)."""

import json
import shutil

import pytest

import porter
from porter.format.model_card import SECTION_TITLE
from porter.version import __version__

CARD = "---\nlicense: other\nlicense_name: tiny\n---\n# Tiny\n\nNo trailing newline, üñíçødé."
LICENSE = b"Tiny license\r\nwith CRLF line ends and a \xe2\x80\x94 dash\r\n"


@pytest.fixture()
def source(tiny_vendor, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_vendor, src)
    (src / "README.md").write_text(CARD, encoding="utf-8")
    (src / "LICENSE").write_bytes(LICENSE)
    (src / "LICENSE-MODEL.txt").write_bytes(LICENSE[::-1])
    return src


def test_card_and_licenses_carried(source, tmp_path):
    out = tmp_path / "out"
    porter.convert(source, out, progress=False, workers=1, device="cpu")
    assert (out / "LICENSE").read_bytes() == LICENSE
    assert (out / "LICENSE-MODEL.txt").read_bytes() == LICENSE[::-1]
    card = (out / "README.md").read_text(encoding="utf-8")
    assert card.startswith(CARD + "\n\n" + SECTION_TITLE + "\n")  # the original first, front matter intact
    section = card[len(CARD) :]
    assert f"porter {__version__}" in section and "local checkpoint `src`" in section
    assert "quantization scope `experts`" in section and "rceil" in section and "layout `porter`" in section
    assert "`porter.json`" in section and "porter verify" in section
    assert section.count(SECTION_TITLE) == 1


def test_card_written_without_a_source_card(tiny_vendor, tmp_path):
    out = tmp_path / "out"
    porter.convert(tiny_vendor, out, progress=False, workers=1, device="cpu", quantize="none")
    card = (out / "README.md").read_text()
    assert card.startswith(f"# {tiny_vendor.name} (MXFP8)\n\n{SECTION_TITLE}\n")
    assert "quantization scope `none`: no tensor" in card
    assert not list(out.glob("LICENSE*"))


def test_force_replaces_the_card_it_wrote(source, tmp_path):
    out = tmp_path / "out"
    porter.convert(source, out, progress=False, workers=1, device="cpu")
    (source / "LICENSE-MODEL.txt").unlink()
    (source / "README.md").write_text("# Tiny v2\n")
    porter.convert(source, out, progress=False, workers=1, device="cpu", force=True)
    assert (out / "README.md").read_text().startswith("# Tiny v2\n\n" + SECTION_TITLE)
    assert not (out / "LICENSE-MODEL.txt").exists()  # porter's own earlier copy, cleared by --force
    assert json.loads((out / "porter.json").read_text())["source"]["path"] == str(source)

"""The report as a reader gets it: the HTML in headless Chromium, the PDF through poppler.

Fails on images that do not load, fonts that are not embedded or that lack
ő, ű, ã, ç, and tables that run over the page. Chromium and poppler-utils
come from Debian's packages (`make system-deps`, part of `make test`).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from test_aggregate_verdict import demo_grid, run_aggregate  # noqa: F401 - the fixture is reused

from servegrid.paths import RunTables

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

PROBE = """
<script>
window.addEventListener("load", async () => {
  await document.fonts.ready;
  const images = [...document.images].map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0}));
  const tables = [...document.querySelectorAll("table")]
    .filter(t => t.scrollWidth > t.parentElement.clientWidth + 1)
    .map(t => t.className + ": " + t.scrollWidth + " > " + t.parentElement.clientWidth);
  const out = document.createElement("pre");
  out.id = "servegrid-probe";
  out.textContent = JSON.stringify({
    images, overflowing: tables,
    page_wider_than_window: document.documentElement.scrollWidth > window.innerWidth,
  });
  document.body.appendChild(out);
});
</script>
"""


def need(tool: str | None, name: str) -> str:
    if tool is None:
        pytest.fail(f"{name} is not installed: run `make system-deps` (part of `make test`)")
    return tool


@pytest.mark.parametrize("lang", ["pt", "hu"])
def test_html_in_headless_chromium(rendered, tmp_path, lang):
    chromium = need(CHROMIUM, "chromium")
    html = rendered[1][lang][0]
    page = tmp_path / f"probe-{lang}.html"
    page.write_text(html.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'chrome'}",
            "--window-size=1280,900",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    probe = json.loads(re.search(r'<pre id="servegrid-probe">(.*?)</pre>', dom, re.S)[1].replace("&quot;", '"'))
    assert len(probe["images"]) == 9
    assert all(image["ok"] for image in probe["images"]), probe["images"]
    assert probe["overflowing"] == []
    assert not probe["page_wider_than_window"]


@pytest.mark.parametrize("lang", ["pt", "hu"])
def test_pdf_through_poppler(rendered, tmp_path, lang):
    pdf = Path(rendered[1][lang][1])
    fonts = subprocess.run(
        [need(shutil.which("pdffonts"), "pdffonts"), str(pdf)], capture_output=True, text=True, check=True
    ).stdout.splitlines()[2:]
    assert fonts and all(line.split()[-5] == "yes" for line in fonts), fonts  # every font embedded
    assert any("Report-Sans" in line for line in fonts)  # the DejaVu Sans shipped with matplotlib
    text = subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True, check=True).stdout
    accented = {"pt": "ãçõéê", "hu": "őöéáú"}[lang]
    assert all(ch in text for ch in accented), [ch for ch in accented if ch not in text]
    problems = page_problems(pdf, tmp_path)
    assert not problems, problems


def page_problems(pdf: Path, tmp_path: Path) -> list[str]:
    """What a reader of the printed report would see wrong: something in the right margin, a blank page, or
    a page (but the last) that ends before 55% of its text area (a half-empty page, with a margin)."""
    pdftoppm = need(shutil.which("pdftoppm"), "pdftoppm (poppler-utils)")
    subprocess.run([pdftoppm, "-r", "40", "-png", str(pdf), str(tmp_path / "page")], check=True, timeout=120)
    pages = sorted(tmp_path.glob("page-*.png"))
    assert len(pages) >= 5
    problems = []
    for number, page in enumerate(pages, 1):
        image = Image.open(page).convert("L")
        width, height = image.size
        margin = int(width * 12 / 210)  # the right margin is 14 mm of 210: 12 mm must stay blank
        if image.crop((width - margin, 0, width, height)).getextrema()[0] <= 235:
            problems.append(f"{page.name}: something runs into the right margin")
        if image.getextrema()[0] >= 100:
            problems.append(f"{page.name}: blank page")
        if number < len(pages) and filled_share(image) < 0.55:  # the last page ends where the document ends
            problems.append(f"{page.name}: only {filled_share(image):.0%} of the page is used")
    return problems


def filled_share(page: Image.Image) -> float:
    """How far down the page's text area (A4 less the 16 mm top and 18 mm bottom margins) something is
    printed: 1.0 for a full page, 0.5 for one that ends half-way."""
    width, height = page.size
    area = page.crop((0, round(height * 16 / 297), width, round(height * (297 - 18) / 297)))
    inked = [y for y in range(area.height) if area.crop((0, y, width, y + 1)).getextrema()[0] < 200]
    return (inked[-1] + 1) / area.height if inked else 0.0


def test_weasyprint_loads_every_resource(demo_grid, tmp_path, caplog):  # noqa: F811
    from servegrid.reporting import document, figures

    experiment, cells = demo_grid
    run_aggregate(experiment, cells, tmp_path)
    figures_dir = tmp_path / "figures"
    tables = RunTables.under(tmp_path)
    figures.draw_all(experiment, tables, figures_dir, "pt")
    with caplog.at_level(logging.WARNING, logger="weasyprint"):
        document.render(experiment, "pt", tables, figures_dir, str(tmp_path / "r.html"), str(tmp_path / "r.pdf"))
    problems = [r.getMessage() for r in caplog.records if r.name.startswith("weasyprint")]
    assert not problems, problems


def test_the_report_font_has_every_letter_both_languages_need():
    import matplotlib
    from fontTools.ttLib import TTFont

    for name in ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf"):
        font = TTFont(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / name)
        cmap = font.getBestCmap()
        assert all(ord(ch) in cmap for ch in "őŐűŰãÃçÇõáéíóúâêôàüö–×’“”„"), name


def test_the_production_section_prices_a_million_tokens_in_both_languages(rendered):
    """Issue 43: the demo's cost: section (an hour of the host) prices each configuration's tokens at the load it
    sustains within the objectives, in each language's own currency format."""
    _, out = rendered
    pt, hu = out["pt"][0], out["hu"][0]
    assert re.search(r"US\$\s0,\d+ por milhão de tokens", pt), "no price in the Portuguese report"
    assert re.search(r"0,\d+\sUSD millió tokenenként", hu), "no price in the Hungarian report"
    assert re.search(r"US\$\s0,08 por hora de dispositivo", pt) and re.search(r"eszközóránként 0,08\sUSD", hu)
    # And what the run took, in device hours and their price.
    assert "O que a execução custou" in pt and "Mibe került a futtatás" in hu


@pytest.mark.parametrize("lang", ["pt", "hu"])
def test_a_first_pass_at_its_least_samples_is_not_marked_imprecise_under_the_verdict_policy(lang):
    """≈ marks a cell that stopped at a ceiling before its precision target. Under sampling.policy: verdict a first
    pass stops at its least number of samples by design: only its time limit marks it."""
    from types import SimpleNamespace

    from servegrid.reporting.document import environment

    env, _, _ = environment(lang)
    cell = '{% from "macros.html.j2" import precision with context %}{{ precision(c) }}'
    template = env.from_string(cell)

    def marked(reason: str, top_up_rounds: int | None) -> bool:
        c = SimpleNamespace(primary_rel_ci=0.08, sampling_reason=reason)
        data = SimpleNamespace(experiment=SimpleNamespace(top_up_rounds=top_up_rounds))
        return "≈" in template.render(c=c, data=data)

    assert marked("max_samples", None) and marked("max_duration", None)  # precision policy: both ceilings
    assert not marked("max_samples", 2) and marked("max_duration", 2)
    assert not marked("precise", None) and not marked("precise", 2)

"""The bilingual report rendered from fixed cell files: content, locale formats, catalogues."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from babel.messages.extract import extract_from_dir, extract_python
from babel.messages.pofile import read_po
from babel.numbers import format_percent
from test_aggregate_verdict import demo_grid, run_aggregate  # noqa: F401 - the fixture is reused

from helpers import with_changes
from servegrid import languages, modes
from servegrid.config import Experiment
from servegrid.errors import ConfigError, ReportError
from servegrid.languages import LOCALES
from servegrid.paths import RunTables
from servegrid.reporting import catalogues, document, figure_files, figures, rate_figures, run_figures, trace_figures
from servegrid.reporting.contents import verdict as verdict_contents
from servegrid.reporting.document import TEMPLATES


def test_both_languages_render_with_their_own_words_and_number_formats(rendered):
    _, out = rendered
    pt, hu = out["pt"][0], out["hu"][0]
    assert '<html lang="pt-BR">' in pt and '<html lang="hu-HU">' in hu
    assert "Veredito" in pt and "Verdikt" in hu
    assert "Multi-turn: sessões concorrentes, contexto crescente" in pt
    assert "Multi-turn: párhuzamos session-ök, növekvő kontextus" in hu
    # decimal comma and the locale's thousands separator
    assert "262.144 tokens" in pt
    assert "262\u00a0144 token" in hu
    assert re.search(r"especulação ngram \(3 tokens\), sem prefix caching, 2,5×", pt)  # the label in Portuguese
    assert "ngram spekuláció (3 token), prefix caching nélkül" in hu and "especulação" not in hu
    assert re.search(r"\d+,\d×", hu)
    assert not re.search(r"\d\.\d×", pt + hu)  # never a decimal point in a ratio


def test_verdict_names_each_workload_class_and_every_group(rendered):
    _, out = rendered
    pt, hu = out["pt"][0], out["hu"][0]
    for html in (pt, hu):
        # What was found comes first: the conclusion, the verdict, the production table; the set-up after.
        order = [
            html.index(f'<section id="{name}"')
            for name in ("conclusion", "verdict", "production", "setup", "decode", "across-the-grid", "details")
        ]
        assert order == sorted(order)
        verdict = html.split('id="verdict"')[1].split("</section>")[0]
        classes = verdict.split("<table")[1]
        assert classes.count("<tr>") == 1 + 3  # header + decode, single-turn, multi-turn (no KV corner here)
        details = html.split('id="details"')[1].split("</section>")[0]
        groups = details.split('class="grid groups"')[1].split("</table>")[0]
        assert groups.count("<tr>") == 1 + 6  # header + 3 modes x 2 concurrencies
    assert "Decode pesado, gerações longas, prompts frios" in pt
    assert re.search(r"especulação ngram \(3 tokens\), sem prefix caching \(2,5× decode", pt)
    # No lead changes in this grid: each mode's pair is a row of the table of steady leads, none a sentence.
    for html in (pt, hu):
        lead = html.split('id="verdict"')[1].split("</section>")[0]
        assert len(steady_rows(lead)) == 3 and changes(lead) == []
    assert "Konverzációs, multi-turn munkaterhelésnél" in hu  # the conclusion, generated from the verdict
    # The production table: decode within TPOT p90 ≤ 4 ms.
    production_pt = pt.split('id="production"')[1].split("</section>")[0]
    production_hu = hu.split('id="production"')[1].split("</section>")[0]
    assert "<h3>Decode, prompts frios: TPOT p90 ≤ 4 ms</h3>" in production_pt
    assert "sessões sustentadas: 4" in production_pt and "em nenhum ponto" in production_pt
    assert "fenntartott session: 4" in production_hu and "sehol" in production_hu
    # Per cell, the share of requests within the objectives: ngram's 2 ms per token meets TPOT p90 ≤ 4 ms in
    # every request, prefix caching's 5 ms in none (each language writes its percent as CLDR, through Babel, does).
    attainment = production_pt.split('class="grid attainment"')[1].split("</table>")[0]
    assert attainment.count("<tr>") == 1 + 2 and attainment.count(">100%<") == 2 and attainment.count(">0%<") == 2
    hundred_hu = format_percent(1, locale="hu")
    assert production_hu.split('class="grid attainment"')[1].count(f">{hundred_hu}<") == 2
    # ngram meets TPOT p90 ≤ 4 ms at both concurrencies of the one decode context: the conclusion says so.
    assert re.search(
        r"“especulação ngram \(3 tokens\), sem prefix caching” sustenta o maior número de sessões "
        r"concorrentes em 1 de 1 contextos",
        pt,
    )
    assert re.search(r"akár \d+,\d× TTFT|\d+,\d–\d+,\d× TTFT|\d+,\d× TTFT", hu)


def steady_rows(verdict: str) -> list[str]:
    """The rows of the verdict's table of pairs whose lead never changes (none without the table)."""
    if 'class="grid steady-lead"' not in verdict:
        return []
    body = verdict.split('class="grid steady-lead"')[1].split("</table>")[0].split("<tbody>")[1]
    return re.findall(r"<tr>(.*?)</tr>", body, re.S)


def changes(verdict: str) -> list[str]:
    """The verdict's sentences on a pair whose lead changes."""
    return re.findall(r'<li class="crossover">(.*?)</li>', verdict, re.S)


# Per language: the label of the configuration ahead throughout, the mode titles as the table names them, and the
# words of a sentence on a lead that changes and of the old sentence on one that does not.
LEAD_WORDS = {
    "pt": {
        "prefix_cache": "prefix caching, sem especulação",
        "decode": "Decode, prompts frios",
        "single_turn": "Single-turn, prefixo compartilhado",
        "multi_turn": "Multi-turn, TTFT do turno 2",
        "overtakes": "passa à frente de",
        "steady": "fica à frente de",
    },
    "hu": {
        "prefix_cache": "prefix caching, spekuláció nélkül",
        "decode": "Decode, hideg promptok",
        "single_turn": "Single-turn, közös prefix",
        "multi_turn": "Multi-turn, 2. fordulós TTFT",
        "overtakes": "előzi meg",
        "steady": "ahol bármelyikük egyértelműen jobb",
    },
}


@pytest.mark.parametrize("lang", ["pt", "hu"])
def test_a_steady_lead_is_a_table_row_and_a_change_is_a_sentence(demo_grid, tmp_path, lang):  # noqa: F811
    """The demo grid with ngram decoding slower than prefix caching at 4 sessions: in decode the lead changes
    (prefix caching overtakes ngram there), a sentence; in single- and multi-turn prefix caching leads throughout,
    one row each of the table of steady leads, and no sentence says so."""
    from helpers import synthetic_cell
    from servegrid.reporting.contents import ReportContents

    experiment, cells = demo_grid
    for cell in experiment.cells():
        if (cell.configuration, cell.mode, cell.sessions) == ("ngram", "decode", 4):
            synthetic_cell(
                tmp_path / cell.path,
                "ngram",
                "decode",
                cell.context,
                4,
                requests=30,
                ttft_s=0.1,
                interval_s=0.02,
                tokens_per_chunk=4,
            )
    tables = run_aggregate(experiment, cells, tmp_path)
    found = dict(zip(tables["crossovers"]["mode"], tables["crossovers"]["found"], strict=True))
    assert found == {"decode": True, "single_turn": False, "multi_turn": False}
    data = ReportContents(
        experiment,
        tables["summary"],
        tables["comparisons"],
        tables["servers"],
        verdict=tables["verdict"],
        crossovers=tables["crossovers"],
        production=tables["production"],
    )
    html = document.render_html(
        experiment, lang, data, tmp_path / "no-figures", "screen", document.provenance(experiment)
    )
    verdict = html.split('id="verdict"')[1].split("</section>")[0]
    words = LEAD_WORDS[lang]
    (sentence,) = changes(verdict)
    assert words["decode"] in sentence and words["overtakes"] in sentence
    rows = steady_rows(verdict)
    assert [words["single_turn"] in rows[0], words["multi_turn"] in rows[1]] == [True, True] and len(rows) == 2
    assert all(words["prefix_cache"] in row for row in rows)
    assert words["steady"] not in verdict


def test_html_is_self_contained_with_every_figure(rendered):
    experiment, out = rendered
    expected = len(figure_files.figure_specs(experiment))
    assert expected == 9  # decode 2, single-turn 2, multi-turn 2, the heatmap, the CDFs, goodput (objectives set)
    for html, _pdf in out.values():
        assert html.count('src="data:image/png;base64,') == expected
        assert not re.search(r'(src|href)="(https?:)?//', html)
        assert "@font-face" not in html  # the screen version uses installed fonts only


def test_pdf_is_written(rendered):
    _, out = rendered
    for _html, pdf in out.values():
        data = Path(pdf).read_bytes()
        assert data.startswith(b"%PDF") and len(data) > 10_000


def test_catalogues_translate_every_template_message():
    extracted = {
        message[2] if isinstance(message[2], str) else message[2][0]
        for message in extract_from_dir(
            str(TEMPLATES), method_map=[("**.j2", "jinja2")], options_map={"**.j2": {"extensions": "jinja2.ext.i18n"}}
        )
    }
    # Words in Python: the figures' own, and every mode's and run figure's (marked N_), as report/babel.cfg says.
    sources = [
        Path(m.__file__) for m in (figures, run_figures, rate_figures, trace_figures, figure_files, verdict_contents)
    ]
    sources += sorted(Path(modes.__file__).parent.glob("*.py"))
    for path in sources:
        with path.open("rb") as source:
            extracted |= {
                m[2] for m in extract_python(source, keywords={"_": None, "N_": None}, comment_tags=(), options={})
            }
    extracted.discard(None)  # _(variable): translated where the variable's message is marked
    assert len(extracted) > 40
    for lang in languages.available_languages():
        with (LOCALES / lang / "LC_MESSAGES" / "messages.po").open("rb") as handle:
            catalog = read_po(handle)
        translated = {m.id: m.string for m in catalog if m.id}
        missing = sorted(extracted - {k for k, v in translated.items() if v})
        stale = sorted(set(translated) - extracted)
        assert not missing, f"{lang}: untranslated: {missing}"
        assert not stale, f"{lang}: no longer in the templates: {stale}"
        assert not any(m.fuzzy for m in catalog if m.id)


def test_languages_come_from_catalogues():
    assert languages.available_languages() == ["hu", "pt"]
    with pytest.raises(ConfigError, match="no catalogue for language 'de'"):
        catalogues.load_catalog("de")


def with_a_kv_limited_corner(experiment, cells, tmp_path):  # type: ignore[no-untyped-def]
    """The demo grid's tables with both configurations' multi-turn cells at 4 sessions past the KV capacity
    (preemptions)."""
    from helpers import synthetic_cell

    for cell in experiment.cells():
        if cell.mode == "multi_turn" and cell.sessions == 4:
            synthetic_cell(
                tmp_path / cell.path,
                cell.configuration,
                "multi_turn",
                cell.context,
                4,
                ttft_s=0.2,
                interval_s=0.005,
                turns=3,
                hit_rate=0.7 if cell.configuration == "prefix_cache" else 0.0,
                preemptions=3,
            )
    return run_aggregate(experiment, cells, tmp_path)


def test_a_corner_past_the_kv_pool_is_neither_with_its_pool_and_live_tokens(demo_grid, tmp_path):  # noqa: F811
    """Both configurations' multi-turn cells at 4 sessions ran into the KV capacity (preemptions): the verdict's
    KV row says neither, with the servers' pool and the most tokens those cells held at once (the seed's third
    row and its explanation)."""
    from servegrid.reporting.contents import ReportContents

    experiment, cells = demo_grid
    tables = with_a_kv_limited_corner(experiment, cells, tmp_path)
    (kv_row,) = tables["verdict"][tables["verdict"]["outcome"] == "kv_limit"].to_dict("records")
    assert (kv_row["min_context"], kv_row["min_concurrency"]) == (1024, 4)
    data = ReportContents(
        experiment,
        tables["summary"],
        tables["comparisons"],
        tables["servers"],
        verdict=tables["verdict"],
        crossovers=tables["crossovers"],
        production=tables["production"],
    )
    html = document.render_html(
        experiment, "pt", data, tmp_path / "no-figures", "screen", document.provenance(experiment)
    )
    verdict = html.split('id="verdict"')[1].split("</section>")[0]
    asked = tables["summary"].query("kv_limited")["peak_tokens_asked"].max()
    assert asked == 4 * (1024 + 32)  # sessions × the longest request (the synthetic cells' prompt and output)
    assert "Nenhum — limite de KV" in verdict
    assert "um pool de KV cache de 262.144 tokens, contra até 4.224 tokens vivos ao mesmo tempo" in verdict
    conclusion = html.split('id="conclusion"')[1].split("</section>")[0]
    assert "A partir de 1.024 tokens com 4 sessões concorrentes" in conclusion


def test_a_large_grids_pdf_lists_only_the_cells_that_need_a_look(demo_grid, tmp_path, monkeypatch):  # noqa: F811
    """Over PRINT_EVERY_CELL_UP_TO cells the printed details keep the cells that need a look (here the
    KV-limited corner) and say where the rest are; the HTML's details keep every cell."""
    from servegrid.reporting.contents import ReportContents, details

    experiment, cells = demo_grid
    tables = with_a_kv_limited_corner(experiment, cells, tmp_path)
    summary = tables["summary"]
    flagged = set(summary.loc[summary["kv_limited"], "cell_id"])
    assert flagged and len(flagged) < len(summary)
    monkeypatch.setattr(details, "PRINT_EVERY_CELL_UP_TO", len(summary) - 1)

    def details(medium: str) -> str:
        data = ReportContents(
            experiment,
            summary,
            tables["comparisons"],
            tables["servers"],
            verdict=tables["verdict"],
            crossovers=tables["crossovers"],
            production=tables["production"],
        )
        html = document.render_html(
            experiment, "pt", data, tmp_path / "no-figures", medium, document.provenance(experiment)
        )
        return html.split('id="details"')[1].split("</section>")[0]

    def listed(section: str) -> set[str]:
        gates = section.split('class="grid gates"')[1]
        return {code.replace("<wbr>", "") for code in re.findall(r"<td><code>(.*?)</code></td>", gates)}

    printed, screen = details("print"), details("screen")
    assert listed(printed) == flagged
    assert f"Este grid tem {len(summary)} células" in printed and f"só as {len(flagged)} que pedem atenção" in printed
    assert 'class="grid groups"' not in printed  # every compared group: in the HTML only
    assert listed(screen) == set(summary["cell_id"])
    assert "Este grid tem" not in screen and 'class="grid groups"' in screen


def test_a_figure_of_one_panel_per_context_shows_at_most_six_and_says_which(demo_raw):
    import pandas as pd
    from babel import Locale

    from servegrid.config import Experiment
    from servegrid.reporting.contents import ReportContents

    portuguese = Locale.parse("pt_BR")
    assert figure_files.shown_contexts(list(range(13))) == [0, 2, 5, 7, 10, 12]  # both ends, evenly between
    assert figure_files.shown_contexts([256, 1024]) == [256, 1024]
    experiment = Experiment(demo_raw)
    contexts = [256 * (i + 1) for i in range(13)]
    summary = pd.DataFrame({"mode": ["decode"] * 13, "context": contexts})
    data = ReportContents(
        experiment, summary, pd.DataFrame(), pd.DataFrame(), formatter=catalogues.Formatter(portuguese)
    )
    by_concurrency, pareto = modes.get("decode").figures
    assert data.panels_shown("decode", by_concurrency) == {
        "shown": "256, 768, 1.536, 2.048, 2.816, 3.328",
        "total": "13",
    }
    assert data.panels_shown("decode", pareto) is not None
    assert data.panels_shown("single_turn", by_concurrency) is None  # no cells of that mode: nothing left out


def test_the_html_report_needs_no_pdf_stack_and_a_missing_one_fails_the_pdf_alone_saying_why(
    demo_grid,  # noqa: F811 - the fixture
    tmp_path,
    monkeypatch,
):
    experiment, cells = demo_grid
    run_aggregate(experiment, cells, tmp_path)
    monkeypatch.setitem(sys.modules, "weasyprint", None)  # as on a host without WeasyPrint: importing it fails
    tables = RunTables.under(tmp_path)
    html = tmp_path / "only.html"
    document.render(experiment, "pt", tables, tmp_path / "no-figures", html_out=str(html))
    assert "</html>" in html.read_text(encoding="utf-8")
    pdf = tmp_path / "only.pdf"
    with pytest.raises(ReportError, match=r"needs WeasyPrint .* set report\.formats: \[html\] to build it alone"):
        document.render(experiment, "pt", tables, tmp_path / "no-figures", pdf_out=str(pdf))
    assert not pdf.exists()


def test_report_formats_is_validated_and_chooses_the_documents(demo_raw):
    assert Experiment(with_changes(demo_raw)).report_formats == ["html", "pdf"]
    assert Experiment(with_changes(demo_raw, **{"report.formats": ["html"]})).report_formats == ["html"]
    with pytest.raises(ConfigError, match=r"report\.formats\[0\]: 'docx' is not one of \['html', 'pdf'\]"):
        Experiment(with_changes(demo_raw, **{"report.formats": ["docx"]}))

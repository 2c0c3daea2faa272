"""Cell files: written atomically with page checksums; a damaged one is an error naming it, never wrong numbers."""

from __future__ import annotations

import pytest

from helpers import synthetic_cell
from servegrid.errors import CellFileError
from servegrid.records import cell_file, cell_format


def test_a_flipped_byte_anywhere_in_the_data_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "cell.parquet"
    synthetic_cell(path, "a", "decode", 512, 2, ttft_s=0.1, interval_s=0.01, requests=200, output_tokens=64)
    table, _ = cell_file.read_cell(path)
    original = path.read_bytes()
    footer = int.from_bytes(original[-8:-4], "little") + 8  # the metadata and its length, at the end
    data_end = len(original) - footer
    for offset in range(8, data_end, max(1, (data_end - 8) // 25)):
        damaged = bytearray(original)
        damaged[offset] ^= 0x10
        path.write_bytes(bytes(damaged))
        try:
            read, _ = cell_file.read_cell(path)
        except CellFileError as exc:
            assert str(path) in str(exc)
            continue
        assert read.equals(table), f"a flip at byte {offset} of {data_end} read back different data silently"


def test_a_footer_changed_after_writing_is_an_error_naming_the_file(tmp_path):
    """The footer holds the cell's facts as JSON (duration, server counters); page checksums do not cover it. A
    changed digit still parses, so only the footer's own checksum tells it from the measured value. (The change is
    made through pyarrow, not as a flipped byte: the facts are in the footer twice, once base64-encoded in Arrow's
    schema, which is the copy pyarrow reads.)"""
    import json

    import pyarrow.parquet as pq

    path = tmp_path / "cell.parquet"
    synthetic_cell(path, "a", "decode", 512, 2, ttft_s=0.1, interval_s=0.01, requests=20, output_tokens=8)
    _, meta = cell_file.read_cell(path)
    table = pq.read_table(path)
    raw = table.schema.metadata[cell_format.FOOTER_KEY]
    changed = raw.replace(json.dumps(meta.duration_s).encode(), json.dumps(meta.duration_s * 2).encode(), 1)
    assert changed != raw and json.loads(changed)  # still valid JSON, another duration
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, cell_format.FOOTER_KEY: changed}), path)
    with pytest.raises(CellFileError, match=r"cell\.parquet: its footer .* does not match its checksum"):
        cell_file.read_cell(path)


def test_a_file_that_is_not_a_cell_file_is_named(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(CellFileError, match=r"x\.parquet"):
        cell_file.read_cell(path)


def test_a_cell_that_cannot_be_written_is_an_error_naming_it_and_leaves_nothing(tmp_path):
    """As on a full disk: the write fails, the error names the file, no file or partial one is left."""
    import os
    import resource
    import subprocess
    import sys

    from helpers import REPO

    script = (
        "import resource, sys\n"
        "from helpers import synthetic_cell\n"
        "from servegrid.errors import guarded\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        f"sys.exit(guarded(lambda: synthetic_cell({str(tmp_path / 'cell.parquet')!r}, 'a', 'decode', 512, 2, "
        "ttft_s=0.1, interval_s=0.01, requests=200, output_tokens=64)))\n"
    )
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] != 0
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stderr
    assert f"{tmp_path / 'cell.parquet'}: cannot write it (" in result.stderr
    assert "File too large" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []

"""Measure ONE real cell with a past commit's own code (its run_cell, its cell-file writer) against its own
loopback calibration server, and copy the cell file to OUT. Not a test; how tests/data/cells/ was made.

    cd /tmp/past-SHA && PYTHONPATH=/tmp/past-SHA/workflow:/tmp/past-SHA/tests \
        python drive.py OUT.parquet "$(cat basic.json)" '{"mode": "decode"}'

CONFIG_JSON is the experiment (its engine.command is replaced by the commit's calibration server); the filter
picks exactly one of its cells by Cell attributes. Environment: CALIB_ADAPTER=1 for commits whose calibration
server predates vLLM-style flags (calib_adapter.py); REFUSING=1 (with FIXTURE_TESTDATA=the commit's tests/data)
for an engine that dies at its first request (refusing_engine.py); KEEP_STATE=1 keeps the server records beside
OUT (OUT.state/).
"""

import dataclasses
import importlib
import inspect
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
out, raw_json, want_json = sys.argv[1], sys.argv[2], sys.argv[3]
raw = json.loads(raw_json)
want = json.loads(want_json)


def first(*names):  # type: ignore[no-untyped-def]
    for n in names:
        try:
            return importlib.import_module(n)
        except ModuleNotFoundError as exc:
            if not exc.name or not n.startswith(exc.name):
                raise
    raise ImportError(names)


server = first("servegrid.serving.server", "servegrid.server")
procs = first("servegrid.serving.procs", "servegrid.procs")
cellmod = first("servegrid.pipeline.cell_job", "servegrid.cell")
Experiment = first("servegrid.config").Experiment
from helpers import free_port_range  # noqa: E402  (the commit's own tests/helpers)

calib = "servegrid.testing.calibration"
try:
    importlib.import_module(calib)
except ModuleNotFoundError:
    calib = "servegrid.calibration"
if os.environ.get("REFUSING"):
    raw["engine"]["command"] = [sys.executable, str(HERE / "refusing_engine.py"), "--model", "{model}"]
elif os.environ.get("CALIB_ADAPTER"):
    raw["engine"]["command"] = [sys.executable, str(HERE / "calib_adapter.py"), "--model", "{model}"]
else:
    raw["engine"]["command"] = [sys.executable, "-m", calib, "--model", "{model}"]

work = Path(tempfile.mkdtemp(prefix="cellrun-"))
os.chdir(work)
fields = {f.name for f in dataclasses.fields(server.Runtime)}
kw = dict(port_range=free_port_range(), startup_timeout_s=30, shutdown_timeout_s=5, state_dir=str(work / "state"))
runtime = server.Runtime(**{k: v for k, v in kw.items() if k in fields})
experiment = Experiment(raw)
cells = [c for c in experiment.cells() if all(getattr(c, k) == v for k, v in want.items())]
assert len(cells) == 1, [c.id for c in experiment.cells()]
cell = cells[0]
owner = procs.ProcessRef.of(os.getpid())
try:
    if "runtime" in inspect.signature(cellmod.run_cell).parameters:
        cellmod.run_cell(experiment, cell, cell.path, owner=owner, runtime=runtime)
    else:
        server.Runtime.from_config = staticmethod(lambda *a, **k: runtime)
        cellmod.run_cell(experiment, cell, cell.path, owner=owner)
finally:
    server.stop_all(runtime, reason="fixture done")
shutil.copyfile(cell.path, out)
if os.environ.get("KEEP_STATE"):
    shutil.copytree(work / "state", out + ".state", dirs_exist_ok=True)
shutil.rmtree(work, ignore_errors=True)
print("cell", cell.id, "->", out, os.path.getsize(out), "bytes")

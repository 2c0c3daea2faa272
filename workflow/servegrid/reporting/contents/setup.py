"""The report's set-up section: the engine, its shared flags (secrets masked), the hardware and CPU placement."""

from __future__ import annotations

from servegrid import engines, redact
from servegrid.reporting.contents.shared import Contents


class SetupContents(Contents):
    def shared_args(self) -> str:
        """engine.args as the report prints them: secrets masked."""
        return " ".join(redact.argv(self.experiment.engine.args))

    def engine_name(self) -> str:
        return engines.get(self.experiment.engine.kind).display_name

    def engine_versions(self) -> list[str]:
        if self.servers.empty:
            return []
        return sorted({str(v) for v in self.servers["engine_version"].dropna()})

    def hardware(self) -> str:
        if self.experiment.info.hardware:
            return self.experiment.info.hardware
        if self.servers.empty:
            return ""
        row = self.servers.iloc[0]
        described = f"{row['host_cpu']} ({row['host_cpu_count']} CPU, {row['host_memory_gib']} GiB)"
        gpus = row.get("host_gpus") or ""
        return f"{described}; {gpus}" if gpus else described

    def cpu_placement(self) -> dict[str, str] | None:
        """The cores servers and client were confined to, when either was ("" = not confined)."""
        servers = sorted({",".join(map(str, c)) for c in self.servers["cpus"]}) if "cpus" in self.servers else []
        clients = sorted(set(self.summary["client_cpus"])) if "client_cpus" in self.summary else []
        confined_servers = [s for s in servers if s]
        if not confined_servers and not self.experiment.operations.client_cpus:
            return None
        return {"server": " / ".join(servers), "client": " / ".join(clients)}

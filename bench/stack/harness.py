"""What the framework benches here share (llama_factory.py, ms_swift.py): each case runs in a
fresh process of the bench itself (`--child NAME`, which prints its measurement as one JSON
line), the estimate of the job the case imports to is put beside it, and the results file
keeps one row per case in the order of the bench's cases.

    --only TEXT     the cases whose name holds TEXT, merged into the results file
    --summary       print the committed rows
    --reestimate    new estimates of the committed measurements (needs no framework)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MEASURED = ("peak_allocated_bytes", "phases", "peak_phase", "params_bytes", "grad_bytes",
            "optimizer_state_bytes", "runner", "dtypes")
"""What a row keeps of the child's measurement (measure/trainer_meter.py metered_train)."""


def rel(est: int, meas: int) -> float:
    return (est - meas) / meas if meas else float("nan")


def estimate(job: dict) -> dict:
    import vramplan

    est = vramplan.estimate(vramplan.load_spec(job)).to_dict()
    return {"peak_allocated_bytes": est["peak_allocated_bytes"], "phases": est["phases"],
            "peak_phase": est["peak_phase"]}


def errors(measured: dict, estimated: dict) -> dict:
    out = {"peak": rel(estimated["peak_allocated_bytes"], measured["peak_allocated_bytes"])}
    for ph in ("forward", "backward", "optimizer"):
        out[ph] = rel(estimated["phases"][ph], measured["phases"][ph])
    return out


@dataclass
class Bench:
    script: str
    """The bench's own file, run again as the child."""
    out: Path
    names: list[str]
    """The cases, in their order."""
    new_row: Callable[[str], dict]
    """A case's row before it is run: its name and what it is made of."""
    job_of: Callable[[dict], dict]
    """The job a row imports to (today's importer)."""
    child: Callable[[str], dict]
    packages: tuple[str, ...]
    """The releases recorded beside the rows."""
    measured: tuple[str, ...] = MEASURED
    width: int = 40

    def run_case(self, name: str) -> dict:
        row = self.new_row(name)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, self.script, "--child", name], capture_output=True, text=True,
                              timeout=900, check=False)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0:
            row["failed"] = proc.stderr.strip()[-3000:]
            return row
        m = json.loads(proc.stdout.strip().splitlines()[-1])
        row["measured"] = {k: m[k] for k in self.measured}
        return self.add_estimate(row)

    def add_estimate(self, row: dict) -> dict:
        row["job"] = self.job_of(row)
        try:
            row["estimated"] = estimate(row["job"])
            row["error"] = errors(row["measured"], row["estimated"])
            row.pop("estimate_failed", None)
        except Exception as exc:  # reported in the row, the others go on
            row["estimate_failed"] = f"{type(exc).__name__}: {exc}"
        return row

    def line(self, row: dict) -> str:
        name = f"{row['name']:{self.width}s}"
        if "failed" in row:
            return f"{name} FAILED {row['failed'][-300:]}"
        if "error" not in row:
            return f"{name} estimate failed: {row.get('estimate_failed')}"
        e = row["error"]
        mib = row["measured"]["peak_allocated_bytes"] / 2**20
        return (f"{name} peak {mib:8.2f} MiB  est {e['peak']:+.3%}  fwd {e['forward']:+.3%}  "
                f"bwd {e['backward']:+.3%}  opt {e['optimizer']:+.3%}")

    def load(self) -> dict:
        return json.loads(self.out.read_text()) if self.out.exists() else {"rows": []}

    def save(self, data: dict) -> None:
        data["rows"].sort(key=lambda r: self.names.index(r["name"]))
        self.out.write_text(json.dumps(data, indent=1) + "\n")

    def versions(self) -> dict:
        from importlib import metadata

        return {pkg: metadata.version(pkg) for pkg in self.packages}

    def main(self, argv=None, description: str = "") -> int:
        ap = argparse.ArgumentParser(description=description)
        ap.add_argument("--child")
        ap.add_argument("--only")
        ap.add_argument("--summary", action="store_true")
        ap.add_argument("--reestimate", action="store_true")
        a = ap.parse_args(argv)
        if a.child:
            print(json.dumps(self.child(a.child)))
            return 0
        data = self.load()
        if a.summary or a.reestimate:
            for row in data["rows"]:
                if a.reestimate and "measured" in row:
                    self.add_estimate(row)
                print(self.line(row))
            if a.reestimate:
                self.save(data)
            return 0
        data["versions"] = self.versions()
        for name in self.names:
            if a.only and a.only not in name:
                continue
            row = self.run_case(name)
            print(self.line(row), flush=True)
            data["rows"] = [r for r in data["rows"] if r["name"] != name] + [row]
            self.save(data)
        return 0

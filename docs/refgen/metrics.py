"""reference/metrics.md: every metric family the daemon registers.

The families come from a real daemon: :func:`daemon_families` builds one with
``create_daemon`` (worker, admin and side sockets in a temporary directory, no model)
on a registry that records what is registered, then asks each collector to describe
itself. Collectors a CPU-only daemon does not register (``CONDITIONAL_COLLECTORS``:
pinned memory, GPU, ...) are described too, marked as conditional.
"""

from __future__ import annotations

import inspect
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import banner


@dataclass(frozen=True)
class Family:
    """One metric family as the reference lists it."""

    name: str  # as exposed: counters end in _total
    kind: str
    labels: tuple[str, ...]
    help: str
    conditional: bool  # present only while its state exists (a GPU, a pinned pool, ...)
    scrape: bool  # computed when Prometheus scrapes, not updated as things happen


def _describe(collector: Any) -> Iterator[tuple[Any, tuple[str, ...], bool]]:
    """(family, label names, computed on scrape) for each family ``collector`` has."""
    from prometheus_client.metrics import MetricWrapperBase

    if isinstance(collector, MetricWrapperBase):
        for family in collector.describe():
            yield family, tuple(collector._labelnames), False
        return
    describe = getattr(collector, "describe", None)
    if describe is None:  # prometheus_client's process/platform/GC collectors
        return
    for family in describe():
        yield family, tuple(getattr(family, "_labelnames", ())), True


def _exposed(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


def daemon_families() -> list[Family]:
    """What ``create_daemon`` registers, plus the conditional collectors."""
    from prometheus_client import CollectorRegistry

    from weightd.server.config import ServeConfig
    from weightd.server.daemon.assembly import create_daemon
    from weightd.server.daemon.collectors import CONDITIONAL_COLLECTORS

    seen: list[Any] = []

    class Recording(CollectorRegistry):
        def register(self, collector: Any) -> None:
            seen.append(collector)
            super().register(collector)

    with tempfile.TemporaryDirectory() as tmp:
        config = ServeConfig(listen=f"unix://{tmp}/run/weightd.sock")
        config.set("admin.listen", f"unix://{tmp}/run/admin.sock")
        daemon = create_daemon(config, Recording())
        daemon.stop(0)
    conditional = set(CONDITIONAL_COLLECTORS)
    registered = {type(c) for c in seen}
    for cls in CONDITIONAL_COLLECTORS:
        if cls not in registered:
            required = [
                p
                for p in inspect.signature(cls).parameters.values()
                if p.default is inspect.Parameter.empty
            ]
            seen.append(cls(*(lambda: None for _ in required)))
    out: dict[str, Family] = {}
    for collector in seen:
        for family, labels, scrape in _describe(collector):
            name = _exposed(family.name, family.type)
            out[name] = Family(
                name,
                family.type,
                labels,
                " ".join(family.documentation.split()),
                type(collector) in conditional,
                scrape,
            )
    return sorted(out.values(), key=lambda f: f.name)


def _label_domains() -> dict[tuple[str, str], tuple[str, ...]]:
    """Label values the code enumerates in a table, where it has one."""
    from weightd.server.adapters.collector import REJECTION_REASONS
    from weightd.server.registry.models import MODEL_STATES
    from weightd.server.telemetry.metrics import FAILURE_REASONS, SOURCE_FAILURE_REASONS

    return {
        ("weightd_model_state", "state"): MODEL_STATES,
        ("weightd_verification_failures_total", "reason"): tuple(sorted(FAILURE_REASONS)),
        ("weightd_adapter_rejections_total", "reason"): REJECTION_REASONS,
        ("weightd_source_failures_total", "reason"): tuple(sorted(SOURCE_FAILURE_REASONS)),
    }


def render() -> str:
    families = daemon_families()
    domains = _label_domains()
    out = [
        "# Metrics",
        "",
        banner("the collectors a real daemon registers (weightd.server.daemon.assembly)"),
        "",
        "Served as Prometheus text on `--metrics-listen` (`GET /metrics`; see "
        "[Operations](../guides/operations.md#metrics)). Names follow Prometheus' "
        "conventions: a `weightd_` prefix, base units (`_bytes`, `_seconds`), counters "
        "ending in `_total`. Label values are bounded: model names come from the "
        "operator's `--model`, methods and codes from the proto and gRPC, never from a "
        "client's string, and adapters have no name label (adapter names come from an "
        "RPC; `ListAdapters` gives per-adapter state).",
        "",
        "*On scrape*: computed when Prometheus scrapes, off the hot path. "
        "*Conditional*: the series exist only while their state does (a GPU in use, a "
        "pinned pool, shared-memory packs, an adapter budget); a zero is only reported "
        "when it was measured.",
        "",
        "| metric | type | labels | what |",
        "|---|---|---|---|",
    ]
    for f in families:
        notes = []
        if f.scrape:
            notes.append("*on scrape*")
        if f.conditional:
            notes.append("*conditional*")
        labels = []
        for label in f.labels:
            values = domains.get((f.name, label))
            labels.append(
                f"`{label}`" + (f" ({', '.join(f'`{v}`' for v in values)})" if values else "")
            )
        what = f.help.replace("|", "\\|") + (f" ({', '.join(notes)})" if notes else "")
        out.append(f"| `{f.name}` | {f.kind} | {', '.join(labels) or '—'} | {what} |")
    out += [
        "",
        "Also exported, by `prometheus_client`'s standard collectors: `process_*` "
        "(resident and virtual memory, CPU seconds, open and maximum file descriptors, "
        "start time), `python_info`, and `python_gc_*`.",
    ]
    return "\n".join(out) + "\n"

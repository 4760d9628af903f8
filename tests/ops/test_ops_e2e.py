"""Operations end to end: a real daemon process, scraped by promtool and a real Prometheus.

One daemon serves the whole module (metrics, health-only listener, reflection, JSON
logs); a Prometheus server from Debian's package is started by the test on a
loopback port, scrapes it every second and is queried over its HTTP API.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RunningDaemon, run_daemon, weightd_command
from tests.ops.conftest import free_port, scrape
from weightd.client import AdminClient, PermissionDeniedError, WeightClient
from weightd.server.daemon.collectors import CONDITIONAL_COLLECTORS

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "weightd-dashboard.json"


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    assert path, f"{name} is missing: .ci/setup.sh installs Debian's prometheus package (as root)"
    return path


@pytest.fixture(scope="module")
def daemon(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("ops-daemon")
    extra = [
        "--metrics-listen",
        "127.0.0.1:0",
        "--health-listen",
        "127.0.0.1:0",
        "--reflection",
        "--log-json",
    ]
    with (
        run_daemon(tmp, [("llama", demo_model)], extra) as d,
        WeightClient(d.target, timeout=60) as client,
    ):
        # something served over gRPC: bytes, latency and RPC series exist ...
        client.fetch(0, 2, transport="grpc")
        # ... and a shared-memory pack, leased while these tensors live
        held = client.fetch(1, 2, transport="shm")
        yield d
        del held


@pytest.fixture(scope="module")
def metrics_url(daemon: RunningDaemon) -> str:
    return daemon.address("metrics")


def test_promtool_check_metrics_passes_on_a_real_scrape(metrics_url: str) -> None:
    text = scrape(metrics_url)
    done = subprocess.run(
        [_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "" and done.stderr.strip() == "", done.stdout + done.stderr
    for needed in (
        "weightd_shm_pack_bytes",
        "weightd_shm_pack_leases",
        "weightd_model_resident_bytes",
        "weightd_model_mapped_bytes",
        "weightd_served_bytes_total",
        "weightd_rpcs_total",
        "weightd_fetch_duration_seconds_bucket",
        "process_resident_memory_bytes",
    ):
        assert needed in text
    assert "weightd_gpu_" not in text  # no CUDA here: no series, not zeros


def _prometheus_query(base: str, query: str) -> list[dict[str, object]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    with urllib.request.urlopen(url, timeout=10) as reply:  # loopback only
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_a_real_prometheus_scrapes_the_memory_metrics(metrics_url: str, tmp_path: Path) -> None:
    target = re.sub(r"^http://([^/]+)/metrics$", r"\1", metrics_url)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: weightd\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            _tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        found: dict[str, list[dict[str, object]]] = {}
        queries = {
            "resident": 'weightd_model_resident_bytes{job="weightd",model="llama"}',
            "mapped": 'weightd_model_mapped_bytes{job="weightd",model="llama"}',
            "rss": 'process_resident_memory_bytes{job="weightd"}',
            "up": 'up{job="weightd"}',
        }
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(found) < len(queries):
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
            for key, query in queries.items():
                if key in found:
                    continue
                try:
                    result = _prometheus_query(base, query)
                except OSError:
                    break  # not listening yet
                if result:
                    found[key] = result
            time.sleep(0.5)
        assert len(found) == len(queries), (found, (tmp_path / "prometheus.log").read_text())

        def value(key: str) -> float:
            (sample,) = found[key]
            return float(sample["value"][1])  # type: ignore[index]

        assert value("up") == 1
        assert value("rss") > 0
        assert 0 < value("resident") <= value("mapped")
    finally:
        process.terminate()
        process.wait(60)
        log.close()


def _dashboard_metrics() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key in ("expr", "query"):  # panel queries and template variables
                if isinstance(node.get(key), str):
                    exprs.append(node[key])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(board)
    assert exprs, "the dashboard queries nothing"
    names = set()
    for expr in exprs:
        bare = re.sub(r'"[^"]*"', '""', expr)  # label values and regexes are not metrics
        names.update(re.findall(r"\b((?:weightd|process|up)\w*)\b", bare))
    return names


def _family_names(text: str) -> set[str]:
    names: set[str] = set()
    # A family declared with HELP/TYPE but no samples yet (a labelled counter before its
    # first event) is exported too: its series appear with the first event.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        for sample in family.samples:
            names.add(sample.name)
    return names


def test_every_metric_the_dashboard_queries_is_exported(metrics_url: str) -> None:
    exported = _family_names(scrape(metrics_url)) | {"up"}  # `up` is Prometheus's own
    conditional: set[str] = set()
    for cls in CONDITIONAL_COLLECTORS:
        collector = cls(lambda: None)
        for family in collector.describe():
            conditional.add(family.name)
    queried = _dashboard_metrics()
    missing = queried - exported - conditional
    assert not missing, f"dashboard queries metrics the daemon does not export: {missing}"
    # and it does show the memory story: page cache, and the state-dependent ones
    assert {"weightd_model_resident_bytes", "weightd_model_mapped_bytes"} <= queried
    assert queried & conditional


def test_health_listener_serves_probes_in_plaintext(daemon: RunningDaemon) -> None:
    target = daemon.address("health")
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "weightd.v1.Weights/llama"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # ... and nothing but health lives there.
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/weightd.v1.Weights/ListModels")(b"", timeout=10)
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_reflection_lists_the_services(daemon: RunningDaemon) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(daemon.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert {"weightd.v1.Weights", "grpc.health.v1.Health"} <= names
    assert "weightd.v1.Admin" not in names


def test_admin_rpcs_refused_on_the_worker_socket_and_served_on_the_admin_socket(
    daemon: RunningDaemon,
) -> None:
    with AdminClient(daemon.target, timeout=30) as wrong, pytest.raises(PermissionDeniedError):
        wrong.reload("llama")
    admin = daemon.address("admin")
    assert admin.endswith("/admin.sock")
    done = subprocess.run(
        weightd_command("reload", admin, "--model", "llama"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("reloaded llama: ")
    with WeightClient(daemon.target, timeout=60) as client:
        assert client.list_models()[0].ready


def test_log_is_json_lines_with_lifecycle_events(daemon: RunningDaemon) -> None:
    records = [json.loads(line) for line in daemon.log().splitlines() if line.strip()]
    events = [r["event"] for r in records if "event" in r]
    for name in ("start", "listening", "verified", "serving"):
        assert name in events, events
    verified = next(r for r in records if r.get("event") == "verified")
    assert verified["model"] == "llama" and verified["tensors"] > 0


def test_second_daemon_on_the_same_tcp_port_fails_clearly(tmp_path: Path, demo_model: Path) -> None:
    with run_daemon(
        tmp_path, [("llama", demo_model)], ["--insecure"], listen="127.0.0.1:0"
    ) as first:
        done = subprocess.run(
            weightd_command(
                "serve",
                "--model",
                f"llama={demo_model}",
                "--listen",
                first.target,
                "--insecure",
                "--admin-listen",
                "none",
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1
        assert f"cannot listen on {first.target} (worker listener)" in done.stderr
        assert "Traceback" not in done.stderr
        with WeightClient(first.target, timeout=30) as client:
            assert client.list_models()[0].ready


def test_the_metrics_reference_lists_what_a_real_scrape_serves(metrics_url: str) -> None:
    """docs/reference/metrics.md is generated from the daemon's collectors
    (``docs.refgen.metrics``); a real scrape must hold no family the page lacks, and
    every family the page calls unconditional, with the same type and labels."""
    from docs.refgen.metrics import daemon_families

    documented = {f.name: f for f in daemon_families()}
    scraped = {}
    for family in text_string_to_metric_families(scrape(metrics_url)):
        if not family.name.startswith("weightd_") or family.name.endswith("_created"):
            continue  # _created: prometheus_client's creation time of a counter/histogram
        name = f"{family.name}_total" if family.type == "counter" else family.name
        labels = {k for s in family.samples for k in s.labels if k not in ("le", "quantile")}
        scraped[name] = (family.type, labels)
    assert set(scraped) - set(documented) == set(), "families missing from the reference"
    always = {n for n, f in documented.items() if not f.conditional}
    assert always - set(scraped) == set(), "documented families a daemon does not serve"
    for name, (kind, labels) in scraped.items():
        assert documented[name].kind == kind, name
        assert labels <= set(documented[name].labels), (name, labels)

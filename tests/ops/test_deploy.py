"""deploy/ as real tools read it: promtool, the Kubernetes schemas, systemd-analyze."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightd.server.config import ServeConfig
from weightd.server.daemon.sockets import dir_problem

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    assert path, f"{name} is missing: .ci/setup.sh installs it (Debian's prometheus package)"
    return path


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize(
    ("check", "target"),
    [
        ("config", "prometheus/prometheus.yml"),
        ("rules", "prometheus/alerts.yml"),
    ],
)
def test_promtool_check(check: str, target: str) -> None:
    done = _run(_tool("promtool"), "check", check, str(DEPLOY / target))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_alert_unit_tests() -> None:
    """The alerts fire when they should (daemon down, failures, residency, pinned budget)."""
    done = _run(_tool("promtool"), "test", "rules", "alerts_test.yml", cwd=DEPLOY / "prometheus")
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    assert {
        "WeightdDown",
        "WeightdVerificationFailures",
        "WeightdPageCacheResidencyLow",
        "WeightdPinnedBudgetNearlyFull",
    } <= names


def _validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    # The package's bundled schemas; no network.
    script = "import sys; from kubernetes_validate.__main__ import main; sys.exit(main())"
    return _run(sys.executable, "-c", script, "--strict", *map(str, paths))


def test_kubernetes_manifests_validate_against_the_schemas() -> None:
    assert {p.name for p in MANIFESTS} >= {
        "daemonset.yaml",
        "daemonset-cuda-ipc.yaml",
        "daemonset-s3.yaml",
        "service.yaml",
        "networkpolicy.yaml",
    }
    done = _validate(*MANIFESTS)
    assert done.returncode == 0, done.stdout + done.stderr
    resources = sum(len([d for d in yaml.safe_load_all(p.read_text()) if d]) for p in MANIFESTS)
    assert resources == 10
    assert (
        done.stdout.count("passed for resource") + done.stderr.count("passed for resource")
        == resources
    )


def test_the_validator_does_reject_a_bad_manifest(tmp_path: Path) -> None:
    """Negative control: the same DaemonSet with a misspelt field fails."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (DEPLOY / "kubernetes" / "daemonset.yaml").read_text().replace("readOnly:", "readonly:")
    )
    assert _validate(bad).returncode != 0


def _daemonset(name: str) -> dict[str, Any]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()))
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds


def _settings(name: str, tmp: Path) -> ServeConfig:
    """The config the DaemonSet's daemon would run with: its ConfigMap's file, its
    container's ``WEIGHTD_*`` variables and its args, read by the daemon's own loader."""
    from weightd.server.cli.main import _parser
    from weightd.server.cli.serve_options import given_flags
    from weightd.server.config.load import check, load
    from weightd.server.sources.location import default_model_name

    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()))
    pod = _daemonset(name)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    (config_map,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]
    ]
    args = container["args"]
    assert args[0] == "serve"
    parsed = _parser().parse_args(args)
    assert Path(parsed.config).parent == Path(mounts["config"])
    file = tmp / Path(parsed.config).name
    file.write_text(config_map["data"][file.name])
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    loaded = load(given_flags(parsed), env, str(file))
    check(loaded, loaded.config.model_names(default_model_name))
    return loaded.config


@pytest.mark.parametrize(
    ("name", "host_ipc"), [("daemonset.yaml", False), ("daemonset-cuda-ipc.yaml", True)]
)
def test_daemonset_shape(name: str, host_ipc: bool, tmp_path: Path) -> None:
    pod = _daemonset(name)["spec"]["template"]["spec"]
    assert bool(pod.get("hostIPC")) is host_ipc
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    assert container["resources"]["requests"] and container["resources"]["limits"]
    config = _settings(name, tmp_path)
    assert config.local.cuda_ipc is host_ipc
    assert config.health.listen is not None and config.metrics.listen is not None
    health_port = int(config.health.listen.rsplit(":", 1)[1])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == health_port
    # Busy is not dead: liveness asks the service that does not follow capacity.
    assert container["livenessProbe"]["grpc"]["service"] == "weightd.v1.Liveness"
    # TCP listeners bind the pod's own address, never every interface.
    for listen in (config.health.listen, config.metrics.listen):
        assert listen.startswith("$(POD_IP):"), listen
    (env,) = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # The variables that name it come after it (Kubernetes expands only earlier ones).
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("WEIGHTD_HEALTH_LISTEN")
    # Admin is not in the socket directory the workers share.
    assert config.admin.listen is not None
    assert not config.admin.listen.startswith("unix:///run/weightd/")
    assert config.server.grace + 10 <= pod["terminationGracePeriodSeconds"]


def test_metrics_are_admitted_only_from_the_monitoring_namespace() -> None:
    (policy,) = yaml.safe_load_all((DEPLOY / "kubernetes" / "networkpolicy.yaml").read_text())
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "weightd"}
    assert spec["policyTypes"] == ["Ingress"]
    by_port = {r["ports"][0]["port"]: r.get("from") for r in spec["ingress"]}
    assert set(by_port) == {9464, 7071}
    assert by_port[9464] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]


def test_s3_daemonset_has_credentials_identity_and_a_cache_volume(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset-s3.yaml").read_text()))
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert "eks.amazonaws.com/role-arn" in account["metadata"]["annotations"]
    pod = _daemonset("daemonset-s3.yaml")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    (container,) = pod["containers"]
    (ref,) = container["envFrom"]
    assert ref["secretRef"]["optional"] is True  # a workload identity needs no Secret
    config = _settings("daemonset-s3.yaml", tmp_path)
    cache = config.cache_dir
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[cache]]["hostPath"]["path"] == cache  # survives pod restarts
    assert [m.value.startswith("s3://") for m in config.model] == [True]
    assert [m.value.startswith("s3://") for m in config.trust.manifest] == [True]
    assert not any("SECRET" in str(e.get("value", "")) for e in container.get("env", []))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert config.health.listen is not None
    health_port = int(config.health.listen.rsplit(":", 1)[1])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == health_port
    assert config.admin.listen is not None
    assert not config.admin.listen.startswith("unix:///run/weightd/")


def test_dockerfile_is_multi_stage_and_runs_unprivileged() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", text, re.MULTILINE)
    assert len(stages) >= 2, stages
    final = text[text.rindex("\nFROM ") :]
    user = re.findall(r"^USER\s+(\S+)", final, re.MULTILINE)
    assert user and not user[-1].startswith(("root", "0:", "0")), user
    assert "COPY --from=build" in final


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    weightd = Path(sys.executable).with_name("weightd")
    unit = tmp_path / "weightd.service"
    unit.write_text(
        (DEPLOY / "systemd" / "weightd.service")
        .read_text()
        .replace("/opt/weightd/bin/weightd", str(weightd))
    )
    done = _run(analyze, "verify", str(unit))
    # systemd-analyze exits 0 even for unknown keys; anything it says is a problem.
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
    assert "ExecStart=" in unit.read_text() and "KillSignal=SIGTERM" in unit.read_text()
    # It serves with the file deploy/ ships, which the daemon's loader accepts.
    (exec_start,) = [ln for ln in unit.read_text().splitlines() if ln.startswith("ExecStart=")]
    assert exec_start.endswith("serve --config /etc/weightd/weightd.toml")
    from weightd.server.config.load import load

    config = load({}, {}, str(DEPLOY / "weightd.toml")).config
    assert config.listen == "unix:///run/weightd/weightd.sock" and config.log_json


@pytest.mark.parametrize("name", ["daemonset.yaml", "daemonset-cuda-ipc.yaml", "daemonset-s3.yaml"])
def test_the_socket_directory_is_handed_to_the_daemon_before_it_starts(
    name: str, tmp_path: Path
) -> None:
    """The kubelet makes the hostPath root-owned 0755, which the daemon refuses (a socket
    directory must be its own and closed to others): the init step's own command,
    run here on such a directory, leaves it as the daemon requires."""
    pod = _daemonset(name)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (container,) = pod["containers"]
    sockets = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["sockets"]
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]} == {"sockets": sockets}
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    shell, flag, script = init["command"]
    assert (shell, flag) == ("sh", "-c") and f"chown {uid}:{gid} {sockets}" in script
    if os.geteuid() != 0:
        pytest.skip("running the init step's chown needs root (CI runs as root)")
    made = tmp_path / "run-weightd"
    made.mkdir(mode=0o755)
    done = subprocess.run(
        ["sh", "-c", script.replace(sockets, str(made))], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    st = made.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, 0o700)
    # The daemon's own check, as uid 10001 runs it: refused before, accepted after.
    assert dir_problem(st, uid, group=False) is None
    made.chmod(0o755)
    os.chown(made, 0, 0)
    assert dir_problem(made.stat(), uid, group=False) is not None

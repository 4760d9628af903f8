"""``weightd plan`` and ``weightd serve --rules``, run as an operator runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import run_daemon, weightd_command
from tests.layouts import restate
from tests.layouts.rules_examples import MY_LLAMA_RULES
from tests.models import read_checkpoint
from weightd.client import WeightClient

pytestmark = pytest.mark.e2e


def weightd(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``weightd`` command, out of process as an operator runs it."""
    return subprocess.run(weightd_command(*args), capture_output=True, text=True, timeout=120)


def plan_cli(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``weightd plan`` in this process (the CLI's own main), to skip an interpreter start."""
    from weightd.server.cli.main import main

    code = main(["plan", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["weightd", "plan", *args], code, out.out, out.err)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_plan_json_accounts_for_every_worker(arch_models: dict[str, Path]) -> None:
    directory = arch_models["mixtral"]
    done = weightd("plan", str(directory), "--tp", "2", "--pp", "2", "--ep", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    original = read_checkpoint(directory)
    config = json.loads((directory / "config.json").read_text())
    assert report["architecture"] == "MixtralForCausalLM"
    assert report["checkpoint_bytes"] == sum(nbytes(t) for t in original.values())
    assert report["stages"] == [[0, 2], [2, 3]]
    assert len(report["ranks"]) == 8
    for entry, lay in zip(report["ranks"], restate.every(2, 2, 2), strict=True):
        assert (entry["tp_rank"], entry["pp_rank"], entry["ep_rank"]) == (
            lay.tp_rank,
            lay.pp_rank,
            lay.ep_rank,
        )
        held = {n: t for n, t in original.items() if restate.holds(n, config, lay, original)}
        want = {n: nbytes(restate.expected(n, t, config, lay)) for n, t in held.items()}
        assert {t["name"]: t["bytes"] for t in entry["tensors"]} == want
        assert entry["bytes"] == sum(want.values())
        assert entry["fraction_of_checkpoint"] == entry["bytes"] / report["checkpoint_bytes"]
        for t in entry["tensors"]:
            assert t["bytes"] <= t["disk_span_bytes"] <= nbytes(original[t["name"]])
            if t["name"].endswith(("down_proj.weight", "o_proj.weight", "w2.weight")):
                assert t["disk_span_bytes"] > t["bytes"]  # row-parallel: strided over the rows
        assert entry["disk_span_bytes"] == sum(t["disk_span_bytes"] for t in entry["tensors"])
    assert report["total_bytes"] == sum(e["bytes"] for e in report["ranks"])


def test_plan_text_and_errors(
    arch_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    done = plan_cli(capsys, str(arch_models["llama-tied"]), "--tp", "2", "--pp", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("llama-tied (LlamaForCausalLM; rules: llama (built-in:llama))")
    assert lines[1] == "layout: tp=2 pp=2 ep=1 (4 workers)"
    assert lines[2] == "stages: 0: layers 0..1 | 1: layers 2..2"
    assert lines[-1].startswith("total over workers: ")
    bad = plan_cli(capsys, str(arch_models["llama"]), "--tp", "3")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "weightd plan: error: tensor 'model.embed_tokens.weight': dim 0 of size 128 is not "
        "divisible by tensor-parallel world_size 3"
    ]
    bad = plan_cli(capsys, str(arch_models["mixtral"]), "--tp", "1", "--ep", "3")
    assert bad.returncode == 1 and "num_experts=4 is not divisible by ep_size 3" in bad.stderr


@pytest.fixture()
def my_llama(arch_models: dict[str, Path], tmp_path: Path) -> tuple[Path, Path]:
    """The Llama checkpoint under an architecture name weightd has no rules for, and a
    rules file for it."""
    directory = tmp_path / "my-llama"
    shutil.copytree(arch_models["llama"], directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["MyLlamaForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    rules = tmp_path / "my-llama.rules.json"
    rules.write_text(json.dumps(MY_LLAMA_RULES, indent=2))
    return directory, rules


def test_plan_with_a_rules_file(
    my_llama: tuple[Path, Path],
    arch_models: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory, rules = my_llama
    refused = plan_cli(capsys, str(directory), "--tp", "2")
    assert refused.returncode == 1
    assert "'MyLlamaForCausalLM', which has no sharding rules" in refused.stderr
    mine = weightd(
        "plan", str(directory), "--tp", "2", "--pp", "3", "--json", "--rules", str(rules)
    )
    assert mine.returncode == 0, mine.stderr
    builtin = plan_cli(capsys, str(arch_models["llama"]), "--tp", "2", "--pp", "3", "--json")
    a, b = json.loads(mine.stdout), json.loads(builtin.stdout)
    assert a["rules"] == f"my-llama ({rules})"
    assert a["ranks"] == b["ranks"]


def test_serve_with_a_rules_file(
    my_llama: tuple[Path, Path], arch_models: dict[str, Path], tmp_path: Path
) -> None:
    directory, rules = my_llama
    original = read_checkpoint(arch_models["llama"])
    config = json.loads((arch_models["llama"] / "config.json").read_text())
    with (
        run_daemon(tmp_path, [("mine", directory)], ["--rules", str(rules)]) as daemon,
        WeightClient(daemon.target, timeout=60) as client,
    ):
        for rank in range(2):
            state = client.fetch(rank, 2, model="mine")
            assert set(state) == set(original)
            for name, t in state.items():
                want = restate.expected(name, original[name], config, restate.L(2, rank))
                assert torch.equal(t, want), name


def test_serve_refuses_a_bad_rules_file(tmp_path: Path) -> None:
    rules = tmp_path / "bad.json"
    rules.write_text(json.dumps({"family": "x", "architectures": ["X"], "rules": [{"match": "["}]}))
    done = subprocess.run(
        weightd_command(
            "serve", "--listen", f"unix://{tmp_path}/run/s.sock", "--rules", str(rules)
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"weightd serve: error: {rules}: rules[0].match '[' is not a valid regex: "
        "unterminated character set at position 0"
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[" * 100_000 + "]" * 100_000, "not valid JSON: maximum recursion depth exceeded"),
        (
            json.dumps(
                {"family": "x", "architectures": ["X"], "rules": [{"match": "a{4294967296}"}]}
            ),
            "rules[0].match 'a{4294967296}' is not a valid regex",
        ),
        (
            json.dumps(
                {
                    "family": "x",
                    "architectures": ["X"],
                    "rules": [{"match": "(" * 5000 + ")" * 5000}],
                }
            ),
            "rules[0].match '((((",
        ),
    ],
    ids=["deep-json", "huge-repeat", "deep-regex"],
)
def test_a_hostile_rules_file_is_one_line(tmp_path: Path, text: str, problem: str) -> None:
    """A rules file that broke Python's parsers (OverflowError, RecursionError: a
    3,000-line traceback) is refused like any bad rules file: one line naming it."""
    rules = tmp_path / "hostile.json"
    rules.write_text(text)
    done = subprocess.run(
        weightd_command(
            "serve", "--listen", f"unix://{tmp_path}/run/s.sock", "--rules", str(rules)
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"weightd serve: error: {rules}: ")
    assert problem in last
    assert len(last) < 600


def test_plan_with_vllms_vocabulary_cut(
    arch_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """128 rows padded to a multiple of 48 are 144: 72 rows for rank 0, 56 for rank 1."""
    directory = str(arch_models["llama"])
    done = plan_cli(capsys, directory, "--tp", "2", "--vocab-pad", "48", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["vocab_pad"] == 48
    for rank, rows in enumerate((72, 56)):
        shapes = {t["name"]: t["shape"] for t in report["ranks"][rank]["tensors"]}
        assert shapes["model.embed_tokens.weight"][0] == rows
        assert shapes["lm_head.weight"][0] == rows
    text = plan_cli(capsys, directory, "--tp", "2", "--vocab-pad", "48")
    assert text.stdout.splitlines()[1] == "layout: tp=2 pp=1 ep=1 vocab_pad=48 (2 workers)"
    bad = plan_cli(capsys, directory, "--tp", "2", "--vocab-pad", "70000")
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "weightd plan: error: vocab_pad 70000 is invalid: it must be between 0 (equal blocks) "
        "and 65536"
    ]

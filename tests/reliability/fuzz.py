"""Coverage-guided fuzzing of weightd's parsers (atheris), bounded or for as long as asked.

    python -m tests.reliability.fuzz header --runs 3000            # what CI runs per target
    python -m tests.reliability.fuzz manifest --seconds 300         # longer, by time
    python -m tests.reliability.fuzz all --seconds 120              # every target in turn
    python -m tests.reliability.fuzz --make-seeds DIR               # regenerate real seeds

Targets: header, index, manifest, signature, adapter_config (see ``fuzz_targets``).
Each run starts from the real seed files, instruments the ``weightd`` modules for
coverage and lets libFuzzer mutate (with a dictionary of JSON and safetensors
tokens). A crasher — any exception but a typed, file-naming ``WeightdError`` — is
written to ``--artifacts`` (default ``fuzz-artifacts/``) and the run exits non-zero;
commit it under ``fuzz_regressions/<target>/`` and fix the parser.

Without atheris (it ships wheels for CPython 3.11 on x86-64 Linux only) a built-in
random mutator runs the same targets on the same seeds (no coverage guidance).
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

#: The targets of ``fuzz_targets.TARGETS``, named here so that choosing one imports no
#: weightd module before atheris instruments them.
NAMES = ("header", "index", "manifest", "signature", "adapter_config")

#: Tokens worth splicing in: JSON structure, safetensors fields, numbers at the edges.
DICTIONARY = [
    '"',
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "null",
    "true",
    "false",
    "NaN",
    "-Infinity",
    "1e999",
    "-1",
    "0",
    "18446744073709551616",
    "4294967296",
    '"__metadata__"',
    '"dtype"',
    '"shape"',
    '"data_offsets"',
    '"F32"',
    '"BF16"',
    '"F8_E4M3"',
    '"I64"',
    '"weight_map"',
    '"metadata"',
    '"total_size"',
    '"files"',
    '"tensors"',
    '"signature"',
    '"sha256"',
    '"size"',
    '"digest"',
    '"blake3:"',
    '"r"',
    '"lora_alpha"',
    '"target_modules"',
    '"rank_pattern"',
    '"alpha_pattern"',
    '"use_rslora"',
    '"peft_type"',
    '"LORA"',
    '"all-linear"',
    '"(?i)"',
    '"\\\\u0000"',
    '"../"',
    '"/etc/passwd"',
    '".bin"',
    '"\\ud800"',
    # unquoted, to land inside strings: regex syntax (adapter patterns are regexes)
    "(?i)",
    "(?P<x>",
    "{4294967296}",
    "\\\\1",
    ".*",
    "|",
    "(",
    ")",
]


def _load_targets(instrument: bool) -> object:
    """Import the targets (and so the weightd parsers), instrumented for coverage if asked."""
    if instrument:
        import atheris

        with atheris.instrument_imports(include=["weightd"]):
            return importlib.import_module("tests.reliability.fuzz_targets")
    return importlib.import_module("tests.reliability.fuzz_targets")


def _have_atheris() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def _write_dictionary(path: Path) -> None:
    lines = []
    for token in DICTIONARY:
        escaped = token.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'"{escaped}"')
    path.write_text("\n".join(lines) + "\n")


def run_atheris(target: str, runs: int, seconds: int, seed: int, artifacts: Path) -> int:
    """Fuzz ``target`` with libFuzzer in a forked child, whose work directory (corpus,
    dictionary) this process removes once the child is done: libFuzzer ends its process
    with ``exit()``, past any ``finally`` or ``atexit`` of Python's. Returns its status."""
    with tempfile.TemporaryDirectory(prefix=f"weightd-fuzz-{target}-") as work:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: libFuzzer runs here and exits
            try:
                _fuzz_in_this_process(target, runs, seconds, seed, artifacts, Path(work))
            finally:
                os._exit(70)  # only if libFuzzer returned, which it does not
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _fuzz_in_this_process(
    target: str, runs: int, seconds: int, seed: int, artifacts: Path, work: Path
) -> None:
    import atheris

    targets = _load_targets(instrument=True)
    fn: Callable[[bytes], None] = targets.TARGETS[target]  # type: ignore[attr-defined]
    corpus = work / "corpus"
    shutil.copytree(targets.SEEDS / target, corpus)  # type: ignore[attr-defined]
    longest = max(p.stat().st_size for p in corpus.iterdir())
    _write_dictionary(work / "tokens.dict")
    artifacts.mkdir(parents=True, exist_ok=True)
    args = [
        sys.argv[0],
        str(corpus),
        f"-seed={seed}",
        f"-max_len={max(4096, 2 * longest)}",
        f"-dict={work / 'tokens.dict'}",
        f"-artifact_prefix={artifacts}/{target}-",
        "-print_final_stats=1",
        "-timeout=20",
        "-rss_limit_mb=4096",
    ]
    if runs:
        args.append(f"-runs={runs}")
    if seconds:
        args.append(f"-max_total_time={seconds}")
    atheris.Setup(args, fn)
    atheris.Fuzz()


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random edit: flip, insert, delete, duplicate or splice a dictionary token."""
    out = bytearray(data)
    op = rng.randrange(5)
    pos = rng.randrange(len(out) + 1)
    if op == 0 and out:
        out[min(pos, len(out) - 1)] ^= 1 << rng.randrange(8)
    elif op == 1:
        out[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
    elif op == 2 and out:
        del out[pos : pos + rng.randrange(1, 16)]
    elif op == 3 and out:
        out[pos:pos] = out[pos : pos + rng.randrange(1, 64)]
    else:
        out[pos:pos] = rng.choice(DICTIONARY).encode()
    return bytes(out)


def run_builtin(target: str, runs: int, seconds: int, seed: int, artifacts: Path) -> int:
    """The same target on the same seeds with :func:`mutate` (no coverage guidance)."""
    targets = _load_targets(instrument=False)
    fn: Callable[[bytes], None] = targets.TARGETS[target]  # type: ignore[attr-defined]
    corpus: list[bytes] = targets.seeds(target)  # type: ignore[attr-defined]
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds if seconds else None
    done = 0
    while (not runs or done < runs) and (deadline is None or time.monotonic() < deadline):
        data = corpus[done] if done < len(corpus) else rng.choice(corpus)
        for _ in range(rng.randrange(1, 6) if done >= len(corpus) else 0):
            data = mutate(data, rng)
        try:
            fn(data)
        except Exception:
            artifacts.mkdir(parents=True, exist_ok=True)
            crash = artifacts / f"{target}-crash-{done}"
            crash.write_bytes(data)
            traceback.print_exc()
            print(f"crasher after {done} executions: {crash}", file=sys.stderr)
            return 1
        done += 1
        if done % 64 == 0 and len(corpus) < 256:
            corpus.append(data)
    print(f"#{done} DONE builtin mutator, target {target}: no crasher", file=sys.stderr)
    return 0


def make_seeds(out: Path) -> None:
    """Write the seed corpus from real tools: transformers, PEFT, weightd itself."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="weightd-seeds-") as scratch:
        _write_seeds(out, Path(scratch))


def _write_seeds(out: Path, work: Path) -> None:
    import peft
    import torch
    import transformers
    from safetensors.torch import save

    from weightd.server.cli.main import main as weightd

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(work / "model", max_shard_size="1KB")
    for sub in ("header", "index", "manifest", "signature", "adapter_config"):
        (out / sub).mkdir(exist_ok=True)
    for i, shard in enumerate(sorted((work / "model").glob("*.safetensors"))[:3]):
        shutil.copy(shard, out / "header" / f"transformers-{i}.safetensors")
    mixed = {
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(3, dtype=torch.int64),
        "f8": torch.zeros(4, dtype=torch.float8_e4m3fn),
    }
    (out / "header" / "mixed.safetensors").write_bytes(save(mixed, metadata={"format": "pt"}))
    shutil.copy(work / "model" / "model.safetensors.index.json", out / "index" / "index.json")
    manifest = out / "manifest" / "manifest.json"
    assert weightd(["manifest", "create", str(work / "model"), "-o", str(manifest)]) == 0
    key = work / "key"
    assert (
        weightd(
            ["manifest", "keygen", "--out-private", str(key), "--out-public", str(key) + ".pub"]
        )
        == 0
    )
    signed = out / "signature" / "signed.json"
    args = ["manifest", "create", str(work / "model"), "-o", str(signed), "--sign-key", str(key)]
    assert weightd(args) == 0
    shutil.copy(str(key) + ".pub", out / "signature.pub")
    for name, kwargs in {
        "plain": {},
        "patterns": {"rank_pattern": {"down_proj": 2}, "alpha_pattern": {"q_proj": 8}},
        "rslora": {"use_rslora": True},
    }.items():
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], **kwargs)
        adapted = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)
        adapted.save_pretrained(work / name)
        shutil.copy(work / name / "adapter_config.json", out / "adapter_config" / f"{name}.json")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.reliability.fuzz", description=__doc__)
    p.add_argument(
        "target", nargs="?", help="header, index, manifest, signature, adapter_config, all"
    )
    p.add_argument("--runs", type=int, default=0, help="executions (0: until --seconds)")
    p.add_argument("--seconds", type=int, default=0, help="stop after this long (0: --runs)")
    p.add_argument("--seed", type=int, default=1, help="random seed (runs are reproducible)")
    p.add_argument("--artifacts", type=Path, default=Path("fuzz-artifacts"))
    p.add_argument("--engine", choices=["auto", "atheris", "builtin"], default="auto")
    p.add_argument("--make-seeds", type=Path, default=None, metavar="DIR")
    args = p.parse_args(argv)
    if args.make_seeds is not None:
        make_seeds(args.make_seeds)
        return 0
    if not args.runs and not args.seconds:
        args.runs = 10_000
    if args.target == "all":
        status = 0
        for name in NAMES:  # each in its own process: libFuzzer exits when done
            cmd = [sys.executable, "-m", "tests.reliability.fuzz", name]
            cmd += [f"--runs={args.runs}", f"--seconds={args.seconds}", f"--seed={args.seed}"]
            cmd += [f"--artifacts={args.artifacts}", f"--engine={args.engine}"]
            status |= subprocess.run(cmd, check=False).returncode
        return status
    if args.target not in NAMES:
        p.error(f"unknown target {args.target!r}; one of {', '.join(NAMES)}, all")
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if _have_atheris() else "builtin"
    if engine == "atheris":
        return run_atheris(args.target, args.runs, args.seconds, args.seed, args.artifacts)
    return run_builtin(args.target, args.runs, args.seconds, args.seed, args.artifacts)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())

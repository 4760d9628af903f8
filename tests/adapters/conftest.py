"""A tiny real Llama (GQA) base and real PEFT LoRA adapters for it, made once per session."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.models import build_model, expected_slice
from weightd.client import Transport, WeightClient
from weightd.client.api.admin import AdminClient
from weightd.client.base.errors import NotFoundError

BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Fixture:
    root: Path  # the adapter root
    base_dir: Path
    adapter_dir: Path  # a good adapter under root
    second_dir: Path  # another good adapter (other seed, other r) under root
    peft_model: Any  # the PeftModel the first adapter was saved from


def make_adapter(
    base_dir: Path, out: Path, seed: int, r: int, rank_pattern: dict[str, int] | None = None
) -> Any:
    import peft
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=TARGETS,
        rank_pattern=rank_pattern or {},
        init_lora_weights=False,  # non-zero lora_B: the adapter changes the output
    )
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(str(out))
    return model


@pytest.fixture(scope="session")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    top = tmp_path_factory.mktemp("lora")
    base_dir = top / "tiny-llama"
    build_model("llama", BASE_CONFIG).save_pretrained(str(base_dir))
    root = top / "adapters"
    root.mkdir()
    model = make_adapter(base_dir, root / "good", 1, 4, {"down_proj": 2})
    make_adapter(base_dir, root / "second", 2, 8)
    cfg = json.loads((root / "good" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base_dir)
    return Fixture(root, base_dir, root / "good", root / "second", model)


PREFIX = "base_model.model."


def expected(
    adapter_dir: Path, ws: int, rank: int, config: dict[str, object]
) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        served = name.removeprefix(PREFIX)
        module = served.rsplit(".", 2)[0]
        base = f"{module}.weight"
        row = module.endswith(("o_proj", "down_proj"))
        cut = (row and ".lora_A." in served) or (not row and ".lora_B." in served)
        out[served] = expected_slice(base, t, config, ws, rank) if cut else t
    return out


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes, shapes and bytes (bit for bit, NaNs and signed zeros included)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
        for k in a
    )


@dataclass
class Race:
    versions: list[int]  # the version of every complete, checked fetch
    misses: int  # fetches that found the adapter unloaded (NOT_FOUND)
    rounds: int  # operator rounds (replace, and every third an unload + load)


def race(
    target: str,
    admin: AdminClient,
    name: str,
    want: dict[Path, dict[str, torch.Tensor]],
    transport: Transport,
) -> Race:
    """Four threads fetch rank 1 of 2 of ``name`` over ``transport`` while this thread
    replaces it (alternating ``want``'s sources) and every third round unloads and
    reloads it, until >= 120 fetches of >= 5 versions completed. Each fetch must come
    over ``transport``, pass the client's digest checks, and equal, bit for bit, the
    source its adapter digest names."""
    digests = {admin.load_adapter(name, str(s)).digest: s for s in reversed(list(want))}
    sources = list(want)
    done = threading.Event()
    ok: list[int] = []
    misses = [0]
    failures: list[BaseException] = []

    def worker() -> None:
        with WeightClient(target, timeout=60) as client:
            while not done.is_set():
                try:
                    # verify: shared packs are re-hashed against their slice digests too
                    got = client.fetch_adapter(name, 1, 2, transport=transport, verify=True)
                except NotFoundError:
                    misses[0] += 1
                    continue
                except BaseException as exc:
                    failures.append(exc)
                    return
                if got.transport != transport or not same_bytes(
                    got.tensors, want[digests[got.digest]]
                ):
                    failures.append(AssertionError(f"version {got.version} differs"))
                    return
                ok.append(got.version)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    i = 0
    while (len(ok) < 120 or len(set(ok)) < 5) and not failures and i < 5000:
        i += 1
        admin.load_adapter(name, str(sources[i % 2]))
        if i % 3 == 0:
            admin.unload_adapter(name)
            admin.load_adapter(name, str(sources[i % 2]))
    done.set()
    for t in threads:
        t.join(60)
    assert not failures, failures[0]
    assert len(ok) >= 120 and len(set(ok)) >= 5
    return Race(ok, misses[0], i)

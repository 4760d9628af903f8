"""vLLM's worker side of the shared hand-over: a ``lora_path`` naming a weightd adapter
version is loaded from the daemon's sealed pack, not from files.

vLLM's worker loads an adapter in ``WorkerLoRAManager._load_adapter``: PEFT's config
with ``PEFTHelper.from_local_dir(lora_path)``, then the weights with
``LoRAModel.from_local_checkpoint(lora_path, ...)``, which reads the safetensors file
and hands the tensors to ``LoRAModel.from_lora_tensors``. vLLM has no hook for another
source (the classes are fixed in ``LoRAModelRunnerMixin``), so :func:`install` (called
by the ``vllm.general_plugins`` entry point in every vLLM process, the workers
included, when ``WEIGHTD_LORA`` is set) wraps those two class methods: for a path of
:mod:`.shared`'s form they take the config and the tensors from the mapped pack
(:func:`.shared.map_adapter`); any other path goes to vLLM's own code untouched.
Everything else of ``_load_adapter`` (``validate_legal``, the weights mapper, the
prefixes a model skips, the checks of the loaded model) is vLLM's, unchanged.

A failure is raised where vLLM's own file read would raise it: ``add_lora`` (how both
weightd routes hand an adapter to the engine) reports it as that request's error.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .options import LoRAOptions
from .shared import SharedAdapter, SharedVersion, map_adapter, parse_shared_path

log = logging.getLogger("vllm.weightd.lora")

_MARK = "__weightd_shared__"
_lock = threading.Lock()
#: The adapter mapped for the config step, waiting for the weights step of the same
#: load (one at a time: a worker loads adapters one after another).
_staged: dict[str, SharedAdapter] = {}


def install(options: LoRAOptions) -> None:
    """Wrap vLLM's two loading class methods (idempotent; see the module docstring)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    if not all(
        hasattr(c, m)
        for c, m in ((PEFTHelper, "from_local_dir"), (LoRAModel, "from_local_checkpoint"))
    ):
        log.warning(
            "weightd: this vLLM has no PEFTHelper.from_local_dir / "
            "LoRAModel.from_local_checkpoint: adapters from the daemon's shared packs "
            'cannot be loaded here; give WEIGHTD_LORA "handover": "files"'
        )
        return
    from_dir = PEFTHelper.from_local_dir
    if getattr(from_dir, _MARK, False):
        return
    from_checkpoint = LoRAModel.from_local_checkpoint

    def peft_from_local_dir(cls: Any, /, lora_path: str, max_positions: int | None) -> Any:
        wanted = parse_shared_path(lora_path)
        if wanted is None:
            return from_dir.__func__(cls, lora_path, max_positions)
        adapter = _map(options, wanted)
        with _lock:
            _staged.clear()  # one pending load at a time: an abandoned one lets go here
            _staged[lora_path] = adapter
        config = dict(adapter.config)
        config["vllm_max_position_embeddings"] = max_positions
        return cls.from_dict(config)

    def lora_from_local_checkpoint(
        cls: Any, /, lora_dir: str, expected_lora_modules: set[str], peft_helper: Any, **kw: Any
    ) -> Any:
        wanted = parse_shared_path(lora_dir)
        if wanted is None:
            return from_checkpoint.__func__(cls, lora_dir, expected_lora_modules, peft_helper, **kw)
        with _lock:
            adapter = _staged.pop(lora_dir, None)
        if adapter is None:  # vLLM read the config elsewhere (or an older vLLM)
            adapter = _map(options, wanted)
        tensors = dict(adapter.tensors)
        del adapter  # the LoRAModel's tensors alone keep the lease from here
        _check_modules(lora_dir, tensors, expected_lora_modules, peft_helper, kw)
        spec = kw.pop("moe_ep_spec", None)
        if spec is not None:
            from vllm.lora import lora_model

            remote = lora_model._is_remote_expert_key
            tensors = {k: v for k, v in tensors.items() if not remote(k, spec)}
        model_id = kw.pop("lora_model_id", None)
        if model_id is None:
            from vllm.lora.utils import get_lora_id

            model_id = get_lora_id()
        return cls.from_lora_tensors(
            lora_model_id=model_id, tensors=tensors, peft_helper=peft_helper, **kw
        )

    setattr(peft_from_local_dir, _MARK, True)
    PEFTHelper.from_local_dir = classmethod(peft_from_local_dir)
    LoRAModel.from_local_checkpoint = classmethod(lora_from_local_checkpoint)


def _map(options: LoRAOptions, wanted: SharedVersion) -> SharedAdapter:
    started = time.monotonic()
    adapter = map_adapter(
        options.target, wanted, timeout=options.timeout, max_bytes=options.max_bytes
    )
    log.info(
        "weightd: adapter %r version %d mapped from the daemon's pack %d (%s), verified, in %.3f s",
        wanted.name,
        wanted.version,
        adapter.pack_id,
        "built now" if adapter.built else "shared",
        time.monotonic() - started,
    )
    return adapter


def _check_modules(
    where: str,
    tensors: dict[str, Any],
    expected: set[str],
    peft_helper: Any,
    kw: dict[str, Any],
) -> None:
    """vLLM's check that every tensor targets a module the model can apply a LoRA to
    (``from_local_checkpoint``'s ``check_unexpected_modules``, with its rules)."""
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    mapper, skip = kw.get("weights_mapper"), kw.get("skip_prefixes")
    unexpected = []
    for name in tensors:
        if is_base_embedding_weights(name) or "base_layer" in name:
            continue
        if skip and any(f".{p}" in name or name.startswith(p) for p in skip):
            continue
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        if ".experts" in module:
            if module[module.find(".experts") + 1 :] not in expected:
                unexpected.append(module)
        elif module.rsplit(".", 1)[-1] not in expected and module.rsplit(".", 1)[-1] not in (
            peft_helper.modules_to_save or ()
        ):
            unexpected.append(module)
    if unexpected:
        raise ValueError(
            f"While loading {where}, expected target modules in {expected} but received "
            f"{unexpected}. Please verify that the loaded LoRA module is correct"
        )

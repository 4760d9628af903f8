"""Feeding a rank's shares through vLLM's own ``model.load_weights``.

vLLM's weight loaders expect the whole checkpoint tensor and cut the rank's part
themselves. weightd hands each worker only its part, so while the loader runs each
parameter's ``weight_loader`` is wrapped; a tensor marked as a share (:func:`mark`)
is loaded as already cut, every other tensor (whole: weightd replicates it) goes to
vLLM's loader unchanged, which cuts it as usual.

* Linear layers: vLLM's own loaders still place the share (the q/k/v and gate/up
  offsets inside fused parameters are theirs), told not to cut it again: plain
  parameters (biases) through vLLM's ``is_sharded_weight`` attribute, which its
  ``weight_loader`` methods honour; ``BasevLLMParameter`` weights, whose loaders
  always cut at ``tp_rank * shard_size`` (``is_sharded_weight`` is not read there),
  by presenting rank 0 for the duration of the call, so the cut of a share that is
  exactly the shard is the share itself. vLLM's shape assertions still apply.
* Vocabulary-parallel embeddings and heads: vLLM pads the vocabulary to a multiple
  of 64 and gives each rank ``padded / tp`` rows; its loader reads only the full
  vocabulary. The share (exactly the rank's ``[org_vocab_start, org_vocab_end)``
  rows, see ``vocab.py``) is copied into the first rows and the padding zeroed, as
  vLLM's loader does.

Wrappers are removed when loading ends, so a later reload with another loader sees
vLLM's own loaders.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import WeightdLoadError

#: Attribute set on a tensor weightd already cut for this rank.
SHARE_ATTR = "weightd_share"


def mark(tensor: torch.Tensor) -> torch.Tensor:
    setattr(tensor, SHARE_ATTR, True)
    return tensor


def is_share(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, SHARE_ATTR, False))


def _linear(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm.model_executor.parameter import BasevLLMParameter

    def load(param: torch.nn.Parameter, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not is_share(loaded):
            return original(param, loaded, *args, **kwargs)
        if isinstance(param, BasevLLMParameter):
            saved_rank = param.tp_rank
            param.tp_rank = 0
            try:
                return original(param, loaded, *args, **kwargs)
            finally:
                param.tp_rank = saved_rank
        had = "is_sharded_weight" in param.__dict__
        saved = getattr(param, "is_sharded_weight", False)
        param.is_sharded_weight = True  # type: ignore[attr-defined]
        try:
            return original(param, loaded, *args, **kwargs)
        finally:
            if had:
                param.is_sharded_weight = saved  # type: ignore[attr-defined]
            else:
                del param.is_sharded_weight  # type: ignore[attr-defined]

    return load


def _vocab(module: Any, original: Callable[..., Any], prefix: str) -> Callable[..., Any]:
    def load(param: torch.nn.Parameter, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not is_share(loaded):
            return original(param, loaded, *args, **kwargs)
        si = module.shard_indices
        rows = si.org_vocab_end_index - si.org_vocab_start_index
        if loaded.shape[0] != rows or tuple(loaded.shape[1:]) != tuple(param.data.shape[1:]):
            raise WeightdLoadError(
                f"{prefix}.weight: weightd sent a share of shape {list(loaded.shape)}, but "
                f"this rank holds vocabulary rows [{si.org_vocab_start_index}, "
                f"{si.org_vocab_end_index}) of width {list(param.data.shape[1:])}"
            )
        param.data[:rows].copy_(loaded)
        param.data[rows:].fill_(0)
        return None

    return load


@contextlib.contextmanager
def presharded_loading(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model.load_weights`` accepts shares marked with :func:`mark`."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    installed: list[tuple[torch.nn.Parameter, Callable[..., Any]]] = []
    seen: set[int] = set()
    try:
        for prefix, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                original = getattr(param, "weight_loader", None)
                if original is None or id(param) in seen:
                    continue  # vLLM's default_weight_loader: whole tensors only
                seen.add(id(param))
                if isinstance(module, VocabParallelEmbedding) and pname == "weight":
                    wrapped = _vocab(module, original, prefix)
                else:
                    wrapped = _linear(original)
                param.weight_loader = wrapped
                installed.append((param, original))
        yield
    finally:
        for param, original in reversed(installed):
            param.weight_loader = original


@contextlib.contextmanager
def presharded_reloading(model: torch.nn.Module) -> Iterator[None]:
    """:func:`presharded_loading` for a model inside vLLM's layer-wise reload.

    vLLM's ``initialize_layerwise_reload`` puts each layer back on the meta device and
    replaces every parameter's ``weight_loader`` with a buffering wrapper that, once a
    layer has all its weights, materializes it, calls the *original* loader (found by
    unwrapping) and re-runs the layer's post-processing (on CPU: the GEMM repacking
    that replaced the linear weights by empty parameters at start-up). A share must
    reach that original loader through this module's wrappers, so here each buffering
    wrapper is rebuilt around them (vLLM's own ``make_online_process_loader``, which
    takes the parameter's current loader as the original). The parameters that carry
    the rebuilt wrappers are the reload's (meta) ones and vLLM keeps them for the next
    reload: each gets back the loader it had when the block ends.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import (
        _get_original_loader,
        make_online_process_loader,
    )

    installed: list[tuple[torch.Tensor, Callable[..., Any]]] = []
    seen: set[int] = set()
    try:
        for prefix, module in model.named_modules():
            for pname, param in list(module.named_parameters(recurse=False)):
                current = getattr(param, "weight_loader", None)
                if current is None or id(param) in seen:
                    continue
                seen.add(id(param))
                original = _get_original_loader(param)
                if isinstance(module, VocabParallelEmbedding) and pname == "weight":
                    wrapped = _vocab(module, original, prefix)
                else:
                    wrapped = _linear(original)
                installed.append((param, current))
                param.weight_loader = wrapped
                if current is not original:  # vLLM buffers this layer: buffer around ours
                    param.weight_loader = make_online_process_loader(module, pname)
        yield
    finally:
        for param, loader in reversed(installed):
            param.weight_loader = loader


# --- parameters shared between modules (tied embeddings) ---------------------------------
#
# vLLM's layer-wise reload works module by module: each module's parameters go to the
# meta device, and once a module has received all its weights it is materialized,
# loaded, post-processed (``quant_method.process_weights_after_loading``: on CPU the
# GEMM packing) and copied back into its original parameters. A parameter held by two
# modules (``lm_head.tie_weights(embed_tokens)``: one ``Parameter`` in both) is loaded
# through one of them only (the model's ``load_weights`` skips ``lm_head.`` when tied);
# the other receives nothing, so the reload only puts its original parameter back and
# never re-runs its post-processing (the documented "Limitations 2" of vLLM 0.32's
# ``model_loader/reload``; its own ``reload_weights`` has the same fault). The shared
# parameter then holds the new weights while the idle module keeps state derived from
# the old ones: on vLLM's CPU build the tied head's packed GEMM computed the logits with
# the embedding the engine started with, across every update, while every named
# parameter read back new. A fresh engine post-processes every module after loading,
# in module order; :func:`reprocess_shared` does the same for the modules the reload
# left idle, after it. :func:`shared_problems` says, before any rank applies, where
# that cannot give a fresh engine's state.

#: Post-processing that is a function of the module's own parameters, which it leaves in
#: place (so re-running it after the reload gives exactly what a fresh start gives).
#: ``UnquantizedEmbeddingMethod``: none on GPU, on CPU the GEMM packed from ``weight``
#: (``remove_weight=False``). Others (quantized heads, CPU linear packing, which
#: replaces the parameter) are refused while they hold a shared parameter.
_REPEATABLE = ("UnquantizedEmbeddingMethod",)


def _shared_groups(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Module]]]:
    """Each parameter held by two or more modules: its holders (name, module), in order."""
    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for prefix, module in model.named_modules():
        for pname, param in module._parameters.items():
            if param is not None:
                name = f"{prefix}.{pname}" if prefix else pname
                holders.setdefault(id(param), []).append((name, module))
    return [group for group in holders.values() if len({id(m) for _, m in group}) > 1]


def shared_problems(model: torch.nn.Module) -> list[str]:
    """Why an update in place could not leave this model as a fresh engine: [] when it can.

    Checked before any rank stages a byte: a parameter shared between modules whose
    holders' post-processing is not known to be repeatable (see ``_REPEATABLE``), and a
    model-level post-load hook, which vLLM's reload never runs again.
    """
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    problems = []
    for group in _shared_groups(model):
        names = " = ".join(name for name, _ in group)
        for name, module in group:
            method = getattr(module, "quant_method", None)
            if isinstance(method, QuantizeMethodBase) and type(method).__name__ not in _REPEATABLE:
                problems.append(
                    f"{names} are one parameter and {name.rpartition('.')[0]}'s "
                    f"post-processing ({type(method).__name__}) cannot be re-run in place: "
                    "vLLM's layer-wise reload would leave it on the old weights"
                )
    if callable(getattr(model, "process_weights_after_loading", None)):
        problems.append(
            f"{type(model).__name__} post-processes its weights as a whole after loading, "
            "which vLLM's layer-wise reload does not run again"
        )
    return problems


def idle_modules(model: torch.nn.Module) -> set[int]:
    """The modules (ids) the running layer-wise reload has received nothing for so far.

    Call between ``model.load_weights`` and ``finalize_layerwise_reload``: a module that
    received all its weights was processed and reset; one that received some is
    processed by the finalize; one that received none only gets its parameters back.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    idle = set()
    for module in model.modules():
        info = get_layerwise_info(module)
        if info.can_load() and info.load_numel == 0:
            idle.add(id(module))
    return idle


def reprocess_shared(model: torch.nn.Module, idle: set[int]) -> list[str]:
    """Post-process again, in model order, each idle module that shares a parameter with a
    module the reload loaded: what a fresh start does after loading. Returns their names.
    """
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    redo: dict[int, tuple[str, torch.nn.Module]] = {}
    for group in _shared_groups(model):
        if all(id(m) in idle for _, m in group):
            continue  # nobody loaded it: the parameter did not change
        for name, module in group:
            if id(module) in idle:
                redo[id(module)] = (name.rpartition(".")[0], module)
    done = []
    for _, module in model.named_modules():
        if id(module) not in redo:
            continue
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
        done.append(redo[id(module)][0])
    return done

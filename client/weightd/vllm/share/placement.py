"""Where this vLLM worker sits: its weightd ``Layout`` from vLLM's parallel state.

Read in the worker process, after vLLM initialised its process groups: the
tensor-parallel rank and size, and the pipeline stage with vLLM's own layer split
(``get_pp_indices``, which honours ``VLLM_PP_LAYER_PARTITION``), passed explicitly
as ``pp_layers`` so the daemon cuts exactly the stages vLLM built.

Expert parallelism is refused: vLLM's fused-MoE layers map experts to ranks with
their own expert map, which this loader does not translate yet; a clear error is
better than experts loaded into the wrong slots.
"""

from __future__ import annotations

from typing import Any

from weightd.client import Layout

from ..errors import WeightdLoadError


def stage_layers(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Layers per pipeline stage as vLLM splits them."""
    from vllm.distributed.utils import get_pp_indices

    out = []
    for rank in range(pp_size):
        start, stop = get_pp_indices(num_layers, rank, pp_size)
        out.append(stop - start)
    return tuple(out)


def worker_layout(model_config: Any) -> Layout:
    """This worker's layout, from vLLM's process groups and its parallel config."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed import parallel_state as ps

    config = get_current_vllm_config_or_none()
    if config is not None and getattr(config.parallel_config, "enable_expert_parallel", False):
        raise WeightdLoadError(
            "load_format 'weightd' does not support expert parallelism "
            "(enable_expert_parallel) yet; load this model without it"
        )
    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    pp = ps.get_pp_group()
    pp_size, pp_rank = pp.world_size, pp.rank_in_group
    pp_layers: tuple[int, ...] = ()
    if pp_size > 1:
        num_layers = model_config.hf_config.num_hidden_layers
        pp_layers = stage_layers(num_layers, pp_size)
    return Layout(
        tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank, pp_layers=pp_layers
    )

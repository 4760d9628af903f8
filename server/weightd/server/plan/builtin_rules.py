"""The built-in rules tables, written as the JSON a ``--rules`` file holds. Pure data.

Megatron-style tensor parallelism throughout: q/k/v/gate/up projections are
column-parallel (output dim), o/down projections row-parallel (input dim, their
biases replicated), embeddings and lm_head vocab-parallel, norms and rotary
buffers replicated. Heads are never cut: q/o by whole query heads; k/v by whole kv
heads, and past the kv-head count each rank gets the one kv head its query heads
use (``rank // (tp / num_kv_heads)``, as vLLM and Megatron). Phi-3's fused
``qkv_proj`` gives each rank its own q, k and v heads; fused ``gate_up_proj`` splits
each half separately. Experts (Mixtral ``block_sparse_moe.experts.N.w1/w2/w3``,
Qwen-MoE / DeepSeek ``mlp.experts.N.*_proj``, and transformers v5's stacked
``mlp.experts.gate_up_proj`` / ``down_proj``) follow expert parallelism, with tensor
parallelism inside each expert; routers and shared-expert gates are replicated,
shared experts are split like a dense MLP.

Every projection rule also covers the quantized forms of its module (GPTQ/AWQ
``qweight``/``qzeros``/``scales``/``g_idx``, FP8 ``weight_scale_inv``): the planner
knows how each of those lays out the module's weight (see ``quant``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from .rules import ArchRules, Rule, RuleTable
from .rules_file import parse_table

#: A linear module's tensors, without / with its bias.
W: Final = r"(weight|qweight|qzeros|scales|g_idx|weight_scale_inv|weight_scale|input_scale)"
P: Final = r"(weight|bias|qweight|qzeros|scales|g_idx|weight_scale_inv|weight_scale|input_scale)"

_ATTENTION: Final = [
    {"match": rf"\.self_attn\.q_proj\.{P}$", "split": "q_heads"},
    {"match": rf"\.self_attn\.(k_proj|v_proj)\.{P}$", "split": "kv_heads"},
    {"match": rf"\.self_attn\.o_proj\.{W}$", "split": "o_heads"},
]
_DENSE_MLP: Final = [
    {"match": rf"\.mlp\.(gate_proj|up_proj)\.{P}$", "split": "column"},
    {"match": rf"\.mlp\.down_proj\.{W}$", "split": "row"},
]
_MODEL: Final = [
    {"match": r"\.(o_proj|down_proj)\.bias$", "split": "replicated"},
    {"match": r"(^|\.)embed_tokens\.weight$", "split": "vocab", "stage": "embedding"},
    {"match": r"(^|\.)lm_head\.weight$", "split": "vocab", "stage": "head"},
    {"match": r"(^|\.)[a-z_]*norm\.(weight|bias)$", "split": "replicated", "stage": "last"},
    {"match": r"(^|\.)rotary_emb\.inv_freq$", "split": "replicated", "stage": "all"},
]
_E: Final = r"\.(block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
_MOE: Final = [
    {
        "match": r"\.(block_sparse_moe|mlp)\.gate\.(weight|e_score_correction_bias)$",
        "split": "replicated",
    },
    {"match": r"\.mlp\.shared_expert_gate\.weight$", "split": "replicated"},
    {"match": rf"{_E}(w1|w3|gate_proj|up_proj)\.{P}$", "split": "column"},
    {"match": rf"{_E}(w2|down_proj)\.{W}$", "split": "row"},
    {"match": rf"{_E}(w2|down_proj)\.bias$", "split": "replicated"},
    {"match": r"\.mlp\.experts\.gate_up_proj$", "split": "fused_column", "experts": "stacked"},
    {"match": r"\.mlp\.experts\.down_proj$", "split": "row", "experts": "stacked"},
    {"match": rf"\.mlp\.shared_experts?\.(gate_proj|up_proj)\.{P}$", "split": "column"},
    {"match": rf"\.mlp\.shared_experts?\.down_proj\.{W}$", "split": "row"},
]

LLAMA_DOC: Final[dict[str, Any]] = {
    "family": "llama",
    "architectures": [
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ],
    "model_types": ["llama", "mistral", "qwen2", "qwen3"],
    "attention": {},
    "rules": [*_ATTENTION, *_DENSE_MLP, *_MODEL],
}
GEMMA_DOC: Final[dict[str, Any]] = {
    "family": "gemma",
    "architectures": ["GemmaForCausalLM", "Gemma2ForCausalLM"],
    "model_types": ["gemma", "gemma2"],
    "attention": {},
    "rules": [*_ATTENTION, *_DENSE_MLP, *_MODEL],
}
PHI3_DOC: Final[dict[str, Any]] = {
    "family": "phi3",
    "architectures": ["Phi3ForCausalLM"],
    "model_types": ["phi3"],
    "attention": {},
    "rules": [
        {"match": rf"\.self_attn\.qkv_proj\.{P}$", "split": "qkv_heads"},
        {"match": rf"\.self_attn\.o_proj\.{W}$", "split": "o_heads"},
        {"match": rf"\.mlp\.gate_up_proj\.{P}$", "split": "fused_column", "parts": 2},
        {"match": rf"\.mlp\.down_proj\.{W}$", "split": "row"},
        *_MODEL,
    ],
}
MIXTRAL_DOC: Final[dict[str, Any]] = {
    "family": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "model_types": ["mixtral"],
    "attention": {},
    "experts": {"count": "num_local_experts"},
    "rules": [*_ATTENTION, *_MOE, *_DENSE_MLP, *_MODEL],
}
QWEN_MOE_DOC: Final[dict[str, Any]] = {
    "family": "qwen-moe",
    "architectures": ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"],
    "model_types": ["qwen2_moe", "qwen3_moe"],
    "attention": {},
    "experts": {"count": ["num_experts", "num_local_experts"]},
    "rules": [*_ATTENTION, *_MOE, *_DENSE_MLP, *_MODEL],
}

BUILTIN_DOCS: Final = (LLAMA_DOC, GEMMA_DOC, PHI3_DOC, MIXTRAL_DOC, QWEN_MOE_DOC)
BUILTIN_TABLES: Final[tuple[RuleTable, ...]] = tuple(
    parse_table(doc, f"built-in:{doc['family']}") for doc in BUILTIN_DOCS
)
LLAMA_TABLE: Final = BUILTIN_TABLES[0]
LLAMA_FAMILY_RULES: Final[tuple[Rule, ...]] = LLAMA_TABLE.rules
LLAMA_FAMILY_ARCHITECTURES: Final = LLAMA_TABLE.architectures
LLAMA_FAMILY_MODEL_TYPES: Final = LLAMA_TABLE.model_types


def table_for(config: Mapping[str, Any], tables: Iterable[RuleTable] = ()) -> RuleTable | None:
    """The table for a config: the user's tables first, then the built-ins."""
    for table in (*tables, *BUILTIN_TABLES):
        if table.applies_to(config):
            return table
    return None


def rules_for(config: Mapping[str, Any], tables: Sequence[RuleTable] = ()) -> ArchRules | None:
    """The sharding rules for a config, or None when its architecture has none.

    The architecture is ``config["architectures"][0]``; only a config without it is
    matched by ``model_type``.
    """
    table = table_for(config, tables)
    return None if table is None else table.bind(config)

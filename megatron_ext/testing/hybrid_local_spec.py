"""A megatron-core HybridModel stack spec of local modules, for ``pretrain_hybrid.py`` on CPU ranks.

    pretrain_hybrid.py ... --spec megatron_ext.testing.hybrid_local_spec hybrid_local_stack_spec
        --hybrid-layer-pattern '*-*-'

megatron-core's own hybrid specs (``megatron.core.models.hybrid.hybrid_layer_specs``) are built
of Transformer Engine modules, which a CPU run does not have. This one has the layers a pattern
without Mamba needs (``*`` attention, ``-`` MLP), each assembled from megatron-core's local GPT
layer (``get_gpt_layer_local_submodules``): the attention layer takes its norm and attention, the
MLP layer its norm and MLP, each with the local layer's checkpoint names for its norm (Transformer
Engine's, as megatron-core's local GPT layer maps them). ``HybridStack`` builds its final norm as Transformer Engine's
``TENorm`` whatever the spec says; without Transformer Engine that name is bound, when this
module is imported, to the local layer's norm.
"""

from __future__ import annotations

from megatron.core.extensions import transformer_engine
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.models.hybrid import hybrid_block
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

_LOCAL = get_gpt_layer_local_submodules()
#: The local GPT layer's checkpoint names for its norms: those of Transformer Engine's fused norm + linear
#: modules, so checkpoints of local and TE models (GPT or hybrid) name the same tensors alike.
_NORM_KEYS = _LOCAL.sharded_state_dict_keys_map

if not transformer_engine.HAVE_TE:
    hybrid_block.TENorm = _LOCAL.input_layernorm

hybrid_local_stack_spec = ModuleSpec(
    module=HybridStack,
    submodules=HybridStackSubmodules(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=_LOCAL.input_layernorm, self_attention=_LOCAL.self_attention,
            self_attn_bda=_LOCAL.self_attn_bda, sharded_state_dict_keys_map=_NORM_KEYS)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=_LOCAL.pre_mlp_layernorm, mlp=_LOCAL.mlp, mlp_bda=_LOCAL.mlp_bda,
            sharded_state_dict_keys_map=_NORM_KEYS)),
    ),
)

"""The one table of op classes: which ops are matmuls, convolutions and fused attention.

The estimators (``passes/costing.py``) tag each CostGraph node from it; solvers read the tags
(``Node.tags``), never op names. Keys are short op names, an aten overload packet's name
(``addmm``, ``_scaled_dot_product_flash_attention``) or an fx target's (``linear``, ``matmul``).
Torch-free, so that a CostGraph built by hand (the solvers' tests) is tagged the same way.

Tags this table gives (beside the estimators' own: ``attention``, ``skip``, ``random``,
``inplace``, ``batchnorm``, ``view``):

- ``matmul``: a matmul, convolution or fused attention, whatever its output's size;
- ``weight_matmul``: of those, the ones that multiply by a weight (linear, addmm, mm, the
  convolutions of ``CONVOLUTION_OPS``): their outputs are worth keeping (Megatron's selective
  recomputation);
- ``fused_attention``: a fused attention kernel (its output is not the S x S scores).
"""

from __future__ import annotations

from planner.solvers.costgraph import CostGraph, Node

MATMUL = "matmul"
WEIGHT_MATMUL = "weight_matmul"
FUSED_ATTENTION = "fused_attention"

# The forward convolutions, by exact name: the generic ops, the functional ones an fx graph
# names, and each backend's kernel. Named one by one because a substring rule ("conv") also
# catches casts (convert_element_type) and index conversions, which selective regions would
# then keep as if they were matmuls.
CONVOLUTION_OPS = frozenset(
    {
        "convolution", "_convolution", "_convolution_mode", "convolution_overrideable",
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "conv_tbc", "_conv_depthwise2d", "conv_depthwise3d",
        "cudnn_convolution", "cudnn_convolution_transpose", "cudnn_convolution_relu",
        "cudnn_convolution_add_relu", "miopen_convolution", "miopen_convolution_transpose",
        "miopen_depthwise_convolution", "miopen_convolution_relu", "miopen_convolution_add_relu",
        "mkldnn_convolution", "_mps_convolution", "_mps_convolution_transpose",
        "_nnpack_spatial_convolution", "_slow_conv2d_forward", "thnn_conv2d", "slow_conv3d",
        "slow_conv3d_forward", "slow_conv_dilated2d", "slow_conv_dilated3d",
        "slow_conv_transpose2d", "slow_conv_transpose3d",
    }
)  # fmt: skip
# Multiply by a weight (exact names).
WEIGHT_MATMUL_OPS = frozenset({"linear", "addmm", "mm", *CONVOLUTION_OPS})
# Multiply two activations (matched within the name: "bmm" also finds "baddbmm").
PAIR_MATMUL_OPS = ("matmul", "bmm", "baddbmm", "einsum")
FUSED_ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention")
# The ops that may compute attention scores, an (S, S)-ended output (exact names).
SCORE_OPS = frozenset({"mm", *PAIR_MATMUL_OPS})


def is_fused_attention(name: str) -> bool:
    """A fused attention op, for the ``attention`` tag (the S x S-memory family)."""
    return "scaled_dot_product" in name or "attention" in name


def op_class_tags(name: str) -> set[str]:
    """The tags op ``name`` earns by its class alone (module docstring)."""
    tags = set()
    fused = any(p in name for p in FUSED_ATTENTION_OPS)
    if name in WEIGHT_MATMUL_OPS:
        tags |= {WEIGHT_MATMUL, MATMUL}
    if fused:
        tags |= {FUSED_ATTENTION, MATMUL}
    if any(p in name for p in PAIR_MATMUL_OPS):
        tags.add(MATMUL)
    return tags


def short_op_name(op: str) -> str:
    """``aten.addmm.default`` -> ``addmm``: the table's key for a node's ``op``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else op


def out_bytes(graph: CostGraph) -> list[int]:
    out = [0] * len(graph.nodes)
    for t in graph.tensors:
        out[t.producer] += t.size_bytes
    return out


def is_matmul(graph: CostGraph, i: int) -> bool:
    """A matmul, convolution or fused attention, whatever its output's size (its tags, from
    ``solvers/op_classes.py``)."""
    return MATMUL in graph.nodes[i].tags


def worth_keeping(graph: CostGraph, i: int, produced: list[int]) -> bool:
    """A weight matmul or convolution, or an activation matmul that does not blow up the size
    (attention's q @ k^T is S x S: recomputed; att @ v is not: kept)."""
    node: Node = graph.nodes[i]
    if "attention" in node.tags and FUSED_ATTENTION not in node.tags:
        return False
    if WEIGHT_MATMUL in node.tags:
        return True
    if MATMUL in node.tags:
        read = sum(produced[j] for j in node.inputs)
        return produced[i] <= max(read, 1)
    return False

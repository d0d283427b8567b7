"""Where a node came from: the PyTorch module the exporter traced it from.

torch.onnx records each node's module scopes in its metadata
(``pkg.torch.onnx.name_scopes`` / ``class_hierarchy``); reports, miss reasons and the KV-cache
pass name layers by it. Reading it needs no torch.
"""

from __future__ import annotations

import ast

import onnx_ir as ir

# Leaf modules that only hold an op (nn.Softmax, nn.Dropout, ...): a report names their owner.
_OP_MODULES = ("torch.nn.modules.activation.", "torch.nn.modules.dropout.")


def _literal_list(node: ir.Node, key: str) -> list[str]:
    text = node.metadata_props.get(key)
    if not text:
        return []
    try:
        return list(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return []


def module_name(node: ir.Node) -> str:
    """The PyTorch module path a node was traced from (``blocks.0.attn``), or ``""``.

    Each name scope is already a full module path and the last one is the op itself; an
    op-holding leaf such as ``nn.Softmax`` is skipped in favour of the module that owns it.
    """
    scopes = _literal_list(node, "pkg.torch.onnx.name_scopes")[:-1]
    classes = _literal_list(node, "pkg.torch.onnx.class_hierarchy")[:-1]
    if len(classes) == len(scopes):
        while len(scopes) > 1 and classes[-1].startswith(_OP_MODULES):
            scopes, classes = scopes[:-1], classes[:-1]
    return scopes[-1] if scopes else ""


def layer_name(node: ir.Node) -> str:
    """The module name, else the node's own name or op type: how errors name a layer."""
    return module_name(node) or node.name or node.op_type

"""Custom losses uploaded with ``create_custom_loss`` (spec §2 #24, §3.11): what a loss program may
contain, and its validation (no torch here, so the API checks an upload before storing it; the
engine runs programs with :mod:`ember.engine.custom_loss`).

A program is the node list of a ``torch.fx`` trace of a per-datum loss
``fn(logprobs, *inputs) -> (loss, {"custom/<name>:sum|mean": tensor})``, in execution order:
``placeholder`` nodes for the parameters, ``call_function`` nodes whose target is a qualified name
(``torch.exp``, ``operator.mul``), ``call_method`` nodes (tensor methods) and one ``output``. Arguments
are JSON with one-key objects for node references and Python constants. Nothing in a program is
executable: the engine maps each name through the tables below, and anything not listed is refused.
"""

from __future__ import annotations

import math
import re
from typing import Any

FORMAT = 1
MAX_NODES = 2000
MAX_INPUTS = 16
MAX_ARG_DEPTH = 8
MAX_LIST_LEN = 64
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
KWARG = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
DICT_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:-]{0,99}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")

# Pure tensor math: elementwise, reductions, comparisons, shape and selection. No function here
# reads or writes files, moves data off the device, or changes global state.
_TORCH = """
abs exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square reciprocal sigmoid tanh sinh cosh atan erf
sign neg pow mul add sub div true_divide floor ceil round clamp clip clamp_min clamp_max minimum maximum
lerp relu where masked_fill nan_to_num isfinite isnan eq ne gt ge lt le logical_and logical_or
logical_not logical_xor sum mean prod cumsum std var min max amin amax argmax argmin any all
count_nonzero logsumexp softmax log_softmax sort topk gather index_select narrow flip diff stack cat
matmul outer squeeze unsqueeze reshape transpose permute flatten broadcast_to numel zeros_like ones_like
full_like tensor zeros ones full arange
""".split()  # noqa: SIM905 - a table, read as words
_NN = "log_sigmoid softplus gelu one_hot".split()  # noqa: SIM905 - torch._C._nn, what torch.nn.functional calls
_FUNCTIONAL = """
relu log_softmax softmax sigmoid silu mse_loss smooth_l1_loss huber_loss kl_div normalize
binary_cross_entropy_with_logits
""".split()  # noqa: SIM905
_OPERATOR = """
add sub mul truediv floordiv mod pow neg pos abs getitem eq ne lt le gt ge and_ or_ xor invert matmul
""".split()  # noqa: SIM905
_MATH = "log log1p exp expm1 sqrt tanh pow fabs floor ceil".split()  # noqa: SIM905
# Qualified names as torch.fx records them (``torch.fx.node._get_qualified_name``).
FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.{n}" for n in _TORCH]
    + ["torch.functional.einsum", "torch._C._special.special_expit", "getattr"]
    + [f"torch._C._nn.{n}" for n in _NN]
    + [f"torch.nn.functional.{n}" for n in _FUNCTIONAL]
    + [f"operator.{n}" for n in _OPERATOR]
    + [f"math.{n}" for n in _MATH]
)

# Tensor methods: the same math (out-of-place only: no ``_``-suffixed in-place methods, which would
# write into the inputs), dtype conversions and views.
_TENSOR_ONLY = """
view view_as reshape_as expand expand_as repeat contiguous clone detach t float double half bfloat16 long
int bool to type_as size dim new_zeros new_ones new_full
""".split()  # noqa: SIM905 - a table, read as words
_NOT_METHODS = ("tensor", "zeros", "ones", "full", "arange", "zeros_like", "ones_like", "full_like", "stack", "cat")
METHODS: frozenset[str] = frozenset([n for n in _TORCH if n not in _NOT_METHODS] + _TENSOR_ONLY)
# Attributes ``getattr`` may read.
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T", "mT", "values", "indices"})  # indices: of max/sort/topk
DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"})
LAYOUTS = frozenset({"strided"})
MEMORY_FORMATS = frozenset({"contiguous_format", "preserve_format"})


# argument kinds whose value is a name (checked by shape before it is looked up)
_TEXT_KINDS = frozenset({"ref", "float", "dtype", "device", "layout", "memory_format"})


class ProgramError(ValueError):
    """The upload is not a valid custom loss (the message says what and where)."""


def _check_arg(arg: Any, known: set[str], where: str, depth: int = 0) -> None:
    """Check one encoded argument: references to earlier nodes only, constants from the tables."""
    if depth > MAX_ARG_DEPTH:
        raise ProgramError(f"{where}: arguments nest deeper than {MAX_ARG_DEPTH}")
    if arg is None or isinstance(arg, (bool, int, str)):
        return
    if isinstance(arg, float):
        if not math.isfinite(arg):
            raise ProgramError(f"{where}: non-finite float {arg} must be encoded as {{'float': ...}}")
        return
    if isinstance(arg, list):
        if len(arg) > MAX_LIST_LEN:
            raise ProgramError(f"{where}: a list argument has more than {MAX_LIST_LEN} items")
        for a in arg:
            _check_arg(a, known, where, depth + 1)
        return
    if not (isinstance(arg, dict) and len(arg) == 1):
        raise ProgramError(f"{where}: cannot read argument {arg!r}")
    ((kind, value),) = arg.items()
    if kind in _TEXT_KINDS and not isinstance(value, str):
        raise ProgramError(f"{where}: a {kind!r} argument must be a string, got {type(value).__name__}")
    if kind == "ref":
        if value not in known:
            raise ProgramError(f"{where}: refers to {value!r}, which is not an earlier node")
    elif kind in ("tuple", "slice"):
        if not isinstance(value, list) or (kind == "slice" and len(value) != 3):
            raise ProgramError(f"{where}: bad {kind} {value!r}")
        _check_arg(value, known, where, depth + 1)
    elif kind == "dict":
        if not isinstance(value, dict) or len(value) > MAX_LIST_LEN or not all(DICT_KEY.fullmatch(k) for k in value):
            raise ProgramError(f"{where}: bad dict {value!r} (keys: letters, digits and _./:-)")
        for a in value.values():
            _check_arg(a, known, where, depth + 1)
    elif kind == "ellipsis":
        if value is not True:
            raise ProgramError(f"{where}: bad ellipsis {value!r}")
    elif kind == "float":
        if value not in ("inf", "-inf", "nan"):
            raise ProgramError(f"{where}: bad float {value!r}")
    elif kind == "dtype":
        if value not in DTYPES:
            raise ProgramError(f"{where}: dtype {value!r} is not one of {sorted(DTYPES)}")
    elif kind == "device":
        if not isinstance(value, str):
            raise ProgramError(f"{where}: bad device {value!r}")
    elif kind == "layout":
        if value not in LAYOUTS:
            raise ProgramError(f"{where}: layout {value!r} is not supported")
    elif kind == "memory_format":
        if value not in MEMORY_FORMATS:
            raise ProgramError(f"{where}: memory format {value!r} is not supported")
    else:
        raise ProgramError(f"{where}: unknown argument kind {kind!r}")


def _check_output(args: list, name: str) -> None:
    out = args[0] if len(args) == 1 else None
    if isinstance(out, dict) and "tuple" in out:
        out = out["tuple"]
    if not (isinstance(out, list) and len(out) == 2):
        raise ProgramError(f"loss {name!r} must return (loss, metrics)")
    loss, metrics = out
    if not (isinstance(loss, dict) and "ref" in loss):
        raise ProgramError(f"loss {name!r} must return its loss as a tensor")
    if not (isinstance(metrics, dict) and set(metrics) == {"dict"} and isinstance(metrics["dict"], dict)):
        raise ProgramError(f"loss {name!r} must return its metrics as a dict")
    for key, value in metrics["dict"].items():
        if not METRIC_KEY.fullmatch(key):
            raise ProgramError(f"loss {name!r}: metric {key!r} must be named custom/<name>:sum or custom/<name>:mean")
        if not (isinstance(value, dict) and "ref" in value):
            raise ProgramError(f"loss {name!r}: metric {key!r} must be a tensor")


def validate_program(name: str, inputs: list[dict], graph: dict) -> dict:
    """Check an uploaded loss (``create_custom_loss``'s ``name``, ``inputs`` and ``graph``) and
    return it as Ember stores it: ``{"name", "inputs": [{"name", "rank"}], "nodes": [...]}``.
    Raises :class:`ProgramError` with the reason."""
    if not isinstance(name, str) or not 0 < len(name) <= 200:
        raise ProgramError("name must be a non-empty string of at most 200 characters")
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise ProgramError(f"inputs must list 1 to {MAX_INPUTS} inputs, logprobs first")
    clean_inputs = []
    for i, x in enumerate(inputs):
        if not (isinstance(x, dict) and isinstance(x.get("name"), str) and INPUT_NAME.fullmatch(x["name"])):
            raise ProgramError(f"inputs[{i}] must have a lowercase identifier name")
        rank = x.get("rank")
        if rank not in (0, 1, 2) or isinstance(rank, bool):
            raise ProgramError(f"inputs[{i}] ({x['name']}): rank must be 0, 1 or 2")
        clean_inputs.append({"name": x["name"], "rank": rank})
    if clean_inputs[0]["name"] != "logprobs" or clean_inputs[0]["rank"] == 0:
        raise ProgramError("the first input must be logprobs, with rank 1 ([T]) or 2 ([T, K])")
    if len({x["name"] for x in clean_inputs}) != len(clean_inputs):
        raise ProgramError("input names must be distinct")
    if not isinstance(graph, dict) or graph.get("format") != FORMAT:
        raise ProgramError(f"graph format must be {FORMAT}")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes or len(nodes) > MAX_NODES:
        raise ProgramError(f"graph must have 1 to {MAX_NODES} nodes")
    known: set[str] = set()
    placeholders: list[str] = []
    clean_nodes = []
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            raise ProgramError(f"node {i} is not an object")
        op, node_name, target = node.get("op"), node.get("name"), node.get("target")
        args, kwargs = node.get("args", []), node.get("kwargs", {})
        where = f"node {i} ({node_name!r})"
        if not (isinstance(node_name, str) and NODE_NAME.fullmatch(node_name)) or node_name in known:
            raise ProgramError(f"{where}: node names must be unique identifiers")
        if not isinstance(target, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ProgramError(f"{where}: needs a string target, a list of args and a dict of kwargs")
        if op == "placeholder":
            if clean_nodes and clean_nodes[-1]["op"] != "placeholder":
                raise ProgramError(f"{where}: placeholders must come first")
            placeholders.append(target)
        elif op == "call_function":
            if target not in FUNCTIONS:
                raise ProgramError(f"{where}: function {target!r} is not allowed in a custom loss")
            if target == "getattr" and (len(args) != 2 or not isinstance(args[1], str) or args[1] not in ATTRIBUTES):
                raise ProgramError(f"{where}: getattr may read only {sorted(ATTRIBUTES)}")
        elif op == "call_method":
            if target not in METHODS:
                raise ProgramError(f"{where}: tensor method {target!r} is not allowed in a custom loss")
            if not args:
                raise ProgramError(f"{where}: a method call needs the tensor it is called on")
        elif op == "output":
            if i != len(nodes) - 1:
                raise ProgramError(f"{where}: the output node must be the last")
            _check_output(args, name)
        else:
            raise ProgramError(f"{where}: {op!r} nodes are not allowed (only torch functions and tensor methods)")
        _check_arg(args, known, where)
        _check_arg(list(kwargs.values()), known, where)
        if not all(KWARG.fullmatch(k) for k in kwargs):
            raise ProgramError(f"{where}: keyword names must be identifiers")
        known.add(node_name)
        clean_nodes.append({"op": op, "name": node_name, "target": target, "args": args, "kwargs": kwargs})
    if clean_nodes[-1]["op"] != "output":
        raise ProgramError("the graph must end with an output node")
    if placeholders != [x["name"] for x in clean_inputs]:
        raise ProgramError(
            f"graph parameters {placeholders} must equal the declared inputs {[x['name'] for x in clean_inputs]}"
        )
    return {"name": name, "inputs": clean_inputs, "nodes": clean_nodes}

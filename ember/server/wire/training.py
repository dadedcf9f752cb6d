"""Training wire codec: Tinker's protobuf ``ForwardBackwardRequest`` -> Ember's internal request
(validated), and internal results -> protobuf ``ForwardBackwardOutput`` (spec §3.2-3.6)."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from ember.lossdefs import LOSS_SPECS, LossSpec, resolve_loss_config
from ember.server.wire import tinker_proto as pb
from ember.server.wire.schemas import text_problem

FLOAT_INPUTS = ("weights", "logprobs", "advantages", "clip_low_threshold", "clip_high_threshold", "sequence_ratio_mask")
_NP_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32, pb.DTYPE_BFLOAT16: np.uint16}


class WireError(ValueError):
    """A malformed or invalid request; the message names the field (HTTP 400)."""


@dataclass(frozen=True)
class ModelLimits:
    """What the API checks requests against: vocabulary size and longest sequence."""

    vocab_size: int
    max_seq_len: int


@dataclass
class DecodedForwardBackward:
    model_id: str
    seq_id: int
    forward_only: bool
    loss_fn: str
    payload: dict  # internal request (ember.store.payload-encodable)
    n_tokens: int


def decompress_zstd(body: bytes, limit: int) -> bytes:
    """Decode a ``Content-Encoding: zstd`` body, refusing more than ``limit`` bytes of output."""
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            out = reader.read(limit + 1)
    except zstandard.ZstdError as e:
        raise WireError(f"body is not valid zstd: {e}") from None
    if len(out) > limit:
        raise OverflowError(f"decompressed body exceeds {limit} bytes")
    return out


def zstd_prefix(body: bytes, size: int = 4096) -> bytes:
    """The first ``size`` bytes (or fewer) that the start of a zstd stream decodes to."""
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            return reader.read(size)
    except zstandard.ZstdError:
        return b""


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(data) or shift > 63:
            raise IndexError
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i


def leading_ids(prefix: bytes) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` from the first bytes of a serialised ``ForwardBackwardRequest``
    (fields 1 and 2 come before the data: a body too large to read whole still names its request),
    or None if the prefix does not hold both."""
    model_id, seq_id, i = None, None, 0
    try:
        while i < len(prefix) and (model_id is None or seq_id is None):
            tag, i = _varint(prefix, i)
            if tag == (1 << 3) | 2:  # model_id: length-delimited
                n, i = _varint(prefix, i)
                if i + n > len(prefix):
                    return None
                model_id, i = prefix[i : i + n].decode(), i + n
                if text_problem(model_id) is not None:
                    return None
            elif tag == (2 << 3) | 0:  # seq_id: varint
                seq_id, i = _varint(prefix, i)
            else:
                return None
    except (IndexError, UnicodeDecodeError):
        return None
    if model_id is None or seq_id is None or seq_id >= 1 << 31:  # negative int32s are 10-byte varints
        return None
    return model_id, seq_id


def parse_forward_backward(body: bytes) -> object:
    """The protobuf message, or ``WireError``."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise WireError(f"malformed protobuf ForwardBackwardRequest: {e}") from None
    if (problem := text_problem(msg.model_id)) is not None:
        raise WireError(f"model_id {problem}")
    return msg


def _tensor(t, where: str) -> np.ndarray:
    dtype = _NP_DTYPES.get(t.dtype)
    if dtype is None:
        raise WireError(f"{where}: unsupported dtype enum {t.dtype}; use float32 or int64")
    shape = [int(s) for s in t.shape]
    if len(shape) > 4 or any(not 0 <= s < 1 << 31 for s in shape):
        raise WireError(f"{where}: shape {shape} must have at most 4 sizes, each between 0 and 2^31")
    try:
        if t.HasField("sparse_csr"):
            if len(shape) != 2:
                raise WireError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
            values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
            crow = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
            rows, cols = shape
            if crow.size != rows + 1 or col.size != values.size or (col.size and (col.min() < 0 or col.max() >= cols)):
                raise WireError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
            if crow[0] != 0 or crow[-1] != values.size or np.any(np.diff(crow) < 0):
                raise WireError(f"{where}: sparse CSR row offsets are not monotone from 0 to nnz")
            dense = np.zeros(shape, dtype=dtype)
            row_of = np.repeat(np.arange(rows), np.diff(crow))
            dense[row_of, col] = values
            arr = dense
        else:
            arr = np.frombuffer(t.dense, dtype=dtype)
            if shape:
                if int(np.prod(shape)) != arr.size:
                    raise WireError(f"{where}: {arr.size} values do not fill shape {shape}")
                arr = arr.reshape(shape)
    except ValueError as e:
        if isinstance(e, WireError):
            raise
        raise WireError(f"{where}: bad tensor bytes ({e})") from None
    if t.dtype == pb.DTYPE_BFLOAT16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def _loss_config(msg) -> dict[str, float | str]:
    if len(msg.loss_fn_config_v2):
        out: dict[str, float | str] = {}
        for k, v in msg.loss_fn_config_v2.items():
            out[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
        return out
    return {k: float(v) for k, v in msg.loss_fn_config.items()}


def custom_loss_id(msg) -> str | None:
    """The ``loss_id`` of a ``loss_fn="custom"`` request (``loss_fn_config_v2``), None for other losses."""
    if msg.loss_fn != "custom":
        return None
    loss_id = _loss_config(msg).get("loss_id")
    if not isinstance(loss_id, str) or not loss_id:
        raise WireError("loss_fn 'custom' needs loss_fn_config_v2 {'loss_id': <text>} from create_custom_loss")
    if (problem := text_problem(loss_id)) is not None:
        raise WireError(f"loss_fn_config_v2.loss_id {problem}")
    return loss_id


def decode_forward_backward(msg, limits: ModelLimits, custom_loss: dict | None = None) -> DecodedForwardBackward:
    """Validate a ``ForwardBackwardRequest`` and turn it into Ember's internal request.
    ``custom_loss``: for ``loss_fn="custom"``, the stored program its ``loss_id`` names."""
    loss_fn = msg.loss_fn
    if loss_fn == "custom":
        if custom_loss is None:
            raise WireError("loss_fn 'custom' needs a loss created with create_custom_loss")
        return _decode_data(msg, limits, "custom", {}, custom_loss)
    if loss_fn not in LOSS_SPECS:
        raise WireError(f"loss_fn {loss_fn!r} is not supported; supported: {sorted(LOSS_SPECS)} or 'custom' "
                        "(create_custom_loss)")
    raw_config = _loss_config(msg)
    numeric = {}
    for k, v in raw_config.items():
        if isinstance(v, str):
            raise WireError(f"loss_fn_config[{k!r}] must be a number for loss_fn {loss_fn!r}, got text {v!r}")
        if not math.isfinite(v):
            raise WireError(f"loss_fn_config[{k!r}] must be finite, got {v}")
        numeric[k] = v
    try:
        config = resolve_loss_config(loss_fn, numeric)
    except ValueError as e:
        raise WireError(str(e)) from None
    return _decode_data(msg, limits, loss_fn, config)


def _decode_data(msg, limits: ModelLimits, loss_fn: str, config: dict, program: dict | None = None) -> DecodedForwardBackward:
    if not msg.data:
        raise WireError("forward_backward needs at least one datum")
    if program is None:
        spec = LOSS_SPECS[loss_fn]
    else:  # a custom loss reads target_tokens (for its logprobs) and the inputs it declares
        spec = LossSpec(inputs=("target_tokens",), allows_2d_targets=program["inputs"][0]["rank"] == 2)
    datums, n_tokens = [], 0
    for i, d in enumerate(msg.data):
        where = f"data[{i}]"
        parts = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"{where}.model_input[{j}]: {kind} chunks are not supported; this model takes text tokens")
            if len(chunk.encoded_text.tokens) % 4:
                raise WireError(f"{where}.model_input[{j}]: token bytes are not a whole number of int32")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        n = tokens.size
        if n == 0:
            raise WireError(f"{where}: model_input is empty")
        if n > limits.max_seq_len:
            raise WireError(f"{where}: {n} tokens exceed the model's maximum sequence length {limits.max_seq_len}")
        if tokens.min() < 0 or tokens.max() >= limits.vocab_size:
            raise WireError(
                f"{where}: token ids must be in [0, {limits.vocab_size}), got {int(tokens.min())}..{int(tokens.max())}"
            )
        inputs = {name: _tensor(t, f"{where}.loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
        missing = [k for k in spec.inputs if k not in inputs]
        if missing:
            raise WireError(f"{where}: loss_fn {loss_fn!r} needs loss_fn_inputs {missing}, got {sorted(inputs)}")
        targets = inputs["target_tokens"]
        if targets.dtype.kind not in "iu":
            raise WireError(f"{where}: target_tokens must be int64, got {targets.dtype}")
        allowed = (1, 2) if spec.allows_2d_targets else (1,)
        if targets.ndim not in allowed or targets.shape[0] != n:
            want = "[N] or [N, K]" if spec.allows_2d_targets else "[N]"
            raise WireError(f"{where}: target_tokens shape {list(targets.shape)} must be {want} with N={n} (model_input length)")
        if targets.size == 0 or targets.min() < 0 or targets.max() >= limits.vocab_size:
            raise WireError(f"{where}: target_tokens must be in [0, {limits.vocab_size})")
        loss_inputs = {"target_tokens": targets.astype(np.int64)}
        for key in (*spec.inputs, *spec.optional_inputs):
            if key == "target_tokens" or key not in inputs:
                continue
            arr = inputs[key]
            if arr.dtype.kind != "f":
                raise WireError(f"{where}: {key} must be float32, got {arr.dtype}")
            if arr.shape != targets.shape:
                raise WireError(f"{where}: {key} shape {list(arr.shape)} must equal target_tokens shape {list(targets.shape)}")
            if not np.all(np.isfinite(arr)):
                raise WireError(f"{where}: {key} must hold finite numbers")
            loss_inputs[key] = arr.astype(np.float32)
        if program is not None:
            loss_inputs.update(_custom_inputs(inputs, targets, program, where))
        datum = {"tokens": tokens, "loss_inputs": loss_inputs}
        if spec.needs_provenance:
            datum.update(_provenance(d, n, targets.shape[0], loss_fn, where))
        datums.append(datum)
        n_tokens += n
    payload = {"loss_fn": loss_fn, "loss_config": config, "forward_only": bool(msg.forward_only), "datums": datums}
    if program is not None:
        payload["custom_loss"] = program
    return DecodedForwardBackward(msg.model_id, int(msg.seq_id), bool(msg.forward_only), loss_fn, payload, n_tokens)


MAX_SPAN_ID = 200  # characters of a provenance span's sequence_id


def _provenance(d, n_inputs: int, n_targets: int, loss_fn: str, where: str) -> dict:
    """A datum's provenance spans (``Datum.with_provenance``): ``input_spans`` tiling its model
    input and ``target_spans`` tiling its targets, each ``[kind, sequence_id, offset, length]``
    with kind ``prompt`` or ``sampled``."""
    if not len(d.model_input_spans) or not len(d.loss_fn_input_spans):
        raise WireError(f"{where}: loss_fn {loss_fn!r} needs provenance on every datum (Datum.with_provenance: "
                        "model_input and loss_fn_inputs spans naming the sampled sequences, from a sampling "
                        "client with record_stability_info=True)")
    return {
        "input_spans": _spans(d.model_input_spans, n_inputs, f"{where}.model_input_spans"),
        "target_spans": _spans(d.loss_fn_input_spans, n_targets, f"{where}.loss_fn_input_spans"),
    }


def _spans(spans, total: int, where: str) -> list[list]:
    if len(spans) > total + 16:
        raise WireError(f"{where}: {len(spans)} spans for {total} positions")
    out, covered = [], 0
    for j, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise WireError(f"{where}[{j}]: a span must be prompt_tokens or sampled_tokens")
        arm = getattr(span, kind)
        if not arm.sequence_id or len(arm.sequence_id) > MAX_SPAN_ID:
            raise WireError(f"{where}[{j}].sequence_id must be a SampledSequence.sequence_id (1 to {MAX_SPAN_ID} chars)")
        if not 0 <= arm.offset < 1 << 31 or not 0 <= arm.length <= total:
            raise WireError(f"{where}[{j}]: offset={arm.offset} and length={arm.length} must be >= 0 "
                            f"(length at most the datum's {total} positions)")
        out.append(["prompt" if kind == "prompt_tokens" else "sampled", arm.sequence_id, int(arm.offset), int(arm.length)])
        covered += arm.length
    if covered != total:
        raise WireError(f"{where}: spans cover {covered} positions but the field has {total}; they must tile it")
    return out


def _custom_inputs(inputs: dict[str, np.ndarray], targets: np.ndarray, program: dict, where: str) -> dict[str, np.ndarray]:
    """The inputs a custom loss declares, checked against their declared ranks (a rank-0 input is
    one value; the wire may carry it as shape [1])."""
    lp_rank = program["inputs"][0]["rank"]
    if targets.ndim != lp_rank:
        raise WireError(f"{where}: target_tokens has rank {targets.ndim}, but loss {program['name']!r} takes "
                        f"logprobs of rank {lp_rank}")
    out = {}
    for spec in program["inputs"][1:]:
        name, rank = spec["name"], spec["rank"]
        if name not in inputs:
            raise WireError(f"{where}: loss {program['name']!r} takes loss_fn_inputs[{name!r}], which is missing")
        arr = inputs[name]
        if rank == 0 and arr.size == 1:
            arr = arr.reshape(())
        if arr.ndim != rank:
            raise WireError(f"{where}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}; loss "
                            f"{program['name']!r} declared rank {rank}")
        if arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)):
                raise WireError(f"{where}: loss_fn_inputs[{name!r}] must hold finite numbers")
            out[name] = arr.astype(np.float32)
        else:
            out[name] = arr.astype(np.int64)
    return out


def encode_forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput``: per-datum ``logprobs`` (one ArrayRecord per run of datums with the
    same trailing shape, so 1-D and ``[N, K]`` outputs can mix) and ``name:reduction`` metrics."""
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    runs: list[list[np.ndarray]] = []
    for lp in logprobs:
        lp = np.asarray(lp, dtype="<f4")
        if runs and runs[-1][0].shape[1:] == lp.shape[1:]:
            runs[-1].append(lp)
        else:
            runs.append([lp])
    for run in runs:
        rec = out.loss_fn_outputs.add()
        rec.num_datums = len(run)
        field = rec.fields["logprobs"]
        field.dtype = pb.DTYPE_FLOAT32
        field.trailing_shape.extend(run[0].shape[1:])
        offsets = np.cumsum([0] + [a.nbytes for a in run]).astype("<i8")
        field.data = b"".join(a.tobytes() for a in run)
        field.offsets = offsets.tobytes()
    return out.SerializeToString()

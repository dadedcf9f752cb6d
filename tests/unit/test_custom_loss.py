"""Server-side custom losses: a loss traced by the official SDK (``create_custom_loss``) is checked
against the allow-list (``ember.lossgraph``) and interpreted by the engine
(``ember.engine.custom_loss``) with the values and gradients of the traced graph itself; in a
packed pass it gives each request what it would get alone, and a loss that fails fails alone."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from ember.core.adapters import LoraConfig
from ember.engine.custom_loss import LossProgram
from ember.engine.worker import Worker
from ember.lossgraph import ProgramError, validate_program
from ember.types import Datum, ForwardBackwardInput, ForwardBackwardOutput, RequestError
from tests.lora_helpers import randomise
from tests.tiny_models import random_sequences


def dpo(logprobs, ref_logprobs, weights, sign):
    margin = ((logprobs - ref_logprobs) * weights).sum()
    return -F.logsigmoid(0.1 * sign * margin), {"custom/margin:mean": margin.detach()}


def clipped(logprobs, logprobs_old, advantages):
    ratio = torch.exp(logprobs - logprobs_old)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages)
    n = logprobs.shape[0]
    return -surrogate.sum() / n, {"custom/ratio_max:sum": ratio.max(), "custom/n:sum": torch.ones_like(ratio).sum()}


def topk_2d(logprobs, weights):
    """2-D logprobs ``[T, K]``: the best of K per position, with selection ops and slicing."""
    best = logprobs.max(dim=-1).values
    top = torch.topk(logprobs, 2, dim=-1).values[..., 0]
    masked = torch.where(weights > 0, best, torch.zeros_like(best))
    pos = torch.arange(logprobs.shape[0], dtype=torch.float32) / logprobs.shape[0]
    loss = -(masked * (1.0 + pos)).sum() + 0.0 * top.sum() + logprobs[1:, :].float().mean() * 0.01
    return loss, {"custom/best:mean": best.mean()}


LOSSES = {
    "dpo": (dpo, {"logprobs": 1, "ref_logprobs": 1, "weights": 1, "sign": 0}),
    "clipped": (clipped, {"logprobs": 1, "logprobs_old": 1, "advantages": 1}),
    "topk_2d": (topk_2d, {"logprobs": 2, "weights": 1}),
}


def _program(name: str) -> tuple[dict, torch.fx.GraphModule]:
    fn, ranks = LOSSES[name]
    handle = trace_loss(fn, ranks, "session")
    wire = encode_graph(handle).model_dump()
    inputs = [x.model_dump() for x in handle.inputs]
    return validate_program(handle.name, inputs, wire), handle.graph


def _inputs(name: str, rng, t: int = 7, k: int = 3) -> list[torch.Tensor]:
    if name == "dpo":
        return [torch.tensor(-rng.random(t), dtype=torch.float32), torch.tensor(rng.random(t) > 0.3, dtype=torch.float32),
                torch.tensor(-1.0)]
    if name == "clipped":
        return [torch.tensor(-rng.random(t), dtype=torch.float32), torch.tensor(rng.standard_normal(t), dtype=torch.float32)]
    return [torch.tensor(rng.random(t) > 0.5, dtype=torch.float32)]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_program_matches_the_traced_graph(name):
    program, graph = _program(name)
    rng = np.random.default_rng(0)
    shape = (7, 3) if LOSSES[name][1]["logprobs"] == 2 else (7,)
    lp = torch.tensor(-rng.random(shape) * 2, dtype=torch.float32)
    inputs = _inputs(name, rng)
    lp_ref = lp.clone().requires_grad_()
    ref_loss, ref_metrics = graph(lp_ref, *inputs)
    ref_loss.backward()
    lp_ours = lp.clone().requires_grad_()
    loss, metrics = LossProgram(program, torch.device("cpu"))(lp_ours, inputs)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad, rtol=0, atol=0)
    assert metrics == {k: float(v.detach()) for k, v in ref_metrics.items()}


def _with_node(program: dict, index: int, **node) -> dict:
    nodes = copy.deepcopy(program["nodes"])
    nodes[index].update(node)
    return {"format": 1, "nodes": nodes}


REFUSED = [
    (dict(target="builtins.open"), "not allowed"),
    (dict(target="torch.load"), "not allowed"),
    (dict(target="torch.save"), "not allowed"),
    (dict(op="call_method", target="add_"), "not allowed"),
    (dict(op="call_method", target="numpy"), "not allowed"),
    (dict(op="call_module", target="fc"), "not allowed"),
    (dict(op="get_attr", target="weight"), "not allowed"),
    (dict(target="getattr", args=[{"ref": "logprobs"}, "__class__"]), "getattr may read only"),
    (dict(args=[{"ref": "neg"}, {"ref": "ref_logprobs"}]), "not an earlier node"),
    (dict(args=[{"__nd__": 0}, 1.0]), "unknown argument kind"),
    (dict(kwargs={"__nd__": 1}), "keyword names"),
    (dict(args=[{"dtype": "complex128"}, 1.0]), "dtype"),
    (dict(name="logprobs"), "unique"),
]


@pytest.mark.parametrize("change,message", REFUSED)
def test_uploads_outside_the_allow_list_are_refused(change, message):
    program, _ = _program("dpo")
    first_call = next(i for i, n in enumerate(program["nodes"]) if n["op"] == "call_function")
    with pytest.raises(ProgramError, match=message):
        validate_program("dpo", program["inputs"], _with_node(program, first_call, **change))


def test_malformed_uploads_are_refused():
    program, _ = _program("dpo")
    graph = {"format": 1, "nodes": program["nodes"]}
    output = dict(program["nodes"][-1])
    cases = [
        (program["inputs"][1:], graph, "first input must be logprobs"),
        (program["inputs"] + [{"name": "extra", "rank": 1}], graph, "must equal the declared inputs"),
        (program["inputs"], {"format": 2, "nodes": program["nodes"]}, "format"),
        (program["inputs"], {"format": 1, "nodes": program["nodes"][:-1]}, "end with an output"),
        (program["inputs"], {"format": 1, "nodes": [*program["nodes"][:4], output, *program["nodes"][4:-1]]},
         "must be the last"),
        (program["inputs"], _with_node(program, -1, args=[{"tuple": [{"ref": "neg"}, {"dict": {"loss": {"ref": "neg"}}}]}]),
         "custom/<name>"),
        ([{"name": "logprobs", "rank": 3}], graph, "rank must be"),
    ]
    for inputs, g, message in cases:
        with pytest.raises(ProgramError, match=message):
            validate_program("dpo", inputs, g)


def _graph_of(fn, ranks):
    handle = trace_loss(fn, ranks, "s")
    return validate_program(handle.name, [x.model_dump() for x in handle.inputs], encode_graph(handle).model_dump())


def test_tensors_a_program_makes_are_bounded():
    def huge(logprobs):
        return (torch.zeros(logprobs.shape[0] * 20_000_000).sum() + logprobs.sum(), {})

    def huge_repeat(logprobs):
        return (logprobs.repeat(10_000_000).sum(), {})

    def wide(logprobs):
        return (logprobs.expand(100_000, 100_000, logprobs.shape[0]).sum(), {})

    for fn in (huge, huge_repeat, wide):
        program = LossProgram(_graph_of(fn, {"logprobs": 1}), torch.device("cpu"))
        with pytest.raises(ProgramError, match="elements"):
            program(torch.zeros(5), [])


def test_run_time_errors_name_the_node():
    def bad_shapes(logprobs, advantages):
        return ((logprobs * advantages).sum(), {})

    program = LossProgram(_graph_of(bad_shapes, {"logprobs": 1, "advantages": 1}), torch.device("cpu"))
    with pytest.raises(ProgramError, match="node 'mul'"):
        program(torch.zeros(5), [torch.zeros(4)])

    def not_scalar(logprobs):
        return (logprobs * 2, {})

    with pytest.raises(ProgramError, match="scalar"):
        LossProgram(_graph_of(not_scalar, {"logprobs": 1}), torch.device("cpu"))(torch.zeros(5), [])


@pytest.fixture
def worker(hf_models):
    _, path = hf_models["qwen3"]
    return Worker.from_pretrained(path, "cpu", torch.float32, max_adapters=4, max_rank=16, max_seq_len=64)


def _datums(vocab, lengths, seed, extra):
    rng = np.random.default_rng(seed)
    out = []
    for s in random_sequences(vocab, lengths, seed=seed):
        n = len(s) - 1
        inputs = {"target_tokens": np.array(s[1:])}
        inputs.update(extra(rng, n))
        out.append(Datum(np.array(s[:-1]), inputs))
    return out


def test_custom_loss_in_a_packed_pass_equals_its_formula_and_runs_alone(worker):
    """-Σ w·lp as a custom loss trains exactly like cross_entropy with weights w, in a pass that
    also holds another adapter's request and a custom loss that fails at run time."""

    def weighted(logprobs, weights):
        return (-(logprobs * weights).sum(), {"custom/tokens:sum": (weights > 0).sum().float()})

    vocab = worker.config.vocab_size
    program = _graph_of(weighted, {"logprobs": 1, "weights": 1})
    slots = [worker.create_adapter(LoraConfig(rank=4, seed=s)) for s in (1, 1, 2, 3)]
    for s in slots:
        randomise(worker.adapter(s), seed=7, scale=0.05)
    data = _datums(vocab, [9, 5, 12], 3, lambda rng, n: {"weights": rng.random(n).astype(np.float32)})
    custom = ForwardBackwardInput(slots[0], data, "custom", custom_loss=program)
    builtin = ForwardBackwardInput(slots[1], data, "cross_entropy")
    other = ForwardBackwardInput(slots[2], _datums(vocab, [7], 4, lambda rng, n: {}), "cross_entropy")
    wrong = [Datum(d.tokens, {"target_tokens": d.loss_inputs["target_tokens"], "weights": np.ones(2, np.float32)})
             for d in data]
    failing = ForwardBackwardInput(slots[3], wrong, "custom", custom_loss=program)

    (other_alone,) = worker.forward_backward([other])
    other_grads = {k: g.clone() for k, g in worker.adapter(slots[2]).grads().items()}
    worker.adapter(slots[2]).optimizer.zero_grad()

    out_custom, out_builtin, out_other, out_failing = worker.forward_backward([custom, builtin, other, failing])
    assert isinstance(out_failing, RequestError) and "custom loss 'weighted'" in out_failing.message
    assert isinstance(out_custom, ForwardBackwardOutput)
    expected = -sum(float((lp.astype(np.float64) * d.loss_inputs["weights"]).sum())
                    for lp, d in zip(out_builtin.logprobs, data))
    assert out_custom.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert out_custom.metrics["loss:sum"] == pytest.approx(out_builtin.metrics["loss:sum"], rel=1e-6)
    assert out_custom.metrics["custom/tokens:sum"] == sum(int((d.loss_inputs["weights"] > 0).sum()) for d in data)
    g_custom, g_builtin = worker.adapter(slots[0]).grads(), worker.adapter(slots[1]).grads()
    for k, g in g_builtin.items():
        torch.testing.assert_close(g_custom[k], g, atol=1e-6, rtol=1e-5)
    for k, g in other_grads.items():
        torch.testing.assert_close(worker.adapter(slots[2]).grads()[k], g, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(out_other.logprobs[0], other_alone.logprobs[0], atol=1e-5)
    assert all(g is None or not g.any() for g in worker.adapter(slots[3]).grads().values())


def test_custom_loss_inputs_are_checked(worker):
    slot = worker.create_adapter(LoraConfig(rank=4))
    program, _ = _program("dpo")
    vocab = worker.config.vocab_size
    cases = [
        ({}, "lacks"),
        ({"ref_logprobs": np.zeros(4, np.float32), "weights": np.ones(4, np.float32), "sign": np.ones(2, np.float32)},
         "rank 0"),
        ({"ref_logprobs": np.full(4, np.nan, np.float32), "weights": np.ones(4, np.float32),
          "sign": np.ones(1, np.float32)}, "finite"),
    ]
    for extra, message in cases:
        data = _datums(vocab, [5], 1, lambda rng, n, extra=extra: extra)
        (out,) = worker.forward_backward([ForwardBackwardInput(slot, data, "custom", custom_loss=program)])
        assert isinstance(out, RequestError) and message in out.message, out

"""`.source`: the operations inside a forward, read and edited like modules.

The references are independent of interlace: plain torch hooks on submodules, and the same
edit made by monkeypatching the forward (or the function it calls) by hand. Every edit test
also checks that the edit changed the result, so a lost edit cannot pass.
"""

import bdb
import functools
import importlib.util
import json
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import interlace
from interlace import InterlaceError, OutOfOrderError, SourceNotAvailable
from interlace.intervention import rewrite
from interlace.intervention import source as source_module

from . import memcheck
from .helpers import assert_clean, hooked

VOCAB = 1000


def _gpt2_config(**extra):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                      bos_token_id=0, eos_token_id=0, **extra)


def _llama_config(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0, **extra)


def _build(kind):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        module = GPT2LMHeadModel(_gpt2_config(attn_implementation="eager"))
    else:
        module = LlamaForCausalLM(_llama_config(attn_implementation="eager"))
    return module.eval()


@pytest.fixture(scope="module")
def gpt2e():
    module = _build("gpt2")
    return module, interlace.Model(module)


@pytest.fixture(scope="module")
def llamae():
    module = _build("llama")
    return module, interlace.Model(module)


@pytest.fixture
def tokens():
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _plain(module, x):
    with torch.no_grad():
        return _logits(module(x))


def _all_forwards_original(module):
    """Every forward in the model runs the code it was loaded with (nothing left swapped)."""
    assert not source_module._SWAPPED
    hooks = (source_module._SharedHook, source_module._RunHook)
    for sub in module.modules():
        function, _ = source_module._forward_of(sub, "x")
        inner, _ = rewrite.peel(function)
        assert not any(isinstance(c, hooks) for c in inner.__code__.co_consts), type(sub)


# -- names and printing --------------------------------------------------------------------------

_NNSIGHT_REPRS = textwrap.dedent(
    """
    import json, torch, transformers
    from nnsight import NNsight
    out = {}
    g = NNsight(transformers.GPT2LMHeadModel(transformers.GPT2Config(**%(gpt2)s)).eval())
    l = NNsight(transformers.LlamaForCausalLM(transformers.LlamaConfig(**%(llama)s)).eval())
    for key, envoy in [("gpt2.attn", g.transformer.h[0].attn), ("gpt2.mlp", g.transformer.h[0].mlp),
                       ("llama.attn", l.model.layers[0].self_attn), ("llama.mlp", l.model.layers[0].mlp),
                       ("llama.layer", l.model.layers[0]), ("llama.rotary", l.model.rotary_emb)]:
        source = envoy.source
        out[key] = [repr(source), list(source.names),
                    {name: repr(getattr(source, name)) for name in source.names}]
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # starts a subprocess
def test_names_and_printouts_match_nnsight(gpt2e, llamae):
    """Ported code finds the same names, and `print(envoy.source)` the same text, as nnsight."""
    if importlib.util.find_spec("nnsight") is None:  # (importorskip would import it here)
        pytest.skip("nnsight is not installed (pip install .[compare])")
    gpt2_kw = dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    llama_kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    script = _NNSIGHT_REPRS % {"gpt2": gpt2_kw, "llama": llama_kw}
    # nnsight installs its own wrappers on modules and on `object`: keep it out of this process
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    g, l = gpt2e[1], llamae[1]
    ours = {"gpt2.attn": g.transformer.h[0].attn, "gpt2.mlp": g.transformer.h[0].mlp,
            "llama.attn": l.model.layers[0].self_attn, "llama.mlp": l.model.layers[0].mlp,
            "llama.layer": l.model.layers[0], "llama.rotary": l.model.rotary_emb}
    for key, envoy in ours.items():
        source = envoy.source
        listing, names, windows = theirs[key]
        assert list(source.names) == names, key
        assert repr(source) == listing, key
        assert str(source) == listing, key
        for name in names:
            assert repr(getattr(source, name)) == windows[name], (key, name)


def test_names_follow_the_scheme():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            a, b = h, torch.relu(h)
            parts = [x[0].view(-1)]
            self.cache = {}
            self.cache["h"] = h.sum(0)
            return (a + b).sum(-1), parts

    model = interlace.Model(Net())
    assert model.source.names == (
        "self_fc1_0", "torch_relu_0", "h_0", "torch_relu_1", "a_0", "b_0", "x_view_0",
        "parts_0", "self_cache_0", "h_sum_0", "self_cache_1", "sum_0",
    )
    assert [op.name for op in model.source] == list(model.source.names)
    assert "torch_relu_1" in dir(model.source)
    assert model.source.torch_relu_1.path == "model.source.torch_relu_1"


def test_unknown_operation_lists_the_names_and_a_close_match(gpt2e):
    _, model = gpt2e
    with pytest.raises(AttributeError) as info:
        model.transformer.h[0].mlp.source.self_act_1
    message = str(info.value)
    assert "model.transformer.h.0.mlp.source has no operation 'self_act_1'" in message
    assert "did you mean self_act_0" in message
    assert "self_c_fc_0, hidden_states_0, self_act_0" in message


# -- reads against plain hooks and hand-patched forwards ---------------------------------------


def test_gpt2_mlp_reads_equal_plain_hooks(gpt2e, tokens):
    module, model = gpt2e
    mlp = module.transformer.h[0].mlp
    seen = {}
    grab = lambda name: lambda mod, args, out: seen.__setitem__(name, (args[0].clone(), out.clone()))
    with torch.no_grad(), hooked(module, output={mlp.c_fc: grab("fc"), mlp.act: grab("act")}):
        module(tokens)
    with torch.no_grad(), model.trace(tokens):
        src = model.transformer.h[0].mlp.source
        fc_in = src.self_c_fc_0.input.save()
        fc = src.self_c_fc_0.output.save()
        bound = src.hidden_states_0.output.save()
        act_args, act_kwargs = src.self_act_0.inputs
        act_in = act_args[0].save()
        act = src.self_act_0.output.save()
    torch.testing.assert_close(fc_in, seen["fc"][0], rtol=0, atol=0)
    torch.testing.assert_close(fc, seen["fc"][1], rtol=0, atol=0)
    assert bound is fc  # `hidden_states = self.c_fc(...)` binds that very tensor
    torch.testing.assert_close(act_in, seen["act"][0], rtol=0, atol=0)
    torch.testing.assert_close(act, seen["act"][1], rtol=0, atol=0)
    assert_clean(module)
    _all_forwards_original(module)


def test_other_instances_and_threads_run_straight_through(gpt2e, tokens):
    """While h.0/h.1's MLPs run rewritten code, another GPT-2 (same classes) in another
    thread computes exactly what it computes alone."""
    import threading

    module, model = gpt2e
    other = _build("gpt2")
    with torch.no_grad():
        alone = _logits(other(tokens + 1))
    seen = {}
    grab = lambda i: lambda m, a, o: seen.setdefault(i, o.clone())  # noqa: E731
    acts = {module.transformer.h[i].mlp.act: grab(i) for i in (0, 1)}
    with torch.no_grad(), hooked(module, output=acts):
        module(tokens)
    box = []
    with torch.no_grad(), model.trace(tokens):
        first = model.transformer.h[0].mlp.source.self_act_0.output.save()
        model.transformer.h[1].mlp.source  # installed before h.1 runs
        worker = threading.Thread(target=lambda: box.append(_plain(other, tokens + 1)))
        worker.start()
        worker.join()
        second = model.transformer.h[1].mlp.source.self_act_0.output.save()
    torch.testing.assert_close(box[0], alone, rtol=0, atol=0)
    torch.testing.assert_close(first, seen[0], rtol=0, atol=0)
    torch.testing.assert_close(second, seen[1], rtol=0, atol=0)
    _all_forwards_original(module)


def _gpt2_eager_reference(target, record, edit=None):
    """GPT-2's eager attention written out by hand: records (and edits) layer `target`'s softmax."""

    def eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if scaling is None:
            scaling = query.size(-1) ** -0.5
        weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = torch.softmax(weights, dim=-1)
        if module is target:
            record.append(weights.clone())
            if edit is not None:
                edit(weights)
        weights = weights.type(value.dtype)
        out = torch.matmul(weights, value).transpose(1, 2)
        return out, weights

    return eager


def test_gpt2_nested_softmax_read_and_edit_equal_hand_patched_attention(gpt2e, tokens, monkeypatch):
    from transformers.models.gpt2 import modeling_gpt2

    module, model = gpt2e
    attn = module.transformer.h[1].attn
    clean = _plain(module, tokens)

    def edit(weights):
        weights[..., 0] = 0

    record = []
    with monkeypatch.context() as patch:
        patch.setattr(modeling_gpt2, "eager_attention_forward",
                      _gpt2_eager_reference(attn, record, edit))
        expected = _plain(module, tokens)
    with torch.no_grad(), model.trace(tokens) as tracer:
        inner = model.transformer.h[1].attn.source.attention_interface_1.source
        weights = inner.nn_functional_softmax_0.output
        before = weights.clone().save()
        weights[..., 0] = 0
        logits = tracer.result.logits.save()
    torch.testing.assert_close(before, record[0], rtol=0, atol=0)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert not torch.allclose(logits, clean)
    assert_clean(module)
    _all_forwards_original(module)


def test_gpt2_assignment_output_edit_equals_hand_patched_forward(gpt2e, tokens):
    """`attn_output = self.c_proj(attn_output)`: edit the assigned value (an assignment op)."""
    module, model = gpt2e
    attn = module.transformer.h[0].attn
    clean = _plain(module, tokens)

    def halve(mod, args, out):  # the same edit, as a hook on the call whose result is bound
        return out * 0.5

    with torch.no_grad(), hooked(module, output={attn.c_proj: halve}):
        expected = _logits(module(tokens))
    with torch.no_grad(), model.trace(tokens) as tracer:
        src = model.transformer.h[0].attn.source
        src.attn_output_1.output = src.attn_output_1.output * 0.5
        logits = tracer.result.logits.save()
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert not torch.allclose(logits, clean)


def test_llama_rotary_output_edit_equals_patched_function(llamae, tokens, monkeypatch):
    from transformers.models.llama import modeling_llama

    module, model = llamae
    clean = _plain(module, tokens)
    calls = []
    original = modeling_llama.apply_rotary_pos_emb

    def patched(q, k, cos, sin, *args, **kwargs):
        q, k = original(q, k, cos, sin, *args, **kwargs)
        calls.append(q.clone())
        if len(calls) == 1:  # layer 0 runs first
            q = q * 0.5
        return q, k

    with monkeypatch.context() as patch:
        patch.setattr(modeling_llama, "apply_rotary_pos_emb", patched)
        expected = _plain(module, tokens)
    with torch.no_grad(), model.trace(tokens) as tracer:
        op = model.model.layers[0].self_attn.source.apply_rotary_pos_emb_0
        q, k = op.output
        seen = q.clone().save()
        op.output = (q * 0.5, k)
        logits = tracer.result.logits.save()
    torch.testing.assert_close(seen, calls[0], rtol=0, atol=0)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert not torch.allclose(logits, clean)


def test_llama_rotary_wrapper_is_the_source_and_the_forward_is_reached_through_its_call(
        llamae, tokens):
    """`@dynamic_rope_update` calls three functions it closes over: its wrapper is what runs,
    so `.source` shows the wrapper (nnsight's names) and the forward is `rope_forward_0.source`.
    Reference: a plain forward hook on `rotary_emb` reading and editing its returned cos."""
    module, model = llamae
    src = model.model.rotary_emb.source
    assert src.names[-1] == "rope_forward_0" and "dynamic_frequency_update_0" in src.names
    seen = []

    def double_cos(mod, args, out):
        seen.append(out[0].clone())
        return out[0] * 2, out[1]

    with hooked(module, output={module.model.rotary_emb: double_cos}):
        expected = _plain(module, tokens)
    with torch.no_grad(), model.trace(tokens) as tracer:
        inner = model.model.rotary_emb.source.rope_forward_0.source
        cos = inner.cos_0.output
        read = cos.clone().save()
        inner.cos_0.output = cos * 2
        logits = tracer.result.logits.save()
    torch.testing.assert_close(read, seen[0], rtol=0, atol=0)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert not torch.allclose(logits, _plain(module, tokens))
    _all_forwards_original(module)


def test_llama_nested_eager_softmax_matches_attention_weights(llamae, tokens):
    """Eager attention returns its weights: the nested softmax's output is what it returns."""
    module, model = llamae
    with torch.no_grad(), model.trace(tokens):
        attn = model.model.layers[1].self_attn.source.attention_interface_1
        inner = attn.source
        soft = inner.nn_functional_softmax_0.output.save()
        returned = attn.output[1].save()
        assert "torch_matmul_1" in inner.names
    torch.testing.assert_close(soft, returned, rtol=0, atol=0)
    assert soft.shape == (2, 4, 9, 9)
    torch.testing.assert_close(soft.sum(-1), torch.ones(2, 4, 9))


def test_llama_mlp_input_edit_equals_hand_patched_forward(llamae, tokens):
    module, model = llamae
    mlp = module.model.layers[0].mlp
    clean = _plain(module, tokens)

    def forward(x):  # LlamaMLP.forward by hand, with the edit
        return mlp.down_proj(2.0 * (mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)))

    mlp.forward = forward
    try:
        expected = _plain(module, tokens)
    finally:
        del mlp.forward
    seen = {}
    with torch.no_grad(), hooked(module, output={mlp.act_fn: lambda m, a, o: seen.setdefault("act", o.clone())}):
        module(tokens)
    with torch.no_grad(), model.trace(tokens) as tracer:
        src = model.model.layers[0].mlp.source
        act = src.self_act_fn_0.output.save()
        src.self_down_proj_0.input = src.self_down_proj_0.input * 2.0
        logits = tracer.result.logits.save()
    torch.testing.assert_close(act, seen["act"], rtol=0, atol=0)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert not torch.allclose(logits, clean)


def test_skip_does_not_run_the_call_and_uses_the_value(gpt2e, tokens):
    module, model = gpt2e
    mlp = module.transformer.h[0].mlp
    clean = _plain(module, tokens)
    ran = []

    def forward(hidden_states):  # GPT2MLP.forward by hand, the activation replaced
        h = mlp.c_fc(hidden_states)
        h = torch.zeros_like(h)
        return mlp.dropout(mlp.c_proj(h))

    mlp.forward = forward
    try:
        expected = _plain(module, tokens)
    finally:
        del mlp.forward
    with torch.no_grad(), hooked(module, output={mlp.act: lambda m, a, o: ran.append(1)}), \
            model.trace(tokens) as tracer:
        src = model.transformer.h[0].mlp.source
        src.self_act_0.skip(torch.zeros(2, 9, 256))
        logits = tracer.result.logits.save()
    assert ran == []
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert not torch.allclose(logits, clean)


# -- occurrences ---------------------------------------------------------------------------------


class Repeat(torch.nn.Module):
    """The same operations three times in one forward: occurrences 0, 1, 2 of each."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.layer(x))
        return x


def test_operation_run_several_times_has_occurrences():
    module = Repeat()
    model = interlace.Model(module)
    x = torch.randn(2, 4)
    expected, h = [], x
    with torch.no_grad():
        for _ in range(3):
            h = torch.tanh(module.layer(h))
            expected.append(h)
    with torch.no_grad(), model.trace(x) as tracer:
        outs = [].save()
        for step in tracer.iter[:3]:
            outs.append(model.source.torch_tanh_0.output.clone())
    assert len(outs) == 3
    for got, want in zip(outs, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    # an edit at one occurrence only, against the same forward written out by hand
    with torch.no_grad():
        h = x
        for i in range(3):
            h = torch.tanh(module.layer(h))
            if i == 1:
                h = h * -1
    with torch.no_grad(), model.trace(x) as tracer:
        for step in tracer.iter[1]:
            model.source.x_0.output = model.source.x_0.output * -1
        result = tracer.result.save()
    torch.testing.assert_close(result, h, rtol=0, atol=0)
    assert not torch.allclose(result, expected[-1])


def test_values_must_be_requested_in_order(gpt2e, tokens):
    _, model = gpt2e
    with pytest.raises(OutOfOrderError) as info:
        with torch.no_grad(), model.trace(tokens):
            model.transformer.h[0].mlp.source.self_act_0.output.save()
            model.transformer.h[0].mlp.source.self_c_fc_0.output.save()
    message = str(info.value)
    assert "model.transformer.h.0.mlp.source.self_c_fc_0.output (occurrence 0) was requested " \
           "after the model had already produced it" in message
    assert "model.transformer.h.0.mlp.source.self_act_0.output" in message  # where the model is


def test_operation_that_never_runs(gpt2e, tokens):
    """GPT-2's cross-attention branch does not run in a decoder-only model."""
    _, model = gpt2e
    with pytest.raises(OutOfOrderError) as info:
        with torch.no_grad(), model.trace(tokens):
            model.transformer.h[0].attn.source.self_q_attn_0.output.save()
    assert ("model.transformer.h.0.attn.source.self_q_attn_0.output (occurrence 0) was never "
            "produced: it never ran in this run") in str(info.value)


def test_source_after_reading_the_module_input(gpt2e, tokens):
    """Served inside the module's pre-hook, the forward has not started: its operations run."""
    module, model = gpt2e
    seen = {}
    with torch.no_grad(), hooked(module, output={module.transformer.h[1].mlp.act:
                                                 lambda m, a, o: seen.setdefault("act", o.clone())}):
        module(tokens)
    with torch.no_grad(), model.trace(tokens):
        mlp = model.transformer.h[1].mlp
        given = mlp.input.save()
        act = mlp.source.self_act_0.output.save()
    torch.testing.assert_close(act, seen["act"], rtol=0, atol=0)
    assert given.shape == (2, 9, 64)


def test_source_used_after_its_module_ran_is_out_of_order(gpt2e, tokens):
    _, model = gpt2e
    with pytest.raises(OutOfOrderError, match=r"mlp\.source\.self_act_0\.output \(occurrence 0\) "
                                              r"was requested after the model had already produced"):
        with torch.no_grad(), model.trace(tokens):
            model.transformer.h[1].output.save()
            model.transformer.h[0].mlp.source.self_act_0.output.save()


def test_source_of_a_module_that_already_ran_while_inside_another_forward(gpt2e, tokens):
    """Served at an operation of h.0.mlp, asking for h.0.attn's: attn has already run."""
    _, model = gpt2e
    with pytest.raises(OutOfOrderError, match=r"attn\.source\.attention_interface_1\.output "
                                              r"\(occurrence 0\) was requested after the model "
                                              r"had already produced it"):
        with torch.no_grad(), model.trace(tokens):
            model.transformer.h[0].mlp.source.self_act_0.output.save()
            model.transformer.h[0].attn.source.attention_interface_1.output.save()


# -- invokes ---------------------------------------------------------------------------------


def test_invokes_each_see_and_edit_their_own_rows(gpt2e, tokens):
    module, model = gpt2e
    a, b = tokens[:1], tokens[1:]
    with torch.no_grad(), model.trace(a) as tracer:
        model.transformer.h[0].mlp.source.self_act_0.output[:] = 0
        alone_a = tracer.result.logits.save()
    with torch.no_grad(), model.trace(b):
        alone_b = model.transformer.h[0].mlp.source.self_act_0.output.save()
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(a):
            model.transformer.h[0].mlp.source.self_act_0.output[:] = 0
            logits_a = model.lm_head.output.save()
        with tracer.invoke(b):
            act_b = model.transformer.h[0].mlp.source.self_act_0.output.save()
    assert act_b.shape[0] == 1
    torch.testing.assert_close(act_b, alone_b)
    torch.testing.assert_close(logits_a, alone_a)
    assert not torch.allclose(alone_a, _plain(module, a))


# -- what is left behind -------------------------------------------------------------------------


def test_original_code_is_back_after_the_trace(gpt2e, tokens):
    from transformers.models.gpt2 import modeling_gpt2

    module, model = gpt2e
    inner = modeling_gpt2.GPT2Attention.forward.__wrapped__
    code = inner.__code__
    mlp_code = modeling_gpt2.GPT2MLP.forward.__code__
    with torch.no_grad(), model.trace(tokens):
        model.transformer.h[0].attn.source.attention_interface_1.source.torch_matmul_0.output.save()
        model.transformer.h[0].mlp.source.self_act_0.output.save()
        assert inner.__code__ is not code  # rewritten while the trace runs
    assert inner.__code__ is code
    assert modeling_gpt2.GPT2MLP.forward.__code__ is mlp_code
    assert_clean(module)
    _all_forwards_original(module)


def test_error_in_the_body_leaves_the_model_clean(gpt2e, tokens):
    module, model = gpt2e
    with pytest.raises(ZeroDivisionError):
        with torch.no_grad(), model.trace(tokens):
            model.transformer.h[0].mlp.source.self_act_0.output.save()
            1 / 0
    _all_forwards_original(module)
    with torch.no_grad(), model.trace(tokens):
        act = model.transformer.h[0].mlp.source.self_act_0.output.save()
    assert act.shape == (2, 9, 256)
    _all_forwards_original(module)


def _lines_run(function, forward_file):
    """(filename, line) of every line event in `forward_file` while `function` runs."""
    lines = set()

    def tracer(frame, event, arg):
        if frame.f_code.co_filename == forward_file:
            if event == "line":
                lines.add(frame.f_lineno)
            return tracer
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        function()
    finally:
        sys.settrace(previous)
    return lines


class _Breaks(bdb.Bdb):
    """A debugger that records the breakpoints it stops at and continues."""

    def __init__(self):
        super().__init__()
        self.stops = []

    def user_line(self, frame):
        if self.get_break(frame.f_code.co_filename, frame.f_lineno):
            self.stops.append(frame.f_lineno)
        self.set_continue()


def test_line_tracing_and_breakpoints_after_a_source_trace(gpt2e, tokens):
    from transformers.models.gpt2 import modeling_gpt2

    module, model = gpt2e
    filename = modeling_gpt2.__file__
    if filename.endswith(".pyc"):
        filename = filename[:-1]
    run = lambda: module(tokens)
    with torch.no_grad():
        before = _lines_run(run, filename)
        with model.trace(tokens):
            model.transformer.h[0].attn.source.attention_interface_1.output.save()
            model.transformer.h[0].mlp.source.self_act_0.output.save()
        after = _lines_run(run, filename)
    assert before and after == before
    line = modeling_gpt2.GPT2MLP.forward.__code__.co_firstlineno + 2  # `self.act(...)`
    debugger = _Breaks()
    debugger.set_break(filename, line)
    with torch.no_grad():
        debugger.runcall(run)
    debugger.clear_all_breaks()
    assert debugger.stops == [line, line]  # both layers' MLPs stop there


class Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.w = torch.nn.Parameter(torch.ones(3, 3))

    def forward(self, x):
        y = self.lin(x)
        return torch.matmul(y, self.w)  # shapes do not match: raises here


def _forward_frame(error):
    tb = error.__traceback__
    found = None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "forward" and tb.tb_frame.f_code.co_filename == __file__:
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def test_tracebacks_point_at_the_users_forward_line():
    module = Boom()
    model = interlace.Model(module)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError) as plain:
        module(x)
    with pytest.raises(RuntimeError) as traced:
        with model.trace(x):
            model.source.self_lin_0.output.save()
    assert _forward_frame(traced.value) == _forward_frame(plain.value) is not None
    assert _forward_frame(plain.value)[1] == Boom.forward.__code__.co_firstlineno + 2


def test_dropping_the_wrapper_frees_the_model_without_the_cycle_collector(tokens):
    def run():
        module = _build("gpt2")
        model = interlace.Model(module)
        with torch.no_grad(), model.trace(tokens):
            src = model.transformer.h[0].attn.source.save()
            inner = src.attention_interface_1.source.save()
            weights = inner.nn_functional_softmax_0.output.save()
            model.transformer.h[0].mlp.source.self_act_0.output[:] = 0
        assert weights.shape == (2, 4, 9, 9)
        refs = {"module": weakref.ref(module), "wrapper": weakref.ref(model)}
        memcheck.watch(refs, "weights", weights)
        return refs

    memcheck.assert_freed(run)


# -- forwards of every shape ---------------------------------------------------------------------


def _make_mangled():
    scale = 3.0  # a closure cell of the forward

    class Base(torch.nn.Module):
        def forward(self, x):
            return x + 1

    class Child(Base):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def __twice(self, x):
            return x * 2

        def forward(self, x):
            y = super().forward(x)
            z = self.__twice(self.lin(y)) * scale
            return z, Child

    return Child


def test_private_names_super_and_closures_keep_working():
    Child = _make_mangled()
    module = Child()
    model = interlace.Model(module)
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = module.lin(x + 1) * 2 * 3.0
    src = model.source
    with torch.no_grad(), model.trace(x) as tracer:
        lin = src.self_lin_0.output.save()
        doubled = src.self___twice_0.output.save()
        result, cls = tracer.result
        result.save()
        classes = [cls].save()
    assert src.names == ("forward_0", "y_0", "self_lin_0", "self___twice_0", "z_0")
    torch.testing.assert_close(doubled, lin * 2, rtol=0, atol=0)
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    assert classes[0] is Child


def test_plain_function_set_on_the_instance():
    module = torch.nn.Linear(4, 4)

    def forward(x):
        h = torch.nn.functional.linear(x, module.weight, module.bias)
        return torch.relu(h)

    module.forward = forward
    model = interlace.Model(module)
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = torch.relu(module(x))
    with torch.no_grad(), model.trace(x) as tracer:
        model.source.torch_relu_0.output = model.source.torch_relu_0.output * -1
        result = tracer.result.save()
    torch.testing.assert_close(result, -expected, rtol=0, atol=0)
    assert module.__dict__["forward"] is forward


def test_decorated_forward_is_peeled_and_its_wrapper_still_runs():
    import functools

    calls = []

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls.append(1)
            return fn(*args, **kwargs)

        return wrapper

    class Net(torch.nn.Module):
        @logged
        def forward(self, x):
            return torch.sigmoid(x) * 2

    model = interlace.Model(Net())
    x = torch.randn(3)
    with model.trace(x) as tracer:
        model.source.torch_sigmoid_0.output = model.source.torch_sigmoid_0.output * 0
        result = tracer.result.save()
    assert model.source.names == ("torch_sigmoid_0",)
    assert calls == [1]
    assert torch.equal(result, torch.zeros(3))


__tally = []  # a module global with a private-looking name: mangled only inside a class


def _noted(fn):
    def note():
        return len(__tally)

    @functools.wraps(fn)
    def wrapper(self, x):
        __tally.append(note())
        return fn(self, x)

    return wrapper


def test_a_wrapper_calling_two_functions_it_closes_over_is_rewritten_as_it_is():
    """Not peeled (it calls `note` and `fn`): the wrapper is rewritten where it was defined,
    not inside the class whose method it wraps (`functools.wraps` gives it that qualname), so
    `__tally` stays the module global."""

    class Net(torch.nn.Module):
        @_noted
        def forward(self, x):
            return torch.sigmoid(x)

    model = interlace.Model(Net())
    assert model.source.names == ("note_0", "__tally_append_0", "fn_0")
    x = torch.randn(3)
    with model.trace(x) as tracer:
        model.source.fn_0.source.torch_sigmoid_0.output = torch.zeros(3)
        result = tracer.result.save()
    assert torch.equal(result, torch.zeros(3)) and __tally[-1] == len(__tally) - 1


def test_a_forward_closing_over_a_helper_is_not_taken_for_a_decorator():
    def helper(x):
        return torch.cos(x)

    class Net(torch.nn.Module):
        def forward(self, x):
            return helper(x) + 1

    model = interlace.Model(Net())
    assert model.source.names == ("helper_0",)
    x = torch.randn(3)
    with model.trace(x):
        inner = model.source.helper_0.source
        cos = inner.torch_cos_0.output.save()
    assert torch.equal(cos, torch.cos(x))


# -- errors ----------------------------------------------------------------------------------


def test_forward_without_readable_source():
    namespace = {"torch": torch}
    exec(textwrap.dedent("""
        class FromString(torch.nn.Module):
            def forward(self, x):
                return x * 2
    """), namespace)
    model = interlace.Model(torch.nn.Sequential(namespace["FromString"]()))
    with pytest.raises(SourceNotAvailable) as info:
        model[0].source
    message = str(info.value)
    assert message.startswith("model.0 (FromString): .source cannot rewrite FromString.forward:")
    assert "its source cannot be read" in message


def test_forward_that_is_not_python():
    module = torch.nn.Sequential(torch.nn.ReLU())
    module[0].forward = torch.relu
    with pytest.raises(SourceNotAvailable, match=r"model\.0 \(ReLU\): \.source needs a forward "
                                                 r"written in Python"):
        interlace.Model(module)[0].source


def test_nested_source_errors(gpt2e, tokens):
    _, model = gpt2e
    src = model.transformer.h[0].mlp.source
    with pytest.raises(SourceNotAvailable, match=r"self_c_fc_0\.source is only available inside "
                                                 r"a trace"):
        src.self_c_fc_0.source
    with pytest.raises(SourceNotAvailable, match=r"mlp\.source\.self_c_fc_0 calls a submodule "
                                                 r"\(Conv1D\): use model\.transformer\.h\.0\.mlp"
                                                 r"\.c_fc\.source to see inside it"):
        with torch.no_grad(), model.trace(tokens):
            model.transformer.h[0].mlp.source.self_c_fc_0.source
    with pytest.raises(SourceNotAvailable, match=r"mlp\.source\.hidden_states_0 is an assignment, "
                                                 r"not a call"):
        with torch.no_grad(), model.trace(tokens):
            model.transformer.h[0].mlp.source.hidden_states_0.source
    with pytest.raises(SourceNotAvailable, match=r"attn\.source\.transpose_2 calls .*transpose, "
                                                 r"which is not written in Python"):
        with torch.no_grad(), model.trace(tokens):
            model.transformer.h[0].attn.source.transpose_2.source


def test_reading_outside_a_trace(gpt2e):
    _, model = gpt2e
    with pytest.raises(InterlaceError, match=r"model\.transformer\.h\.0\.mlp\.source\.self_act_0"
                                             r"\.output is only available inside a "
                                             r"`with model.trace\(\.\.\.\)` block"):
        model.transformer.h[0].mlp.source.self_act_0.output


def test_rewritten_forwards_are_bounded_and_evicted_ones_still_work(monkeypatch, tmp_path):
    """A program that keeps making model classes does not keep every rewritten forward."""
    monkeypatch.setattr(rewrite, "_CACHE_MAX", 2)
    monkeypatch.setattr(rewrite, "_CACHE", {})
    classes = []
    for scale in (1, 2, 3, 4):  # four forwards, four code objects, each in its own file
        path = tmp_path / f"scaled_{scale}.py"
        path.write_text(textwrap.dedent(f"""
            import torch

            class Scaled(torch.nn.Module):
                def forward(self, x):
                    y = torch.tanh(x)
                    return y * {scale}
        """))
        namespace = {}
        exec(compile(path.read_text(), str(path), "exec"), namespace)
        classes.append((scale, namespace["Scaled"]))
    x = torch.randn(2, 3)
    for _ in range(2):  # the second round finds the first classes' entries evicted
        for scale, cls in classes:
            model = interlace.Model(cls())
            with torch.no_grad(), model.trace(x):
                y = model.source.torch_tanh_0.output.save()
                model.source.torch_tanh_0.output = y * 0 + 1
                out = model.output.save()
            torch.testing.assert_close(y, torch.tanh(x), rtol=0, atol=0)
            torch.testing.assert_close(out, torch.full_like(x, float(scale)), rtol=0, atol=0)
            assert len(rewrite._CACHE) <= 2

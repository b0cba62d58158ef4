"""The batching rule (docs/batching.md): each invoke and each sweep item gets the values of a
trace of it alone - for values the whole batch shares, values reduced over the batch,
sequence-first models, batch-only model errors and padded inputs. Every value is compared
with plain torch (hooks, or the module called on the item alone)."""

import warnings

import pytest
import torch
from torch import nn

import interlace
from interlace.intervention.batching import BatchingError

from .conftest import Calls

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def gpt2_model(gpt2):
    return interlace.Model(gpt2)


def _ids(seed, n=6, rows=1):
    return torch.randint(1, 1000, (rows, n), generator=torch.Generator().manual_seed(seed))


def _zero_wpe(module, x):
    """GPT-2 run alone with its position embedding zeroed (a plain hook)."""
    handle = module.transformer.wpe.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    try:
        return module(x).logits
    finally:
        handle.remove()


def _same(a, b):
    """Equal as a batched pass and a pass of one row can be: BLAS may split a matmul of
    several rows otherwise than one row's (seen on AVX-512: 1e-5 apart), which no leak
    between items is near (an edit leaking moves the logits by about 1)."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# -- 1. values the whole batch shares ---------------------------------------------------------


def test_an_items_edit_of_a_shared_value_stays_its_own_in_a_sweep(gpt2, gpt2_model):
    x = _ids(0)
    with torch.no_grad(), Calls(gpt2) as calls, gpt2_model.sweep(
            range(3), input=x, batch_size=3, progress=False) as sweep:
        wpe = gpt2_model.transformer.wpe.output
        shape = wpe.shape
        if sweep.item == 0:
            wpe[:] = 0  # item 0 only
        logits = gpt2_model.lm_head.output[:, -1].save()
        seen = shape.save()
    with torch.no_grad():
        plain = gpt2(x).logits[:, -1]
        zeroed = _zero_wpe(gpt2, x)[:, -1]
    assert calls.sizes == [3]  # one batched pass
    assert not _same(plain, zeroed)
    assert _same(logits[0], zeroed)
    assert _same(logits[1], plain) and _same(logits[2], plain)
    assert seen == [torch.Size([1, 6, 64])] * 3  # its shape alone


def test_an_invokes_assignment_to_a_shared_value_stays_its_own(gpt2, gpt2_model):
    x = _ids(1)
    with torch.no_grad(), gpt2_model.trace() as tracer:
        with tracer.invoke(x):
            a = gpt2_model.transformer.wpe.output.save()
            b = gpt2_model.lm_head.output[:, -1].save()
        with tracer.invoke(x):
            gpt2_model.transformer.wpe.output = torch.zeros(1, 6, 64)
            c = gpt2_model.lm_head.output[:, -1].save()
        with tracer.invoke(x):
            d = gpt2_model.lm_head.output[:, -1].save()
    with torch.no_grad():
        plain = gpt2(x).logits[:, -1]
        zeroed = _zero_wpe(gpt2, x)[:, -1]
        wpe = gpt2.transformer.wpe(torch.arange(6)[None])
    assert torch.equal(a, wpe) and a.shape == (1, 6, 64)
    assert not _same(plain, zeroed)
    assert _same(b, plain) and _same(d, plain) and _same(c, zeroed)


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def test_llama_rotary_embedding_edited_by_one_item_in_one_batched_pass(llama):
    model = interlace.Model(llama)
    x = _ids(2)
    with torch.no_grad(), Calls(llama) as calls, model.sweep(
            range(3), input=x, batch_size=3, progress=False) as sweep:
        cos, sin = model.model.rotary_emb.output
        if sweep.item == 1:
            sin[:] = 0
            cos[:] = 1
        shapes = (cos.shape, sin.shape)
        seen = shapes.save()
        logits = model.lm_head.output[:, -1].save()

    def alone(edit):
        def hook(module, args, out):
            return (torch.ones_like(out[0]), torch.zeros_like(out[1])) if edit else out
        handle = llama.model.rotary_emb.register_forward_hook(hook)
        try:
            with torch.no_grad():
                return llama(x).logits[:, -1]
        finally:
            handle.remove()

    assert calls.sizes == [3]
    assert seen[0] == (torch.Size([1, 6, 16]), torch.Size([1, 6, 16]))
    assert not torch.equal(alone(False), alone(True))
    assert torch.allclose(logits[1], alone(True), atol=1e-6)
    assert torch.allclose(logits[0], alone(False), atol=1e-6)
    assert torch.allclose(logits[2], alone(False), atol=1e-6)


class _Positions(nn.Module):
    """A position embedding of arange(S): no batch dim, (S, 8) whatever the batch."""

    def __init__(self, length):
        super().__init__()
        self.length = length
        self.pos = nn.Embedding(length, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x + self.pos(torch.arange(self.length)))


@pytest.mark.parametrize("batch_size", [3, 4])
def test_a_shared_value_has_its_alone_shape_whatever_the_batch_size(batch_size):
    torch.manual_seed(0)
    module = _Positions(4).eval()  # S == 4: the batch total of a batch of 4
    model = interlace.Model(module)
    xs = [torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad(), model.sweep(xs, batch_size=batch_size, progress=False) as sweep:
        pos = model.pos.output.save()
        if sweep.index == 2:
            model.pos.output[0] = 0
        out = model.output.save()
    for i, x in enumerate(xs):
        assert pos[i].shape == (4, 8)
        with torch.no_grad():
            alone_pos = module.pos(torch.arange(4))
            assert torch.equal(pos[i], alone_pos)
            if i == 2:
                alone_pos = alone_pos.clone()
                alone_pos[0] = 0
            assert torch.allclose(out[i], module.proj(x + alone_pos), atol=1e-6)


# -- 2. values reduced over the batch -------------------------------------------------------------


def test_each_items_loss_equals_its_loss_alone_in_a_sweep(lm):
    module = _module_of(lm)
    rows = [_ids(10 + i, n=7) % 300 for i in range(4)]
    items = [{"input_ids": r, "labels": r} for r in rows]
    with pytest.warns(interlace.BatchingWarning, match="reduced over the batch"):
        with torch.no_grad(), lm.sweep(items, batch_size=4, progress=False) as sweep:
            loss = sweep.output.loss.save()
    with torch.no_grad():
        alone = [module(r, labels=r).loss for r in rows]
    assert len({round(v.item(), 6) for v in alone}) == 4
    assert all(torch.equal(a, b) for a, b in zip(loss, alone))


def test_each_invokes_loss_equals_its_loss_alone(lm):
    module = _module_of(lm)
    r1, r2 = _ids(20, n=5) % 300, _ids(21, n=5) % 300
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", interlace.BatchingWarning)  # said once per model
        with torch.no_grad(), lm.trace() as tracer:
            with tracer.invoke(r1, labels=r1):
                a = tracer.result.loss.save()
            with tracer.invoke(r2, labels=r2):
                b = tracer.result.loss.save()
    with torch.no_grad():
        assert torch.equal(a, module(r1, labels=r1).loss)
        assert torch.equal(b, module(r2, labels=r2).loss)


class _MeanHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x).mean()


def test_a_forward_ending_in_mean_gives_each_item_its_own_mean():
    torch.manual_seed(0)
    module = _MeanHead().eval()
    model = interlace.Model(module)
    xs = [torch.randn(1, 6, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    with pytest.warns(interlace.BatchingWarning):
        with torch.no_grad(), model.sweep(xs, batch_size=5, progress=False) as sweep:
            hidden = model.lin.output.save()
            out = sweep.output.save()
    with torch.no_grad():
        for i, x in enumerate(xs):
            assert torch.equal(out[i], module(x)) and torch.equal(hidden[i], module.lin(x))
    assert sweep.chosen_batch_size == 1


def test_invokes_that_share_variables_are_not_run_apart(lm):
    r1, r2 = _ids(30, n=5) % 300, _ids(31, n=5) % 300
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", interlace.BatchingWarning)
        with pytest.raises(interlace.InterlaceError, match="cannot run apart"):
            with torch.no_grad(), lm.trace() as tracer:
                with tracer.invoke(r1, labels=r1):
                    a = tracer.result.loss
                with tracer.invoke(r2, labels=r2):
                    b = (tracer.result.loss + a).save()  # noqa: F841


def _module_of(wrapper):
    from interlace.intervention.access import module_of

    return module_of(wrapper)


# -- 3. sequence-first models ------------------------------------------------------------------


class _SequenceFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.attn = nn.MultiheadAttention(16, 2)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        out, _ = self.lstm(x)
        out = self.encoder(out)
        out, _ = self.attn(out, out, out, need_weights=True)
        return self.head(out)


@pytest.fixture(scope="module")
def seq_first():
    torch.manual_seed(0)
    return _SequenceFirst().eval()


def _seqs(n, length=5):
    return [torch.randn(length, 1, 8, generator=torch.Generator().manual_seed(40 + i)) for i in range(n)]


def _alone_values(module, x, edit):
    """(lstm output, h_n, attention weights, head output) of `module` on `x` alone, with the
    first encoder layer's output zeroed when `edit`."""
    seen = {}
    hooks = [
        module.lstm.register_forward_hook(lambda m, a, o: seen.update(lstm=o)),
        module.attn.register_forward_hook(lambda m, a, o: seen.update(weights=o[1])),
    ]
    if edit:
        hooks.append(module.encoder.layers[0].register_forward_hook(lambda m, a, o: torch.zeros_like(o)))
    try:
        with torch.no_grad():
            out = module(x)
    finally:
        for h in hooks:
            h.remove()
    return seen["lstm"][0], seen["lstm"][1][0], seen["weights"], out


@pytest.mark.parametrize("batch_size", [2, 3])
def test_a_sequence_first_model_batches_along_batch_dim(seq_first, batch_size):
    model = interlace.Model(seq_first, batch_dim=1)
    xs = _seqs(3)
    with torch.no_grad(), Calls(seq_first) as calls, model.sweep(
            xs, batch_size=batch_size, progress=False) as sweep:
        out, (h, c) = model.lstm.output
        lstm_out, h_n = out.save(), h.save()
        if sweep.index == 1:
            model.encoder.layers[0].output[:] = 0
        weights = model.attn.output[1].save()
        head = model.head.output.save()
    assert calls.sizes and all(size == 5 for size in calls.sizes)  # dim 0 is time, never batch
    for i, x in enumerate(xs):
        ref = _alone_values(seq_first, x, edit=i == 1)
        assert lstm_out[i].shape == (5, 1, 16) and h_n[i].shape == (1, 1, 16)
        assert weights[i].shape == (1, 5, 5)
        for got, want in zip((lstm_out[i], h_n[i], weights[i], head[i]), ref):
            assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(head[1], _alone_values(seq_first, xs[1], edit=False)[3])


def test_sequence_first_invokes_batch_along_batch_dim(seq_first):
    model = interlace.Model(seq_first, batch_dim=1)
    x1, x2 = _seqs(2)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(x1):
            a = model.head.output.save()
        with tracer.invoke(x2):
            b = model.head.output.save()
    with torch.no_grad():
        assert torch.allclose(a, seq_first(x1), atol=1e-5)
        assert torch.allclose(b, seq_first(x2), atol=1e-5)


def test_a_sequence_first_model_refuses_to_batch_without_batch_dim(seq_first):
    model = interlace.Model(seq_first)
    with pytest.raises(BatchingError, match=r"model\.lstm \(LSTM\).*batch_first=False.*batch_dim"):
        with torch.no_grad(), model.sweep(_seqs(3), batch_size=3, progress=False):
            model.head.output.save()
    with pytest.raises(BatchingError, match="batch_dim"):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(_seqs(1)[0]):
                model.head.output.save()
            with tracer.invoke(_seqs(1)[0]):
                model.head.output.save()
    # one input alone is not batched: it runs as given
    with torch.no_grad(), model.trace(_seqs(1)[0]):
        out = model.head.output.save()
    assert out.shape == (5, 1, 4)


def test_batch_dim_zero_is_accepted_for_a_model_that_transposes_itself():
    class Transposing(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(4, 6)

        def forward(self, x):  # x: (batch, seq, feature)
            out, _ = self.gru(x.transpose(0, 1))
            return out.transpose(0, 1)

    torch.manual_seed(0)
    module = Transposing().eval()
    model = interlace.Model(module, batch_dim=0)
    xs = [torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with torch.no_grad(), model.sweep(xs, batch_size=3, progress=False):
        gru = model.gru.output[0].save()
        out = model.output.save()
    with torch.no_grad():
        for i, x in enumerate(xs):
            assert torch.allclose(out[i], module(x), atol=1e-6)
            assert torch.allclose(gru[i], module.gru(x.transpose(0, 1))[0], atol=1e-6)


@pytest.mark.parametrize("bad", [-1, 1.0, "1", True])
def test_bad_batch_dims_raise(seq_first, bad):
    with pytest.raises(ValueError, match="batch_dim"):
        interlace.Model(seq_first, batch_dim=bad)


def test_a_batch_dim_the_inputs_do_not_have_raises(mlp):
    model = interlace.Model(mlp, batch_dim=2)
    with pytest.raises(BatchingError, match="batch_dim=2"):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(torch.randn(1, 6)):
                model.output.save()
            with tracer.invoke(torch.randn(1, 6)):
                model.output.save()


# -- 4. a forward that fails only when batched -------------------------------------------------


def test_a_batch_only_model_error_lowers_the_batch_size(lm):
    module = _module_of(lm)
    rows = [_ids(50 + i, n=6) % 300 for i in range(32)]
    labels = rows[0]  # one row for the whole sweep: fails for any batch of more than one
    with pytest.warns(interlace.BatchingWarning, match="Expected input batch_size"):
        with torch.no_grad(), Calls(module) as calls, lm.sweep(
                rows, labels=labels, batch_size=8, progress=False) as sweep:
            loss = sweep.output.loss.save()
    assert sweep.chosen_batch_size == 1
    assert len(calls.sizes) <= 33  # one failed batch, then each item once
    with torch.no_grad():
        assert all(torch.equal(a, module(r, labels=labels).loss) for a, r in zip(loss, rows))


# -- 5. inputs as given ----------------------------------------------------------------------------


def test_a_right_padded_encoding_reaches_the_model_as_given(lm, tokenizer):
    module = _module_of(lm)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    enc = tokenizer(["the capital of france is paris", "hello"], return_tensors="pt", padding=True)
    assert enc["attention_mask"][1, -1] == 0  # right-padded
    seen = []
    handle = module.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"]),
                                              with_kwargs=True)
    try:
        with torch.no_grad(), lm.trace(enc):
            logits = lm.lm_head.output.save()
        with torch.no_grad(), lm.sweep([enc, enc], batch_size=2, progress=False):
            swept = lm.lm_head.output.save()
    finally:
        handle.remove()
    assert torch.equal(seen[0], enc["input_ids"]) and torch.equal(seen[1], torch.cat([enc["input_ids"]] * 2))
    with torch.no_grad():
        ref = module(**enc).logits
    real = enc["attention_mask"].bool()
    assert torch.allclose(logits[real], ref[real], atol=1e-5)
    assert torch.allclose(swept[1][real], ref[real], atol=1e-5)


def test_a_batch_dim_no_value_carries_is_refused():
    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 3)

        def forward(self, x):  # x: (2, n): pools dim 1 away at once
            return self.lin(x.sum(1))

    model = interlace.Model(Pooled().eval(), batch_dim=1)
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with pytest.raises(BatchingError, match="batch_dim=1.*no value"):
        with torch.no_grad(), model.sweep(xs, batch_size=3, progress=False):
            model.lin.output.save()


def test_each_sweep_item_reads_its_own_rows_of_the_models_cache(gpt2_model, gpt2):
    """`sweep.output`'s cache (a transformers `Cache` object) is the item's rows of the
    batch's: each layer's keys and values equal the model run on that item alone."""
    xs = [_ids(40 + i, n=5) for i in range(3)]
    with torch.no_grad(), gpt2_model.sweep(xs, batch_size=3, progress=False) as sweep:
        keys = sweep.output.cache.layers[1].keys.save()
        values = sweep.output.cache.layers[0].values.save()
    assert sweep.chosen_batch_size == 3
    for i, x in enumerate(xs):
        with torch.no_grad():
            alone = gpt2(x).cache
        assert keys[i].shape == alone.layers[1].keys.shape
        assert _same(keys[i], alone.layers[1].keys) and _same(values[i], alone.layers[0].values)

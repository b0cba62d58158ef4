"""The contenders: the same work written for each way of doing it.

Every contender has one method per operation. A method takes the subject and the
operation's arguments, does its setup (wrapping, hooks that stay) outside the timed part, and
returns a zero-argument callable that does the work once and returns what the work produced
(the saved values), or None when the contender has no way to do that work. Results are
compared across contenders before anything is timed (`measure.agree`).

* raw          the model's forward (or `generate`) alone: no reading, no editing
* hooks        plain `register_forward_hook` doing the same reads and edits: the floor
* prototype    issue 20's mechanism by hand, no interlace: instance `forward`s tapped by
               closures that switch to one pooled greenlet running the body (prototype.py)
* genproto     issue 21's mechanism by hand, no interlace: the body a Python generator that
               yields the module it waits for, each tapped forward `send`s it the output
               (prototype.py; save one, zero MLPs, fixed)
* gencore      genproto run by interlace's tracer core: the `with` block captured, skipped,
               deferred, compiled as a generator, its saves written back (prototype.py):
               the capture-and-skip design's floor, with no engine
* checked      the tracer core driving a plain-Python generator engine that makes the checks an
               express run cannot do without (prototype.py's CheckedEngine; save one, zero MLPs,
               fixed): the floor of that mechanism. Only when named in --contenders
* interlace    `interlace.Model` / `interlace.LanguageModel`, on whichever path this process
               loaded (the harness runs the pure-Python twin in a second process)
* nnsight      nnsight 0.8.1, on its own deep copy of the module (it replaces every module's
               `forward` for good when it wraps a model); its function form `nnsight.save`
* tlens        TransformerLens' TransformerBridge over a deep copy of the module

Saved values are the tensors the model produced, not copies, for every contender: the hooks
keep `output`, not `output.clone()`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import shutil
import warnings

import torch

#: Tracer entries timed per call of a `noop_tracer`/`nullcontext` callable (one entry is < 1 us).
ENTRIES = 1000


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@functools.lru_cache(maxsize=None)
def patching(s, repeat: int):
    """The `sweep_item` workload's inputs on subject `s` (issue 20's sweep probe): every block's
    output on the clean run, the corrupted run's ids, and the items: every (layer, position)
    cell, `repeat` times over."""
    from .probes import sweep as P

    clean_ids, corrupt = P.inputs(s.shape.vocab, s.shape.tokens, s.device)
    cells = [(layer, pos) for layer in range(s.shape.layers) for pos in range(s.shape.tokens)]
    return P.clean_cache(s.module, s.layers(), clean_ids), corrupt, cells * repeat


def _no_iteration_warning():
    """Open-ended `tracer.iter[:]` ends with a warning by design; the harness expects it."""
    import interlace

    warnings.filterwarnings("ignore", category=interlace.IterationCutShortWarning)


class Contender:
    name = ""
    label = ""
    version = ""

    def unavailable(self) -> str | None:
        """Why this contender cannot run here (None: it can)."""
        return None

    # Operations (see the module docstring); None: not something this contender does.
    def save_one(self, s): return None
    def zero_mlps(self, s, k=None): return None
    def save_all(self, s): return None
    def invokes(self, s, n): return None
    def generate(self, s, new): return None
    def fixed(self, s): return None
    def wrapped(self, s): return None
    def noop_tracer(self, s): return None
    def collect(self, s, items, tokens): return None
    def edited(self, s, how): return None
    def sweep_item(self, s, repeat, batch): return None


class Raw(Contender):
    name, label = "raw", "raw forward"

    def _forward(self, s):
        module, ids = s.module, s.ids
        return lambda: (module(ids), None)[1]

    save_one = save_all = fixed = _forward

    def zero_mlps(self, s, k=None):
        return self._forward(s)

    def edited(self, s, how):
        return self._forward(s)

    def invokes(self, s, n):
        module, batch = s.module, torch.cat(s.rows(n))
        return lambda: (module(batch), None)[1]

    def sweep_item(self, s, repeat, batch):
        """The sweep's batched forwards alone."""
        module, (_, corrupt, items) = s.module, patching(s, repeat)
        sizes = [len(items[start:start + batch]) for start in range(0, len(items), batch)]

        def run():
            for n in sizes:
                module(corrupt.expand(n, -1))
        return run

    def generate(self, s, new):
        module, ids, kw = s.module, s.ids, _gen_kwargs(new)
        mask = torch.ones_like(ids)
        return lambda: (module.generate(ids, attention_mask=mask, **kw), None)[1]

    def wrapped(self, s):
        module, ids = s.module, s.ids
        return lambda: module(ids)

    def noop_tracer(self, s):
        def run():
            for _ in range(ENTRIES):
                with contextlib.nullcontext():
                    x = 1  # noqa: F841 - the body under test, never read
        return run


class Hooks(Contender):
    """Plain torch hooks, registered and removed around each run like a trace's are."""

    name, label = "hooks", "plain hooks"

    @staticmethod
    def _run(module, hooks, run):
        handles = [m.register_forward_hook(fn) for m, fn in hooks]
        try:
            return run()
        finally:
            for handle in handles:
                handle.remove()

    def save_one(self, s):
        module, ids, layer = s.module, s.ids, s.layers()[0]

        def run():
            out = []
            self._run(module, [(layer, lambda m, a, o: out.append(_first(o)))], lambda: module(ids))
            return out[0]
        return run

    def zero_mlps(self, s, k=None):
        module, ids, head = s.module, s.ids, s.lm_head()
        mlps = [layer.mlp for layer in s.layers()][:k]

        def run():
            out = []
            hooks = [(mlp, lambda m, a, o: torch.zeros_like(o)) for mlp in mlps]
            hooks.append((head, lambda m, a, o: out.append(o)))
            self._run(module, hooks, lambda: module(ids))
            return out[0]
        return run

    def edited(self, s, how):
        return self.zero_mlps(s)  # the same edit, as hooks registered around each call

    def save_all(self, s):
        module, ids, layers = s.module, s.ids, list(s.layers())

        def run():
            out = []
            self._run(module, [(layer, lambda m, a, o: out.append(_first(o))) for layer in layers],
                      lambda: module(ids))
            return out
        return run

    def invokes(self, s, n):
        module, layer, batch = s.module, s.layers()[0], torch.cat(s.rows(n))

        def run():
            out = []
            self._run(module, [(layer, lambda m, a, o: out.append(_first(o)))], lambda: module(batch))
            return list(out[0].split(1))
        return run

    def generate(self, s, new):
        module, ids, head, kw = s.module, s.ids, s.lm_head(), _gen_kwargs(new)
        mask = torch.ones_like(ids)

        def run():
            out = []
            self._run(module, [(head, lambda m, a, o: out.append(o))],
                      lambda: module.generate(ids, attention_mask=mask, **kw))
            return out
        return run

    def fixed(self, s):
        module, x = s.module, s.ids

        def run():
            out = []
            self._run(module, [(module, lambda m, a, o: out.append(o))], lambda: module(x))
            return out[0]
        return run


    def sweep_item(self, s, repeat, batch):
        """Issue 20's floor: hooks hand-batched, one per layer writing its rows in a Python loop."""
        from .probes import sweep as P

        module, layers, (clean, corrupt, items) = s.module, s.layers(), patching(s, repeat)
        return lambda: torch.cat(P.floor(module, layers, items, corrupt, clean, batch, per_row=True))

    def collect(self, s, items, tokens):
        from .probes import datasets as D

        module, layers, folder = s.module, list(s.layers()), _folder()
        ids = D.windows(s.shape.vocab, items, tokens).to(s.device)

        def run():
            shutil.rmtree(folder, ignore_errors=True)
            D.hooks_loop(module, [layers[0], layers[-1]], ids, folder)
            return D.last_row(folder)
        return run


def _folder():
    """A folder for a `collect` run's files, removed when the process exits."""
    import atexit
    import tempfile

    root = tempfile.mkdtemp(prefix="bench-collect-")
    atexit.register(shutil.rmtree, root, True)
    return os.path.join(root, "data")


class Interlace(Contender):
    name, label = "interlace", "interlace"

    def unavailable(self):
        import interlace

        if self.name == "interlace" and not interlace.native:
            return "the compiled extension is not loaded (build it: make build)"
        return None

    @property
    def version(self):
        import interlace

        return interlace.__version__

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one wrapper per subject, for the process
    def model(self, s):
        import interlace

        return interlace.Model(s.module)

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one per subject, kept for the process
    def language_model(self, s):
        import interlace

        return interlace.LanguageModel(s.module, tokenizer=s.tokenizer)

    def save_one(self, s):
        from interlace import save

        model, ids = self.model(s), s.ids

        def run():
            with model.trace(ids):
                h = save(s.layers_of(model)[0].output)
            return h
        return run

    def zero_mlps(self, s, k=None):
        from interlace import save

        model, ids = self.model(s), s.ids
        k = s.shape.layers if k is None else k

        def run():
            with model.trace(ids):
                layers = s.layers_of(model)
                for i in range(k):
                    mlp = layers[i].mlp
                    mlp.output = torch.zeros_like(mlp.output)
                logits = save(s.head_of(model).output)
            return logits
        return run

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one per subject, kept for the process
    def zeroed(self, s):
        """`model.edit()` zeroing every MLP's output (the zero_mlps edit, recorded once)."""
        with self.model(s).edit() as edited:
            for layer in s.layers_of(edited):
                layer.mlp.output = torch.zeros_like(layer.mlp.output)
        return edited

    def edited(self, s, how):
        """The recorded edit run by a trace of the edited wrapper (how="trace"), or by a call
        of the module `as_module()` exports (how="module"), reading the logits."""
        from interlace import save

        edited, ids = self.zeroed(s), s.ids
        if how == "module":
            module = edited.as_module()
            return lambda: module(ids).logits

        def run():
            with edited.trace(ids):
                logits = save(s.head_of(edited).output)
            return logits
        return run

    def save_all(self, s):
        from interlace import save

        model, ids = self.model(s), s.ids

        def run():
            with model.trace(ids):
                hs = save([layer.output for layer in s.layers_of(model)])
            return hs
        return run

    def invokes(self, s, n):
        from interlace import save

        lm, rows = self.language_model(s), s.rows(n)

        def run():
            with lm.trace() as tracer:
                hs = save([])
                for row in rows:
                    with tracer.invoke(row):
                        hs.append(s.layers_of(lm)[0].output)
            return hs
        return run

    def generate(self, s, new):
        from interlace import save

        _no_iteration_warning()
        lm, ids, kw = self.language_model(s), s.ids, _gen_kwargs(new)

        def run():
            with lm.generate(ids, **kw) as tracer:
                logits = save([])
                for step in tracer.iter[:]:  # noqa: B007 - the loop drives the steps
                    logits.append(s.head_of(lm).output)
            return logits
        return run

    def fixed(self, s):
        from interlace import save

        model, x = self.model(s), s.ids

        def run():
            with model.trace(x):
                h = save(model.output)
            return h
        return run

    def wrapped(self, s):
        model, ids = self.model(s), s.ids
        return lambda: model(ids)

    def sweep_item(self, s, repeat, batch):
        from .probes import sweep as P

        model, (clean, corrupt, items) = self.model(s), patching(s, repeat)
        blocks, head = s.layers_of(model), s.head_of(model)
        return lambda: torch.cat(P.patch_sweep(model, blocks, head, items, corrupt, clean, batch)[0])

    def noop_tracer(self, s):
        from interlace import Backend, Tracer

        class Nothing(Backend):
            def __call__(self, tracer):
                pass

        nothing = Nothing()

        def run():
            for _ in range(ENTRIES):
                with Tracer(backend=nothing):
                    x = 1  # noqa: F841 - the body under test, never read
        return run

    def collect(self, s, items, tokens):
        if importlib.util.find_spec("datasets") is None:
            return None  # save_to= needs the extra: pip install 'interlace[datasets]'
        from .probes import datasets as D

        model, folder = self.model(s), _folder()
        layers = s.layers_of(model)
        first, last = layers[0], layers[len(s.layers()) - 1]
        ids = D.windows(s.shape.vocab, items, tokens).to(s.device)

        def run():
            D.sweep(model, first, last, ids, folder)
            return D.last_row(folder)
        return run


class NNsight(Contender):
    name, label = "nnsight", "nnsight"

    def unavailable(self):
        if importlib.util.find_spec("nnsight") is None:
            return "nnsight is not installed (pip install -e '.[bench]')"
        from importlib.metadata import version

        if version("nnsight") != "0.8.1":
            return f"nnsight {version('nnsight')} is installed; the harness compares with 0.8.1"
        return None

    @property
    def version(self):
        from importlib.metadata import version

        return version("nnsight")

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one per subject, kept for the process
    def model(self, s):
        import nnsight

        return nnsight.NNsight(copy.deepcopy(s.module))

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one per subject, kept for the process
    def language_model(self, s):
        import nnsight

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 0.8.1 calls LanguageModel deprecated
            return nnsight.LanguageModel(copy.deepcopy(s.module), tokenizer=s.tokenizer)

    def save_one(self, s):
        from nnsight import save

        model, ids = self.model(s), s.ids

        def run():
            with model.trace(ids):
                h = save(s.layers_of(model)[0].output)
            return h
        return run

    def zero_mlps(self, s, k=None):
        from nnsight import save

        model, ids = self.model(s), s.ids
        k = s.shape.layers if k is None else k

        def run():
            with model.trace(ids):
                layers = s.layers_of(model)
                for i in range(k):
                    mlp = layers[i].mlp
                    mlp.output = torch.zeros_like(mlp.output)
                logits = save(s.head_of(model).output)
            return logits
        return run

    def save_all(self, s):
        from nnsight import save

        model, ids = self.model(s), s.ids

        def run():
            with model.trace(ids):
                hs = save([layer.output for layer in s.layers_of(model)])
            return hs
        return run

    def invokes(self, s, n):
        from nnsight import save

        lm, rows = self.language_model(s), s.rows(n)

        def run():
            with lm.trace() as tracer:
                hs = save([])
                for row in rows:
                    with tracer.invoke(row):
                        hs.append(s.layers_of(lm)[0].output)
            return hs
        return run

    def generate(self, s, new):
        from nnsight import save

        lm, ids, kw = self.language_model(s), s.ids, _gen_kwargs(new)

        def run():
            with lm.generate(ids, **kw) as tracer:
                logits = save([])
                for step in tracer.iter[:]:  # noqa: B007 - the loop drives the steps
                    logits.append(s.head_of(lm).output)
            return logits
        return run

    def fixed(self, s):
        from nnsight import save

        model, x = self.model(s), s.ids

        def run():
            with model.trace(x):
                h = save(model.output)
            return h
        return run

    def wrapped(self, s):
        model, ids = self.model(s), s.ids
        return lambda: model(ids)


class TransformerLens(Contender):
    """TransformerLens 4 (TransformerBridge over the transformers module): hooks by name."""

    name, label = "tlens", "TransformerLens"

    def unavailable(self):
        if importlib.util.find_spec("transformer_lens") is None:
            return "TransformerLens is not installed (pip install transformer-lens)"
        return None

    @property
    def version(self):
        from importlib.metadata import version

        return version("transformer-lens")

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one per subject, kept for the process
    def bridge(self, s):
        from transformer_lens.model_bridge import TransformerBridge

        # (the subjects' tokenizer has no bos token: with one, the bridge reloads it by name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return TransformerBridge.boot_transformers(
                s.arch, hf_model=copy.deepcopy(s.module), tokenizer=s.tokenizer, device=s.device)

    def _hooked(self, s, hooks):
        bridge, ids = self.bridge(s), s.ids
        return lambda: bridge.run_with_hooks(ids, fwd_hooks=hooks)

    def save_one(self, s):
        out = []
        run = self._hooked(s, [("blocks.0.hook_out", lambda t, hook: out.append(t))])
        return lambda: (out.clear(), run(), out[0])[2]

    def zero_mlps(self, s, k=None):
        k = s.shape.layers if k is None else k
        return self._hooked(s, [(f"blocks.{i}.mlp.hook_out", lambda t, hook: torch.zeros_like(t))
                                for i in range(k)])

    def save_all(self, s):
        out = []
        run = self._hooked(s, [(f"blocks.{i}.hook_out", lambda t, hook: out.append(t))
                               for i in range(s.shape.layers)])
        return lambda: (out.clear(), run(), list(out))[2]


def _gen_kwargs(new: int) -> dict:
    return dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

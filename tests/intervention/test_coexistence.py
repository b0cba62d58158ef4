"""interlace next to other tools in one process: torch.compile, nnsight, imports after a trace.

Whatever is mounted on `object`, and dynamo's caches, are process-wide: the cases about
import order run in fresh interpreters (on the same interlace path: the INTERLACE_*
switches are inherited). nnsight is an optional test dependency (`pip install .[compare]`);
its cases skip when it is absent.
"""

import copy
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import interlace

from .helpers import hooked, reference_outputs

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
HAS_NNSIGHT = importlib.util.find_spec("nnsight") is not None
needs_nnsight = pytest.mark.skipif(not HAS_NNSIGHT, reason="nnsight is not installed (pip install .[compare])")


def run_fresh(code, *paths, timeout=600):
    """Run `code` in a fresh interpreter that imports interlace from src/; its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, *map(str, paths)]))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.strip().splitlines()[-1]


# -- torch.compile --------------------------------------------------------------------------------
COMPILE_AFTER_IMPORT = """
import torch, interlace
torch.manual_seed(0)
x = torch.randn(2, 4)

def check(net):
    compiled = torch.compile(net, backend={backend!r})
    with torch.no_grad():
        assert torch.allclose(compiled(x), net(x), atol=1e-6)

check(torch.nn.Linear(4, 4))            # the issue's case: right after `import interlace`
with interlace.Tracer():
    kept = [1].save()                   # `.save` is on `object` from here on
check(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()))
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_works_after_import_interlace(backend):
    if backend == "inductor" and shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("inductor on CPU needs a C++ compiler")
    assert run_fresh(COMPILE_AFTER_IMPORT.format(backend=backend)) == "ok"


class Block(torch.nn.Module):
    """Its forward calls a torch.compile'd function: compiled code that no wrapper shows."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(6, 16)
        self.head = torch.nn.Linear(16, 4)
        self.eager_runs = []
        self.fused = torch.compile(self._fused, backend="eager")

    @property
    def calls(self):
        """How many times `_fused` ran as Python code rather than as the compiled graph."""
        return len(self.eager_runs)

    def _fused(self, x):
        if not torch.compiler.is_compiling():
            self.eager_runs.append(1)
        return self.head(torch.relu(self.inner(x)))

    def forward(self, x):
        return self.fused(x)


def test_a_compiled_model_runs_eagerly_inside_a_trace(mlp, x6):
    """Reads see the real values and edits land, as on the eager model; outside, compiled."""
    net = copy.deepcopy(mlp)
    compiled = torch.compile(net, backend="eager")
    with torch.no_grad():
        assert torch.allclose(compiled(x6), mlp(x6))  # compiled once, before any trace
    (h_ref,), plain = reference_outputs(mlp, (x6,), [mlp[1]])

    def zero(module, args, out):
        return torch.zeros_like(out)

    with torch.no_grad(), hooked(mlp, output={mlp[3]: zero}):
        edited_ref = mlp(x6)
    assert not torch.allclose(edited_ref, plain)  # the edit is not vacuous

    from torch._dynamo.utils import counters

    compiles = counters["frames"]["total"]
    model = interlace.Model(compiled)
    with torch.no_grad(), model.trace(x6):
        h = model._orig_mod[1].output.save()
        model._orig_mod[3].output[:] = 0
        out = model.output.save()
    assert torch.equal(h, h_ref)
    assert torch.equal(out, edited_ref)
    with torch.no_grad():
        assert torch.allclose(compiled(x6), plain)  # the edit and its hooks are gone
    assert counters["frames"]["total"] == compiles  # ...and the trace caused no recompile
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_a_compiled_function_inside_the_forward_runs_eagerly_in_a_trace():
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(3, 6)
    with torch.no_grad():
        compiled_out = block(x)  # compiles
        inner_ref = block.inner(x)  # the reference: the submodules called by hand
        edited_ref = block.head(torch.zeros(3, 16))
    calls = block.calls
    assert not torch.allclose(edited_ref, compiled_out)  # the edit is not vacuous
    model = interlace.Model(block)
    with torch.no_grad(), model.trace(x):
        inner = model.inner.output.clone().save()
        model.inner.output[:] = 0
        out = model.output.save()
    assert block.calls == calls + 1  # the trace ran the Python code...
    assert torch.equal(inner, inner_ref)
    assert torch.equal(out, edited_ref)  # ...and the edit landed
    with torch.no_grad():
        again = block(x)
        block(x)
    assert torch.allclose(again, compiled_out)
    assert block.calls == calls + 1  # outside traces the graph runs again


def test_the_stance_is_restored_after_a_failing_trace():
    """An error inside the trace still puts dynamo's stance back (compiled stays compiled)."""
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(3, 6)
    with torch.no_grad():
        block(x)
    calls = block.calls
    model = interlace.Model(block)
    with pytest.raises(ZeroDivisionError), torch.no_grad(), model.trace(x):
        model.inner.output.save()
        1 / 0
    assert block.calls == calls + 1  # the trace ran the Python code
    with torch.no_grad():
        block(x)
    assert block.calls == calls + 1  # compiled again: the stance went back to "default"


COMPILED_BETWEEN_WARM_TRACES = """
import torch, torch._dynamo, interlace

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.fused = None
        self.eager_runs = 0

    def _fused(self, x):
        if not torch.compiler.is_compiling():
            self.eager_runs += 1
        return torch.relu(x)

    def forward(self, x):
        x = self.inner(x)
        return self.fused(x) if self.fused is not None else torch.relu(x)

net = Block()
model = interlace.Model(net)
x = torch.randn(2, 4)

def traced():
    with torch.no_grad(), model.trace(x):
        h = model.inner.output.save()
    return h

for _ in range(3):  # the audit, then express runs: dynamo imported, nothing compiled
    traced()
net.fused = torch.compile(net._fused, backend="eager")
with torch.no_grad():
    net(x)  # compiled: the graph runs, not the Python code
before = net.eager_runs
for _ in range(3):  # dynamo's backends changed since the runs above: each trace runs eagerly
    traced()
assert net.eager_runs == before + 3, (before, net.eager_runs)
with torch.no_grad():
    net(x)
assert net.eager_runs == before + 3  # and the graph again outside traces
print("ok")
"""


@pytest.mark.slow
def test_a_function_compiled_between_warm_traces_runs_eagerly_in_the_next():
    """The express run asks `compiled.force_eager` only when dynamo's backends changed since
    it last had nothing to do (`compiled.quiet_backends`): something compiled after warm
    traces must still run eagerly in the next ones. In a fresh interpreter: what dynamo has
    compiled is process-wide."""
    assert run_fresh(COMPILED_BETWEEN_WARM_TRACES) == "ok"


# -- nnsight in the same process -------------------------------------------------------------------
NNSIGHT_SIDE_BY_SIDE = """
import copy
{imports}
import torch

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
x = torch.randn(3, 4)
seen = {{}}
handle = net[0].register_forward_hook(lambda m, a, out: seen.setdefault("h", out.detach().clone()))
with torch.no_grad():
    plain = net(x)
handle.remove()
with torch.no_grad():
    zeroed = net[2](torch.zeros(3, 8))

theirs = nnsight.NNsight(copy.deepcopy(net))
ours = interlace.Model(net)

def both():
    with torch.no_grad(), theirs.trace(x):
        a = theirs[0].output.save()
        theirs[1].output[:] = 0
        a_out = theirs.output.save()
    with torch.no_grad(), ours.trace(x):
        b = ours[0].output.save()
        ours[1].output[:] = 0
        b_out = interlace.save(ours.output)
        none = None.save()
    with torch.no_grad(), theirs.trace(x):
        c = nnsight.save(theirs.output)
    assert torch.equal(a, seen["h"]) and torch.equal(b, seen["h"])
    assert torch.allclose(a_out, zeroed) and torch.allclose(b_out, zeroed) and none is None
    assert torch.allclose(c, plain)
    for bad in (lambda: [1].save(), lambda: interlace.save(1)):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("saved outside any trace")

both()
both()
print("ok")
"""

NNSIGHT_ORDERS = {
    "interlace first": "import interlace\nimport nnsight",
    "nnsight first": "import nnsight\nimport interlace",
    "interlace traced first": (
        "import interlace\nwith interlace.Tracer():\n    kept = [0].save()\nimport nnsight"
    ),
}


@pytest.mark.slow
@needs_nnsight
@pytest.mark.parametrize("order", list(NNSIGHT_ORDERS))
def test_interlace_and_nnsight_each_save_in_their_own_traces(order):
    assert run_fresh(NNSIGHT_SIDE_BY_SIDE.format(imports=NNSIGHT_ORDERS[order])) == "ok"


NNSIGHT_SAME_MODULE_SOURCE = """
import torch, nnsight, interlace
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                  bos_token_id=0, eos_token_id=0)).eval()
ids = torch.randint(0, 1000, (1, 6))
act = gpt2.transformer.h[0].mlp.act
seen = []
handle = act.register_forward_hook(lambda m, a, out: seen.append(out.clone()))
with torch.no_grad():
    clean = gpt2(ids).logits
handle.remove()
handle = act.register_forward_hook(lambda m, a, out: out * 0)
with torch.no_grad():
    zeroed = gpt2(ids).logits
handle.remove()

{wrap}
controller = gpt2.transformer.h[0].mlp.__dict__["forward"]  # nnsight's, on the instance

def ours_():
    with torch.no_grad(), ours.trace(ids) as tracer:
        src = ours.transformer.h[0].mlp.source
        a = src.self_act_0.output.clone().save()
        src.self_act_0.output = src.self_act_0.output * 0
        out = tracer.result.logits.save()
    assert torch.equal(a, seen[0]) and torch.equal(out, zeroed)
    assert gpt2.transformer.h[0].mlp.__dict__["forward"] is controller  # put back

def theirs_():
    with torch.no_grad(), theirs.trace(ids):
        src = theirs.transformer.h[0].mlp.source
        a = src.self_act_0.output.clone().save()
        src.self_act_0.output = src.self_act_0.output * 0
        out = theirs.output.logits.save()
    assert torch.equal(a, seen[0]) and torch.equal(out, zeroed)

ours_()
theirs_()   # nnsight's controller now runs its own rewritten forward
ours_()
theirs_()
with torch.no_grad():
    assert torch.equal(gpt2(ids).logits, clean)
print("ok")
"""

NNSIGHT_WRAPS = {
    "nnsight wraps first": "theirs = nnsight.NNsight(gpt2)\nours = interlace.Model(gpt2)",
    "interlace wraps first": "ours = interlace.Model(gpt2)\ntheirs = nnsight.NNsight(gpt2)",
}


@pytest.mark.slow
@needs_nnsight
@pytest.mark.parametrize("wrap", list(NNSIGHT_WRAPS))
def test_source_of_a_module_nnsight_also_wraps(wrap):
    """nnsight puts its controller (a callable object) on each module's instance `forward`:
    `.source` rewrites the class's forward it calls (its `__wrapped__`) and runs that in the
    controller's place for the run; both libraries' reads and edits equal plain hooks'."""
    assert run_fresh(NNSIGHT_SAME_MODULE_SOURCE.format(wrap=NNSIGHT_WRAPS[wrap])) == "ok"


# -- imports after interlace, and after a trace ------------------------------------------------------
IMPORTS_THEN_TRACE = """
import interlace
{before}
import torch, transformers
{optional}
from transformers import GPT2Config, GPT2LMHeadModel

assert torch.save.__module__ == "torch.serialization"
torch.manual_seed(0)
config = GPT2Config(vocab_size=100, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                    bos_token_id=0, eos_token_id=0)
gpt2 = GPT2LMHeadModel(config).eval()
ids = torch.tensor([[1, 2, 3, 4]])
seen = {{}}
handle = gpt2.transformer.h[0].register_forward_hook(lambda m, a, out: seen.setdefault("h", out[0].clone()))
with torch.no_grad():
    gpt2(ids)
handle.remove()
model = interlace.Model(gpt2)
with torch.no_grad(), model.trace(ids):
    h = model.transformer.h[0].output[0].save()
assert torch.equal(h, seen["h"])
print("ok")
"""


@pytest.mark.parametrize("before", ["", "with interlace.Tracer():\n    kept = [0].save()"],
                         ids=["import then trace", "trace, import, trace"])
@pytest.mark.slow
def test_torch_transformers_and_anyio_import_after_interlace(before):
    optional = "import anyio" if importlib.util.find_spec("anyio") is not None else ""
    assert run_fresh(IMPORTS_THEN_TRACE.format(before=before, optional=optional)) == "ok"


EXPERIMENT = """
import torch
import interlace

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
x = torch.randn(2, 4)
model = interlace.Model(net)
with torch.no_grad(), model.trace(x):
    hidden = model[0].output.save()
MATCHES = torch.equal(hidden, net[0](x).detach())
"""


@pytest.mark.parametrize("before", ["", "with interlace.Tracer():\n    kept = [0].save()"],
                         ids=["first trace", "already mounted"])
@pytest.mark.slow
def test_a_module_that_traces_when_imported(before, tmp_path):
    """A driver imports an experiment module that runs a trace at import time."""
    (tmp_path / "torch_experiment.py").write_text(EXPERIMENT)
    code = f"import interlace\n{before}\nimport torch_experiment\nprint('ok' if torch_experiment.MATCHES else 'no')"
    assert run_fresh(code, tmp_path) == "ok"

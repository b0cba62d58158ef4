"""`global NAME` outside the `with`: the caller's declaration holds in the body, as inline.

A `global` statement is scope-wide, so a traced body inside a function (or class body) that
declares `global G` reads and writes the module global `G` at once, saved or not, as the same
statements inline do. Each block is run with `Inline` (conftest.py) and with
`Tracer`, from the same starting globals, and the results and the module globals compared.
"""

import contextlib
import threading

import pytest

from interlace import Tracer, save
from interlace.tracing import Backend

from .conftest import Inline

G = 0
H = 0
NAMES = ("G", "H", "G_FOR", "G_TUPLE", "G_IMPORT", "G_DEF", "G_CLASS", "G_WALRUS", "G_DEL",
         "G_WITH", "G_EXCEPT", "G_STAR")  # fmt: skip
_MISSING = "<unbound>"


def _state():
    """The module globals the tests touch, comparable across runs (functions, classes and
    modules by name)."""
    out = {}
    for name in NAMES:
        value = globals().get(name, _MISSING)
        if callable(value) or hasattr(value, "__spec__"):
            value = (type(value).__name__, getattr(value, "__name__", None))
        out[name] = value
    return out


def _reset(start):
    for name in NAMES:
        globals().pop(name, None)
    globals().update(start)


def same_as_inline(f, start=None, **kwargs):
    """Run `f(Inline)` then `f(Tracer)` from the same globals; both results, which must agree."""
    start = {"G": 1, "H": 10} if start is None else start
    runs = []
    for cm in (Inline, Tracer):
        _reset(start)
        try:
            out = ("returned", f(cm, **kwargs))
        except Exception as error:  # noqa: BLE001 - an error inline must be the same error traced
            out = ("raised", type(error), str(error))
        runs.append((out, _state()))
    _reset({"G": 0, "H": 0})
    assert runs[1] == runs[0]
    return runs[0]


# -- assignments and reads of a name the function declares global ------------------------------
def assign(cm):
    global G
    with cm():
        G = 5
    return G


def augment(cm):
    global G
    with cm():
        G += 1
    return G


def read_then_write(cm):
    global G, H
    with cm():
        before = G
        G = G * 3
        H = before + G
    return G, H


def test_an_assignment_writes_the_module_global():
    (_, out), state = same_as_inline(assign)
    assert out == 5 and state["G"] == 5


def test_an_augmented_assignment_reads_and_writes_the_module_global():
    (_, out), state = same_as_inline(augment)
    assert out == 2 and state["G"] == 2


def test_reads_before_and_after_the_write_see_the_module_global():
    (_, out), state = same_as_inline(read_then_write)
    assert out == (3, 4) and (state["G"], state["H"]) == (3, 4)


def saved_and_method_saved(cm):
    global G, H
    with cm():
        G = save(G + 1)
        H = [G, H].save()
        kept = save(G * 100)
    return G, H, kept


def test_saved_values_are_the_global_too():
    (_, out), state = same_as_inline(saved_and_method_saved)
    assert out == (2, [2, 10], 200) and (state["G"], state["H"]) == (2, [2, 10])


# -- every way a body binds a name --------------------------------------------------------------
def binds_each_way(cm):
    global G_FOR, G_TUPLE, G_STAR, G_IMPORT, G_DEF, G_CLASS, G_WALRUS, G_DEL, G_WITH, G_EXCEPT
    with cm():
        for G_FOR in range(3):
            pass
        G_TUPLE, (G_STAR, *_rest) = 1, (2, 3)
        import contextlib as G_IMPORT

        def G_DEF():
            return G_FOR + G_TUPLE  # reads the globals, after the block too

        class G_CLASS:
            pass

        squares = save([G_WALRUS := i * i for i in range(4)])
        del G_DEL
        with contextlib.nullcontext(7) as G_WITH:
            pass
        try:
            raise KeyError("x")
        except KeyError as G_EXCEPT:  # unbinds G_EXCEPT at the end of the handler: the global
            pass
    return squares, G_DEF()


def test_every_binding_form_binds_the_module_global():
    start = {"G": 1, "H": 10, "G_DEL": "to delete", "G_EXCEPT": "to unbind"}
    (_, out), state = same_as_inline(binds_each_way, start)
    assert out == ([0, 1, 4, 9], 3)
    assert state["G_FOR"] == 2 and state["G_TUPLE"] == 1 and state["G_STAR"] == 2
    assert state["G_WALRUS"] == 9 and state["G_WITH"] == 7
    assert state["G_IMPORT"][1] == "contextlib" and state["G_DEF"][1] == "G_DEF"
    assert state["G_CLASS"][1] == "G_CLASS"
    assert state["G_DEL"] == _MISSING and state["G_EXCEPT"] == _MISSING


def walrus_in_generators_and_nested_comprehensions(cm):
    global G, H
    with cm():
        total = save(sum((G := i) for i in range(3)))
        grid = save([[H := i * j for j in range(3)] for i in range(3)])
    return total, grid


def test_a_walrus_in_a_generator_or_nested_comprehension_binds_the_module_global():
    (_, out), state = same_as_inline(walrus_in_generators_and_nested_comprehensions)
    assert out == (3, [[0, 0, 0], [0, 1, 2], [0, 2, 4]]) and (state["G"], state["H"]) == (2, 4)


def unbound_global(cm):
    global G
    with cm():
        G += 1
    return G


def test_reading_an_unbound_global_raises_the_same_name_error():
    out, _ = same_as_inline(unbound_global, {"H": 10})
    assert out[:2] == ("raised", NameError) and "'G'" in out[2]


# -- nested scopes in the body, nested traces, the body's own declaration -----------------------
def nested_scopes(cm):
    global G
    with cm():
        G = [G + i for i in range(3)]
        total = save(sum(x for x in G))
        reader = save(lambda: G)
    G = "later"
    return total, reader()


def test_comprehensions_and_functions_in_the_body_see_the_module_global():
    (_, out), state = same_as_inline(nested_scopes)
    assert out == (6, "later") and state["G"] == "later"


def nested_traces(cm):
    global G
    with cm():
        with cm():
            G += 1
        seen = save(G)
        with cm():
            G = G * 10
    return seen, G


def test_nested_traces_write_the_module_global():
    (_, out), state = same_as_inline(nested_traces)
    assert out == (2, 20) and state["G"] == 20


def declared_twice(cm):
    global G
    with cm():
        global G  # noqa: PLW0602 - the body's own declaration as well
        G = G + 40
    return G


def test_a_declaration_in_the_body_as_well():
    (_, out), state = same_as_inline(declared_twice)
    assert out == 41 and state["G"] == 41


def nested_function_declares_a_local_global(cm):
    G = "local"  # noqa: F841 - the caller's own local; only g() declares G global

    def g():
        global G
        G = "from g"

    with cm():
        G = save(G + " body")
    return G, g.__name__


def test_a_nested_functions_declaration_leaves_the_callers_local_alone():
    (_, out), state = same_as_inline(nested_function_declares_a_local_global)
    assert out[0] == "local body" and state["G"] == 1


# -- class bodies and module level --------------------------------------------------------------
def class_in_declaring_function(cm):
    global G

    class Inner:
        with cm():  # a class body is a scope of its own: the function's `global` is not its
            G = save(3)

    class Declaring:
        global H
        with cm():
            H = H + 5
            kept = save(H)

    return Inner.G, Declaring.kept, "H" in vars(Declaring), G


def test_class_bodies_follow_their_own_declarations():
    (_, out), state = same_as_inline(class_in_declaring_function)
    assert out == (3, 15, False, 1) and (state["G"], state["H"]) == (1, 15)


MODULE_SOURCE = """\
global G
with CM():
    G = G + 1
    H = G + 1
    later = save(G + H)
"""


@pytest.mark.parametrize("cm", [Inline, Tracer], ids=["inline", "tracer"])
def test_module_level_declaration_is_a_no_op(tmp_path, cm):
    """At module level `global` changes nothing in Python, and nothing here: the module rule
    (a name the body binds is written back when saved) holds for G as for H."""
    path = tmp_path / "mod_global_decl.py"
    path.write_text(MODULE_SOURCE)
    namespace = {"__name__": "mod_global_decl", "CM": cm, "save": save, "G": 1, "H": 10}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    assert namespace["later"] == 5
    assert (namespace["G"], namespace["H"]) == ((2, 3) if cm is Inline else (1, 10))


# -- a body run later (what interleaving backends do) ------------------------------------------
class RunOnThread(Backend):
    """Defer, run on another thread, push: an interleaving backend's steps."""

    def __call__(self, tracer):
        body = tracer.defer()
        box = {}

        def run():
            try:
                box["values"] = body.run()
            except Exception as error:  # noqa: BLE001 - raised again in the caller's thread
                box["error"] = error

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        body.push(box["values"])


def deferred(cm):
    global G
    with cm(backend=RunOnThread()):
        G += 1
        G_seen = save(G)  # noqa: N806
    return G, G_seen


def test_a_deferred_body_writes_the_module_global():
    (_, out), state = same_as_inline(deferred)
    assert out == (2, 2) and state["G"] == 2

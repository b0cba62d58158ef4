"""The per-event exchange (`hotpath.Exchange`), compiled and twin side by side.

No interleaver here: bodies are plain functions on real greenlets, parked by hand in a real
`Hub`, and the hooks are called by torch on small modules. Results are checked against plain
torch hooks doing the same edit, and against what a body observed while it ran.
"""

import contextvars
import importlib
import threading

import pytest
import torch
from greenlet import greenlet

IMPLS = ["interlace._pyhotpath"]
try:
    importlib.import_module("interlace._chotpath")
    IMPLS.append("interlace._chotpath")
except ImportError:
    pass


@pytest.fixture(params=IMPLS)
def hp(request):
    return importlib.import_module(request.param)


_HARNESSES = []


@pytest.fixture(autouse=True)
def _unwind_bodies():
    """End every body a test left parked: a suspended greenlet in a cycle is never freed."""
    yield
    while _HARNESSES:
        _HARNESSES.pop().close()


class Harness:
    """One run: a hub, an exchange, and bodies that park on it like mediators do."""

    def __init__(self, hp, nkeys=8, routed=None, message=None):
        self.hp = hp
        self.hub = hp.Hub(nkeys, 0, None, None, True)
        self.messages = []
        self.bodies = []
        _HARNESSES.append(self)

        def record(mediator, msg, event):
            self.messages.append((mediator.index, msg))
            if message is not None:
                message(mediator, msg, event)

        self.ex = hp.Exchange(torch.is_grad_enabled, torch._C._set_grad_enabled, routed, record)
        self.ex.begin(self.hub, threading.get_ident())

        class Body(hp.MediatorCore):
            __slots__ = ("log",)  # fn and error are the core's fields

        self.Body = Body

    def start(self, fn, index=0):
        """Run `fn(body)` on its own greenlet until it first waits; returns the body."""
        hp = self.hp
        body = self.Body()
        body.index = index
        body.finished = False
        body.error = None
        body.log = []
        body.body_grad = torch.is_grad_enabled()

        def run(_payload):
            try:
                fn(body)
                return hp.DONE
            except Exception as error:  # noqa: BLE001 - reported as FAILED, as mediators do
                body.error = error
                return hp.FAILED

        body.worker = greenlet(run)
        self.bodies.append(body)
        message = self.ex.resume(body, None)
        assert message in (hp.PARKED, hp.DONE, hp.FAILED, hp.STOPPED)
        return body

    def close(self):
        for body in self.bodies:
            if body.worker is not None and not body.worker.dead:  # (None: released to a pool)
                body.worker.throw()  # GreenletExit: unwinds it
            body.worker = None
        self.bodies = []

    def wait(self, body, key, occ):
        """Body side: park for (key, occ) and return the event handed over."""
        self.hub.park(key, occ, body)
        body.body_grad = torch.is_grad_enabled()
        payload = body.worker.parent.switch(self.hp.PARKED)
        if isinstance(payload, BaseException):
            raise payload
        return body.event


def test_no_waiter_returns_none_and_counts(hp):
    h = Harness(hp)
    pre, post = h.ex.pre_hook(2), h.ex.post_hook(3)
    assert pre(None, (1,), {}) is None
    assert post(None, (1,), "out") is None
    assert post(None, (1,), "out") is None
    assert hp.Hook(h.ex, 3, False)(None, (1,), "out") is None  # the object itself is a hook too
    assert h.hub.counts[2:4] == [1, 3] and h.hub.record == [2, 3, 3, 3]
    assert h.messages == []


def test_a_waiter_reads_the_value_and_a_replacement_reaches_torch(hp):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with torch.no_grad():
        plain = net(x)
        handle = net[0].register_forward_hook(lambda m, a, out: out * 2)
        reference = net(x)
        handle.remove()
    assert not torch.equal(reference, plain)

    h = Harness(hp)
    seen = {}

    def body(me):
        event = h.wait(me, 1, 0)
        seen["value"] = event.value.clone()
        seen["current"] = h.ex.current is me
        seen["key_occ"] = (event.key, event.occ)
        event.value = event.value * 2
        event.replaced = True

    mediator = h.start(body)
    handle = net[0].register_forward_hook(h.ex.post_hook(1))
    try:
        with torch.no_grad():
            out = net(x)
    finally:
        handle.remove()
    assert torch.equal(out, reference)
    assert torch.equal(seen["value"], net[0](x).detach())
    assert seen["current"] and seen["key_occ"] == (1, 0)
    assert h.ex.current is None and mediator.event is None  # reset after the switch back
    assert h.messages == [(0, hp.DONE)]


def test_a_pre_hook_replacement_is_the_new_args_and_kwargs(hp):
    torch.manual_seed(1)
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(1, 3)
    with torch.no_grad():
        handle = lin.register_forward_pre_hook(lambda m, a, k: ((a[0] + 1,), k), with_kwargs=True)
        reference = lin(x)
        handle.remove()
        assert not torch.equal(reference, lin(x))

    h = Harness(hp)

    def body(me):
        event = h.wait(me, 0, 0)
        (arg,), kwargs = event.value
        event.value = ((arg + 1,), kwargs)
        event.replaced = True

    h.start(body)
    handle = lin.register_forward_pre_hook(h.ex.pre_hook(0), with_kwargs=True)
    try:
        with torch.no_grad():
            out = lin(x)
    finally:
        handle.remove()
    assert torch.equal(out, reference)


def test_waiters_are_served_in_invoke_order_and_edits_compose(hp):
    h = Harness(hp)
    order = []

    def adder(me):
        event = h.wait(me, 3, 0)
        order.append(me.index)
        event.value = event.value + 1
        event.replaced = True

    def multiplier(me):
        event = h.wait(me, 3, 0)
        order.append(me.index)
        event.value = event.value * 3
        event.replaced = True

    def reader(me):
        me.log.append(h.wait(me, 3, 0).value)
        order.append(me.index)

    # parked in the order 2, 1, 0, 1: served 0, 1, 1, 2 (ties keep their parking order)
    last = h.start(reader, index=2)
    h.start(multiplier, index=1)
    h.start(adder, index=0)
    h.start(adder, index=1)
    assert h.ex.post_hook(3)(None, (), 5) == ((5 + 1) * 3) + 1
    assert order == [0, 1, 1, 2] and last.log == [19]
    assert [m for _, m in h.messages] == [hp.DONE] * 4
    assert h.hub.nparked == 0


def test_an_event_nobody_replaces_returns_none(hp):
    h = Harness(hp)
    body = h.start(lambda me: me.log.append(h.wait(me, 5, 0).value))
    assert h.ex.post_hook(5)(None, (), "value") is None
    assert body.log == ["value"]


def test_grad_mode_is_the_bodys_inside_and_the_models_after(hp):
    h = Harness(hp)
    inside = []

    def body(me):
        with torch.no_grad():
            event = h.wait(me, 1, 0)
            inside.append(torch.is_grad_enabled())
            event = h.wait(me, 1, 1)
            inside.append(torch.is_grad_enabled())
        torch.set_grad_enabled(True)  # the body's own change must not leak into the model
        h.wait(me, 1, 2)
        inside.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    with torch.enable_grad():
        h.start(body)
        assert torch.is_grad_enabled()
        hook = h.ex.post_hook(1)
        hook(None, (), 0)
        assert torch.is_grad_enabled()
    with torch.no_grad():
        hook(None, (), 1)
        assert not torch.is_grad_enabled()
        hook(None, (), 2)  # the body ends with grad off after setting it on: no leak either way
        assert not torch.is_grad_enabled()
    assert inside == [False, False, True]


def test_bypass_and_other_threads_are_ignored(hp):
    h = Harness(hp)
    body = h.start(lambda me: me.log.append(h.wait(me, 1, 0).value))
    hook = h.ex.post_hook(1)
    h.ex.bypass += 1
    assert hook(None, (), "inside a body's own call") is None
    h.ex.bypass -= 1
    results = []
    thread = threading.Thread(target=lambda: results.append(hook(None, (), "other thread")))
    thread.start()
    thread.join()
    assert results == [None] and h.hub.counts[1] == 0 and body.log == []
    hook(None, (), "model")
    assert body.log == ["model"] and h.hub.counts[1] == 1


def test_routed_keys_go_to_the_policy(hp):
    calls = []

    def routed(key, occ, value):
        calls.append((key, occ, value))
        return "from policy"

    h = Harness(hp, routed=routed)
    h.ex.route(6)
    body = h.start(lambda me: me.log.append(h.wait(me, 6, 0).value))
    assert h.ex.post_hook(6)(None, ("a",), "out") == "from policy"
    assert h.ex.pre_hook(7)(None, ("a",), {"k": 1}) is None  # not routed
    h.ex.route(4)
    assert h.ex.pre_hook(4)(None, ("a",), {"k": 1}) == "from policy"
    assert calls == [(6, 0, "out"), (4, 0, (("a",), {"k": 1}))]
    assert body.log == [] and h.hub.nparked == 1  # the policy owns the event: it did not serve
    h.ex.route(6, False)
    h.ex.route(50, False)  # unrouting a key never routed is a no-op
    assert h.ex.post_hook(6)(None, (), "later") is None
    assert h.hub.counts[6] == 2 and h.hub.nparked == 1  # occurrence 1: the body waits for 0


def test_a_routed_policy_can_serve_through_the_exchange(hp):
    observed = []
    h = None

    def routed(key, occ, value):  # what an observer does: serve, then look at the result
        event = h.ex.deliver(key, occ, value)
        if event is None:
            observed.append(value)
            return None
        observed.append(event.value)
        return event.value if event.replaced else None

    h = Harness(hp, routed=routed)
    h.ex.route(3)

    def body(me):
        event = h.wait(me, 3, 0)
        event.value = event.value * 10
        event.replaced = True

    h.start(body)
    assert h.ex.post_hook(3)(None, (), 2) == 20
    assert h.ex.post_hook(3)(None, (), 4) is None
    assert observed == [20, 4]


def test_an_error_raised_by_a_body_reaches_the_policy(hp):
    class Abort(BaseException):
        pass

    def message(mediator, msg, event):
        if msg == hp.FAILED:
            raise Abort(mediator.error, event.value)

    h = Harness(hp, message=message)

    def body(me):
        h.wait(me, 1, 0)
        raise ValueError("bad edit")

    later = h.start(lambda me: me.log.append(h.wait(me, 1, 0)), index=1)
    failing = h.start(body)
    lin = torch.nn.Linear(2, 2)
    handle = lin.register_forward_hook(h.ex.post_hook(1))
    try:
        with pytest.raises(Abort) as info:
            lin(torch.ones(1, 2))
    finally:
        handle.remove()
    assert isinstance(info.value.args[0], ValueError) and str(failing.error) == "bad edit"
    assert info.value.args[1].shape == (1, 2)  # the policy sees the event the body failed at
    assert h.messages == [(0, hp.FAILED)]
    assert later.log == [] and h.ex.current is None  # the run unwinds: nobody else is served


def test_stopped_and_other_messages_reach_the_policy(hp):
    h = Harness(hp)

    def body(me):
        h.wait(me, 1, 0)
        me.worker.parent.switch(hp.STOPPED)

    h.start(body)
    h.ex.post_hook(1)(None, (), 0)
    assert h.messages == [(0, hp.STOPPED)]


def test_paused_runs_after_each_body_served(hp):
    h = Harness(hp)
    calls = []
    h.ex.paused = lambda mediator, event: calls.append((mediator.index, event.value, h.ex.current))
    first = h.start(lambda me: me.log.append(h.wait(me, 2, 0).value), index=0)
    h.start(lambda me: (h.wait(me, 2, 0), h.wait(me, 2, 1)), index=1)
    assert h.ex.pre_hook(2)(None, ("x",), {}) is None
    assert calls == [(0, (("x",), {}), None), (1, (("x",), {}), None)]
    assert first.log == [(("x",), {})] and h.messages == [(0, hp.DONE)]  # message before paused


def test_handoff_and_deliver_return_the_event_as_bodies_left_it(hp):
    h = Harness(hp)
    assert h.ex.handoff(7, "plain") is None and h.hub.counts[7] == 1

    def body(me):
        event = h.wait(me, 7, 1)
        event.value = event.value.upper()
        event.replaced = True
        event = h.wait(me, 6, 0)
        me.log.append(event.value)

    body = h.start(body)
    event = h.ex.handoff(7, "edited")
    assert (event.key, event.occ, event.value, event.replaced) == (7, 1, "EDITED", True)
    assert h.ex.deliver(6, 1, "not this one") is None and h.hub.nparked == 1
    event = h.ex.deliver(6, 0, "read")
    assert event.replaced is False and body.log == ["read"]
    assert h.hub.counts[6] == 0  # deliver does not count: the caller did


def test_grow_makes_room_for_added_keys(hp):
    h = Harness(hp, nkeys=4)
    h.ex.grow(6)
    assert h.hub.counts == [0] * 6 and h.hub.exact[4:] == [True, True]
    assert h.ex.handoff(5, "x") is None and h.hub.counts[5] == 1
    h.ex.grow(3)  # never shrinks
    assert len(h.hub.counts) == 6


def test_end_makes_installed_hooks_inert(hp):
    h = Harness(hp)
    h.start(lambda me: me.log.append(h.wait(me, 1, 0)))
    hook = h.ex.post_hook(1)
    h.ex.end()
    assert h.ex.hub is None and h.ex.current is None
    assert hook(None, (), 0) is None and h.hub.counts[1] == 0
    for call in (lambda: h.ex.handoff(1, 0), lambda: h.ex.deliver(1, 0, 0), lambda: h.ex.grow(9)):
        with pytest.raises(RuntimeError, match="outside a run"):
            call()
    hub = hp.Hub(4, 0, None, None, True)
    h.ex.begin(hub, threading.get_ident())  # one exchange serves the next run
    assert h.ex.bypass == 0
    hook(None, (), 0)
    assert hub.counts[1] == 1


def test_bad_arguments_are_type_errors(hp):
    h = Harness(hp)
    with pytest.raises(TypeError):
        h.ex.begin(None, 0)
    with pytest.raises(TypeError):
        h.ex.resume(None, None)
    with pytest.raises(TypeError):
        h.ex.resume(object(), None)


def test_a_run_can_subclass_the_exchange(hp):
    class Run(hp.Exchange):
        def __init__(self):
            super().__init__(torch.is_grad_enabled, torch._C._set_grad_enabled)
            self.served = []

        def serve(self, event, waiters):  # not called by the hooks: they are non-virtual
            raise AssertionError("hooks called a subclass's serve")

        def resume(self, mediator, event, payload=None):
            raise AssertionError("hooks called a subclass's resume")

    run = Run()
    h = Harness(hp)
    run.begin(h.hub, threading.get_ident())
    body = h.start(lambda me: me.log.append((h.wait(me, 1, 0).value, run.current is me)))
    hook = run.post_hook(1)
    run.bypass += 1  # the subclass's own attribute is the field the hook reads
    assert hook(None, (), "ignored") is None and h.hub.counts[1] == 0
    run.bypass -= 1
    assert hook(None, (), "seen") is None
    assert body.log == [("seen", True)] and run.current is None


def test_the_harness_leaves_no_body_suspended(hp):
    """(test_pool.py counts suspended greenlets: the bodies parked here must not outlive it.)"""
    h = Harness(hp)
    body = h.start(lambda me: h.wait(me, 1, 0))
    worker = body.worker
    assert worker and not worker.dead
    h.close()
    assert worker.dead


def test_the_engines_mediator_does_not_hide_the_fields_the_exchange_reads():
    """A slot named like a MediatorCore field would hide it: C would read the field while
    Python wrote the slot (the mediator would never see its events)."""
    from interlace._native import hotpath
    from interlace.intervention.mediator import Mediator

    assert issubclass(Mediator, hotpath.MediatorCore)
    core = {"index", "rows", "pointer", "worker", "event", "body_grad", "finished"}
    assert core.isdisjoint(Mediator.__slots__)
    mediator = Mediator(lambda: None, index=3)
    # the base's own descriptor sees what the subclass's __init__ wrote
    assert hotpath.MediatorCore.index.__get__(mediator, Mediator) == 3


def test_wait_for_parks_switches_and_raises_what_the_model_side_throws(hp):
    """`Exchange.wait_for`: a request's whole wait in one call (the engine's `request`): the
    body is parked for (key, occ), the model side gets PARKED, the body's grad mode is kept
    for its resumption, and a payload other than None goes through `mediator.received`."""
    h = Harness(hp)
    received = []

    def receive(self, payload):  # as the engine's Mediator.received: raise what it is
        received.append(payload)
        raise payload

    h.Body.received = receive
    seen = []

    def body(me):
        with torch.no_grad():
            assert h.ex.wait_for(me, 1, 0) is None
            seen.append((me.event.key, me.event.occ, me.event.value, torch.is_grad_enabled()))
        try:
            h.ex.wait_for(me, 2, 0)
        except KeyError as error:
            seen.append(error.args)

    with torch.enable_grad():
        mediator = h.start(body)
        assert h.hub.nparked == 1 and mediator.body_grad is False and mediator.event is None
        h.ex.post_hook(1)(None, (), "value")
        assert torch.is_grad_enabled()  # the model's grad mode again after the body ran
        assert seen == [(1, 0, "value", False)]
        assert h.hub.nparked == 1 and mediator.body_grad is True
        assert h.ex.resume(mediator, None, KeyError("stop")) == hp.DONE
    assert seen[1] == ("stop",) and [type(p) for p in received] == [KeyError]
    with pytest.raises(RuntimeError, match="outside a run"):
        hp.Exchange(torch.is_grad_enabled, torch._C._set_grad_enabled).wait_for(mediator, 1, 0)


class _Policy:
    """The run object's policy methods that `Exchange.request`/`read` call back, recording."""

    def __init__(self, calls, mediator=None):
        self.calls = calls
        self.body = mediator

    def mediator(self, key):
        self.calls.append(("mediator", key))
        if self.body is None:
            raise LookupError(f"no body reads {key} here")
        return self.body

    def refuse(self, key, occ, passed, event):
        self.calls.append(("refuse", key, occ, passed))
        raise LookupError(f"{key} occurrence {occ} passed ({passed} so far)")

    def install_by_policy(self, key):
        self.calls.append(("install", key))

    def narrowed(self, event, mediator, key):
        self.calls.append(("narrowed", key, mediator.rows))
        return event.value[mediator.rows]


def _policy_exchange(hp, calls):
    class Run(hp.Exchange):
        pass

    for name in ("mediator", "refuse", "install_by_policy", "narrowed"):
        setattr(Run, name, getattr(_Policy, name))
    run = Run(torch.is_grad_enabled, torch._C._set_grad_enabled, getcurrent=greenlet.getcurrent)
    run.calls = calls
    run.body = None
    return run


def test_request_and_read_serve_the_common_case_and_call_the_policy_for_the_rest(hp):
    """A body's read parks until the hook serves it (no tapper: the policy installs), its
    rows go through `narrowed`; a read from outside a body and a request the run must
    refuse call the policy, which raises."""
    calls = []
    run = _policy_exchange(hp, calls)
    hub = hp.Hub(4, 0, None, None, True)
    run.begin(hub, threading.get_ident())
    seen = []

    class Body(hp.MediatorCore):
        __slots__ = ()

    def job(me):
        seen.append(run.read(3))  # served below by the hook
        run.current = me
        seen.append(run.request(3, me).value)  # the same occurrence: no wait, no install
        return hp.DONE

    me = Body(None, 0, slice(1, 2))
    me.worker = greenlet(lambda _: job(me))
    run.current = me
    assert run.resume(me, None) == hp.PARKED
    assert calls == [("install", 3)]
    value = torch.arange(4.0)
    assert run.hook_event(3, False, (), value) is None
    assert torch.equal(seen[0], value[1:2]) and seen[1] is value
    assert calls == [("install", 3), ("narrowed", 3, slice(1, 2))]

    with pytest.raises(LookupError, match="no body reads 2"):
        run.read(2)  # not inside a body: the policy says why
    assert calls[-1] == ("mediator", 2)
    run.done = True
    with pytest.raises(LookupError, match="occurrence 0 passed"):
        run.request(2, Body())
    assert calls[-1] == ("refuse", 2, 0, 0)


def test_a_body_that_ends_goes_back_to_the_pool_without_a_message(hp):
    """With `begin(..., pool=)` a served body that returns is finished and its worker is
    appended to the pool by the exchange itself; without a pool `message` hears DONE."""
    for pool in ([], None):
        h = Harness(hp)
        h.ex.begin(h.hub, threading.get_ident(), False, pool)
        body = h.start(lambda me: h.wait(me, 1, 0))
        worker = body.worker
        worker.single_use = False
        h.ex.post_hook(1)(None, (), "out")
        if pool is None:
            assert h.messages == [(0, hp.DONE)] and not body.finished
        else:
            assert h.messages == [] and body.finished and body.worker is None
            assert pool == [worker] or (worker.dead and pool == [])


def test_a_generator_bodys_reads_park_by_yielding_and_return_its_rows(hp):
    """`reader(key)` in a generator body resumed through a `GenCore` worker: each read
    parks by yielding (the policy installs), returns its rows through `narrowed` (a tuple
    stays a tuple), an error the model side sends is raised at the read and reaches the
    worker's `failed`; outside a generator body, `reader` is the run's `generator_read`."""
    calls = []
    run = _policy_exchange(hp, calls)
    run.generator_read = lambda key: calls.append(("generator_read", key)) or iter(())
    hub = hp.Hub(4, 0, None, None, True)
    run.begin(hub, threading.get_ident())
    ends = []

    class Body(hp.MediatorCore):
        __slots__ = ()

        def received(self, payload):
            raise payload

    class Worker(hp.GenCore):
        def returned(self, value):
            ends.append(("returned", value))
            return hp.DONE

        def failed(self, error):
            ends.append(("failed", error))
            return hp.FAILED

    def start(gen):
        me = Body(None, 0, slice(1, 2))
        worker = me.worker = Worker()
        worker.gen, worker.context, worker.home = gen, contextvars.copy_context(), greenlet.getcurrent()
        run.current = None
        assert run.resume(me, None) == hp.PARKED
        return me

    def body():
        first = yield from run.reader(3)
        second = yield from run.reader(1)
        return first, second

    start(body())
    assert calls == [("install", 3)]
    value, pair = torch.arange(4.0), (10, 11, 12, 13)
    assert run.hook_event(3, False, (), value) is None  # the body reads it, then waits for 1
    assert calls[1:] == [("narrowed", 3, slice(1, 2)), ("install", 1)]
    assert run.hook_event(1, False, (), pair) is None
    (how, (first, second)), = ends
    assert how == "returned" and torch.equal(first, value[1:2]) and second == (11,)

    def waits():
        yield from run.reader(2)

    me = start(waits())
    assert run.resume(me, None, KeyError("sent by the model side")) == hp.FAILED
    assert ends[-1][0] == "failed" and isinstance(ends[-1][1], KeyError)

    run.current = None
    assert list(run.reader(0)) == [] and calls[-1] == ("generator_read", 0)

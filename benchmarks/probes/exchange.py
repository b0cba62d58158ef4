"""Per-event cost of the model side of interleaving: one hook call, in ns.

    python benchmarks/probes/exchange.py [--events 20000] [--repeats 5]

Hooks are called directly (no module around them), so the figure is the hook's own cost:
  plain        a Python function hook that returns None / reads the value (the floor)
  0.1 closure  the 0.1 engine's sequence, frozen here: a Python closure, Hub.fire/take, an
               Event, _serve, _resume, Mediator.resume/_enter (grad-mode swap, switch)
  exchange     hotpath.Exchange.post_hook(key): the same sequence in one compiled call
each on the compiled hot path and on its pure-Python twin. Cases: "no waiter" (nobody asked
for this location) and "one waiter" (a body on a greenlet reads the value, parks for the
next occurrence; two greenlet switches per event). Minimum over repeats, ns per event.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import threading
import time

import torch
from greenlet import getcurrent, greenlet

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
PARKED, DONE, FAILED = 1, 2, 3


# -- the 0.1 engine's per-event sequence (interleaver.py / mediator.py at 2eafd86) -------------

class _OldEvent:
    __slots__ = ("key", "occ", "value", "replaced")

    def __init__(self, key, occ, value):
        self.key = key
        self.occ = occ
        self.value = value
        self.replaced = False


class _OldMediator:
    __slots__ = ("index", "worker", "event", "body_grad")

    def __init__(self):
        self.index = 0
        self.worker = None
        self.event = None
        self.body_grad = None

    def resume(self, payload=None):
        return self._enter(payload)

    def _enter(self, payload):
        model_grad = _is_grad_enabled()
        if self.body_grad != model_grad:
            _set_grad_enabled(self.body_grad)
        try:
            message = self.worker.switch(payload)
        finally:
            if _is_grad_enabled() != model_grad:
                _set_grad_enabled(model_grad)
        if message == DONE or message == FAILED:
            pass  # release: not reached here
        return message


class _OldRun:
    def __init__(self, hub):
        self.hub = hub
        self.bypass = 0
        self.thread = threading.get_ident()
        self.current = None
        self.shared = None
        self.held = {}
        self.released = []
        self.skips = {}
        self.observers = {}
        self.total = None

    def _post(self, key):
        hub = self.hub
        thread = self.thread
        get_ident = threading.get_ident
        index = key >> 1
        skips = self.skips
        observers = self.observers

        def post_hook(module, args, output):
            if self.bypass or get_ident() != thread:
                return None
            occ = hub.fire(key)
            replaced = False
            if skips:
                pending = skips.pop(index, None)
                if pending is not None:
                    replaced = True
            waiters = hub.take(key, occ)
            if waiters is None:
                if observers:
                    pass
                return output if replaced else None
            event = _OldEvent(key, occ, output)
            self._serve(event, waiters)
            if observers:
                pass
            if event.replaced or replaced:
                return event.value
            return None

        return post_hook

    def _serve(self, event, waiters):
        if len(waiters) > 1:
            waiters.sort(key=lambda m: m.index)
        for mediator in waiters:
            self._resume(mediator, event)
            if self.shared is not None or self.held or self.released:
                pass

    def _resume(self, mediator, event, payload=None):
        self.current = mediator
        mediator.event = event
        try:
            message = mediator.resume(payload)
        finally:
            mediator.event = None
            self.current = None
        if message != PARKED and message != DONE:
            raise RuntimeError(message)


# -- the measurement --------------------------------------------------------------------------

def _body(mediator, hub, key):
    """A body that reads every occurrence of `key`: park, wait, read, repeat."""
    def run(_payload=None):
        occ = 0
        while True:
            hub.park(key, occ, mediator)
            mediator.body_grad = _is_grad_enabled()
            mediator.worker.parent.switch(PARKED)
            mediator.event.value  # noqa: B018 - the read
            occ += 1
    return greenlet(run)


def _per_event(hook, events, repeats, value):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(events):
            hook(None, (), value)
        best = min(best, (time.perf_counter_ns() - start) / events)
    return best


def measure(hp, events, repeats):
    key = 3
    value = torch.zeros(1)
    out = {}

    def plain(module, args, output):
        return None

    seen = []

    def plain_read(module, args, output):
        seen.append(output)
        seen.pop()
        return None

    out["plain, no waiter"] = _per_event(plain, events, repeats, value)
    out["plain, reads"] = _per_event(plain_read, events, repeats, value)

    # 0.1 closure
    hub = hp.Hub(8, 0, None, None, True)
    hub.record = None
    run = _OldRun(hub)
    out["0.1 closure, no waiter"] = _per_event(run._post(key), events, repeats, value)
    hub = run.hub = hp.Hub(8, 0, None, None, True)
    hub.record = None
    mediator = _OldMediator()
    mediator.worker = _body(mediator, hub, key)
    mediator.body_grad = _is_grad_enabled()
    mediator.worker.parent = getcurrent()
    mediator.resume()
    out["0.1 closure, one waiter"] = _per_event(run._post(key), events, repeats, value)

    # exchange
    class Mediator(hp.MediatorCore):
        __slots__ = ()

    exchange = hp.Exchange(_is_grad_enabled, _set_grad_enabled)
    hub = hp.Hub(8, 0, None, None, True)
    hub.record = None
    exchange.begin(hub, threading.get_ident())
    out["exchange, no waiter"] = _per_event(exchange.post_hook(key), events, repeats, value)
    hub = hp.Hub(8, 0, None, None, True)
    hub.record = None
    exchange.begin(hub, threading.get_ident())
    mediator = Mediator()
    mediator.worker = _body(mediator, hub, key)
    mediator.body_grad = _is_grad_enabled()
    exchange.resume(mediator, None)
    out["exchange, one waiter"] = _per_event(exchange.post_hook(key), events, repeats, value)
    exchange.end()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    impls = [("twin", "interlace._pyhotpath")]
    try:
        importlib.import_module("interlace._chotpath")
        impls.insert(0, ("compiled", "interlace._chotpath"))
    except ImportError:
        print("compiled hot path not built: twin only")
    results = {name: measure(importlib.import_module(module), args.events, args.repeats)
               for name, module in impls}
    cases = list(next(iter(results.values())))
    print(f"| ns per hook call (min of {args.repeats} x {args.events}) | "
          + " | ".join(name for name, _ in impls) + " |")
    print("|---|" + "---|" * len(impls))
    for case in cases:
        print(f"| {case} | " + " | ".join(f"{results[name][case]:.0f}" for name, _ in impls) + " |")


if __name__ == "__main__":
    main()

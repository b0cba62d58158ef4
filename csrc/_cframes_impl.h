/* interlace frame mechanism: the C half of interlace._cframes (see _cframes_impl.c). */
#ifndef INTERLACE_CFRAMES_IMPL_H
#define INTERLACE_CFRAMES_IMPL_H
#include <Python.h>

#define ILC_JUMP 0
#define ILC_RAISE_LINE 1
#define ILC_RAISE_INSTRUCTION 2
/* A flag of arm's mode: the body start shares a line (3.10/3.11 then use opcode events). */
#define ILC_OPCODE_EVENTS 4

/* skip_signal: borrowed, kept alive by the module. Returns 0, or -1 with an error set. */
int ilc_init(PyObject *skip_signal);
/* frame: borrowed. mode: ILC_JUMP or a raise mode, | ILC_OPCODE_EVENTS when the body start
   shares the with's line. Pushes a handle on this thread's armed stack. Returns a NEW reference to
   the armed handle, or NULL with an error set. */
PyObject *ilc_arm(PyObject *frame, int lo, int hi, int exit_unit, int mode);
/* handle: borrowed. Takes it off the armed stack (idempotent). Returns 1 if the skip fired,
   0 if not, -1 with an error set. */
int ilc_disarm(PyObject *handle);
/* 3.12+ monitoring event in the current frame. Returns 1 jumped, 0 no armed frame here,
   -1 error set (the skip signal in raise mode). */
int ilc_fire(void);
/* code: borrowed. Turns the read at `unit` into LOAD_FAST_CHECK (3.12+), splitting a
   quickened pair that starts at `prev_unit` (-1: none). Returns 1 patched, 0 nothing to do,
   -1 with an error set. */
int ilc_patch_check(PyObject *code, int unit, int prev_unit);
/* code: borrowed. 3.12: turns a quickened superinstruction at `unit` back into its first
   base instruction, so the next unit gets its own events. Returns 1/0, -1 with error. */
int ilc_split_super(PyObject *code, int unit);
/* code: borrowed. 3.13: turns the fused read at `unit` into JUMP_FORWARD `delta` (to the
   same instruction in the handler's checked copy of the tail). Returns 1, -1 with error. */
int ilc_redirect(PyObject *code, int unit, int delta);
/* code: borrowed. 3.13: if the current frame runs `code`, raise UnboundLocalError (as the
   interpreter would) when a local that the fused read at `unit` (LOAD_FAST_LOAD_FAST,
   STORE_FAST_LOAD_FAST) reads is unbound. Returns 0 (bound, or nothing to check), -1 with
   the error set. A no-op before 3.13. */
int ilc_guard(PyObject *code, int unit);
/* Armed handles on any thread's armed stack (for leak tests). */
Py_ssize_t ilc_armed_count(void);
/* Tracer entries the C warm path served since import. */
Py_ssize_t ilc_warm_entries(void);

/* All borrowed; the record keeps new references to kind, block and plan (None: the body
   runs inline, the arm arguments are then unused). Records the site of the with at byte
   offset `lasti` of `code` for tracers of type `kind`, replacing an earlier record.
   Returns 0, -1 with an error set. */
int ilc_register_site(PyObject *code, int lasti, PyObject *kind, PyObject *block, PyObject *plan,
                      int lo, int hi, int exit_unit, int mode);
/* code: borrowed. Marks `code` as a tracer's own __enter__: its frames are walked past when
   looking for the user's frame. Returns 0, -1 with an error set. */
int ilc_look_past(PyObject *code);
/* code, kind: borrowed. Returns a NEW reference to (block, plan, (lo, hi, exit, mode)) or
   (block, None, None) for a registered site, None if none, NULL with an error set. */
PyObject *ilc_site(PyObject *code, int lasti, PyObject *kind);
/* frame: borrowed. Returns a NEW reference to the first frame from `frame` outwards whose
   code is not marked by ilc_look_past (None if none), NULL with an error set. */
PyObject *ilc_user_frame(PyObject *frame);
/* Returns a NEW reference to the TracerBase type (made once), NULL with an error set. */
PyObject *ilc_tracer_base(void);
/* type (a TracerBase subclass), enter, exit_, clean, current (the trace-state ContextVar),
   default_backend (what TracerBase.__init__ stores for backend=None): borrowed, kept as
   strong references by the module. Returns a NEW reference to a tuple
   (__enter__, __exit__, __aenter__, __aexit__) of C method descriptors for `type`: the warm
   path of Tracer.__enter__/__exit__, calling `enter(self, frame)` / `exit(self, t, v, tb[,
   fired])` for everything else, and `clean(error, signal)` on every error that leaves them
   (it drops interlace's frames from the traceback); __aenter__ and __aexit__ call
   __enter__/__exit__ and return a done awaitable. NULL with an error set. */
PyObject *ilc_tracer_methods(PyObject *type, PyObject *enter, PyObject *exit_, PyObject *clean,
                             PyObject *current, PyObject *default_backend);
/* frame: borrowed; names: borrowed, a tuple of str. Returns a NEW dict of those names bound
   in the frame now, in `names` order: a function frame's variables (a cell's contents; read
   in place on 3.10-3.12, emptying an f_locals snapshot an earlier read left), else what its
   f_locals maps them to (a module's globals, a class namespace, 3.13's proxy). NULL with an
   error set. */
PyObject *ilc_bind(PyObject *frame, PyObject *names);
/* frame, values (a mapping name -> value): borrowed. Writes each value into the frame's
   variable of that name: a function frame's in place on 3.10-3.12 (a cell's contents for a
   cell variable; names that are not variables of the frame are skipped; an f_locals snapshot
   left is emptied), through 3.13's proxy, or `f_locals.update(values)` for a module or a
   class body. Returns 0, -1 with an error set. */
int ilc_write_back(PyObject *frame, PyObject *values);
/* function, namespace (a mapping), params (a tuple of names): borrowed. Returns a NEW
   reference to function(*[namespace[name] for name in params]) without building the
   argument tuple; NULL with an error set (KeyError for a name namespace lacks). */
PyObject *ilc_call_bound(PyObject *function, PyObject *namespace, PyObject *params);
/* values (a mapping), names (an iterable of names), saved (a dict id -> object, or None):
   borrowed. Returns a NEW dict {name: values[name]} for each of `names` in `values` (in
   `names`' iteration order) whose value is in `saved` by identity (every one if saved is
   None); NULL with an error set. */
PyObject *ilc_pick(PyObject *values, PyObject *names, PyObject *saved);
/* The per-trace steps in C (see the last section of _cframes_impl.c). Each returns a NEW
   reference, NULL with an error set; arguments are borrowed (kept as strong references by
   the module where said). */
/* The TraceState type (made once). */
PyObject *ilc_trace_state_type(void);
/* Keeps the trace-state ContextVar, the running-bodies list, the mount's state class (its
   `importing` count), the descriptor `object.save` is when ours is on, and the Python
   on_enter() (mount) / on_exit() (an import runs: resync). Returns (enter_body, exit_body). */
PyObject *ilc_save_hooks(PyObject *current, PyObject *running, PyObject *mount, PyObject *descriptor,
                         PyObject *on_enter, PyObject *on_exit);
/* The DeferredBase type (made once). */
PyObject *ilc_deferred_base(void);
/* Keeps the classes and the Python policies; returns (Tracer.defer, Tracer.push_result,
   DeferredBody.run) as C method descriptors that call the policy for all but the warm case. */
PyObject *ilc_generator_method(PyObject *deferred_cls, PyObject *generator);
PyObject *ilc_deferred_methods(PyObject *tracer_cls, PyObject *deferred_cls, PyObject *defer,
                               PyObject *push, PyObject *run, PyObject *locals_param);
/* A C descriptor for `object.save`: instances get a C bound method that marks in the current
   trace's state (outside a trace it calls `save(value)`); classes, modules get `descriptor`'s
   __get__. */
PyObject *ilc_object_save(PyObject *descriptor, PyObject *save);
/* `interlace.save` as a builtin function: `save(value)` marks in the current trace's state
   (one C call); outside a trace, and any other call, it is the Python function `save`'s. */
PyObject *ilc_function_save(PyObject *save);
#endif

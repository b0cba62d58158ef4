/* interlace frame mechanism, CPython 3.10-3.13 (reads interpreter internals: no stable ABI).
 *
 * Mechanism only; every decision is made in Python (interlace/tracing/skip.py, tracer.py).
 *
 *  - ilc_arm/ilc_disarm: an armed handle records (frame, body units lo..hi, exit unit, mode)
 *    and sits on its thread's armed stack until disarmed. 3.10/3.11: the handle is also the
 *    `obj` of a one-shot C trace function installed with PyEval_SetTrace, chained to the
 *    thread's previous C trace function, which it forwards every event it does not consume
 *    to. 3.12+: the sys.monitoring callbacks (ilc_fire) look for the current frame's handle
 *    on the thread's stack.
 *  - Writing the instruction pointer only takes effect where the eval loop reloads it: after
 *    a line-trace call (3.10 f_lasti, 3.11 prev_instr) and after a sys.monitoring LINE
 *    callback (3.12 prev_instr, 3.13 instr_ptr).
 *  - Warm sites (ilc_register_site): what the Python policy decided for a `with` site, kept
 *    by C on the code object itself (co_extra), so the Tracer's C __enter__ finds it
 *    without reading a Python attribute and it goes when the code object goes.
 *  - TracerBase: the Tracer's per-run fields as C fields, read and written by the warm path
 *    by offset and exposed to Python under the same names.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include "frameobject.h"
#if PY_VERSION_HEX >= 0x030B0000
#  ifndef Py_BUILD_CORE
#    define Py_BUILD_CORE 1
#  endif
#  undef _PyGC_FINALIZED
#  include "internal/pycore_frame.h"
#endif
#if PY_VERSION_HEX >= 0x030D0000
#  include "opcode_ids.h"
#elif PY_VERSION_HEX >= 0x030C0000
#  include "opcode.h"
#endif
#include "_cframes_impl.h"

#define CHECK(cond, msg) do { if (!(cond)) { PyErr_Format(PyExc_SystemError, \
    "interlace._cframes %s:%d: %s", __FILE__, __LINE__, msg); return -1; } } while (0)

#if PY_VERSION_HEX >= 0x030C0000
#  define ILC_GET_EXTRA PyUnstable_Code_GetExtra
#  define ILC_SET_EXTRA PyUnstable_Code_SetExtra
#  define ILC_REQUEST_EXTRA PyUnstable_Eval_RequestCodeExtraIndex
#else
#  define ILC_GET_EXTRA _PyCode_GetExtra
#  define ILC_SET_EXTRA _PyCode_SetExtra
#  define ILC_REQUEST_EXTRA _PyEval_RequestCodeExtraIndex
#endif

static PyObject *SkipSignal = NULL;   /* strong, set once by ilc_init */

/* ------------------------------------------------------------- armed handles ---- */

typedef struct Armed {
    PyObject_HEAD
    PyObject *frame;          /* strong: keeps f_frame pointing at the live frame */
    int lo, hi, exit_unit, mode;
    int by_opcode;            /* 3.10/3.11: the body start shares a line: per-opcode events */
    int fired, live;
    int stacked;              /* on its thread's armed stack (which holds a reference) */
    int disarmed;             /* disarm() ran (maybe on another thread: see pop_armed) */
    unsigned long thread;     /* the arming thread (PyThread_get_thread_ident) */
    struct Armed *below, *above;  /* neighbours on that stack (the stack owns them) */
    Py_tracefunc prev_func;   /* 3.10/3.11: the tracer we chain to */
    PyObject *prev_obj;       /* strong */
    int saved_opcodes;        /* the frame's f_trace_opcodes before arming */
    int installed;            /* we are (or were) the thread's C trace function */
} Armed;

/* A few freed records kept for the next arm (a warm site arms and frees one per trace). */
#define ARMED_FREE_MAX 8
static Armed *armed_free[ARMED_FREE_MAX];
static int n_armed_free = 0;

static void armed_dealloc(Armed *self) {
    Py_CLEAR(self->frame);
    Py_CLEAR(self->prev_obj);
    if (n_armed_free < ARMED_FREE_MAX) armed_free[n_armed_free++] = self;
    else PyObject_Free(self);
}

static PyTypeObject ArmedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "interlace._cframes.Armed",
    .tp_basicsize = sizeof(Armed),
    .tp_dealloc = (destructor)armed_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An armed skip (opaque handle).",
};

/* The per-thread armed stack: a doubly linked list of Armed records whose top is this
 * thread's thread-specific value. Each record is pushed by arm and taken off by disarm on
 * the same thread (a with statement enters and exits on one thread); a record disarmed from
 * another thread stays until its own thread next arms, fires or disarms (prune_dead). */
static Py_tss_t armed_top = Py_tss_NEEDS_INIT;
static Py_ssize_t n_stacked = 0;      /* records on any thread's stack */
static Py_ssize_t n_warm = 0;         /* Tracer entries the warm path served */

/* a: borrowed. Pushes it on this thread's stack (the stack takes a new reference).
   Returns 0, -1 with an error set. */
static int push_armed(Armed *a) {
    Armed *top = (Armed *)PyThread_tss_get(&armed_top);
    if (PyThread_tss_set(&armed_top, a) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "interlace: cannot record an armed skip for this thread");
        return -1;
    }
    a->below = top;
    a->above = NULL;
    if (top != NULL) top->above = a;
    a->stacked = 1;
    a->thread = PyThread_get_thread_ident();
    Py_INCREF(a);
    n_stacked++;
    return 0;
}

/* a: borrowed (the caller holds a reference). Takes it off this thread's stack and drops
   the stack's reference; a record of another thread's stack is left to that thread. */
static void pop_armed(Armed *a) {
    if (!a->stacked || a->thread != PyThread_get_thread_ident()) return;
    if (a->above != NULL) a->above->below = a->below;
    else PyThread_tss_set(&armed_top, a->below);
    if (a->below != NULL) a->below->above = a->above;
    a->below = a->above = NULL;
    a->stacked = 0;
    n_stacked--;
    Py_DECREF(a);
}

/* Drop records disarmed from another thread off the top of this thread's stack. */
static void prune_dead(void) {
    Armed *top;
    while ((top = (Armed *)PyThread_tss_get(&armed_top)) != NULL && top->disarmed) {
        Py_INCREF(top);
        pop_armed(top);
        Py_DECREF(top);
    }
}

int ilc_init(PyObject *skip_signal) {
    if (PyType_Ready(&ArmedType) < 0) return -1;
    if (!PyThread_tss_is_created(&armed_top) && PyThread_tss_create(&armed_top) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "interlace: cannot create the armed-stack key");
        return -1;
    }
    Py_XINCREF(skip_signal);
    Py_XSETREF(SkipSignal, skip_signal);
    return 0;
}

static inline int frame_unit(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030D0000
    _PyInterpreterFrame *iframe = f->f_frame;
    return (int)(iframe->instr_ptr - _PyCode_CODE(_PyFrame_GetCode(iframe)));
#elif PY_VERSION_HEX >= 0x030B0000
    _PyInterpreterFrame *iframe = f->f_frame;
    return (int)(iframe->prev_instr - _PyCode_CODE(iframe->f_code));
#else
    return f->f_lasti;
#endif
}

/* Write the instruction pointer so the eval loop resumes AT `unit` after this callback. */
static inline void frame_jump(PyFrameObject *f, int unit) {
#if PY_VERSION_HEX >= 0x030D0000
    _PyInterpreterFrame *iframe = f->f_frame;
    iframe->instr_ptr = _PyCode_CODE(_PyFrame_GetCode(iframe)) + unit;
#elif PY_VERSION_HEX >= 0x030B0000
    _PyInterpreterFrame *iframe = f->f_frame;
    iframe->prev_instr = _PyCode_CODE(iframe->f_code) + unit;
#else
    f->f_lasti = unit;
#endif
}

/* The code object a frame runs. f: borrowed. Returns a borrowed reference. */
static inline PyObject *frame_code(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030D0000
    return (PyObject *)_PyFrame_GetCode(f->f_frame);
#elif PY_VERSION_HEX >= 0x030B0000
    return (PyObject *)f->f_frame->f_code;
#else
    return (PyObject *)f->f_code;
#endif
}

/* frame.f_lasti (bytes) of a frame. f: borrowed. */
static inline int frame_lasti_bytes(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else
    return f->f_lasti < 0 ? -1 : f->f_lasti * (int)sizeof(_Py_CODEUNIT);
#endif
}

/* A new Armed record for `frame` (borrowed; the record keeps a new reference), nothing
   installed yet. Returns a new reference, or NULL with an exception set. */
static Armed *new_armed(PyObject *frame, int lo, int hi, int exit_unit, int mode) {
    if (!PyFrame_Check(frame)) { PyErr_SetString(PyExc_TypeError, "arm() needs a frame"); return NULL; }
    Armed *a;
    if (n_armed_free > 0) {
        a = armed_free[--n_armed_free];
        (void)PyObject_Init((PyObject *)a, &ArmedType);
    } else if ((a = PyObject_New(Armed, &ArmedType)) == NULL) {
        return NULL;
    }
    Py_INCREF(frame);
    a->frame = frame;
    a->lo = lo; a->hi = hi; a->exit_unit = exit_unit;
    a->mode = mode & ~ILC_OPCODE_EVENTS;
    a->by_opcode = (mode & ILC_OPCODE_EVENTS) != 0;
    a->fired = 0; a->live = 1; a->stacked = 0; a->disarmed = 0; a->thread = 0;
    a->below = a->above = NULL;
    a->prev_func = NULL; a->prev_obj = NULL; a->saved_opcodes = 0; a->installed = 0;
    return a;
}

Py_ssize_t ilc_armed_count(void) { return n_stacked; }
Py_ssize_t ilc_warm_entries(void) { return n_warm; }

/* ------------------------------------------------------------------ 3.10 / 3.11 ---- */
#if PY_VERSION_HEX < 0x030C0000

static int oneshot_trace(PyObject *obj, PyFrameObject *frame, int what, PyObject *arg);

/* Put back the previous tracer, if we are still the thread's C trace function. */
static void restore(Armed *a) {
    PyThreadState *tstate = PyThreadState_Get();
    if (a->live == 0 && a->installed == 0) return;
    a->live = 0;
    if (a->frame) ((PyFrameObject *)a->frame)->f_trace_opcodes = (char)a->saved_opcodes;
    if (a->installed && tstate->c_tracefunc == oneshot_trace && tstate->c_traceobj == (PyObject *)a) {
        PyObject *prev = a->prev_obj;      /* borrowed from a; a stays alive (caller holds it) */
        Py_XINCREF(prev);
        PyEval_SetTrace(a->prev_func, prev);
        Py_XDECREF(prev);
    }
    a->installed = 0;
}

/* The one-shot trace function. obj: borrowed (the Armed handle), frame: borrowed. */
static int oneshot_trace(PyObject *obj, PyFrameObject *frame, int what, PyObject *arg) {
    Armed *a = (Armed *)obj;
    int result = 0;
    Py_INCREF(a);                          /* restore() may drop the tstate's reference */
    if (a->live && (PyObject *)frame == a->frame) {
        if (what == PyTrace_LINE || what == PyTrace_OPCODE) {
            int unit = frame_unit(frame);
            if (unit >= a->lo && unit <= a->hi) {
                a->fired = 1;
                restore(a);
                if (a->mode == ILC_JUMP) {
                    frame_jump(frame, a->exit_unit);
#if PY_VERSION_HEX >= 0x030B0000
                    /* 3.10 reports the with line again when the exit runs (its next
                       dispatch compares lines); 3.11 compares with the exit itself, so
                       give the chained tracer the line event the inline run gives it. */
                    if (a->prev_func != NULL && frame->f_trace_lines) {
                        PyCodeObject *co = frame->f_frame->f_code;
                        int exit_line = PyCode_Addr2Line(co, a->exit_unit * 2);
                        int body_line = PyCode_Addr2Line(co, unit * 2);
                        if (exit_line >= 0 && exit_line != body_line) {
                            int saved = frame->f_lineno;  /* call_trace set it for this event */
                            frame->f_lineno = exit_line;
                            result = a->prev_func(a->prev_obj, frame, PyTrace_LINE, Py_None);
                            frame->f_lineno = saved;
                        }
                    }
#endif
                } else {
                    PyErr_SetNone(SkipSignal);
                    result = -1;
                }
                goto done;                 /* consumed: nobody else sees the body start */
            }
        } else if (what == PyTrace_RETURN) {
            restore(a);                    /* the frame left the window without a skip */
        }
        /* PyTrace_EXCEPTION does not end the window: `async with` awaits __aenter__'s
           result between arming and the body start, and with a trace function set the
           await reports the StopIteration that carries it. An exception that does leave
           the window ends in __exit__ (disarm) or in a RETURN event. */
    }
    if (a->prev_func != NULL &&
        !(what == PyTrace_OPCODE && (PyObject *)frame == a->frame && !a->saved_opcodes)) {
        result = a->prev_func(a->prev_obj, frame, what, arg);
    }
done:
    Py_DECREF(a);
    return result;
}

PyObject *ilc_arm(PyObject *frame, int lo, int hi, int exit_unit, int mode) {
    PyThreadState *tstate = PyThreadState_Get();
    prune_dead();
    Armed *a = new_armed(frame, lo, hi, exit_unit, mode);
    if (a == NULL) return NULL;
    if (push_armed(a) < 0) { Py_DECREF(a); return NULL; }
    a->prev_func = tstate->c_tracefunc;
    a->prev_obj = tstate->c_traceobj;
    Py_XINCREF(a->prev_obj);
    PyFrameObject *f = (PyFrameObject *)frame;
    a->saved_opcodes = f->f_trace_opcodes;
    if (a->by_opcode || !f->f_trace_lines)
        f->f_trace_opcodes = 1;            /* no line event at the body start: opcode events */
    a->installed = 1;
    PyEval_SetTrace(oneshot_trace, (PyObject *)a);
    if (PyErr_Occurred()) {
        a->installed = 0;
        f->f_trace_opcodes = (char)a->saved_opcodes;
        a->disarmed = 1;
        pop_armed(a);
        Py_DECREF(a);
        return NULL;
    }
    return (PyObject *)a;
}

int ilc_disarm(PyObject *handle) {
    CHECK(Py_TYPE(handle) == &ArmedType, "disarm() needs an armed handle");
    Armed *a = (Armed *)handle;
    Py_INCREF(a);
    restore(a);
    a->disarmed = 1;
    pop_armed(a);
    prune_dead();
    Py_CLEAR(a->frame);
    int fired = a->fired;
    Py_DECREF(a);
    return fired;
}

int ilc_fire(void) { return 0; }
int ilc_patch_check(PyObject *code, int unit, int prev_unit) { return 0; }
int ilc_split_super(PyObject *code, int unit) { return 0; }
int ilc_redirect(PyObject *code, int unit, int delta) {
    PyErr_SetString(PyExc_NotImplementedError, "redirect() is for 3.13 only"); return -1;
}
int ilc_guard(PyObject *code, int unit) { return 0; }

/* ------------------------------------------------------------------ 3.12 / 3.13 ---- */
#else

PyObject *ilc_arm(PyObject *frame, int lo, int hi, int exit_unit, int mode) {
    prune_dead();
    Armed *a = new_armed(frame, lo, hi, exit_unit, mode);
    if (a == NULL) return NULL;
    if (push_armed(a) < 0) { Py_DECREF(a); return NULL; }
    return (PyObject *)a;
}

int ilc_disarm(PyObject *handle) {
    CHECK(Py_TYPE(handle) == &ArmedType, "disarm() needs an armed handle");
    Armed *a = (Armed *)handle;
    Py_INCREF(a);
    a->live = 0;
    a->disarmed = 1;
    pop_armed(a);
    prune_dead();
    Py_CLEAR(a->frame);
    int fired = a->fired;
    Py_DECREF(a);
    return fired;
}

int ilc_fire(void) {
    if (n_stacked == 0) return 0;
    Armed *a = (Armed *)PyThread_tss_get(&armed_top);
    if (a == NULL) return 0;
    PyThreadState *tstate = PyThreadState_Get();
#if PY_VERSION_HEX >= 0x030D0000
    _PyInterpreterFrame *cur = tstate->current_frame;
#else
    _PyInterpreterFrame *cur = tstate->cframe->current_frame;
#endif
    for (; a != NULL; a = a->below) {
        if (!a->live || a->frame == NULL) continue;
        PyFrameObject *f = (PyFrameObject *)a->frame;
        if (f->f_frame != cur) continue;
        int unit = frame_unit(f);
        if (unit < a->lo || unit > a->hi) return 0;
        a->fired = 1;
        a->live = 0;
        if (a->mode == ILC_JUMP) {
            frame_jump(f, a->exit_unit);
            return 1;
        }
        PyErr_SetNone(SkipSignal);
        return -1;
    }
    return 0;
}

/* The opcode slot that decides what unit `i` executes: through INSTRUMENTED_LINE and
   INSTRUMENTED_INSTRUCTION to the stored original opcode. */
static uint8_t *opcode_slot(PyCodeObject *co, int i) {
    uint8_t *slot = &_PyCode_CODE(co)[i].op.code;
    if (*slot == INSTRUMENTED_LINE && co->_co_monitoring && co->_co_monitoring->lines)
        slot = &co->_co_monitoring->lines[i].original_opcode;
    if (*slot == INSTRUMENTED_INSTRUCTION && co->_co_monitoring && co->_co_monitoring->per_instruction_opcodes)
        slot = &co->_co_monitoring->per_instruction_opcodes[i];
    return slot;
}

#if PY_VERSION_HEX < 0x030D0000
static int super_base(int op) {
    switch (op) {
    case LOAD_FAST__LOAD_FAST: return LOAD_FAST;
    case LOAD_FAST__LOAD_CONST: return LOAD_FAST;
    case STORE_FAST__LOAD_FAST: return STORE_FAST;
    case STORE_FAST__STORE_FAST: return STORE_FAST;
    case LOAD_CONST__LOAD_FAST: return LOAD_CONST;
    default: return 0;
    }
}
#endif

int ilc_split_super(PyObject *code, int unit) {
    CHECK(PyCode_Check(code), "split_super() needs a code object");
    PyCodeObject *co = (PyCodeObject *)code;
    CHECK(unit >= 0 && unit < Py_SIZE(co), "unit out of range");
#if PY_VERSION_HEX < 0x030D0000
    uint8_t *slot = opcode_slot(co, unit);
    int base = super_base(*slot);
    if (base) { *slot = (uint8_t)base; return 1; }
#endif
    return 0;
}

int ilc_redirect(PyObject *code, int unit, int delta) {
    CHECK(PyCode_Check(code), "redirect() needs a code object");
    PyCodeObject *co = (PyCodeObject *)code;
    CHECK(unit >= 0 && unit < Py_SIZE(co) && delta >= 0 && delta <= 255 &&
          unit + 1 + delta < Py_SIZE(co), "redirect out of range");
#if PY_VERSION_HEX >= 0x030D0000
    uint8_t *slot = opcode_slot(co, unit);
    CHECK(*slot == LOAD_FAST_LOAD_FAST || *slot == STORE_FAST_LOAD_FAST,
          "expected a fused LOAD_FAST_LOAD_FAST/STORE_FAST_LOAD_FAST to redirect");
    _PyCode_CODE(co)[unit].op.arg = (uint8_t)delta;   /* the oparg stays in the code unit */
    *slot = JUMP_FORWARD;
    return 1;
#else
    PyErr_SetString(PyExc_NotImplementedError, "redirect() is for 3.13 only");
    return -1;
#endif
}

int ilc_guard(PyObject *code, int unit) {
#if PY_VERSION_HEX >= 0x030D0000
    CHECK(PyCode_Check(code), "guard() needs a code object");
    PyCodeObject *co = (PyCodeObject *)code;
    CHECK(unit >= 0 && unit < Py_SIZE(co), "unit out of range");
    _PyInterpreterFrame *cur = PyThreadState_Get()->current_frame;
    if (cur == NULL || (PyObject *)_PyFrame_GetCode(cur) != code) return 0;
    int op = *opcode_slot(co, unit);
    int arg = _PyCode_CODE(co)[unit].op.arg;
    int reads[2] = {-1, -1};
    if (op == LOAD_FAST_LOAD_FAST) { reads[0] = arg >> 4; reads[1] = arg & 15; }
    else if (op == STORE_FAST_LOAD_FAST) { reads[0] = arg & 15; }
    else return 0;
    PyObject **locals = _PyFrame_GetLocalsArray(cur);
    for (int k = 0; k < 2; k++) {
        int i = reads[k];
        if (i < 0 || locals[i] != NULL) continue;
        if (op == STORE_FAST_LOAD_FAST && (arg >> 4) == i) continue;  /* stored first */
        PyObject *name = PyTuple_GET_ITEM(co->co_localsplusnames, i);   /* borrowed */
        PyObject *error = PyObject_CallFunction(PyExc_UnboundLocalError,
            "N", PyUnicode_FromFormat("cannot access local variable '%U' where it is not "
                                      "associated with a value", name));
        if (error == NULL) return -1;
        PyErr_SetObject(PyExc_UnboundLocalError, error);
        Py_DECREF(error);
        return -1;
    }
#endif
    return 0;
}

int ilc_patch_check(PyObject *code, int unit, int prev_unit) {
    CHECK(PyCode_Check(code), "patch_check() needs a code object");
    PyCodeObject *co = (PyCodeObject *)code;
    CHECK(unit >= 0 && unit < Py_SIZE(co), "unit out of range");
    if (prev_unit >= 0) {
        CHECK(prev_unit < unit, "prev_unit must precede unit");
        ilc_split_super(code, prev_unit);  /* a pair would read `unit` unchecked */
    }
    uint8_t *slot = opcode_slot(co, unit);
    int op = *slot;
#if PY_VERSION_HEX < 0x030D0000
    if (op == LOAD_FAST__LOAD_FAST || op == LOAD_FAST__LOAD_CONST) op = LOAD_FAST;
#endif
    if (op == LOAD_FAST_CHECK) return 0;
    CHECK(op == LOAD_FAST, "expected LOAD_FAST at the unit to patch");
    *slot = LOAD_FAST_CHECK;
    return 1;
}
#endif

/* ---------------------------------------------------------- frame variables ---- *
 * A function frame's variables read and written in place (3.10-3.12), for binding the
 * names a deferred body uses and for writing its results back, without the `f_locals`
 * snapshot (a dict of every local, synced at each read) that the Python route builds and
 * then has to empty. What they see is what the snapshot would hold: a cell variable's
 * contents (3.10 keeps an argument that is also a cell in the cell, its fast slot cleared),
 * free variables, plain locals; unbound slots are missing. 3.13's `f_locals` is already a
 * write-through proxy with no snapshot: its frames go the Python route. */
#if PY_VERSION_HEX < 0x030D0000
#ifndef CO_FAST_CELL
#  define CO_FAST_CELL 0x40
#endif
#ifndef CO_FAST_FREE
#  define CO_FAST_FREE 0x80
#endif

static inline int same_name(PyObject *a, PyObject *b) {
    return a == b || (PyUnicode_GET_LENGTH(a) == PyUnicode_GET_LENGTH(b) && PyUnicode_Compare(a, b) == 0);
}

/* The slot of variable `name` (borrowed, a str) in frame f (borrowed, a function frame):
   a pointer into its locals array, NULL if the code has no such variable. *cell: the slot
   holds the variable's cell. */
static PyObject **var_slot(PyFrameObject *f, PyObject *name, int *cell) {
#if PY_VERSION_HEX >= 0x030B0000
    _PyInterpreterFrame *fr = f->f_frame;
    PyCodeObject *co = fr->f_code;
    PyObject *names = co->co_localsplusnames;
    const char *kinds = PyBytes_AS_STRING(co->co_localspluskinds);
    for (int i = 0; i < co->co_nlocalsplus; i++) {
        if (!same_name(PyTuple_GET_ITEM(names, i), name)) continue;
        unsigned char kind = (unsigned char)kinds[i];
#if PY_VERSION_HEX >= 0x030C0000
        if (kind & CO_FAST_HIDDEN) return NULL;   /* an inlined comprehension's */
#endif
        PyObject **slot = &fr->localsplus[i];
        *cell = (kind & (CO_FAST_CELL | CO_FAST_FREE)) && *slot != NULL && PyCell_Check(*slot);
        return slot;
    }
    return NULL;
#else
    PyCodeObject *co = f->f_code;
    Py_ssize_t nlocals = co->co_nlocals;
    Py_ssize_t ncells = PyTuple_GET_SIZE(co->co_cellvars), nfree = PyTuple_GET_SIZE(co->co_freevars);
    for (Py_ssize_t j = 0; j < ncells + nfree; j++) {   /* first: an argument may also be a cell */
        PyObject *n = j < ncells ? PyTuple_GET_ITEM(co->co_cellvars, j)
                                 : PyTuple_GET_ITEM(co->co_freevars, j - ncells);
        if (!same_name(n, name)) continue;
        PyObject **slot = &f->f_localsplus[nlocals + j];
        *cell = *slot != NULL && PyCell_Check(*slot);
        return slot;
    }
    for (Py_ssize_t j = 0; j < nlocals; j++) {
        if (!same_name(PyTuple_GET_ITEM(co->co_varnames, j), name)) continue;
        *cell = 0;
        return &f->f_localsplus[j];
    }
    return NULL;
#endif
}

/* Empty the frame's `f_locals` snapshot if an earlier read left one (see skip.release_locals). */
static void drop_snapshot(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *snapshot = f->f_frame->f_locals;
#else
    PyObject *snapshot = f->f_locals;
#endif
    if (snapshot != NULL && PyDict_CheckExact(snapshot) && PyDict_GET_SIZE(snapshot) > 0)
        PyDict_Clear(snapshot);
}
#endif

static PyObject *s_f_locals = NULL, *s_update = NULL;   /* interned */

/* frame.f_locals (a new reference): a module's globals, a class body's namespace, 3.13's
   write-through proxy. NULL with an error set. */
static PyObject *frame_scope(PyObject *frame) {
    if (s_f_locals == NULL && (s_f_locals = PyUnicode_InternFromString("f_locals")) == NULL) return NULL;
    return PyObject_GetAttr(frame, s_f_locals);
}

PyObject *ilc_bind(PyObject *frame, PyObject *names) {
    if (!PyFrame_Check(frame) || !PyTuple_Check(names)) {
        PyErr_SetString(PyExc_TypeError, "bind() needs a frame and a tuple of names");
        return NULL;
    }
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(names);
#if PY_VERSION_HEX < 0x030D0000
    PyFrameObject *f = (PyFrameObject *)frame;
    if (((PyCodeObject *)frame_code(f))->co_flags & CO_OPTIMIZED) {
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *name = PyTuple_GET_ITEM(names, k);
            if (!PyUnicode_Check(name)) continue;
            int cell = 0;
            PyObject **slot = var_slot(f, name, &cell);
            PyObject *value = slot == NULL ? NULL : cell ? PyCell_GET(*slot) : *slot;
            if (value != NULL && PyDict_SetItem(out, name, value) < 0) { Py_DECREF(out); return NULL; }
        }
        drop_snapshot(f);
        return out;
    }
#endif
    PyObject *scope = frame_scope(frame);
    if (scope == NULL) { Py_DECREF(out); return NULL; }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *name = PyTuple_GET_ITEM(names, k);
        PyObject *value = NULL;
        if (PyDict_CheckExact(scope)) {
            value = Py_XNewRef(PyDict_GetItemWithError(scope, name));
        } else {                           /* a class namespace of a metaclass's own, a proxy */
            int has = PySequence_Contains(scope, name);
            if (has > 0) value = PyObject_GetItem(scope, name);
            else if (has < 0) goto error;
        }
        if (value == NULL) {
            if (PyErr_Occurred()) goto error;
            continue;
        }
        int r = PyDict_SetItem(out, name, value);
        Py_DECREF(value);
        if (r < 0) goto error;
    }
    Py_DECREF(scope);
    return out;
error:
    Py_DECREF(scope);
    Py_DECREF(out);
    return NULL;
}

int ilc_write_back(PyObject *frame, PyObject *values) {
    if (!PyFrame_Check(frame)) { PyErr_SetString(PyExc_TypeError, "write_back() needs a frame"); return -1; }
    int any = PyObject_IsTrue(values);
    if (any <= 0) return any;
    PyFrameObject *f = (PyFrameObject *)frame;
    int optimized = ((PyCodeObject *)frame_code(f))->co_flags & CO_OPTIMIZED;
    PyObject *scope = NULL, *items = NULL;
    int result = -1;
#if PY_VERSION_HEX < 0x030D0000
    if (optimized) {
        if (PyDict_Check(values)) items = Py_NewRef(values);
        else if ((items = PyDict_New()) == NULL || PyDict_Update(items, values) < 0) goto done;
        Py_ssize_t pos = 0;
        PyObject *name, *value;
        while (PyDict_Next(items, &pos, &name, &value)) {
            if (!PyUnicode_Check(name)) continue;
            int cell = 0;
            PyObject **slot = var_slot(f, name, &cell);
            if (slot == NULL) continue;                /* not a variable of the frame */
            if (cell) {
                PyObject *old = PyCell_GET(*slot);
                if (old == value) continue;
                Py_INCREF(value);
                PyCell_SET(*slot, value);
                Py_XDECREF(old);
            } else if (*slot != value) {
                Py_INCREF(value);
                Py_XSETREF(*slot, value);
            }
        }
        drop_snapshot(f);
        result = 0;
        goto done;
    }
#endif
    if ((scope = frame_scope(frame)) == NULL) goto done;
    if (!optimized) {                      /* module globals, a class body's namespace */
        if (s_update == NULL && (s_update = PyUnicode_InternFromString("update")) == NULL) goto done;
        PyObject *r = PyObject_CallMethodOneArg(scope, s_update, values);
        if (r == NULL) goto done;
        Py_DECREF(r);
        result = 0;
        goto done;
    }
    /* 3.13: the PEP 667 write-through proxy */
    if ((items = PyDict_New()) == NULL || PyDict_Update(items, values) < 0) goto done;
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(items, &pos, &name, &value))
        if (PyObject_SetItem(scope, name, value) < 0) goto done;
    result = 0;
done:
    Py_XDECREF(scope);
    Py_XDECREF(items);
    return result;
}

PyObject *ilc_call_bound(PyObject *function, PyObject *namespace, PyObject *params) {
    if (!PyTuple_Check(params)) { PyErr_SetString(PyExc_TypeError, "call_bound() needs a tuple of names"); return NULL; }
    Py_ssize_t n = PyTuple_GET_SIZE(params), got = 0;
    PyObject *small[8] = {NULL};
    PyObject **stack = n <= 8 ? small : PyMem_New(PyObject *, n);
    if (stack == NULL) return PyErr_NoMemory();
    PyObject *result = NULL;
    int exact = PyDict_CheckExact(namespace);
    for (; got < n; got++) {
        PyObject *name = PyTuple_GET_ITEM(params, got);
        PyObject *value;
        if (exact) {
            value = Py_XNewRef(PyDict_GetItemWithError(namespace, name));
            if (value == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, name);
        } else {
            value = PyObject_GetItem(namespace, name);   /* a mapping's own __getitem__ */
        }
        if (value == NULL) goto done;
        stack[got] = value;
    }
    result = PyObject_Vectorcall(function, stack, (size_t)n, NULL);
done:
    for (Py_ssize_t k = 0; k < got; k++) Py_DECREF(stack[k]);
    if (stack != small) PyMem_Free(stack);
    return result;
}

PyObject *ilc_pick(PyObject *values, PyObject *names, PyObject *saved) {
    if (saved != Py_None && !PyDict_Check(saved)) {
        PyErr_SetString(PyExc_TypeError, "pick() needs the saved dict (id -> object) or None");
        return NULL;
    }
    /* A few saved values (the common case): compared by identity, as their ids would be
       (the saved dict keeps each alive), without making an int per name. */
    PyObject *few[8];
    Py_ssize_t nfew = -1;
    if (saved != Py_None && PyDict_GET_SIZE(saved) <= 8) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        nfew = 0;
        while (PyDict_Next(saved, &pos, &k, &v)) few[nfew++] = v;
    }
    PyObject *out = PyDict_New(), *iter = NULL, *name = NULL;
    if (out == NULL) return NULL;
    if ((iter = PyObject_GetIter(names)) == NULL) goto error;
    int exact = PyDict_CheckExact(values);
    while ((name = PyIter_Next(iter)) != NULL) {
        PyObject *value;
        if (exact) {
            value = Py_XNewRef(PyDict_GetItemWithError(values, name));
        } else {
            int has = PySequence_Contains(values, name);
            value = has > 0 ? PyObject_GetItem(values, name) : NULL;
        }
        if (value == NULL) {
            if (PyErr_Occurred()) goto error;
            Py_DECREF(name);
            continue;
        }
        int keep = 1;
        if (nfew >= 0) {
            keep = 0;
            for (Py_ssize_t i = 0; i < nfew; i++) {
                if (few[i] == value) { keep = 1; break; }
            }
        } else if (saved != Py_None) {     /* saved by identity: its id is the key */
            PyObject *key = PyLong_FromVoidPtr(value);
            keep = key == NULL ? -1 : PyDict_Contains(saved, key);
            Py_XDECREF(key);
        }
        if (keep > 0) keep = PyDict_SetItem(out, name, value) < 0 ? -1 : 1;
        Py_DECREF(value);
        Py_DECREF(name);
        name = NULL;
        if (keep < 0) goto error;
    }
    if (PyErr_Occurred()) goto error;
    Py_DECREF(iter);
    return out;
error:
    Py_XDECREF(name);
    Py_XDECREF(iter);
    Py_DECREF(out);
    return NULL;
}

/* --------------------------------------------------------------- warm sites ---- *
 * What the Python policy decided for a `with` site, kept on the code object (co_extra): one
 * CodeSites per code object, freed with it. A site is keyed by the with's f_lasti and the
 * tracer's type; `look_past` marks a tracer's own __enter__ (a subclass calling
 * super().__enter__()), whose frame is walked past to find the user's.
 *
 * Nothing a record refers to strongly may lead back to the code object: the garbage
 * collector does not see co_extra, so such a cycle would never be freed. The Block (whose
 * body functions hold the globals that hold the code) and the tracer type (whose methods
 * may) are therefore weak references: a record whose Block went (dropped from BLOCKS) is a
 * miss, and the policy registers the site again. The SkipPlan holds only facts. */

typedef struct {
    int lasti;                /* bytes offset of the with's enter instruction */
    PyObject *kind;           /* strong: a weak reference to the tracer type */
    PyObject *block;          /* strong: a weak reference to its Block */
    PyObject *plan;           /* strong: its SkipPlan; NULL for a body that runs inline */
    int lo, hi, exit_unit, mode;
} Site;

/* What the weak reference `ref` (borrowed; made by PyWeakref_NewRef) points to, borrowed,
   or NULL if it is gone. The GIL build clears wr_object to None when the referent goes. */
static inline PyObject *target_of(PyObject *ref) {
    PyObject *obj = ((PyWeakReference *)ref)->wr_object;
    return obj != Py_None && Py_REFCNT(obj) > 0 ? obj : NULL;
}

/* target_of as a NEW reference, or NULL (no error set). */
static inline PyObject *deref(PyObject *ref) {
    return Py_XNewRef(target_of(ref));
}

/* Whether the weak reference `ref` (borrowed) points to `obj` (borrowed). */
static inline int refers_to(PyObject *ref, PyObject *obj) {
    return target_of(ref) == obj;
}

typedef struct {
    int look_past;
    Py_ssize_t n, cap;
    Site *sites;              /* PyMem; n used */
} CodeSites;

static Py_ssize_t extra_index = -1;

static void site_clear(Site *s) {
    Py_CLEAR(s->kind);
    Py_CLEAR(s->block);
    Py_CLEAR(s->plan);
}

/* co_extra's free function: runs when the code object goes (the GIL is held). */
static void code_sites_free(void *p) {
    CodeSites *cs = (CodeSites *)p;
    if (cs == NULL) return;
    Site *sites = cs->sites;
    Py_ssize_t n = cs->n;
    cs->sites = NULL;
    cs->n = cs->cap = 0;
    for (Py_ssize_t k = 0; k < n; k++) site_clear(&sites[k]);
    PyMem_Free(sites);
    PyMem_Free(cs);
}

/* The CodeSites of `code` (borrowed), or NULL if none (no error set). */
static inline CodeSites *code_sites(PyObject *code) {
    void *extra = NULL;
    if (extra_index < 0 || ILC_GET_EXTRA(code, extra_index, &extra) < 0) {
        PyErr_Clear();
        return NULL;
    }
    return (CodeSites *)extra;
}

/* The CodeSites of `code`, made if missing. Returns NULL with an error set. */
static CodeSites *code_sites_make(PyObject *code) {
    if (!PyCode_Check(code)) { PyErr_SetString(PyExc_TypeError, "expected a code object"); return NULL; }
    if (extra_index < 0) {
        extra_index = ILC_REQUEST_EXTRA(code_sites_free);
        if (extra_index < 0) { PyErr_SetString(PyExc_RuntimeError, "interlace: no code extra index left"); return NULL; }
    }
    CodeSites *cs = code_sites(code);
    if (cs != NULL) return cs;
    cs = (CodeSites *)PyMem_Calloc(1, sizeof(CodeSites));
    if (cs == NULL) { PyErr_NoMemory(); return NULL; }
    if (ILC_SET_EXTRA(code, extra_index, cs) < 0) { PyMem_Free(cs); return NULL; }
    return cs;
}

/* The site of (lasti, kind) in cs, or NULL. cs, kind: borrowed. */
static inline Site *find_site(CodeSites *cs, int lasti, PyObject *kind) {
    for (Py_ssize_t k = 0; k < cs->n; k++)
        if (cs->sites[k].lasti == lasti && refers_to(cs->sites[k].kind, kind)) return &cs->sites[k];
    return NULL;
}

int ilc_register_site(PyObject *code, int lasti, PyObject *kind, PyObject *block, PyObject *plan,
                      int lo, int hi, int exit_unit, int mode) {
    CHECK(PyType_Check(kind), "register_site() needs the tracer type");
    PyObject *kind_ref = PyWeakref_NewRef(kind, NULL);
    if (kind_ref == NULL) return -1;
    PyObject *block_ref = PyWeakref_NewRef(block, NULL);
    if (block_ref == NULL) { Py_DECREF(kind_ref); return -1; }
    CodeSites *cs = code_sites_make(code);
    if (cs == NULL) { Py_DECREF(kind_ref); Py_DECREF(block_ref); return -1; }
    Site *s = find_site(cs, lasti, kind);
    if (s == NULL) {                       /* else a record whose type or Block went */
        for (Py_ssize_t k = 0; k < cs->n && s == NULL; k++)
            if (target_of(cs->sites[k].kind) == NULL || target_of(cs->sites[k].block) == NULL)
                s = &cs->sites[k];
    }
    Site old = {0};
    if (s == NULL) {
        if (cs->n == cs->cap) {
            Py_ssize_t cap = cs->cap ? cs->cap * 2 : 2;
            Site *grown = PyMem_Realloc(cs->sites, (size_t)cap * sizeof(Site));
            if (grown == NULL) { Py_DECREF(kind_ref); Py_DECREF(block_ref); PyErr_NoMemory(); return -1; }
            cs->sites = grown;
            cs->cap = cap;
        }
        s = &cs->sites[cs->n++];
        memset(s, 0, sizeof(Site));
    } else {
        old = *s;                          /* released last: a release may run Python code */
    }
    s->lasti = lasti;
    s->kind = kind_ref;
    s->block = block_ref;
    s->plan = (plan == Py_None) ? NULL : plan;
    Py_XINCREF(s->plan);
    s->lo = lo; s->hi = hi; s->exit_unit = exit_unit; s->mode = mode;
    site_clear(&old);
    return 0;
}

int ilc_look_past(PyObject *code) {
    CodeSites *cs = code_sites_make(code);
    if (cs == NULL) return -1;
    cs->look_past = 1;
    return 0;
}

/* The frame the user wrote the `with` in: `frame` (borrowed) or the first caller whose code
   is not marked look_past. Returns a NEW reference (NULL without an error if none). */
static PyFrameObject *user_frame(PyFrameObject *f) {
    Py_XINCREF(f);
    while (f != NULL) {
        CodeSites *cs = code_sites(frame_code(f));
        if (cs == NULL || !cs->look_past) break;
        PyFrameObject *back = PyFrame_GetBack(f);  /* new reference or NULL */
        Py_DECREF(f);
        f = back;
    }
    return f;
}

PyObject *ilc_user_frame(PyObject *frame) {
    if (!PyFrame_Check(frame)) { PyErr_SetString(PyExc_TypeError, "user_frame() needs a frame"); return NULL; }
    PyFrameObject *f = user_frame((PyFrameObject *)frame);
    if (f == NULL) Py_RETURN_NONE;
    return (PyObject *)f;
}

PyObject *ilc_site(PyObject *code, int lasti, PyObject *kind) {
    if (!PyCode_Check(code)) { PyErr_SetString(PyExc_TypeError, "site() needs a code object"); return NULL; }
    CodeSites *cs = code_sites(code);
    Site *s = cs != NULL ? find_site(cs, lasti, kind) : NULL;
    PyObject *block = s != NULL ? deref(s->block) : NULL;  /* a record whose Block went: none */
    if (block == NULL) Py_RETURN_NONE;
    PyObject *out = s->plan == NULL ? Py_BuildValue("(NOO)", block, Py_None, Py_None)
        : Py_BuildValue("(NO(iiii))", block, s->plan, s->lo, s->hi, s->exit_unit, s->mode);
    return out;
}

/* ----------------------------------------------------------------- TracerBase ---- *
 * The Tracer's fields, in C so that the warm path reads and writes them by offset, and its
 * __init__ (args, kwargs, backend), in C so that making a tracer runs no Python frame. A
 * field holds NULL when unset and reads as None (assigning None stores NULL); `kwargs` reads
 * as a dict made on first use. A heap type without tp_new of its own: instances are made by
 * object.__new__, so a Python subclass pickles (every protocol) and copies like any Python
 * class (through its __getstate__). */

typedef struct {
    PyObject_HEAD
    PyObject *args;           /* the positional arguments (a tuple) */
    PyObject *kwargs;         /* the keyword arguments but `backend` (NULL: none yet) */
    PyObject *block;          /* the captured Block (kept after the run) */
    PyObject *backend;        /* called with the tracer after a clean skip */
    PyObject *frame;          /* the caller's frame while the trace runs */
    PyObject *plan;           /* its SkipPlan (NULL: the body runs inline) */
    PyObject *parent;         /* the enclosing trace's state, read at __enter__ */
    PyObject *state;          /* this trace's TraceState, made when the body first runs */
    PyObject *armed;          /* the Armed handle from __enter__ until __exit__ disarms */
} TracerBaseObject;

static PyTypeObject *TracerBaseType = NULL;   /* strong */
static PyObject *tr_default_backend = NULL;   /* strong: the backend of `backend=None` */
static PyObject *s_backend = NULL;            /* interned "backend", strong */

#define TB(o) ((TracerBaseObject *)(o))
#define FIELD(o, off) ((PyObject **)((char *)(o) + (Py_ssize_t)(off)))

static PyObject *tb_get(PyObject *self, void *offset) {
    PyObject *v = *FIELD(self, offset);
    return Py_NewRef(v != NULL ? v : Py_None);
}

static int tb_set(PyObject *self, PyObject *value, void *offset) {
    if (value == Py_None) value = NULL;
    if ((Py_ssize_t)offset == offsetof(TracerBaseObject, armed) && value != NULL
            && Py_TYPE(value) != &ArmedType) {
        PyErr_SetString(PyExc_TypeError, "_armed must be an armed handle (frames.arm) or None");
        return -1;
    }
    Py_XINCREF(value);
    Py_XSETREF(*FIELD(self, offset), value);
    return 0;
}

/* `kwargs`: the dict, made (and kept) on first read so that it is the same object each time. */
static PyObject *tb_get_kwargs(PyObject *self, void *unused) {
    TracerBaseObject *t = TB(self);
    if (t->kwargs == NULL && (t->kwargs = PyDict_New()) == NULL) return NULL;
    return Py_NewRef(t->kwargs);
}

/* __init__(self, *args, backend=None, **kwargs). self, args, kwds: borrowed. Returns 0, -1
   with an error set. */
static int tb_init(PyObject *self, PyObject *args, PyObject *kwds) {
    TracerBaseObject *t = TB(self);
    PyObject *backend = NULL, *kwargs = NULL;
    Py_ssize_t n = kwds != NULL ? PyDict_GET_SIZE(kwds) : 0;
    if (n > 0) {
        backend = PyDict_GetItemWithError(kwds, s_backend);   /* borrowed */
        if (backend == NULL && PyErr_Occurred()) return -1;
        if (n > (backend != NULL)) {       /* more than `backend`: a dict of our own */
            if ((kwargs = PyDict_Copy(kwds)) == NULL) return -1;
            if (backend != NULL && PyDict_DelItem(kwargs, s_backend) < 0) { Py_DECREF(kwargs); return -1; }
        }
    }
    if (backend == NULL || backend == Py_None) backend = tr_default_backend;
    Py_XINCREF(backend);
    Py_INCREF(args);
    PyObject *old[3] = {t->args, t->kwargs, t->backend};
    t->args = args;
    t->kwargs = kwargs;
    t->backend = backend;
    for (int k = 0; k < 3; k++) Py_XDECREF(old[k]);
    return 0;
}

static int tb_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    TracerBaseObject *t = TB(self);
    Py_VISIT(t->args); Py_VISIT(t->kwargs);
    Py_VISIT(t->block); Py_VISIT(t->backend); Py_VISIT(t->frame); Py_VISIT(t->plan);
    Py_VISIT(t->parent); Py_VISIT(t->state); Py_VISIT(t->armed);
    return 0;
}

/* A tracer that goes while armed (its __enter__ armed, then something raised before the
   with could call __exit__) disarms first: the armed stack must not keep its frame. */
static void tb_drop_armed(TracerBaseObject *t) {
    PyObject *handle = t->armed;
    if (handle == NULL) return;
    t->armed = NULL;
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *pending = PyErr_GetRaisedException();   /* dealloc keeps the caller's error */
    if (ilc_disarm(handle) < 0) PyErr_Clear();
    PyErr_SetRaisedException(pending);
#else
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    if (ilc_disarm(handle) < 0) PyErr_Clear();
    PyErr_Restore(et, ev, etb);
#endif
    Py_DECREF(handle);
}

static int tb_clear(PyObject *self) {
    TracerBaseObject *t = TB(self);
    tb_drop_armed(t);
    Py_CLEAR(t->args); Py_CLEAR(t->kwargs);
    Py_CLEAR(t->block); Py_CLEAR(t->backend); Py_CLEAR(t->frame); Py_CLEAR(t->plan);
    Py_CLEAR(t->parent); Py_CLEAR(t->state); Py_CLEAR(t->armed);
    return 0;
}

static void tb_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    tb_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

#define TB_FIELD(name, member, doc) \
    {name, tb_get, tb_set, doc, (void *)offsetof(TracerBaseObject, member)}
static PyGetSetDef tb_getset[] = {
    TB_FIELD("args", args, "The positional arguments the tracer was made with."),
    {"kwargs", tb_get_kwargs, tb_set, "The keyword arguments the tracer was made with, but `backend`.",
     (void *)offsetof(TracerBaseObject, kwargs)},
    TB_FIELD("block", block, "The captured Block of this tracer's with site (None before __enter__)."),
    TB_FIELD("backend", backend, "Called with the tracer after a clean skip."),
    TB_FIELD("_frame", frame, "The caller's frame while the trace runs."),
    TB_FIELD("_plan", plan, "The site's SkipPlan while the trace runs (None: the body runs inline)."),
    TB_FIELD("_parent", parent, "The enclosing trace's state, read at __enter__."),
    TB_FIELD("_state", state, "This trace's TraceState, made when the body first runs."),
    TB_FIELD("_armed", armed, "The armed skip from __enter__ until __exit__ disarms it."),
    {NULL},
};

static PyType_Slot tb_slots[] = {
    {Py_tp_doc, (void *)"The Tracer's per-run fields as C fields: the warm __enter__/__exit__ read "
                        "and write them by offset, never by attribute name. Unset fields read as "
                        "None; subclasses keep a __dict__."},
    {Py_tp_dealloc, (void *)tb_dealloc},
    {Py_tp_init, (void *)tb_init},
    {Py_tp_traverse, (void *)tb_traverse},
    {Py_tp_clear, (void *)tb_clear},
    {Py_tp_getset, (void *)tb_getset},
    {0, NULL},
};

static PyType_Spec tb_spec = {
    .name = "interlace._cframes.TracerBase",
    .basicsize = sizeof(TracerBaseObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = tb_slots,
};

PyObject *ilc_tracer_base(void) {
    if (s_backend == NULL && (s_backend = PyUnicode_InternFromString("backend")) == NULL) return NULL;
    if (TracerBaseType == NULL) {
        TracerBaseType = (PyTypeObject *)PyType_FromSpec(&tb_spec);
        if (TracerBaseType == NULL) return NULL;
    }
    return Py_NewRef((PyObject *)TracerBaseType);
}

/* ------------------------------------------------------- Tracer warm path (all) ---- *
 * Tracer.__enter__/__exit__/__aenter__/__aexit__ as C methods (no Python frame, no
 * traceback entry of ours). Mechanism only: on a registered site they do what the policy
 * decided (set the per-run fields, arm/disarm, call the backend). Anything else (a site not
 * registered for this tracer type, a tracer already armed, an exception other than our skip
 * signal, a skip that did not fire) calls the Python methods, which hold the whole policy.
 *
 * Errors: whatever leaves these methods (a refusal, a body's or a backend's error) first
 * goes through the Python `clean(error, signal)`, which drops interlace's frames from its
 * traceback. `clean` returns normally, so it adds no frame; the eval loop then adds only the
 * user's frame at the `with` line: no interlace frame is left in the traceback. */

static PyObject *tr_enter = NULL;     /* strong: Python __enter__(self, frame) */
static PyObject *tr_exit = NULL;      /* strong: Python __exit__(self, t, v, tb, fired) */
static PyObject *tr_clean = NULL;     /* strong: Python clean(error, signal): drop our frames */
static PyObject *tr_current = NULL;   /* strong: the trace-state ContextVar */
static PyObject *s_dunder_enter = NULL, *s_dunder_exit = NULL, *s_dunder_call = NULL;  /* interned */

/* The pending exception, its traceback cleaned of interlace's frames (and `signal`, borrowed,
   unlinked from its context chain), still pending. Returns NULL (so that
   `return clean_pending(...);` propagates it). If `clean` itself fails, the original
   exception stays as it was. */
static PyObject *clean_pending(PyObject *signal) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *error = PyErr_GetRaisedException();      /* new reference, traceback attached */
    if (error == NULL) return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(tr_clean, error, signal, NULL);
    if (r == NULL) PyErr_Clear(); else Py_DECREF(r);
    PyErr_SetRaisedException(error);                   /* steals; uses error.__traceback__ */
#else
    PyObject *type, *error, *tb;
    PyErr_Fetch(&type, &error, &tb);
    PyErr_NormalizeException(&type, &error, &tb);
    if (error == NULL) { PyErr_Restore(type, error, tb); return NULL; }
    if (tb != NULL) PyException_SetTraceback(error, tb);
    PyObject *r = PyObject_CallFunctionObjArgs(tr_clean, error, signal, NULL);
    if (r == NULL) PyErr_Clear(); else Py_DECREF(r);
    Py_XDECREF(tb);
    tb = PyException_GetTraceback(error);              /* new reference: the cleaned one */
    PyErr_Restore(type, error, tb);                    /* steals all three */
#endif
    return NULL;
}

/* Enter a registered site: set the per-run fields, arm last. t: borrowed; f: borrowed, the
   user's frame; s: a copy of the site whose `block` is the Block itself (not the weak
   reference) and whose block/plan the caller holds references to.
   Returns 0, -1 with an error set (fields left unset). */
static int enter_warm(TracerBaseObject *t, PyFrameObject *f, Site *s) {
    PyObject *parent = NULL, *handle = NULL;
    if (PyContextVar_Get(tr_current, NULL, &parent) < 0) return -1;   /* parent: new ref or NULL */
    if (parent == Py_None) Py_CLEAR(parent);
    if (s->plan != NULL) {
        handle = ilc_arm((PyObject *)f, s->lo, s->hi, s->exit_unit, s->mode);
        if (handle == NULL) { Py_XDECREF(parent); return -1; }
    }
    /* No Python code runs between arming and the body start: the old values (normally
       NULL; the previous run's Block) are released after the fields are set, and
       releasing them runs no code in the armed frame. */
    PyObject *old[5] = {t->block, t->frame, t->plan, t->parent, t->armed};
    Py_INCREF(s->block); t->block = s->block;
    Py_INCREF(f); t->frame = (PyObject *)f;
    Py_XINCREF(s->plan); t->plan = s->plan;
    t->parent = parent;
    t->armed = handle;
    for (int k = 0; k < 5; k++) Py_XDECREF(old[k]);
    n_warm++;
    return 0;
}

/* __enter__(self). self: borrowed. Returns a new reference to self (or what the Python
   method returns), NULL with an error set (its traceback cleaned). */
static PyObject *tracer_enter(PyObject *self, PyObject *unused) {
    TracerBaseObject *t = TB(self);
    PyFrameObject *f = user_frame(PyEval_GetFrame());  /* new reference or NULL */
    if (f != NULL && t->armed == NULL) {
        CodeSites *cs = code_sites(frame_code(f));
        Site *found = cs != NULL ? find_site(cs, frame_lasti_bytes(f), (PyObject *)Py_TYPE(self)) : NULL;
        PyObject *block = found != NULL ? deref(found->block) : NULL;  /* NULL: its Block went */
        if (block != NULL) {
            Site s = *found;                           /* ours: registering may move it */
            s.block = block;                           /* the Block itself, our reference */
            Py_XINCREF(s.plan);
            int r = enter_warm(t, f, &s);
            Py_DECREF(s.block);
            Py_XDECREF(s.plan);
            Py_DECREF(f);
            if (r < 0) return clean_pending(Py_None);
            return Py_NewRef(self);
        }
    }
    PyObject *argv[2] = {self, f != NULL ? (PyObject *)f : Py_None};
    PyObject *res = PyObject_Vectorcall(tr_enter, argv, 2, NULL);
    Py_XDECREF(f);
    return res != NULL ? res : clean_pending(Py_None);
}

/* After a clean skip: run the backend; clear the per-run fields. self: borrowed; signal:
   borrowed, our skip signal being handled (raise mode) or None. Returns a new reference to
   True, or NULL with the backend's error set, its traceback cleaned. */
static PyObject *tracer_finish(PyObject *self, PyObject *signal) {
    TracerBaseObject *t = TB(self);
    PyObject *backend = t->backend != NULL ? t->backend : Py_None;
    Py_INCREF(backend);                                /* the backend may replace it */
    /* backend(self): a Python `__call__` of its class is called as __call__(backend, self)
       directly (what the call does, without a bound method and an argument tuple). */
    PyObject *call = _PyType_Lookup(Py_TYPE(backend), s_dunder_call);   /* borrowed */
    PyObject *r;
    if (call != NULL && PyFunction_Check(call)) {
        Py_INCREF(call);
        PyObject *argv[2] = {backend, self};
        r = PyObject_Vectorcall(call, argv, 2, NULL);
        Py_DECREF(call);
    } else {
        r = PyObject_CallOneArg(backend, self);
    }
    Py_DECREF(backend);
    if (r == NULL) clean_pending(signal);
    Py_XDECREF(r);
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *error = PyErr_GetRaisedException();      /* kept aside while clearing */
#else
    PyObject *et, *error, *etb;
    PyErr_Fetch(&et, &error, &etb);
#endif
    PyObject *old[4] = {t->frame, t->plan, t->state, t->parent};
    t->frame = t->plan = t->state = t->parent = NULL;
    for (int k = 0; k < 4; k++) Py_XDECREF(old[k]);
#if PY_VERSION_HEX >= 0x030C0000
    if (error != NULL) { PyErr_SetRaisedException(error); return NULL; }
#else
    if (et != NULL) { PyErr_Restore(et, error, etb); return NULL; }
#endif
    Py_RETURN_TRUE;
}

/* __exit__(self, exc_type, exc, tb). self, args: borrowed. Returns a new reference, NULL
   with an error set (its traceback cleaned). A clean exit (or our skip signal) of an armed
   run disarms here and runs the backend, as does the clean exit of a body that ran inline;
   otherwise the Python method (told whether the skip fired) does. */
static PyObject *tracer_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "__exit__() takes exactly 3 arguments (%zd given)", nargs);
        return NULL;
    }
    TracerBaseObject *t = TB(self);
    PyObject *et = args[0], *fired = NULL;
    int clean = et == Py_None;
    int signal = !clean && t->armed != NULL && PyType_Check(et)
                 && PyType_IsSubtype((PyTypeObject *)et, (PyTypeObject *)SkipSignal);
    if ((clean || signal) && t->armed != NULL) {
        PyObject *handle = t->armed;                   /* the field's reference is ours now */
        t->armed = NULL;
        int r = ilc_disarm(handle);
        Py_DECREF(handle);
        if (r < 0) return clean_pending(Py_None);
        if (r == 1) return tracer_finish(self, signal ? args[1] : Py_None);
        fired = Py_False;                              /* the policy reports it */
    } else if (clean && t->armed == NULL && t->plan == NULL && t->frame != NULL) {
        return tracer_finish(self, Py_None);           /* a body that ran inline */
    }
    PyObject *res;
    if (fired != NULL) {
        PyObject *argv[5] = {self, args[0], args[1], args[2], fired};
        res = PyObject_Vectorcall(tr_exit, argv, 5, NULL);
    } else {
        PyObject *argv[4] = {self, args[0], args[1], args[2]};
        res = PyObject_Vectorcall(tr_exit, argv, 4, NULL);
    }
    return res != NULL ? res : clean_pending(Py_None);
}
/* ---- async with: __aenter__/__aexit__ do the work at once and return a done awaitable ---- *
 * `await` on a Ready gives its value without suspending the coroutine, so the skip armed
 * by __aenter__ (before the await loop of BEFORE_ASYNC_WITH runs) is still armed at the
 * body start, and __aexit__'s backend has run when the await after the exit call returns. */

typedef struct {
    PyObject_HEAD
    PyObject *value;          /* strong; NULL once given out */
} Ready;

static void ready_dealloc(Ready *self) {
    Py_CLEAR(self->value);
    PyObject_Free(self);
}

/* am_await: the object is its own iterator. Returns a new reference. */
static PyObject *ready_await(PyObject *self) { Py_INCREF(self); return self; }

/* tp_iternext (3.12+'s SEND, and 3.10/3.11 while a trace function is set): finish at once
   with StopIteration(value). Returns NULL with StopIteration set. */
static PyObject *ready_next(Ready *self) {
    PyObject *value = self->value;                   /* ours now */
    self->value = NULL;
    if (value == NULL) return NULL;                   /* exhausted: a bare StopIteration */
    PyObject *stop = PyObject_CallOneArg(PyExc_StopIteration, value);  /* keeps tuples whole */
    Py_DECREF(value);
    if (stop == NULL) return NULL;
    PyErr_SetObject(PyExc_StopIteration, stop);
    Py_DECREF(stop);
    return NULL;
}

/* am_send (3.10/3.11's PyIter_Send): return the value without an exception. *result: a
   new reference. */
static PySendResult ready_send(Ready *self, PyObject *arg, PyObject **result) {
    PyObject *value = self->value;
    self->value = NULL;
    if (value == NULL) { Py_INCREF(Py_None); value = Py_None; }
    *result = value;
    return PYGEN_RETURN;
}

static PyAsyncMethods ready_async = {
    .am_await = ready_await,
    .am_send = (sendfunc)ready_send,
};

static PyTypeObject ReadyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "interlace._cframes.Ready",
    .tp_basicsize = sizeof(Ready),
    .tp_dealloc = (destructor)ready_dealloc,
    .tp_as_async = &ready_async,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)ready_next,
    .tp_doc = "An awaitable that is already done (the result of Tracer.__aenter__/__aexit__).",
};

/* A Ready holding `value` (stolen; NULL passes the error on). Returns a new reference. */
static PyObject *ready_new(PyObject *value) {
    if (value == NULL) return NULL;
    Ready *r = PyObject_New(Ready, &ReadyType);
    if (r == NULL) { Py_DECREF(value); return NULL; }
    r->value = value;
    return (PyObject *)r;
}

/* __aenter__(self): self.__enter__() (the C method above, or a subclass's), awaited at once.
   self: borrowed. Returns a new reference. */
static PyObject *tracer_aenter(PyObject *self, PyObject *unused) {
    return ready_new(PyObject_CallMethodNoArgs(self, s_dunder_enter));
}

/* __aexit__(self, exc_type, exc, tb): self.__exit__(...), awaited at once. A raised error
   leaves here directly (as from a synchronous __exit__). self, args: borrowed. */
static PyObject *tracer_aexit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "__aexit__() takes exactly 3 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *argv[4] = {self, args[0], args[1], args[2]};
    return ready_new(PyObject_VectorcallMethod(s_dunder_exit, argv, 4, NULL));
}

static PyMethodDef tracer_enter_def = {"__enter__", (PyCFunction)tracer_enter, METH_NOARGS,
    "__enter__($self, /)\n--\n\nCapture (memoised) and arm the skip of this with block's body."};
static PyMethodDef tracer_exit_def = {"__exit__", (PyCFunction)(void (*)(void))tracer_exit,
    METH_FASTCALL, "__exit__($self, exc_type, exc, tb, /)\n--\n\n"
    "Disarm the skip; run the backend; raise its errors without interlace's frames."};
static PyMethodDef tracer_aenter_def = {"__aenter__", (PyCFunction)tracer_aenter, METH_NOARGS,
    "__aenter__($self, /)\n--\n\n__enter__ for `async with`: returns a done awaitable."};
static PyMethodDef tracer_aexit_def = {"__aexit__", (PyCFunction)(void (*)(void))tracer_aexit,
    METH_FASTCALL, "__aexit__($self, exc_type, exc, tb, /)\n--\n\n"
    "__exit__ for `async with`: returns a done awaitable."};

PyObject *ilc_tracer_methods(PyObject *type, PyObject *enter, PyObject *exit_, PyObject *clean,
                             PyObject *current, PyObject *default_backend) {
    if (TracerBaseType == NULL || !PyType_Check(type)
            || !PyType_IsSubtype((PyTypeObject *)type, TracerBaseType)) {
        PyErr_SetString(PyExc_TypeError, "tracer_methods(): the class must derive from TracerBase");
        return NULL;
    }
    if (!PyContextVar_CheckExact(current) || !PyCallable_Check(clean)
            || !PyCallable_Check(enter) || !PyCallable_Check(exit_)) {
        PyErr_SetString(PyExc_TypeError, "tracer_methods(): unexpected argument types");
        return NULL;
    }
    if (PyType_Ready(&ReadyType) < 0) return NULL;
    if (s_dunder_enter == NULL && (s_dunder_enter = PyUnicode_InternFromString("__enter__")) == NULL) return NULL;
    if (s_dunder_exit == NULL && (s_dunder_exit = PyUnicode_InternFromString("__exit__")) == NULL) return NULL;
    if (s_dunder_call == NULL && (s_dunder_call = PyUnicode_InternFromString("__call__")) == NULL) return NULL;
    Py_INCREF(enter); Py_XSETREF(tr_enter, enter);
    Py_INCREF(exit_); Py_XSETREF(tr_exit, exit_);
    Py_INCREF(clean); Py_XSETREF(tr_clean, clean);
    Py_INCREF(current); Py_XSETREF(tr_current, current);
    Py_INCREF(default_backend); Py_XSETREF(tr_default_backend, default_backend);
    PyMethodDef *defs[4] = {&tracer_enter_def, &tracer_exit_def, &tracer_aenter_def, &tracer_aexit_def};
    PyObject *out = PyTuple_New(4);
    if (out == NULL) return NULL;
    for (int k = 0; k < 4; k++) {
        PyObject *m = PyDescr_NewMethod((PyTypeObject *)type, defs[k]);
        if (m == NULL) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, k, m);                    /* steals */
    }
    return out;
}

/* ------------------------------------------- a trace's per-trace steps (all) ---- *
 * What every warm trace does besides enter/exit, in C so that none of it runs a Python
 * frame: the save state (TraceState), making it current while a body runs (enter_body /
 * exit_body), a deferred body (DeferredBase's fields, Tracer.defer, DeferredBody.run),
 * writing the results back (Tracer.push_result) and `.save()` on an object. Mechanism only:
 * each C method serves the usual case and calls the Python policy it was given, with the
 * same arguments, for anything else (a namespace or globals of the caller's own, a Block
 * whose body function is not compiled yet, an error to word, `.save()` outside a trace). */

#include "structmember.h"

static PyObject *sv_current = NULL;     /* strong: the trace-state ContextVar */
static PyObject *sv_running = NULL;     /* strong: the list of tokens of running bodies */
static PyObject *sv_mount = NULL;       /* strong: the mount's state class (`importing`) */
static PyObject *sv_on_enter = NULL;    /* strong: Python on_enter(): mount `.save()` */
static PyObject *sv_on_exit = NULL;     /* strong: Python on_exit(): an import runs, resync */
static PyObject *sv_descriptor = NULL;  /* strong: what `object.save` is when ours is on */
static PyObject *s_importing = NULL, *s_save = NULL, *s_names = NULL, *s_assigned = NULL,
                *s_last_function = NULL, *s_block = NULL, *s_saved = NULL,   /* interned */
                *s_last_generator = NULL;
static PyObject *dm_defer = NULL, *dm_push = NULL, *dm_run = NULL;  /* strong: the policies */
static PyObject *dm_generator = NULL;                               /* strong: the policy */
static PyObject *dm_cls = NULL;         /* strong: the DeferredBody class defer makes */
static PyObject *dm_locals = NULL;      /* strong: the body function's hidden parameter */
static PyObject *os_save = NULL;        /* strong: Python `.save()` outside a trace */

static int intern(PyObject **slot, const char *text) {
    if (*slot == NULL && (*slot = PyUnicode_InternFromString(text)) == NULL) return -1;
    return 0;
}

/* -- TraceState: one trace's save set (id -> object) and nesting depth -- */

typedef struct {
    PyObject_HEAD
    PyObject *saved;          /* the outermost trace's dict id -> object */
    PyObject *parent;         /* the enclosing trace's state, or NULL */
    Py_ssize_t depth;         /* 0 at top level */
} TraceStateObject;

static PyTypeObject *TraceStateType = NULL;   /* strong */

/* A new TraceState under `parent` (borrowed; NULL or None: top level). Returns a NEW
   reference, NULL with an error set. */
static PyObject *ts_make(PyTypeObject *type, PyObject *parent) {
    if (parent == Py_None) parent = NULL;
    PyObject *saved;
    Py_ssize_t depth = 0;
    if (parent == NULL) {
        if ((saved = PyDict_New()) == NULL) return NULL;
    } else if (PyObject_TypeCheck(parent, TraceStateType)) {
        saved = Py_NewRef(((TraceStateObject *)parent)->saved);
        depth = ((TraceStateObject *)parent)->depth + 1;
    } else {
        PyErr_Format(PyExc_TypeError, "TraceState(parent): parent must be a TraceState or None, not %.100s",
                     Py_TYPE(parent)->tp_name);
        return NULL;
    }
    TraceStateObject *s = (TraceStateObject *)type->tp_alloc(type, 0);
    if (s == NULL) { Py_DECREF(saved); return NULL; }
    s->saved = saved;
    s->parent = Py_XNewRef(parent);
    s->depth = depth;
    return (PyObject *)s;
}

static PyObject *ts_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"parent", NULL};
    PyObject *parent;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:TraceState", kwlist, &parent)) return NULL;
    return ts_make(type, parent);
}

static int ts_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(((TraceStateObject *)self)->saved);
    Py_VISIT(((TraceStateObject *)self)->parent);
    return 0;
}

static int ts_clear(PyObject *self) {
    Py_CLEAR(((TraceStateObject *)self)->saved);
    Py_CLEAR(((TraceStateObject *)self)->parent);
    return 0;
}

static void ts_dealloc(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    ts_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

/* __reduce__: (type(self), (None,), (saved, parent, depth)), for copy and pickle. */
static PyObject *ts_reduce(PyObject *self, PyObject *unused) {
    TraceStateObject *s = (TraceStateObject *)self;
    return Py_BuildValue("(O(O)(OOn))", (PyObject *)Py_TYPE(self), Py_None, s->saved,
                         s->parent != NULL ? s->parent : Py_None, s->depth);
}

/* __setstate__((saved, parent, depth)) */
static PyObject *ts_setstate(PyObject *self, PyObject *state) {
    TraceStateObject *s = (TraceStateObject *)self;
    PyObject *saved, *parent;
    Py_ssize_t depth;
    if (!PyArg_ParseTuple(state, "OOn:__setstate__", &saved, &parent, &depth)) return NULL;
    Py_INCREF(saved);
    Py_XSETREF(s->saved, saved);
    Py_XSETREF(s->parent, parent == Py_None ? NULL : Py_NewRef(parent));
    s->depth = depth;
    Py_RETURN_NONE;
}

static PyMethodDef ts_methods[] = {
    {"__reduce__", ts_reduce, METH_NOARGS, NULL},
    {"__setstate__", ts_setstate, METH_O, NULL},
    {NULL},
};

static PyMemberDef ts_members[] = {
    {"saved", T_OBJECT, offsetof(TraceStateObject, saved), 0, "id -> object: the values saved (shared by nested traces)"},
    {"parent", T_OBJECT, offsetof(TraceStateObject, parent), 0, "the enclosing trace's state, or None"},
    {"depth", T_PYSSIZET, offsetof(TraceStateObject, depth), 0, "how deep this trace is nested (0: top level)"},
    {NULL},
};

static PyType_Slot ts_slots[] = {
    {Py_tp_new, ts_new},
    {Py_tp_traverse, ts_traverse},
    {Py_tp_clear, ts_clear},
    {Py_tp_dealloc, ts_dealloc},
    {Py_tp_members, ts_members},
    {Py_tp_methods, ts_methods},
    {Py_tp_doc, "TraceState(parent)\n--\n\nOne trace's save set (`saved`: id -> object, shared "
                "with the enclosing traces) and nesting `depth`."},
    {0, NULL},
};

static PyType_Spec ts_spec = {
    .name = "interlace._cframes.TraceState",
    .basicsize = sizeof(TraceStateObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = ts_slots,
};

PyObject *ilc_trace_state_type(void) {
    if (TraceStateType == NULL && (TraceStateType = (PyTypeObject *)PyType_FromSpec(&ts_spec)) == NULL)
        return NULL;
    return Py_NewRef((PyObject *)TraceStateType);
}

/* `t`'s TraceState, made (under its `parent`) and kept on first use. t: borrowed. Returns
   a BORROWED reference, NULL with an error set. */
static PyObject *tracer_state(TracerBaseObject *t) {
    if (t->state == NULL) t->state = ts_make(TraceStateType, t->parent);
    return t->state;
}

/* -- enter_body / exit_body: a state current while a body runs, `.save()` mounted -- */

/* Whether an import runs now (the mount's `importing` count). Never fails. */
static inline int importing(void) {
    PyObject *n = _PyType_Lookup((PyTypeObject *)sv_mount, s_importing);   /* borrowed */
    if (n == NULL) return 0;
    int r = PyObject_IsTrue(n);
    if (r < 0) { PyErr_Clear(); return 1; }         /* (an int: never) */
    return r;
}

static PyObject *enter_body(PyObject *state) {
    PyObject *token = PyContextVar_Set(sv_current, state);
    if (token == NULL) return NULL;
    if (PyList_Append(sv_running, token) < 0) goto undo_set;
    /* Checked after registering this body: an import starting now sees it (and keeps ours on). */
    if (importing() || _PyType_Lookup(&PyBaseObject_Type, s_save) != sv_descriptor) {
        PyObject *r = PyObject_CallNoArgs(sv_on_enter);
        if (r == NULL) {
            Py_ssize_t n = PyList_GET_SIZE(sv_running);
            if (n > 0 && PyList_GET_ITEM(sv_running, n - 1) == token)
                PyList_SetSlice(sv_running, n - 1, n, NULL);
            goto undo_set;
        }
        Py_DECREF(r);
    }
    return token;
undo_set:
    {
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        if (PyContextVar_Reset(sv_current, token) < 0) PyErr_Clear();
        PyErr_Restore(et, ev, etb);
    }
    Py_DECREF(token);
    return NULL;
}

/* Undo enter_body (same context). token: borrowed. Returns 0, -1 with an error set. */
static int exit_body(PyObject *token) {
    Py_ssize_t k = PyList_GET_SIZE(sv_running);
    while (--k >= 0 && PyList_GET_ITEM(sv_running, k) != token) {}
    int result = 0;
    if (k < 0) {
        PyErr_SetString(PyExc_ValueError, "exit_body(): this token's body is not running");
        result = -1;
    } else if (PyList_SetSlice(sv_running, k, k + 1, NULL) < 0) {
        result = -1;
    } else if (importing()) {
        PyObject *r = PyObject_CallNoArgs(sv_on_exit);
        if (r == NULL) result = -1;
        Py_XDECREF(r);
    }
    if (result < 0) {
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        if (PyContextVar_Reset(sv_current, token) < 0) PyErr_Clear();
        PyErr_Restore(et, ev, etb);
        return -1;
    }
    return PyContextVar_Reset(sv_current, token);
}

static PyObject *py_enter_body(PyObject *module, PyObject *state) {
    if (sv_current == NULL) { PyErr_SetString(PyExc_RuntimeError, "enter_body() before save_hooks()"); return NULL; }
    return enter_body(state);
}

static PyObject *py_exit_body(PyObject *module, PyObject *token) {
    if (sv_current == NULL) { PyErr_SetString(PyExc_RuntimeError, "exit_body() before save_hooks()"); return NULL; }
    if (exit_body(token) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef enter_body_def = {"enter_body", (PyCFunction)py_enter_body, METH_O,
    "enter_body(state, /)\n--\n\nMake `state` the current trace here, with `.save()` mounted; a token for exit_body."};
static PyMethodDef exit_body_def = {"exit_body", (PyCFunction)py_exit_body, METH_O,
    "exit_body(token, /)\n--\n\nUndo enter_body (same context)."};

PyObject *ilc_save_hooks(PyObject *current, PyObject *running, PyObject *mount, PyObject *descriptor,
                         PyObject *on_enter, PyObject *on_exit) {
    if (!PyContextVar_CheckExact(current) || !PyList_CheckExact(running) || !PyType_Check(mount)
            || !PyCallable_Check(on_enter) || !PyCallable_Check(on_exit)) {
        PyErr_SetString(PyExc_TypeError, "save_hooks(): unexpected argument types");
        return NULL;
    }
    if (intern(&s_importing, "importing") < 0 || intern(&s_save, "save") < 0) return NULL;
    Py_INCREF(current); Py_XSETREF(sv_current, current);
    Py_INCREF(running); Py_XSETREF(sv_running, running);
    Py_INCREF(mount); Py_XSETREF(sv_mount, mount);
    Py_INCREF(descriptor); Py_XSETREF(sv_descriptor, descriptor);
    Py_INCREF(on_enter); Py_XSETREF(sv_on_enter, on_enter);
    Py_INCREF(on_exit); Py_XSETREF(sv_on_exit, on_exit);
    PyObject *enter = PyCFunction_New(&enter_body_def, NULL);
    PyObject *exit_ = enter != NULL ? PyCFunction_New(&exit_body_def, NULL) : NULL;
    if (exit_ == NULL) { Py_XDECREF(enter); return NULL; }
    return Py_BuildValue("(NN)", enter, exit_);
}

/* -- a Block's attributes, read by slot offset: the warm steps read three per trace -- */

/* Block is a Python class with __slots__: each attribute is a member descriptor at a fixed
   offset. The offsets are learned from the descriptors found on the type (and learned again
   when the type, or its version tag, changes), so a read is a load, not a generic lookup. */
enum { BA_NAMES, BA_ASSIGNED, BA_LAST, BA_LAST_GENERATOR, BA_N };
static PyTypeObject *ba_type = NULL;          /* borrowed: compared by identity only */
static unsigned int ba_version = 0;
static Py_ssize_t ba_offset[BA_N];            /* 0: not a plain object slot, look it up */

static PyObject *ba_name(int which) {
    return which == BA_NAMES ? s_names : which == BA_ASSIGNED ? s_assigned
           : which == BA_LAST ? s_last_function : s_last_generator;
}

/* block.<which> as a NEW reference, NULL with an error set. block: borrowed. */
static PyObject *block_attr(PyObject *block, int which) {
    PyTypeObject *type = Py_TYPE(block);
    if (type != ba_type || type->tp_version_tag != ba_version
            || !(type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) {
        ba_type = NULL;
        for (int k = 0; k < BA_N; k++) {
            PyObject *descr = _PyType_Lookup(type, ba_name(k));   /* borrowed */
            ba_offset[k] = 0;
            if (descr != NULL && Py_TYPE(descr) == &PyMemberDescr_Type) {
                PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
                if (m->type == T_OBJECT_EX && !(m->flags & READ_RESTRICTED)) ba_offset[k] = m->offset;
            }
        }
        if (type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) {   /* (_PyType_Lookup assigned one) */
            ba_type = type;
            ba_version = type->tp_version_tag;
        }
    }
    if (ba_offset[which] > 0) {
        PyObject *value = *(PyObject **)((char *)block + ba_offset[which]);
        if (value != NULL) return Py_NewRef(value);
    }
    return PyObject_GetAttr(block, ba_name(which));   /* unset: its AttributeError */
}

/* -- DeferredBase: a deferred body's fields -- */

typedef struct {
    PyObject_HEAD
    PyObject *tracer, *block, *namespace, *globals, *state;
    PyObject *params;         /* the body function's parameters: names of `namespace` it mentions */
    PyObject *code;           /* the code object the latest run executes (to find its frame) */
    PyObject *entry;          /* the namespace the latest run started from */
} DeferredObject;

static PyTypeObject *DeferredType = NULL;   /* strong */
#define DB(o) ((DeferredObject *)(o))

/* tuple(name for name in block.names if name in namespace). All borrowed; a NEW reference. */
static PyObject *params_of(PyObject *block, PyObject *namespace) {
    PyObject *names = block_attr(block, BA_NAMES);
    if (names == NULL) return NULL;
    PyObject *list = PyList_New(0), *out = NULL, *iter = NULL, *name;
    if (list == NULL || (iter = PyObject_GetIter(names)) == NULL) goto done;
    while ((name = PyIter_Next(iter)) != NULL) {
        int has = PySequence_Contains(namespace, name);
        if (has > 0) has = PyList_Append(list, name) < 0 ? -1 : 1;
        Py_DECREF(name);
        if (has < 0) goto done;
    }
    if (!PyErr_Occurred()) out = PyList_AsTuple(list);
done:
    Py_XDECREF(iter);
    Py_XDECREF(list);
    Py_DECREF(names);
    return out;
}

/* __init__(self, tracer, namespace, globals_, state, _params=None) */
static int db_init(PyObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tracer", "namespace", "globals_", "state", "_params", NULL};
    PyObject *tracer, *namespace, *globals, *state, *params = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|O:DeferredBody", kwlist,
                                     &tracer, &namespace, &globals, &state, &params)) return -1;
    PyObject *block = PyObject_GetAttr(tracer, s_block);
    if (block == NULL) return -1;
    if (params == Py_None) {
        if ((params = params_of(block, namespace)) == NULL) { Py_DECREF(block); return -1; }
    } else {
        Py_INCREF(params);
    }
    DeferredObject *d = DB(self);
    PyObject *old[8] = {d->tracer, d->block, d->namespace, d->globals, d->state, d->params, d->code, d->entry};
    d->tracer = Py_NewRef(tracer);
    d->block = block;
    d->namespace = Py_NewRef(namespace);
    d->globals = globals == Py_None ? NULL : Py_NewRef(globals);
    d->state = Py_NewRef(state);
    d->params = params;
    d->code = d->entry = NULL;
    for (int k = 0; k < 8; k++) Py_XDECREF(old[k]);
    return 0;
}

static int db_traverse(PyObject *self, visitproc visit, void *arg) {
    DeferredObject *d = DB(self);
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(d->tracer); Py_VISIT(d->block); Py_VISIT(d->namespace); Py_VISIT(d->globals);
    Py_VISIT(d->state); Py_VISIT(d->params); Py_VISIT(d->code); Py_VISIT(d->entry);
    return 0;
}

static int db_clear(PyObject *self) {
    DeferredObject *d = DB(self);
    Py_CLEAR(d->tracer); Py_CLEAR(d->block); Py_CLEAR(d->namespace); Py_CLEAR(d->globals);
    Py_CLEAR(d->state); Py_CLEAR(d->params); Py_CLEAR(d->code); Py_CLEAR(d->entry);
    return 0;
}

static void db_dealloc(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    db_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyMemberDef db_members[] = {
    {"tracer", T_OBJECT, offsetof(DeferredObject, tracer), 0, "the tracer whose body this is"},
    {"block", T_OBJECT, offsetof(DeferredObject, block), 0, "the captured Block"},
    {"namespace", T_OBJECT, offsetof(DeferredObject, namespace), 0, "the caller's names the body uses, bound at defer()"},
    {"globals", T_OBJECT, offsetof(DeferredObject, globals), 0, "the caller's module globals (None: rebuilt from a pickle)"},
    {"state", T_OBJECT, offsetof(DeferredObject, state), 0, "the TraceState save() marks into while the body runs"},
    {"_params", T_OBJECT, offsetof(DeferredObject, params), 0, "the body function's parameters"},
    {"_code", T_OBJECT, offsetof(DeferredObject, code), 0, "the code object the latest run executes"},
    {"_entry", T_OBJECT, offsetof(DeferredObject, entry), 0, "the namespace the latest run started from"},
    {NULL},
};

static PyType_Slot db_slots[] = {
    {Py_tp_init, db_init},
    {Py_tp_traverse, db_traverse},
    {Py_tp_clear, db_clear},
    {Py_tp_dealloc, db_dealloc},
    {Py_tp_members, db_members},
    {Py_tp_doc, "A deferred body's fields (C fields the C run and defer read by offset)."},
    {0, NULL},
};

static PyType_Spec db_spec = {
    .name = "interlace._cframes.DeferredBase",
    .basicsize = sizeof(DeferredObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = db_slots,
};

PyObject *ilc_deferred_base(void) {
    if (intern(&s_names, "names") < 0 || intern(&s_block, "block") < 0
            || intern(&s_assigned, "assigned_names") < 0 || intern(&s_last_function, "last_function") < 0)
        return NULL;
    if (DeferredType == NULL) {
        PyObject *bases = PyTuple_Pack(1, (PyObject *)&PyBaseObject_Type);
        if (bases == NULL) return NULL;
        DeferredType = (PyTypeObject *)PyType_FromSpecWithBases(&db_spec, bases);
        Py_DECREF(bases);
        if (DeferredType == NULL) return NULL;
    }
    return Py_NewRef((PyObject *)DeferredType);
}

/* -- the C methods: Tracer.defer, Tracer.push_result, DeferredBody.run -- */

/* policy(self, *args, **kwargs) for a vectorcall's arguments. All borrowed. */
static PyObject *call_policy(PyObject *policy, PyObject *self, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t total = nargs + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8];
    PyObject **argv = total < 8 ? small : PyMem_New(PyObject *, total + 1);
    if (argv == NULL) return PyErr_NoMemory();
    argv[0] = self;
    for (Py_ssize_t k = 0; k < total; k++) argv[k + 1] = args[k];
    PyObject *r = PyObject_Vectorcall(policy, argv, (size_t)nargs + 1, kwnames);
    if (argv != small) PyMem_Free(argv);
    return r;
}

static PyObject *frame_globals(PyObject *frame) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetGlobals((PyFrameObject *)frame);
#else
    return Py_NewRef(((PyFrameObject *)frame)->f_globals);
#endif
}

/* Tracer.defer(self, namespace=None, *, state=None): a plain `defer()` of a tracer whose
   __exit__ runs binds the caller's names here; the rest is the policy's. */
static PyObject *m_defer(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    TracerBaseObject *t = TB(self);
    if (nargs != 0 || kwnames != NULL || t->block == NULL || t->frame == NULL
            || !PyType_IsSubtype((PyTypeObject *)dm_cls, DeferredType))
        return call_policy(dm_defer, self, args, nargs, kwnames);
    PyObject *names = block_attr(t->block, BA_NAMES);
    if (names == NULL) return NULL;
    if (!PyTuple_Check(names)) { Py_DECREF(names); return call_policy(dm_defer, self, args, nargs, kwnames); }
    PyObject *namespace = NULL, *params = NULL, *globals = NULL, *state;
    DeferredObject *d = NULL;
    if ((namespace = ilc_bind(t->frame, names)) == NULL) goto error;
    /* in `names` order: the body function's parameters as they are (all bound: names itself) */
    Py_ssize_t bound = PyDict_GET_SIZE(namespace);
    if (bound == PyTuple_GET_SIZE(names)) {
        params = Py_NewRef(names);
    } else if ((params = PyTuple_New(bound)) != NULL) {   /* the keys, in `names` order */
        Py_ssize_t pos = 0, k = 0;
        PyObject *key, *value;
        while (PyDict_Next(namespace, &pos, &key, &value)) PyTuple_SET_ITEM(params, k++, Py_NewRef(key));
    }
    if (params == NULL || (globals = frame_globals(t->frame)) == NULL) goto error;
    if ((state = tracer_state(t)) == NULL) goto error;
    d = (DeferredObject *)((PyTypeObject *)dm_cls)->tp_alloc((PyTypeObject *)dm_cls, 0);
    if (d == NULL) goto error;
    d->tracer = Py_NewRef(self);
    d->block = Py_NewRef(t->block);
    d->namespace = namespace;
    d->globals = globals;
    d->state = Py_NewRef(state);
    d->params = params;
    Py_DECREF(names);
    return (PyObject *)d;
error:
    Py_XDECREF(namespace);
    Py_XDECREF(params);
    Py_XDECREF(globals);
    Py_DECREF(names);
    return NULL;
}

/* Tracer.push_result(self, values): the results into the caller (all of them when nested,
   else the saved ones). */
static PyObject *m_push(PyObject *self, PyObject *values) {
    TracerBaseObject *t = TB(self);
    if (t->block == NULL) return call_policy(dm_push, self, &values, 1, NULL);
    PyObject *state = tracer_state(t);
    if (state == NULL) return NULL;
    if (!PyObject_TypeCheck(state, TraceStateType)) return call_policy(dm_push, self, &values, 1, NULL);
    TraceStateObject *s = (TraceStateObject *)state;
    PyObject *names = block_attr(t->block, BA_ASSIGNED);
    if (names == NULL) return NULL;
    PyObject *out = ilc_pick(values, names, s->depth ? Py_None : s->saved);
    Py_DECREF(names);
    if (out == NULL) return NULL;
    int r = PyDict_GET_SIZE(out) && t->frame != NULL ? ilc_write_back(t->frame, out) : 0;
    Py_DECREF(out);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

/* The function a warm site keeps on `d`'s Block (`which`: BA_LAST, `last_function`, or
   BA_LAST_GENERATOR, `last_generator`: (params, globals, function)) for `d`'s params and
   globals, as a NEW reference, with `d`'s code and entry set for the run about to start;
   NULL with no error when it keeps none for them (the policy's case), NULL with an error
   set on failure (`*failed`). */
static PyObject *warm_function(DeferredObject *d, int which, int *failed) {
    *failed = 1;
    PyObject *last = block_attr(d->block, which);
    if (last == NULL) return NULL;
    PyObject *function = NULL;
    if (PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 3 && PyTuple_GET_ITEM(last, 1) == d->globals) {
        PyObject *params = PyTuple_GET_ITEM(last, 0);
        int same = params == d->params ? 1 : PyObject_RichCompareBool(params, d->params, Py_EQ);
        if (same < 0) { Py_DECREF(last); return NULL; }
        if (same && PyFunction_Check(PyTuple_GET_ITEM(last, 2))) function = Py_NewRef(PyTuple_GET_ITEM(last, 2));
    }
    Py_DECREF(last);
    *failed = 0;
    if (function != NULL) {
        Py_XSETREF(d->code, Py_NewRef(PyFunction_GET_CODE(function)));
        Py_XSETREF(d->entry, Py_NewRef(d->namespace));
    }
    return function;
}

/* DeferredBody.generator(self): a site whose previous start left its generator function on
   the Block (`last_generator`) starts the body here (its generator made, not run); the rest
   is the policy's. */
static PyObject *m_generator(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    DeferredObject *d = DB(self);
    if (nargs != 0 || kwnames != NULL || d->globals == NULL || d->block == NULL
            || d->params == NULL || d->namespace == NULL)
        return call_policy(dm_generator, self, args, nargs, kwnames);
    int failed;
    PyObject *function = warm_function(d, BA_LAST_GENERATOR, &failed);
    if (function == NULL) return failed ? NULL : call_policy(dm_generator, self, args, nargs, kwnames);
    PyObject *namespace = Py_NewRef(d->namespace), *params = Py_NewRef(d->params);
    PyObject *gen = ilc_call_bound(function, namespace, params);
    Py_DECREF(function);
    Py_DECREF(namespace);
    Py_DECREF(params);
    return gen;
}

static PyMethodDef generator_def = {"generator", (PyCFunction)(void (*)(void))m_generator,
    METH_FASTCALL | METH_KEYWORDS, "generator($self)\n--\n\n"
    "The body as a generator, started by the first send(None); it returns its final locals."};

PyObject *ilc_generator_method(PyObject *deferred_cls, PyObject *generator) {
    if (DeferredType == NULL || !PyType_Check(deferred_cls)
            || !PyType_IsSubtype((PyTypeObject *)deferred_cls, DeferredType) || !PyCallable_Check(generator)) {
        PyErr_SetString(PyExc_TypeError, "generator_method(): the class must derive from DeferredBase, "
                        "and the policy be callable");
        return NULL;
    }
    if (intern(&s_names, "names") < 0 || intern(&s_assigned, "assigned_names") < 0
            || intern(&s_last_function, "last_function") < 0
            || intern(&s_last_generator, "last_generator") < 0) return NULL;
    Py_INCREF(generator); Py_XSETREF(dm_generator, generator);
    return PyDescr_NewMethod(DeferredType, &generator_def);
}

/* DeferredBody.run(self, namespace=None, globals=None, *, reads_as_globals=False): a plain
   `run()` whose body function the site's previous run left (Block.last_function) runs here;
   the rest is the policy's. */
static PyObject *m_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    DeferredObject *d = DB(self);
    if (nargs != 0 || kwnames != NULL || d->globals == NULL || d->block == NULL
            || d->params == NULL || d->namespace == NULL || d->state == NULL)
        return call_policy(dm_run, self, args, nargs, kwnames);
    int failed;
    PyObject *function = warm_function(d, BA_LAST, &failed);
    if (function == NULL) return failed ? NULL : call_policy(dm_run, self, args, nargs, kwnames);
    PyObject *namespace = Py_NewRef(d->namespace), *params = Py_NewRef(d->params);
    PyObject *token = enter_body(d->state);            /* also mounts `.save()` */
    PyObject *result = NULL;
    if (token != NULL) {
        result = ilc_call_bound(function, namespace, params);
        if (result == NULL) {
            PyObject *et, *ev, *etb;
            PyErr_Fetch(&et, &ev, &etb);
            if (exit_body(token) < 0) {                /* its error wins, as in a finally */
                Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(etb);
            } else {
                PyErr_Restore(et, ev, etb);
            }
        } else if (exit_body(token) < 0) {
            Py_CLEAR(result);
        }
        Py_DECREF(token);
    }
    Py_DECREF(function);
    Py_DECREF(namespace);
    Py_DECREF(params);
    if (result != NULL && (PyDict_CheckExact(result) ? PyDict_DelItem(result, dm_locals)
                           : PyObject_DelItem(result, dm_locals)) < 0)
        Py_CLEAR(result);
    return result;
}

static PyMethodDef defer_def = {"defer", (PyCFunction)(void (*)(void))m_defer,
    METH_FASTCALL | METH_KEYWORDS, "defer($self, namespace=None, *, state=None)\n--\n\n"
    "A DeferredBody: the body to run later, anywhere (see interlace.tracing.deferred)."};
static PyMethodDef push_def = {"push_result", (PyCFunction)m_push, METH_O,
    "push_result($self, values, /)\n--\n\n"
    "Write the body's results into the caller: all of them when nested, else the saved."};
static PyMethodDef run_def = {"run", (PyCFunction)(void (*)(void))m_run,
    METH_FASTCALL | METH_KEYWORDS, "run($self, namespace=None, globals=None, *, reads_as_globals=False)\n--\n\n"
    "Run the body now, in this trace's save state, from any greenlet or thread; its final locals."};

PyObject *ilc_deferred_methods(PyObject *tracer_cls, PyObject *deferred_cls, PyObject *defer,
                               PyObject *push, PyObject *run, PyObject *locals_param) {
    if (TracerBaseType == NULL || DeferredType == NULL || TraceStateType == NULL
            || !PyType_Check(tracer_cls) || !PyType_IsSubtype((PyTypeObject *)tracer_cls, TracerBaseType)
            || !PyType_Check(deferred_cls) || !PyType_IsSubtype((PyTypeObject *)deferred_cls, DeferredType)) {
        PyErr_SetString(PyExc_TypeError, "deferred_methods(): the classes must derive from TracerBase "
                        "and DeferredBase (and TraceState be made)");
        return NULL;
    }
    if (sv_current == NULL) { PyErr_SetString(PyExc_RuntimeError, "deferred_methods() before save_hooks()"); return NULL; }
    if (!PyCallable_Check(defer) || !PyCallable_Check(push) || !PyCallable_Check(run) || !PyUnicode_Check(locals_param)) {
        PyErr_SetString(PyExc_TypeError, "deferred_methods(): unexpected argument types");
        return NULL;
    }
    if (intern(&s_names, "names") < 0 || intern(&s_assigned, "assigned_names") < 0
            || intern(&s_last_function, "last_function") < 0) return NULL;
    Py_INCREF(deferred_cls); Py_XSETREF(dm_cls, deferred_cls);
    Py_INCREF(defer); Py_XSETREF(dm_defer, defer);
    Py_INCREF(push); Py_XSETREF(dm_push, push);
    Py_INCREF(run); Py_XSETREF(dm_run, run);
    Py_INCREF(locals_param); Py_XSETREF(dm_locals, locals_param);
    PyObject *a = PyDescr_NewMethod(TracerBaseType, &defer_def);
    PyObject *b = a != NULL ? PyDescr_NewMethod(TracerBaseType, &push_def) : NULL;
    PyObject *c = b != NULL ? PyDescr_NewMethod(DeferredType, &run_def) : NULL;
    if (c == NULL) { Py_XDECREF(a); Py_XDECREF(b); return NULL; }
    return Py_BuildValue("(NNN)", a, b, c);
}

/* -- `.save()` on every object: a C descriptor whose bound method marks in C -- */

typedef struct {
    PyObject_HEAD
    PyObject *policy;         /* strong: the Python descriptor, for classes, modules, None... */
} ObjectSaveObject;

/* Mark `value` in the current trace's save set and return it (a NEW reference); outside a
   trace, `fallback(value)` (the Python `save`: a `save` we displaced, or the error). */
static PyObject *mark_saved(PyObject *value, PyObject *fallback) {
    PyObject *state;
    if (sv_current == NULL) return PyObject_CallOneArg(fallback, value);   /* (before save_hooks) */
    if (PyContextVar_Get(sv_current, NULL, &state) < 0) return NULL;
    if (state == NULL || state == Py_None) {
        Py_XDECREF(state);
        return PyObject_CallOneArg(fallback, value);
    }
    PyObject *saved = PyObject_TypeCheck(state, TraceStateType) ? Py_NewRef(((TraceStateObject *)state)->saved)
                      : PyObject_GetAttr(state, s_saved);
    Py_DECREF(state);
    if (saved == NULL) return NULL;
    PyObject *key = PyLong_FromVoidPtr(value);
    int r = key == NULL ? -1 : PyObject_SetItem(saved, key, value);
    Py_XDECREF(key);
    Py_DECREF(saved);
    return r < 0 ? NULL : Py_NewRef(value);
}

/* value.save(): `mark_saved`, outside a trace the Python `.save()`. value: borrowed. */
static PyObject *os_call(PyObject *value, PyObject *unused) {
    return mark_saved(value, os_save);
}

static PyMethodDef os_def = {"save", (PyCFunction)os_call, METH_NOARGS,
    "save($self, /)\n--\n\nMark this object to be kept after the trace (see interlace.save); returns it."};

/* __get__: an instance (not a class, not a module) gets the C bound method; the rest is the
   Python descriptor's (a class sees a plain function, a module has none, `None.save`...). */
static PyObject *os_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj != NULL && !PyType_Check(obj) && !PyModule_Check(obj))
        return PyCFunction_New(&os_def, obj);
    PyObject *policy = ((ObjectSaveObject *)self)->policy;
    descrgetfunc get = Py_TYPE(policy)->tp_descr_get;
    if (get == NULL) return Py_NewRef(policy);
    return get(policy, obj, type);
}

static PyObject *os_repr(PyObject *self) {
    return PyObject_Repr(((ObjectSaveObject *)self)->policy);
}

static void os_dealloc(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    Py_CLEAR(((ObjectSaveObject *)self)->policy);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyType_Slot os_slots[] = {
    {Py_tp_descr_get, os_get},
    {Py_tp_repr, os_repr},
    {Py_tp_dealloc, os_dealloc},
    {Py_tp_doc, "The `save` attribute every object gets (compiled): `value.save()` marks in C."},
    {0, NULL},
};

static PyType_Spec os_spec = {
    .name = "interlace._cframes.ObjectSave",
    .basicsize = sizeof(ObjectSaveObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = os_slots,
};

static PyTypeObject *ObjectSaveType = NULL;   /* strong */

PyObject *ilc_object_save(PyObject *descriptor, PyObject *save) {
    if (TraceStateType == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "object_save() before TraceState is made");
        return NULL;
    }
    if (!PyCallable_Check(save)) { PyErr_SetString(PyExc_TypeError, "object_save(): `save` must be callable"); return NULL; }
    if (intern(&s_saved, "saved") < 0) return NULL;
    if (ObjectSaveType == NULL && (ObjectSaveType = (PyTypeObject *)PyType_FromSpec(&os_spec)) == NULL) return NULL;
    ObjectSaveObject *o = PyObject_New(ObjectSaveObject, ObjectSaveType);
    if (o == NULL) return NULL;
    o->policy = Py_NewRef(descriptor);
    Py_INCREF(save); Py_XSETREF(os_save, save);
    return (PyObject *)o;
}

/* -- `interlace.save(value)`: the same marking, as a builtin function -- */

static PyObject *fs_save = NULL;        /* strong: the Python `save(value)` it stands for */

/* save(value): `mark_saved`; any other call (a keyword, a wrong count) is the Python
   function's, which binds its arguments as written and explains. */
static PyObject *fs_call(PyObject *unused, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs != 1 || kwnames != NULL) return PyObject_Vectorcall(fs_save, args, nargs, kwnames);
    return mark_saved(args[0], fs_save);
}

static PyMethodDef fs_def = {"save", (PyCFunction)(void (*)(void))fs_call, METH_FASTCALL | METH_KEYWORDS, NULL};

PyObject *ilc_function_save(PyObject *save) {
    if (TraceStateType == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "function_save() before TraceState is made");
        return NULL;
    }
    if (!PyFunction_Check(save)) { PyErr_SetString(PyExc_TypeError, "function_save(): `save` must be a function"); return NULL; }
    if (intern(&s_saved, "saved") < 0) return NULL;
    if (fs_def.ml_doc == NULL) {   /* its signature and docstring, as the Python function's */
        PyObject *doc = PyObject_GetAttrString(save, "__doc__");
        if (doc == NULL) return NULL;
        const char *text = doc != Py_None ? PyUnicode_AsUTF8(doc) : "";
        PyObject *full = text != NULL ? PyUnicode_FromFormat("save(value)\n--\n\n%s", text) : NULL;
        Py_DECREF(doc);
        if (full == NULL) return NULL;
        const char *utf8 = PyUnicode_AsUTF8(full);
        char *kept = utf8 != NULL ? PyMem_RawMalloc(strlen(utf8) + 1) : NULL;   /* kept for the process */
        if (kept != NULL) strcpy(kept, utf8);
        Py_DECREF(full);
        if (kept == NULL) return PyErr_NoMemory();
        fs_def.ml_doc = kept;
    }
    PyObject *module = PyObject_GetAttrString(save, "__module__");
    if (module == NULL) return NULL;
    PyObject *function = PyCFunction_NewEx(&fs_def, NULL, module);
    Py_DECREF(module);
    if (function == NULL) return NULL;
    Py_INCREF(save); Py_XSETREF(fs_save, save);
    return function;
}

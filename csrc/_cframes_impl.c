/* interlace frame mechanism, CPython 3.10-3.13 (reads interpreter internals: no stable ABI).
 *
 * Mechanism only; every decision is made in interlace/tracing/skip.py.
 *
 *  - ilc_arm/ilc_disarm: an armed handle records (frame, body units lo..hi, exit unit, mode).
 *    3.10/3.11: the handle is also the `obj` of a one-shot C trace function installed with
 *    PyEval_SetTrace, chained to the thread's previous C trace function, which it forwards
 *    every event it does not consume to. 3.12+: the handle sits in a small table consulted
 *    by the sys.monitoring callbacks (ilc_fire).
 *  - Writing the instruction pointer only takes effect where the eval loop reloads it: after
 *    a line-trace call (3.10 f_lasti, 3.11 prev_instr) and after a sys.monitoring LINE
 *    callback (3.12 prev_instr, 3.13 instr_ptr).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyObject *SkipSignal = NULL;   /* strong, set once by ilc_init */

typedef struct {
    PyObject_HEAD
    PyObject *frame;          /* strong: keeps f_frame pointing at the live frame */
    int lo, hi, exit_unit, mode;
    int fired, live;
    Py_tracefunc prev_func;   /* 3.10/3.11: the tracer we chain to */
    PyObject *prev_obj;       /* strong */
    int saved_opcodes;        /* the frame's f_trace_opcodes before arming */
    int installed;            /* we are (or were) the thread's C trace function */
} Armed;

static void armed_dealloc(Armed *self) {
    Py_CLEAR(self->frame);
    Py_CLEAR(self->prev_obj);
    PyObject_Free(self);
}

static PyTypeObject ArmedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "interlace._cframes.Armed",
    .tp_basicsize = sizeof(Armed),
    .tp_dealloc = (destructor)armed_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An armed skip (opaque handle).",
};

int ilc_init(PyObject *skip_signal) {
    if (PyType_Ready(&ArmedType) < 0) return -1;
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

/* A new Armed record for `frame` (borrowed; the record keeps a new reference), nothing
   installed yet. Returns a new reference, or NULL with an exception set. */
static Armed *new_armed(PyObject *frame, int lo, int hi, int exit_unit, int mode) {
    if (!PyFrame_Check(frame)) { PyErr_SetString(PyExc_TypeError, "arm() needs a frame"); return NULL; }
    Armed *a = PyObject_New(Armed, &ArmedType);
    if (a == NULL) return NULL;
    Py_INCREF(frame);
    a->frame = frame;
    a->lo = lo; a->hi = hi; a->exit_unit = exit_unit; a->mode = mode;
    a->fired = 0; a->live = 1;
    a->prev_func = NULL; a->prev_obj = NULL; a->saved_opcodes = 0; a->installed = 0;
    return a;
}

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
    Armed *a = new_armed(frame, lo, hi, exit_unit, mode);
    if (a == NULL) return NULL;
    a->prev_func = tstate->c_tracefunc;
    a->prev_obj = tstate->c_traceobj;
    Py_XINCREF(a->prev_obj);
    PyFrameObject *f = (PyFrameObject *)frame;
    a->saved_opcodes = f->f_trace_opcodes;
    f->f_trace_opcodes = 1;                /* bodies on the with line get no line event */
    a->installed = 1;
    PyEval_SetTrace(oneshot_trace, (PyObject *)a);
    if (PyErr_Occurred()) { a->installed = 0; f->f_trace_opcodes = (char)a->saved_opcodes; Py_DECREF(a); return NULL; }
    return (PyObject *)a;
}

int ilc_disarm(PyObject *handle) {
    CHECK(Py_TYPE(handle) == &ArmedType, "disarm() needs an armed handle");
    Armed *a = (Armed *)handle;
    Py_INCREF(a);
    restore(a);
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
Py_ssize_t ilc_armed_count(void) { return 0; }

/* ------------------------------------------------------------------ 3.12 / 3.13 ---- */
#else

#define MAX_ARMED 256
static Armed *armed[MAX_ARMED];          /* strong references */
static Py_ssize_t n_armed = 0;

PyObject *ilc_arm(PyObject *frame, int lo, int hi, int exit_unit, int mode) {
    if (n_armed >= MAX_ARMED) {
        PyErr_SetString(PyExc_RuntimeError, "interlace: too many traces armed at once (256)");
        return NULL;
    }
    Armed *a = new_armed(frame, lo, hi, exit_unit, mode);
    if (a == NULL) return NULL;
    Py_INCREF(a);
    armed[n_armed++] = a;                  /* the table's reference */
    return (PyObject *)a;
}

static void unlink_armed(Armed *a) {
    for (Py_ssize_t k = n_armed - 1; k >= 0; k--) {
        if (armed[k] == a) {
            memmove(&armed[k], &armed[k + 1], (size_t)(n_armed - k - 1) * sizeof(Armed *));
            n_armed--;
            Py_DECREF(a);
            return;
        }
    }
}

int ilc_disarm(PyObject *handle) {
    CHECK(Py_TYPE(handle) == &ArmedType, "disarm() needs an armed handle");
    Armed *a = (Armed *)handle;
    Py_INCREF(a);
    a->live = 0;
    unlink_armed(a);
    Py_CLEAR(a->frame);
    int fired = a->fired;
    Py_DECREF(a);
    return fired;
}

int ilc_fire(void) {
    if (n_armed == 0) return 0;
    PyThreadState *tstate = PyThreadState_Get();
#if PY_VERSION_HEX >= 0x030D0000
    _PyInterpreterFrame *cur = tstate->current_frame;
#else
    _PyInterpreterFrame *cur = tstate->cframe->current_frame;
#endif
    for (Py_ssize_t k = n_armed - 1; k >= 0; k--) {
        Armed *a = armed[k];
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

Py_ssize_t ilc_armed_count(void) { return n_armed; }

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

/* ------------------------------------------------------- Tracer warm path (all) ---- *
 * Tracer.__enter__/__exit__/__aenter__/__aexit__ as C methods (no Python frame, no
 * traceback entry of ours). Mechanism only: on a warm site they look up what Python already
 * decided (the Block in BLOCKS, its SkipPlan's arm arguments) and arm/disarm exactly as
 * skip.arm/skip.disarm do, on the same thread-local stack, and call the backend. Anything
 * else (a miss, a negative verdict, a pass-only body, a subclass's __enter__ calling
 * super().__enter__(), an exception, a skip that did not fire) calls the Python methods,
 * which hold the whole policy.
 *
 * Errors: whatever leaves these methods (a refusal, a body's or a backend's error) first
 * goes through the Python `clean(error, None)`, which drops interlace's frames from its
 * traceback. `clean` returns normally, so it adds no frame; the eval loop then adds only the
 * user's frame at the `with` line: no interlace frame is left in the traceback. */

static PyObject *tr_enter = NULL;     /* strong: Python __enter__(self, frame) */
static PyObject *tr_exit = NULL;      /* strong: Python __exit__(self, t, v, tb, fired) */
static PyObject *tr_clean = NULL;     /* strong: Python clean(error, signal): drop our frames */
static PyObject *tr_blocks = NULL;    /* strong: blocks.BLOCKS (dict) */
static PyObject *tr_block_type = NULL;/* strong: blocks.Block */
static PyObject *tr_plan_type = NULL; /* strong: skip.SkipPlan */
static PyObject *tr_enter_ids = NULL; /* strong: tracer._ENTER_CODE_IDS (set) */
static PyObject *tr_local = NULL;     /* strong: skip._local (threading.local) */
static PyObject *tr_current = NULL;   /* strong: save._CURRENT (ContextVar) */
static PyObject *s_capture_key, *s_passonly, *s_skip_plan, *s_arm_args, *s_block, *s_parent,
                *s_frame, *s_plan, *s_stack, *s_state, *s_backend,
                *s_dunder_enter, *s_dunder_exit;  /* interned, strong */

/* The pending exception, its traceback cleaned of interlace's frames, still pending.
   Returns NULL (so that `return clean_pending();` propagates it). If `clean` itself fails,
   the original exception stays as it was. */
static PyObject *clean_pending(void) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *error = PyErr_GetRaisedException();      /* new reference, traceback attached */
    if (error == NULL) return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(tr_clean, error, Py_None, NULL);
    if (r == NULL) PyErr_Clear(); else Py_DECREF(r);
    PyErr_SetRaisedException(error);                   /* steals; uses error.__traceback__ */
#else
    PyObject *type, *error, *tb;
    PyErr_Fetch(&type, &error, &tb);
    PyErr_NormalizeException(&type, &error, &tb);
    if (error == NULL) { PyErr_Restore(type, error, tb); return NULL; }
    if (tb != NULL) PyException_SetTraceback(error, tb);
    PyObject *r = PyObject_CallFunctionObjArgs(tr_clean, error, Py_None, NULL);
    if (r == NULL) PyErr_Clear(); else Py_DECREF(r);
    Py_XDECREF(tb);
    tb = PyException_GetTraceback(error);              /* new reference: the cleaned one */
    PyErr_Restore(type, error, tb);                    /* steals all three */
#endif
    return NULL;
}

static inline int frame_lasti_bytes(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else
    return f->f_lasti < 0 ? -1 : f->f_lasti * (int)sizeof(_Py_CODEUNIT);
#endif
}

/* The warm path of __enter__. self, frame: borrowed. Returns 1 armed (self's fields set),
   0 not warm (nothing changed, no error), -1 with an error set. */
static int tracer_enter_warm(PyObject *self, PyFrameObject *f) {
    int result = 0, contains;
    PyObject *cid = NULL, *lasti = NULL, *ckey = NULL, *key = NULL, *entry, *block = NULL;
    PyObject *passonly = NULL, *plan = NULL, *args = NULL, *parent = NULL, *stack = NULL;
    PyObject *handle = NULL, *item = NULL;
    long a[4];
    PyCodeObject *code = PyFrame_GetCode(f);          /* new reference */
    cid = PyLong_FromVoidPtr(code);                   /* id(code); the frame keeps code alive */
    Py_DECREF(code);
    if (cid == NULL) return -1;
    contains = PySet_Contains(tr_enter_ids, cid);     /* a subclass's __enter__ frame */
    if (contains != 0) { result = contains < 0 ? -1 : 0; goto done; }
    if ((lasti = PyLong_FromLong(frame_lasti_bytes(f))) == NULL) goto error;
    if ((ckey = PyObject_GetAttr(self, s_capture_key)) == NULL) goto error;
    if ((key = PyTuple_Pack(3, cid, lasti, ckey)) == NULL) goto error;
    entry = PyDict_GetItemWithError(tr_blocks, key);  /* borrowed */
    if (entry == NULL) { if (PyErr_Occurred()) goto error; goto done; }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) < 2) goto done;
    block = PyTuple_GET_ITEM(entry, 1);
    if ((PyObject *)Py_TYPE(block) != tr_block_type) { block = NULL; goto done; }
    Py_INCREF(block);                                 /* ours: BLOCKS may change meanwhile */
    if ((passonly = PyObject_GetAttr(block, s_passonly)) == NULL) goto error;
    if (passonly != Py_False) goto done;              /* pass-only (or odd): Python's path */
    if ((plan = PyObject_GetAttr(block, s_skip_plan)) == NULL) goto error;
    if ((PyObject *)Py_TYPE(plan) != tr_plan_type) goto done;  /* None or a refusal */
    args = PyObject_GetAttr(plan, s_arm_args);        /* cached in its __dict__ by skip.arm */
    if (args == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) goto error;
        PyErr_Clear();
        goto done;
    }
    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != 4) goto done;
    for (int k = 0; k < 4; k++) {
        a[k] = PyLong_AsLong(PyTuple_GET_ITEM(args, k));
        if (a[k] == -1 && PyErr_Occurred()) goto error;
    }
    stack = PyObject_GetAttr(tr_local, s_stack);      /* this thread's armed (plan, handle) */
    if (stack == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) goto error;
        PyErr_Clear();
        goto done;                                    /* first trace on this thread */
    }
    if (!PyList_CheckExact(stack)) goto done;
    if (PyContextVar_Get(tr_current, NULL, &parent) < 0) goto error;  /* parent: new ref */
    if (parent == NULL) { parent = Py_None; Py_INCREF(parent); }
    /* the same order as the Python method: fields, then arm last (no Python code runs
       between arming and the body start) */
    if (PyObject_SetAttr(self, s_block, block) < 0) goto error;
    if (PyObject_SetAttr(self, s_parent, parent) < 0) goto error;
    if (PyObject_SetAttr(self, s_frame, (PyObject *)f) < 0) goto error;
    if (PyObject_SetAttr(self, s_plan, plan) < 0) goto error;
    if ((item = PyTuple_New(2)) == NULL) goto error;
    if ((handle = ilc_arm((PyObject *)f, (int)a[0], (int)a[1], (int)a[2], (int)a[3])) == NULL) goto error;
    Py_INCREF(plan);
    PyTuple_SET_ITEM(item, 0, plan);
    PyTuple_SET_ITEM(item, 1, handle);                /* steals handle */
    handle = NULL;
    if (PyList_Append(stack, item) < 0) goto error;
    result = 1;
    goto done;
error:
    result = -1;
done:
    Py_XDECREF(cid); Py_XDECREF(lasti); Py_XDECREF(ckey); Py_XDECREF(key);
    Py_XDECREF(passonly); Py_XDECREF(plan); Py_XDECREF(args); Py_XDECREF(stack);
    Py_XDECREF(parent); Py_XDECREF(handle); Py_XDECREF(item); Py_XDECREF(block);
    return result;
}

/* __enter__(self). self: borrowed. Returns a new reference to self (or what the Python
   method returns), NULL with an error set (its traceback cleaned). */
static PyObject *tracer_enter(PyObject *self, PyObject *unused) {
    PyFrameObject *f = PyEval_GetFrame();             /* borrowed: the caller's frame */
    if (f != NULL) {
        int warm = tracer_enter_warm(self, f);
        if (warm < 0) return clean_pending();
        if (warm == 1) { Py_INCREF(self); return self; }
    }
    PyObject *argv[2] = {self, f != NULL ? (PyObject *)f : Py_None};
    PyObject *res = PyObject_Vectorcall(tr_enter, argv, 2, NULL);
    return res != NULL ? res : clean_pending();
}

/* After a clean skip: run the backend; clear the per-run fields. self: borrowed. Returns
   a new reference to True, or NULL with the backend's error set, its traceback cleaned. */
static PyObject *tracer_finish(PyObject *self) {
    PyObject *backend = PyObject_GetAttr(self, s_backend);
    PyObject *r = backend != NULL ? PyObject_CallOneArg(backend, self) : NULL;
    Py_XDECREF(backend);
    if (r == NULL) clean_pending();
    Py_XDECREF(r);
    PyObject *names[4] = {s_frame, s_plan, s_state, s_parent};
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *error = PyErr_GetRaisedException();      /* keep it aside while clearing */
#else
    PyObject *et, *error, *etb;
    PyErr_Fetch(&et, &error, &etb);
#endif
    for (int k = 0; k < 4; k++)
        if (PyObject_SetAttr(self, names[k], Py_None) < 0) PyErr_Clear();
#if PY_VERSION_HEX >= 0x030C0000
    if (error != NULL) { PyErr_SetRaisedException(error); return NULL; }
#else
    if (et != NULL) { PyErr_Restore(et, error, etb); return NULL; }
#endif
    Py_RETURN_TRUE;
}

/* __exit__(self, exc_type, exc, tb). self, args: borrowed. Returns a new reference, NULL
   with an error set (its traceback cleaned). A clean warm exit disarms here and runs the
   backend; otherwise the Python method (told whether the skip fired) does. */
static PyObject *tracer_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *fired = NULL;
    if (nargs == 3 && args[0] == Py_None) {
        PyObject *plan = PyObject_GetAttr(self, s_plan);
        if (plan == NULL) return clean_pending();
        if (plan != Py_None) {
            PyObject *stack = PyObject_GetAttr(tr_local, s_stack);
            if (stack == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError)) { Py_DECREF(plan); return clean_pending(); }
                PyErr_Clear();
            } else {
                Py_ssize_t n = PyList_CheckExact(stack) ? PyList_GET_SIZE(stack) : 0;
                PyObject *top = n > 0 ? PyList_GET_ITEM(stack, n - 1) : NULL;
                if (top != NULL && PyTuple_CheckExact(top) && PyTuple_GET_SIZE(top) == 2
                        && PyTuple_GET_ITEM(top, 0) == plan) {
                    PyObject *handle = PyTuple_GET_ITEM(top, 1);
                    Py_INCREF(handle);
                    int popped = PyList_SetSlice(stack, n - 1, n, NULL);   /* stack.pop() */
                    int r = popped < 0 ? -1 : ilc_disarm(handle);
                    Py_DECREF(handle);
                    if (r < 0) { Py_DECREF(stack); Py_DECREF(plan); return clean_pending(); }
                    fired = r ? Py_True : Py_False;
                }
                Py_DECREF(stack);
            }
        }
        Py_DECREF(plan);
    }
    if (fired == Py_True) return tracer_finish(self);
    PyObject *res;
    if (fired != NULL) {
        PyObject *argv[5] = {self, Py_None, Py_None, Py_None, fired};
        res = PyObject_Vectorcall(tr_exit, argv, 5, NULL);
    } else if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "__exit__() takes exactly 3 arguments (%zd given)", nargs);
        return NULL;
    } else {
        PyObject *argv[4] = {self, args[0], args[1], args[2]};
        res = PyObject_Vectorcall(tr_exit, argv, 4, NULL);
    }
    return res != NULL ? res : clean_pending();
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
                             PyObject *blocks,
                             PyObject *block_type, PyObject *plan_type, PyObject *enter_ids,
                             PyObject *local, PyObject *current) {
    if (!PyType_Check(type) || !PyDict_CheckExact(blocks) || !PyType_Check(block_type)
            || !PyType_Check(plan_type) || !PyAnySet_CheckExact(enter_ids)
            || !PyContextVar_CheckExact(current) || !PyCallable_Check(clean)) {
        PyErr_SetString(PyExc_TypeError, "tracer_methods(): unexpected argument types");
        return NULL;
    }
    if (PyType_Ready(&ReadyType) < 0) return NULL;
#define INTERN(var, text) if (var == NULL && (var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_capture_key, "_capture_key"); INTERN(s_passonly, "passonly");
    INTERN(s_skip_plan, "skip_plan"); INTERN(s_arm_args, "_arm_args"); INTERN(s_block, "block");
    INTERN(s_parent, "_parent"); INTERN(s_frame, "_frame"); INTERN(s_plan, "_plan");
    INTERN(s_stack, "stack"); INTERN(s_state, "_state"); INTERN(s_backend, "backend");
    INTERN(s_dunder_enter, "__enter__"); INTERN(s_dunder_exit, "__exit__");
#undef INTERN
    Py_INCREF(enter); Py_XSETREF(tr_enter, enter);
    Py_INCREF(exit_); Py_XSETREF(tr_exit, exit_);
    Py_INCREF(clean); Py_XSETREF(tr_clean, clean);
    Py_INCREF(blocks); Py_XSETREF(tr_blocks, blocks);
    Py_INCREF(block_type); Py_XSETREF(tr_block_type, block_type);
    Py_INCREF(plan_type); Py_XSETREF(tr_plan_type, plan_type);
    Py_INCREF(enter_ids); Py_XSETREF(tr_enter_ids, enter_ids);
    Py_INCREF(local); Py_XSETREF(tr_local, local);
    Py_INCREF(current); Py_XSETREF(tr_current, current);
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

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
        } else if (what == PyTrace_RETURN || what == PyTrace_EXCEPTION) {
            restore(a);                    /* the frame left the window without a skip */
        }
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
    if (!PyFrame_Check(frame)) { PyErr_SetString(PyExc_TypeError, "arm() needs a frame"); return NULL; }
    Armed *a = PyObject_New(Armed, &ArmedType);
    if (a == NULL) return NULL;
    Py_INCREF(frame);
    a->frame = frame;
    a->lo = lo; a->hi = hi; a->exit_unit = exit_unit; a->mode = mode;
    a->fired = 0; a->live = 1;
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
Py_ssize_t ilc_armed_count(void) { return 0; }

/* ------------------------------------------------------------------ 3.12 / 3.13 ---- */
#else

#define MAX_ARMED 256
static Armed *armed[MAX_ARMED];          /* strong references */
static Py_ssize_t n_armed = 0;

PyObject *ilc_arm(PyObject *frame, int lo, int hi, int exit_unit, int mode) {
    if (!PyFrame_Check(frame)) { PyErr_SetString(PyExc_TypeError, "arm() needs a frame"); return NULL; }
    if (n_armed >= MAX_ARMED) {
        PyErr_SetString(PyExc_RuntimeError, "interlace: too many traces armed at once (256)");
        return NULL;
    }
    Armed *a = PyObject_New(Armed, &ArmedType);
    if (a == NULL) return NULL;
    Py_INCREF(frame);
    a->frame = frame;
    a->lo = lo; a->hi = hi; a->exit_unit = exit_unit; a->mode = mode;
    a->fired = 0; a->live = 1;
    a->prev_func = NULL; a->prev_obj = NULL; a->saved_opcodes = 0; a->installed = 0;
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

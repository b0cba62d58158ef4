/* interlace hot path: the C half of interlace._chotpath (see _chotpath_impl.c). */
#ifndef INTERLACE_CHOTPATH_IMPL_H
#define INTERLACE_CHOTPATH_IMPL_H
#include <Python.h>

/* 1 where ilh_outermost's first frame ends every unwind of the C stack (x86-64 and aarch64
   Linux), 0 elsewhere (there it is a plain call). */
extern const int ILH_UNWIND_STOP;
/* fn: borrowed. Calls fn() from a native frame whose unwind information marks it as the
   outermost one. Returns a NEW reference, or NULL with the error set (e.g. GreenletExit). */
PyObject *ilh_outermost(PyObject *fn);

/* ---- ilh_call_below (h-sweep: a new worker greenlet's stack starts deep) ---- */
/* fn: borrowed. Calls fn() with `depth` bytes of this thread's C stack reserved below the
   caller, where the stack has room to spare for it (Linux); else a plain call. Returns a NEW
   reference, or NULL with the error set. */
PyObject *ilh_call_below(Py_ssize_t depth, PyObject *fn);
/* ---- end of ilh_call_below ---- */
#endif
